"""A vocab-sharded head's top k per token: :func:`vocab_parallel_fused_linear_top_k`, what a tensor-parallel
teacher's cache stores (:func:`~lightning_flce.fused_linear_top_k` for a head whose ``[V, H]`` weight is sharded over
V across a process group, as :class:`~lightning_flce.parallel.VocabParallelHead` holds it).

Each rank runs the single-device op's chunks (:func:`~lightning_flce.distill.top_k.top_k_rows`) on its rows: its k
largest transformed logits of each token, their columns, and, for log-probabilities, the row's log-sum-exp over its
columns. One all-gather brings every rank's candidates and log-sum-exps to every rank; each chooses the k largest of
the ``world * k`` candidates and subtracts the log-sum-exp of the ranks' log-sum-exps (the whole row's). The
result is the same on every rank and equal to the single-device op's on the full head (up to the order of equal
logits). No rank holds a ``[N, V]`` or ``[N, V_r]`` logits tensor beyond a chunk.

The ranks agree on the call first (:mod:`lightning_flce.parallel.agreement`: one small all-reduce): a bad argument
on one rank raises on all, never a hang.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_flce.distill.top_k import TopKOutput, top_k_rows
from lightning_flce.engine import target_range_error
from lightning_flce.functional import checked_call
from lightning_flce.losses.top_k import TopKChunkLoss
from lightning_flce.options import FLCEOptions, ImplName, LogitsPrecision
from lightning_flce.parallel.agreement import (
    agree,
    agreement_device,
    agreement_row,
    call_group,
    layout,
    local_tensors,
)
from lightning_flce.parallel.sequence import gather_rows, local_rows
from lightning_flce.validation import class_indices

__all__ = ["vocab_parallel_fused_linear_top_k"]


def vocab_parallel_fused_linear_top_k(
    input: Tensor,
    weight_shard: Tensor,
    k: int,
    bias_shard: Optional[Tensor] = None,
    *,
    target: Optional[Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    log_probs: bool = True,
    logits_precision: LogitsPrecision = "input",
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> TopKOutput:
    """:func:`~lightning_flce.fused_linear_top_k` with the head's weight sharded over V across ``group``.

    Call it on every rank of ``group`` with the same hidden states, ``target`` and options; each rank passes its
    rows of the head. Every rank gets the same :class:`~lightning_flce.distill.top_k.TopKOutput`: each token's
    ``k`` most likely columns of the whole vocabulary (global indices) and their log-probabilities (or transformed
    logits), equal to the single-device op's on the full head (ties between equal logits go to either column).

    Args:
        input: [..., H] hidden states, identical on every rank (with ``sequence_parallel``, this rank's tokens).
        weight_shard: [V_r, H], this rank's rows of the head (V_r >= 1); a ``Shard(0)`` DTensor on a 1-D mesh is
            accepted too (its local rows and the mesh's group are used).
        k: columns a token, an int in [1, V] (V: the rows of all shards).
        bias_shard: optional [V_r], this rank's rows of the bias.
        target: optional [...]: tokens whose target is ``ignore_index`` are skipped (values -inf, indices 0); other
            values must be in [0, V) (input ids or labels serve). They also let the ranks check that they hold the
            same tokens (the agreement compares a fingerprint of the targets), which plain hidden states do not.
        group: the process group the vocabulary is sharded over (default: the world).
        vocab_start: first global row of this rank's shard; None: the shards are contiguous in rank order (uneven
            sizes work). If given, on every rank, and the shards must tile ``[0, V)``.
        sequence_parallel: ``input`` and ``target`` hold this rank's tokens only (as many on every rank, the
            group's tokens the ranks' blocks in rank order); they are all-gathered in and each rank gets its own
            tokens' top k back.
        ignore_index, softcap, log_probs, logits_precision, chunk_size, impl: as
            :func:`~lightning_flce.fused_linear_top_k`'s.

    Returns:
        ``(values, indices)``, [..., k] each, the same on every rank (this rank's tokens with
        ``sequence_parallel``). No gradient flows to any input.

    Raises:
        RuntimeError: without an initialized ``torch.distributed`` (on this rank).
        ValueError / TypeError: on every rank, before any kernel, where one rank's arguments fail the
            single-device checks, the ranks disagree (tokens, hidden size, dtypes, options, the shard layout), a
            target lies outside [0, V) or ``k`` outside [1, V].
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_fused_linear_top_k needs an initialized torch.distributed")
    group = call_group(weight_shard, group)
    sequence_parallel = bool(sequence_parallel)
    # This rank's checks; an error is raised after the agreement all-reduce, which every rank must join.
    failure = row = None
    try:
        input, weight_shard, bias_shard = local_tensors(input, weight_shard, bias_shard)
        if target is None:
            target = torch.zeros(input.shape[:-1], dtype=torch.int64, device=input.device)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        options = FLCEOptions.of(
            ignore_index=ignore_index,
            reduction="none",
            softcap=softcap,
            logits_precision=logits_precision,
            chunk_size=chunk_size,
            impl=impl,
        )
        # (no range check there: the targets' range against the whole V is the agreement's)
        options, compute_dtype, backend = checked_call(input, weight_shard, target, bias_shard, options)
        target = class_indices(target)
        row = agreement_row(
            input,
            weight_shard,
            target,
            vocab_start=vocab_start,
            options=options,
            compute_dtype=compute_dtype,
            need_grad_input=False,
            compute_stats=False,
            sequence_parallel=sequence_parallel,
            has_bias=bias_shard is not None,
            loss_code=hash((k, int(bool(log_probs)), int(backend.name == "triton"))),
        )
    except Exception as exc:
        failure = exc
    rows = agree(row, failure, group, agreement_device(input, group))
    agreed = layout(
        rows,
        rank=dist.get_rank(group),
        chunk_size=options.chunk_size,
        compute_dtype=compute_dtype,
        on_gpu=input.device.type == "cuda",
        workspace_copies=TopKChunkLoss.workspace_copies,
    )
    token_shape = target.shape
    hidden = input.detach().reshape(-1, input.shape[-1])
    target = target.reshape(-1)
    if sequence_parallel:  # every rank's columns of every token
        hidden, target = gather_rows(hidden, group), gather_rows(target, group)
    if not agreed.targets_in_range:  # the same targets on every rank: the same message
        raise target_range_error(target, agreed.vocab, options.ignore_index)
    if k > agreed.vocab:
        raise ValueError(f"k must be an int in [1, V={agreed.vocab}], got {k}")
    valid = target != options.ignore_index
    columns = weight_shard.shape[0]
    values, indices, lse = top_k_rows(
        hidden,
        weight_shard.detach(),
        # the targets only say which rows to skip: on a shard of V_r rows, 0 for the others
        torch.where(valid, 0, target),
        None if bias_shard is None else bias_shard.detach(),
        k=min(k, columns),
        with_lse=log_probs,
        ignore_index=options.ignore_index,
        softcap=options.softcap if options.softcap is not None else 0.0,
        logits_precision=options.logits_precision,
        compute_dtype=compute_dtype,
        chunk_size=agreed.chunk_size,
        backend=backend.name,
    )
    values, indices = _merged(values, indices + agreed.vocab_start, lse, k, group)
    # rows without a loss: the single-device op's padding (the merge's -inf - log-sum-exp would be NaN)
    values = values.masked_fill(~valid.unsqueeze(1), float("-inf"))
    indices = indices.masked_fill(~valid.unsqueeze(1), 0)
    if sequence_parallel:
        values, indices = local_rows(values, group), local_rows(indices, group)
    shape = (*token_shape, k)
    return TopKOutput(values.reshape(shape), indices.reshape(shape))


def _merged(
    values: Tensor, indices: Tensor, lse: Optional[Tensor], k: int, group: Optional[dist.ProcessGroup]
) -> tuple[Tensor, Tensor]:
    """Every rank's candidates ``values`` / ``indices`` [N, k_r] (global columns; ``k_r = min(k, V_r)``) and row
    log-sum-exps ``lse`` [N] (None: the values stay logits) -> the whole head's top k [N, k], the same on every
    rank: one all-gather of the values with the log-sum-exp beside them, one of the columns."""
    rows, local_k = values.shape
    if local_k < k:  # a shard of fewer than k rows: -inf pads, never chosen over the V >= k finite logits
        values = torch.cat([values, values.new_full((rows, k - local_k), float("-inf"))], dim=1)
        indices = torch.cat([indices, indices.new_zeros(rows, k - local_k)], dim=1)
    if lse is not None:
        values = torch.cat([values, lse.unsqueeze(1)], dim=1)
    world = dist.get_world_size(group)
    # [world * N, width] in rank order -> [N, world, width]: each row's candidates of every rank
    every_values = gather_rows(values, group).view(world, rows, values.shape[1]).transpose(0, 1)
    every_indices = gather_rows(indices, group).view(world, rows, k).transpose(0, 1).reshape(rows, world * k)
    candidates = every_values[:, :, :k].reshape(rows, world * k)
    top, chosen = candidates.topk(k, dim=1)
    if lse is not None:  # the whole row's log-sum-exp, from the shards'
        top = top - torch.logsumexp(every_values[:, :, k], dim=1, keepdim=True)
    return top, every_indices.gather(1, chosen)
