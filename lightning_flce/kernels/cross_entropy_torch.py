"""Plain-PyTorch twin of the Triton chunk kernel (same contract, same formulas; see
:mod:`lightning_flce.kernels.cross_entropy`). Serves the CPU and devices without Triton.

It works in the softmax dtype (fp32; fp64 for fp64 logits, which the Triton kernel does not take) on a
[C, V] copy of the chunk, so the chunk loop sizes its chunks for that workspace.
"""

from __future__ import annotations

import torch

from lightning_flce.kernels import ChunkOutputs, LossOptions, copy_gradient, softmax_dtype
from lightning_flce.kernels.transform_torch import transform_backward, transform_slope, transformed_logits


def cross_entropy_chunk_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    options: LossOptions,
    *,
    ce_scale: torch.Tensor,
    z_scale: torch.Tensor,
    compute_grad: bool,
    compute_stats: bool,
    grad_out: torch.Tensor = None,
) -> ChunkOutputs:
    n_rows, vocab = logits.shape
    eps = options.label_smoothing
    cap = options.softcap
    lam = options.lse_square_scale
    class_weight = options.class_weight

    valid = target != options.ignore_index
    safe_target = torch.where(valid, target, 0).unsqueeze(1)
    # the logits themselves for fp32 ones without a softcap: the gradient overwrites them in place below
    z, _ = transformed_logits(logits.to(softmax_dtype(logits.dtype)), cap)
    lse = torch.logsumexp(z, dim=1)
    z_target = z.gather(1, safe_target).squeeze(1)
    if class_weight is not None:
        w_target = class_weight[safe_target.squeeze(1)]
        w_total = options.class_weight_sum
    else:
        w_target = torch.ones_like(lse)
        w_total = torch.full_like(lse[:1], float(vocab))

    ce = (1.0 - eps) * w_target * (lse - z_target)
    if eps > 0.0:
        weighted_z_sum = z @ class_weight if class_weight is not None else z.sum(dim=1)
        ce = ce + eps / vocab * (w_total * lse - weighted_z_sum)
    ce_scale = ce_scale.to(z.dtype)
    z_scale = z_scale.to(z.dtype)
    loss = torch.where(valid, ce_scale * ce + z_scale * lam * lse.square(), 0.0)
    lse_out = torch.where(valid, lse, 0.0)

    correct = entropy = None
    if compute_stats:
        correct = (z.argmax(dim=1) == target) & valid
        probs = torch.softmax(z, dim=1)
        # p z with p = 0 counts 0, also where z = -inf (a masked logit), not NaN.
        entropy = torch.where(valid, lse - (probs * torch.where(probs > 0, z, 0.0)).sum(dim=1), 0.0)
        del probs

    if compute_grad:
        p_coef = ce_scale * (1.0 - eps) * w_target + z_scale * 2.0 * lam * lse
        if eps > 0.0:
            p_coef = p_coef + ce_scale * eps * w_total / vocab
        target_coef = ce_scale * (1.0 - eps) * w_target
        slope = transform_slope(z, cap)  # before z becomes the gradient
        # z becomes the gradient in place: exp(z - lse) * p_coef - smoothing - one-hot.
        grad = z.sub_(lse.unsqueeze(1)).exp_().mul_(p_coef.unsqueeze(1))
        if eps > 0.0:
            smooth = class_weight if class_weight is not None else torch.ones_like(grad[0])
            grad.sub_((ce_scale * eps / vocab).unsqueeze(-1) * smooth)
        grad.scatter_add_(1, safe_target, -target_coef.expand(n_rows).unsqueeze(1))
        transform_backward(grad, slope)
        grad.mul_(valid.unsqueeze(1))
        # over the logits (a no-op for fp32 ones: z is them), or into grad_out, which may be their own rows
        copy_gradient(grad, logits if grad_out is None else grad_out)
    return ChunkOutputs(loss, lse_out, correct, entropy)
