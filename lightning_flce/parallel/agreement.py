"""The rank agreement of the vocab-parallel op: one small int64 all-reduce per call (one host sync), its first
collective, in which every rank learns every shard's ``(start, size)`` and every rank's view of the call.

A mismatch between ranks (different hidden states count, targets, per-token inputs (token weights), hidden size, chunk size,
dtype, ``requires_grad`` or ``sequence_parallel``) raises the same error on every rank instead of hanging in a
later collective. Every rank joins it even when its own argument checks failed (it then sends a flag instead
of its row), so a bad argument on one rank raises on all: there its own error, on the others one naming it.
Only errors raised before the group is known (no initialized ``torch.distributed``, a DTensor weight whose
mesh gives no group) stay on the rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_flce._compat import dtensor_api
from lightning_flce.chunk_loss import DEFAULT_WORKSPACE_COPIES
from lightning_flce.engine import chunk_rows
from lightning_flce.options import LOGITS_PRECISIONS, FLCEOptions
from lightning_flce.per_token import CROSS_ENTROPY_INPUTS, PER_TOKEN_INPUTS

_REDUCTION_CODES = {"mean": 0, "sum": 1, "none": 2}
# Columns of the per-rank row of the agreement all-reduce.
(
    _C_FAILED,  # 0, or 1 + the index in _PEER_ERROR_TYPES of the error this rank's argument checks raised
    _C_SEQUENCE_PARALLEL,
    _C_START_GIVEN,
    _C_START,
    _C_ROWS,
    _C_HIDDEN,
    _C_TOKENS,
    _C_VALID,
    _C_TARGET_MIN,
    _C_TARGET_MAX,
    _C_FINGERPRINT,
    _C_CHUNK,
    _C_DTYPES,
    _C_FLAGS,
    _C_OPTIONS,
    _C_PER_TOKEN,  # a fingerprint of the per-token inputs the ranks must agree on (0 without)
) = range(16)
_N_COLUMNS = 16
# The ranks whose checks passed raise the failed rank's error type: the first listed that it is, else RuntimeError
_PEER_ERROR_TYPES = (ValueError, TypeError, NotImplementedError, RuntimeError)
_FINGERPRINT_PRIME = 2**31 - 1  # the targets fingerprint (see _agreement_row)
#: a float dtype as an int the ranks can compare (Python's hash of a dtype's name differs per process)
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_PER_TOKEN_NAMES = " or ".join(CROSS_ENTROPY_INPUTS)  # in the errors


def call_group(weight: Tensor, group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The call's process group: a DTensor weight's 1-D mesh's (``group``, if given, must be the same), else
    ``group``. Its errors raise on this rank only (no group to agree through)."""
    api = dtensor_api()
    if api is None or not isinstance(weight, api.DTensor):
        return group
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"a DTensor weight must be Shard(0) on a 1-D mesh, got {weight.placements} on a {mesh.ndim}-D mesh"
        )
    mesh_group = mesh.get_group()
    if group is not None and group != mesh_group:
        raise ValueError("group differs from the process group of the DTensor weight's mesh")
    return mesh_group


def local_tensors(
    input: Tensor, weight: Tensor, bias: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Local tensors of a ``Shard(0)`` DTensor weight (and bias) on a 1-D mesh (see :func:`call_group`) whose
    ranks are in ascending order; a ``Replicate`` DTensor input becomes its local tensor. Plain tensors pass
    through."""
    api = dtensor_api()
    if api is None:  # pragma: no cover - torch without distributed
        return input, weight, bias
    DTensor, Replicate, Shard = api.DTensor, api.Replicate, api.Shard
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if tuple(weight.placements) != (Shard(0),):
            raise ValueError(
                f"a DTensor weight must be Shard(0) on a 1-D mesh, got {weight.placements} on a {mesh.ndim}-D mesh"
            )
        mesh_ranks = mesh.mesh.flatten().tolist()  # the same list on every rank: all raise or none
        if mesh_ranks != sorted(mesh_ranks):
            raise ValueError(
                f"a DTensor weight's mesh must list its ranks in ascending order, got {mesh_ranks}: shards are"
                " placed in process-group rank order (and torch's own scatter/gather disagree on such meshes)"
            )
        weight = weight.to_local()
        if isinstance(bias, DTensor):
            if tuple(bias.placements) != (Shard(0),) or bias.device_mesh != mesh:
                raise ValueError(
                    f"a DTensor bias must be Shard(0) on the weight's mesh, got {bias.placements}"
                )
            bias = bias.to_local()
    elif isinstance(bias, DTensor):
        raise ValueError("the bias is a DTensor but the weight is not")
    if isinstance(input, DTensor):
        if any(p != Replicate() for p in input.placements):
            raise ValueError(f"a DTensor input must be replicated, got {input.placements}")
        input = input.to_local()
    return input, weight, bias


def agreement_row(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    vocab_start: Optional[int],
    options: FLCEOptions,
    compute_dtype: torch.dtype,
    need_grad_input: bool,
    compute_stats: bool,
    sequence_parallel: bool,
    has_bias: bool = False,
    loss_code: int = 0,
) -> Tensor:
    """This rank's int64 row of the agreement table (see :func:`layout`): its shard, its tokens' count and
    target statistics, and codes of what must agree. ``loss_code``: a hash of a loss's own options (the
    distillation op's: divergence, temperature, the teacher's head), agreed with the others; ints and floats only
    (Python hashes those alike in every process)."""
    device = input.device
    ignore_index, reduction, chunk_size = options.ignore_index, options.reduction, options.chunk_size
    loss_options = (
        options.label_smoothing,
        options.lse_square_scale,
        options.softcap or 0.0,
        LOGITS_PRECISIONS.index(options.logits_precision),  # not the str: its hash differs per process
    )
    flat_target = target.reshape(-1).long()
    n_tokens = flat_target.numel()
    valid = flat_target != ignore_index
    big = torch.iinfo(torch.int64).max
    target_min = torch.where(valid, flat_target, big).amin() if n_tokens else flat_target.new_tensor(big)
    target_max = torch.where(valid, flat_target, -big).amax() if n_tokens else flat_target.new_tensor(-big)
    # sum over tokens of ((target, position) mixed, squared) mod a prime: not linear in the targets, so
    # differing targets (a permutation among positions included) change it but with chance ~1 / 2^31
    mixed = (
        (flat_target % _FINGERPRINT_PRIME + 1) * 65537 + torch.arange(n_tokens, device=device)
    ) % _FINGERPRINT_PRIME
    fingerprint = (mixed * mixed % _FINGERPRINT_PRIME).sum() % (1 << 40)
    # must agree as well (a bias on some ranks only would leave the others' logits without it)
    per_token = {name: getattr(options, name) for name in CROSS_ENTROPY_INPUTS}
    flags = (
        int(need_grad_input) | int(compute_stats) << 1 | _REDUCTION_CODES[reduction] << 2 | int(has_bias) << 4
    )
    for bit, value in enumerate(per_token.values(), start=5):  # each per-token input given or not
        flags |= int(value is not None) << bit
    # fp16 and bf16 have one itemsize: compare the dtypes themselves (input's and the GEMMs')
    dtypes = DTYPE_CODES.get(input.dtype, 0) * 16 + DTYPE_CODES.get(compute_dtype, 0)
    # Python's hash of ints and floats is the same in every process (no hash randomization for numbers).
    # The target's shape too (the shape of "none"'s losses), where every rank holds the same tokens.
    shape = () if sequence_parallel else tuple(target.shape)
    options_code = hash((ignore_index, *loss_options, shape, loss_code)) & ((1 << 62) - 1)
    zero = flat_target.new_tensor(0)
    return torch.stack(
        [
            flat_target.new_tensor(0),
            flat_target.new_tensor(int(sequence_parallel)),
            flat_target.new_tensor(int(vocab_start is not None)),
            flat_target.new_tensor(int(vocab_start) if vocab_start is not None else 0),
            flat_target.new_tensor(weight.shape[0]),
            flat_target.new_tensor(weight.shape[1]),
            flat_target.new_tensor(n_tokens),
            valid.sum(),
            target_min,
            target_max,
            fingerprint,
            flat_target.new_tensor(int(chunk_size) if chunk_size is not None else 0),
            flat_target.new_tensor(dtypes),
            flat_target.new_tensor(flags),
            flat_target.new_tensor(options_code),
            _per_token_fingerprint(per_token, flat_target, zero),
        ]
    )


def _per_token_fingerprint(per_token: dict, flat_target: Tensor, zero: Tensor) -> Tensor:
    """A fingerprint of the given per-token inputs whose ranks must agree (``ranks_agree``): the sum (wrapping)
    of each one's :func:`_values_fingerprint`; 0 without any."""
    fingerprint = zero
    for name, value in per_token.items():
        if value is not None and PER_TOKEN_INPUTS[name].ranks_agree:
            fingerprint = fingerprint + _values_fingerprint(value, flat_target)
    return fingerprint


def _values_fingerprint(values: Tensor, flat_target: Tensor) -> Tensor:
    """The bits of a position-mixed fp64 sum of the values, as int64: the same values give the same sum
    (the same reduction over the same values) on every rank; differing values, a permutation included,
    differ but by chance."""
    values = values.reshape(-1).double()
    mix = 1.0 + torch.arange(values.numel(), device=values.device, dtype=torch.float64).remainder(7919) / 7919
    return (values * mix).sum().reshape(1).view(torch.int64)[0].to(flat_target.device)


def agreement_device(input: Any, group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the agreement table lives: the input's device, or CUDA's under NCCL (a rank whose input is not
    a CUDA tensor, a bad argument, must still join the all-reduce)."""
    device = input.device if isinstance(input, Tensor) else torch.device("cpu")
    if device.type != "cuda" and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def agree(
    row: Optional[Tensor],
    failure: Optional[Exception],
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> Sequence[Sequence[int]]:
    """Every rank's agreement row, through one int64 all-reduce (one host sync): the call's first collective,
    joined by every rank whatever its argument checks raised (``failure``; it then sends only the flag). If
    any rank's checks failed, every rank raises: that rank its own error, the others one of the same type
    naming it (its message cannot be sent)."""
    table = torch.zeros(dist.get_world_size(group), _N_COLUMNS, dtype=torch.int64, device=device)
    rank = dist.get_rank(group)
    if failure is None:
        table[rank] = row
    else:
        table[rank, _C_FAILED] = 1 + next(
            (i for i, kind in enumerate(_PEER_ERROR_TYPES) if isinstance(failure, kind)),
            _PEER_ERROR_TYPES.index(RuntimeError),
        )
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    rows: Sequence[Sequence[int]] = table.tolist()
    if failure is not None:
        raise failure
    failed = [r for r, values in enumerate(rows) if values[_C_FAILED]]
    if failed:
        kind = _PEER_ERROR_TYPES[rows[failed[0]][_C_FAILED] - 1]
        raise kind(
            f"rank(s) {failed} of the vocab-parallel group failed their argument checks ({kind.__name__} on"
            f" rank {failed[0]}); see that rank's error"
        )
    return rows


class Layout(NamedTuple):
    """What the agreement rows say, the same on every rank."""

    vocab_start: int
    vocab: int
    n_valid: int  # over all ranks' tokens with sequence parallelism
    chunk_size: int
    targets_in_range: bool  # the caller raises otherwise, once it holds every token
    shard_rows: Tuple[int, ...] = ()  # every rank's rows, in rank order


def layout(
    rows: Sequence[Sequence[int]],
    *,
    rank: int,
    chunk_size: Optional[int],
    compute_dtype: torch.dtype,
    on_gpu: bool,
    workspace_copies: int = DEFAULT_WORKSPACE_COPIES,
    auxiliary_dtype: Optional[torch.dtype] = None,
) -> Layout:
    """The shard layout and chunk size from every rank's agreement row (:func:`agreement_row`); raises the
    same error on every rank where the ranks disagree. Without sequence parallelism every rank holds the same
    tokens, so their counts and target fingerprints must be equal; with it each holds its own (as many on
    every rank): the counts of non-ignored targets add up, the target bounds combine by min / max.
    ``workspace_copies`` and ``auxiliary_dtype``: the chunk loss's, for the default chunk size
    (:func:`~lightning_flce.engine.chunk_rows`)."""

    def column(index: int) -> list:
        return [r[index] for r in rows]

    if len(set(column(_C_SEQUENCE_PARALLEL))) > 1:
        raise ValueError(
            "the ranks of the vocab-parallel group disagree on sequence_parallel:"
            f" {[bool(flag) for flag in column(_C_SEQUENCE_PARALLEL)]}; give the same on every rank"
        )
    sequence_parallel = bool(rows[0][_C_SEQUENCE_PARALLEL])
    must_agree = [
        (_C_HIDDEN, "hidden sizes (weight columns)"),
        (_C_TOKENS, "numbers of tokens"),
        (_C_VALID, "numbers of non-ignored targets"),
        (_C_FINGERPRINT, "targets"),
        (_C_CHUNK, "chunk_size"),
        (_C_DTYPES, "input or compute dtypes"),
        (_C_FLAGS, f"reduction, stats, bias or {_PER_TOKEN_NAMES} (given or not) or input.requires_grad"),
        (
            _C_OPTIONS,
            "ignore_index, label_smoothing, lse_square_scale, logits_precision, softcap or target shape (or the"
            " loss's own options: the distillation's)",
        ),
        (_C_PER_TOKEN, _PER_TOKEN_NAMES),
        (_C_START_GIVEN, "use of vocab_start (give it on every rank or on none)"),
    ]
    tokens = column(_C_TOKENS)
    if sequence_parallel:
        if len(set(tokens)) > 1:
            raise ValueError(f"sequence_parallel needs the same number of tokens on every rank, got {tokens}")
        input_dtypes = {code // 16 for code in column(_C_DTYPES)}
        if len(set(column(_C_HIDDEN))) > 1 or len(input_dtypes) > 1:
            raise ValueError(
                "sequence_parallel needs the same hidden size and input dtype on every rank (the tokens are"
                " all-gathered as one tensor)"
            )
        excluded = (_C_VALID, _C_FINGERPRINT, _C_PER_TOKEN)  # each rank's own tokens
        must_agree = [(index, what) for index, what in must_agree if index not in excluded]
    for index, what in must_agree:
        if len(set(column(index))) > 1:
            raise ValueError(
                f"the ranks of the vocab-parallel group disagree on their {what}: {column(index)}; input, target"
                " and options must be the same on every rank"
            )
    sizes = column(_C_ROWS)
    if min(sizes) < 1:
        raise ValueError(f"every rank needs at least one vocabulary row, got shard sizes {sizes}")
    vocab = sum(sizes)
    if rows[0][_C_START_GIVEN]:
        starts = column(_C_START)
        spans = sorted(zip(starts, sizes))
        covered = 0
        for start, size in spans:
            if start != covered:
                raise ValueError(
                    f"the shards (vocab_start, rows) {list(zip(starts, sizes))} do not tile [0, {vocab}) exactly"
                )
            covered += size
        start = starts[rank]
    else:
        start = sum(sizes[:rank])

    n_tokens = sum(tokens) if sequence_parallel else tokens[0]
    n_valid = sum(column(_C_VALID)) if sequence_parallel else rows[0][_C_VALID]
    in_range = min(column(_C_TARGET_MIN)) >= 0 and max(column(_C_TARGET_MAX)) < vocab
    if chunk_size is None:
        # The same on every rank: chunk boundaries must line up for the per-chunk collectives.
        # On a GPU the GEMM-side rule (>= 4096 rows while the logits fit in dX + dW): each chunk reads and
        # writes the whole dW accumulator, and the CPU rule's 128 MiB of fp32 temporaries meant ~128-row
        # chunks at 64K local columns. The softmax's temporaries are bounded by row slices instead.
        chunk_size = chunk_rows(
            None,
            n_tokens,
            n_valid,
            max(sizes),
            rows[0][_C_HIDDEN],
            compute_dtype,
            on_gpu,
            workspace_copies,
            auxiliary_dtype=auxiliary_dtype,
        )
    return Layout(start, vocab, n_valid, int(chunk_size), in_range, tuple(sizes))
