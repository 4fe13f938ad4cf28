"""Triton kernel: cross-entropy loss, LSE and d loss / d logits for one chunk of logits, in place.

One program per row. Pass 1 streams the row once with an online softmax (running max ``m`` and
``d = sum(exp(z - m))``), collecting what the loss needs: the smoothing term ``sum(w_j z_j)``, and for
the optional statistics the argmax and ``sum(exp(z - m) z)`` (entropy = lse - E_p[z]). Pass 2 streams
the row again, last block first, and overwrites it with the gradient, so the chunk needs no second
[C, V] buffer. The 16-bit gradient of fp32 logits goes to the second half of each row's own bytes
(:func:`~lightning_flce.kernels.gradient_in_logits_rows`): the blocks it overwrites there have been read by
then, and a barrier per block keeps every warp's loads of a block before any warp's stores.

With logits ``z`` (after the optional softcap ``z = c tanh(r / c)``), target ``t``, class weights
``w`` (1 without), smoothing ``eps`` and z-loss scale ``lam``, a row's terms are

    ce     = (1 - eps) w_t (lse - z_t) + eps / V * (W lse - sum_j w_j z_j),     W = sum_j w_j
    z_loss = lam lse^2
    d/dz_j = ce_scale ((1 - eps) w_t + eps W / V) p_j - ce_scale eps w_j / V - ce_scale (1 - eps) w_t [j == t]
             + z_scale 2 lam lse p_j

which is ``F.cross_entropy(..., weight=w, label_smoothing=eps)`` term by term; the softcap adds the
factor ``1 - (z / c)^2``. Rows whose target is ``ignore_index`` skip both passes and write zeros.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from lightning_flce._compat import TRITON_INTERPRET
from lightning_flce.kernels import ChunkOutputs, LossOptions, is_gradient_in_logits_rows
from lightning_flce.kernels.triton_math import (
    exp,
    load_transformed,
    log,
    online_lse_step,
    transform_backward,
    transform_logits,
)

# Elements of a row handled per loop iteration, 32 per thread (one warp per 1024): more loads in flight per
# thread. H200 sweep (benchmarks/tune_ce_kernel.py, results/*_run14_*): 13-23% less kernel time than 8192
# on 32 warps at the benchmark chunk shapes (67-74% of the read+write floor vs 56-58%).
_MAX_BLOCK_V = 16384
_ELEMENTS_PER_WARP = 1024


class LaunchConfig(NamedTuple):
    """Launch parameters of :func:`_cross_entropy_chunk_kernel` (``benchmarks/tune_ce_kernel.py`` sweeps them)."""

    block_v: int
    num_warps: int
    num_stages: Optional[int] = None  # None: Triton's default


def default_launch_config(vocab: int) -> LaunchConfig:
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    return LaunchConfig(block_v, max(4, block_v // _ELEMENTS_PER_WARP))


def exp_precision(logits_dtype: torch.dtype, grad_dtype: Optional[torch.dtype]) -> Tuple[bool, bool]:
    """(first pass, gradient pass): whether each pass's exponentials use libdevice's exp (correctly rounded
    within an ulp, ~10 instructions) rather than ``tl.exp`` (the GPU's ``ex2.approx`` of ``x log2(e)``: a
    relative error of ~|x| 6e-8 + 2^-22). 16-bit logits: neither (their own rounding is 2^-9 / 2^-12). fp32
    logits: the first pass always (the LSE and loss are fp32 outputs; the fast exp there saved 0.1-3% of the
    kernel in run88, inside the op's spread); the gradient pass only where the gradient is fp32 (``grad_dtype``
    None: no gradient): a 16-bit gradient is rounded far more coarsely than the fast exp errs, and the kernel
    runs 1-5% faster with the same errors (``benchmarks/experiments/chunk_kernel_exp.py``, run88). The
    interpreter has no libdevice."""
    if TRITON_INTERPRET or logits_dtype != torch.float32:
        return False, False
    return True, grad_dtype is None or grad_dtype == torch.float32


@triton.jit
def _cross_entropy_chunk_kernel(
    logits_ptr,  # [C, V] chunk logits (compute dtype, or fp32 logits of 16-bit GEMMs)
    logits_row_stride,
    grad_ptr,  # [C, V] out: d loss / d logits (logits_ptr itself for the in-place gradient, or the 16-bit
    # view of each fp32 row's second half: GRAD_IN_ROW), own dtype
    grad_row_stride,
    target_ptr,  # [C] int64, already validated to be in [0, V) or ignore_index
    class_weight_ptr,  # [V] fp32 (read only with HAS_CLASS_WEIGHT)
    class_weight_sum_ptr,  # [1] fp32 sum of class weights (read only with HAS_CLASS_WEIGHT)
    ce_scale_ptr,  # fp32 multiplier of the CE term, [1] or [C]
    z_scale_ptr,  # fp32 multiplier of the z-loss term, [1] or [C]
    scale_stride,  # 0 for a shared scale, 1 for per-row scales
    loss_ptr,  # [C] fp32 out: scaled loss per row
    lse_ptr,  # [C] fp32 out
    correct_ptr,  # [C] int8 out (only with COMPUTE_STATS)
    entropy_ptr,  # [C] fp32 out (only with COMPUTE_STATS)
    tile_max_ptr,  # [C, TILES] fp32: the logits GEMM's per-tile row maxima (read only with TILE_LSE)
    tile_sum_ptr,  # [C, TILES] fp32: sum(exp(z - max)) per tile
    tile_row_stride,
    target_logit_ptr,  # [C] fp32: the GEMM's target logits, softcap applied (read only with TARGET_LOGIT)
    V: tl.constexpr,  # constexpr: fixed per model, and the interpreter cannot loop to a runtime bound
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    HAS_CLASS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    COMPUTE_STATS: tl.constexpr,
    PRECISE: tl.constexpr,  # libdevice exp/log in the first pass (fp32 logits on a GPU)
    PRECISE_GRAD: tl.constexpr,  # libdevice exp in the gradient pass (an fp32 gradient on a GPU)
    GRAD_IN_ROW: tl.constexpr,  # grad_ptr is the 16-bit view of the fp32 rows' second halves
    TILE_LSE: tl.constexpr,  # the LSE from the GEMM's tile partials, no first pass (no smoothing, no stats)
    TARGET_LOGIT: tl.constexpr,  # with TILE_LSE: z_target from target_logit_ptr, not from the row
    RELATIVE: tl.constexpr,  # with TARGET_LOGIT: the row holds z - its tile's max (tile_max_ptr) in 16 bits
    TILES: tl.constexpr,
    TILES_BLOCK: tl.constexpr,  # partials per iteration: TILES rounded up to a power of two, at most BLOCK_V
    TILE_N: tl.constexpr,  # the tiles' width (columns per partial; with RELATIVE, BLOCK_V is a multiple of it)
    BLOCK_V: tl.constexpr,
    LAST_BLOCK_START: tl.constexpr,  # (V - 1) // BLOCK_V * BLOCK_V
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    target = tl.load(target_ptr + row)
    offsets = tl.arange(0, BLOCK_V)

    if target == ignore_index:
        if COMPUTE_GRAD:
            for start in range(0, V, BLOCK_V):
                cols = start + offsets
                zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
                tl.store(grad_row_ptr + cols, zeros, mask=cols < V)
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if COMPUTE_STATS:
            tl.store(correct_ptr + row, 0)
            tl.store(entropy_ptr + row, 0.0)
    else:
        # Pass 1: online logsumexp (+ smoothing and statistics terms); with TILE_LSE over the GEMM's partials
        # (TILES values a row instead of V).
        m = float("-inf")
        d = 0.0
        weighted_z_sum = 0.0
        exp_z_sum = 0.0
        best = float("-inf")
        best_idx = 0
        tile_row = row * tile_row_stride
        if TILE_LSE:
            for start in range(0, TILES, TILES_BLOCK):
                cols = start + tl.arange(0, TILES_BLOCK)
                mask = cols < TILES
                part_max = tl.load(tile_max_ptr + tile_row + cols, mask=mask, other=float("-inf"))
                part_sum = tl.load(tile_sum_ptr + tile_row + cols, mask=mask, other=0.0)
                # sum_t sum_exp_t exp(max_t - m) over the partials, as online_lse_step over logits
                m_new, _, e, rescale, _ = online_lse_step(part_max, m, 0.0, PRECISE)
                d = d * rescale + tl.sum(part_sum * e, 0)
                m = m_new
        for start in range(0, 0 if TILE_LSE else V, BLOCK_V):
            cols = start + offsets
            mask = cols < V
            z, _ = load_transformed(row_ptr, cols, mask, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
            m_new, d, e, rescale, block_max = online_lse_step(z, m, d, PRECISE)
            # Masked lanes hold -inf; zero them before any product (0 * -inf is NaN).
            z_finite = tl.where(mask, z, 0.0)
            if HAS_SMOOTHING:
                if HAS_CLASS_WEIGHT:
                    w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
                    weighted_z_sum += tl.sum(w * z_finite, 0)
                else:
                    weighted_z_sum += tl.sum(z_finite, 0)
            if COMPUTE_STATS:
                exp_z_sum = exp_z_sum * rescale + tl.sum(e * tl.where(e > 0.0, z, 0.0), 0)  # 0 * -inf is NaN
                block_arg = tl.argmax(z, 0).to(tl.int32)
                # Strict '>' keeps the first maximum, as torch.argmax does.
                best_idx = tl.where(block_max > best, start + block_arg, best_idx)
                best = tl.maximum(best, block_max)
            m = m_new
        lse = m + log(d, PRECISE)

        if TARGET_LOGIT:  # the GEMM's fp32 value, through the softcap already
            z_target = tl.load(target_logit_ptr + row)
        else:
            r_target = tl.load(row_ptr + target).to(tl.float32)
            z_target, _ = transform_logits(r_target, True, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False)
        if HAS_CLASS_WEIGHT:
            w_target = tl.load(class_weight_ptr + target)
            w_total = tl.load(class_weight_sum_ptr)
        else:
            w_target = 1.0
            w_total = V * 1.0
        ce = (1.0 - label_smoothing) * w_target * (lse - z_target)
        if HAS_SMOOTHING:
            ce += label_smoothing / V * (w_total * lse - weighted_z_sum)
        ce_scale = tl.load(ce_scale_ptr + row * scale_stride)
        z_scale = tl.load(z_scale_ptr + row * scale_stride)
        tl.store(loss_ptr + row, ce_scale * ce + z_scale * lse_square_scale * lse * lse)
        tl.store(lse_ptr + row, lse)
        if COMPUTE_STATS:
            tl.store(correct_ptr + row, (best_idx == target).to(tl.int8))
            tl.store(entropy_ptr + row, lse - exp_z_sum / d)

        if COMPUTE_GRAD:
            # Every thread loaded z_target above; without this barrier a warp that reaches pass 2 first
            # can overwrite the target's logit with its gradient before a slower warp has read it (seen
            # on an H200 as wrong losses for targets in the last block, with loads issued a block ahead).
            tl.debug_barrier()
            # Pass 2: overwrite the row with d loss / d logits.
            p_coef = ce_scale * (1.0 - label_smoothing) * w_target + z_scale * 2.0 * lse_square_scale * lse
            if HAS_SMOOTHING:
                p_coef += ce_scale * label_smoothing * w_total / V
            target_coef = ce_scale * (1.0 - label_smoothing) * w_target
            # Backwards over the row: its last blocks, read last in pass 1, are the likeliest still in L2
            # (rows of 128K+ bf16 logits in flight on every SM exceed it).
            for done in range(0, V, BLOCK_V):
                start = LAST_BLOCK_START - done
                if RELATIVE:
                    # The block as [tiles, TILE_N]: each stored value plus its tile's max (0 for a -inf max, as the
                    # epilogue subtracted; softcapped already), one load of the maxima per tile, not per element.
                    tiles_here = tl.arange(0, BLOCK_V // TILE_N)
                    cols = start + tiles_here[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
                    mask = cols < V
                    tile_first = start // TILE_N + tiles_here
                    ref = tl.load(tile_max_ptr + tile_row + tile_first, mask=tile_first < TILES, other=0.0)
                    ref = tl.where(ref == float("-inf"), 0.0, ref)
                    z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32) + ref[:, None]
                    # The target's own term (-1 times the softcap's factor) from its exact logit: a 16-bit value
                    # far below its tile's max would move that factor by 2^-8 |z - max| 2 |z| / c^2.
                    z = tl.where(cols == target, z_target, z)
                    capped = z  # softcapped by the GEMM's epilogue already
                else:
                    cols = start + offsets
                    mask = cols < V
                    z, capped = load_transformed(
                        row_ptr, cols, mask, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False
                    )
                grad = exp(z - lse, PRECISE_GRAD) * p_coef
                if HAS_SMOOTHING:
                    if HAS_CLASS_WEIGHT:
                        w = tl.load(class_weight_ptr + cols, mask=mask, other=0.0)
                        grad -= ce_scale * label_smoothing / V * w
                    else:
                        grad -= ce_scale * label_smoothing / V
                grad = tl.where(cols == target, grad - target_coef, grad)
                grad = transform_backward(
                    grad, capped, mask, softcap, 1.0, HAS_SOFTCAP, HAS_TEMPERATURE=False
                )
                if GRAD_IN_ROW:
                    # This block's 16-bit values land in fp32 columns [(V + cols) / 2], at or past the block's
                    # start: read by now, this block included, once every warp has loaded its part of it.
                    tl.debug_barrier()
                tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_chunk_triton(
    logits: torch.Tensor,
    target: torch.Tensor,
    options: LossOptions,
    *,
    ce_scale: torch.Tensor,
    z_scale: torch.Tensor,
    compute_grad: bool,
    compute_stats: bool,
    grad_out: Optional[torch.Tensor] = None,
    config: Optional[LaunchConfig] = None,
    tile_lse=None,
) -> ChunkOutputs:
    """Launch :func:`_cross_entropy_chunk_kernel` on a [C, V] chunk (contract in ``lightning_flce.kernels``);
    the gradient goes to ``grad_out`` (a [C, V] tensor of any float dtype, or the logits' own rows as
    :func:`~lightning_flce.kernels.gradient_in_logits_rows` lays them out; default: the logits, in place);
    ``config`` overrides :func:`default_launch_config`. ``tile_lse``: the logits GEMM's log-sum-exp partials
    of these rows (:class:`~lightning_flce.kernels.compensated_gemm.TileLse`, the options' softcap): the
    rows' LSE comes from them and the kernel reads the logits once (options without label smoothing,
    ``compute_stats=False``: those need the first pass's other sums), the target logit from its
    ``target_logit`` where it has one. 16-bit ``logits`` with ``tile_lse`` are the GEMM's relative values
    (``compensated_logits_mm`` into a 16-bit ``out``: each softcapped logit minus its tile's maximum), which
    need ``target_logit``."""
    n_rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel needs unit stride along the vocabulary"
    device = logits.device
    loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    correct = torch.empty(n_rows if compute_stats else 0, dtype=torch.int8, device=device)
    entropy = torch.empty(n_rows if compute_stats else 0, dtype=torch.float32, device=device)
    if n_rows == 0:
        return ChunkOutputs(
            loss, lse, correct.bool() if compute_stats else None, entropy if compute_stats else None
        )
    has_class_weight = options.class_weight is not None
    class_weight = options.class_weight if has_class_weight else loss  # dummy pointer, never read
    class_weight_sum = options.class_weight_sum if has_class_weight else loss
    scale_stride = 1 if ce_scale.numel() > 1 else 0
    config = config or default_launch_config(vocab)
    block_v = config.block_v
    relative = tile_lse is not None and logits.dtype != torch.float32
    if relative:  # whole tiles per block
        block_v = max(block_v, tile_lse.block_n)
    extra = {} if config.num_stages is None else {"num_stages": config.num_stages}
    grad_out = logits if grad_out is None else grad_out
    assert grad_out.shape == logits.shape and grad_out.stride(1) == 1
    grad_in_row = is_gradient_in_logits_rows(logits, grad_out)  # raises for any other overlap
    if tile_lse is not None:
        _check_tile_lse(tile_lse, n_rows, options, compute_stats, relative)
        tile_max, tile_sum = tile_lse.max, tile_lse.sum_exp
    else:
        tile_max = tile_sum = loss  # dummy pointers, never read without TILE_LSE
    target_logit = tile_lse.target_logit if tile_lse is not None else None
    # Relative logits' LSE and loss come from fp32 partials and target logits: fp32 results, as of fp32 logits.
    precise_lse, precise_grad = exp_precision(
        torch.float32 if relative else logits.dtype, grad_out.dtype if compute_grad else None
    )
    _cross_entropy_chunk_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        grad_out,
        grad_out.stride(0),
        target,
        class_weight,
        class_weight_sum,
        ce_scale,
        z_scale,
        scale_stride,
        loss,
        lse,
        correct,
        entropy,
        tile_max,
        tile_sum,
        tile_max.stride(0),
        target_logit if target_logit is not None else loss,  # a dummy pointer without TARGET_LOGIT
        vocab,
        options.ignore_index,
        options.label_smoothing,
        options.lse_square_scale,
        options.softcap,
        HAS_CLASS_WEIGHT=has_class_weight,
        HAS_SMOOTHING=options.label_smoothing > 0.0,
        HAS_SOFTCAP=options.softcap > 0.0,
        COMPUTE_GRAD=compute_grad,
        COMPUTE_STATS=compute_stats,
        PRECISE=precise_lse,
        PRECISE_GRAD=precise_grad,
        GRAD_IN_ROW=grad_in_row,
        TILE_LSE=tile_lse is not None,
        TARGET_LOGIT=target_logit is not None,
        RELATIVE=relative,
        TILES=tile_max.shape[1] if tile_lse is not None else 1,
        # not BLOCK_V wide: 250 partials a row at V = 32000 in a 16384-wide block of libdevice exps cost the
        # kernel ~15% there (run90)
        TILES_BLOCK=min(block_v, triton.next_power_of_2(tile_max.shape[1])) if tile_lse is not None else 1,
        TILE_N=tile_lse.block_n if tile_lse is not None else 1,
        BLOCK_V=block_v,
        LAST_BLOCK_START=(vocab - 1) // block_v * block_v,
        num_warps=config.num_warps,
        **extra,
    )
    if not compute_stats:
        return ChunkOutputs(loss, lse)
    return ChunkOutputs(loss, lse, correct.bool(), entropy)


def _check_tile_lse(tile_lse, n_rows: int, options: LossOptions, compute_stats: bool, relative: bool) -> None:
    """The partials must be these rows' and of the logits as this loss transforms them (its softcap), and the
    loss must need nothing else of the first pass; relative logits need the target logits (their row holds no
    exact one)."""
    if options.label_smoothing > 0.0 or compute_stats:
        raise ValueError(
            "cross_entropy_chunk_triton: tile_lse gives the LSE only; label smoothing and compute_stats need"
            " the first pass over the logits"
        )
    if tile_lse.softcap != options.softcap:
        raise ValueError(
            f"cross_entropy_chunk_triton: tile_lse is of softcap {tile_lse.softcap}, the loss's is {options.softcap}"
        )
    if tile_lse.max.shape[0] != n_rows or tile_lse.sum_exp.shape != tile_lse.max.shape:
        raise ValueError(
            f"cross_entropy_chunk_triton: tile_lse must have the chunk's {n_rows} rows, got"
            f" {tuple(tile_lse.max.shape)} and {tuple(tile_lse.sum_exp.shape)}"
        )
    target_logit = tile_lse.target_logit
    if target_logit is not None and tuple(target_logit.shape) != (n_rows,):
        raise ValueError(
            f"cross_entropy_chunk_triton: tile_lse.target_logit must have the chunk's {n_rows} rows, got"
            f" {tuple(target_logit.shape)}"
        )
    if relative and target_logit is None:
        raise ValueError(
            "cross_entropy_chunk_triton: 16-bit logits with tile_lse are relative to their tiles' maxima and"
            " hold no exact target logit: tile_lse needs target_logit"
        )
