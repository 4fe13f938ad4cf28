"""Plain-PyTorch twins of the log-probability kernels (:mod:`lightning_flce.kernels.logprobs`; same contracts,
same formulas), for the CPU, devices without Triton, and fp64.

The logits are transformed as samplers do: ``z = softcap(r) / T`` (:func:`transform_logits`), with its
derivative ``dz/dr = (1 - (softcap(r) / c)^2) / T`` (:func:`transform_backward`), written once here for both
kernels. Both work in the softmax dtype (fp32; fp64 for fp64 logits) on [C, V] copies of the chunk
(:data:`WORKSPACE_COPIES` of them at most).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.kernels import copy_gradient, softmax_dtype

#: [C, V] softmax-dtype copies the gradient pass holds at once (the capped logits, their probabilities, a temporary).
WORKSPACE_COPIES = 4


def softcapped(logits: Tensor, softcap: float) -> Tensor:
    """``c tanh(r / c)`` (``softcap`` 0.0: off) of ``logits`` as a new softmax-dtype tensor."""
    capped = logits.to(softmax_dtype(logits.dtype), copy=True)
    if softcap > 0.0:
        capped = torch.tanh(capped.div_(softcap)).mul_(softcap)
    return capped


def transform_logits(capped: Tensor, inv_temperature: Tensor) -> Tensor:
    """``z = softcap(r) / T`` from :func:`softcapped` values; ``inv_temperature`` [1] or [C]."""
    return capped * inv_temperature.to(capped.dtype).reshape(-1, 1)


def transform_backward(grad_z: Tensor, capped: Tensor, inv_temperature: Tensor, softcap: float) -> Tensor:
    """``d/dr`` from ``d/dz`` (in place): times ``1 / T`` and the softcap's ``1 - (softcap(r) / c)^2``."""
    grad_z.mul_(inv_temperature.to(grad_z.dtype).reshape(-1, 1))
    if softcap > 0.0:
        grad_z.mul_((capped / softcap).square_().neg_().add_(1.0))
    return grad_z


def logprob_row_stats_torch(
    logits: Tensor, target: Tensor, *, inv_temperature: Tensor, softcap: float, with_entropy: bool
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Per row of a [C, V] chunk (targets in [0, V)): ``(log p_target, lse, entropy)`` of ``softmax(z)``, [C] each
    in the softmax dtype (entropy None unless ``with_entropy``)."""
    z = transform_logits(softcapped(logits, softcap), inv_temperature)
    lse = torch.logsumexp(z, dim=1)
    logprobs = z.gather(1, target.unsqueeze(1)).squeeze(1) - lse
    entropy = None
    if with_entropy:
        probs = z.sub(lse.unsqueeze(1)).exp_()
        # p z with p = 0 counts 0, also where z = -inf (a masked logit), not NaN.
        entropy = lse - (probs * torch.where(probs > 0, z, 0.0)).sum(dim=1)
    return logprobs, lse, entropy


def logprob_grad_torch(
    logits: Tensor,
    target: Tensor,
    *,
    lse: Tensor,
    entropy: Optional[Tensor],
    grad_logprobs: Tensor,
    grad_entropy: Optional[Tensor],
    inv_temperature: Tensor,
    softcap: float,
    grad_out: Optional[Tensor] = None,
) -> None:
    """Write ``d/dr`` of ``sum_rows g log p_target + h H`` over ``logits`` (or into ``grad_out``, which may be
    :func:`~lightning_flce.kernels.gradient_in_logits_rows` of them): per row
    ``d/dz_j = g (δ_jt - p_j) - h p_j (log p_j + H)``, then :func:`transform_backward`. ``grad_logprobs`` (g),
    ``grad_entropy`` (h; None: no entropy term), ``lse`` and ``entropy`` (H) are [C] (g, h may be [1])."""
    capped = softcapped(logits, softcap)
    logp = transform_logits(capped, inv_temperature).sub_(lse.unsqueeze(1))  # log p_j
    probs = logp.exp()
    g = grad_logprobs.to(probs.dtype).reshape(-1, 1)
    if grad_entropy is not None:
        h = grad_entropy.to(probs.dtype).reshape(-1, 1)
        coef = logp.add_(entropy.unsqueeze(1)).mul_(h).add_(g)  # g + h (log p_j + H)
        grad = torch.where(probs > 0, probs.mul_(coef), 0.0).neg_()  # p = 0: 0, not 0 * -inf
    else:
        del logp
        grad = probs.mul_(g).neg_()
    grad.scatter_add_(1, target.unsqueeze(1), g.expand(grad.shape[0], 1))
    transform_backward(grad, capped, inv_temperature, softcap)
    del capped
    copy_gradient(grad, logits if grad_out is None else grad_out)
