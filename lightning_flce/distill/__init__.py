"""Logit distillation on the fused heads, without either side's [N, V] logits:
:func:`fused_linear_distillation` and :class:`FusedLinearDistillationLoss`, and for a teacher given by its cached
top k :func:`fused_linear_distillation_from_top_k` (``functional.py``; the custom ops in
``op.py``), and :func:`fused_linear_top_k`, a head's top k per token, what such a cache holds (``top_k.py``). The chunk loss is :mod:`lightning_flce.losses.distillation`, its kernels ``distill_chunk`` of each
backend (:mod:`lightning_flce.kernels.distill_torch`, :mod:`lightning_flce.kernels.distill`)."""

from lightning_flce.distill.functional import (
    Divergence,
    FusedLinearDistillationLoss,
    fused_linear_distillation,
    fused_linear_distillation_from_top_k,
)
from lightning_flce.distill.top_k import TopKOutput, fused_linear_top_k

__all__ = [
    "Divergence",
    "FusedLinearDistillationLoss",
    "TopKOutput",
    "fused_linear_distillation",
    "fused_linear_distillation_from_top_k",
    "fused_linear_top_k",
]
