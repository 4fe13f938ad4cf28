"""Triton kernels of the vocab-parallel op's softmax: one rank's columns of a chunk, in two launches
around the all-reduces that make the row statistics global (``lightning_flce.parallel``).

- :func:`_shard_row_stats_kernel` reads each row once with an online softmax and writes the row's local
  maximum ``m``, ``sum_j exp(z_j - m)``, the target logit when this shard holds the target (0 otherwise),
  and on request ``sum_j z_j`` (label smoothing), ``sum_j exp(z_j - m) z_j`` and the first local argmax
  (statistics). The caller rescales the sums to the global maximum (``exp(m - M)``) before summing them
  over the ranks, so no second read of the logits is needed for the statistics.
- :func:`_shard_grad_kernel` reads each row once more and overwrites it with
  ``p_coef exp(z_j - lse) - smoothing - target_coef [j == target]`` (times ``1 - (z_j / c)^2`` with a
  softcap), given the global ``lse`` and the per-row coefficients.

One program per row, as :mod:`lightning_flce.kernels.cross_entropy` (whose launch configuration, softcap
and exp helpers these share). The chunk holds only non-ignored rows (the chunk loop drops the others).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_flce._compat import TRITON_INTERPRET
from lightning_flce.kernels import ShardRowStats
from lightning_flce.kernels.cross_entropy import default_launch_config
from lightning_flce.kernels.triton_math import (
    exp,
    load_transformed,
    online_lse_step,
    transform_backward,
    transform_logits,
)


@triton.jit
def _shard_row_stats_kernel(
    logits_ptr,  # [C, V_LOCAL] this shard's logits of the chunk (compute dtype)
    logits_row_stride,
    local_target_ptr,  # [C] int64: target - vocab_start (held here iff in [0, V_LOCAL))
    max_ptr,  # [C] fp32 out: local max of z
    sum_exp_ptr,  # [C] fp32 out: sum exp(z - max)
    z_target_ptr,  # [C] fp32 out: z at the target, 0 when another shard holds it
    z_sum_ptr,  # [C] fp32 out (only with HAS_SMOOTHING): sum z
    exp_z_sum_ptr,  # [C] fp32 out (only with COMPUTE_STATS): sum exp(z - max) z
    argmax_ptr,  # [C] int64 out (only with COMPUTE_STATS): first local index of the max
    softcap,
    V_LOCAL: tl.constexpr,  # constexpr: the interpreter cannot loop to a runtime bound
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_STATS: tl.constexpr,
    PRECISE: tl.constexpr,  # libdevice exp (fp32 logits on a GPU)
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    offsets = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    z_sum = 0.0
    exp_z_sum = 0.0
    best_idx = 0
    for start in range(0, V_LOCAL, BLOCK_V):
        cols = start + offsets
        mask = cols < V_LOCAL
        z, _ = load_transformed(row_ptr, cols, mask, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
        m_new, d, e, rescale, block_max = online_lse_step(z, m, d, PRECISE)
        # Masked lanes hold -inf; zero them before any product (0 * -inf is NaN).
        z_finite = tl.where(mask, z, 0.0)
        if HAS_SMOOTHING:
            z_sum += tl.sum(z_finite, 0)
        if COMPUTE_STATS:
            exp_z_sum = exp_z_sum * rescale + tl.sum(e * tl.where(e > 0.0, z, 0.0), 0)  # 0 * -inf is NaN
            # Strict '>' keeps the first maximum, as torch.argmax does.
            best_idx = tl.where(block_max > m, start + tl.argmax(z, 0).to(tl.int32), best_idx)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sum_exp_ptr + row, d)

    local_target = tl.load(local_target_ptr + row)
    held = (local_target >= 0) & (local_target < V_LOCAL)
    # Clamped so the load stays in the row; the value is used only where this shard holds the target.
    r_target = tl.load(row_ptr + tl.where(held, local_target, 0)).to(tl.float32)
    z_target, _ = transform_logits(r_target, True, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
    tl.store(z_target_ptr + row, tl.where(held, z_target, 0.0))
    if HAS_SMOOTHING:
        tl.store(z_sum_ptr + row, z_sum)
    if COMPUTE_STATS:
        tl.store(exp_z_sum_ptr + row, exp_z_sum)
        tl.store(argmax_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _shard_grad_kernel(
    logits_ptr,  # [C, V_LOCAL] this shard's logits of the chunk; overwritten with d loss / d logits
    logits_row_stride,
    local_target_ptr,  # [C] int64: target - vocab_start (never a local column when held elsewhere)
    lse_ptr,  # [C] fp32: the global log-sum-exp
    p_coef_ptr,  # [C] fp32: multiplier of the softmax
    smoothing_ptr,  # [C] fp32 (only with HAS_SMOOTHING): subtracted from every column
    target_coef_ptr,  # [C] fp32: subtracted at the target column (0 when held elsewhere)
    softcap,
    V_LOCAL: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    offsets = tl.arange(0, BLOCK_V)
    local_target = tl.load(local_target_ptr + row)
    lse = tl.load(lse_ptr + row)
    p_coef = tl.load(p_coef_ptr + row)
    target_coef = tl.load(target_coef_ptr + row)
    smoothing = 0.0
    if HAS_SMOOTHING:
        smoothing = tl.load(smoothing_ptr + row)
    for start in range(0, V_LOCAL, BLOCK_V):
        cols = start + offsets
        mask = cols < V_LOCAL
        z, capped = load_transformed(row_ptr, cols, mask, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
        grad = exp(z - lse, PRECISE) * p_coef - smoothing
        grad = tl.where(cols == local_target, grad - target_coef, grad)
        grad = transform_backward(grad, capped, mask, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
        tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _launch_args(logits: torch.Tensor):
    config = default_launch_config(logits.shape[1])
    extra = {} if config.num_stages is None else {"num_stages": config.num_stages}
    precise = logits.dtype == torch.float32 and not TRITON_INTERPRET
    return config, extra, precise


def shard_row_stats_triton(
    logits: torch.Tensor, local_target: torch.Tensor, *, softcap: float, with_z_sum: bool, with_stats: bool
) -> ShardRowStats:
    """Launch :func:`_shard_row_stats_kernel` (contract: :func:`lightning_flce.kernels.shard_row_stats`)."""
    n_rows, local_vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel needs unit stride along the vocabulary"

    out = ShardRowStats.empty(n_rows, logits.device, with_z_sum=with_z_sum, with_stats=with_stats)
    if n_rows == 0:
        return out
    config, extra, precise = _launch_args(logits)
    dummy = out.max  # pointer never read or written (its block is compiled out)
    _shard_row_stats_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        local_target,
        out.max,
        out.sum_exp,
        out.z_target,
        out.z_sum if with_z_sum else dummy,
        out.exp_z_sum if with_stats else dummy,
        out.argmax if with_stats else dummy,
        softcap,
        V_LOCAL=local_vocab,
        HAS_SMOOTHING=with_z_sum,
        HAS_SOFTCAP=softcap > 0.0,
        COMPUTE_STATS=with_stats,
        PRECISE=precise,
        BLOCK_V=config.block_v,
        num_warps=config.num_warps,
        **extra,
    )
    return out


def shard_softmax_grad_triton(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    lse: torch.Tensor,
    p_coef: torch.Tensor,
    smoothing: Optional[torch.Tensor],
    target_coef: torch.Tensor,
    *,
    softcap: float,
) -> None:
    """Launch :func:`_shard_grad_kernel` (contract: :func:`lightning_flce.kernels.shard_softmax_grad`)."""
    n_rows, local_vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel needs unit stride along the vocabulary"
    if n_rows == 0:
        return
    config, extra, precise = _launch_args(logits)
    _shard_grad_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        local_target,
        lse,
        p_coef,
        smoothing if smoothing is not None else lse,
        target_coef,
        softcap,
        V_LOCAL=local_vocab,
        HAS_SMOOTHING=smoothing is not None,
        HAS_SOFTCAP=softcap > 0.0,
        PRECISE=precise,
        BLOCK_V=config.block_v,
        num_warps=config.num_warps,
        **extra,
    )
