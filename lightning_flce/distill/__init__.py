"""Logit distillation on the fused heads, without either side's [N, V] logits:
:func:`fused_linear_distillation` and :class:`FusedLinearDistillationLoss`, and for a teacher given by its cached
top k :func:`fused_linear_distillation_from_top_k` (``functional.py``; the custom ops in
``op.py``). The chunk loss is :mod:`lightning_flce.losses.distillation`, its kernels ``distill_chunk`` of each
backend (:mod:`lightning_flce.kernels.distill_torch`, :mod:`lightning_flce.kernels.distill`)."""

from lightning_flce.distill.functional import (
    Divergence,
    FusedLinearDistillationLoss,
    fused_linear_distillation,
    fused_linear_distillation_from_top_k,
)

__all__ = [
    "Divergence",
    "FusedLinearDistillationLoss",
    "fused_linear_distillation",
    "fused_linear_distillation_from_top_k",
]
