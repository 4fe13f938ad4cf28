"""Vocab-parallel fused linear cross-entropy: the LM head's weight is sharded over V across a process group.

Rank ``r`` of ``group`` holds the rows ``[vocab_start_r, vocab_start_r + V_r)`` of the ``[V, H]`` head weight
(and of the bias); the hidden states and targets are the same on every rank of the group (replicated, as in
Megatron-style tensor parallelism). Per chunk of C tokens each rank computes only its ``[C, V_r]`` logits and::

    M        = all_reduce_max(max_j z_j)                         # [C]
    S, z_t.. = all_reduce_sum(sum_j exp(z_j - M), z_target, ...)  # [k, C] in one collective
    lse      = M + log S                                          # the global log-sum-exp
    d loss / d z_j = coef * exp(z_j - M) / S - smoothing - one-hot(target), on the local columns only
    dW_r    (+)= (d loss / d logits).T @ x_c                      # stays local
    dX_part (+)= (d loss / d logits) @ W_r                        # summed over the group once, at the end

where ``z`` are the (softcapped) logits in fp32 (fp64 for fp64 GEMMs), ``z_target`` comes from the rank that
owns the target (the others add 0), and the label-smoothing and entropy sums ride in the same sum. No rank
holds ``[N, V]`` or the full ``[V, H]``. Every collective goes through :mod:`torch.distributed` on ``group``
(gloo on the CPU, NCCL on GPUs). Default chunks follow the single-device op's rule for the device (on GPUs:
large chunks, since each one reads and writes the whole dW accumulator). The per-chunk softmax is a pair of Triton kernels
around the all-reduces (``lightning_flce.kernels.cross_entropy_shard``: one read for the row statistics,
one read + write for the gradient), or their PyTorch twin in row slices that bound its temporaries (fp64
GEMMs always run the twin: the kernels compute in fp32).

Like the single-device op, "mean"/"sum" compute the gradients in forward (backward multiplies them by
``grad_output``), and "none" recomputes the chunks in backward with the per-token ``grad_output`` (its
collectives then run in backward too, on every rank in the same order). fp16 gradients get the
single-device op's powers of two (see ``lightning_flce.op``), so a GradScaler works as with the unfused loss.

Shard layout and consistency are checked with one small integer all-reduce per call
(:mod:`lightning_flce.parallel.agreement`), before any other collective.

Not supported (raise): ``class_weight`` (``NotImplementedError``). Not tested: ``torch.compile`` of a graph
containing this op (it is a plain ``autograd.Function`` with host syncs and collectives, so dynamo
graph-breaks around it).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_flce.engine import (
    accumulator_dtype,
    check_single_backward,
    finish_saved_grads,
    inverse_scales,
    run_chunks,
    saved_gradients,
    target_range_error,
    valid_rows,
)
from lightning_flce.kernels import (
    Backend,
    ChunkOutputs,
    backend_for,
    copy_gradient,
    resolve_backend,
    softmax_dtype,
)
from lightning_flce.losses.cross_entropy import CrossEntropyChunkLoss, kernel_options, loss_scales
from lightning_flce.options import (
    AccumDtype,
    FLCEOptions,
    ImplName,
    LogitsPrecision,
    Reduction,
    resolve_logits_precision,
    takes_options_of,
)
from lightning_flce.outputs import FLCEOutput, shaped_like_target
from lightning_flce.parallel.agreement import (
    agree,
    agreement_device,
    agreement_row,
    call_group,
    layout,
    local_tensors,
)
from lightning_flce.parallel.sequence import gather_rows, local_rows, reduce_scatter_rows
from lightning_flce.per_token import CROSS_ENTROPY_INPUTS, PER_TOKEN_INPUTS
from lightning_flce.validation import check_inputs, class_indices

__all__ = [
    "vocab_parallel_fused_linear_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy_with_stats",
]


def vocab_parallel_fused_linear_cross_entropy(
    input: Tensor,
    weight_shard: Tensor,
    target: Tensor,
    bias_shard: Optional[Tensor] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    token_weight: Optional[Tensor] = None,
    logits_precision: LogitsPrecision = "input",
    chunk_size: Optional[int] = None,
    accum_dtype: AccumDtype = None,
    class_weight: Optional[Tensor] = None,
    impl: ImplName = "auto",
    sequence_parallel: bool = False,
) -> Tensor:
    """:func:`~lightning_flce.fused_linear_cross_entropy` with the head weight sharded over V across ``group``.

    Call it on every rank of ``group`` with the same ``input``, ``target`` and options; each rank passes its
    own rows of the weight (and bias). The result — the loss and the gradient w.r.t. ``input`` — is the same
    on every rank and equals the single-device op on the full weight; ``weight_shard.grad`` (and
    ``bias_shard.grad``) get the rows of the full gradient that the rank holds.

    Args:
        input: [..., H] hidden states, identical on every rank of ``group``.
        weight_shard: [V_r, H] this rank's rows of the head weight (V_r >= 1). A ``DTensor`` sharded
            ``Shard(0)`` on a 1-D device mesh is accepted too: its local rows and the mesh's group are used.
        target: [...] global class indices in ``[0, V)`` (or ``ignore_index``), identical on every rank.
        bias_shard: optional [V_r] rows of the head bias.
        group: the process group the vocabulary is sharded over (default: the world).
        vocab_start: first global row of ``weight_shard``. ``None`` (default): shards are contiguous in rank
            order, ``vocab_start_r = V_0 + ... + V_{r-1}`` (the sizes are exchanged, so uneven shards work).
            If given, it must be given on every rank and the shards must tile ``[0, V)``.
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap, token_weight, logits_precision,
        chunk_size, accum_dtype: as in
            :func:`~lightning_flce.fused_linear_cross_entropy` (``chunk_size=None`` picks the same size on
            every rank, from the largest shard).
        class_weight: not supported (``NotImplementedError``).
        impl: the per-chunk softmax: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` (CUDA, or
            CPU tensors under ``TRITON_INTERPRET=1``) or ``"torch"``; the GEMMs are cuBLAS either way.
        sequence_parallel: ``input`` and ``target`` hold this rank's tokens only (sequence parallelism: the
            same number on every rank, rank ``r``'s after rank ``r - 1``'s). They are all-gathered for the
            loss; dX is reduce-scattered back to this rank's tokens instead of all-reduced; "none" returns the
            losses of this rank's tokens (their ``grad_output`` is all-gathered in backward), and so do the
            statistics of ``..._with_stats``. "mean"/"sum" are over all ranks' tokens.

    Returns:
        The loss (a scalar, or one per token in the target's shape for ``reduction="none"``) in fp32, fp64 for
        fp64 inputs, replicated on every rank. Backpropagate the same ``grad_output`` on every rank (the usual
        case: the loss feeds the same computation on all).
    """
    options = {
        "ignore_index": ignore_index,
        "reduction": reduction,
        "label_smoothing": label_smoothing,
        "lse_square_scale": lse_square_scale,
        "softcap": softcap,
        "token_weight": token_weight,
        "logits_precision": logits_precision,
        "chunk_size": chunk_size,
        "accum_dtype": accum_dtype,
        "class_weight": class_weight,
        "impl": impl,
    }
    return _call(
        input,
        weight_shard,
        target,
        bias_shard,
        options,
        group=group,
        vocab_start=vocab_start,
        sequence_parallel=sequence_parallel,
        compute_stats=False,
    ).loss


@takes_options_of(vocab_parallel_fused_linear_cross_entropy)
def vocab_parallel_fused_linear_cross_entropy_with_stats(
    input: Tensor, weight_shard: Tensor, target: Tensor, bias_shard: Optional[Tensor] = None, **kwargs: Any
) -> FLCEOutput:
    """:func:`vocab_parallel_fused_linear_cross_entropy` plus the per-token global LSE, ``argmax == target``
    (first maximum over the whole vocabulary on ties) and entropy, as
    :func:`~lightning_flce.fused_linear_cross_entropy_with_stats` returns them (one more all-reduce per
    chunk, for the argmax)."""
    group = kwargs.pop("group", None)
    vocab_start = kwargs.pop("vocab_start", None)
    sequence_parallel = kwargs.pop("sequence_parallel", False)
    return _call(
        input,
        weight_shard,
        target,
        bias_shard,
        kwargs,
        group=group,
        vocab_start=vocab_start,
        sequence_parallel=sequence_parallel,
        compute_stats=True,
    )


class _Plan(NamedTuple):
    """What every rank agreed on (:func:`~lightning_flce.parallel.agreement.layout`), plus the loss options."""

    group: Optional[dist.ProcessGroup]
    vocab_start: int
    vocab: int
    n_valid: int
    chunk_size: int
    compute_dtype: torch.dtype
    options: (
        FLCEOptions  # per-token inputs: every token's (all-gathered with sequence parallelism), flattened
    )
    backend: (
        Backend  # whose shard kernels run the softmax (Triton on CUDA or in the interpreter, or the twin)
    )
    sequence_parallel: bool  # inputs are this rank's tokens: gathered in, dX reduce-scattered out


def _call(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    options: dict,
    *,
    group: Optional[dist.ProcessGroup],
    vocab_start: Optional[int],
    sequence_parallel: bool,
    compute_stats: bool,
) -> FLCEOutput:
    # Raised on this rank only: without a process group there is no collective to tell the others through.
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_fused_linear_cross_entropy needs an initialized torch.distributed")
    group = call_group(weight, group)
    sequence_parallel = bool(sequence_parallel)
    # The argument checks of this rank: an error is re-raised after the agreement all-reduce, which every
    # rank must join (a rank raising before it would leave the others waiting there).
    failure = row = None
    try:
        options = FLCEOptions.of(**options)
        if options.class_weight is not None:
            raise NotImplementedError(
                "class_weight is not supported by the vocab-parallel op (its normalizer and smoothing term would"
                " need the weights of every shard); use fused_linear_cross_entropy on the full weight"
            )
        input, weight, bias = local_tensors(input, weight, bias)
        compute_dtype = check_inputs(input, weight, target, bias, options)
        options, compute_dtype = resolve_logits_precision(options, compute_dtype)
        token_shape = target.shape  # this rank's tokens: the shape of "none"'s losses and of the statistics
        target = class_indices(target)
        backend = backend_for(resolve_backend(options.impl, input.device), compute_dtype)
        grad_enabled = torch.is_grad_enabled()
        needs = (
            grad_enabled and input.requires_grad,
            grad_enabled and weight.requires_grad,
            grad_enabled and bias is not None and bias.requires_grad,
        )
        row = agreement_row(
            input,
            weight,
            target,
            vocab_start=vocab_start,
            options=options,
            compute_dtype=compute_dtype,
            need_grad_input=needs[0],
            compute_stats=compute_stats,
            sequence_parallel=sequence_parallel,
            has_bias=bias is not None,
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
    )
    local_input = input
    # After the agreement: every rank holds as many tokens, of one hidden size and dtype.
    if sequence_parallel:
        input, target = _gather_tokens(input, target, group)
    # the per-token inputs of every token, flattened (all-gathered as the tokens are)
    per_token = {}
    for name in CROSS_ENTROPY_INPUTS:
        value = getattr(options, name)
        if value is not None:
            value = value.reshape(-1)
            if sequence_parallel and PER_TOKEN_INPUTS[name].sequence_parallel_gather:
                value = gather_rows(value, group)
            per_token[name] = value
    if not agreed.targets_in_range:  # the same targets on every rank now: the same message
        raise target_range_error(target, agreed.vocab, options.ignore_index)
    plan = _Plan(
        group=group,
        vocab_start=agreed.vocab_start,
        vocab=agreed.vocab,
        n_valid=agreed.n_valid,
        chunk_size=agreed.chunk_size,
        compute_dtype=compute_dtype,
        options=options.replace(**per_token),
        backend=backend,
        sequence_parallel=sequence_parallel,
    )
    loss, lse, correct, entropy = _VocabParallelFLCE.apply(
        local_input, weight, target, bias, plan, options.reduction, compute_stats, needs, input
    )
    return shaped_like_target(
        FLCEOutput(loss, lse, correct, entropy), token_shape, options.reduction, compute_stats
    )


class _VocabParallelFLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, bias, plan: _Plan, reduction: str, compute_stats: bool, needs, x_all):
        # x: this rank's input (what autograd sees); x_all: every token's (x itself without sequence parallelism)
        need_gx, need_gw, need_gb = needs
        grads_now = reduction != "none"
        # dW stays in its accumulator's dtype until backward casts it with grad_output folded in (see op.py)
        n_chunks = -(-plan.n_valid // plan.chunk_size)
        grad_weight_dtype = accumulator_dtype(plan.options.accum_dtype, weight, plan.compute_dtype, n_chunks)
        with torch.autocast(x.device.type, enabled=False):
            ce_scale, z_scale = _token_scales(plan, target, reduction)
            loss, lse, correct, entropy, gx, gw, gb, scales = _chunk_loop(
                x_all,
                weight,
                target,
                bias,
                plan,
                ce_scale=ce_scale,
                z_scale=z_scale,
                need_grad_input=need_gx and grads_now,
                need_grad_weight=need_gw and grads_now,
                need_grad_bias=need_gb and grads_now,
                compute_stats=compute_stats,
                keep_scaled=True,
                grad_weight_dtype=grad_weight_dtype,
            )
        # the per-token results are the same on every rank: reduce them whole, or keep this rank's tokens'
        if reduction != "none":
            loss = loss.sum()
        elif plan.sequence_parallel:
            loss = local_rows(loss, plan.group)
        if plan.sequence_parallel:
            lse, correct, entropy = (local_rows(t, plan.group) for t in (lse, correct, entropy))
        if gx is not None:
            gx = gx.view(x.shape)
        ctx.plan, ctx.reduction, ctx.needs, ctx.input_shape = plan, reduction, needs, x.shape
        ctx.final_dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for t in (lse, correct, entropy) if t is not None))
        if reduction == "none":
            ctx.save_for_backward(x_all, weight, target, bias)
        else:
            saved = saved_gradients(x, gx, gw, gb)
            ctx.save_for_backward(*saved, inverse_scales(scales, plan.compute_dtype, x.device))
        return loss, lse, correct, entropy

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grads = [None] * 9
        if grad_loss is None:
            return tuple(grads)
        need_gx, need_gw, need_gb = ctx.needs
        plan = ctx.plan
        if ctx.reduction == "none":
            x_all, weight, target, bias = ctx.saved_tensors
            grad = grad_loss.reshape(-1)
            if plan.sequence_parallel:  # every rank's chunks need every token's grad_output
                grad = gather_rows(grad.contiguous(), plan.group)
            with torch.autocast(x_all.device.type, enabled=False):
                weight_scale, _ = _token_scales(plan, target, "sum")  # [1] ones, or the token weights [N]
                scale = grad.to(weight_scale.dtype) * weight_scale
                *_, gx, gw, gb, _ = _chunk_loop(
                    x_all,
                    weight,
                    target,
                    bias,
                    plan,
                    ce_scale=scale,
                    z_scale=scale,
                    need_grad_input=need_gx,
                    need_grad_weight=need_gw,
                    need_grad_bias=need_gb,
                    compute_stats=False,
                )
            if gx is not None:
                gx = gx.view(ctx.input_shape)
        else:
            check_single_backward(ctx)
            *saved, inverse = ctx.saved_tensors
            gx, gw, gb = finish_saved_grads(saved, ctx.final_dtypes, grad_loss, inverse)
        grads[0] = gx if need_gx else None
        grads[1] = gw if need_gw else None
        grads[3] = gb if need_gb else None
        return tuple(grads)


def _token_scales(plan: _Plan, target: Tensor, reduction: str) -> Tuple[Tensor, Tensor]:
    dtype = softmax_dtype(plan.compute_dtype)
    return loss_scales(target, reduction, plan.options.ignore_index, None, plan.options.token_weight, dtype)


def _gather_tokens(
    input: Tensor, target: Tensor, group: Optional[dist.ProcessGroup]
) -> Tuple[Tensor, Tensor]:
    """Sequence parallelism: all ranks' tokens, ``[sum N_r, H]`` and ``[sum N_r]`` (the agreement checked that
    every rank holds as many, of one hidden size and dtype)."""
    hidden = input.reshape(-1, input.shape[-1]).detach()
    return gather_rows(hidden, group), gather_rows(target.reshape(-1), group)


def _chunk_loop(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    plan: _Plan,
    *,
    ce_scale: Tensor,
    z_scale: Tensor,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    compute_stats: bool,
    keep_scaled: bool = False,
    grad_weight_dtype: Optional[torch.dtype] = None,
) -> Tuple[Optional[Tensor], ...]:
    """The engine's chunk loop (:func:`lightning_flce.engine.run_chunks`) on a shard: per-token loss/LSE/stats [N]
    (replicated), the gradients (dX [N, H] all-reduced over the group, or with sequence parallelism this
    rank's reduce-scattered rows; dW, db local rows; None for gradients not asked for) and their
    :class:`~lightning_flce.engine.GradScales` (``keep_scaled`` and ``grad_weight_dtype`` as in ``run_chunks``)."""
    target = target.reshape(-1)

    def shard_cross_entropy(
        logits, chunk_target, options, *, ce_scale, z_scale, compute_grad, compute_stats, grad_out
    ):
        out = ChunkOutputs(
            *_shard_chunk(
                logits,
                chunk_target,
                plan,
                ce_scale=ce_scale,
                z_scale=z_scale,
                compute_grad=compute_grad,
                compute_stats=compute_stats,
            )
        )
        # fp32 logits: the shard kernels write their gradient in place, narrowed here
        if grad_out is not None:
            copy_gradient(logits, grad_out)
        return out

    loss = CrossEntropyChunkLoss(
        shard_cross_entropy,
        kernel_options(
            plan.options.ignore_index,
            plan.options.label_smoothing,
            plan.options.lse_square_scale,
            plan.options.softcap or 0.0,
            None,
            plan.compute_dtype,
        ),
        ce_scale=ce_scale,
        z_scale=z_scale,
        compute_stats=compute_stats,
    )
    # Each rank's partial dX is summed over the group: in fp32 at least, so fp16/bf16 partials are not
    # rounded before the sum.
    reduce_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    *per_token, grad_input, grad_weight, grad_bias, scales = run_chunks(
        x,
        weight,
        target,
        bias,
        loss,
        rows=valid_rows(target != plan.options.ignore_index, plan.n_valid),
        n_valid=plan.n_valid,
        chunk_size=plan.chunk_size,
        compute_dtype=plan.compute_dtype,
        need_grad_input=need_grad_input,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
        accum_dtype=plan.options.accum_dtype,
        logits_precision=plan.options.logits_precision,
        triton_logits_gemm=plan.backend.name == "triton",
        grad_input_dtype=reduce_dtype,
        keep_scaled=keep_scaled,
        grad_weight_dtype=grad_weight_dtype,
    )
    if grad_input is not None:
        grad_input = grad_input.view(-1, x.shape[-1])
        if plan.sequence_parallel:  # this rank's tokens only: reduce-scatter instead of all-reduce
            grad_input = reduce_scatter_rows(grad_input, plan.group)
        else:
            dist.all_reduce(grad_input, op=dist.ReduceOp.SUM, group=plan.group)
        grad_input = grad_input.to(x.dtype)
    return (*per_token, grad_input, grad_weight, grad_bias, scales)


def _shard_chunk(
    logits: Tensor,
    target: Tensor,
    plan: _Plan,
    *,
    ce_scale: Tensor,
    z_scale: Tensor,
    compute_grad: bool,
    compute_stats: bool,
) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """One chunk of non-ignored rows on this rank's columns: the loss rows and global LSE (and stats), and
    with ``compute_grad`` ``logits`` overwritten with d loss / d logits of the local columns.

    Same formulas as :mod:`lightning_flce.kernels.cross_entropy` (without class weights): one read of the
    local logits for per-row statistics relative to the local maximum (:func:`shard_row_stats`), two
    all-reduces on [k, C] vectors that make them global, and one read + write for the gradient.
    """
    group = plan.group
    n_rows = logits.shape[0]
    vocab = plan.vocab
    eps = plan.options.label_smoothing
    lam = plan.options.lse_square_scale
    softcap = plan.options.softcap or 0.0
    kernels = plan.backend.kernels()
    local_target = target - plan.vocab_start
    local = kernels.shard_row_stats(
        logits, local_target, softcap=softcap, with_z_sum=eps > 0.0, with_stats=compute_stats
    )
    row_max = local.max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    rescale = (local.max - row_max).exp()  # this shard's sums, relative to the global maximum
    sums = [local.sum_exp * rescale, local.z_target]
    if eps > 0.0:
        sums.append(local.z_sum)
    if compute_stats:
        sums.append(local.exp_z_sum * rescale)
        # first global index of the row maximum: from the first shard (in V order) that holds it
        first = torch.where(local.max == row_max, local.argmax + plan.vocab_start, vocab)
        neg_first = -first
        dist.all_reduce(neg_first, op=dist.ReduceOp.MAX, group=group)
    summed = torch.stack(sums)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    sum_exp, z_target = summed[0], summed[1]
    lse = row_max + sum_exp.log()

    ce_scale = ce_scale.to(lse.dtype)
    z_scale = z_scale.to(lse.dtype)
    ce = (1.0 - eps) * (lse - z_target)
    if eps > 0.0:
        ce = ce + eps * (lse - summed[2] / vocab)
    loss = ce_scale * ce + z_scale * lam * lse.square()

    correct = entropy = None
    if compute_stats:
        correct = -neg_first == target
        entropy = lse - summed[-1] / sum_exp

    if compute_grad:
        # softmax * (ce_scale + 2 z_scale lam lse) - ce_scale eps / V - ce_scale (1 - eps) one-hot
        kernels.shard_softmax_grad(
            logits,
            local_target,
            lse,
            (ce_scale + z_scale * 2.0 * lam * lse).expand(n_rows).contiguous(),
            (ce_scale * eps / vocab).expand(n_rows).contiguous() if eps > 0.0 else None,
            (ce_scale * (1.0 - eps)).expand(n_rows).contiguous(),
            softcap=softcap,
        )
    return loss, lse, correct, entropy
