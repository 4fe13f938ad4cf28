"""The clipped policy-gradient family on the fused head (GRPO, BNPO, DAPO, Dr. GRPO, CISPO, PPO):
:func:`fused_linear_policy_loss`, its module :class:`FusedLinearPolicyLoss` and its metrics, with the gradients
computed in forward (:mod:`lightning_flce.rl.policy_op`, :class:`~lightning_flce.losses.policy.PolicyChunkLoss`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional, Union

import torch
from torch import Tensor

from lightning_flce.functional import checked_call
from lightning_flce.kernels import softmax_dtype
from lightning_flce.losses.policy import LOSS_TYPES, PolicyLossType
from lightning_flce.options import FLCEOptions, ImplName, LogitsPrecision
from lightning_flce.per_token import POLICY_INPUTS, check_per_token
from lightning_flce.rl.logprobs import inverse_temperature
from lightning_flce.rl.policy_op import flce_policy_loss
from lightning_flce.validation import class_indices

__all__ = [
    "FusedLinearPolicyLoss",
    "PolicyLossOutput",
    "fused_linear_policy_loss",
    "policy_metrics",
    "policy_normalizer",
]


class PolicyLossOutput(NamedTuple):
    """Result of :func:`fused_linear_policy_loss`.

    Attributes:
        loss: the normalized policy loss (0-d, fp32; fp64 for fp64 inputs), differentiable.
        metrics: 0-d tensors (no gradient), masked means over the tokens that count: ``"clip_fraction_low"``
            (ratio below ``1 - epsilon_low`` with a negative advantage: clipped from below),
            ``"clip_fraction_high"`` (above ``1 + epsilon_high`` with a positive advantage), ``"ratio_mean"``,
            ``"kl_mean"`` (the k3 KL to ``ref_logprobs``, when given) and ``"entropy_mean"`` (when computed).
        logprobs: each token's log-probability [B, T] (no gradient; 0 where masked or ignored), e.g. as the
            next iteration's ``old_logprobs``.
        entropy: each token's entropy [B, T] (no gradient), or None when not computed.
    """

    loss: Tensor
    metrics: Dict[str, Tensor]
    logprobs: Tensor
    entropy: Optional[Tensor]


def fused_linear_policy_loss(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    advantages: Tensor,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    loss_type: PolicyLossType = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    temperature: Union[float, Tensor] = 1.0,
    token_weight: Optional[Tensor] = None,
    max_completion_length: Optional[int] = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logits_precision: LogitsPrecision = "input",
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> PolicyLossOutput:
    """The clipped policy-gradient loss of the tokens ``target`` under ``softmax(softcap(input @ weight.T + bias) /
    temperature)``, in chunks of tokens, with the gradients to ``input``, ``weight`` and ``bias`` computed in the
    same pass (backward only scales them by its grad_output, once).

    Per token (TRL's ``GRPOTrainer`` definitions; ``ratio = exp(log p - old_logprobs)``): the clipped term
    ``-min(ratio A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) A)`` ("cispo":
    ``-min(ratio, epsilon_high).detach() A log p``), plus ``beta (exp(ref - log p) - (ref - log p) - 1)`` with
    ``ref_logprobs``, minus ``entropy_coef * entropy``; times ``token_weight``; normalized over the tokens of
    ``mask`` by ``loss_type``:

    - ``"grpo"``: each sequence's masked mean, then the mean over the B sequences;
    - ``"bnpo"``, ``"dapo"``, ``"cispo"``, ``"ppo"``: the masked sum over the masked token count of the call
      (across micro-batches and ranks, pass a normalizer through ``token_weight``);
    - ``"dr_grpo"``: the masked sum over ``B * max_completion_length`` (default T).

    Args:
        input: [B, T, H] hidden states of the completion tokens' predecessors.
        weight, bias: the head ([V, H], [V]).
        target: [B, T] the sampled tokens.
        advantages: [B] (one per sequence) or [B, T], finite.
        old_logprobs: [B, T] the sampling policy's log-probabilities; None: on-policy (ratio 1, with its gradient).
        ref_logprobs: [B, T] the reference model's (needed for ``beta``'s KL term).
        mask: [B, T] bool or 0/1: the tokens that count (None: all); positions whose target is ``ignore_index``
            never count. Tokens outside it cost no GEMM work.
        temperature: a positive float or [B, T] tensor dividing the (softcapped) logits, as the sampler did.
        token_weight: optional [B, T] per-token factors of the loss (no gradient).
        return_entropy: compute each token's entropy (and ``"entropy_mean"``) without an entropy term.
        softcap, logits_precision, chunk_size, impl: as :func:`fused_linear_logprobs`'s.

    Returns:
        :class:`PolicyLossOutput`.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if input.dim() != 3 or target.dim() != 2:
        raise ValueError(
            f"expected input [B, T, H] and target [B, T], got {tuple(input.shape)} and {tuple(target.shape)}"
        )
    for name, value in (
        ("epsilon_low", epsilon_low),
        ("epsilon_high", epsilon_high),
        ("beta", beta),
        ("entropy_coef", entropy_coef),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite float, got {value!r}")
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low and epsilon_high must be >= 0, got {epsilon_low} and {epsilon_high}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} needs ref_logprobs (the reference model's log-probabilities)")
    batch, length = target.shape
    if max_completion_length is not None and not (
        isinstance(max_completion_length, int) and max_completion_length > 0
    ):
        raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    given = dict(
        advantages=advantages,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        mask=mask,
        token_weight=token_weight,
    )
    for name in POLICY_INPUTS:
        if given[name] is not None or name == "advantages":
            check_per_token(
                name,
                given[name],
                target,
                shape_error="{name} must have shape {shape} (target is {target}), got {got}",
                dtype_error="{name} must be a floating-point tensor, got {got}",
            )

    options = FLCEOptions.of(
        ignore_index=ignore_index,
        reduction="none",
        softcap=softcap,
        logits_precision=logits_precision,
        chunk_size=chunk_size,
        impl=impl,
    )
    options, compute_dtype, backend = checked_call(input, weight, target, bias, options)
    dtype = softmax_dtype(compute_dtype)

    target = class_indices(target)
    counts = target != ignore_index
    if mask is not None:
        counts = counts & (mask != 0)
    target = torch.where(counts, target, ignore_index)  # tokens outside the mask are dropped before the GEMMs
    counted = counts.to(dtype)
    if loss_type == "grpo":
        token_scale = counted / (counted.sum(-1, keepdim=True).clamp(min=1.0) * batch)
    elif loss_type == "dr_grpo":
        token_scale = counted / (batch * (max_completion_length or length))
    else:
        token_scale = counted / counted.sum().clamp(min=1.0)
    if token_weight is not None:
        token_scale = token_scale * token_weight.detach().to(dtype)
    advantages = advantages.detach().to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand(batch, length)

    def per_token(value: Optional[Tensor]) -> Optional[Tensor]:
        return None if value is None else value.detach().to(dtype).reshape(-1)

    with_entropy = return_entropy or entropy_coef != 0.0
    grad_enabled = torch.is_grad_enabled()
    loss, logprobs, entropy, *_ = flce_policy_loss(
        input,
        weight,
        target,
        bias,
        inverse_temperature(temperature, target, dtype),
        per_token(advantages),
        per_token(token_scale),
        per_token(old_logprobs),
        per_token(ref_logprobs) if beta != 0.0 else None,
        loss_type,
        float(epsilon_low),
        float(epsilon_high),
        float(beta),
        float(entropy_coef),
        with_entropy,
        ignore_index,
        options.softcap if options.softcap is not None else 0.0,
        options.logits_precision,
        compute_dtype,
        options.accum_dtype,
        options.chunk_size or 0,
        backend.name,
        grad_enabled and input.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    logprobs = logprobs.view(batch, length)
    entropy = entropy.view(batch, length) if with_entropy else None
    metrics = policy_metrics(
        logprobs,
        entropy,
        advantages,
        None if old_logprobs is None else old_logprobs.detach().to(dtype),
        None if ref_logprobs is None else ref_logprobs.detach().to(dtype),
        counted,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
    )
    return PolicyLossOutput(loss, metrics, logprobs, entropy)


def policy_metrics(
    logprobs: Tensor,
    entropy: Optional[Tensor],
    advantages: Tensor,
    old_logprobs: Optional[Tensor],
    ref_logprobs: Optional[Tensor],
    counted: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
) -> Dict[str, Tensor]:
    """The metrics of :class:`PolicyLossOutput`: masked means over the ``counted`` tokens (0/1, [B, T])."""
    total = counted.sum().clamp(min=1.0)

    def mean(values: Tensor) -> Tensor:
        return (values * counted).sum() / total

    ratio = torch.ones_like(logprobs) if old_logprobs is None else torch.exp(logprobs - old_logprobs)
    ratio = torch.where(counted > 0, ratio, 1.0)
    metrics = {
        "clip_fraction_low": mean(((ratio < 1.0 - epsilon_low) & (advantages < 0)).to(counted.dtype)),
        "clip_fraction_high": mean(((ratio > 1.0 + epsilon_high) & (advantages > 0)).to(counted.dtype)),
        "ratio_mean": mean(ratio),
    }
    if ref_logprobs is not None:
        delta = torch.where(counted > 0, ref_logprobs - logprobs, 0.0)
        metrics["kl_mean"] = mean(torch.exp(delta) - delta - 1.0)
    if entropy is not None:
        metrics["entropy_mean"] = mean(entropy)
    return metrics


def policy_normalizer(
    loss_type: PolicyLossType, counted: Tensor, max_completion_length: Optional[int] = None
) -> tuple[Tensor, str]:
    """What :func:`fused_linear_policy_loss` divides ``loss_type``'s sum by, for a call whose tokens that count
    are ``counted`` ([B, T], 0/1), and its unit, for a normalizer over several calls (micro-batches, ranks):
    the counted tokens (``"bnpo"``, ``"dapo"``, ``"cispo"``, ``"ppo"``), the B sequences (``"grpo"``: the sum of
    the sequences' means), or ``B * max_completion_length`` (``"dr_grpo"``; default T). A 0-d tensor of
    ``counted``'s dtype, not clamped (the function divides by at least 1)."""
    batch, length = counted.shape
    if loss_type == "grpo":
        return counted.new_tensor(float(batch)), "sequences"
    if loss_type == "dr_grpo":
        return counted.new_tensor(float(batch * (max_completion_length or length))), "sequences x length"
    return counted.sum(), "completion tokens"


class FusedLinearPolicyLoss(torch.nn.Module):
    """:func:`fused_linear_policy_loss` as a module: the loss's options (``loss_type``, the clip range, ``beta``,
    ``entropy_coef``, ``temperature``, ``max_completion_length``, ``softcap``, ``logits_precision``, ...) set once;
    ``forward(input, weight, target, bias=None, *, advantages, old_logprobs=None, ref_logprobs=None, mask=None,
    token_weight=None)`` returns its :class:`PolicyLossOutput`. Options are checked when the module is built."""

    #: the arguments of :func:`fused_linear_policy_loss` given per call (``forward``), not to the constructor
    PER_CALL = POLICY_INPUTS

    def __init__(
        self,
        *,
        loss_type: PolicyLossType = "grpo",
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        temperature: Union[float, Tensor] = 1.0,
        max_completion_length: Optional[int] = None,
        return_entropy: bool = False,
        ignore_index: int = -100,
        softcap: Optional[float] = None,
        logits_precision: LogitsPrecision = "input",
        chunk_size: Optional[int] = None,
        impl: ImplName = "auto",
    ) -> None:
        # the function's keyword options less PER_CALL, under the same names and defaults
        # (tests/test_policy_loss.py checks the two signatures agree)
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        self.options: Dict[str, Any] = dict(
            loss_type=loss_type,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            beta=beta,
            entropy_coef=entropy_coef,
            temperature=temperature,
            max_completion_length=max_completion_length,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
            softcap=softcap,
            logits_precision=logits_precision,
            chunk_size=chunk_size,
            impl=impl,
        )

    def forward(
        self,
        input: Tensor,
        weight: Tensor,
        target: Tensor,
        bias: Optional[Tensor] = None,
        *,
        advantages: Tensor,
        old_logprobs: Optional[Tensor] = None,
        ref_logprobs: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        token_weight: Optional[Tensor] = None,
    ) -> PolicyLossOutput:
        return fused_linear_policy_loss(
            input,
            weight,
            target,
            bias,
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            mask=mask,
            token_weight=token_weight,
            **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())
