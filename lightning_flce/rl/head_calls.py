"""The RL calls on a model's LM head, run inside the head's own call, and the mixin's options for them: what
:meth:`~lightning_flce.mixin.FLCEMixin.flce_logprobs` and :meth:`~lightning_flce.mixin.FLCEMixin.flce_policy_loss`
compute once the head is found (:func:`~lightning_flce.head_discovery.resolve_head`).

As for the cross-entropy (:class:`~lightning_flce.head.FLCEHeadLoss`), the head's weight is read only inside a call
of the head whose ``forward`` is bound to the loss, so that hooks around the head (a forward pre-hook that
gathers a sharded weight, say) run around it; a bare head is used directly. The model's logit transforms apply:
the logit scale multiplies the hidden states and the bias, the softcap is the op's.

A PEFT LoRA head is computed as one linear map with its logits (:func:`~lightning_flce.adapters.lora_head_loss`).
Not yet supported, and refused: a :class:`~lightning_flce.parallel.VocabParallelHead` (no vocab-parallel RL op).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union, cast

from torch import Tensor, nn

from lightning_flce.adapters import is_peft_lora_head, lora_head_loss
from lightning_flce.head import unwrap_head
from lightning_flce.head_discovery import ResolvedHead
from lightning_flce.losses.policy import LOSS_TYPES
from lightning_flce.module_calls import forward_bound_to, has_call_hooks
from lightning_flce.options import FLCEOptions
from lightning_flce.parallel import VocabParallelHead
from lightning_flce.rl.logprobs import LogProbsOutput, fused_linear_logprobs
from lightning_flce.rl.policy import FusedLinearPolicyLoss, PolicyLossOutput, fused_linear_policy_loss

__all__ = ["head_logprobs", "head_policy_loss", "policy_loss_module"]


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


def _run_in_head(
    resolved: ResolvedHead, hidden: Tensor, loss_of: Callable[[Tensor, Tensor, Optional[Tensor]], Any]
) -> Any:
    """``loss_of(hidden, weight, bias)`` inside the head's call, with the head's logit scale applied."""
    head = resolved.module
    module = unwrap_head(head)
    if isinstance(module, VocabParallelHead):
        raise NotImplementedError(
            "the RL calls (flce_logprobs, flce_policy_loss) do not support a VocabParallelHead yet; use a"
            " replicated head"
        )
    lora = is_peft_lora_head(module)  # (raises for the PEFT layers the fused ops cannot compute)
    is_linear = isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
    if not (lora or is_linear or isinstance(module, nn.Embedding)):
        raise TypeError(
            "The LM head must compute F.linear(hidden, head.weight, head.bias): an nn.Linear that keeps"
            f" nn.Linear.forward or an nn.Embedding used as the tied output matrix; got {type(module).__name__}"
        )
    scale = resolved.logit_scale

    def with_operands(head_input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple[Any, ...]:
        if head_input.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"hidden size {head_input.shape[-1]} does not match the head weight {tuple(weight.shape)} ([V, H])"
            )
        if scale is not None:
            head_input = head_input * scale
            bias = None if bias is None else bias * scale
        # a plain tuple: hooks that rebuild their outputs may not handle NamedTuples
        return tuple(loss_of(head_input, weight, bias))

    def as_forward(head_input: Tensor) -> tuple[Any, ...]:
        if lora:  # one linear map with the LoRA head's logits (lightning_flce/adapters.py)
            return lora_head_loss(module, head_input, lambda ops, h: with_operands(h, ops.weight, ops.bias))
        return with_operands(head_input, cast(Tensor, module.weight), getattr(module, "bias", None))

    if head is module and "forward" not in module.__dict__ and not has_call_hooks(module):
        return as_forward(hidden)
    with forward_bound_to(module, as_forward):
        return head(hidden)


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
    output = _run_in_head(
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
    output = _run_in_head(
        resolved,
        hidden,
        lambda h, weight, bias: fused_linear_policy_loss(h, weight, target, bias, **per_call, **options),
    )
    return PolicyLossOutput(*output)
