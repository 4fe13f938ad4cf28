"""The single-device op: the chunk engine on the whole vocabulary, registered as ``torch.library`` custom ops.

Forward (``lightning_flce::flce_forward``) runs :func:`lightning_flce.engine.run_chunks` with a backend's
chunk kernel, so for "mean"/"sum" the gradients exist when forward returns, and backward only multiplies
them by grad_output (:func:`lightning_flce.engine.finish_saved_grads`: in place, or folded into the cast of
dW's wider accumulator / dX's narrower GEMM dtype). For "none" each token has its own grad_output, which dW
cannot absorb after the fact: forward computes only the loss, and backward
(``lightning_flce::flce_backward``) recomputes the chunks with the per-token scales.

Rows whose target is ``ignore_index`` are dropped before the GEMMs (they cost nothing but a gather).
Targets are validated and counted with one host sync per call, before any kernel runs; the mean's
normalizer stays on the device.

The ops' arguments are declared once, in :data:`FORWARD_ARGS` (name and schema type): the schemas, the
implementations, the fake implementations, ``setup_context``, backward and the FLOP formulas all read them by
name through :class:`ForwardArgs` / :class:`BackwardArgs`. Being custom ops with fake implementations, the op
is a single opaque node under ``torch.compile`` and has FLOP formulas for ``torch.utils.flop_counter``
(Lightning's ``measure_flops``).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.engine import (
    check_single_backward,
    check_targets,
    chunk_rows,
    finish_saved_grads,
    fp16_bound_stats,
    inverse_scales,
    recomputed_gradient_fakes,
    refuse_double_backward,
    run_chunks,
    saved_grad_dtypes,
    saved_gradient_fakes,
    saved_gradients,
    token_rows,
    valid_rows,
)
from lightning_flce.kernels import BACKENDS, softmax_dtype
from lightning_flce.losses.cross_entropy import CrossEntropyChunkLoss, kernel_options, loss_scales
from lightning_flce.op_autograd import OpWithAutograd
from lightning_flce.options import FLCEOptions
from lightning_flce.per_token import CROSS_ENTROPY_INPUTS

# The arguments of lightning_flce::flce_forward, in schema order: (name, schema type). The loss options are
# FLCEOptions' fields as the kernels take them (softcap 0.0 = off, chunk_size 0 = automatic, "backend": the
# resolved impl); the rest say what to compute. lightning_flce::flce_backward takes grad_loss, then these.
FORWARD_ARGS: Tuple[Tuple[str, str], ...] = (
    ("x", "Tensor"),
    ("weight", "Tensor"),
    ("target", "Tensor"),
    ("bias", "Tensor?"),
    ("class_weight", "Tensor?"),
    *((name, "Tensor?") for name in CROSS_ENTROPY_INPUTS),  # per-token inputs: saved for "none"'s backward
    ("ignore_index", "int"),
    ("reduction", "str"),
    ("label_smoothing", "float"),
    ("lse_square_scale", "float"),
    ("softcap", "float"),
    ("logits_precision", "str"),
    ("compute_dtype", "ScalarType"),
    ("accum_dtype", "ScalarType?"),
    ("chunk_size", "int"),
    ("backend", "str"),
    ("need_grad_input", "bool"),
    ("need_grad_weight", "bool"),
    ("need_grad_bias", "bool"),
    ("compute_stats", "bool"),
)
BACKWARD_ARGS: Tuple[Tuple[str, str], ...] = (("grad_loss", "Tensor"), *FORWARD_ARGS)
#: FLCEOptions fields that reach the op under another name (resolved on the way).
OPTION_ARG_NAMES = {"impl": "backend"}
ForwardArgs = namedtuple("ForwardArgs", [name for name, _ in FORWARD_ARGS])
BackwardArgs = namedtuple("BackwardArgs", [name for name, _ in BACKWARD_ARGS])
_TENSOR_ARGS = tuple(name for name, kind in FORWARD_ARGS if kind.startswith("Tensor"))


def _schema(args: Tuple[Tuple[str, str], ...], returns: int) -> str:
    return (
        "("
        + ", ".join(f"{kind} {name}" for name, kind in args)
        + ") -> ("
        + ", ".join(["Tensor"] * returns)
        + ")"
    )


def forward_args(
    options: FLCEOptions,
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    *,
    compute_dtype: torch.dtype,
    backend: str,
    compute_stats: bool,
) -> ForwardArgs:
    """The op's arguments for a validated call: the options by name, and what autograd will need."""
    grad_enabled = torch.is_grad_enabled()
    return ForwardArgs(
        x=x,
        weight=weight,
        target=target,
        bias=bias,
        class_weight=options.class_weight,
        **{name: getattr(options, name) for name in CROSS_ENTROPY_INPUTS},
        ignore_index=options.ignore_index,
        reduction=options.reduction,
        label_smoothing=options.label_smoothing,
        lse_square_scale=options.lse_square_scale,
        softcap=options.softcap if options.softcap is not None else 0.0,
        logits_precision=options.logits_precision,
        compute_dtype=compute_dtype,
        accum_dtype=options.accum_dtype,
        chunk_size=options.chunk_size or 0,
        backend=backend,
        need_grad_input=grad_enabled and x.requires_grad,
        need_grad_weight=grad_enabled and weight.requires_grad,
        need_grad_bias=grad_enabled and bias is not None and bias.requires_grad,
        compute_stats=compute_stats,
    )


def _large_chunks(args) -> bool:
    return BACKENDS[args.backend].large_chunks


def _chunk_loop(
    args,
    *,
    ce_scale: Tensor,
    z_scale: Tensor,
    need_grad_input: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    compute_stats: bool,
    keep_scaled: bool = False,
    grad_input_dtype: Optional[torch.dtype] = None,
    grad_weight_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, ...]:
    """The op's loop: validate targets, drop ignored rows, :func:`~lightning_flce.engine.run_chunks` with the
    cross-entropy (:class:`~lightning_flce.losses.cross_entropy.CrossEntropyChunkLoss` of the backend's chunk
    kernel) on the whole vocabulary.

    Returns per-token loss/LSE/stats [N], the gradients, and :func:`~lightning_flce.engine.inverse_scales`
    (``keep_scaled``, ``grad_input_dtype`` (default: x's) and ``grad_weight_dtype`` as in ``run_chunks``);
    unused outputs are distinct empty tensors (custom-op outputs may not alias each other). The gradients are
    dX, dW and d bias, or with ``grad_weight_dtype`` the four of :func:`~lightning_flce.engine.saved_gradients`
    (dW as its accumulator's two blocks, for backward to round).
    """
    x, weight, compute_dtype = args.x, args.weight, args.compute_dtype
    options = kernel_options(
        args.ignore_index,
        args.label_smoothing,
        args.lse_square_scale,
        args.softcap,
        args.class_weight,
        compute_dtype,
    )
    target = args.target.reshape(-1)
    valid = target != options.ignore_index
    backend = BACKENDS[args.backend]
    loss = CrossEntropyChunkLoss(
        backend.kernels().cross_entropy_chunk,
        options,
        ce_scale=ce_scale,
        z_scale=z_scale,
        compute_stats=compute_stats,
        takes_tile_lse=args.backend == "triton",  # the Triton chunk kernel takes the GEMM's tile statistics
    )
    fp16_stats = []
    if compute_dtype == torch.float16 and (need_grad_input or need_grad_weight or need_grad_bias):
        fp16_stats = fp16_bound_stats(
            x.reshape(-1, x.shape[-1]), loss, keep_scaled=keep_scaled, weight_dtype=weight.dtype
        )
    n_valid, fp16_bounds = check_targets(target, valid, weight.shape[0], options.ignore_index, fp16_stats)
    vocab, hidden = weight.shape
    chunk_size = chunk_rows(
        args.chunk_size,
        token_rows(x),
        n_valid,
        vocab,
        hidden,
        compute_dtype,
        backend.large_chunks,
        loss.workspace_copies,
    )
    *per_token, grad_input, grad_weight, grad_bias, scales = run_chunks(
        x,
        weight,
        target,
        args.bias,
        loss,
        rows=valid_rows(valid, n_valid),
        n_valid=n_valid,
        chunk_size=chunk_size,
        compute_dtype=compute_dtype,
        logits_precision=args.logits_precision,
        triton_logits_gemm=args.backend == "triton",
        need_grad_input=need_grad_input,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
        accum_dtype=args.accum_dtype,
        grad_input_dtype=grad_input_dtype or x.dtype,
        keep_scaled=keep_scaled,
        fp16_bounds=fp16_bounds if fp16_stats else None,
        grad_weight_dtype=grad_weight_dtype,
    )
    if grad_input is not None:
        grad_input = grad_input.view(x.shape)
    if grad_weight_dtype is not None:
        grads = saved_gradients(x, grad_input, grad_weight, grad_bias)
    else:
        grads = [g if g is not None else x.new_empty(0) for g in (grad_input, grad_weight, grad_bias)]
    return (*per_token, *grads, inverse_scales(scales, compute_dtype, x.device))


def _saved_dtypes(args) -> Tuple[torch.dtype, torch.dtype]:
    """(dX, dW) dtypes that "mean"/"sum" forward keeps for backward (see the engine's ``saved_grad_*``)."""
    return saved_grad_dtypes(
        args.x, args.weight, args.compute_dtype, args.accum_dtype, args.chunk_size, _large_chunks(args)
    )


def _token_scales(args, reduction: str) -> Tuple[Tensor, Tensor]:
    dtype = softmax_dtype(args.compute_dtype)
    return loss_scales(args.target, reduction, args.ignore_index, args.class_weight, args.token_weight, dtype)


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


def _forward(*values) -> Tuple[Tensor, ...]:
    """Returns (loss, lse, correct, entropy, grad_input, grad_weight head, grad_weight tail, grad_bias,
    inverse_scales); unused ones are empty. loss, lse and entropy are in
    :func:`~lightning_flce.kernels.softmax_dtype` of ``compute_dtype`` (fp32; fp64 for fp64 GEMMs).
    ``inverse_scales`` (fp32 [3], fp16 GEMMs with gradients only) undoes the powers of two the fp16 gradients
    carry. ``grad_input`` and ``grad_weight`` are in the dtypes of :func:`_saved_dtypes` (backward casts them);
    ``grad_weight`` in the two row blocks of its accumulator (:func:`~lightning_flce.engine.saved_gradients`).

    For "none" no gradient is computed here (backward recomputes); the need_grad_* flags then only
    say what backward will produce.
    """
    args = ForwardArgs(*values)
    grads_now = args.reduction != "none"
    grad_input_dtype, grad_weight_dtype = _saved_dtypes(args)
    with torch.autocast(args.x.device.type, enabled=False):
        ce_scale, z_scale = _token_scales(args, args.reduction)
        loss, lse, correct, entropy, *grads, inverse = _chunk_loop(
            args,
            ce_scale=ce_scale,
            z_scale=z_scale,
            need_grad_input=args.need_grad_input and grads_now,
            need_grad_weight=args.need_grad_weight and grads_now,
            need_grad_bias=args.need_grad_bias and grads_now,
            compute_stats=args.compute_stats,
            keep_scaled=True,
            grad_input_dtype=grad_input_dtype,
            grad_weight_dtype=grad_weight_dtype,
        )
    if grads_now:
        loss = loss.sum()
    if not args.compute_stats:
        lse = lse.new_empty(0)
    if not (grads_now and (args.need_grad_input or args.need_grad_weight or args.need_grad_bias)):
        inverse = inverse.new_empty(0)
    return (loss, lse, correct, entropy, *grads, inverse)


def _forward_fake(*values) -> Tuple[Tensor, ...]:
    args = ForwardArgs(*values)
    x, weight, bias = args.x, args.weight, args.bias
    n_rows = token_rows(x)
    grads_now = args.reduction != "none"  # "none" computes its gradients in backward
    needs = (
        args.need_grad_input and grads_now,
        args.need_grad_weight and grads_now,
        args.need_grad_bias and grads_now,
    )
    loss_dtype = softmax_dtype(args.compute_dtype)
    n_stats = n_rows if args.compute_stats else 0
    return (
        x.new_empty((n_rows,) if args.reduction == "none" else (), dtype=loss_dtype),
        x.new_empty(n_stats, dtype=loss_dtype),
        x.new_empty(n_stats, dtype=torch.bool),
        x.new_empty(n_stats, dtype=loss_dtype),
        *saved_gradient_fakes(x, weight, bias, needs, *_saved_dtypes(args), args.compute_dtype),
    )


def _backward_recompute(*values) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward of reduction="none": recompute each chunk with the per-token grad_output as its scale (times
    the token's weight)."""
    grad_loss, *forward = values
    args = ForwardArgs(*forward)
    with torch.autocast(args.x.device.type, enabled=False):
        weight_scale, _ = _token_scales(args, "sum")  # [1] ones, or the token weights [N]
        scale = grad_loss.reshape(-1).to(weight_scale.dtype) * weight_scale
        *_, gx, gw, gb, _ = _chunk_loop(
            args,
            ce_scale=scale,
            z_scale=scale,
            need_grad_input=args.need_grad_input,
            need_grad_weight=args.need_grad_weight,
            need_grad_bias=args.need_grad_bias,
            compute_stats=False,
        )
    return gx, gw, gb


def _backward_recompute_fake(*values) -> Tuple[Tensor, Tensor, Tensor]:
    _, *forward = values
    args = ForwardArgs(*forward)
    needs = (args.need_grad_input, args.need_grad_weight, args.need_grad_bias)
    return recomputed_gradient_fakes(args.x, args.weight, args.bias, needs)


_flce_forward_op = torch.library.custom_op(
    "lightning_flce::flce_forward", _forward, mutates_args=(), schema=_schema(FORWARD_ARGS, 9)
)
_flce_forward_op.register_fake(_forward_fake)
flce_backward = torch.library.custom_op(
    "lightning_flce::flce_backward", _backward_recompute, mutates_args=(), schema=_schema(BACKWARD_ARGS, 3)
)
flce_backward.register_fake(_backward_recompute_fake)


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    args = ForwardArgs(*inputs)
    ctx.reduction = args.reduction
    ctx.needs = (args.need_grad_input, args.need_grad_weight, args.need_grad_bias)
    ctx.final_dtypes = (args.x.dtype, args.weight.dtype, None if args.bias is None else args.bias.dtype)
    # Only the loss is differentiable. Without this, autograd would hand backward zero-filled
    # [N, H] and [V, H] "gradients" for the saved-gradient outputs: a full dX + dW of memory.
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    if args.reduction == "none":
        ctx.save_for_backward(*(getattr(args, name) for name in _TENSOR_ARGS))
        ctx.args = args._replace(**dict.fromkeys(_TENSOR_ARGS))  # the tensors live in saved_tensors
    else:
        ctx.save_for_backward(*output[4:])


def _backward(ctx, grad_loss, *unused_grads) -> Tuple[Optional[Tensor], ...]:
    grads = dict.fromkeys(ForwardArgs._fields)
    if grad_loss is not None:
        if ctx.reduction == "none":
            args = ctx.args._replace(**dict(zip(_TENSOR_ARGS, ctx.saved_tensors)))
            gx, gw, gb = flce_backward(grad_loss, *args)
        else:
            check_single_backward(ctx)
            *saved, inverse = ctx.saved_tensors
            gx, gw, gb = finish_saved_grads(saved, ctx.final_dtypes, grad_loss, inverse)
        need_grad_input, need_grad_weight, need_grad_bias = ctx.needs
        grads["x"] = gx if need_grad_input else None
        grads["weight"] = gw if need_grad_weight else None
        grads["bias"] = gb if need_grad_bias else None
    return tuple(grads.values())


#: The forward op with its autograd (eager calls with gradients skip torch.library's wrapper: op_autograd.py).
flce_forward = OpWithAutograd(_flce_forward_op, _backward, setup_context=_setup_context)


refuse_double_backward(
    flce_backward,
    "fused linear cross-entropy",
    why="its reduction='none' backward recomputes the chunks",
    alternative=None,
)


# ----------------------------------------------------------------------------------------------
# FLOP counts (model FLOPs: a recompute in backward is not counted, as with activation checkpointing)
# ----------------------------------------------------------------------------------------------


def _gemm_flops(x_shape, weight_shape) -> int:
    n_rows = 1
    for dim in x_shape[:-1]:
        n_rows *= dim
    vocab, hidden = weight_shape
    return 2 * n_rows * hidden * vocab


def _register_flop_formulas() -> None:
    try:
        from torch.utils.flop_counter import register_flop_formula
    except ImportError:  # pragma: no cover - older torch
        return

    # The counter passes the arguments in schema order, tensors replaced by their shapes.
    @register_flop_formula(torch.ops.lightning_flce.flce_forward)
    def _forward_flops(*values, out_shape=None, **kwargs) -> int:
        args = ForwardArgs(*values)
        flops = _gemm_flops(args.x, args.weight)
        if args.reduction != "none":
            flops *= 1 + int(args.need_grad_input) + int(args.need_grad_weight)
        return flops

    @register_flop_formula(torch.ops.lightning_flce.flce_backward)
    def _backward_flops(*values, out_shape=None, **kwargs) -> int:
        args = BackwardArgs(*values)
        return _gemm_flops(args.x, args.weight) * (int(args.need_grad_input) + int(args.need_grad_weight))

    # torch 2.4 files custom ops' formulas under their .default overload but looks ops up by packet.
    from torch.utils import flop_counter

    registry = getattr(flop_counter, "flop_registry", {})
    for packet in (torch.ops.lightning_flce.flce_forward, torch.ops.lightning_flce.flce_backward):
        if packet not in registry and packet.default in registry:
            registry[packet] = registry[packet.default]


_register_flop_formulas()
