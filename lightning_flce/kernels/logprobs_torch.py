"""Plain-PyTorch twins of the log-probability kernels (:mod:`lightning_flce.kernels.logprobs`; same contracts,
same formulas), for the CPU, devices without Triton, and fp64.

The logits are transformed as samplers do: ``z = softcap(r) / T``, with its derivative
``dz/dr = (1 - (softcap(r) / c)^2) / T`` (the pair of :mod:`~lightning_flce.kernels.transform_torch`). Both work
in the softmax dtype (fp32; fp64 for fp64 logits) on [C, V] copies of the chunk (:data:`WORKSPACE_COPIES` of
them at most).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.kernels import copy_gradient, softmax_dtype
from lightning_flce.kernels.transform_torch import transform_backward, transform_slope, transformed_logits

#: [C, V] softmax-dtype copies the gradient pass holds at once (the capped logits, their probabilities, a temporary).
WORKSPACE_COPIES = 4


def logprob_row_stats_torch(
    logits: Tensor, target: Tensor, *, inv_temperature: Tensor, softcap: float, with_entropy: bool
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Per row of a [C, V] chunk (targets in [0, V)): ``(log p_target, lse, entropy)`` of ``softmax(z)``, [C] each
    in the softmax dtype (entropy None unless ``with_entropy``)."""
    z, _ = transformed_logits(logits.to(softmax_dtype(logits.dtype)), softcap, inv_temperature)
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
    logp, capped = transformed_logits(logits.to(softmax_dtype(logits.dtype)), softcap, inv_temperature)
    logp.sub_(lse.unsqueeze(1))  # log p_j (in place: z is the temperature's new product, not the logits)
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
    transform_backward(grad, transform_slope(capped, softcap), inv_temperature)
    del capped
    copy_gradient(grad, logits if grad_out is None else grad_out)
