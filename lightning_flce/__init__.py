"""lightning_flce: fused linear cross-entropy for PyTorch Lightning.

The LM-head loss ``cross_entropy(hidden @ W.T, target)`` computed in chunks, so the [N, V] logits
never exist. Public API:

- :func:`fused_linear_cross_entropy` / :func:`fused_linear_cross_entropy_with_stats` — the op.
- :class:`FLCEMixin` — LightningModule mixin that computes the LM loss with the op.
- :class:`FLCEMemoryCallback` — Lightning callback logging memory per step.
"""

from lightning_flce.functional import (
    FLCEOutput,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_with_stats,
)

__all__ = [
    "FLCEOutput",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_with_stats",
]

__version__ = "0.1.0"
