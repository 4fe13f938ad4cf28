"""Logit distillation on the fused heads, without either side's [N, V] logits:
:func:`fused_linear_distillation` and :class:`FusedLinearDistillationLoss` (``functional.py``; the custom ops in
``op.py``). The chunk loss is :mod:`lightning_flce.losses.distillation`, its kernels ``distill_chunk`` of each
backend (:mod:`lightning_flce.kernels.distill_torch`, :mod:`lightning_flce.kernels.distill`)."""

from lightning_flce.distill.functional import (
    Divergence,
    FusedLinearDistillationLoss,
    fused_linear_distillation,
)

__all__ = ["Divergence", "FusedLinearDistillationLoss", "fused_linear_distillation"]
