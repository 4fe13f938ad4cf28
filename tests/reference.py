"""Float64 reference for the op: F.cross_entropy on upcast logits, plus the z-loss term."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def reference_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    **options,
) -> torch.Tensor:
    """The op's definition in float64 (differentiable w.r.t. x, weight, bias). ``options``: ignore_index,
    reduction, label_smoothing, class_weight, lse_square_scale, softcap, as the op takes them."""
    logits = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    if options.get("class_weight") is not None:
        options["class_weight"] = options["class_weight"].double()
    return loss_of_logits(logits, target, **options)


def unfused_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    **options,
) -> torch.Tensor:
    """What users run without the op, in the inputs' dtype: logits from ``F.linear``, then an fp32
    cross-entropy (plus the z-loss term). The bar the op's low-precision errors are held to."""
    return loss_of_logits(F.linear(x, weight, bias).float(), target, **options)


def loss_of_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[torch.Tensor] = None,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    token_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Cross-entropy (``F.cross_entropy``'s options) plus the z-loss term, in the logits' dtype; "none" gives
    one loss per token in the target's shape. ``token_weight`` multiplies each token's loss (CE and z-loss);
    "mean" keeps F.cross_entropy's unweighted denominators."""
    if token_weight is not None:
        return _token_weighted(
            logits,
            target,
            token_weight,
            ignore_index,
            reduction,
            class_weight,
            **{"label_smoothing": label_smoothing, "lse_square_scale": lse_square_scale, "softcap": softcap},
        )
    token_shape = target.shape
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(
        logits,
        target,
        weight=class_weight,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    if lse_square_scale:
        valid = target != ignore_index
        z_loss = lse_square_scale * torch.logsumexp(logits, dim=-1).square() * valid
        if reduction == "mean":
            z_loss = z_loss.sum() / valid.sum()
        elif reduction == "sum":
            z_loss = z_loss.sum()
        loss = loss + z_loss
    return loss.view(token_shape) if reduction == "none" else loss


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    denom = expected.norm()
    diff = (actual - expected).norm()
    if denom == 0:
        return float(diff)
    return float(diff / denom)


def grads_of(fn, *tensors, grad_output=None):
    """Run fn(*tensors) -> loss, backprop grad_output (1 by default), return (loss, [grads])."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
    loss = fn(*leaves)
    if grad_output is None:
        grad_output = torch.ones_like(loss)
    (loss * grad_output.to(loss.dtype)).sum().backward()
    return loss.detach(), [t.grad if t is not None and t.requires_grad else None for t in leaves]


def assert_matches_reference(got, want, dtype: torch.dtype, tol: float) -> None:
    """``got`` and ``want`` are :func:`grads_of` results: the loss and every gradient the reference has are in
    ``dtype`` (the loss in its shape) and within a relative L2 error of ``tol``."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert loss.dtype == dtype and loss.shape == ref_loss.shape, (loss.dtype, loss.shape, ref_loss.shape)
    assert relative_error(loss, ref_loss) < tol, relative_error(loss, ref_loss)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        if ref_grad is not None:
            assert grad.dtype == dtype, (index, grad.dtype)
            assert relative_error(grad, ref_grad) < tol, (index, relative_error(grad, ref_grad))


def _token_weighted(logits, target, token_weight, ignore_index, reduction, class_weight, **options):
    per_token = loss_of_logits(
        logits, target, ignore_index=ignore_index, reduction="none", class_weight=class_weight, **options
    )
    weighted = per_token * token_weight.to(per_token.dtype)
    if reduction == "none":
        return weighted
    if reduction == "sum":
        return weighted.sum()
    # "mean": F.cross_entropy's denominators, without the token weights: the summed class weight of the valid
    # targets for the CE term, their count for the z-loss term (equal without class weights)
    valid = (target != ignore_index).reshape(-1)
    count = valid.sum()
    if class_weight is None or not options.get("lse_square_scale"):
        norm = (
            count
            if class_weight is None
            else class_weight[torch.where(valid, target.reshape(-1), 0)][valid].sum()
        )
        return weighted.sum() / norm
    ce = loss_of_logits(
        logits,
        target,
        ignore_index=ignore_index,
        reduction="none",
        class_weight=class_weight,
        label_smoothing=options["label_smoothing"],
        softcap=options["softcap"],
    )
    z = per_token - ce
    w = token_weight.to(per_token.dtype)
    ce_norm = class_weight[torch.where(valid, target.reshape(-1), 0)][valid].sum()
    return (ce * w).sum() / ce_norm + (z * w).sum() / count
