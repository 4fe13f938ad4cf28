"""TEMPORARY naive stand-in; replaced by the chunked op (same signature)."""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class FLCEOutput(NamedTuple):
    loss: torch.Tensor
    lse: torch.Tensor
    correct: torch.Tensor
    entropy: torch.Tensor


def fused_linear_cross_entropy(
    input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
    class_weight=None, lse_square_scale=0.0, softcap=None, accum_dtype=None, chunk_size=None, impl="auto",
):
    logits = F.linear(input, weight, bias).float().flatten(0, -2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    target = target.flatten()
    return F.cross_entropy(logits, target, weight=class_weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


def fused_linear_cross_entropy_with_stats(input, weight, target, bias=None, **kw):
    raise NotImplementedError
