"""lightning_flce: fused linear cross-entropy for PyTorch Lightning.

The LM-head loss ``cross_entropy(hidden @ W.T, target)`` computed in chunks of tokens, so the
[N, V] logits never exist. Where things live:

- the op: :func:`fused_linear_cross_entropy`, :func:`fused_linear_cross_entropy_with_stats`
  (``functional.py``: the API; ``options.py``: the options record; ``per_token.py``: the per-token inputs;
  ``validation.py``: input checks; ``op.py``: the custom ops; ``engine.py``: the chunk engine);
- the chunk losses (plug-ins of the engine; interface in ``chunk_loss.py``): ``losses/``;
- reinforcement learning: :func:`fused_linear_logprobs`, :func:`fused_linear_policy_loss` and its module
  :class:`FusedLinearPolicyLoss` (``rl/``: the APIs and their custom ops);
- distillation: :func:`fused_linear_distillation` and its module :class:`FusedLinearDistillationLoss`, and
  :func:`fused_linear_distillation_from_top_k` for a cached teacher's top k, and :func:`fused_linear_top_k` that
  makes such a cache (``distill/``: the APIs and their custom ops); its Lightning side: :func:`teacher_top_k`,
  :class:`TeacherTopKModule` (``models/teacher_cache.py``), :class:`TopKCacheWriter` (``callbacks/``) and
  :class:`TopKCacheDataset` (``data/``);
- the per-chunk kernels and their backends: ``kernels/`` (registry in ``kernels/__init__.py``);
- the dW accumulation: ``accumulate.py``;
- the head sharded over V across ranks: ``parallel/`` (the op, the ranks' agreement, ``VocabParallelHead``);
  FSDP2 helpers: ``fsdp.py``; PEFT LoRA heads: ``adapters.py``;
- the loss inside the head module's own forward call (plain PyTorch, Fabric): :class:`FLCEHeadLoss` (``head.py``);
- Lightning: :class:`FLCEMixin` (``mixin.py`` and its parts ``mixin_step.py``, ``mixin_eval.py``, ``mixin_rl.py``,
  ``mixin_checks.py``; with ``normalization.py``, ``head_discovery.py``,
  ``eval_metrics.py``), :class:`FLCEMemoryCallback`
  (``callbacks/``), models in ``models/`` (distillation's LightningModule: :class:`DistillationModule`,
  ``models/distill.py``), data in ``data/``, the CLI in ``cli.py`` and its configs in ``configs/``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_flce._version import __version__ as __version__

# Every export loads on first use: the op does not import lightning, and `import lightning_flce` (which
# `lightning-flce --version` and `configs` run) does not import torch. Static checkers read the imports below
# instead of ``__getattr__``.
_LAZY = {
    "DistillationModule": "lightning_flce.models.distill",
    "FLCEHeadLoss": "lightning_flce.head",
    "FLCEMemoryCallback": "lightning_flce.callbacks",
    "FLCEMixin": "lightning_flce.mixin",
    "FLCEOptions": "lightning_flce.options",
    "FLCEOutput": "lightning_flce.functional",
    "FusedLinearDistillationLoss": "lightning_flce.distill",
    "FusedLinearPolicyLoss": "lightning_flce.rl",
    "LogProbsOutput": "lightning_flce.rl",
    "PolicyLossOutput": "lightning_flce.rl",
    "TeacherTopKModule": "lightning_flce.models.teacher_cache",
    "TopKCacheDataModule": "lightning_flce.data.top_k_cache",
    "TopKCacheDataset": "lightning_flce.data.top_k_cache",
    "TopKCacheWriter": "lightning_flce.callbacks.top_k_cache",
    "TopKOutput": "lightning_flce.distill",
    "fused_linear_cross_entropy": "lightning_flce.functional",
    "fused_linear_cross_entropy_with_stats": "lightning_flce.functional",
    "fused_linear_distillation": "lightning_flce.distill",
    "fused_linear_distillation_from_top_k": "lightning_flce.distill",
    "fused_linear_logprobs": "lightning_flce.rl",
    "fused_linear_policy_loss": "lightning_flce.rl",
    "fused_linear_top_k": "lightning_flce.distill",
    "teacher_top_k": "lightning_flce.models.teacher_cache",
}

if TYPE_CHECKING:
    from lightning_flce.callbacks import FLCEMemoryCallback
    from lightning_flce.callbacks.top_k_cache import TopKCacheWriter
    from lightning_flce.data.top_k_cache import TopKCacheDataModule, TopKCacheDataset
    from lightning_flce.distill import (
        FusedLinearDistillationLoss,
        TopKOutput,
        fused_linear_distillation,
        fused_linear_distillation_from_top_k,
        fused_linear_top_k,
    )
    from lightning_flce.functional import (
        FLCEOutput,
        fused_linear_cross_entropy,
        fused_linear_cross_entropy_with_stats,
    )
    from lightning_flce.head import FLCEHeadLoss
    from lightning_flce.mixin import FLCEMixin
    from lightning_flce.models.distill import DistillationModule
    from lightning_flce.models.teacher_cache import TeacherTopKModule, teacher_top_k
    from lightning_flce.options import FLCEOptions
    from lightning_flce.rl import (
        FusedLinearPolicyLoss,
        LogProbsOutput,
        PolicyLossOutput,
        fused_linear_logprobs,
        fused_linear_policy_loss,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_flce' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "DistillationModule",
    "FLCEHeadLoss",
    "FLCEMemoryCallback",
    "FLCEMixin",
    "FLCEOptions",
    "FLCEOutput",
    "FusedLinearDistillationLoss",
    "FusedLinearPolicyLoss",
    "LogProbsOutput",
    "PolicyLossOutput",
    "TeacherTopKModule",
    "TopKCacheDataModule",
    "TopKCacheDataset",
    "TopKCacheWriter",
    "TopKOutput",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_with_stats",
    "fused_linear_distillation",
    "fused_linear_distillation_from_top_k",
    "fused_linear_logprobs",
    "fused_linear_policy_loss",
    "fused_linear_top_k",
    "teacher_top_k",
]
