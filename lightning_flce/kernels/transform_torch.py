"""The logit transform of every PyTorch path and its derivative, written once: ``z = softcap(r) / T`` with
``softcap(r) = c tanh(r / c)`` (Gemma 2's soft-capping) and a temperature ``T`` (a scalar or one per row, as
samplers apply it), and ``dz/dr = (1 - (softcap(r) / c)^2) / T``.

The kernels' PyTorch twins (cross-entropy, vocab-parallel shard, log-probabilities), the head's reference path and a
discovered head's logits path use it; the Triton kernels' twin pair is in :mod:`~lightning_flce.kernels.triton_math`
(``transform_logits`` / ``load_transformed``, ``transform_backward``). A softcap of None or 0.0 and an inverse
temperature of None are off: no operation at all, so a loss without them computes exactly what it did before.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def transformed_logits(
    logits: Tensor, softcap: Optional[float], inv_temperature: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """``(z, capped)`` of [..., V] ``logits``, in their dtype: ``capped = c tanh(r / c)`` (the logits themselves
    without a softcap) and ``z = capped / T`` (``capped`` itself without ``inv_temperature``, ``1 / T`` as a [1]
    or per-row [C] tensor). ``logits`` is never written; the softcap's multiply is in place on its new tensor
    unless autograd records it (``tanh``'s backward reads its output), so the autograd paths may use it too."""
    capped = logits
    if softcap:
        capped = torch.tanh(logits / softcap)
        capped = capped * softcap if capped.requires_grad else capped.mul_(softcap)
    z = capped
    if inv_temperature is not None:
        z = capped * inv_temperature.to(capped.dtype).reshape(-1, 1)
    return z, capped


def transform_slope(capped: Tensor, softcap: Optional[float]) -> Optional[Tensor]:
    """The softcap's derivative ``1 - (softcap(r) / c)^2`` from the :func:`transformed_logits` ``capped`` values,
    as a new tensor (None without a softcap). Taken before :func:`transform_backward` by a caller that overwrites
    ``capped`` with the gradient (the cross-entropy twin computes it in place of the logits)."""
    if not softcap:
        return None
    return (capped / softcap).square_().neg_().add_(1.0)


def transform_backward(
    grad_z: Tensor, slope: Optional[Tensor], inv_temperature: Optional[Tensor] = None
) -> Tensor:
    """``d/dr`` from ``d/dz`` of :func:`transformed_logits`, in place over ``grad_z``: times ``1 / T``, then times
    the softcap's :func:`transform_slope` (the Triton twin's order of roundings)."""
    if inv_temperature is not None:
        grad_z.mul_(inv_temperature.to(grad_z.dtype).reshape(-1, 1))
    if slope is not None:
        grad_z.mul_(slope)
    return grad_z
