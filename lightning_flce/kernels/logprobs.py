"""Triton kernels: per-token log-probabilities and entropy of a chunk of logits, and their logit gradient for
per-row upstream gradients.

With the samplers' transform ``z = softcap(r) / T`` (``T`` per row or shared), ``p = softmax(z)``:

    log p_t = z_t - lse,        H = lse - sum_j p_j z_j
    d/dz_j  = g (δ_jt - p_j) - h p_j (log p_j + H)         (g = d/d log p_t, h = d/dH)
    d/dr_j  = d/dz_j (1 - (softcap(r_j) / c)^2) / T

Two kernels, one program per row each: :func:`_row_stats_kernel` streams the row once (an online log-sum-exp,
with ``sum exp(z - m) z`` for the entropy), and :func:`_grad_kernel` streams it again, last block first, and
overwrites it with ``d/dr`` (or writes the 16-bit gradient of fp32 logits into each row's second half, as the
cross-entropy kernel does: :func:`~lightning_flce.kernels.gradient_in_logits_rows`). Between them the caller
may compute g and h from the row statistics (a per-token loss of log p and H: the policy losses). The chunk
holds only rows with targets in [0, V) (the engine drops ignored rows before the GEMM).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from lightning_flce.kernels import is_gradient_in_logits_rows
from lightning_flce.kernels.cross_entropy import LaunchConfig, default_launch_config, exp_precision
from lightning_flce.kernels.triton_math import exp, load_transformed, log, online_lse_step, transform_backward


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # [C, V] chunk logits (compute dtype, or fp32 logits of 16-bit GEMMs)
    logits_row_stride,
    target_ptr,  # [C] int64 in [0, V)
    inv_temperature_ptr,  # fp32 1 / T, [1] or [C]
    temperature_stride,  # 0 for a shared temperature, 1 per row
    logprobs_ptr,  # [C] fp32 out: log p_target
    lse_ptr,  # [C] fp32 out: log-sum-exp of z
    entropy_ptr,  # [C] fp32 out (only with WITH_ENTROPY)
    V: tl.constexpr,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row)
    inv_t = tl.load(inv_temperature_ptr + row * temperature_stride)
    offsets = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    exp_z_sum = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + offsets
        mask = cols < V
        z, _ = load_transformed(row_ptr, cols, mask, softcap, inv_t, HAS_SOFTCAP)
        m_new, d, e, rescale, _ = online_lse_step(z, m, d, PRECISE)
        if WITH_ENTROPY:
            exp_z_sum = exp_z_sum * rescale + tl.sum(e * tl.where(e > 0.0, z, 0.0), 0)  # 0 * -inf is NaN
        m = m_new
    lse = m + log(d, PRECISE)
    z_target, _ = load_transformed(row_ptr, target, True, softcap, inv_t, HAS_SOFTCAP)
    tl.store(logprobs_ptr + row, z_target - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, lse - exp_z_sum / d)


@triton.jit
def _grad_kernel(
    logits_ptr,  # [C, V] chunk logits
    logits_row_stride,
    grad_ptr,  # [C, V] out: d/dr (logits_ptr itself, or the 16-bit view of the fp32 rows' second halves)
    grad_row_stride,
    target_ptr,  # [C] int64 in [0, V)
    inv_temperature_ptr,  # fp32 [1] or [C]
    temperature_stride,
    lse_ptr,  # [C] fp32: from the row statistics
    entropy_ptr,  # [C] fp32 (read only with HAS_ENTROPY_GRAD)
    grad_logprobs_ptr,  # fp32 g, [1] or [C]
    grad_entropy_ptr,  # fp32 h, [1] or [C] (read only with HAS_ENTROPY_GRAD)
    coef_stride,  # 0 for shared g and h, 1 per row
    V: tl.constexpr,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    PRECISE_GRAD: tl.constexpr,
    GRAD_IN_ROW: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LAST_BLOCK_START: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    target = tl.load(target_ptr + row)
    inv_t = tl.load(inv_temperature_ptr + row * temperature_stride)
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_logprobs_ptr + row * coef_stride)
    if HAS_ENTROPY_GRAD:
        h = tl.load(grad_entropy_ptr + row * coef_stride)
        h_shift = tl.load(entropy_ptr + row) - lse  # log p_j + H = z_j + (H - lse)
    offsets = tl.arange(0, BLOCK_V)
    # Backwards over the row: its last blocks, read last by the statistics kernel, are the likeliest in L2.
    for done in range(0, V, BLOCK_V):
        start = LAST_BLOCK_START - done
        cols = start + offsets
        mask = cols < V
        z, capped = load_transformed(row_ptr, cols, mask, softcap, inv_t, HAS_SOFTCAP)
        p = exp(z - lse, PRECISE_GRAD)
        coef = g
        if HAS_ENTROPY_GRAD:
            coef = g + h * (tl.where(p > 0.0, z, 0.0) + h_shift)  # z = -inf has p = 0: no 0 * inf
        grad = tl.where(p > 0.0, -p * coef, 0.0)
        grad = tl.where(cols == target, grad + g, grad)
        grad = transform_backward(grad, capped, mask, softcap, inv_t, HAS_SOFTCAP)
        if GRAD_IN_ROW:
            # This block's 16-bit values land in fp32 columns [(V + cols) / 2], at or past the block's start:
            # read by now, once every warp has loaded its part of it.
            tl.debug_barrier()
        tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _stride(values: torch.Tensor) -> int:
    return 1 if values.numel() > 1 else 0


def logprob_row_stats_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    inv_temperature: torch.Tensor,
    softcap: float,
    with_entropy: bool,
    config: Optional[LaunchConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """See :func:`lightning_flce.kernels.logprobs_torch.logprob_row_stats_torch` (fp32 outputs); ``config``
    overrides :func:`~lightning_flce.kernels.cross_entropy.default_launch_config`."""
    n_rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel needs unit stride along the vocabulary"
    device = logits.device
    logprobs = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    entropy = torch.empty(n_rows if with_entropy else 0, dtype=torch.float32, device=device)
    if n_rows:
        config = config or default_launch_config(vocab)
        inv_temperature = inv_temperature.float()
        _row_stats_kernel[(n_rows,)](
            logits,
            logits.stride(0),
            target,
            inv_temperature,
            _stride(inv_temperature),
            logprobs,
            lse,
            entropy if with_entropy else lse,  # a dummy pointer without WITH_ENTROPY
            vocab,
            softcap,
            HAS_SOFTCAP=softcap > 0.0,
            WITH_ENTROPY=with_entropy,
            PRECISE=exp_precision(logits.dtype, None)[0],
            BLOCK_V=config.block_v,
            num_warps=config.num_warps,
        )
    return logprobs, lse, entropy if with_entropy else None


def logprob_grad_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    lse: torch.Tensor,
    entropy: Optional[torch.Tensor],
    grad_logprobs: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    inv_temperature: torch.Tensor,
    softcap: float,
    grad_out: Optional[torch.Tensor] = None,
    config: Optional[LaunchConfig] = None,
) -> None:
    """See :func:`lightning_flce.kernels.logprobs_torch.logprob_grad_torch`; ``config`` as in
    :func:`logprob_row_stats_triton`."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return
    assert logits.stride(1) == 1, "the kernel needs unit stride along the vocabulary"
    grad_out = logits if grad_out is None else grad_out
    assert grad_out.shape == logits.shape and grad_out.stride(1) == 1
    grad_in_row = is_gradient_in_logits_rows(logits, grad_out)  # raises for any other overlap
    has_entropy_grad = grad_entropy is not None
    g = grad_logprobs.float()
    h = grad_entropy.float() if has_entropy_grad else g
    if has_entropy_grad and h.numel() != g.numel():  # one stride for both
        g, h = torch.broadcast_tensors(g, h)
        g, h = g.contiguous(), h.contiguous()
    inv_temperature = inv_temperature.float()
    config = config or default_launch_config(vocab)
    _grad_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        grad_out,
        grad_out.stride(0),
        target,
        inv_temperature,
        _stride(inv_temperature),
        lse,
        entropy if has_entropy_grad else lse,  # a dummy pointer without HAS_ENTROPY_GRAD
        g,
        h,
        _stride(g),
        vocab,
        softcap,
        HAS_SOFTCAP=softcap > 0.0,
        HAS_ENTROPY_GRAD=has_entropy_grad,
        PRECISE_GRAD=exp_precision(logits.dtype, grad_out.dtype)[1],
        GRAD_IN_ROW=grad_in_row,
        BLOCK_V=config.block_v,
        LAST_BLOCK_START=(vocab - 1) // config.block_v * config.block_v,
        num_warps=config.num_warps,
    )
