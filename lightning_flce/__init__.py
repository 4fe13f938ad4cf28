"""lightning_flce: fused linear cross-entropy for PyTorch Lightning.

The LM-head loss ``cross_entropy(hidden @ W.T, target)`` computed in chunks of tokens, so the
[N, V] logits never exist. Where things live:

- the op: :func:`fused_linear_cross_entropy`, :func:`fused_linear_cross_entropy_with_stats`
  (``functional.py``: API and checks; ``op.py``: chunk loop and custom ops);
- the per-chunk kernels: ``kernels/cross_entropy.py`` (Triton), ``kernels/cross_entropy_torch.py``
  (its PyTorch twin), ``kernels/cross_entropy_shard*.py`` (the vocab-parallel softmax), ``kernels/scale.py``;
- the dW accumulation: ``accumulate.py``;
- the head sharded over V across ranks: ``parallel.py`` (``vocab_parallel_fused_linear_cross_entropy``,
  ``VocabParallelHead``);
- Lightning: :class:`FLCEMixin` (``mixin.py``; the loss inside the head's own forward, for FSDP/ZeRO-3 and
  Hugging Face heads: ``head.py``), :class:`FLCEMemoryCallback` (``callbacks/memory.py``), models in
  ``models/``, data in ``data/``, the CLI in ``cli.py``.
"""

import importlib

from lightning_flce.functional import (
    FLCEOutput,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_with_stats,
)

# The Lightning pieces load on first use, so the op alone does not import lightning.
_LAZY = {"FLCEMixin": "lightning_flce.mixin", "FLCEMemoryCallback": "lightning_flce.callbacks"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_flce' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = [
    "FLCEMemoryCallback",
    "FLCEMixin",
    "FLCEOutput",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_with_stats",
]

__version__ = "0.1.0"
