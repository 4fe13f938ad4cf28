"""What the ``*_with_stats`` functions return, and the per-token outputs shaped like the target."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class FLCEOutput(NamedTuple):
    """Result of :func:`~lightning_flce.fused_linear_cross_entropy_with_stats`.

    Attributes:
        loss: as :func:`~lightning_flce.fused_linear_cross_entropy` returns it (differentiable).
        lse: log-sum-exp of each token's (softcapped) logits, in the target's shape and the loss's dtype; 0 for
            ignored tokens.
        correct: bool ``argmax(logits) == target`` per token (first maximum on ties); False for ignored tokens.
        entropy: entropy of each token's softmax, in the loss's dtype; 0 for ignored tokens.

    The statistics carry no gradient.
    """

    loss: Tensor
    lse: Tensor
    correct: Tensor
    entropy: Tensor


def shaped_like_target(
    output: FLCEOutput, shape: torch.Size, reduction: str, compute_stats: bool
) -> FLCEOutput:
    """The per-token outputs ([N] from the op) in the target's shape, as ``F.cross_entropy``'s "none" is."""
    loss, lse, correct, entropy = output
    if reduction == "none":
        loss = loss.view(shape)
    if compute_stats:
        lse, correct, entropy = lse.view(shape), correct.view(shape), entropy.view(shape)
    return FLCEOutput(loss, lse, correct, entropy)
