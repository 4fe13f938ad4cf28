"""Reinforcement learning on the fused head, without the [N, V] logits:

- :func:`fused_linear_logprobs` (``logprobs.py``; its custom ops in ``logprobs_op.py``): each token's
  differentiable ``log p(target)`` and entropy, for any upstream gradient (backward recomputes the chunks);
- :func:`fused_linear_policy_loss` and :class:`FusedLinearPolicyLoss` (``policy.py``; ``policy_op.py``): the
  clipped policy-gradient family with its gradients computed in forward.

Their chunk losses are in :mod:`lightning_flce.losses` (``logprobs.py``, ``policy.py``), their kernels in
:mod:`lightning_flce.kernels` (``logprobs.py``, ``logprobs_torch.py``). See ``docs/rl.md``.
"""

from lightning_flce.rl.logprobs import LogProbsOutput, fused_linear_logprobs
from lightning_flce.rl.policy import (
    FusedLinearPolicyLoss,
    PolicyLossOutput,
    fused_linear_policy_loss,
    policy_normalizer,
)

__all__ = [
    "FusedLinearPolicyLoss",
    "LogProbsOutput",
    "PolicyLossOutput",
    "fused_linear_logprobs",
    "fused_linear_policy_loss",
    "policy_normalizer",
]
