"""The chunk engine shared by every chunk loss and front end (the single-device op :mod:`lightning_flce.op`, the
vocab-parallel op :mod:`lightning_flce.parallel.op`, the RL ops :mod:`lightning_flce.rl.logprobs_op` and
:mod:`lightning_flce.rl.policy_op`):
the chunk-size rule, the target check, the chunk loop (:func:`run_chunks`), the fp16 gradient scaling, and the
backward of the gradients computed in forward.

Per chunk of C tokens, :func:`run_chunks` runs::

    logits = x_c @ W.T (+ b)                      # [C, V] in the compute dtype, one reused buffer
    aux = a_c @ W_aux.T (+ b_aux)                 # only with an auxiliary head (a teacher): a second buffer
    loss(logits, target_c, rows_c, side_c) -> per-row outputs; logits := d loss / d logits
    dX_c = logits @ W                              # written into grad_input
    dW (+)= logits.T @ x_c                         # lightning_flce.accumulate, no [V, H] temporary
    db += logits.sum(0)

where ``loss`` is a :class:`~lightning_flce.chunk_loss.ChunkLoss` (the plug-in interface: its per-token side
inputs ``side_c`` gathered for the chunk's rows (and its auxiliary head's logits, no gradient), its named per-token
outputs, its workspace and fp16 bound);
:mod:`lightning_flce.losses` has the cross-entropy (a backend's chunk kernel on the whole vocabulary, or the
vocab-parallel softmax around its all-reduces), the log-probabilities and the policy losses. The cross-entropy's
row loss is
``ce_scale * ce + z_scale * z-loss`` with ``ce_scale``/``z_scale`` of shape [1] (shared) or [N] (per token): one
kernel serves "mean" (1 / the normalizer), "sum" (1), per-token weights (the weights times those), and the
per-token grad_output of "none"'s backward.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_flce._compat import TORCH_VERSION, resolved_annotations, triton_usable
from lightning_flce.accumulate import GradWeightAccumulator, head_rows, round_into_head_, rounded_view
from lightning_flce.chunk_loss import DEFAULT_WORKSPACE_COPIES, AuxiliaryHead, ChunkLoss, gather_side_inputs
from lightning_flce.kernels import LOW_PRECISION, gradient_in_logits_rows, softmax_dtype
from lightning_flce.kernels.scale import scale_, scale_into
from lightning_flce.op_autograd import OpWithAutograd
from lightning_flce.options import WIDE_LOGITS_PRECISIONS

_MiB = 1 << 20
# A chunk's logits may take a quarter of the memory floor (dX + dW), within these bounds.
_MIN_CHUNK_BYTES = 32 * _MiB
_MAX_CHUNK_BYTES = 2048 * _MiB
_CHUNK_ALIGN = 64
# On the GPU a chunk has at least this many rows (memory permitting, see default_chunk_size): every chunk
# reads and writes the whole dW accumulator (8 V H bytes in fp32), which costs about 760 / rows of the
# chunk's dW GEMM on an H100/H200 (2 rows H V FLOP at ~800 TFLOP/s vs ~4.2 TB/s); the profile of the
# quarter-floor rule showed it as the largest loss (results/*_run8_*: dW 30% over its FLOP floor).
_MIN_TRITON_CHUNK_ROWS = 4096
#: On the GPU (backends with ``large_chunks``) a chunk loss's auxiliary head (a distillation teacher) runs on the
#: chunk in blocks of at most this many rows: its logits GEMM and the chunk loss go block by block, while the main
#: head's logits, dX and dW GEMMs keep the chunk's rows. Its buffer is then a fixed 256 x V, and the main head's
#: chunk gets the rest of the memory budget, instead of half of it (at the issue's shapes the cross-entropy's own
#: rows). Each chunk fewer is one read and write less of the whole fp32 dW accumulator, about 2% of the
#: FLOP floor of a distillation step at N = 8192 (see _MIN_TRITON_CHUNK_ROWS); at the issue's shapes 2 / 3 / 4
#: chunks instead of 4 / 5 / 8 (tests/test_distill.py). 256 rows keep the teacher's GEMM at 1000 or more output
#: tiles of 128 x 256 for V >= 128K, and one launch of the row kernel at about one program per SM slot (two
#: programs an SM at its 64 registers, 132 SMs).
AUXILIARY_BLOCK_ROWS = 256
# A chunk loss with an auxiliary head (two [C, V] buffers) and a 16-bit dW accumulator (an explicit
# ``accum_dtype`` equal to the 16-bit weight's dtype: the memory-lean choice) lets its buffers grow to this share
# of the floor only: the buffers are the peak's only term over dW + dX, so they set it: 1.75 floors (Liger's fused
# JSD, chunked by 1024 rows, peaks at 1.87 floors at N 8192, H 4096, V 128256; issue 37). Beside a wider
# accumulator, which dW's final rounding reuses (GradWeightAccumulator), the peak is the accumulator, dX and the
# buffers, and the buffers get dW's own size (V x H in the compute dtype, the floor less dX): for a 16-bit weight
# the peak stays within 3 dW + dX (the accumulator plus a separate cast's output, this loss's peak before the
# rounding reused the accumulator), and at the shapes under Liger's fused JSD's (one chunk more at V
# 128256, 3 instead of 2; the same 3 and 4 at 151936 and 256000).
_NARROW_ACCUMULATOR_FLOOR_SHARE = 0.75
_FLOOR_LIMITED_ALIGN = 256
# The PyTorch path works on a few copies of a chunk in the softmax dtype (fp32, or fp64; the chunk loss's
# workspace_copies), and needs larger chunks than the GPU to keep its GEMMs efficient (CPU, 4096x1024x32000
# fp32: 64-row chunks run 1.4x slower than 320-row ones).
_TORCH_PATH_MIN_CHUNK_BYTES = 128 * _MiB
# fp16 logit gradients. d loss / d logit is ~ p / N for "mean": below fp16's smallest subnormal (6e-8)
# once N V > 2^24, so it would flush to zero, and torch's GradScaler cannot help (its scale reaches only
# backward, after the gradients computed in forward were rounded). The chunk loop scales the logit
# gradient by a power of two so its largest possible element is _FP16_LOGIT_GRAD_MAX (64x headroom
# below fp16's 65504), and takes the factor back out in the GEMM epilogues (alpha, in fp32).
_FP16_LOGIT_GRAD_MAX = 2.0**10
# fp16 gradients returned through backward are stored pre-multiplied by a power of two (backward divides
# it out while it multiplies by grad_output), sized so their bound stays at or below this.
_FP16_STORED_GRAD_MAX = 2.0**14
#: ``logits_precision="fp32_compensated"`` on the Triton path with the fp32 buffer (:data:`RELATIVE_16BIT_LOGITS`
#: off): the logits GEMM's epilogue writes each row's
#: log-sum-exp partials over its column tiles (:class:`~lightning_flce.kernels.compensated_gemm.TileLse`) and
#: the chunk kernel takes the LSE from them, reading the fp32 logits once instead of twice (options without
#: label smoothing, no statistics; front ends that pass ``chunk_lse_from_tiles=True``). Tested under Triton's
#: interpreter and on CUDA (run86, run88), and off: with libdevice's exp the epilogue cost the GEMM more than the
#: saved read saves (the op 0.8-4.6% slower at the four benchmark shapes, run86, row ``flce_fp32comp_tilelse``);
#: with ``tl.exp`` there 0-1.7% faster (run88), inside the run's spread.
LSE_FROM_LOGITS_GEMM = False
#: ``logits_precision="fp32_compensated"`` on the Triton path where the chunk kernel needs only each row's LSE and
#: target logit (no label smoothing, no statistics; front ends that pass ``chunk_lse_from_tiles=True``): the
#: logits GEMM computes both in fp32 (its epilogue the LSE partials, a small kernel the target logits:
#: :class:`~lightning_flce.kernels.compensated_gemm.TileLse` with ``target_logit``), and the chunk's buffer holds
#: each logit minus its column tile's maximum, rounded to
#: the 16-bit compute dtype, for the gradient only (bf16: an absolute error of 2^-8 |z - max|, so the gradient of
#: the logits near the maximum, the ones that carry it, is about as exact as from fp32 logits). The buffer is the
#: default's (no fp32 [C, V] buffer), the chunk kernel reads it once, and the loss and LSE are those of the fp32
#: logits. Off (or with smoothing / statistics): the fp32 buffer of ``"fp32"``.
RELATIVE_16BIT_LOGITS = True
#: ... for vocabularies of at least this many columns. Below, the fp32 buffer is faster: a row of fp32 logits is
#: then short enough (128 KiB at V = 32000) for the chunk kernel's second read to come from L2, so the 16-bit
#: buffer saves little while the GEMM's LSE epilogue still costs (H200, run90: the op 2.5% slower at
#: 16384x4096x32000 on the 16-bit buffer, 0.6-1.5% faster at V = 128256 / 151936 / 256000).
RELATIVE_MIN_VOCAB = 65536


def tile_stats_suffice(gemm_mode: Optional[str], label_smoothing: float, compute_stats: bool) -> bool:
    """Whether the chunk kernel can take what it needs from the logits GEMM's tile statistics (the LSE partials
    and target logits of :class:`~lightning_flce.kernels.compensated_gemm.TileLse`): the compensated Triton GEMM
    (``gemm_mode`` of :class:`WideLogitsGemm`), no label smoothing and no statistics (their sums need every
    logit)."""
    return gemm_mode == "triton" and label_smoothing == 0.0 and not compute_stats


def relative_16bit_logits(
    gemm_mode: Optional[str], vocab: int, label_smoothing: float, compute_stats: bool
) -> bool:
    """Whether the cross-entropy's chunk buffer holds :data:`RELATIVE_16BIT_LOGITS`' 16-bit relative logits (the
    memory callback's model asks it; the engine asks :func:`_relative_logits` with the chunk loss's answer)."""
    return _relative_logits(tile_stats_suffice(gemm_mode, label_smoothing, compute_stats), vocab)


def _relative_logits(tiles_suffice: bool, vocab: int) -> bool:
    return RELATIVE_16BIT_LOGITS and vocab >= RELATIVE_MIN_VOCAB and tiles_suffice


def default_chunk_size(
    n_rows: int,
    vocab: int,
    hidden: int,
    itemsize: int,
    large_chunks: bool,
    workspace_copies: int = DEFAULT_WORKSPACE_COPIES,
    auxiliary_itemsize: int = 0,
    floor_share: float = 1.0,
    auxiliary_block_rows: Optional[int] = None,
) -> int:
    """Tokens per chunk.

    The chunk's logits get a quarter of the memory floor (dX + dW). With ``large_chunks`` (a backend whose
    softmax works in place, on the GPU) a chunk gets at least ``_MIN_TRITON_CHUNK_ROWS`` rows as long as its logits stay within the floor itself, so the per-chunk
    dW accumulator traffic stays small next to the GEMMs; peak extra memory is then at most about the
    floor for the logits plus the accumulator (see ``accum_dtype``). Otherwise a row costs the chunk loss's
    ``workspace_copies`` of the logits in the softmax dtype (its PyTorch twin's workspace). A chunk loss with an
    :class:`~lightning_flce.chunk_loss.AuxiliaryHead` adds its logits buffer, ``auxiliary_itemsize`` bytes a
    logit, to every row's cost (its softmax-dtype copies are part of the twin's ``workspace_copies``).
    ``floor_share``: the share of the floor the buffers may grow to on the GPU (``_NARROW_ACCUMULATOR_FLOOR_SHARE``
    for two buffers beside a 16-bit accumulator). ``auxiliary_block_rows``: the auxiliary head runs in blocks of
    that many rows (:data:`AUXILIARY_BLOCK_ROWS`), so its buffer is a fixed cost, not a cost per row of the chunk.
    """
    floor_bytes = (n_rows + vocab) * hidden * itemsize
    min_bytes = _MIN_CHUNK_BYTES if large_chunks else _TORCH_PATH_MIN_CHUNK_BYTES
    budget = max(floor_bytes // 4, min_bytes)
    bytes_per_row = vocab * (itemsize if large_chunks else workspace_copies * max(itemsize, 4))
    auxiliary_row_bytes = vocab * auxiliary_itemsize
    block_bytes = 0
    if auxiliary_block_rows is None:
        bytes_per_row += auxiliary_row_bytes
    else:
        block_bytes = auxiliary_block_rows * auxiliary_row_bytes

    def rows_within(budget_bytes: int) -> int:
        if block_bytes:
            rows = (budget_bytes - block_bytes) // bytes_per_row
            if rows >= int(auxiliary_block_rows or 0):
                return rows
            # a chunk smaller than a block is one block: the auxiliary buffer has the chunk's rows
            return budget_bytes // (bytes_per_row + auxiliary_row_bytes)
        return budget_bytes // bytes_per_row

    align = _CHUNK_ALIGN
    wanted = _MIN_TRITON_CHUNK_ROWS * bytes_per_row + block_bytes
    cap = int(floor_bytes * floor_share)
    if large_chunks and wanted > budget:
        if wanted <= cap:
            budget = wanted
        elif cap > budget:
            # Limited by the floor: whole multiples of 256 rows. cuBLAS's fp16 dX GEMM came out 1.3x less
            # accurate than naive's at 576 rows (4096 x 512 x 32003, sum/none); 512 and 768 rows matched it.
            budget, align = cap, _FLOOR_LIMITED_ALIGN
    budget = min(budget, _MAX_CHUNK_BYTES)
    rows = max(_CHUNK_ALIGN, rows_within(budget) // align * align)
    return int(min(rows, max(n_rows, 1)))


def auxiliary_block_rows(large_chunks: bool) -> Optional[int]:
    """Rows per block of an auxiliary head within a chunk: :data:`AUXILIARY_BLOCK_ROWS` on the GPU; None (the whole
    chunk) on the PyTorch path, whose chunk rule already counts its twin's workspace per row."""
    return AUXILIARY_BLOCK_ROWS if large_chunks else None


def chunk_rows(
    chunk_size: Optional[int],
    n_rows: int,
    n_valid: int,
    vocab: int,
    hidden: int,
    compute_dtype: torch.dtype,
    large_chunks: bool,
    workspace_copies: int = DEFAULT_WORKSPACE_COPIES,
    auxiliary_dtype: Optional[torch.dtype] = None,
    narrow_accumulator: bool = False,
) -> int:
    """Rows per chunk: a user's ``chunk_size`` as given; else :func:`default_chunk_size` of the call's shape
    (``n_rows`` tokens, ignored ones included, so the fake implementation knows it too), balanced over the
    ``n_valid`` rows that run (:func:`balanced_chunk_rows`). The wide-logits precisions take the same rows: their
    fp32 buffer holds the 16-bit gradient in its own rows (:func:`~lightning_flce.kernels.gradient_in_logits_rows`),
    so it is exactly one default chunk buffer more (and :data:`RELATIVE_16BIT_LOGITS`'s 16-bit buffer is the
    default's). ``auxiliary_dtype``: the compute dtype of the chunk loss's
    :class:`~lightning_flce.chunk_loss.AuxiliaryHead` (None: none), whose buffer is counted too (as the main head's:
    in its compute dtype): per row of the chunk on the PyTorch path, as one block of :func:`auxiliary_block_rows`
    on the GPU. The two buffers of an auxiliary head get dW's own size of the floor (V x H of dX + dW), or with
    ``narrow_accumulator`` (dW accumulates in the 16-bit weight's dtype by the caller's choice)
    ``_NARROW_ACCUMULATOR_FLOOR_SHARE`` of it."""
    if chunk_size:
        return int(chunk_size)
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    auxiliary_itemsize = (
        0 if auxiliary_dtype is None else torch.empty((), dtype=auxiliary_dtype).element_size()
    )
    floor_share = 1.0
    if auxiliary_dtype is not None:
        floor_share = _NARROW_ACCUMULATOR_FLOOR_SHARE if narrow_accumulator else vocab / (n_rows + vocab)
    max_rows = default_chunk_size(
        n_rows,
        vocab,
        hidden,
        itemsize,
        large_chunks,
        workspace_copies,
        auxiliary_itemsize,
        floor_share,
        auxiliary_block_rows(large_chunks) if auxiliary_dtype is not None else None,
    )
    align = _FLOOR_LIMITED_ALIGN if large_chunks else _CHUNK_ALIGN
    return balanced_chunk_rows(n_valid, max_rows, align)


def target_range_error(
    target: Tensor, vocab: int, ignore_index: int, n_bad: Optional[int] = None
) -> ValueError:
    """The error for targets outside ``[0, vocab)`` that are not ``ignore_index`` (a host sync)."""
    flat_target = target.reshape(-1)
    bad = flat_target[(flat_target != ignore_index) & ((flat_target < 0) | (flat_target >= vocab))]
    count = bad.numel() if n_bad is None else n_bad
    return ValueError(
        f"{count} target(s) outside [0, {vocab}) and not ignore_index={ignore_index}, e.g. {bad[:5].tolist()}"
    )


def check_targets(
    target: Tensor, valid: Tensor, vocab: int, ignore_index: int, extra: Sequence[Tensor] = ()
) -> Tuple[int, List[float]]:
    """Raise on targets outside [0, V) other than ignore_index; return the number of valid rows and the
    values of the 0-d tensors ``extra``.

    One host sync for all of them.
    """
    out_of_range = valid & ((target < 0) | (target >= vocab))
    values = torch.stack([out_of_range.sum().double(), valid.sum().double(), *(v.double() for v in extra)])
    n_bad, n_valid, *extra_values = values.tolist()
    if n_bad:
        raise target_range_error(target, vocab, ignore_index, int(n_bad))
    return int(n_valid), extra_values


def inverse_scales(scales: GradScales, compute_dtype: torch.dtype, device: torch.device) -> Tensor:
    """fp32 [3]: 1 / the factors the fp16 dX, dW, d bias carry (empty for other dtypes), for backward."""
    if compute_dtype != torch.float16:
        return torch.empty(0, dtype=torch.float32, device=device)
    inverse = torch.empty(3, dtype=torch.float32, device=device)
    for i, factor in enumerate(scales[1:]):
        inverse[i].fill_(1.0 / factor)  # a fill kernel each: no host-to-device copy to wait for
    return inverse


def valid_rows(valid: Tensor, n_valid: int) -> Optional[Tensor]:
    """Indices of the rows that carry a loss (None when all do), without a host sync."""
    if n_valid == valid.numel():
        return None
    return torch.argsort(valid.to(torch.int8), descending=True, stable=True)[:n_valid]


class GradScales(NamedTuple):
    """Powers of two of the fp16 gradient scaling (all 1 elsewhere): ``logits`` multiplies the logit
    gradient inside the chunk loop; the others are what the returned dX, dW and d bias are multiplied by
    (the caller divides them out)."""

    logits: float = 1.0
    grad_input: float = 1.0
    grad_weight: float = 1.0
    grad_bias: float = 1.0


def _pow2_at_most(value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        return 1.0
    return 2.0 ** max(-60, min(60, math.floor(math.log2(value))))


def fp16_bound_stats(
    x2: Tensor,
    loss: ChunkLoss,
    *,
    keep_scaled: bool,
    weight_dtype: torch.dtype,
) -> List[Tensor]:
    """The device-side inputs of :func:`_fp16_grad_scales` (0-d fp32): the largest per-token bound ``b``
    (:meth:`~lightning_flce.chunk_loss.ChunkLoss.fp16_logit_grad_bound`: every logit-gradient element of the
    token is at most ``b``, and a row's elements sum to at most ``2 b``), the sum of the per-token bounds (for a
    shared bound: ``b`` once), and max|x| when dW is stored scaled (``keep_scaled`` with an fp16 weight).
    """
    token_bound = loss.fp16_logit_grad_bound().float()
    if token_bound.numel() == 0:  # per-token scales of an empty batch ("none" backward)
        token_bound = token_bound.new_zeros(1)
    stats = [token_bound.max(), token_bound.sum()]
    if keep_scaled and weight_dtype == torch.float16:
        stats.append(x2.abs().amax().float() if x2.numel() else torch.zeros((), device=x2.device))
    return stats


def _fp16_grad_scales(
    bounds: Sequence[float],
    n_valid: int,
    per_row_scale: bool,
    *,
    keep_scaled: bool,
    grad_input_fp16: bool,
    bias_dtype: Optional[torch.dtype],
) -> GradScales:
    """:class:`GradScales` for fp16 GEMMs from :func:`fp16_bound_stats`' values: the stored dX row is at
    most ``2 b max|W|``, a dW row at most ``sum(b) max|x|`` (max|x| is there when dW is stored scaled),
    and d bias at most ``sum(b)``. ``grad_input_fp16``: an fp16 dX is returned or kept for backward."""
    bound, bound_sum, *x_max = bounds
    total = bound_sum if per_row_scale else bound_sum * max(n_valid, 1)
    logits_scale = _pow2_at_most(_FP16_LOGIT_GRAD_MAX / bound) if bound > 0 else 1.0
    # dX: 2 b max|W| * (logits_scale / 64) = 32 max|W| at most (fp16 weights never come near 2000).
    stored_input = logits_scale / 64 if keep_scaled and grad_input_fp16 else 1.0
    # A zero bound (no valid rows, all-zero hidden states, zero weights) means zero gradients: any scale does.
    weight_bound = total * x_max[0] if x_max else 0.0
    stored_weight = _pow2_at_most(_FP16_STORED_GRAD_MAX / weight_bound) if weight_bound > 0 else 1.0
    stored_bias = (
        _pow2_at_most(_FP16_STORED_GRAD_MAX / total)
        if keep_scaled and bias_dtype == torch.float16 and total > 0
        else 1.0
    )
    return GradScales(logits_scale, stored_input, stored_weight, stored_bias)


def run_chunks(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    loss: ChunkLoss,
    *,
    rows: Optional[Tensor],
    n_valid: int,
    chunk_size: int,
    compute_dtype: torch.dtype,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    accum_dtype: Optional[torch.dtype],
    logits_precision: str = "input",
    triton_logits_gemm: bool = False,
    grad_input_dtype: torch.dtype,
    keep_scaled: bool = False,
    fp16_bounds: Optional[Sequence[float]] = None,
    grad_weight_dtype: Optional[torch.dtype] = None,
    auxiliary_block_rows: Optional[int] = None,
) -> Tuple[Optional[Tensor], ...]:
    """The chunk loop shared by every chunk loss and front end (:mod:`lightning_flce.op`,
    :mod:`lightning_flce.parallel`, :mod:`lightning_flce.rl.logprobs_op`, :mod:`lightning_flce.rl.policy_op`).

    Over chunks of the ``rows`` that carry a loss (all rows when None): logits GEMM into one reused
    buffer, the chunk loss ``loss(logits, target, rows, side, compute_grad=, grad_out=)`` (a
    :class:`~lightning_flce.chunk_loss.ChunkLoss`: it returns its per-row outputs and overwrites the logits
    with their gradient), then dX rows, the dW accumulation and d bias.

    Returns the loss's per-token outputs ([N] or [N, width] each in the order of ``loss.outputs()``, 0 or the
    spec's ``fill`` for rows that carry no loss; empty for inactive ones), the gradients: dX [N, H] in
    ``grad_input_dtype``, dW in the weight's dtype, d bias; None for those not asked for, and their
    :class:`GradScales`. Per-token outputs whose spec has no dtype are in
    :func:`~lightning_flce.kernels.softmax_dtype` of ``compute_dtype``. ``accum_dtype`` is dW's accumulator dtype,
    None for the automatic choice (see :func:`accumulator_dtype`).
    With fp16 GEMMs the logit gradient is scaled (see ``_FP16_LOGIT_GRAD_MAX``; the loss's
    ``linear_inputs`` carry the factor); ``keep_scaled`` returns
    the gradients kept or returned in fp16 (dX: x's dtype or ``grad_input_dtype``, which may be wider for
    a later reduction or narrower for backward to widen) pre-multiplied by the scales in :class:`GradScales`
    (for a backward that multiplies them by grad_output anyway), otherwise every gradient is returned
    unscaled. ``fp16_bounds``: the values of :func:`fp16_bound_stats`, when the caller has read them
    already. ``grad_weight_dtype``: dW's accumulator dtype, and dW is then returned as its
    :class:`~lightning_flce.accumulate.GradWeightAccumulator`, unrounded, for the caller to keep for backward
    (:func:`saved_gradients`, :func:`finish_saved_grads`; see :func:`saved_grad_weight_dtype`).
    ``triton_logits_gemm``: the chunk kernels are the "triton" backend's, so
    ``logits_precision="fp32_compensated"`` may run its Triton GEMM (see :class:`WideLogitsGemm`), and where
    ``loss.tile_stats_suffice()`` its tile statistics may replace the chunk kernel's first pass.
    A ``loss.auxiliary_head()`` (a distillation teacher) gets its chunk logits computed beside the main head's, for
    the same rows and with the same ``logits_precision``, without a gradient (:class:`_AuxiliaryLogits`); with
    ``auxiliary_block_rows`` its GEMM and the chunk loss run on blocks of at most that many of the chunk's rows
    (the loss sees each block as a chunk of its own; :data:`AUXILIARY_BLOCK_ROWS`).
    """
    hidden = x.shape[-1]
    vocab = weight.shape[0]
    x2 = x.reshape(-1, hidden)
    target = target.reshape(-1)
    n_rows = x2.shape[0]
    device = x.device

    weight_c = weight.to(compute_dtype)
    # logits_precision "fp32" / "fp32_compensated" with 16-bit GEMMs: the logits GEMM accumulates and writes
    # fp32 (no rounding of the logits to 16 bits; "fp32_compensated" also compensates the sum over H), the bias
    # is added in fp32; the logit gradient goes to the dX/dW GEMMs in their operand dtype, written into the
    # second half of each fp32 row (gradient_in_logits_rows: no second [C, V] buffer).
    wide_logits = logits_precision in WIDE_LOGITS_PRECISIONS and compute_dtype in LOW_PRECISION
    bias_c = bias.to(torch.float32 if wide_logits else compute_dtype) if bias is not None else None
    logits_gemm = (
        WideLogitsGemm(
            weight_c, compensated=logits_precision == "fp32_compensated", triton=triton_logits_gemm
        )
        if wide_logits
        else None
    )
    # The GEMM's LSE partials (and target logits) for the chunk kernel, where it needs nothing else of the logits.
    gemm_mode = logits_gemm.mode if logits_gemm is not None else None
    tiles_suffice = gemm_mode == "triton" and loss.tile_stats_suffice()
    relative_logits = _relative_logits(tiles_suffice, vocab)
    logits_dtype = torch.float32 if wide_logits and not relative_logits else compute_dtype
    # One buffer for the largest chunk (rows x V / 128 x 8 bytes: 1/64 of the fp32 logits at 128-wide tiles, plus
    # 4 bytes a row for the target logits), sliced per chunk.
    tile_lse = None
    if tiles_suffice and (relative_logits or LSE_FROM_LOGITS_GEMM):
        tile_lse = logits_gemm.empty_tile_lse(
            min(chunk_size, n_valid), vocab, softcap=loss.softcap, with_target_logit=relative_logits
        )

    auxiliary = loss.auxiliary_head()
    auxiliary_logits = (
        _AuxiliaryLogits(
            auxiliary, logits_precision=logits_precision, triton_logits_gemm=triton_logits_gemm, vocab=vocab
        )
        if auxiliary is not None
        else None
    )

    loss_dtype = softmax_dtype(compute_dtype)
    specs = loss.outputs()
    outputs = [
        torch.full(spec.shape(n_rows), spec.fill, dtype=spec.dtype or loss_dtype, device=device)
        for spec in specs
    ]
    active_outputs = [i for i, spec in enumerate(specs) if spec.active]
    compute_grad = need_grad_input or need_grad_weight or need_grad_bias
    side = loss.side_inputs()
    per_token_inputs = tuple(name for name, value in side.items() if value.numel() > 1)
    scales = GradScales()
    if compute_grad and compute_dtype == torch.float16:
        if fp16_bounds is None:  # one host sync (the op passes them in, read with its target check)
            stats = fp16_bound_stats(x2, loss, keep_scaled=keep_scaled, weight_dtype=weight.dtype)
            fp16_bounds = torch.stack(stats).tolist()
        scales = _fp16_grad_scales(
            fp16_bounds,
            n_valid,
            any(name in per_token_inputs for name in loss.linear_inputs),
            keep_scaled=keep_scaled,
            grad_input_fp16=torch.float16 in (x.dtype, grad_input_dtype),
            bias_dtype=bias.dtype if bias is not None else None,
        )
    if scales.logits != 1.0:
        loss.scale_logit_gradient(scales.logits)
        side = loss.side_inputs()
    unscaled_outputs = tuple(i for i in active_outputs if specs[i].gradient_scaled and scales.logits != 1.0)

    grad_input = grad_weight = grad_bias = accum_path = None
    if need_grad_input:
        # Ignored rows keep a zero gradient; when every row is valid the chunks fill it all.
        grad_input = (torch.empty if rows is None else torch.zeros)(
            n_rows, hidden, dtype=grad_input_dtype, device=device
        )
    accum_dtype = grad_weight_dtype or accumulator_dtype(
        accum_dtype, weight, compute_dtype, n_chunks=-(-n_valid // chunk_size)
    )
    # With an fp64 accumulator (fp32 weights), dX's long reduction over V runs in fp64 too: cuBLAS's
    # fp32 accuracy over K = V varies with the chunk's shape, fp64 makes it a non-issue.
    weight_for_grad_input = (
        weight_c.double() if need_grad_input and accum_dtype == torch.float64 else weight_c
    )
    if need_grad_weight:
        grad_weight = GradWeightAccumulator.empty(
            vocab, hidden, accum_dtype, device, final_dtype=weight.dtype
        )
        accum_path = grad_weight.choose_path(x2[:0].to(compute_dtype))
    if need_grad_bias:  # summed in the loss dtype: fp32, or fp64 for fp64 GEMMs
        grad_bias = torch.zeros(vocab, dtype=loss_dtype, device=device)

    logits_buffer = None
    for chunk_index, start in enumerate(range(0, n_valid, chunk_size)):
        end = min(start + chunk_size, n_valid)
        if rows is None:
            x_c, t_c, chunk_rows_ = x2[start:end], target[start:end], slice(start, end)
        else:
            chunk_rows_ = rows[start:end]
            x_c, t_c = x2.index_select(0, chunk_rows_), target.index_select(0, chunk_rows_)
        x_c = x_c.to(compute_dtype)
        if logits_buffer is None:
            logits_buffer = torch.empty(min(chunk_size, n_valid), vocab, dtype=logits_dtype, device=device)
        logits = logits_buffer[: end - start]
        tile_lse_c = tile_lse.rows(end - start) if tile_lse is not None else None
        if logits_gemm is not None:
            logits_gemm(x_c, bias_c, out=logits, tile_lse=tile_lse_c, target=t_c if relative_logits else None)
        elif bias_c is not None:
            torch.addmm(bias_c, x_c, weight_c.t(), out=logits)
        else:
            torch.mm(x_c, weight_c.t(), out=logits)

        # d loss / d logits: over the logits, or (fp32 logits) in the GEMMs' operand dtype into the second
        # half of each fp32 row
        grad_logits = logits
        if logits_dtype != compute_dtype and (need_grad_input or need_grad_weight):
            grad_logits = gradient_in_logits_rows(logits, compute_dtype)
        # The loss on the chunk, or with an auxiliary head on blocks of its rows (each block's auxiliary logits
        # computed into the block-sized buffer just before the loss reads them).
        n_chunk = end - start
        blocked = auxiliary_logits is not None and auxiliary_block_rows and tile_lse_c is None
        block = auxiliary_block_rows if blocked else n_chunk
        for block_start in range(0, n_chunk, block):
            block_end = min(block_start + block, n_chunk)
            whole = block_end - block_start == n_chunk
            block_rows_ = chunk_rows_ if whole else _sub_rows(chunk_rows_, block_start, block_end)
            side_c = gather_side_inputs(side, per_token_inputs, block_rows_)
            if auxiliary_logits is not None:
                side_c = {
                    **side_c,
                    auxiliary_logits.name: auxiliary_logits(block_rows_, block_end - block_start),
                }
            block_slice = slice(block_start, block_end)
            grad_out = None if grad_logits is logits else grad_logits[block_slice]
            out = loss(
                logits[block_slice],
                t_c[block_slice],
                block_rows_,
                side_c,
                compute_grad=compute_grad,
                grad_out=grad_out,
                tile_lse=tile_lse_c if whole else None,
            )
            for i in active_outputs:
                value = out[i] / scales.logits if i in unscaled_outputs else out[i]
                _write_rows(outputs[i], block_rows_, value)

        if need_grad_input:
            _write_grad_input(grad_input, chunk_rows_, grad_logits, weight_for_grad_input, scales)
        if need_grad_weight:
            grad_weight.add(
                grad_logits,
                x_c,
                first=chunk_index == 0,
                path=accum_path,
                alpha=scales.grad_weight / scales.logits,
            )
        if need_grad_bias:
            grad_bias.add_(grad_logits.sum(dim=0, dtype=loss_dtype), alpha=scales.grad_bias / scales.logits)
        x_c = side_c = None  # before the next chunk's row gather (and its cast) allocates

    # Release the chunk buffer and the weight copies before dW's rounding to the weight's dtype (into the
    # accumulator's memory, see GradWeightAccumulator), or before the caller keeps the accumulator for backward.
    logits_buffer = logits = grad_logits = x_c = weight_c = weight_for_grad_input = bias_c = None
    auxiliary_logits = None
    tile_lse = tile_lse_c = None
    logits_gemm = None
    if need_grad_weight:
        if n_valid == 0:
            grad_weight.zero_()
        if grad_weight_dtype is None:
            grad_weight = grad_weight.result(weight.dtype)
    if need_grad_bias:
        grad_bias = grad_bias.to(bias.dtype)
    return (*outputs, grad_input, grad_weight, grad_bias, scales)


class _AuxiliaryLogits:
    """The logits of a chunk loss's :class:`~lightning_flce.chunk_loss.AuxiliaryHead` for a chunk's rows, without a
    gradient, in one reused buffer: ``input[rows] @ W.T (+ b)`` in the head's compute dtype, or with the wide
    precisions (``logits_precision`` "fp32" / "fp32_compensated" and a 16-bit compute dtype) written in fp32 by
    :class:`WideLogitsGemm`, as the main head's (the bias then added in fp32). Never the main head's 16-bit
    relative logits or tile statistics: the loss reads every logit of this head."""

    def __init__(
        self, head: AuxiliaryHead, *, logits_precision: str, triton_logits_gemm: bool, vocab: int
    ) -> None:
        self.name = head.name
        self.input = head.input.reshape(-1, head.input.shape[-1])
        self.compute_dtype = head.compute_dtype
        self.weight = head.weight.to(head.compute_dtype)
        wide = logits_precision in WIDE_LOGITS_PRECISIONS and head.compute_dtype in LOW_PRECISION
        self.bias = (
            head.bias.to(torch.float32 if wide else head.compute_dtype) if head.bias is not None else None
        )
        self.gemm = (
            WideLogitsGemm(
                self.weight, compensated=logits_precision == "fp32_compensated", triton=triton_logits_gemm
            )
            if wide
            else None
        )
        self.logits_dtype = torch.float32 if wide else head.compute_dtype
        self.vocab = vocab
        self.buffer: Optional[Tensor] = None

    def __call__(self, rows, n_rows: int) -> Tensor:
        """The [n_rows, V] logits of the chunk's ``rows`` (a slice or an index tensor), valid until the next call."""
        x_c = self.input[rows] if isinstance(rows, slice) else self.input.index_select(0, rows)
        x_c = x_c.to(self.compute_dtype)
        if self.buffer is None:  # the first chunk is the largest
            self.buffer = torch.empty(n_rows, self.vocab, dtype=self.logits_dtype, device=x_c.device)
        logits = self.buffer[:n_rows]
        if self.gemm is not None:
            self.gemm(x_c, self.bias, out=logits)
        elif self.bias is not None:
            torch.addmm(self.bias, x_c, self.weight.t(), out=logits)
        else:
            torch.mm(x_c, self.weight.t(), out=logits)
        return logits


def _scaled_mm(a: Tensor, b: Tensor, alpha: float, out: Optional[Tensor] = None) -> Tensor:
    """``alpha * a @ b`` with alpha in the GEMM's epilogue (before rounding to the output dtype)."""
    if alpha == 1.0:
        return torch.mm(a, b, out=out)
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)


def _write_grad_input(grad_input: Tensor, rows, logits: Tensor, weight: Tensor, scales: GradScales) -> None:
    """dX rows = d loss / d logits @ W, times ``scales.grad_input``."""
    if grad_input.dtype == weight.dtype:
        alpha = scales.grad_input / scales.logits
        if isinstance(rows, slice):
            _scaled_mm(logits, weight, alpha, out=grad_input[rows])
        else:
            _write_rows(grad_input, rows, _scaled_mm(logits, weight, alpha))
        return
    # A wider grad_input (fp32 x, fp16 GEMMs): the product stays scaled in fp16 (by logits / 64, in range:
    # see _fp16_grad_scales) and is unscaled after widening, so small rows do not underflow.
    product_scale = scales.logits / 64 if scales.logits != 1.0 else 1.0
    product = _scaled_mm(logits.to(weight.dtype), weight, product_scale / scales.logits).to(grad_input.dtype)
    if scales.grad_input != product_scale:
        product.mul_(scales.grad_input / product_scale)
    _write_rows(grad_input, rows, product)


def accumulator_dtype(
    accum_dtype: Optional[torch.dtype], weight: Tensor, compute_dtype: torch.dtype, n_chunks: int
) -> torch.dtype:
    """The dW accumulator's dtype: ``accum_dtype`` (checked by the front end: fp32, fp64 or the weight's), or
    for None the automatic choice, which widens only where rounding the running sum once per chunk
    would make dW less accurate than one unchunked GEMM. It follows the GEMMs' operand dtype, not the
    weight's storage: fp16/bf16 GEMMs (also an fp32 weight under autocast) accumulate in fp32, and fp32
    GEMMs in fp64 on GPUs with full-rate fp64 (there an fp64 GEMM is as fast as a non-TF32 fp32 one;
    dX's GEMM then runs in fp64 as well)."""
    if accum_dtype is not None:
        return accum_dtype
    if n_chunks > 1:
        if compute_dtype in LOW_PRECISION and weight.dtype in LOW_PRECISION + (torch.float32,):
            return torch.float32
        if compute_dtype == weight.dtype == torch.float32 and _has_full_rate_fp64(weight.device):
            return torch.float64
    return weight.dtype


def saved_grad_weight_dtype(
    x: Tensor,
    weight: Tensor,
    compute_dtype: torch.dtype,
    accum_dtype: Optional[torch.dtype],
    chunk_size: Optional[int],
    large_chunks: bool,
    *,
    workspace_copies: int = DEFAULT_WORKSPACE_COPIES,
    auxiliary_dtype: Optional[torch.dtype] = None,
) -> torch.dtype:
    """The dtype of the dW that "mean"/"sum" forward keeps for backward: its accumulator's, uncast.

    Backward casts it to the weight's dtype with grad_output folded into the same pass, instead of a cast
    in forward and a scaling pass in backward (fp16, whose grad_output is a loss scale, and any loss
    scaled before backward, e.g. gradient accumulation). The dtype follows the chunk count of the shape
    (every row valid), which the fake implementation knows; masked rows only lower the real count. The chunk
    loss's ``workspace_copies`` and ``auxiliary_dtype`` are those :func:`run_valid_rows` gives :func:`chunk_rows`:
    a count from another rule could keep a 16-bit accumulator for a call that runs in several chunks.
    """
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    vocab, hidden = weight.shape
    rows = chunk_rows(
        chunk_size,
        n_rows,
        n_rows,
        vocab,
        hidden,
        compute_dtype,
        large_chunks,
        workspace_copies,
        auxiliary_dtype=auxiliary_dtype,
    )
    return accumulator_dtype(accum_dtype, weight, compute_dtype, n_chunks=-(-n_rows // rows))


def saved_grad_input_dtype(
    x: Tensor, compute_dtype: torch.dtype, grad_weight_dtype: torch.dtype
) -> torch.dtype:
    """The dtype of the dX that "mean"/"sum" forward keeps for backward: the dX GEMM's output dtype when x is
    wider (fp32 hidden states under fp16/bf16 autocast), since dX holds that dtype's values anyway; backward
    widens it with grad_output folded in. Forward's peak (the training step's, as the head runs last) is then
    N H (x's itemsize - the GEMM's) bytes lower, and no chunk of dX needs a widened temporary.
    With an fp64 accumulator dX's GEMM runs in fp64 (see :func:`run_chunks`): it is kept in x's dtype."""
    if (
        compute_dtype in LOW_PRECISION
        and grad_weight_dtype != torch.float64
        and x.dtype.itemsize > compute_dtype.itemsize
    ):
        return compute_dtype
    return x.dtype


def saved_grad_dtypes(
    x: Tensor,
    weight: Tensor,
    compute_dtype: torch.dtype,
    accum_dtype: Optional[torch.dtype],
    chunk_size: Optional[int],
    large_chunks: bool,
    *,
    workspace_copies: int = DEFAULT_WORKSPACE_COPIES,
    auxiliary_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.dtype, torch.dtype]:
    """(dX, dW) dtypes that a "gradients in forward" call keeps for backward (:func:`saved_grad_input_dtype`,
    :func:`saved_grad_weight_dtype`); the fake implementations use them too."""
    weight_dtype = saved_grad_weight_dtype(
        x,
        weight,
        compute_dtype,
        accum_dtype,
        chunk_size,
        large_chunks,
        workspace_copies=workspace_copies,
        auxiliary_dtype=auxiliary_dtype,
    )
    return saved_grad_input_dtype(x, compute_dtype, weight_dtype), weight_dtype


def token_rows(x: Tensor) -> int:
    """The number of tokens (rows) of hidden states ``x`` [..., H] (0 for an empty hidden size)."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def run_valid_rows(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    loss: ChunkLoss,
    *,
    valid: Tensor,
    ignore_index: int,
    checks: Sequence[Tuple[Tensor, Callable[[], Exception]]] = (),
    large_chunks: bool,
    chunk_size: Optional[int],
    compute_dtype: torch.dtype,
    logits_precision: str,
    triton_logits_gemm: bool,
    needs: Tuple[bool, bool, bool],
    accum_dtype: Optional[torch.dtype],
    grad_input_dtype: torch.dtype,
    keep_scaled: bool = False,
    grad_weight_dtype: Optional[torch.dtype] = None,
    auxiliary_dtype: Optional[torch.dtype] = None,
) -> Tuple[Optional[Tensor], ...]:
    """The front ends' way into :func:`run_chunks` on the rows that carry a loss (``valid``, [N] bool; the others' target
    is ``ignore_index``): one host
    sync for the target check, the caller's ``checks`` (a 0-d count of bad values and the error to raise when it is
    not 0: temperatures, advantages) and the fp16 bounds, before any kernel; then the chunk size
    (:func:`chunk_rows`, with the loss's workspace and any auxiliary head's buffer) and the chunk loop.
    ``needs``: (dX, dW, d bias) asked for. Returns :func:`run_chunks`' tuple."""
    vocab, hidden = weight.shape
    target = target.reshape(-1)
    extra = [count for count, _ in checks]
    if any(needs) and compute_dtype == torch.float16:
        extra += fp16_bound_stats(
            x.reshape(-1, hidden), loss, keep_scaled=keep_scaled, weight_dtype=weight.dtype
        )
    n_valid, values = check_targets(target, valid, vocab, ignore_index, extra)
    for value, (_, error) in zip(values, checks):
        if value:
            raise error()
    fp16_bounds = values[len(checks) :]
    rows = chunk_rows(
        chunk_size,
        token_rows(x),
        n_valid,
        vocab,
        hidden,
        compute_dtype,
        large_chunks,
        loss.workspace_copies,
        auxiliary_dtype=auxiliary_dtype,
        # only a dtype the caller chose: the automatic one depends on the chunk count
        narrow_accumulator=accum_dtype is not None
        and accum_dtype == weight.dtype
        and accum_dtype in LOW_PRECISION,
    )
    return run_chunks(
        x,
        weight,
        target,
        bias,
        loss,
        rows=valid_rows(valid, n_valid),
        n_valid=n_valid,
        chunk_size=rows,
        compute_dtype=compute_dtype,
        logits_precision=logits_precision,
        triton_logits_gemm=triton_logits_gemm,
        need_grad_input=needs[0],
        need_grad_weight=needs[1],
        need_grad_bias=needs[2],
        accum_dtype=accum_dtype,
        grad_input_dtype=grad_input_dtype,
        keep_scaled=keep_scaled,
        fp16_bounds=fp16_bounds or None,
        grad_weight_dtype=grad_weight_dtype,
        auxiliary_block_rows=auxiliary_block_rows(large_chunks),
    )


def _has_full_rate_fp64(device: torch.device) -> bool:
    # P100, V100, A100, H100/H200, B200: fp64 at half the fp32 rate or better (others: 1/32 to 1/64).
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in (
        (6, 0),
        (7, 0),
        (8, 0),
        (9, 0),
        (10, 0),
    )


def _sub_rows(rows, start: int, end: int):
    """Rows ``start:end`` of a chunk's ``rows`` (a slice of the call's rows, or an index tensor)."""
    if isinstance(rows, slice):
        return slice(rows.start + start, rows.start + end)
    return rows[start:end]


def _write_rows(dest: Tensor, rows, values: Tensor) -> None:
    if isinstance(rows, slice):
        dest[rows] = values.to(dest.dtype)
    else:
        dest.index_copy_(0, rows, values.to(dest.dtype))


def balanced_chunk_rows(n_rows: int, max_rows: int, align: int) -> int:
    """Rows per chunk for as few chunks as ``max_rows`` allows, of about equal size (in ``align`` steps,
    never above ``max_rows``): 8192 rows at most 2304 apiece run as 4 x 2048, not 3 x 2304 + 1280 (same
    number of dW accumulator passes, less memory, no small last GEMM)."""
    if n_rows <= max_rows:
        return max(max_rows if n_rows == 0 else n_rows, 1)
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // n_chunks)
    return min(max_rows, -(-rows // align) * align)


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "lightning_flce::flce_scale_grads_", mutates_args=("grad_input", "grad_weight", "grad_bias")
)
@resolved_annotations
def flce_scale_grads_(
    grad_input: Tensor, grad_weight: Tensor, grad_bias: Tensor, scale: Tensor, inverse_scales: Tensor
) -> None:
    """Multiply the gradients computed in forward by grad_output (a no-op when it is 1), and by their
    ``inverse_scales`` where forward gave some (fp16)."""
    for i, grad in enumerate((grad_input, grad_weight, grad_bias)):
        if inverse_scales.numel():
            scale_(grad, scale.reshape(1).float() * inverse_scales[i])
        else:
            scale_(grad, scale)


@flce_scale_grads_.register_fake
def _(grad_input, grad_weight, grad_bias, scale, inverse_scales):
    return None


@torch.library.custom_op("lightning_flce::flce_cast_grad", mutates_args=())
@resolved_annotations
def flce_cast_grad(
    saved: Tensor, scale: Tensor, inverse_scales: Tensor, index: int, dtype: torch.dtype
) -> Tensor:
    """A gradient in ``dtype`` from forward's copy in another dtype (dX from the GEMM's narrower dtype, dW
    from a wider accumulator): ``saved * grad_output`` (and the fp16 inverse scale ``inverse_scales[index]``)
    in one pass, rounded once."""
    factor = scale.reshape(1).float()
    if inverse_scales.numel():
        factor = factor * inverse_scales[index]
    return scale_into(saved.new_empty(saved.shape, dtype=dtype), saved, factor)


@flce_cast_grad.register_fake
def _(saved, scale, inverse_scales, index, dtype):
    return saved.new_empty(saved.shape, dtype=dtype)


@torch.library.custom_op("lightning_flce::flce_round_grad_weight_", mutates_args=("head",))
@resolved_annotations
def flce_round_grad_weight_(
    head: Tensor, tail: Tensor, scale: Tensor, inverse_scales: Tensor, dtype: torch.dtype
) -> None:
    """dW from forward's wider accumulator kept in two blocks
    (:class:`~lightning_flce.accumulate.GradWeightAccumulator`): ``accumulator * grad_output`` (and the fp16
    inverse scale ``inverse_scales[1]``) rounded once to ``dtype`` into ``head``'s memory
    (:func:`~lightning_flce.accumulate.round_into_head_`), read back by
    :func:`~lightning_flce.accumulate.rounded_view`. No second allocation: backward's peak is the accumulator's."""
    factor = scale.reshape(1).float()
    if inverse_scales.numel():
        factor = factor * inverse_scales[1]
    round_into_head_(head, tail, dtype, factor)


@flce_round_grad_weight_.register_fake
def _(head, tail, scale, inverse_scales, dtype):
    return None


def saved_gradients(
    like: Tensor,
    grad_input: Optional[Tensor],
    grad_weight: Optional[GradWeightAccumulator],
    grad_bias: Optional[Tensor],
) -> List[Tensor]:
    """What a "gradients in forward" op returns and keeps for backward: dX, dW's two accumulator blocks (head,
    tail) and d bias, a distinct empty tensor (of ``like``'s device) for each one not computed (custom-op outputs
    may not alias each other)."""
    weight_parts = grad_weight.parts() if grad_weight is not None else (like.new_empty(0), like.new_empty(0))
    return [
        grad_input if grad_input is not None else like.new_empty(0),
        *weight_parts,
        grad_bias if grad_bias is not None else like.new_empty(0),
    ]


def saved_grad_weight_fakes(
    like: Tensor, weight: Tensor, accumulator: torch.dtype, needed: bool
) -> Tuple[Tensor, Tensor]:
    """The fake implementations' dW blocks (head, tail) of :func:`saved_gradients`, for an accumulator in
    ``accumulator`` (:func:`saved_grad_weight_dtype`); two empty tensors of ``like`` where dW is not ``needed``."""
    if not needed:
        return like.new_empty(0), like.new_empty(0)
    vocab, hidden = weight.shape
    rows = head_rows(vocab, accumulator, weight.dtype)
    return (
        weight.new_empty((rows, hidden), dtype=accumulator),
        weight.new_empty((vocab - rows, hidden), dtype=accumulator),
    )


def saved_gradient_fakes(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    needs: Tuple[bool, bool, bool],
    grad_input_dtype: torch.dtype,
    grad_weight_dtype: torch.dtype,
    compute_dtype: torch.dtype,
) -> List[Tensor]:
    """The fake implementations' gradient outputs of a "gradients in forward" op, as the real one returns them
    (:func:`saved_gradients`, then :func:`inverse_scales`): dX, dW's two blocks and d bias where ``needs`` says
    so (distinct empties elsewhere), and the fp16 scales' [3] (empty for other dtypes or without a gradient).
    Gradients are contiguous, as the chunk loop allocates them (not empty_like: a permuted x or weight)."""
    need_input, need_weight, need_bias = needs
    scaled = compute_dtype == torch.float16 and any(needs)
    return [
        x.new_empty(x.shape, dtype=grad_input_dtype) if need_input else x.new_empty(0),
        *saved_grad_weight_fakes(x, weight, grad_weight_dtype, need_weight),
        bias.new_empty(bias.shape) if need_bias and bias is not None else x.new_empty(0),
        x.new_empty(3 if scaled else 0, dtype=torch.float32),
    ]


def recomputed_gradient_fakes(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], needs: Tuple[bool, bool, bool]
) -> Tuple[Tensor, Tensor, Tensor]:
    """The fake implementations' outputs of a recomputing backward (reduction "none"): dX, dW and d bias in their
    inputs' shapes and dtypes where ``needs`` says so, distinct empties elsewhere."""
    need_input, need_weight, need_bias = needs
    return (
        x.new_empty(x.shape) if need_input else x.new_empty(0),
        weight.new_empty(weight.shape) if need_weight else x.new_empty(0),
        bias.new_empty(bias.shape) if need_bias and bias is not None else x.new_empty(0),
    )


def double_backward_error(
    why: str, op: str = "fused linear cross-entropy", alternative: Optional[str] = None
) -> str:
    if alternative is None:
        alternative = (
            "Compute a gradient penalty on the unfused loss (F.cross_entropy(F.linear(x, W), t)) for the steps"
            " that need it"
        )
    return f"{op} does not support double backward (create_graph=True): {why} without a graph. {alternative}".rstrip()


#: What a second backward through a "mean"/"sum" call of the cross-entropy should do instead.
_CROSS_ENTROPY_REPEAT_HINT = (
    "Use reduction='none' (it recomputes in backward; take .sum()/.mean() of its output) for retain_graph or"
    " repeated autograd.grad, or call the loss again"
)


def check_single_backward(
    ctx,
    op: str = "fused linear cross-entropy",
    repeat_hint: str = _CROSS_ENTROPY_REPEAT_HINT,
    why: str = "with reduction 'mean'/'sum' its gradients are computed in forward",
) -> None:
    """A call whose forward computed the gradients hands them out scaled in place by grad_output: a second
    backward through the same graph (``retain_graph=True``, repeated ``autograd.grad``) cannot reuse them,
    and they carry no graph of their own, so ``create_graph=True`` (a gradient penalty) cannot differentiate
    them (it would silently drop the penalty's term through the head). ``op`` names the call in the errors,
    ``repeat_hint`` says what to do instead of a second backward, ``why`` when its gradients are computed in
    forward."""
    if torch.is_grad_enabled():  # backward runs in grad mode only under create_graph=True
        raise RuntimeError(double_backward_error(why, op))
    if getattr(ctx, "grads_handed_out", False):
        raise RuntimeError(
            f"backward ran twice through the same {op} call: {why} and handed out once (scaled in place)."
            f" {repeat_hint}"
        )
    ctx.grads_handed_out = True


def refuse_double_backward(
    backward_op, op: str, why: str = "its backward recomputes the chunks", alternative: Optional[str] = ""
) -> None:
    """Register, as the autograd of a recomputing backward op (``"none"``'s, the log-probabilities'), an error:
    it is reached only by differentiating the gradients it returned (``create_graph=True``, then a second
    backward), which carry no graph. ``alternative``: what to do instead (None: the cross-entropy's hint)."""

    def refuse(ctx, *grads):
        raise RuntimeError(double_backward_error(why, op, alternative))

    backward_op.register_autograd(refuse, setup_context=lambda ctx, inputs, output: None)


def register_forward_grads_autograd(
    op, names: Sequence[str], *, op_name: str, repeat_hint: str, why: str
) -> OpWithAutograd:
    """The autograd of a custom op that computes its gradients in forward (the policy and distillation losses):
    its inputs named ``names`` (``x``, ``weight``, ``bias`` and ``need_grad_input`` / ``_weight`` / ``_bias``
    among them), its outputs ``(loss, *metrics, dX, dW head, dW tail, d bias, inverse scales)``: the gradients of
    :func:`saved_gradients` and :func:`run_chunks`'s scales (empty where not computed). Backward multiplies the
    saved gradients by grad_output (:func:`finish_saved_grads`) once, checked by :func:`check_single_backward`.
    Returns the op with that autograd (:class:`~lightning_flce.op_autograd.OpWithAutograd`)."""

    def setup_context(ctx, inputs, output) -> None:
        a = dict(zip(names, inputs))
        ctx.needs = (a["need_grad_input"], a["need_grad_weight"], a["need_grad_bias"])
        ctx.final_dtypes = (a["x"].dtype, a["weight"].dtype, None if a["bias"] is None else a["bias"].dtype)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(*output[-5:])

    def backward(ctx, grad_loss, *unused) -> Tuple[Optional[Tensor], ...]:
        grads = dict.fromkeys(names)
        if grad_loss is not None:
            check_single_backward(ctx, op_name, repeat_hint, why)
            *saved, inverse = ctx.saved_tensors
            gx, gw, gb = finish_saved_grads(saved, ctx.final_dtypes, grad_loss, inverse)
            grads["x"] = gx if ctx.needs[0] else None
            grads["weight"] = gw if ctx.needs[1] else None
            grads["bias"] = gb if ctx.needs[2] else None
        return tuple(grads.values())

    return OpWithAutograd(op, backward, setup_context=setup_context)


def finish_saved_grads(
    saved: Sequence[Tensor],
    final_dtypes: Sequence[Optional[torch.dtype]],
    grad_loss: Tensor,
    inverse_scales: Tensor,
) -> List[Tensor]:
    """Backward of "mean"/"sum": the gradients that forward computed (:func:`saved_gradients`: dX, dW's head and
    tail, d bias; empty tensors where not computed) times ``grad_loss``, in their ``final_dtypes`` (dX, dW, d
    bias). One kept in its final dtype is scaled in place. dW's wider accumulator is rounded into its head's
    memory with the scale folded in (:func:`flce_round_grad_weight_`); dX kept in the GEMM's narrower dtype is
    cast with the scale folded in. Each is rounded once. ``inverse_scales`` (fp32 [3], fp16 only; else empty)
    undoes the powers of two the fp16 gradients carry (:func:`inverse_scales`)."""
    grad_input, weight_head, weight_tail, grad_bias = saved
    grads = [grad_input, weight_head, grad_bias]
    in_place = list(grads)
    for i, dtype in enumerate(final_dtypes):
        if not grads[i].numel() or grads[i].dtype == dtype:
            continue
        if i == 1:
            flce_round_grad_weight_(weight_head, weight_tail, grad_loss, inverse_scales, dtype)
            grads[1] = rounded_view(weight_head, weight_tail, dtype)
        else:
            grads[i] = flce_cast_grad(grads[i], grad_loss, inverse_scales, i, dtype)
        in_place[i] = grads[i].new_empty(0)
    flce_scale_grads_(*in_place, grad_loss, inverse_scales)
    return grads


class WideLogitsGemm:
    """``x_c @ W.T (+ b)`` of 16-bit operands, accumulated and written in fp32 (the wide-logits precisions,
    :data:`~lightning_flce.options.WIDE_LOGITS_PRECISIONS`).

    ``logits_precision="fp32"`` (``compensated=False``): torch >= 2.8 on CUDA has the GEMM with an fp32 output
    (``out_dtype``; exact products, fp32 sums, no rounding to 16 bits). Elsewhere the documented fallback: the
    operands widened to fp32 (the same exact products and fp32 sums, at the fp32 GEMM rate), with the weight
    widened once per call ([V, H] fp32).

    ``logits_precision="fp32_compensated"`` (``compensated=True``): with ``triton`` (the "triton" backend) where
    Triton runs on the weight's device (CUDA, or the CPU under Triton's interpreter), the Triton GEMM whose sum
    over H is kept in short tensor-core chains (:mod:`lightning_flce.kernels.compensated_gemm`: chains of 256
    products summed from zero, their sums added in fp32; logits within ~5 fp32 ulps of exact at H = 4096). Elsewhere (the CPU, the "torch" backend) the documented
    fallback: the float64 GEMM rounded once to fp32 (exactly rounded logits), with the weight widened once per
    call ([V, H] fp64) and a [C, V] fp64 temporary per chunk; about 2x an fp32 GEMM's cost (the reference path).

    The bias is added in fp32 (one rounding, as the other paths).
    """

    #: The dtype of the weight copy each mode makes once per call (None: no copy).
    WEIGHT_COPY_DTYPES = {"widened": torch.float32, "float64": torch.float64}

    @staticmethod
    def mode_for(device: torch.device, *, compensated: bool, triton: bool) -> str:
        """Which GEMM runs for a weight on ``device``: "triton" (the compensated kernel), "float64" (its
        fallback), "native" (the fp32-output GEMM) or "widened" (its fallback)."""
        if compensated:
            return "triton" if triton and triton_usable(device) else "float64"
        return "native" if _HAS_MM_OUT_DTYPE and device.type == "cuda" else "widened"

    def __init__(self, weight: Tensor, *, compensated: bool = False, triton: bool = False) -> None:
        self.mode = self.mode_for(weight.device, compensated=compensated, triton=triton)
        if self.mode == "triton" and weight.stride(-1) != 1:
            weight = weight.contiguous()  # once per call (the kernel reads rows of W with unit stride)
        self.weight = weight
        if self.mode == "triton":  # imported here: only the Triton path needs the kernel module (and triton)
            from lightning_flce.kernels import compensated_gemm

            self.compensated_mm = compensated_gemm.compensated_logits_mm
            self.empty_tile_lse = functools.partial(compensated_gemm.empty_tile_lse, device=weight.device)
        wide_dtype = self.WEIGHT_COPY_DTYPES.get(self.mode)
        self.weight_wide = weight.to(wide_dtype) if wide_dtype is not None else None

    def __call__(
        self, x_c: Tensor, bias: Optional[Tensor], *, out: Tensor, tile_lse=None, target=None
    ) -> None:
        """``out = x_c @ W.T (+ b)``; ``tile_lse`` (the "triton" mode's, from :meth:`empty_tile_lse`): the
        rows' log-sum-exp partials, written by the kernel's epilogue, with ``target`` their target logits (and
        ``out`` may then be 16-bit: the logits relative to their tiles' maxima, see ``compensated_logits_mm``)."""
        if self.mode == "triton":  # the bias in the kernel's epilogue, in fp32
            self.compensated_mm(x_c, self.weight, out, bias, tile_lse=tile_lse, target=target)
            return
        assert tile_lse is None and target is None, "LSE partials come only from the Triton GEMM"
        if self.mode == "native":
            torch.mm(x_c, self.weight.t(), out_dtype=torch.float32, out=out)
        elif self.mode == "widened":
            torch.mm(x_c.float(), self.weight_wide.t(), out=out)
        else:
            out.copy_(torch.mm(x_c.double(), self.weight_wide.t()))  # rounded once to fp32
        if bias is not None:
            out.add_(bias)


# torch.mm(..., out_dtype=...) (aten::mm.dtype_out): torch 2.8 and later, CUDA only.
_HAS_MM_OUT_DTYPE = TORCH_VERSION >= (2, 8)
