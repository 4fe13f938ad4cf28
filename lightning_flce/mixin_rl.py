"""The reinforcement-learning calls of :class:`~lightning_flce.mixin.FLCEMixin` (``docs/rl.md``):
:meth:`~PolicyCalls.flce_logprobs` and :meth:`~PolicyCalls.flce_policy_loss` on the mixin's head, with the
policy options it takes as ``flce_*`` arguments (``flce_loss_type``, ``flce_epsilon_low``, ...).

What runs once the head is found is :mod:`lightning_flce.rl.head_calls`'s; here is the Lightning side: the
``shift`` of the per-token tensors, the policy loss's normalizer joined to the optimizer step
(:func:`policy_step_count`, the count each loss type divides by) and its metrics logged when the micro-batch is
back-propagated.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_flce.head import FLCEHeadLoss
from lightning_flce.head_discovery import ResolvedHead, resolve_head
from lightning_flce.mixin_step import StepNormalization
from lightning_flce.per_token import shift_per_token, shift_per_token_inputs
from lightning_flce.rl import FusedLinearPolicyLoss, LogProbsOutput, PolicyLossOutput, policy_normalizer
from lightning_flce.rl.head_calls import head_logprobs, head_policy_loss

__all__ = ["NARROW_INT_DTYPES", "PolicyCalls", "policy_step_count"]

#: target dtypes widened to int64 before the loss (``ignore_index`` (-100) does not fit uint8, say)
NARROW_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32)


def policy_step_count(
    policy: FusedLinearPolicyLoss, target: Tensor, mask: Optional[Tensor], dtype: torch.dtype
) -> tuple[Tensor, str, Union[int, Tensor]]:
    """What a policy-loss call counts into the optimizer step under ``flce_normalize="step"``: its loss type's
    normalizer (:func:`~lightning_flce.rl.policy_normalizer`: the counted tokens, the sequences, or sequences x
    length) with its unit, and the most the call could count (for the fp16 divisor ``D``)."""
    options = policy.options
    counted = target != options["ignore_index"]
    if mask is not None:
        counted = counted & (mask != 0)
    count, unit = policy_normalizer(options["loss_type"], counted.to(dtype), options["max_completion_length"])
    capacity: Union[int, Tensor] = target.numel() if unit == "completion tokens" else count
    return count, unit, capacity


class PolicyCalls(StepNormalization):
    """The RL part of the mixin. ``FLCEMixin.__init__`` makes the state declared here."""

    #: the policy loss's options (flce_policy_loss; the op's names with the flce_ prefix), as its module
    flce_policy: FusedLinearPolicyLoss
    _flce_policy_metrics: dict[str, Tensor]  # to log at the micro-batch's backward
    flce_head: Optional[str]
    flce_head_loss: FLCEHeadLoss  # the cross-entropy's options and the naive flag

    def flce_logprobs(
        self,
        hidden: Tensor,
        target: Tensor,
        *,
        shift: bool = False,
        temperature: Union[float, Tensor, None] = None,
        return_entropy: bool = False,
    ) -> LogProbsOutput:
        """Each token's log-probability of ``target`` under the head, and on request its entropy
        (:func:`~lightning_flce.fused_linear_logprobs`), both differentiable, without the logits.

        The head is found as :meth:`flce_loss` finds it, with the model's logit scale and softcap; the
        ``flce_ignore_index``, ``flce_logits_precision``, ``flce_chunk_size`` and ``flce_impl`` options apply.
        Under ``torch.no_grad()`` it is the reference or old-policy pass (one GEMM per chunk). A loss built on
        it is not normalized by the mixin (a step without :meth:`flce_loss` / :meth:`flce_policy_loss` calls
        keeps Lightning's plain averaging).

        Args:
            hidden: final hidden states [..., H].
            target: token ids [...] (``flce_ignore_index``: 0 and no gradient).
            shift: ``target`` holds the input ids: position t is scored against token t + 1 (the last position
                ignored); a per-token ``temperature`` is shifted with it.
            temperature: a positive float or a tensor of the target's shape dividing the softcapped logits;
                None: ``flce_temperature``.
            return_entropy: also compute each token's entropy.

        Returns:
            :class:`~lightning_flce.LogProbsOutput` (``.logprobs``, ``.entropy``) in the target's shape.
        """
        target = self._flce_rl_target(hidden, target, shift)
        if shift and isinstance(temperature, Tensor):
            temperature = shift_per_token("temperature", temperature)
        policy = self.flce_policy.options
        return head_logprobs(
            self._flce_rl_head(),
            hidden,
            target,
            temperature=policy["temperature"] if temperature is None else temperature,
            return_entropy=return_entropy,
            **{name: policy[name] for name in ("ignore_index", "logits_precision", "chunk_size", "impl")},
        )

    def flce_policy_loss(
        self,
        hidden: Tensor,
        target: Tensor,
        *,
        advantages: Tensor,
        old_logprobs: Optional[Tensor] = None,
        ref_logprobs: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        token_weight: Optional[Tensor] = None,
        temperature: Optional[Tensor] = None,
        return_entropy: bool = False,
        shift: bool = False,
    ) -> PolicyLossOutput:
        """The clipped policy-gradient loss of the head (:func:`~lightning_flce.fused_linear_policy_loss`) with
        the mixin's options ``flce_loss_type``, ``flce_epsilon_low`` / ``flce_epsilon_high``, ``flce_beta``,
        ``flce_entropy_coef``, ``flce_temperature`` and ``flce_max_completion_length``, the head found as
        :meth:`flce_loss` finds it.

        Under ``flce_normalize="step"`` the loss is normalized as its loss type over the whole optimizer step
        (micro-batches and data-parallel ranks), as if the step's sequences were one call: ``"grpo"`` divides
        the sum of the sequences' masked means by the step's sequences, ``"bnpo"``/``"dapo"``/``"cispo"``/
        ``"ppo"`` the masked token sum by the step's masked tokens, ``"dr_grpo"`` by the step's sequences times
        ``flce_max_completion_length`` (default T). The mechanism is :meth:`flce_loss`'s (see the class
        docstring), with the loss type's count in place of the tokens; one step's calls must share one loss
        type's normalizer (and not mix with :meth:`flce_loss`).

        In training, logs the metrics as ``train/policy/<name>`` (this micro-batch's masked means; the last call's
        of the micro-batch, when it is back-propagated: ``on_before_backward`` must call ``super()``).

        Args:
            hidden: [B, T, H] hidden states predicting ``target``.
            target: [B, T] the sampled tokens.
            advantages: [B] or [B, T]; old_logprobs, ref_logprobs, mask, token_weight: [B, T] (see the function).
            temperature: a [B, T] tensor (per token, as the sampler) replacing ``flce_temperature`` for this call.
            return_entropy: compute each token's entropy (and ``entropy_mean``) without an entropy term (it is
                computed anyway when ``flce_entropy_coef`` is not 0).
            shift: ``target`` holds the input ids (position t is scored against t + 1): the [B, T] tensors are
                shifted with it (the last position leaves the mask) and the returned log-probabilities are the
                predicting positions'.

        Returns:
            :class:`~lightning_flce.PolicyLossOutput` whose ``loss`` value is the micro-batch's own normalized
            loss; in training under ``"step"`` its gradient is the micro-batch's share of the step's loss (the
            mixin rescales the gradients at the optimizer step).
        """
        per_token = dict(
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            mask=mask,
            token_weight=token_weight,
            temperature=temperature,
        )
        target = self._flce_rl_target(hidden, target, shift)
        if shift:
            if mask is None:  # the last position leaves the mask
                per_token["mask"] = torch.ones_like(target, dtype=torch.bool)
            per_token = shift_per_token_inputs(per_token)
        output = head_policy_loss(
            self._flce_rl_head(), hidden, target, self.flce_policy, return_entropy=return_entropy, **per_token
        )
        mask = per_token["mask"]
        if self._flce_stage() != "train":
            return output
        count, unit, capacity = policy_step_count(self.flce_policy, target, mask, output.loss.dtype)
        loss = self._flce_count_for_step(output.loss * count, count, unit=unit, capacity=capacity)
        # logged when the micro-batch is back-propagated (on_before_backward): self.log in a compiled step breaks it
        self._flce_policy_metrics = output.metrics
        return output._replace(loss=loss)

    def _flce_log_policy_metrics(self) -> None:
        """Logs the last :meth:`flce_policy_loss` call's metrics of the micro-batch being back-propagated."""
        metrics, self._flce_policy_metrics = self._flce_policy_metrics, {}
        for name, value in metrics.items():  # one call's: per step, so no batch size to weigh
            self.log(f"train/policy/{name}", value, on_step=True, on_epoch=False, batch_size=1)

    def _flce_rl_target(self, hidden: Tensor, target: Tensor, shift: bool) -> Tensor:
        if not isinstance(hidden, Tensor) or not isinstance(target, Tensor):
            raise TypeError(
                f"the RL calls take the final hidden states and the target as tensors, got {type(hidden).__name__}"
                f" and {type(target).__name__}"
            )
        if target.dtype in NARROW_INT_DTYPES:
            target = target.long()
        if shift:
            target = F.pad(target[..., 1:], (0, 1), value=self.flce_head_loss.options.ignore_index)
        return target

    def _flce_rl_head(self) -> ResolvedHead:
        if self.flce_head_loss.naive:
            raise NotImplementedError("flce_naive=True has no RL path: the RL calls always use the fused ops")
        return resolve_head(self, self.flce_head, self.flce_head_loss.options.softcap)
