"""The distillation ops: :class:`~lightning_flce.losses.distillation.DistillationChunkLoss` on the chunk engine (the
teacher its auxiliary head), registered as ``torch.library`` custom ops (one opaque node under ``torch.compile``).

- ``lightning_flce::flce_distill`` ("mean"/"sum"): the 0-d loss, with the student's gradients computed in forward
  (as the cross-entropy's and :mod:`lightning_flce.rl.policy_op`'s); backward only multiplies them by grad_output
  (:func:`lightning_flce.engine.finish_saved_grads`).
- ``lightning_flce::flce_distill_per_token`` ("none"): each token's loss without gradients; its backward
  (``lightning_flce::flce_distill_backward``) recomputes the chunks with the per-token grad_output folded into the
  token scale, as :mod:`lightning_flce.rl.logprobs_op` does.

Both also return each token's divergence and cross-entropy (no gradient). The teacher is a head (``teacher_x``,
``teacher_weight``, ``teacher_bias``: the loss's auxiliary head) or a cached top k (``teacher_top_k_indices``,
``teacher_top_k_logits``: per-token side inputs). Targets, a per-token temperature and a cached top k are validated
with one host sync per call (the fp16 bounds read in it), before any kernel runs. The teacher gets no gradient.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.chunk_loss import AuxiliaryHead
from lightning_flce.engine import (
    inverse_scales,
    recomputed_gradient_fakes,
    refuse_double_backward,
    register_forward_grads_autograd,
    run_valid_rows,
    saved_grad_dtypes,
    saved_gradient_fakes,
    saved_gradients,
    token_rows,
)
from lightning_flce.kernels import BACKENDS, softmax_dtype
from lightning_flce.losses.distillation import TEACHER_LOGITS, DistillationChunkLoss, TopKColumns
from lightning_flce.op_autograd import OpWithAutograd
from lightning_flce.rl.logprobs_op import bad_temperatures, gemm_flops, register_flops, temperature_error

_ARGS = (
    "Tensor x, Tensor weight, Tensor? bias, Tensor? teacher_x, Tensor? teacher_weight, Tensor? teacher_bias,"
    " Tensor? teacher_top_k_indices, Tensor? teacher_top_k_logits,"
    " Tensor target, Tensor token_scale, Tensor inv_temperature, str divergence, float beta, float hard_weight,"
    " int top_k, int ignore_index, float student_softcap, float teacher_softcap, float student_logit_scale,"
    " float teacher_logit_scale, str logits_precision, ScalarType compute_dtype, ScalarType teacher_compute_dtype,"
    " ScalarType? accum_dtype, int chunk_size, str backend, bool need_grad_input, bool need_grad_weight, bool need_grad_bias"
)
_NAMES = [part.split()[-1] for part in _ARGS.split(",")]
#: the op's argument names, in order (:func:`~lightning_flce.distill.functional.distillation_op_args` builds them)
OP_ARG_NAMES: Tuple[str, ...] = tuple(_NAMES)
_N_TENSORS = 11  # x ... inv_temperature: saved for the recompute of "none"'s backward


def _needs(a) -> Tuple[bool, bool, bool]:
    return a["need_grad_input"], a["need_grad_weight"], a["need_grad_bias"]


def _saved_dtypes(a) -> Tuple[torch.dtype, torch.dtype]:
    large = BACKENDS[a["backend"]].large_chunks
    return saved_grad_dtypes(
        a["x"],
        a["weight"],
        a["compute_dtype"],
        a["accum_dtype"],
        a["chunk_size"],
        large,
        workspace_copies=DistillationChunkLoss.workspace_copies,
        auxiliary_dtype=_auxiliary_dtype(a),
    )


def _auxiliary_dtype(a) -> Optional[torch.dtype]:
    """The teacher head's compute dtype; None for a cached teacher's top k (no second head)."""
    return a["teacher_compute_dtype"] if a["teacher_x"] is not None else None


def bad_top_k_rows(indices: Tensor, logits: Tensor, vocab: int, valid: Tensor) -> Tensor:
    """[N] bool: the rows that carry a loss (``valid``) whose cached top k is not usable: an index outside [0, V)
    or a NaN / +inf logit in an entry that is not padding (-inf), no entry that is not padding, or a column twice."""
    padding = logits == float("-inf")
    bad_entry = ~padding & (
        (indices < 0) | (indices >= vocab) | torch.isnan(logits) | (logits == float("inf"))
    )
    sorted_indices = torch.where(padding, -1, indices).sort(dim=1).values
    repeated = (sorted_indices[:, 1:] == sorted_indices[:, :-1]) & (sorted_indices[:, 1:] >= 0)
    return valid & (bad_entry.any(dim=1) | padding.all(dim=1) | repeated.any(dim=1))


def top_k_error(indices: Tensor, logits: Tensor, vocab: int, valid: Tensor) -> ValueError:
    """The error for :func:`bad_top_k_rows` (a host sync)."""
    bad = bad_top_k_rows(indices, logits, vocab, valid).nonzero().view(-1)
    return ValueError(
        f"teacher_top_k: {bad.numel()} token(s) carrying a loss have indices outside [0, {vocab}), NaN or +inf logits,"
        f" a column twice, or only padding (-inf) entries, e.g. at rows {bad[:5].tolist()}"
    )


def distillation_chunk_loss(
    a, kernels: Any, vocab: int, top_k_columns: Optional[TopKColumns] = None
) -> Tuple[DistillationChunkLoss, List[Tuple[Tensor, Callable[[], Exception]]]]:
    """The op's chunk loss from its arguments ``a`` (by :data:`_NAMES`) over a ``vocab``-column vocabulary, its
    per-chunk math ``kernels.distill_chunk`` (a backend's module, or the vocab-parallel op's) and ``top_k_columns``
    (None: the whole vocabulary's, :class:`~lightning_flce.losses.distillation.TopKColumns`), and the checks of
    its inputs to read in the call's host sync (a 0-d count of bad values, the error to raise when it is not 0):
    the temperatures, and a cached top k's indices and logits."""
    x, compute_dtype = a["x"], a["compute_dtype"]
    target = a["target"].reshape(-1)
    valid = target != a["ignore_index"]
    dtype = softmax_dtype(compute_dtype)
    inv_t = a["inv_temperature"].to(dtype)
    checks = [(bad_temperatures(inv_t, valid).sum(), lambda: temperature_error(inv_t, valid))]
    teacher = teacher_top_k = None
    if a["teacher_x"] is not None:
        teacher = AuxiliaryHead(
            TEACHER_LOGITS, a["teacher_x"], a["teacher_weight"], a["teacher_bias"], a["teacher_compute_dtype"]
        )
    else:
        k = a["teacher_top_k_indices"].shape[-1]
        indices = a["teacher_top_k_indices"].reshape(-1, k)
        top_logits = a["teacher_top_k_logits"].reshape(-1, k).to(dtype)
        teacher_top_k = (indices, top_logits)
        checks.append(
            (
                bad_top_k_rows(indices, top_logits, vocab, valid).sum(),
                lambda: top_k_error(indices, top_logits, vocab, valid),
            )
        )
    loss = DistillationChunkLoss(
        kernels,
        teacher=teacher,
        teacher_top_k=teacher_top_k,
        divergence=a["divergence"],
        beta=a["beta"],
        hard_weight=a["hard_weight"],
        top_k=a["top_k"] or None,
        student_softcap=a["student_softcap"] / a["student_logit_scale"],
        teacher_softcap=a["teacher_softcap"] / a["teacher_logit_scale"],
        vocab=vocab,
        token_scale=a["token_scale"].to(dtype),
        student_inv_temperature=inv_t * a["student_logit_scale"],
        teacher_inv_temperature=inv_t * a["teacher_logit_scale"],
        ce_inv_temperature=torch.full((1,), a["student_logit_scale"], dtype=dtype, device=x.device),
        top_k_columns=top_k_columns,
    )
    return loss, checks


def _run(a, *, keep_scaled: bool) -> Tuple[Optional[Tensor], ...]:
    """Validate targets and temperatures (one host sync), drop ignored rows, run the chunks. Returns the
    per-token (loss, divergence, ce) and (dX, dW, d bias, :class:`~lightning_flce.engine.GradScales`); with
    ``keep_scaled`` the saved gradients' dtypes of "mean"/"sum" (dW in its accumulator's dtype, fp16 ones scaled),
    else the inputs' dtypes."""
    x, weight, compute_dtype = a["x"], a["weight"], a["compute_dtype"]
    target = a["target"].reshape(-1)
    valid = target != a["ignore_index"]
    needs = _needs(a)
    backend = BACKENDS[a["backend"]]
    loss, checks = distillation_chunk_loss(a, backend.kernels(), weight.shape[0])
    grad_input_dtype, grad_weight_dtype = _saved_dtypes(a) if keep_scaled else (x.dtype, None)
    return run_valid_rows(
        x,
        weight,
        target,
        a["bias"],
        loss,
        valid=valid,
        ignore_index=a["ignore_index"],
        checks=checks,
        large_chunks=backend.large_chunks,
        chunk_size=a["chunk_size"],
        compute_dtype=compute_dtype,
        logits_precision=a["logits_precision"],
        triton_logits_gemm=a["backend"] == "triton",
        needs=needs,
        accum_dtype=a["accum_dtype"],
        grad_input_dtype=grad_input_dtype,
        keep_scaled=keep_scaled,
        grad_weight_dtype=grad_weight_dtype,
        auxiliary_dtype=_auxiliary_dtype(a),
    )


# ----------------------------------------------------------------------------------------------
# "mean" / "sum": the gradients computed in forward
# ----------------------------------------------------------------------------------------------


def _forward(*values) -> Tuple[Tensor, ...]:
    """(loss 0-d, divergence [N], ce [N] or empty, dX, dW head, dW tail, d bias, inverse_scales); unused ones
    empty (the gradients: :func:`~lightning_flce.engine.saved_gradients`)."""
    a = dict(zip(_NAMES, values))
    x = a["x"]
    with torch.autocast(x.device.type, enabled=False):
        per_token_loss, divergence, ce, gx, gw, gb, scales = _run(a, keep_scaled=True)
    needs = _needs(a)
    inverse = (
        inverse_scales(scales, a["compute_dtype"], x.device)
        if any(needs)
        else x.new_empty(0, dtype=torch.float32)
    )
    if gx is not None:
        gx = gx.view(x.shape)
    grads = saved_gradients(x, gx, gw, gb)
    return (per_token_loss.sum(), divergence, ce, *grads, inverse)


def _forward_fake(*values) -> Tuple[Tensor, ...]:
    a = dict(zip(_NAMES, values))
    x, weight, bias = a["x"], a["weight"], a["bias"]
    dtype = softmax_dtype(a["compute_dtype"])
    n_rows = token_rows(x)
    return (
        x.new_empty((), dtype=dtype),
        x.new_empty(n_rows, dtype=dtype),
        x.new_empty(n_rows if a["hard_weight"] != 0.0 else 0, dtype=dtype),
        *saved_gradient_fakes(x, weight, bias, _needs(a), *_saved_dtypes(a), a["compute_dtype"]),
    )


_flce_distill_op = torch.library.custom_op(
    "lightning_flce::flce_distill",
    _forward,
    mutates_args=(),
    schema=f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_flce_distill_op.register_fake(_forward_fake)


flce_distill = register_forward_grads_autograd(
    _flce_distill_op,
    _NAMES,
    op_name="fused_linear_distillation",
    why="with reduction 'mean'/'sum' its gradients are computed in forward",
    repeat_hint=(
        "Use reduction='none' (it recomputes in backward; take .sum()/.mean() of its output) for retain_graph or"
        " repeated autograd.grad, or call the loss again"
    ),
)


# ----------------------------------------------------------------------------------------------
# "none": per-token losses; backward recomputes the chunks with grad_output as the token scale
# ----------------------------------------------------------------------------------------------


def _no_grads(values) -> dict:
    a = dict(zip(_NAMES, values))
    a.update(need_grad_input=False, need_grad_weight=False, need_grad_bias=False)
    return a


def _forward_per_token(*values) -> Tuple[Tensor, Tensor, Tensor]:
    """(loss [N], divergence [N], ce [N] or empty), without gradients."""
    a = _no_grads(values)
    with torch.autocast(a["x"].device.type, enabled=False):
        per_token_loss, divergence, ce, *_ = _run(a, keep_scaled=False)
    return per_token_loss, divergence, ce


def _forward_per_token_fake(*values) -> Tuple[Tensor, Tensor, Tensor]:
    a = dict(zip(_NAMES, values))
    x = a["x"]
    dtype = softmax_dtype(a["compute_dtype"])
    n_rows = token_rows(x)
    return (
        x.new_empty(n_rows, dtype=dtype),
        x.new_empty(n_rows, dtype=dtype),
        x.new_empty(n_rows if a["hard_weight"] != 0.0 else 0, dtype=dtype),
    )


def _backward_recompute(grad_loss, *values) -> Tuple[Tensor, Tensor, Tensor]:
    """dX, dW, d bias (empty where not needed) for the per-token ``grad_loss``: the chunks recomputed with
    ``grad_loss * token_scale`` as the token scale."""
    a = dict(zip(_NAMES, values))
    x = a["x"]
    dtype = softmax_dtype(a["compute_dtype"])
    a["token_scale"] = grad_loss.reshape(-1).to(dtype) * a["token_scale"].to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        *_, gx, gw, gb, _ = _run(a, keep_scaled=False)
    if gx is not None:
        gx = gx.view(x.shape)
    return tuple(g if g is not None else x.new_empty(0) for g in (gx, gw, gb))


def _backward_recompute_fake(grad_loss, *values) -> Tuple[Tensor, Tensor, Tensor]:
    a = dict(zip(_NAMES, values))
    return recomputed_gradient_fakes(a["x"], a["weight"], a["bias"], _needs(a))


_flce_distill_per_token_op = torch.library.custom_op(
    "lightning_flce::flce_distill_per_token",
    _forward_per_token,
    mutates_args=(),
    schema=f"({_ARGS}) -> (Tensor, Tensor, Tensor)",
)
_flce_distill_per_token_op.register_fake(_forward_per_token_fake)
flce_distill_backward = torch.library.custom_op(
    "lightning_flce::flce_distill_backward",
    _backward_recompute,
    mutates_args=(),
    schema=f"(Tensor grad_loss, {_ARGS}) -> (Tensor, Tensor, Tensor)",
)
flce_distill_backward.register_fake(_backward_recompute_fake)


def _setup_context_per_token(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*inputs[:_N_TENSORS])
    ctx.options = inputs[_N_TENSORS:]


def _backward_per_token(ctx, grad_loss, *unused) -> Tuple[Optional[Tensor], ...]:
    grads = dict.fromkeys(_NAMES)
    if grad_loss is None:
        return tuple(grads.values())
    inputs = (*ctx.saved_tensors, *ctx.options)
    gx, gw, gb = flce_distill_backward(grad_loss, *inputs)
    a = dict(zip(_NAMES, inputs))
    grads["x"] = gx if a["need_grad_input"] else None
    grads["weight"] = gw if a["need_grad_weight"] else None
    grads["bias"] = gb if a["need_grad_bias"] else None
    return tuple(grads.values())


flce_distill_per_token = OpWithAutograd(
    _flce_distill_per_token_op, _backward_per_token, setup_context=_setup_context_per_token
)


refuse_double_backward(flce_distill_backward, "fused_linear_distillation")


# ----------------------------------------------------------------------------------------------
# FLOP counts (model FLOPs: the recompute in "none"'s backward is not counted)
# ----------------------------------------------------------------------------------------------

_NEED_GRAD_INPUT = _NAMES.index("need_grad_input")


def _logits_flops(args) -> int:
    """2 N V (H_s + H_t): the two logits GEMMs (the student's alone for a cached teacher's top k)."""
    teacher = gemm_flops(args[3], args[4]) if args[3] is not None else 0
    return gemm_flops(args[0], args[1]) + teacher


def _grad_flops(args) -> int:
    """2 N V H_s for each of dX and dW."""
    need_grad_input, need_grad_weight = args[_NEED_GRAD_INPUT], args[_NEED_GRAD_INPUT + 1]
    return gemm_flops(args[0], args[1]) * (int(need_grad_input) + int(need_grad_weight))


register_flops(torch.ops.lightning_flce.flce_distill, lambda *args: _logits_flops(args) + _grad_flops(args))
register_flops(torch.ops.lightning_flce.flce_distill_per_token, lambda *args: _logits_flops(args))
register_flops(torch.ops.lightning_flce.flce_distill_backward, lambda grad_loss, *args: _grad_flops(args))
