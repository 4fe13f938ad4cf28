"""The policy-loss op: :class:`~lightning_flce.losses.policy.PolicyChunkLoss` on the chunk engine, registered as
``torch.library`` custom ops, with the gradients computed in forward (as the cross-entropy's "mean"/"sum"):
backward only multiplies them by grad_output (:func:`lightning_flce.engine.finish_saved_grads`).

Returns the loss (the sum of the scaled per-token losses, 0-d), and each token's log-probability and entropy (no
gradient) for the metrics. Targets, temperatures and advantages (of the tokens that count) are validated with one
host sync, before any kernel runs.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from lightning_flce.engine import (
    inverse_scales,
    register_forward_grads_autograd,
    run_valid_rows,
    saved_grad_dtypes,
    saved_gradient_fakes,
    saved_gradients,
    token_rows,
)
from lightning_flce.kernels import BACKENDS, softmax_dtype
from lightning_flce.losses.policy import PolicyChunkLoss
from lightning_flce.rl.logprobs_op import bad_temperatures, gemm_flops, register_flops, temperature_error

_ARGS = (
    "Tensor x, Tensor weight, Tensor target, Tensor? bias, Tensor inv_temperature, Tensor advantages,"
    " Tensor token_scale, Tensor? old_logprobs, Tensor? ref_logprobs, str loss_type, float epsilon_low,"
    " float epsilon_high, float beta, float entropy_coef, bool with_entropy, int ignore_index, float softcap,"
    " str logits_precision, ScalarType compute_dtype, ScalarType? accum_dtype, int chunk_size, str backend,"
    " bool need_grad_input, bool need_grad_weight, bool need_grad_bias"
)
_NAMES = [part.split()[-1] for part in _ARGS.split(",")]


def _saved_dtypes(a) -> Tuple[torch.dtype, torch.dtype]:
    large = BACKENDS[a["backend"]].large_chunks
    return saved_grad_dtypes(
        a["x"], a["weight"], a["compute_dtype"], a["accum_dtype"], a["chunk_size"], large
    )


def _advantages_error(count: Tensor) -> ValueError:
    return ValueError(f"advantages must be finite: {int(count)} counted token(s) have NaN or Inf")


def _forward(*values) -> Tuple[Tensor, ...]:
    """(loss 0-d, logprobs [N], entropy [N] or empty, dX, dW head, dW tail, d bias, inverse_scales); unused ones
    empty (the gradients: :func:`~lightning_flce.engine.saved_gradients`)."""
    a = dict(zip(_NAMES, values))
    x, weight, compute_dtype = a["x"], a["weight"], a["compute_dtype"]
    vocab, hidden = weight.shape
    target = a["target"].reshape(-1)
    valid = target != a["ignore_index"]
    needs = (a["need_grad_input"], a["need_grad_weight"], a["need_grad_bias"])
    grad_input_dtype, grad_weight_dtype = _saved_dtypes(a)
    with torch.autocast(x.device.type, enabled=False):
        loss = PolicyChunkLoss(
            BACKENDS[a["backend"]].kernels(),
            inv_temperature=a["inv_temperature"],
            softcap=a["softcap"],
            with_entropy=a["with_entropy"],
            vocab=vocab,
            advantages=a["advantages"],
            token_scale=a["token_scale"],
            old_logprobs=a["old_logprobs"],
            ref_logprobs=a["ref_logprobs"],
            loss_type=a["loss_type"],
            epsilon_low=a["epsilon_low"],
            epsilon_high=a["epsilon_high"],
            beta=a["beta"],
            entropy_coef=a["entropy_coef"],
        )
        inv_t = a["inv_temperature"]
        bad_advantages = (~torch.isfinite(a["advantages"]) & valid).sum()
        backend = BACKENDS[a["backend"]]
        logprobs, entropy, per_token_loss, gx, gw, gb, scales = run_valid_rows(
            x,
            weight,
            target,
            a["bias"],
            loss,
            valid=valid,
            ignore_index=a["ignore_index"],
            checks=[
                (bad_temperatures(inv_t, valid).sum(), lambda: temperature_error(inv_t, valid)),
                (bad_advantages, lambda: _advantages_error(bad_advantages)),
            ],
            large_chunks=backend.large_chunks,
            chunk_size=a["chunk_size"],
            compute_dtype=compute_dtype,
            logits_precision=a["logits_precision"],
            triton_logits_gemm=a["backend"] == "triton",
            needs=needs,
            accum_dtype=a["accum_dtype"],
            grad_input_dtype=grad_input_dtype,
            keep_scaled=True,
            grad_weight_dtype=grad_weight_dtype,
        )
    inverse = (
        inverse_scales(scales, compute_dtype, x.device) if any(needs) else x.new_empty(0, dtype=torch.float32)
    )
    if gx is not None:
        gx = gx.view(x.shape)
    grads = saved_gradients(x, gx, gw, gb)
    return (per_token_loss.sum(), logprobs, entropy, *grads, inverse)


def _forward_fake(*values) -> Tuple[Tensor, ...]:
    a = dict(zip(_NAMES, values))
    x, weight, bias = a["x"], a["weight"], a["bias"]
    dtype = softmax_dtype(a["compute_dtype"])
    n_rows = token_rows(x)
    needs = (a["need_grad_input"], a["need_grad_weight"], a["need_grad_bias"])
    return (
        x.new_empty((), dtype=dtype),
        x.new_empty(n_rows, dtype=dtype),
        x.new_empty(n_rows if a["with_entropy"] else 0, dtype=dtype),
        *saved_gradient_fakes(x, weight, bias, needs, *_saved_dtypes(a), a["compute_dtype"]),
    )


_flce_policy_loss_op = torch.library.custom_op(
    "lightning_flce::flce_policy_loss",
    _forward,
    mutates_args=(),
    schema=f"({_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
_flce_policy_loss_op.register_fake(_forward_fake)


flce_policy_loss = register_forward_grads_autograd(
    _flce_policy_loss_op,
    _NAMES,
    op_name="fused_linear_policy_loss",
    why="its gradients are computed in forward",
    repeat_hint=(
        "Call the loss again, or build the loss on fused_linear_logprobs (its backward recomputes the chunks) for"
        " retain_graph or repeated autograd.grad"
    ),
)


register_flops(
    torch.ops.lightning_flce.flce_policy_loss,
    lambda *args: gemm_flops(args[0], args[1]) * (1 + int(args[-3]) + int(args[-2])),
)
