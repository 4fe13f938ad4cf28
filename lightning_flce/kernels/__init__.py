"""Per-chunk cross-entropy kernels: given one chunk's logits, the loss per row, its LSE, and (in place)
d loss / d logits.

Two implementations share one contract (:func:`cross_entropy_chunk`):

- :mod:`lightning_flce.kernels.cross_entropy` — a Triton kernel (CUDA, or the CPU interpreter in tests);
- :mod:`lightning_flce.kernels.cross_entropy_torch` — plain PyTorch, for the CPU and devices without Triton.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class LossOptions(NamedTuple):
    """The loss definition shared by every chunk of one call.

    ``class_weight`` is fp32 [V] or None; ``class_weight_sum`` its sum as a [1] fp32 device tensor (the
    label-smoothing term needs it; kept on device to avoid a host sync). ``softcap`` 0.0 means off.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float = 0.0
    class_weight: Optional[torch.Tensor] = None
    class_weight_sum: Optional[torch.Tensor] = None


class ChunkOutputs(NamedTuple):
    """Per-row outputs of one chunk (fp32 [C] each; ``correct`` bool). Stats are None unless asked."""

    loss: torch.Tensor
    lse: torch.Tensor
    correct: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


def cross_entropy_chunk(
    logits: torch.Tensor,
    target: torch.Tensor,
    options: LossOptions,
    *,
    ce_scale: torch.Tensor,
    z_scale: torch.Tensor,
    compute_grad: bool,
    compute_stats: bool,
    use_triton: bool,
) -> ChunkOutputs:
    """Loss rows of one chunk; with ``compute_grad`` overwrites ``logits`` with d loss / d logits.

    Row ``i``'s loss is ``ce_scale[i] * ce_i + z_scale[i] * lse_square_scale * lse_i**2`` (0 for ignored
    rows); ``ce_scale``/``z_scale`` are fp32 of shape [1] (shared) or [C] (per row), so the same kernel
    serves "mean" (1 / normalizer), "sum" (1) and the per-token grad_output of "none".
    """
    if use_triton:
        from lightning_flce.kernels.cross_entropy import cross_entropy_chunk_triton as impl
    else:
        from lightning_flce.kernels.cross_entropy_torch import cross_entropy_chunk_torch as impl
    return impl(
        logits,
        target,
        options,
        ce_scale=ce_scale,
        z_scale=z_scale,
        compute_grad=compute_grad,
        compute_stats=compute_stats,
    )
