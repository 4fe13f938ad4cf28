"""Per-token log-probabilities and entropy on the fused head: :func:`fused_linear_logprobs`.

RL objectives (GRPO, PPO, DPO, GSPO, custom sequence-level losses) need the log-probability of each sampled
token under the policy, often its entropy, with gradients for whatever loss is built on them; samplers divide
the (softcapped) logits by a temperature, which the log-probabilities must match.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from lightning_flce.functional import checked_call
from lightning_flce.kernels import softmax_dtype
from lightning_flce.options import FLCEOptions, ImplName, LogitsPrecision
from lightning_flce.rl.logprobs_op import flce_logprobs
from lightning_flce.validation import class_indices

__all__ = ["LogProbsOutput", "fused_linear_logprobs", "inverse_temperature"]


class LogProbsOutput(NamedTuple):
    """Result of :func:`fused_linear_logprobs`.

    Attributes:
        logprobs: ``log p(target)`` per token, in the target's shape (fp32; fp64 for fp64 inputs), 0 at ignored
            positions; differentiable.
        entropy: the entropy of each token's distribution, same shape and dtype, 0 at ignored positions;
            differentiable. None unless ``return_entropy=True``.
    """

    logprobs: Tensor
    entropy: Optional[Tensor]


def fused_linear_logprobs(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    temperature: Union[float, Tensor] = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logits_precision: LogitsPrecision = "input",
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> LogProbsOutput:
    """Per-token log-probabilities of ``target`` (and entropies) under ``softmax(softcap(input @ weight.T + bias) /
    temperature)``, computed in chunks of tokens, with gradients to ``input``, ``weight`` and ``bias`` for any
    upstream gradient of both outputs.

    Equal to ``torch.log_softmax(softcap(F.linear(input, weight, bias).float()) / temperature, -1)`` gathered at
    ``target``, and ``-(p * log p).sum(-1)``; 0 at positions whose target is ``ignore_index``.

    Args:
        input: [..., H] hidden states.
        weight: [V, H] head weight.
        target: [...] integer token ids with the leading shape of ``input``.
        bias: optional [V] head bias.
        temperature: a positive float, or a tensor of positive values in the target's shape (one per token, as a
            sampler that varies it); divides the logits after the softcap. It gets no gradient.
        return_entropy: also return each token's entropy (its gradient is exact: ``-p (log p + H)`` per row).
        ignore_index: positions whose target equals it get 0 and no gradient.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` before the temperature.
        logits_precision: as :func:`~lightning_flce.fused_linear_cross_entropy`'s (``"input"``, ``"fp32"``,
            ``"fp32_head"``, ``"fp32_compensated"``; the last for log-probabilities within ~1e-5 of float64).
        chunk_size: tokens per chunk (None: from a memory budget).
        impl: ``"triton"``, ``"torch"`` or ``"auto"``.

    Returns:
        :class:`LogProbsOutput` (``.logprobs``, ``.entropy``).

    Backward recomputes each chunk's logits (the upstream gradients are known only then), as the cross-entropy's
    ``reduction="none"`` does: about twice the forward's GEMMs.
    """
    options = FLCEOptions.of(
        ignore_index=ignore_index,
        reduction="none",
        softcap=softcap,
        logits_precision=logits_precision,
        chunk_size=chunk_size,
        impl=impl,
    )
    options, compute_dtype, backend = checked_call(input, weight, target, bias, options)
    inv_temperature = inverse_temperature(temperature, target, softmax_dtype(compute_dtype))
    grad_enabled = torch.is_grad_enabled()
    logprobs, entropy = flce_logprobs(
        input,
        weight,
        class_indices(target),
        bias,
        inv_temperature,
        options.ignore_index,
        options.softcap if options.softcap is not None else 0.0,
        options.logits_precision,
        compute_dtype,
        options.accum_dtype,
        options.chunk_size or 0,
        backend.name,
        return_entropy,
        grad_enabled and input.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    return LogProbsOutput(logprobs.view(target.shape), entropy.view(target.shape) if return_entropy else None)


def inverse_temperature(temperature: Union[float, Tensor], target: Tensor, dtype: torch.dtype) -> Tensor:
    """``1 / temperature`` as [1] (a float) or [N] (a tensor in the target's shape) in ``dtype``, on the target's
    device. A float is checked here; a tensor's values with the targets, in the op's one host sync."""
    if isinstance(temperature, Tensor):
        if temperature.shape != target.shape:
            raise ValueError(
                f"temperature must be a float or a tensor in the target's shape {tuple(target.shape)}, got"
                f" {tuple(temperature.shape)}"
            )
        if temperature.device != target.device:
            raise ValueError(f"temperature is on {temperature.device} but target is on {target.device}")
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature must be a floating-point tensor, got {temperature.dtype}")
        return 1.0 / temperature.detach().reshape(-1).to(dtype)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float or a tensor, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    return torch.full((1,), 1.0 / temperature, dtype=dtype, device=target.device)
