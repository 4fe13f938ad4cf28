"""The log-probabilities op: :class:`~lightning_flce.losses.logprobs.LogProbsChunkLoss` on the chunk engine,
registered as ``torch.library`` custom ops (one opaque node under ``torch.compile``).

Forward (``lightning_flce::flce_logprobs``) computes each token's ``log p(target)`` and (on request) its entropy
without gradients. The upstream gradients of both are per token and known only in backward
(``lightning_flce::flce_logprobs_backward``), which recomputes the chunks with them as side inputs, as the
cross-entropy's ``reduction="none"`` does. Rows whose target is ``ignore_index`` are dropped before the GEMMs;
targets (and a per-token temperature) are validated with one host sync per call, before any kernel runs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.engine import (
    recomputed_gradient_fakes,
    refuse_double_backward,
    run_valid_rows,
    token_rows,
)
from lightning_flce.kernels import BACKENDS, softmax_dtype
from lightning_flce.losses.logprobs import LogProbsChunkLoss
from lightning_flce.op_autograd import OpWithAutograd

_ARGS = (
    "Tensor x, Tensor weight, Tensor target, Tensor? bias, Tensor inv_temperature, int ignore_index,"
    " float softcap, str logits_precision, ScalarType compute_dtype, ScalarType? accum_dtype, int chunk_size,"
    " str backend, bool return_entropy, bool need_grad_input, bool need_grad_weight, bool need_grad_bias"
)
_N_TENSORS = 5  # x, weight, target, bias, inv_temperature: saved for backward


def bad_temperatures(inv_temperature: Tensor, valid: Tensor) -> Tensor:
    """Where a temperature is not positive and finite (``inv_temperature`` = 1 / T, [1] or [N]); a per-token one
    only where the token counts (``valid``: padding may hold anything)."""
    bad = ~((inv_temperature > 0) & torch.isfinite(inv_temperature))
    return bad & valid if bad.numel() > 1 else bad


def temperature_error(inv_temperature: Tensor, valid: Tensor) -> ValueError:
    """The error for :func:`bad_temperatures` (a host sync)."""
    bad = (1.0 / inv_temperature.double())[bad_temperatures(inv_temperature, valid)]
    return ValueError(
        f"temperature must be positive and finite, got {bad.numel()} value(s) that are not, e.g. {bad[:5].tolist()}"
    )


def _run(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    inv_temperature: Tensor,
    ignore_index: int,
    softcap: float,
    logits_precision: str,
    compute_dtype: torch.dtype,
    accum_dtype: Optional[torch.dtype],
    chunk_size: int,
    backend: str,
    return_entropy: bool,
    need_grad_input: bool = False,
    need_grad_weight: bool = False,
    need_grad_bias: bool = False,
    grad_logprobs: Optional[Tensor] = None,
    grad_entropy: Optional[Tensor] = None,
) -> Tuple[Optional[Tensor], ...]:
    """Validate targets and temperatures (one host sync), drop ignored rows, run the chunks. Returns
    (logprobs [N], entropy [N] or empty, dX, dW, d bias) (gradients None where not asked for)."""
    target = target.reshape(-1)
    valid = target != ignore_index
    vocab = weight.shape[0]
    kernels = BACKENDS[backend].kernels()
    loss = LogProbsChunkLoss(
        kernels,
        inv_temperature=inv_temperature,
        softcap=softcap,
        with_entropy=return_entropy,
        vocab=vocab,
        grad_logprobs=grad_logprobs,
        grad_entropy=grad_entropy,
    )
    backend_entry = BACKENDS[backend]
    logprobs, entropy, grad_input, grad_weight, grad_bias, _ = run_valid_rows(
        x,
        weight,
        target,
        bias,
        loss,
        valid=valid,
        ignore_index=ignore_index,
        checks=[
            (
                bad_temperatures(inv_temperature, valid).sum(),
                lambda: temperature_error(inv_temperature, valid),
            )
        ],
        large_chunks=backend_entry.large_chunks,
        chunk_size=chunk_size,
        compute_dtype=compute_dtype,
        logits_precision=logits_precision,
        triton_logits_gemm=backend == "triton",
        needs=(need_grad_input, need_grad_weight, need_grad_bias),
        accum_dtype=accum_dtype,
        grad_input_dtype=x.dtype,
    )
    if grad_input is not None:
        grad_input = grad_input.view(x.shape)
    return logprobs, entropy, grad_input, grad_weight, grad_bias


def _forward(x, weight, target, bias, inv_temperature, *options) -> Tuple[Tensor, Tensor]:
    """(logprobs [N], entropy [N] or empty) in the softmax dtype of ``compute_dtype``."""
    with torch.autocast(x.device.type, enabled=False):
        logprobs, entropy, *_ = _run(x, weight, target, bias, inv_temperature, *options[:8])
    return logprobs, entropy


def _forward_fake(x, weight, target, bias, inv_temperature, *options) -> Tuple[Tensor, Tensor]:
    compute_dtype, return_entropy = options[3], options[7]
    dtype = softmax_dtype(compute_dtype)
    n_rows = token_rows(x)
    return x.new_empty(n_rows, dtype=dtype), x.new_empty(n_rows if return_entropy else 0, dtype=dtype)


def _backward_recompute(grad_logprobs, grad_entropy, x, weight, target, bias, inv_temperature, *options):
    """dX, dW, d bias (empty where not needed) for per-token upstream gradients: the chunks recomputed."""
    dtype = softmax_dtype(options[3])
    with torch.autocast(x.device.type, enabled=False):
        *_, gx, gw, gb = _run(
            x,
            weight,
            target,
            bias,
            inv_temperature,
            *options,
            grad_logprobs=grad_logprobs.reshape(-1).to(dtype),
            grad_entropy=grad_entropy.reshape(-1).to(dtype) if grad_entropy.numel() else None,
        )
    return tuple(g if g is not None else x.new_empty(0) for g in (gx, gw, gb))


def _backward_recompute_fake(grad_logprobs, grad_entropy, x, weight, target, bias, inv_temperature, *options):
    need_grad_input, need_grad_weight, need_grad_bias = options[8:11]
    return recomputed_gradient_fakes(x, weight, bias, (need_grad_input, need_grad_weight, need_grad_bias))


_flce_logprobs_op = torch.library.custom_op(
    "lightning_flce::flce_logprobs", _forward, mutates_args=(), schema=f"({_ARGS}) -> (Tensor, Tensor)"
)
_flce_logprobs_op.register_fake(_forward_fake)
flce_logprobs_backward = torch.library.custom_op(
    "lightning_flce::flce_logprobs_backward",
    _backward_recompute,
    mutates_args=(),
    schema=f"(Tensor grad_logprobs, Tensor grad_entropy, {_ARGS}) -> (Tensor, Tensor, Tensor)",
)
flce_logprobs_backward.register_fake(_backward_recompute_fake)


def _setup_context(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*(t if t is not None else None for t in inputs[:_N_TENSORS]))
    ctx.options = inputs[_N_TENSORS:]
    ctx.n_rows = output[0].shape[0]


def _backward(ctx, grad_logprobs, grad_entropy) -> Tuple[Optional[Tensor], ...]:
    grads = [None] * (_N_TENSORS + len(ctx.options))
    if grad_logprobs is None and grad_entropy is None:
        return tuple(grads)
    x, weight, target, bias, inv_temperature = ctx.saved_tensors
    return_entropy = ctx.options[7]
    dtype = softmax_dtype(ctx.options[3])
    if grad_logprobs is None:
        grad_logprobs = torch.zeros(ctx.n_rows, dtype=dtype, device=x.device)
    if grad_entropy is None or not return_entropy:
        grad_entropy = x.new_empty(0, dtype=dtype)
    gx, gw, gb = flce_logprobs_backward(
        grad_logprobs, grad_entropy, x, weight, target, bias, inv_temperature, *ctx.options
    )
    need_grad_input, need_grad_weight, need_grad_bias = ctx.options[8:11]
    grads[0] = gx if need_grad_input else None
    grads[1] = gw if need_grad_weight else None
    grads[3] = gb if need_grad_bias else None
    return tuple(grads)


flce_logprobs = OpWithAutograd(_flce_logprobs_op, _backward, setup_context=_setup_context)


refuse_double_backward(flce_logprobs_backward, "fused_linear_logprobs")


# ----------------------------------------------------------------------------------------------
# FLOP counts (model FLOPs, as the cross-entropy op counts them: a recompute in backward is not counted)
# ----------------------------------------------------------------------------------------------


def gemm_flops(x_shape, weight_shape) -> int:
    """2 N H V: one GEMM of the head."""
    n_rows = 1
    for dim in x_shape[:-1]:
        n_rows *= dim
    vocab, hidden = weight_shape
    return 2 * n_rows * hidden * vocab


def register_flops(packet, formula) -> None:
    """``formula(*schema_args)`` (tensors as their shapes) as ``packet``'s FLOP formula for
    ``torch.utils.flop_counter`` (Lightning's ``measure_flops``)."""
    try:
        from torch.utils import flop_counter
    except ImportError:  # pragma: no cover - older torch
        return

    flop_counter.register_flop_formula(packet)(lambda *args, out_shape=None, **kwargs: formula(*args))
    # torch 2.4 files custom ops' formulas under their .default overload but looks ops up by packet.
    registry = getattr(flop_counter, "flop_registry", {})
    if packet not in registry and packet.default in registry:
        registry[packet] = registry[packet.default]


register_flops(torch.ops.lightning_flce.flce_logprobs, lambda x, weight, *rest: gemm_flops(x, weight))
register_flops(
    torch.ops.lightning_flce.flce_logprobs_backward,
    lambda grad_logprobs, grad_entropy, x, weight, *rest: (
        gemm_flops(x, weight) * (int(rest[-3]) + int(rest[-2]))
    ),
)
