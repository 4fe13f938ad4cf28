"""The clipped policy-gradient family as a chunk loss whose gradients are computed in forward.

Each token's loss is a function of that token's log-probability (and entropy) only, so once the chunk's row
statistics are known (:class:`~lightning_flce.losses.logprobs.LogProbsChunkLoss`'s first kernel), its
value and derivatives ``g = dL/d log p`` and ``h = dL/dH`` per row come from :func:`per_token_policy_loss` and
:func:`per_token_policy_grads`, small PyTorch functions of [C] vectors (never of [C, V] logits; the tests check the
second against autograd through the first), and the gradient kernel writes the logit gradient in the same pass:
no recompute in backward.

The per-token terms follow TRL's ``GRPOTrainer``: with ``ratio = exp(log p - old)`` (``old = log p.detach()``
on-policy: 1, with its gradient)

    clipped   -min(ratio A, clamp(ratio, 1 - eps_low, 1 + eps_high) A)      ("cispo": -min(ratio, eps_high).detach() A log p)
    k3 KL     beta (exp(ref - log p) - (ref - log p) - 1)                    (with reference log-probs)
    entropy   -entropy_coef H

each token's sum times its ``token_scale`` (the mask over the loss type's normalizer, and any per-token weight).
"""

from __future__ import annotations

import math
import types
from typing import Dict, Literal, Optional, Tuple, get_args

import torch
from torch import Tensor

from lightning_flce.chunk_loss import OutputSpec
from lightning_flce.losses.logprobs import LogProbsChunkLoss

#: The policy losses' ``loss_type`` (normalizers as TRL's ``GRPOTrainer``, plus "ppo"); the tuple is read from it.
PolicyLossType = Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "ppo"]
LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)


def per_token_policy_loss(
    logprobs: Tensor,
    entropy: Optional[Tensor],
    advantages: Tensor,
    old_logprobs: Optional[Tensor],
    ref_logprobs: Optional[Tensor],
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    entropy_coef: float,
) -> Tensor:
    """Each token's policy loss (unnormalized), differentiable in ``logprobs`` and ``entropy``."""
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logprobs
    else:
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
    if ref_logprobs is not None and beta != 0.0:
        delta = ref_logprobs - logprobs
        loss = loss + beta * (torch.exp(delta) - delta - 1.0)
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * entropy
    return loss


class PolicyChunkLoss(LogProbsChunkLoss):
    """Outputs (logprobs, entropy, loss): the rows' log-probabilities, entropies (with ``with_entropy``) and
    ``token_scale`` times :func:`per_token_policy_loss`; its gradient computed in the same pass.

    Side inputs ([N] or [1]): ``inv_temperature``, ``advantages``, ``token_scale`` (the gradient is linear in it),
    and ``old_logprobs`` / ``ref_logprobs`` where given.
    """

    linear_inputs = ("token_scale",)

    def __init__(
        self,
        kernels: types.ModuleType,
        *,
        inv_temperature: Tensor,
        softcap: float,
        with_entropy: bool,
        vocab: int,
        advantages: Tensor,
        token_scale: Tensor,
        old_logprobs: Optional[Tensor],
        ref_logprobs: Optional[Tensor],
        loss_type: str,
        epsilon_low: float,
        epsilon_high: float,
        beta: float,
        entropy_coef: float,
    ) -> None:
        super().__init__(
            kernels, inv_temperature=inv_temperature, softcap=softcap, with_entropy=with_entropy, vocab=vocab
        )
        self.inputs.update(advantages=advantages, token_scale=token_scale)
        for name, value in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
            if value is not None:
                self.inputs[name] = value
        self.terms = dict(
            loss_type=loss_type,
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            beta=beta,
            entropy_coef=entropy_coef,
        )

    def outputs(self) -> Tuple[OutputSpec, ...]:
        return (*super().outputs(), OutputSpec("loss", gradient_scaled=True))

    def fp16_logit_grad_bound(self) -> Tensor:
        """``|token_scale| (|A| (1 + eps) + 2 |beta| + |c| (1/e + log V)) / T`` per token: exact for the entropy
        term, and for the ratio and KL terms while the ratio and ``exp(ref - log p)`` stay below 2 and
        ``1 + eps`` (beyond, the fp16 factor's 64x headroom absorbs them up to that factor)."""
        terms = self.terms
        inputs = self.inputs
        ratio_bound = max(
            1.0 + terms["epsilon_high"], 1.0 if terms["loss_type"] != "cispo" else terms["epsilon_high"]
        )
        bound = inputs["advantages"].abs() * ratio_bound + 2.0 * abs(terms["beta"])
        bound = bound + abs(terms["entropy_coef"]) * (1.0 / math.e + math.log(max(self.vocab, 2)))
        bound = bound * inputs["token_scale"].abs() * inputs["inv_temperature"]
        return torch.where(torch.isfinite(bound), bound, 0.0)  # rows that carry no loss: any temperature

    def row_terms(
        self, logprobs: Tensor, entropy: Optional[Tensor], side: Dict[str, Tensor], compute_grad: bool
    ) -> Tuple[Optional[Tensor], Optional[Tensor], Tuple[Tensor, ...]]:
        scale = side["token_scale"]
        args = (logprobs, entropy, side["advantages"], side.get("old_logprobs"), side.get("ref_logprobs"))
        loss = scale * per_token_policy_loss(*args, **self.terms)
        if not compute_grad:
            return None, None, (loss,)
        grad_logprobs, grad_entropy = per_token_policy_grads(*args, **self.terms)
        return grad_logprobs * scale, None if grad_entropy is None else grad_entropy * scale, (loss,)


def per_token_policy_grads(
    logprobs: Tensor,
    entropy: Optional[Tensor],
    advantages: Tensor,
    old_logprobs: Optional[Tensor],
    ref_logprobs: Optional[Tensor],
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    entropy_coef: float,
) -> Tuple[Tensor, Optional[Tensor]]:
    """``(d/d log p, d/dH)`` of :func:`per_token_policy_loss` per token (``d/dH`` None without an entropy term),
    written out: the chunk's rows are computed inside a custom op, below autograd. (``torch.min``'s ties, inside the
    clip range, have equal derivatives on both sides.)"""
    ratio = torch.ones_like(logprobs) if old_logprobs is None else torch.exp(logprobs - old_logprobs)
    if loss_type == "cispo":
        grad = -torch.clamp(ratio, max=epsilon_high) * advantages
    else:
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        # the unclipped term is the minimum (d ratio / d log p = ratio), or the clamp is, whose slope is 0 outside
        grad = torch.where(ratio * advantages <= clipped * advantages, -ratio * advantages, 0.0)
    if ref_logprobs is not None and beta != 0.0:
        grad = grad + beta * (1.0 - torch.exp(ref_logprobs - logprobs))
    grad_entropy = None
    if entropy_coef != 0.0:
        grad_entropy = torch.full_like(logprobs, -entropy_coef)
    return grad, grad_entropy
