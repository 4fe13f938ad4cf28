"""The RL calls on a model's LM head, run inside the head's own call, and the mixin's options for them: what
:meth:`~lightning_flce.mixin.FLCEMixin.flce_logprobs` and :meth:`~lightning_flce.mixin.FLCEMixin.flce_policy_loss`
compute once the head is found (:func:`~lightning_flce.head_discovery.resolve_head`).

Each runs inside the head's own call (:func:`~lightning_flce.head_calls.run_in_head`: hooks around the head run
around the loss, the logit scale multiplies the hidden states and the bias, the softcap is the op's, a PEFT LoRA
head is one linear map with its logits). Not yet supported, and refused: a
:class:`~lightning_flce.parallel.VocabParallelHead` (no vocab-parallel RL op).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

from torch import Tensor

from lightning_flce.head_calls import run_in_head
from lightning_flce.head_discovery import ResolvedHead
from lightning_flce.losses.policy import LOSS_TYPES
from lightning_flce.options import FLCEOptions
from lightning_flce.rl.logprobs import LogProbsOutput, fused_linear_logprobs
from lightning_flce.rl.policy import FusedLinearPolicyLoss, PolicyLossOutput, fused_linear_policy_loss

__all__ = ["head_logprobs", "head_policy_loss", "policy_loss_module"]

_RL_CALLS = "the RL calls (flce_logprobs, flce_policy_loss)"


def policy_loss_module(options: FLCEOptions, **policy: Any) -> FusedLinearPolicyLoss:
    """The mixin's policy-loss options (``policy``: ``loss_type``, ``epsilon_low``, ...) as the module that
    holds them, with the cross-entropy record's ``ignore_index``, ``logits_precision``, ``chunk_size`` and
    ``impl``; checked here, the errors naming the ``flce_*`` options."""
    if policy["loss_type"] not in LOSS_TYPES:
        raise ValueError(f"flce_loss_type must be one of {LOSS_TYPES}, got {policy['loss_type']!r}")
    for name in ("epsilon_low", "epsilon_high", "beta", "entropy_coef", "temperature"):
        value = policy[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"flce_{name} must be a finite float, got {value!r}")
    if policy["epsilon_low"] < 0 or policy["epsilon_high"] < 0:
        raise ValueError("flce_epsilon_low and flce_epsilon_high must be >= 0")
    if policy["temperature"] <= 0:
        raise ValueError(f"flce_temperature must be positive, got {policy['temperature']}")
    length = policy["max_completion_length"]
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length <= 0):
        raise ValueError(f"flce_max_completion_length must be a positive int or None, got {length!r}")
    return FusedLinearPolicyLoss(
        **policy,
        ignore_index=options.ignore_index,
        logits_precision=options.logits_precision,
        chunk_size=options.chunk_size,
        impl=options.impl,
    )


def head_logprobs(
    resolved: ResolvedHead,
    hidden: Tensor,
    target: Tensor,
    *,
    temperature: Union[float, Tensor],
    return_entropy: bool,
    **options: Any,
) -> LogProbsOutput:
    """:func:`~lightning_flce.fused_linear_logprobs` of the head (``options``: its ``ignore_index``,
    ``logits_precision``, ``chunk_size``, ``impl``; the softcap is the head's)."""
    output = run_in_head(
        resolved,
        hidden,
        lambda h, weight, bias: fused_linear_logprobs(
            h,
            weight,
            target,
            bias,
            temperature=temperature,
            return_entropy=return_entropy,
            softcap=resolved.softcap,
            **options,
        ),
        caller=_RL_CALLS,
    )
    return LogProbsOutput(*output)


def head_policy_loss(
    resolved: ResolvedHead,
    hidden: Tensor,
    target: Tensor,
    policy: FusedLinearPolicyLoss,
    *,
    temperature: Optional[Union[float, Tensor]] = None,
    return_entropy: bool = False,
    **per_call: Any,
) -> PolicyLossOutput:
    """:func:`~lightning_flce.fused_linear_policy_loss` of the head with ``policy``'s options (the softcap is
    the head's; ``temperature``, when given, replaces the option's; ``return_entropy`` adds to the option's) and
    the per-call tensors ``per_call`` (:data:`~lightning_flce.per_token.POLICY_INPUTS`)."""
    options = {**policy.options, "softcap": resolved.softcap}
    if temperature is not None:
        options["temperature"] = temperature
    options["return_entropy"] = options["return_entropy"] or return_entropy
    output = run_in_head(
        resolved,
        hidden,
        lambda h, weight, bias: fused_linear_policy_loss(h, weight, target, bias, **per_call, **options),
        caller=_RL_CALLS,
    )
    return PolicyLossOutput(*output)
