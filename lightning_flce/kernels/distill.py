"""Triton kernel: the distillation loss of one chunk (a divergence between the teacher's and the student's
vocabulary distributions, plus an optional hard-label cross-entropy) and its student logit gradient, in place.

Per row, with each side's transform ``z = inv_t * softcap(r)`` (``softcap(r) = c tanh(r / c)``, or ``r``),
``p = softmax(z_s)`` (student), ``q = softmax(z_t)`` (teacher), ``M = beta q + (1 - beta) p``:

    forward_kl  KL(q || p) = sum q (log q - log p)                      d/dz_s = p - q
    reverse_kl  KL(p || q) = sum p (log p - log q)                      d/dz_s = p (log p - log q - KL(p || q))
    jsd         beta KL(q || M) + (1 - beta) KL(p || M)                 d/dz_s = (1 - beta) p (log p - log M - KL(p || M))
    ce          lse(z_c) - z_c[target],  z_c = ce_inv_t * softcap(r_s)  d/dz_c = softmax(z_c) - onehot(target)
    loss        token_scale ((1 - w) divergence + w ce)
    d/dr_s      token_scale ((1 - w) d/dz_s inv_t_s + w d/dz_c ce_inv_t) (1 - (softcap(r_s) / c)^2)

Up to three passes over a row (the chunk holds only rows that carry a loss):

1. both rows once: the online log-sum-exp of z_s and z_t (and of z_c where its inverse temperature differs
   from the student's: a runtime branch per row, so a CE on the student's own scale reuses z_s's), and for
   the KLs the sum that gives the divergence without another pass: ``sum exp(z_t - m_t) (z_t - z_s)`` (forward)
   or ``sum exp(z_s - m_s) (z_s - z_t)`` (reverse), rescaled with the running maximum as the LSE's sum is;
2. "jsd" only: ``log M`` needs both final LSEs, so a second read of both rows sums KL(q || M) and KL(p || M);
   where the caller lets the kernel overwrite the teacher's logits (``teacher_scratch``: the engine's per-block
   buffer), it also stores ``log p - log M`` there (fp16 in a 16-bit row), so that pass 3 reads the student row
   and that ratio instead of recomputing q, M and log M from both rows;
3. with ``compute_grad``: d/dr_s over the student row (or into the 16-bit view of an fp32 row's second half,
   :func:`~lightning_flce.kernels.gradient_in_logits_rows`: then last block first, a barrier per block, as the
   cross-entropy kernel does). The teacher row is read once per pass; the teacher gets no gradient.

The JSD kernel was bound by instruction issue, not by memory. On a GPU (``FAST_MATH``) the per-element exps of
16-bit logits are one ``ex2.approx.ftz`` each, where ``tl.exp`` adds three instructions that keep results under
2^-126 from flushing to 0 (fp32 logits keep libdevice's exp, ``PRECISE``; the interpreter ``tl.exp``), and with
the stored ratio the gradient pass has one exp an element where it had two and a log. JSD's per-element log M is
the log-add-exp of log q + log beta and log p + log(1 - beta) (:func:`~lightning_flce.kernels.triton_math.log_add_exp`):
on a GPU one more ``ex2.approx`` and one ``lg2.approx`` on [1, 2], where its error is absolute (2^-22), in place of
``tl.log`` of M (a polynomial of about 25 instructions); ``lg2.approx`` of M itself raised the loss's error at
V = 256000 from 1.02x to 1.13x the unfused bf16 loss's on an H100 (docs/distill.md). sm_90 SASS of the split
launch's three JSD steps (4096-column blocks, ``benchmarks/experiments/distill_kernel_resources.py``): 1,808
instructions with ``tl.log`` of M, 1,664 now.

Two launches of the one kernel run them (:class:`DistillLaunchConfig`'s ``row_splits``; the kernel's ``STEP``):
whole rows, one program per row through every pass; and the split launch, where each row's columns are cut
into ``row_splits`` slices, one program each, and the passes become steps, one launch each (pass 1 into per-slice statistics; JSD's pass 2 and the gradient
pass merge them first, as the online LSE merges blocks). The teacher's blocks of a chunk are 256 rows
(:data:`~lightning_flce.engine.AUXILIARY_BLOCK_ROWS`): one 16-warp program per row keeps two programs on
each SM, while the kernel alone reaches 69-71% (JSD) and 91-92% (forward KL) of the copy bandwidth on 2048-row
launches of 4096 x 8 (``benchmarks/results/*_distill_kernel_sweep_1505288``) against 54-56% / 76-80% for the
default. On a GPU, JSD's kernel (:data:`SPLIT_DIVERGENCES`) splits rows until it has :data:`PROGRAMS_PER_SM`
programs per SM, on blocks of 4096 x 8: inside the op that made the kernel 15-19% faster and the call 1-2.5%
(H100); the two-pass kernels gained nothing and keep whole rows. The 16-bit gradient in fp32 rows lands past its
own slice, so it keeps whole rows.

Masked or padded columns (-inf logits) have p = 0 or q = 0: the KLs take every product with a log-probability
under ``where(prob > 0)``, never as 0 * -inf, and JSD clamps its log-probabilities at -10000 (a product is then
0 * finite; :func:`_mixture_terms`). A column where a KL's weight is positive and the other side's probability is
0 gives an infinite KL, as the float64 definition does.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from lightning_flce.kernels import is_gradient_in_logits_rows
from lightning_flce.kernels.cross_entropy import LaunchConfig, exp_precision
from lightning_flce.kernels.triton_math import (
    exp,
    load_transformed,
    log,
    log_add_exp,
    online_lse_step,
    transform_backward,
)

#: The divergences by name, as the kernel's DIVERGENCE constant (None: the hard-label CE alone).
DIVERGENCES = {None: 0, "forward_kl": 1, "reverse_kl": 2, "jsd": 3}

# Two rows (student and teacher) are live per block, so half the cross-entropy kernel's widest block; 512
# elements per warp (16 per thread) keeps the block's values in registers.
_MAX_BLOCK_V = 8192
_ELEMENTS_PER_WARP = 512

#: The split launch's aim: this many programs per SM in one launch (8: two waves of four resident 8-warp
#: programs); 0: whole rows for every divergence.
PROGRAMS_PER_SM = 8
#: The split launch's blocks: 4096 columns x 8 warps, four programs an SM (the launch that was measured).
_SPLIT_MAX_BLOCK_V = 4096
#: The divergences whose kernel takes the split launch on a GPU: JSD, which reads both rows three times. Measured
#: inside the op on an H100 (2026-12-06, ``benchmarks/results/2026-12-06_h100_*_distill_split_*``): JSD's kernel
#: 15-19% faster, the call 1-2.5% at the issue's three shapes; forward KL's two passes gained nothing (the call
#: -1% to +1%, its kernel slower at 128256 columns), so the two-pass kernels (the KLs, the CE alone) keep whole rows.
SPLIT_DIVERGENCES = frozenset({"jsd"})
#: Whether JSD keeps ``log p - log M`` in the teacher row for its gradient pass where the caller allows it
#: (``distill_chunk``'s ``teacher_scratch``): one write of the row in pass 2 for one exp, one log and the
#: teacher's transform an element fewer in the gradient pass. ``bench_distill.py``'s ``flce_jsd_recompute_ratio``
#: measures the call without it.
JSD_LOG_RATIO_IN_TEACHER = True


class DistillLaunchConfig(NamedTuple):
    """Launch parameters of the distillation kernels: the cross-entropy kernel's
    (:class:`~lightning_flce.kernels.cross_entropy.LaunchConfig`) and the programs per row."""

    block_v: int
    num_warps: int
    num_stages: Optional[int] = None  # None: Triton's default
    row_splits: int = 1  # 1: whole rows; more: the split launch (at most one slice per block)


def default_distill_launch_config(
    vocab: int, max_block_v: int = _MAX_BLOCK_V, *, rows: int = 0, programs: int = 0
) -> DistillLaunchConfig:
    """The launch for ``rows`` rows of ``vocab`` logits: blocks of at most ``max_block_v`` columns, a warp per 512
    of them, and each row split into as many slices (of whole blocks, then at most 4096 columns) as it takes for
    ``rows`` to make ``programs`` programs (``distill_chunk`` asks for :data:`PROGRAMS_PER_SM` per SM on a GPU for
    :data:`SPLIT_DIVERGENCES`; 0: whole rows).
    ``benchmarks/experiments/bench_distill_kernel.py`` sweeps the alternatives alone, ``bench_distill.py``'s
    ``flce_launch_*`` rows inside the op."""
    split = bool(rows) and programs > rows
    cap = min(max_block_v, _SPLIT_MAX_BLOCK_V) if split else max_block_v
    block_v = min(cap, triton.next_power_of_2(vocab))
    splits = 1
    if split:
        splits = min(triton.cdiv(programs, rows), triton.cdiv(vocab, block_v))
    return DistillLaunchConfig(block_v, max(4, min(16, block_v // _ELEMENTS_PER_WARP)), None, splits)


class ShardSlots(NamedTuple):
    """The vocab-parallel op's split launch over ranks (``distill_chunk``'s ``shard``; the kernel's SHARDED): each
    rank's columns are cut into :func:`shard_slices` slices, each row's scratch slots hold every rank's slices in
    rank order, this rank's from ``offset`` on, ``total`` in all; ``all_reduce`` sums a scratch buffer over the
    ranks in place (each slot is written by one rank, 0 on the others)."""

    offset: int
    total: int
    all_reduce: Callable[[torch.Tensor], None]


def shard_launch_config(columns: int) -> DistillLaunchConfig:
    """A shard's launch: the split launch's blocks (at most 4096 columns), a slice per block."""
    config = default_distill_launch_config(columns, _SPLIT_MAX_BLOCK_V)
    return config._replace(row_splits=triton.cdiv(columns, config.block_v))


def shard_slices(columns: int) -> int:
    """The slices (a program each per row) of a shard of ``columns`` columns; every rank computes every rank's from
    the shard sizes, for :class:`ShardSlots`."""
    return shard_launch_config(columns).row_splits


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """:data:`PROGRAMS_PER_SM` times the device's SM count (0 off CUDA: the interpreter runs whole rows unless
    a config says otherwise)."""
    if device.type != "cuda" or PROGRAMS_PER_SM <= 0:
        return 0
    return PROGRAMS_PER_SM * _sm_count(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@triton.jit
def _mixture_terms(
    z_s, z_t, lse_s, lse_t, log_beta, log_one_minus_beta, PRECISE: tl.constexpr, FAST_MATH: tl.constexpr
):
    """A block's ``(log p, log q, p, q, log M)``, M = beta q + (1 - beta) p, from the row's log-weights
    ``log beta`` and ``log(1 - beta)`` (taken once per row by the caller). The log-probabilities are clamped at
    -10000, not masked: below it the probability is 0 in fp32 either way, and a -inf column (masked or padded)
    gets a finite log-probability, so that every product of a probability and a difference of these logs is
    0 * finite = 0 there without a ``where``. log M is the log-add-exp of the two weighted log-probabilities
    (finite; ``log p - log M`` lies in [-10000, -log(1 - beta)]), which on a GPU is one exp and one
    ``lg2.approx`` on [1, 2] (absolute error 2^-22) where ``tl.log`` of M is a polynomial of about 25
    instructions; ``lg2.approx`` of M itself has an error relative to |log2 M| and measurably raised the
    loss's error at V = 256000 (docs/distill.md)."""
    log_p = tl.maximum(z_s - lse_s, -10000.0)
    log_q = tl.maximum(z_t - lse_t, -10000.0)
    p = exp(log_p, PRECISE, FAST_MATH)
    q = exp(log_q, PRECISE, FAST_MATH)
    log_m = log_add_exp(log_q + log_beta, log_p + log_one_minus_beta, PRECISE, FAST_MATH)
    return log_p, log_q, p, q, log_m


@triton.jit
def _row_parameters(
    row,
    target_ptr,
    student_inv_t_ptr,
    teacher_inv_t_ptr,
    ce_inv_t_ptr,
    token_scale_ptr,
    student_inv_t_stride,
    teacher_inv_t_stride,
    ce_inv_t_stride,
    token_scale_stride,
    DIVERGENCE: tl.constexpr,
    HAS_CE: tl.constexpr,
):
    """A row's scalars: ``(inv_t_s, inv_t_t, ce_inv_t, token_scale, target, own_ce_lse)``; without HAS_CE the
    last three are placeholders (``ce_inv_t = inv_t_s``, target 0, False)."""
    inv_t_s = tl.load(student_inv_t_ptr + row * student_inv_t_stride)
    inv_t_t = tl.load(teacher_inv_t_ptr + row * teacher_inv_t_stride)
    token_scale = tl.load(token_scale_ptr + row * token_scale_stride)
    ce_inv_t = inv_t_s
    target = row * 0
    if HAS_CE:
        ce_inv_t = tl.load(ce_inv_t_ptr + row * ce_inv_t_stride)
        target = tl.load(target_ptr + row)
        if DIVERGENCE == 0:
            inv_t_s = ce_inv_t  # the student's statistics are then the CE's own
    own_ce_lse = ce_inv_t != inv_t_s  # z_c is not z_s: the CE needs its own log-sum-exp
    return inv_t_s, inv_t_t, ce_inv_t, token_scale, target, own_ce_lse


@triton.jit
def _statistics_pass(
    student_row,
    teacher_row,
    begin,
    end,
    inv_t_s,
    inv_t_t,
    ce_inv_t,
    own_ce_lse,
    student_softcap,
    teacher_softcap,
    DIVERGENCE: tl.constexpr,
    HAS_CE: tl.constexpr,
    STUDENT_SOFTCAP: tl.constexpr,
    TEACHER_SOFTCAP: tl.constexpr,
    PRECISE: tl.constexpr,
    FAST_MATH: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 1 over columns [begin, end) of both rows: the online log-sum-exps ``(m, d)`` of z_s, z_t and z_c (the
    CE's, where ``own_ce_lse``) and the KLs' sum (``sum exp(z_t - m_t) (z_t - z_s)`` forward, ``sum exp(z_s -
    m_s) (z_s - z_t)`` reverse, relative to the returned maximum as ``d`` is)."""
    offsets = tl.arange(0, BLOCK_V)
    m_s = tl.full((), float("-inf"), tl.float32)
    d_s = tl.zeros((), tl.float32)
    m_t = tl.full((), float("-inf"), tl.float32)
    d_t = tl.zeros((), tl.float32)
    m_c = tl.full((), float("-inf"), tl.float32)
    d_c = tl.zeros((), tl.float32)
    kl_sum = tl.zeros((), tl.float32)
    for start in range(begin, end, BLOCK_V):
        cols = start + offsets
        mask = cols < end
        z_s, capped_s = load_transformed(student_row, cols, mask, student_softcap, inv_t_s, STUDENT_SOFTCAP)
        if HAS_CE:  # noqa: SIM102  (a compile-time condition, then a runtime one: Triton keeps them apart)
            if own_ce_lse:
                m_c, d_c, _, _, _ = online_lse_step(capped_s * ce_inv_t, m_c, d_c, PRECISE, FAST_MATH)
        if DIVERGENCE != 0:
            z_t, capped_t = load_transformed(
                teacher_row, cols, mask, teacher_softcap, inv_t_t, TEACHER_SOFTCAP
            )
        # The side whose exps weight the KL's terms steps last, so that they need not stay live (in registers)
        # across the other side's step.
        if DIVERGENCE == 2:
            m_t, d_t, _, _, _ = online_lse_step(z_t, m_t, d_t, PRECISE, FAST_MATH)
        m_s_new, d_s, e_s, rescale_s, _ = online_lse_step(z_s, m_s, d_s, PRECISE, FAST_MATH)
        if DIVERGENCE == 1 or DIVERGENCE == 3:
            m_t, d_t, e_t, rescale_t, _ = online_lse_step(z_t, m_t, d_t, PRECISE, FAST_MATH)
        if DIVERGENCE == 1:
            kl_sum = kl_sum * rescale_t + tl.sum(tl.where(e_t > 0.0, e_t * (z_t - z_s), 0.0), 0)
        elif DIVERGENCE == 2:
            kl_sum = kl_sum * rescale_s + tl.sum(tl.where(e_s > 0.0, e_s * (z_s - z_t), 0.0), 0)
        m_s = m_s_new
    return m_s, d_s, m_t, d_t, m_c, d_c, kl_sum


@triton.jit
def _mixture_pass(
    student_row,
    teacher_row,
    ratio_row,
    begin,
    end,
    lse_s,
    lse_t,
    inv_t_s,
    inv_t_t,
    beta,
    student_softcap,
    teacher_softcap,
    STUDENT_SOFTCAP: tl.constexpr,
    TEACHER_SOFTCAP: tl.constexpr,
    PRECISE: tl.constexpr,
    FAST_MATH: tl.constexpr,
    STORE_RATIO: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """JSD's pass 2 over columns [begin, end), last block first (the blocks pass 1 read last are the likeliest
    still in L2): ``(sum q (log q - log M), sum p (log p - log M))``; ``log M`` needs both final LSEs. With
    STORE_RATIO it also writes ``log p - log M`` over the teacher row (``ratio_row``, the row's memory as fp16
    or fp32; finite, also where p = 0), which the gradient pass then reads instead of recomputing it from both
    rows."""
    offsets = tl.arange(0, BLOCK_V)
    last_start = begin + (end - 1 - begin) // BLOCK_V * BLOCK_V
    kl_q_m = tl.zeros((), tl.float32)
    kl_p_m = tl.zeros((), tl.float32)
    log_beta = log(beta, PRECISE)
    log_one_minus_beta = log(1.0 - beta, PRECISE)
    for done in range(0, end - begin, BLOCK_V):
        cols = last_start - done + offsets
        mask = cols < end
        z_s, capped_s = load_transformed(student_row, cols, mask, student_softcap, inv_t_s, STUDENT_SOFTCAP)
        z_t, capped_t = load_transformed(teacher_row, cols, mask, teacher_softcap, inv_t_t, TEACHER_SOFTCAP)
        log_p, log_q, p, q, log_m = _mixture_terms(
            z_s, z_t, lse_s, lse_t, log_beta, log_one_minus_beta, PRECISE, FAST_MATH
        )
        log_ratio = log_p - log_m  # finite, in fp16's range
        kl_q_m += tl.sum(q * (log_q - log_m), 0)
        kl_p_m += tl.sum(p * log_ratio, 0)
        if STORE_RATIO:
            tl.store(ratio_row + cols, log_ratio.to(ratio_row.dtype.element_ty), mask=mask)
    return kl_q_m, kl_p_m


@triton.jit
def _row_loss(
    lse_s,
    lse_t,
    d_s,
    d_t,
    m_c,
    d_c,
    kl_sum,
    kl_q_m,
    kl_p_m,
    own_ce_lse,
    z_target,
    token_scale,
    beta,
    hard_weight,
    DIVERGENCE: tl.constexpr,
    DIVERGENCE_GRAD: tl.constexpr,
    HAS_CE: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """A row's ``(loss, divergence, ce, lse_c)`` from its statistics (``ce`` 0 without HAS_CE; ``lse_c`` the
    CE's log-sum-exp, z_s's where the CE shares the student's scale)."""
    divergence = tl.zeros((), tl.float32)
    if DIVERGENCE == 1:
        divergence = kl_sum / d_t + (lse_s - lse_t)
    elif DIVERGENCE == 2:
        divergence = kl_sum / d_s + (lse_t - lse_s)
    elif DIVERGENCE == 3:
        divergence = beta * kl_q_m + (1.0 - beta) * kl_p_m
    loss = tl.zeros((), tl.float32)
    if DIVERGENCE_GRAD:
        loss = (1.0 - hard_weight) * divergence
    lse_c = lse_s
    ce = tl.zeros((), tl.float32)
    if HAS_CE:
        if own_ce_lse:
            lse_c = m_c + log(d_c, PRECISE)
        ce = lse_c - z_target
        loss += hard_weight * ce
    return token_scale * loss, divergence, ce, lse_c


@triton.jit
def _gradient_pass(
    student_row,
    teacher_row,
    ratio_row,
    grad_row,
    begin,
    end,
    lse_s,
    lse_t,
    lse_c,
    divergence,
    kl_p_m,
    target,
    inv_t_s,
    inv_t_t,
    ce_inv_t,
    token_scale,
    beta,
    hard_weight,
    student_softcap,
    teacher_softcap,
    DIVERGENCE: tl.constexpr,
    DIVERGENCE_GRAD: tl.constexpr,
    HAS_CE: tl.constexpr,
    STUDENT_SOFTCAP: tl.constexpr,
    TEACHER_SOFTCAP: tl.constexpr,
    PRECISE_GRAD: tl.constexpr,
    FAST_MATH: tl.constexpr,
    GRAD_IN_ROW: tl.constexpr,
    RATIO_IN_TEACHER: tl.constexpr,
    LAST_BLOCK_FIRST: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """d/dr_s over columns [begin, end), written to ``grad_row`` (in place over the student row, another buffer,
    or GRAD_IN_ROW's 16-bit view of the fp32 row's second half: then LAST_BLOCK_FIRST, a barrier per block).
    RATIO_IN_TEACHER (JSD): ``log p - log M`` from ``ratio_row``, where pass 2 stored it, instead of the teacher
    row."""
    offsets = tl.arange(0, BLOCK_V)
    last_start = begin + (end - 1 - begin) // BLOCK_V * BLOCK_V
    divergence_coef = token_scale * (1.0 - hard_weight) * inv_t_s  # d/dz_s -> d/dr_s, weighted
    shift = tl.zeros((), tl.float32)
    if DIVERGENCE == 3:
        shift = -kl_p_m  # d/dz_s = (1 - beta) p (log p - log M - KL(p || M))
        divergence_coef = divergence_coef * (1.0 - beta)
        log_beta = log(beta, PRECISE_GRAD)  # the mixture's weights, where log M is recomputed
        log_one_minus_beta = log(1.0 - beta, PRECISE_GRAD)
    elif DIVERGENCE == 2:
        shift = lse_t - lse_s - divergence  # log p - log q - KL = z_s - z_t + this
    for done in range(0, end - begin, BLOCK_V):
        start = begin + done
        if LAST_BLOCK_FIRST:
            start = last_start - done
        cols = start + offsets
        mask = cols < end
        z_s, capped_s = load_transformed(student_row, cols, mask, student_softcap, inv_t_s, STUDENT_SOFTCAP)
        grad = tl.zeros([BLOCK_V], dtype=tl.float32)
        if DIVERGENCE_GRAD and RATIO_IN_TEACHER:
            # finite ratios (p = 0 times them is 0); masked lanes: p = 0
            log_ratio = tl.load(ratio_row + cols, mask=mask, other=0.0).to(tl.float32)
            grad = divergence_coef * (exp(z_s - lse_s, PRECISE_GRAD, FAST_MATH) * (log_ratio + shift))
        elif DIVERGENCE_GRAD:
            z_t, capped_t = load_transformed(
                teacher_row, cols, mask, teacher_softcap, inv_t_t, TEACHER_SOFTCAP
            )
            if DIVERGENCE == 3:
                log_p, _, p, _, log_m = _mixture_terms(
                    z_s, z_t, lse_s, lse_t, log_beta, log_one_minus_beta, PRECISE_GRAD, FAST_MATH
                )
                grad_z = p * (log_p - log_m + shift)
            else:
                p = exp(z_s - lse_s, PRECISE_GRAD, FAST_MATH)
                if DIVERGENCE == 1:
                    grad_z = p - exp(z_t - lse_t, PRECISE_GRAD, FAST_MATH)
                else:
                    grad_z = tl.where(p > 0.0, p * (z_s - z_t + shift), 0.0)
            grad = divergence_coef * grad_z
        if HAS_CE:
            p_c = exp(capped_s * ce_inv_t - lse_c, PRECISE_GRAD, FAST_MATH)
            grad += token_scale * hard_weight * ce_inv_t * tl.where(cols == target, p_c - 1.0, p_c)
        grad = transform_backward(
            grad, capped_s, mask, student_softcap, 1.0, STUDENT_SOFTCAP, HAS_TEMPERATURE=False
        )
        if GRAD_IN_ROW:
            # This block's 16-bit values land in fp32 columns [(V + cols) / 2], at or past the block's
            # start: read by now, once every warp has loaded its part of it.
            tl.debug_barrier()
        tl.store(grad_row + cols, grad.to(grad_row.dtype.element_ty), mask=mask)


#: Per row slice, pass 1's results: (m_s, d_s, m_t, d_t, m_c, d_c, kl_sum).
STATISTICS = 7
_STATISTICS = tl.constexpr(STATISTICS)  # the kernel's copy (a jit function reads only constexpr globals)

#: The kernel's STEP: the whole-row launch's one, or the split launch's three (grid [C, SPLITS] each).
WHOLE_ROW, SLICE_STATISTICS, SLICE_MIXTURE, SLICE_FINISH = 0, 1, 2, 3
# the kernel's copies
_WHOLE_ROW = tl.constexpr(WHOLE_ROW)
_SLICE_STATISTICS = tl.constexpr(SLICE_STATISTICS)
_SLICE_MIXTURE = tl.constexpr(SLICE_MIXTURE)
_SLICE_FINISH = tl.constexpr(SLICE_FINISH)


@triton.jit
def _merge_lse(m_parts, d_parts, PRECISE: tl.constexpr):
    """The running ``(m, d)`` of several slices as one row's, and each slice's factor ``exp(m_j - m)`` (0 for a
    slice with no finite logit)."""
    m = tl.max(m_parts, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    scale = exp(m_parts - m_ref, PRECISE)
    return m, tl.sum(d_parts * scale, 0), scale


@triton.jit
def _row_statistics(
    statistics_ptr,
    row,
    DIVERGENCE: tl.constexpr,
    PRECISE: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
):
    """A row's pass-1 results merged from its slices' (what :func:`_statistics_pass` returns for a whole row)."""
    parts = tl.arange(0, SPLITS_POW2)
    present = parts < SPLITS
    base = statistics_ptr + (row * SPLITS + parts) * _STATISTICS
    none = float("-inf")
    m_s, d_s, scale_s = _merge_lse(
        tl.load(base, mask=present, other=none), tl.load(base + 1, mask=present, other=0.0), PRECISE
    )
    m_t, d_t, scale_t = _merge_lse(
        tl.load(base + 2, mask=present, other=none), tl.load(base + 3, mask=present, other=0.0), PRECISE
    )
    m_c, d_c, _ = _merge_lse(
        tl.load(base + 4, mask=present, other=none), tl.load(base + 5, mask=present, other=0.0), PRECISE
    )
    kl_parts = tl.load(base + 6, mask=present, other=0.0)
    kl_sum = tl.zeros((), tl.float32)
    if DIVERGENCE == 1:
        kl_sum = tl.sum(kl_parts * scale_t, 0)
    elif DIVERGENCE == 2:
        kl_sum = tl.sum(kl_parts * scale_s, 0)
    return m_s, d_s, m_t, d_t, m_c, d_c, kl_sum


@triton.jit
def _slot(split, slot_offset, SHARDED: tl.constexpr):
    """A slice's slot among its row's scratch slots: its own index, after the earlier ranks' slices when SHARDED."""
    if SHARDED:
        return slot_offset + split
    return split


@triton.jit
def _distill_kernel(
    student_ptr,  # [C, V] student logits r_s (compute dtype, or fp32 wide logits)
    student_row_stride,
    teacher_ptr,  # [C, V] teacher logits r_t (any float dtype), read only unless RATIO_IN_TEACHER
    teacher_row_stride,
    ratio_ptr,  # RATIO_IN_TEACHER: the teacher's memory as fp16 (16-bit teacher) or fp32, teacher_row_stride apart
    grad_ptr,  # [C, V] out: d/dr_s (student_ptr itself, another buffer, or GRAD_IN_ROW's 16-bit view)
    grad_row_stride,
    target_ptr,  # [C] int64 in [0, V) (read only with HAS_CE)
    student_inv_t_ptr,  # fp32 [1] or [C]
    teacher_inv_t_ptr,  # fp32 [1] or [C]
    ce_inv_t_ptr,  # fp32 [1] or [C]
    token_scale_ptr,  # fp32 [1] or [C]
    student_inv_t_stride,  # 0 for a shared value, 1 per row (each of the four)
    teacher_inv_t_stride,
    ce_inv_t_stride,
    token_scale_stride,
    loss_ptr,  # [C] fp32 out: token_scale ((1 - w) divergence + w ce)
    divergence_ptr,  # [C] fp32 out: the divergence (0 without one)
    ce_ptr,  # [C] fp32 out (only with HAS_CE)
    statistics_ptr,  # [C, SPLITS, STATISTICS] fp32 scratch of the split launch: each slice's pass 1
    mixture_ptr,  # [C, SPLITS, 2] fp32 scratch of the split launch ("jsd"): each slice's JSD sums
    target_logit_ptr,  # [C] fp32 scratch of the split launch (HAS_CE): z_c at the target
    beta,  # JSD's teacher weight in M
    hard_weight,  # w
    student_softcap,
    teacher_softcap,
    slot_offset,  # this launch's first slice among the MERGED slots of a row (0 unless SHARDED)
    V: tl.constexpr,
    DIVERGENCE: tl.constexpr,  # DIVERGENCES' value
    DIVERGENCE_GRAD: tl.constexpr,  # the divergence's gradient term (a divergence and w < 1)
    HAS_CE: tl.constexpr,  # w > 0
    STUDENT_SOFTCAP: tl.constexpr,
    TEACHER_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    PRECISE: tl.constexpr,  # libdevice exp / log in the loss passes (fp32 logits on a GPU)
    PRECISE_GRAD: tl.constexpr,  # libdevice exp in the gradient pass (an fp32 gradient on a GPU)
    FAST_MATH: tl.constexpr,  # a GPU: per-element exps (and JSD's log M) not PRECISE as single MUFU ops
    GRAD_IN_ROW: tl.constexpr,  # grad_ptr is the 16-bit view of the fp32 student rows' second halves
    RATIO_IN_TEACHER: tl.constexpr,  # JSD: pass 2 stores log p - log M over the teacher row, the gradient reads it
    BLOCK_V: tl.constexpr,
    SLICE_V: tl.constexpr,  # columns per program: a multiple of BLOCK_V (split launch), V (whole rows)
    SPLITS: tl.constexpr,  # programs per row (program_id(1) is the slice)
    SPLITS_POW2: tl.constexpr,
    STEP: tl.constexpr,  # WHOLE_ROW, or the split launch's SLICE_STATISTICS, SLICE_MIXTURE, SLICE_FINISH
    MERGED: tl.constexpr,  # slots per row in the scratch buffers (SPLITS unless SHARDED: every rank's slices)
    MERGED_POW2: tl.constexpr,
    SHARDED: tl.constexpr,  # the row's columns are one rank's; target is a local index, maybe elsewhere
):
    """WHOLE_ROW: one program per row runs every pass. The split launch, a program per slice of a row: pass 1
    into ``statistics_ptr`` (SLICE_STATISTICS; the first slice's program also keeps the target's CE logit, which
    the last step overwrites); JSD's pass 2 into ``mixture_ptr`` (SLICE_MIXTURE, "jsd" only); the row's loss
    (stored by the first slice's program) and the gradient pass (SLICE_FINISH, grid [C, 1] without
    COMPUTE_GRAD). The later steps merge every slice's statistics first. SHARDED (the vocab-parallel op): the
    row holds one rank's columns, the scratch buffers every rank's slices (MERGED slots a row, this launch's from
    ``slot_offset``; the caller all-reduces them between the steps), and the target's CE logit is stored only by
    the rank whose columns hold it (0 elsewhere, for the sum)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if STEP == _SLICE_MIXTURE or (STEP == _SLICE_FINISH and DIVERGENCE != 3):
        # A step that follows pass 1 takes the slices in its reverse order (programs start in the order of their
        # ids), and its blocks last first: the slices the step before read last, the likeliest still in L2,
        # come first. (A row's data, 256 rows of both sides at V = 128K, is 2.5x an H100's L2.)
        row = tl.num_programs(0) - 1 - row
        split = tl.num_programs(1) - 1 - split
    if STEP == _WHOLE_ROW:
        begin = 0
        end = V
    else:
        begin = split * SLICE_V
        end = tl.minimum(begin + SLICE_V, V)
    student_row = student_ptr + row * student_row_stride
    teacher_row = teacher_ptr + row * teacher_row_stride
    ratio_row = ratio_ptr + row * teacher_row_stride
    inv_t_s, inv_t_t, ce_inv_t, token_scale, target, own_ce_lse = _row_parameters(
        row,
        target_ptr,
        student_inv_t_ptr,
        teacher_inv_t_ptr,
        ce_inv_t_ptr,
        token_scale_ptr,
        student_inv_t_stride,
        teacher_inv_t_stride,
        ce_inv_t_stride,
        token_scale_stride,
        DIVERGENCE,
        HAS_CE,
    )
    if STEP != _SLICE_MIXTURE and STEP != _SLICE_FINISH:  # pass 1 here
        m_s, d_s, m_t, d_t, m_c, d_c, kl_sum = _statistics_pass(
            student_row,
            teacher_row,
            begin,
            end,
            inv_t_s,
            inv_t_t,
            ce_inv_t,
            own_ce_lse,
            student_softcap,
            teacher_softcap,
            DIVERGENCE,
            HAS_CE,
            STUDENT_SOFTCAP,
            TEACHER_SOFTCAP,
            PRECISE,
            FAST_MATH,
            BLOCK_V,
        )
        z_target = tl.zeros((), tl.float32)
        # the target's CE logit, read before any gradient overwrites the row (the split launch keeps it for its
        # last step)
        if HAS_CE:
            owned = True
            if SHARDED:
                owned = (target >= 0) & (target < V)
            z_target, _ = load_transformed(
                student_row, target, owned, student_softcap, ce_inv_t, STUDENT_SOFTCAP
            )
            if SHARDED:
                z_target = tl.where(owned, z_target, 0.0)
    else:
        m_s, d_s, m_t, d_t, m_c, d_c, kl_sum = _row_statistics(
            statistics_ptr, row, DIVERGENCE, PRECISE, MERGED, MERGED_POW2
        )
        z_target = tl.zeros((), tl.float32)
        if HAS_CE:
            z_target = tl.load(target_logit_ptr + row)

    if STEP == _SLICE_STATISTICS:
        out = statistics_ptr + (row * MERGED + _slot(split, slot_offset, SHARDED)) * _STATISTICS
        tl.store(out, m_s)
        tl.store(out + 1, d_s)
        tl.store(out + 2, m_t)
        tl.store(out + 3, d_t)
        tl.store(out + 4, m_c)
        tl.store(out + 5, d_c)
        tl.store(out + 6, kl_sum)
        if HAS_CE:  # noqa: SIM102  (a compile-time condition, then a runtime one: Triton keeps them apart)
            if split == 0:
                tl.store(target_logit_ptr + row, z_target)
    else:
        lse_s = m_s + log(d_s, PRECISE)
        lse_t = lse_s
        if DIVERGENCE != 0:
            lse_t = m_t + log(d_t, PRECISE)
        kl_q_m = tl.zeros((), tl.float32)
        kl_p_m = tl.zeros((), tl.float32)
        if DIVERGENCE == 3 and STEP != _SLICE_FINISH:  # the row's (WHOLE_ROW) or the slice's (SLICE_MIXTURE)
            kl_q_m, kl_p_m = _mixture_pass(
                student_row,
                teacher_row,
                ratio_row,
                begin,
                end,
                lse_s,
                lse_t,
                inv_t_s,
                inv_t_t,
                beta,
                student_softcap,
                teacher_softcap,
                STUDENT_SOFTCAP,
                TEACHER_SOFTCAP,
                PRECISE,
                FAST_MATH,
                RATIO_IN_TEACHER,
                BLOCK_V,
            )
        if DIVERGENCE == 3 and STEP == _SLICE_FINISH:
            parts = tl.arange(0, MERGED_POW2)
            present = parts < MERGED
            sums = mixture_ptr + (row * MERGED + parts) * 2
            kl_q_m = tl.sum(tl.load(sums, mask=present, other=0.0), 0)
            kl_p_m = tl.sum(tl.load(sums + 1, mask=present, other=0.0), 0)
        if STEP == _SLICE_MIXTURE:
            out = mixture_ptr + (row * MERGED + _slot(split, slot_offset, SHARDED)) * 2
            tl.store(out, kl_q_m)
            tl.store(out + 1, kl_p_m)
        else:
            loss, divergence, ce, lse_c = _row_loss(
                lse_s,
                lse_t,
                d_s,
                d_t,
                m_c,
                d_c,
                kl_sum,
                kl_q_m,
                kl_p_m,
                own_ce_lse,
                z_target,
                token_scale,
                beta,
                hard_weight,
                DIVERGENCE,
                DIVERGENCE_GRAD,
                HAS_CE,
                PRECISE,
            )
            if split == 0:
                tl.store(loss_ptr + row, loss)
                tl.store(divergence_ptr + row, divergence)
                if HAS_CE:
                    tl.store(ce_ptr + row, ce)
            if COMPUTE_GRAD:
                if STEP == _WHOLE_ROW:
                    # Every warp has read the row (the target's logit too) before any warp overwrites it: loads
                    # may be issued ahead of the stores of the pass below. (A slice's earlier reads were other
                    # launches.)
                    tl.debug_barrier()
                # Against the previous pass's direction, so that the blocks it read last (the likeliest still
                # in L2) come first: last block first after pass 1, first block first after JSD's pass 2
                # (whole rows, and a slice as its step's order above), except that the 16-bit gradient in the
                # fp32 rows (whole rows only) always goes last block first (its values land at or past the
                # block being read).
                _gradient_pass(
                    student_row,
                    teacher_row,
                    ratio_row,
                    grad_ptr + row * grad_row_stride,
                    begin,
                    end,
                    lse_s,
                    lse_t,
                    lse_c,
                    divergence,
                    kl_p_m,
                    target,
                    inv_t_s,
                    inv_t_t,
                    ce_inv_t,
                    token_scale,
                    beta,
                    hard_weight,
                    student_softcap,
                    teacher_softcap,
                    DIVERGENCE,
                    DIVERGENCE_GRAD,
                    HAS_CE,
                    STUDENT_SOFTCAP,
                    TEACHER_SOFTCAP,
                    PRECISE_GRAD,
                    FAST_MATH,
                    GRAD_IN_ROW,
                    RATIO_IN_TEACHER,
                    GRAD_IN_ROW or DIVERGENCE != 3,
                    BLOCK_V,
                )


def _per_row(values: torch.Tensor, n_rows: int, device: torch.device, name: str) -> Tuple[torch.Tensor, int]:
    """``values`` as fp32 and its row stride (0 shared, 1 per row); raises unless [1] or [C] on ``device``."""
    if values.dim() != 1 or values.numel() not in (1, n_rows):
        raise ValueError(f"{name} must have shape [1] or [{n_rows}], got {tuple(values.shape)}")
    if values.device != device:
        raise ValueError(f"{name} must be on the logits' device {device}, got {values.device}")
    return values.float().contiguous(), int(values.numel() > 1)


def distill_chunk(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: Optional[torch.Tensor],
    *,
    divergence: Optional[str],
    beta: float,
    student_inv_temperature: torch.Tensor,
    teacher_inv_temperature: torch.Tensor,
    ce_inv_temperature: torch.Tensor,
    student_softcap: float,
    teacher_softcap: float,
    hard_weight: float,
    token_scale: torch.Tensor,
    compute_grad: bool,
    grad_out: Optional[torch.Tensor] = None,
    config: Optional[Union[DistillLaunchConfig, LaunchConfig]] = None,
    teacher_scratch: bool = False,
    shard: Optional[ShardSlots] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The distillation loss of one [C, V] chunk (the module's docstring; the PyTorch twin of this contract
    is ``kernels/distill_torch.py``): returns fp32 ``(loss_rows, divergence_rows, ce_rows)`` (``ce_rows`` None when ``hard_weight`` is 0) and,
    with ``compute_grad``, writes d loss / d student logits over ``student_logits`` or into ``grad_out`` (a
    [C, V] tensor, or :func:`~lightning_flce.kernels.gradient_in_logits_rows` of the fp32 student logits).
    ``target`` is read only when ``hard_weight`` > 0 (and may be None otherwise); ``config`` overrides
    :func:`default_distill_launch_config`. ``teacher_scratch``: the caller lets the kernel overwrite the teacher
    logits (the engine's per-block buffer): JSD's gradient pass then reads ``log p - log M`` where pass 2 stored it
    over the teacher row (fp16 in a 16-bit row, fp32 in an fp32 one) instead of recomputing it from both rows, one
    exp, one log and the teacher's read-and-transform an element fewer; otherwise the teacher is read only.
    ``shard``: the logits are one rank's columns of the vocabulary and ``target`` local indices (``target -
    vocab_start``, outside ``[0, V)`` where another rank holds the column): the split launch on
    :func:`shard_slices` slices, the scratch statistics (and JSD's sums) all-reduced between its steps
    (:class:`ShardSlots`); every rank must call it with the same rows. Not with a 16-bit gradient in fp32 rows."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {list(DIVERGENCES)}, got {divergence!r}")
    if divergence == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1 (0 and 1 are forward_kl and reverse_kl), got {beta}")
    if not 0.0 <= hard_weight <= 1.0:
        raise ValueError(f"hard_weight must be in [0, 1], got {hard_weight}")
    if student_softcap < 0.0 or teacher_softcap < 0.0:
        raise ValueError(f"softcaps must be >= 0 (0: none), got {student_softcap} and {teacher_softcap}")
    if student_logits.dim() != 2 or teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"student and teacher logits must be [C, V] of one shape, got {tuple(student_logits.shape)}"
            f" and {tuple(teacher_logits.shape)}"
        )
    for name, logits in (("student", student_logits), ("teacher", teacher_logits)):
        if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"the Triton kernel takes 16-bit or fp32 {name} logits, got {logits.dtype}")
        if logits.stride(1) != 1:
            raise ValueError(f"the {name} logits need unit stride along the vocabulary")
    has_ce = hard_weight > 0.0
    n_rows, vocab = student_logits.shape
    if has_ce and (target is None or target.shape != (n_rows,)):
        raise ValueError(f"hard_weight > 0 needs a [{n_rows}] target, got {target}")
    device = student_logits.device
    if teacher_logits.device != device or (has_ce and target.device != device):
        raise ValueError(f"the teacher logits and the target must be on the student logits' device {device}")
    student_inv_t, student_stride = _per_row(
        student_inv_temperature, n_rows, device, "student_inv_temperature"
    )
    teacher_inv_t, teacher_stride = _per_row(
        teacher_inv_temperature, n_rows, device, "teacher_inv_temperature"
    )
    ce_inv_t, ce_stride = _per_row(ce_inv_temperature, n_rows, device, "ce_inv_temperature")
    scale, scale_stride = _per_row(token_scale, n_rows, device, "token_scale")
    grad = student_logits if grad_out is None else grad_out
    if compute_grad and (grad.shape != student_logits.shape or grad.stride(1) != 1):
        raise ValueError(f"grad_out must be [C, V] with unit column stride, got {tuple(grad.shape)}")
    grad_in_row = compute_grad and is_gradient_in_logits_rows(student_logits, grad)
    if shard is not None and grad_in_row:
        raise ValueError("a shard's launch is split, which a 16-bit gradient in fp32 rows cannot take")

    loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    divergence_rows = torch.empty(n_rows, dtype=torch.float32, device=device)
    ce = torch.empty(n_rows if has_ce else 0, dtype=torch.float32, device=device)
    if n_rows:
        # the split launch for JSD's kernel (SPLIT_DIVERGENCES); a 16-bit gradient in fp32 rows runs whole rows
        # (below), so it asks for none and keeps the whole-row blocks
        programs = target_programs(device) if divergence in SPLIT_DIVERGENCES and not grad_in_row else 0
        if shard is not None:  # a slice per block, the same rule on every rank (ShardSlots)
            config = shard_launch_config(vocab)
        config = config or default_distill_launch_config(vocab, rows=n_rows, programs=programs)
        block_v = config.block_v
        # 1 for a LaunchConfig; the 16-bit gradient in fp32 rows lands past its own slice: whole rows
        splits = 1 if grad_in_row else max(1, getattr(config, "row_splits", 1))
        slice_v = triton.cdiv(triton.cdiv(vocab, splits), block_v) * block_v
        splits = triton.cdiv(vocab, slice_v)
        split = splits > 1 or shard is not None
        merged = splits if shard is None else shard.total
        jsd = divergence == "jsd"
        divergence_grad = divergence is not None and hard_weight < 1.0
        ratio_in_teacher = (
            JSD_LOG_RATIO_IN_TEACHER and teacher_scratch and jsd and compute_grad and divergence_grad
        )
        # log p - log M over the teacher's own memory: fp16 (more mantissa than bf16; the values lie in
        # [-10000, -log(1 - beta)], _mixture_terms) in a 16-bit row, fp32 in an fp32 one
        ratio = teacher_logits
        if ratio_in_teacher and teacher_logits.element_size() == 2:
            ratio = teacher_logits.view(torch.float16)
        precise = exp_precision(student_logits.dtype, None)[0] or exp_precision(teacher_logits.dtype, None)[0]
        scratch = loss  # a dummy pointer where a scratch buffer is not used
        statistics = target_logit = mixture = scratch
        if split:
            # a shard's slots and target logits that are not this rank's stay 0, for the sum over the ranks
            new_scratch = torch.empty if shard is None else torch.zeros
            # one buffer for pass 1's statistics and the target's CE logit: one all-reduce for a shard
            pass_one = new_scratch(n_rows * (merged * STATISTICS + 1), dtype=torch.float32, device=device)
            statistics, target_logit = (
                pass_one[: n_rows * merged * STATISTICS],
                pass_one[n_rows * merged * STATISTICS :],
            )
            if jsd:
                mixture = new_scratch(n_rows * merged * 2, dtype=torch.float32, device=device)
        args = (
            student_logits,
            student_logits.stride(0),
            teacher_logits,
            teacher_logits.stride(0),
            ratio,
            grad,
            grad.stride(0),
            target if has_ce else loss,  # a dummy pointer without the CE
            student_inv_t,
            teacher_inv_t,
            ce_inv_t,
            scale,
            student_stride,
            teacher_stride,
            ce_stride,
            scale_stride,
            loss,
            divergence_rows,
            ce if has_ce else loss,
            statistics,
            mixture,
            target_logit if has_ce else scratch,
            float(beta),
            float(hard_weight),
            float(student_softcap),
            float(teacher_softcap),
            0 if shard is None else shard.offset,
            vocab,
        )
        constants = dict(
            DIVERGENCE=DIVERGENCES[divergence],
            DIVERGENCE_GRAD=divergence_grad,
            HAS_CE=has_ce,
            STUDENT_SOFTCAP=student_softcap > 0.0,
            TEACHER_SOFTCAP=teacher_softcap > 0.0,
            COMPUTE_GRAD=compute_grad,
            PRECISE=precise,
            PRECISE_GRAD=exp_precision(student_logits.dtype, grad.dtype)[1],
            FAST_MATH=device.type == "cuda",  # inline PTX: not in the interpreter
            GRAD_IN_ROW=grad_in_row,
            RATIO_IN_TEACHER=ratio_in_teacher,
            BLOCK_V=block_v,
            SLICE_V=slice_v,
            SPLITS=splits,
            SPLITS_POW2=max(2, triton.next_power_of_2(splits)),
            MERGED=merged,
            MERGED_POW2=max(2, triton.next_power_of_2(merged)),
            SHARDED=shard is not None,
            num_warps=config.num_warps,
            **({} if config.num_stages is None else {"num_stages": config.num_stages}),
        )
        if not split:
            _distill_kernel[(n_rows, 1)](*args, STEP=WHOLE_ROW, **constants)
        else:
            _distill_kernel[(n_rows, splits)](*args, STEP=SLICE_STATISTICS, **constants)
            if shard is not None:
                shard.all_reduce(pass_one)
            if jsd:
                _distill_kernel[(n_rows, splits)](*args, STEP=SLICE_MIXTURE, **constants)
                if shard is not None:
                    shard.all_reduce(mixture)
            _distill_kernel[(n_rows, splits if compute_grad else 1)](*args, STEP=SLICE_FINISH, **constants)
    return loss, divergence_rows, ce if has_ce else None


__all__ = [
    "DIVERGENCES",
    "PROGRAMS_PER_SM",
    "SPLIT_DIVERGENCES",
    "DistillLaunchConfig",
    "ShardSlots",
    "default_distill_launch_config",
    "distill_chunk",
    "shard_launch_config",
    "shard_slices",
    "target_programs",
]
