"""Plain-PyTorch twin of :mod:`lightning_flce.kernels.cross_entropy_shard` (same contract, same formulas).

It works on copies of row slices of the chunk in the softmax dtype (fp32; fp64 for fp64 logits): at most
``_SOFTMAX_TEMPORARY_BYTES`` of temporaries (about four ``[rows, V_local]`` tensors at once), whatever the
chunk's row count, so the chunk loop can size GEMM chunks for the GEMMs alone.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from lightning_flce.kernels import ShardRowStats, softmax_dtype
from lightning_flce.kernels.transform_torch import transform_backward, transform_slope, transformed_logits

_SOFTMAX_TEMPORARY_BYTES = 256 * 2**20


def _row_slices(n_rows: int, local_vocab: int, itemsize: int) -> List[slice]:
    rows = max(1, _SOFTMAX_TEMPORARY_BYTES // (4 * itemsize * max(local_vocab, 1)))
    return [slice(start, min(start + rows, n_rows)) for start in range(0, n_rows, rows)]


def _capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    return transformed_logits(logits.to(softmax_dtype(logits.dtype)), softcap)[0]


def shard_row_stats_torch(
    logits: torch.Tensor, local_target: torch.Tensor, *, softcap: float, with_z_sum: bool, with_stats: bool
) -> ShardRowStats:
    n_rows, local_vocab = logits.shape
    held = (local_target >= 0) & (local_target < local_vocab)
    safe_target = torch.where(held, local_target, 0).unsqueeze(1)

    dtype = softmax_dtype(logits.dtype)
    out = ShardRowStats.empty(
        n_rows, logits.device, with_z_sum=with_z_sum, with_stats=with_stats, dtype=dtype
    )
    for part in _row_slices(n_rows, local_vocab, dtype.itemsize):
        z = _capped(logits[part], softcap)
        row_max = z.amax(dim=1)
        # A row masked to -inf on this whole shard: sums of 0 relative to 0, not exp(-inf - -inf) = NaN.
        shift = torch.where(row_max == float("-inf"), 0.0, row_max)
        exp_shifted = (z - shift.unsqueeze(1)).exp_()
        out.max[part] = row_max
        out.sum_exp[part] = exp_shifted.sum(dim=1)
        out.z_target[part] = torch.where(held[part], z.gather(1, safe_target[part]).squeeze(1), 0.0)
        if with_z_sum:
            out.z_sum[part] = z.sum(dim=1)
        if with_stats:
            out.exp_z_sum[part] = (exp_shifted * torch.where(exp_shifted > 0, z, 0.0)).sum(dim=1)
            out.argmax[part] = z.argmax(dim=1)  # the first maximum
    return out


def shard_softmax_grad_torch(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    lse: torch.Tensor,
    p_coef: torch.Tensor,
    smoothing: Optional[torch.Tensor],
    target_coef: torch.Tensor,
    *,
    softcap: float,
) -> None:
    n_rows, local_vocab = logits.shape
    held = (local_target >= 0) & (local_target < local_vocab)
    safe_target = torch.where(held, local_target, 0).unsqueeze(1)
    target_coef = torch.where(held, target_coef, 0.0)
    for part in _row_slices(n_rows, local_vocab, softmax_dtype(logits.dtype).itemsize):
        z = _capped(logits[part], softcap)
        grad = (z - lse[part].unsqueeze(1)).exp_().mul_(p_coef[part].unsqueeze(1))
        if smoothing is not None:
            grad.sub_(smoothing[part].unsqueeze(1))
        grad.scatter_add_(1, safe_target[part], -target_coef[part].unsqueeze(1))
        transform_backward(grad, transform_slope(z, softcap))
        logits[part].copy_(grad)
