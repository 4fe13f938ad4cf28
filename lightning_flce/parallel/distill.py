"""Vocab-parallel logit distillation: the student's and the teacher's LM heads both sharded over V across a process
group, row for row alike (Megatron-style tensor parallelism of two models that share a tokenizer).

Rank ``r`` of ``group`` holds the rows ``[vocab_start_r, vocab_start_r + V_r)`` of the student's ``[V, H_s]`` head
and of the teacher's ``[V, H_t]`` head (and of their biases); the hidden states of both models, the targets and
the options are the same on every rank, or with ``sequence_parallel`` each rank holds its own block of the tokens
(all-gathered in, dX reduce-scattered out: :mod:`lightning_flce.parallel.sequence`). No rank holds either side's
``[N, V]`` logits or a full head.

It is the single-device op's chunk loss (:class:`~lightning_flce.losses.distillation.DistillationChunkLoss`, the
teacher its auxiliary head) on the one chunk engine (:func:`lightning_flce.engine.run_chunks`), with a different
``distill_chunk`` (:class:`ShardKernels`) on this rank's columns:

- on CUDA (``impl="auto"``), the Triton kernel's split launch (:func:`lightning_flce.kernels.distill.distill_chunk`
  with ``shard``): a program per slice of 4096 columns, its per-slice statistics (both sides' log-sum-exps, the
  KLs' sums, the CE's) and JSD's per-slice sums all-reduced over the group between its steps, so every rank merges
  every rank's slices as one device merges its own; two all-reduces per block of rows for JSD, one for the KLs;
- elsewhere (and for fp64, and the 16-bit gradient in fp32 rows of ``logits_precision="fp32"``, which the split
  launch cannot take), the distillation twin (:func:`lightning_flce.kernels.distill_torch.distill_chunk`, the same
  formulas) whose row reductions (:class:`ShardRowReductions`) are all-reduced over the group: both sides'
  log-sum-exps (a max and a sum), the divergence's row sums, and with ``hard_weight`` the student's CE log-sum-exp
  and its target logit.

The blocks are the engine's: on GPUs the teacher's 256-row blocks of each chunk
(:data:`lightning_flce.engine.AUXILIARY_BLOCK_ROWS`), on the CPU the chunk. dW and d bias stay on their rank; dX's
partial sums (fp32 at least, so that 16-bit partials are not rounded before the sum) are all-reduced once per call
(reduce-scattered to each rank's tokens with ``sequence_parallel``).
As the single-device op, "mean"/"sum" compute the gradients in forward and "none" recomputes the chunks in backward
with the per-token ``grad_output`` (its collectives then run in backward, on every rank in the same order).

The shard layout, the token counts and targets and the options are agreed first, in one small int64 all-reduce
(:mod:`lightning_flce.parallel.agreement`): a bad argument on one rank raises on all, never a hang.

``top_k``: each rank's k largest teacher logits of a row are all-gathered and the k largest of those chosen
(:class:`ShardTopKColumns`); the student's logits there are read by the ranks that hold them (one all-reduce of
``[rows, k]``), the divergence over the k columns is the same small PyTorch computation on every rank, and each
rank adds its gradient at its own columns.

A cached teacher (its top k per token, no head): :func:`vocab_parallel_fused_linear_distillation_from_top_k`, the
same top-k path on the teacher's stored columns.

Not supported: ``vocab_size`` (shard the rows the heads share). The op is a plain ``autograd.Function`` with collectives,
so ``torch.compile`` graph-breaks around it, and the FLOP counter does not see it.
"""

from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_flce.distill.functional import (
    check_teacher,
    check_top_k,
    check_top_k_columns,
    check_top_k_teacher,
    distillation_op_args,
    loss_token_scale,
)
from lightning_flce.distill.op import OP_ARG_NAMES, distillation_chunk_loss
from lightning_flce.engine import (
    accumulator_dtype,
    auxiliary_block_rows,
    check_single_backward,
    finish_saved_grads,
    inverse_scales,
    run_chunks,
    saved_gradients,
    target_range_error,
    valid_rows,
)
from lightning_flce.kernels import distill_torch, is_gradient_in_logits_rows, softmax_dtype
from lightning_flce.kernels.distill_torch import RowReductions
from lightning_flce.losses.distillation import DIVERGENCES, DistillationChunkLoss, Divergence, TopKColumns
from lightning_flce.options import AccumDtype, FLCEOptions, ImplName, LogitsPrecision, Reduction
from lightning_flce.parallel.agreement import (
    DTYPE_CODES,
    Layout,
    agree,
    agreement_device,
    agreement_row,
    call_group,
    layout,
    local_tensors,
)
from lightning_flce.parallel.sequence import gather_rows, local_rows, reduce_scatter_rows

__all__ = [
    "ShardKernels",
    "ShardRowReductions",
    "ShardTopKColumns",
    "vocab_parallel_fused_linear_distillation",
    "vocab_parallel_fused_linear_distillation_from_top_k",
]


def vocab_parallel_fused_linear_distillation(
    student_input: Tensor,
    student_weight_shard: Tensor,
    teacher_input: Tensor,
    teacher_weight_shard: Tensor,
    target: Optional[Tensor] = None,
    *,
    student_bias_shard: Optional[Tensor] = None,
    teacher_bias_shard: Optional[Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    sequence_parallel: bool = False,
    divergence: Divergence = "jsd",
    beta: float = 0.5,
    temperature: Union[float, Tensor] = 1.0,
    hard_weight: float = 0.0,
    top_k: Optional[int] = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    token_weight: Optional[Tensor] = None,
    student_softcap: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logits_precision: LogitsPrecision = "input",
    accum_dtype: AccumDtype = None,
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> Tensor:
    """:func:`~lightning_flce.fused_linear_distillation` with both heads' weights sharded over V across ``group``.

    Call it on every rank of ``group`` with the same hidden states, ``target`` and options; each rank passes its
    rows of the student's and the teacher's head (the same rows of both). The loss and the gradient w.r.t.
    ``student_input`` are the same on every rank and equal the single-device op's on the full heads;
    ``student_weight_shard.grad`` (and the bias's) get the rows of the full gradient that the rank holds. The
    teacher gets no gradient (teacher tensors that require grad are refused).

    Args:
        student_input, teacher_input: [..., H_s] and [..., H_t] hidden states, identical on every rank.
        student_weight_shard, teacher_weight_shard: [V_r, H_s] and [V_r, H_t], this rank's rows of each head (V_r >=
            1, the same for both). ``Shard(0)`` DTensors on one 1-D mesh are accepted too (their local rows and the
            mesh's group are used).
        target: [...] global token indices in ``[0, V)`` or ``ignore_index``; None: every token carries the
            divergence (no ``hard_weight``).
        student_bias_shard, teacher_bias_shard: optional [V_r] rows of each head's bias.
        group: the process group the vocabulary is sharded over (default: the world).
        vocab_start: first global row of this rank's shard. None: the shards are contiguous in rank order (their
            sizes are exchanged, so uneven shards work); if given, on every rank, and the shards must tile
            ``[0, V)``.
        sequence_parallel: the hidden states, ``target``, ``token_weight`` and a per-token ``temperature`` hold
            this rank's tokens only (as many on every rank; the group's tokens are the ranks' blocks in rank order),
            as after a sequence-parallel block of Megatron-style tensor parallelism. They are all-gathered in, dX is
            reduce-scattered back to this rank's tokens, "none" returns this rank's tokens' losses and "mean"
            averages over the group's tokens (:mod:`lightning_flce.parallel.sequence`).
        divergence, beta, temperature, hard_weight, top_k, ignore_index, reduction, token_weight, student_softcap,
        teacher_softcap, student_logit_scale, teacher_logit_scale, logits_precision, accum_dtype, chunk_size: as in
            :func:`~lightning_flce.fused_linear_distillation` (a per-token ``temperature`` tensor must be the same
            on every rank, as the hidden states; ``top_k`` is over the whole vocabulary, chosen across the shards;
            ``chunk_size=None`` picks the same size on every rank, from the largest shard).
        impl: the per-chunk math: ``"auto"`` (the Triton kernel on CUDA, the PyTorch twin elsewhere), ``"triton"``
            (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``) or ``"torch"``; fp64 and the wide logits of
            ``logits_precision="fp32"`` with 16-bit inputs always run the twin. The GEMMs are cuBLAS either way.

    Returns:
        The loss (a scalar, or one per token in the target's shape for ``reduction="none"``) in fp32 (fp64 for fp64
        inputs), replicated on every rank (with ``sequence_parallel``, "none" gives this rank's tokens' losses and
        the scalar is the group's). Backpropagate the same ``grad_output`` on every rank (for "none" with
        ``sequence_parallel``: each rank its tokens').
    """
    teacher_shards = (teacher_input, teacher_weight_shard, teacher_bias_shard)
    return _distill_on_shards(
        "vocab_parallel_fused_linear_distillation",
        student_input,
        student_weight_shard,
        target,
        student_bias_shard,
        teacher_shards,
        None,
        group=group,
        vocab_start=vocab_start,
        sequence_parallel=sequence_parallel,
        options=dict(
            divergence=divergence,
            beta=beta,
            temperature=temperature,
            hard_weight=hard_weight,
            top_k=top_k,
            ignore_index=ignore_index,
            reduction=reduction,
            token_weight=token_weight,
            student_softcap=student_softcap,
            teacher_softcap=teacher_softcap,
            student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale,
            logits_precision=logits_precision,
            accum_dtype=accum_dtype,
            chunk_size=chunk_size,
            impl=impl,
        ),
    )


def vocab_parallel_fused_linear_distillation_from_top_k(
    student_input: Tensor,
    student_weight_shard: Tensor,
    teacher_indices: Tensor,
    teacher_logits: Tensor,
    target: Optional[Tensor] = None,
    *,
    student_bias_shard: Optional[Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    sequence_parallel: bool = False,
    divergence: Divergence = "jsd",
    beta: float = 0.5,
    temperature: Union[float, Tensor] = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    token_weight: Optional[Tensor] = None,
    student_softcap: Optional[float] = None,
    student_logit_scale: float = 1.0,
    logits_precision: LogitsPrecision = "input",
    accum_dtype: AccumDtype = None,
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> Tensor:
    """:func:`~lightning_flce.fused_linear_distillation_from_top_k` (a teacher cached as its top k per token) with the
    student's head sharded over V across ``group``: :func:`vocab_parallel_fused_linear_distillation` without a
    teacher head.

    ``teacher_indices`` and ``teacher_logits`` ([..., k], global columns in ``[0, V)``) are the same on every rank
    (with ``sequence_parallel``, this rank's tokens', as the hidden states). The student's logits at a token's k
    columns are read by the ranks that hold them (one all-reduce of ``[rows, k]`` per chunk), the divergence over
    them is computed alike on every rank, and each rank adds its gradient at its own columns; the cross-entropy of
    ``hard_weight`` stays over the whole vocabulary, on the shards. The other arguments are those two functions'."""
    return _distill_on_shards(
        "vocab_parallel_fused_linear_distillation_from_top_k",
        student_input,
        student_weight_shard,
        target,
        student_bias_shard,
        None,
        (teacher_indices, teacher_logits),
        group=group,
        vocab_start=vocab_start,
        sequence_parallel=sequence_parallel,
        options=dict(
            divergence=divergence,
            beta=beta,
            temperature=temperature,
            hard_weight=hard_weight,
            top_k=None,
            ignore_index=ignore_index,
            reduction=reduction,
            token_weight=token_weight,
            student_softcap=student_softcap,
            teacher_softcap=None,
            student_logit_scale=student_logit_scale,
            teacher_logit_scale=1.0,
            logits_precision=logits_precision,
            accum_dtype=accum_dtype,
            chunk_size=chunk_size,
            impl=impl,
        ),
    )


def _distill_on_shards(
    name: str,
    student_input: Tensor,
    student_weight_shard: Tensor,
    target: Optional[Tensor],
    student_bias_shard: Optional[Tensor],
    teacher_shards: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]],
    teacher_top_k: Optional[Tuple[Tensor, Tensor]],
    *,
    group: Optional[dist.ProcessGroup],
    vocab_start: Optional[int],
    sequence_parallel: bool,
    options: Dict[str, Any],
) -> Tensor:
    """Both front ends' body: this rank's checks, the ranks' agreement, the sequence-parallel gathering, the op. The
    teacher is its head's rows on this rank (``teacher_shards``) or its cached top k (``teacher_top_k``)."""
    # Raised on this rank only: without a process group there is no collective to tell the others through.
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs an initialized torch.distributed")
    group = call_group(student_weight_shard, group)
    sequence_parallel = bool(sequence_parallel)
    reduction, temperature, token_weight = (
        options["reduction"],
        options["temperature"],
        options["token_weight"],
    )
    # This rank's argument checks: an error is raised after the agreement all-reduce, which every rank must join.
    failure = row = None
    a: Dict[str, Any] = {}
    try:
        student_input, student_weight_shard, student_bias_shard = local_tensors(
            student_input, student_weight_shard, student_bias_shard
        )
        if teacher_shards is not None:
            if call_group(teacher_shards[1], group) is not group:
                raise ValueError(
                    "the teacher's head is sharded over another process group than the student's"
                )
            teacher_input, teacher_weight_shard, teacher_bias_shard = local_tensors(*teacher_shards)
            _check_shards(student_weight_shard, teacher_weight_shard)
            check_teacher(
                student_input,
                student_weight_shard,
                teacher_input,
                teacher_weight_shard,
                teacher_bias_shard,
                None,
            )
            teacher_shards = (teacher_input, teacher_weight_shard, teacher_bias_shard)
        else:
            assert teacher_top_k is not None
            check_top_k_teacher(student_input, None, *teacher_top_k)  # k against V after the agreement
        args = distillation_op_args(
            student_input,
            student_weight_shard,
            target,
            student_bias=student_bias_shard,
            teacher_head=teacher_shards,
            teacher_top_k=teacher_top_k,
            vocab_sharded=True,
            **options,
        )
        a = dict(zip(OP_ARG_NAMES, args))
        row = agreement_row(
            student_input,
            student_weight_shard,
            a["target"],
            vocab_start=vocab_start,
            options=FLCEOptions.of(
                ignore_index=a["ignore_index"],
                reduction=reduction,
                token_weight=token_weight,
                logits_precision=a["logits_precision"],
                chunk_size=options["chunk_size"],
            ),
            compute_dtype=a["compute_dtype"],
            need_grad_input=a["need_grad_input"],
            compute_stats=False,
            sequence_parallel=sequence_parallel,
            has_bias=student_bias_shard is not None,
            loss_code=_loss_code(a, temperature),
        )
    except Exception as exc:
        failure = exc
    rows = agree(row, failure, group, agreement_device(student_input, group))
    agreed = layout(
        rows,
        rank=dist.get_rank(group),
        chunk_size=options["chunk_size"],
        compute_dtype=a["compute_dtype"],
        on_gpu=student_input.device.type == "cuda",
        workspace_copies=DistillationChunkLoss.workspace_copies,
        auxiliary_dtype=a["teacher_compute_dtype"] if a["teacher_x"] is not None else None,
    )
    token_shape = a["target"].shape  # this rank's tokens: the shape of "none"'s losses
    # after the agreement: with sequence parallelism every rank holds as many tokens, of one hidden size and dtype
    if sequence_parallel:
        a = _gather_tokens(a, reduction, temperature, token_weight, group)
    if not agreed.targets_in_range:  # the same targets on every rank: the same message
        raise target_range_error(a["target"], agreed.vocab, a["ignore_index"])
    # k against the whole vocabulary, the single-device op's checks (the same k on every rank: the same message)
    if a["top_k"]:
        check_top_k(a["top_k"], agreed.vocab)
    if a["teacher_top_k_indices"] is not None:
        check_top_k_columns(a["teacher_top_k_indices"], agreed.vocab)
    plan = _Plan(group, agreed, reduction, sequence_parallel)
    statics = {name: value for name, value in a.items() if name not in ("x", "weight", "bias")}
    loss = _VocabParallelDistillation.apply(a["x"], a["weight"], a["bias"], plan, statics)
    return loss.view(token_shape) if reduction == "none" else loss


class ShardRowReductions(RowReductions):
    """The twin's row reductions on one rank's columns ``[vocab_start, vocab_start + V_r)`` of each row, made global
    by all-reduces over ``group`` (one per call; every rank calls them in the same order)."""

    def __init__(self, group: Optional[dist.ProcessGroup], vocab_start: int) -> None:
        self.group = group
        self.vocab_start = vocab_start

    def logsumexp(self, *z: Tensor) -> Tuple[Tensor, ...]:
        row_max = torch.stack([values.amax(dim=1) for values in z])
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=self.group)
        # a row without mass anywhere (-inf everywhere) keeps log 0 = -inf, without inf - inf
        offset = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        sums = torch.stack(
            [(values - offset[i].unsqueeze(1)).exp_().sum(dim=1) for i, values in enumerate(z)]
        )
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        lse = offset + sums.log()
        return tuple(lse[i].unsqueeze(1) for i in range(len(z)))

    def row_sums(self, partial: Tensor) -> Tensor:
        total = partial.contiguous()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total

    def at_target(self, values: Tensor, target: Tensor) -> Tensor:
        column, owned = _on_shard(target, self.vocab_start, values.shape[1])
        picked = torch.where(owned, values.gather(1, column.unsqueeze(1)).squeeze(1), 0.0)
        dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=self.group)
        return picked

    def add_at_target_(self, values: Tensor, target: Tensor, value: float) -> None:
        column, owned = _on_shard(target, self.vocab_start, values.shape[1])
        added = torch.where(owned, value, 0.0).to(values.dtype).unsqueeze(1)
        values.scatter_add_(1, column.unsqueeze(1), added)


class ShardTopKColumns(TopKColumns):
    """``top_k`` on one rank's columns ``[vocab_start, vocab_start + V_r)``: each rank's k largest teacher logits of a
    row are all-gathered and the k largest of those chosen, the same on every rank; the student's logits there are
    read by the rank that holds each column (all-reduced), and each rank adds the top-k gradient at its own
    columns only."""

    def __init__(self, group: Optional[dist.ProcessGroup], vocab_start: int) -> None:
        self.group = group
        self.vocab_start = vocab_start

    def select(self, teacher: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        rows, columns = teacher.shape
        local_k = min(k, columns)
        values, index = teacher.topk(local_k, dim=1, sorted=False)
        # exact in the softmax dtype; a shard of fewer than k columns pads with -inf (never chosen over a finite
        # logit: every rank's pads together are fewer than the V - k other columns)
        values = values.to(softmax_dtype(teacher.dtype))
        index = index + self.vocab_start
        if local_k < k:
            values = torch.cat([values, values.new_full((rows, k - local_k), float("-inf"))], dim=1)
            index = torch.cat([index, index.new_full((rows, k - local_k), self.vocab_start)], dim=1)
        values, index = self._every_ranks(values), self._every_ranks(index)
        chosen = values.topk(k, dim=1, sorted=False).indices
        return index.gather(1, chosen), values.gather(1, chosen)

    def _every_ranks(self, local: Tensor) -> Tensor:
        """[C, k] of each rank -> [C, world * k]: every rank's candidates of each row, in rank order."""
        rows, k = local.shape
        world = dist.get_world_size(self.group)
        return gather_rows(local, self.group).view(world, rows, k).transpose(0, 1).reshape(rows, world * k)

    def gather(self, logits: Tensor, index: Tensor) -> Tensor:
        local, owned = _on_shard(index, self.vocab_start, logits.shape[1])
        picked = torch.where(owned, super().gather(logits, local), 0.0)
        dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=self.group)
        return picked

    def scatter_add_(self, grad: Tensor, index: Tensor, values: Tensor) -> None:
        local, owned = _on_shard(index, self.vocab_start, grad.shape[1])
        super().scatter_add_(grad, local, torch.where(owned, values, 0.0))


class ShardKernels:
    """The per-chunk math of the vocab-parallel op for
    :class:`~lightning_flce.losses.distillation.DistillationChunkLoss`: the Triton kernel's split launch with its
    statistics all-reduced between the steps (``slots``: :class:`~lightning_flce.kernels.distill.ShardSlots`), or
    the distillation twin with :class:`ShardRowReductions` (``slots`` None, and for a 16-bit gradient in fp32
    rows, which the split launch cannot take: the same choice on every rank, which sees the same dtypes)."""

    def __init__(self, reductions: ShardRowReductions, slots: Any = None) -> None:
        self.reductions = reductions
        self.slots = slots
        self.kernel = None
        if slots is not None:  # (Triton is an optional dependency: imported only where it runs)
            from lightning_flce.kernels import distill as kernel

            self.kernel = kernel

    def distill_chunk(
        self, student_logits: Tensor, teacher_logits: Tensor, target: Tensor, **kwargs: Any
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        grad_out = kwargs.get("grad_out")
        grad_in_row = kwargs["compute_grad"] and is_gradient_in_logits_rows(
            student_logits, student_logits if grad_out is None else grad_out
        )
        if self.kernel is None or grad_in_row:
            return distill_torch.distill_chunk(
                student_logits, teacher_logits, target, reductions=self.reductions, **kwargs
            )
        local_target = target - self.reductions.vocab_start  # outside [0, V_r) where another rank holds it
        return self.kernel.distill_chunk(
            student_logits, teacher_logits, local_target, shard=self.slots, **kwargs
        )


class _Plan(NamedTuple):
    """The call's group, what every rank agreed on, the reduction, and whether each rank holds its own tokens."""

    group: Optional[dist.ProcessGroup]
    layout: Layout
    reduction: str
    sequence_parallel: bool


def _gather_tokens(
    a: Dict[str, Any],
    reduction: str,
    temperature: Union[float, Tensor],
    token_weight: Optional[Tensor],
    group: Optional[dist.ProcessGroup],
) -> Dict[str, Any]:
    """The op's arguments with every per-token value of the group's tokens (sequence parallelism): both sides'
    hidden states (the student's detached: autograd sees this rank's, which the chunks read as ``gathered_x``),
    the targets, a per-token temperature, and the token scale rebuilt from the group's targets and weights ("mean"
    divides by the group's tokens that carry a loss)."""
    dtype = softmax_dtype(a["compute_dtype"])
    target = gather_rows(a["target"].reshape(-1), group)
    weights = None if token_weight is None else gather_rows(token_weight.detach().reshape(-1), group)
    gathered = {
        "gathered_x": gather_rows(a["x"].detach().reshape(-1, a["x"].shape[-1]), group),
        "target": target,
        "token_scale": loss_token_scale(target, a["ignore_index"], reduction, weights, dtype),
    }
    # the teacher's hidden states, or its cached top k: [..., H_t] or [..., k] per token
    for name in ("teacher_x", "teacher_top_k_indices", "teacher_top_k_logits"):
        if a[name] is not None:
            gathered[name] = gather_rows(a[name].detach().reshape(-1, a[name].shape[-1]), group)
    if isinstance(temperature, Tensor):  # [N_r] per token; a float's [1] is the same everywhere
        gathered["inv_temperature"] = gather_rows(a["inv_temperature"], group)
    return {**a, **gathered}


def _on_shard(columns: Tensor, vocab_start: int, width: int) -> Tuple[Tensor, Tensor]:
    """Global ``columns`` on the shard ``[vocab_start, vocab_start + width)``: (their local index, clamped into the
    shard so that a gather or scatter stays in bounds; whether the shard holds each)."""
    local = columns - vocab_start
    return local.clamp(0, width - 1), (local >= 0) & (local < width)


def _check_shards(student_weight: Tensor, teacher_weight: Tensor) -> None:
    if (
        student_weight.dim() == 2
        and teacher_weight.dim() == 2
        and student_weight.shape[0] != teacher_weight.shape[0]
    ):
        raise ValueError(
            f"this rank holds {student_weight.shape[0]} rows of the student's head and {teacher_weight.shape[0]} of"
            " the teacher's: shard both heads alike (the same rows of the shared vocabulary on each rank)"
        )


def _loss_code(a: Dict[str, Any], temperature: Union[float, Tensor]) -> int:
    """A hash of the distillation's own options, for the ranks' agreement (ints and floats only)."""
    codes = (
        DIVERGENCES.index(a["divergence"]),
        a["beta"],
        a["hard_weight"],
        a["top_k"],
        a["student_softcap"],
        a["teacher_softcap"],
        a["student_logit_scale"],
        a["teacher_logit_scale"],
        -1 if a["teacher_weight"] is None else a["teacher_weight"].shape[1],
        int(a["teacher_bias"] is not None),
        # a cached teacher's k entries a token (0 with a teacher head)
        0 if a["teacher_top_k_indices"] is None else a["teacher_top_k_indices"].shape[-1],
        DTYPE_CODES[a["teacher_compute_dtype"]],
        float(temperature) if isinstance(temperature, (int, float)) else -float(temperature.numel()),
        # the per-block math: the Triton launch and the twin run different collectives, which must line up
        int(a["backend"] == "triton"),
    )
    return hash(codes)


def _run(a: Dict[str, Any], plan: _Plan, *, keep_scaled: bool) -> Tuple[Optional[Tensor], ...]:
    """The chunks on this rank's shard: per-token (loss, divergence, ce), then dX (all-reduced over the group, fp32
    for 16-bit inputs), dW, d bias (this rank's rows) and their :class:`~lightning_flce.engine.GradScales`."""
    x, weight, compute_dtype = a["x"], a["weight"], a["compute_dtype"]
    layout = plan.layout
    slots = None
    if a["backend"] == "triton":
        from lightning_flce.kernels.distill import ShardSlots, shard_slices

        slices = [shard_slices(rows) for rows in layout.shard_rows]
        rank = dist.get_rank(plan.group)
        slots = ShardSlots(
            sum(slices[:rank]),
            sum(slices),
            lambda scratch: dist.all_reduce(scratch, op=dist.ReduceOp.SUM, group=plan.group),
        )
    kernels = ShardKernels(ShardRowReductions(plan.group, layout.vocab_start), slots)
    columns = ShardTopKColumns(plan.group, layout.vocab_start)
    loss, checks = distillation_chunk_loss(a, kernels, layout.vocab, columns)
    counts = torch.stack([count for count, _ in checks]).tolist()  # one host sync; the same on every rank
    for count, (_, error) in zip(counts, checks):
        if count:
            raise error()
    target = a["target"].reshape(-1)
    valid = target != a["ignore_index"]
    grad_weight_dtype = None
    if keep_scaled:
        n_chunks = max(1, math.ceil(layout.n_valid / layout.chunk_size))
        grad_weight_dtype = accumulator_dtype(a["accum_dtype"], weight, compute_dtype, n_chunks)
    # Each rank's partial dX is summed over the group in fp32 at least: 16-bit partials are not rounded first.
    reduce_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    *per_token, grad_input, grad_weight, grad_bias, scales = run_chunks(
        x,
        weight,
        target,
        a["bias"],
        loss,
        rows=valid_rows(valid, layout.n_valid),
        n_valid=layout.n_valid,
        chunk_size=layout.chunk_size,
        compute_dtype=compute_dtype,
        need_grad_input=a["need_grad_input"],
        need_grad_weight=a["need_grad_weight"],
        need_grad_bias=a["need_grad_bias"],
        accum_dtype=a["accum_dtype"],
        logits_precision=a["logits_precision"],
        grad_input_dtype=reduce_dtype,
        keep_scaled=keep_scaled,
        grad_weight_dtype=grad_weight_dtype,
        auxiliary_block_rows=auxiliary_block_rows(x.device.type == "cuda"),
    )
    if grad_input is not None and plan.sequence_parallel:  # this rank's tokens only: sum and scatter at once
        grad_input = reduce_scatter_rows(grad_input.view(-1, x.shape[-1]), plan.group)
    elif grad_input is not None:
        dist.all_reduce(grad_input, op=dist.ReduceOp.SUM, group=plan.group)
    return (*per_token, grad_input, grad_weight, grad_bias, scales)


def _chunk_args(statics: Dict[str, Any], x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Dict[str, Any]:
    """The op's arguments for the chunks: the student's hidden states are ``x`` (what autograd sees), or with
    sequence parallelism the group's tokens gathered from it (``gathered_x``)."""
    return {**statics, "x": statics.get("gathered_x", x), "weight": weight, "bias": bias}


class _VocabParallelDistillation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: _Plan, statics: Dict[str, Any]):
        a = _chunk_args(statics, x, weight, bias)
        needs = (a["need_grad_input"], a["need_grad_weight"], a["need_grad_bias"])
        ctx.needs, ctx.plan, ctx.input_shape = needs, plan, x.shape
        ctx.set_materialize_grads(False)
        with torch.autocast(x.device.type, enabled=False):
            if plan.reduction == "none":  # gradients in backward, with the per-token grad_output
                per_token_loss, *_ = _run(
                    {**a, "need_grad_input": False, "need_grad_weight": False, "need_grad_bias": False},
                    plan,
                    keep_scaled=False,
                )
                ctx.statics = statics
                ctx.save_for_backward(x, weight, bias)
                return local_rows(per_token_loss, plan.group) if plan.sequence_parallel else per_token_loss
            per_token_loss, _, _, gx, gw, gb, scales = _run(a, plan, keep_scaled=True)
        if gx is not None:
            gx = gx.view(x.shape)
        ctx.final_dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        saved = saved_gradients(x, gx, gw, gb)
        ctx.save_for_backward(*saved, inverse_scales(scales, a["compute_dtype"], x.device))
        return per_token_loss.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        need_gx, need_gw, need_gb = ctx.needs
        if grad_loss is None:
            return None, None, None, None, None
        if ctx.plan.reduction == "none":
            x, weight, bias = ctx.saved_tensors
            statics = ctx.statics
            dtype = softmax_dtype(statics["compute_dtype"])
            grad = grad_loss.reshape(-1)
            if ctx.plan.sequence_parallel:  # every rank's chunks need every token's grad_output
                grad = gather_rows(grad, ctx.plan.group)
            scale = grad.to(dtype) * statics["token_scale"].to(dtype)
            a = {**_chunk_args(statics, x, weight, bias), "token_scale": scale}
            with torch.autocast(x.device.type, enabled=False):
                *_, gx, gw, gb, _ = _run(a, ctx.plan, keep_scaled=False)
            if gx is not None:
                gx = gx.view(ctx.input_shape).to(x.dtype)
        else:
            check_single_backward(
                ctx,
                "vocab_parallel_fused_linear_distillation",
                "Use reduction='none' (it recomputes in backward) for retain_graph or repeated autograd.grad",
            )
            *saved, inverse = ctx.saved_tensors
            gx, gw, gb = finish_saved_grads(saved, ctx.final_dtypes, grad_loss, inverse)
        return (gx if need_gx else None, gw if need_gw else None, gb if need_gb else None, None, None)
