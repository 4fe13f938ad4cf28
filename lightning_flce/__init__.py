"""lightning_flce: fused linear cross-entropy for PyTorch Lightning.

The LM-head loss ``cross_entropy(hidden @ W.T, target)`` computed in chunks of tokens, so the
[N, V] logits never exist. Where things live:

- the op: :func:`fused_linear_cross_entropy`, :func:`fused_linear_cross_entropy_with_stats`
  (``functional.py``: API and checks; ``op.py``: chunk loop and custom ops);
- the per-chunk kernels: ``kernels/cross_entropy.py`` (Triton), ``kernels/cross_entropy_torch.py``;
- the dW accumulation: ``accumulate.py``;
- Lightning: :class:`FLCEMixin` (``mixin.py``), :class:`FLCEMemoryCallback` (``callbacks/memory.py``),
  models in ``models/``, data in ``data/``, the CLI in ``cli.py``.
"""

from lightning_flce.callbacks import FLCEMemoryCallback
from lightning_flce.functional import (
    FLCEOutput,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_with_stats,
)
from lightning_flce.mixin import FLCEMixin

__all__ = [
    "FLCEMemoryCallback",
    "FLCEMixin",
    "FLCEOutput",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_with_stats",
]

__version__ = "0.1.0"
