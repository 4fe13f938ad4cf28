"""The cross-entropy as a chunk loss: the single-device op's (a backend's chunk kernel on the whole vocabulary)
and the vocab-parallel op's (its shard kernels around all-reduces) both run through :class:`CrossEntropyChunkLoss`.

Each row's loss is ``ce_scale * ce + z_scale * z-loss`` (:mod:`lightning_flce.kernels.cross_entropy` has the
terms); ``ce_scale``/``z_scale`` are [1] (shared: "mean", "sum") or [N] (per-token weights, "none"'s backward
grad_output), the side inputs the gradient is linear in.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.chunk_loss import ChunkLoss, OutputSpec
from lightning_flce.kernels import ChunkOutputs, LossOptions

# The z-loss gradient 2 lam lse p is bounded assuming |lse| <= this (the fp16 factor's headroom covers far more).
_Z_LOSS_LSE_BOUND = 64.0

#: ``kernel(logits, target, options, *, ce_scale, z_scale, compute_grad, compute_stats, grad_out, [tile_lse])``
#: -> :class:`~lightning_flce.kernels.ChunkOutputs`: a backend's ``cross_entropy_chunk`` or the shard version.
ChunkKernel = Callable[..., ChunkOutputs]


class CrossEntropyChunkLoss(ChunkLoss):
    """Per token ``ce_scale * ce + z_scale * lam * lse^2`` with outputs (loss, lse, correct, entropy), the last
    two with ``compute_stats`` only. ``takes_tile_lse``: ``kernel`` accepts ``tile_lse=`` (the Triton one)."""

    linear_inputs = ("ce_scale", "z_scale")

    def __init__(
        self,
        kernel: ChunkKernel,
        options: LossOptions,
        *,
        ce_scale: Tensor,
        z_scale: Tensor,
        compute_stats: bool,
        takes_tile_lse: bool = False,
    ) -> None:
        self.kernel = kernel
        self.options = options
        self.ce_scale = ce_scale
        self.z_scale = z_scale
        self.compute_stats = compute_stats
        self.takes_tile_lse = takes_tile_lse

    def outputs(self) -> Tuple[OutputSpec, ...]:
        stats = self.compute_stats
        return (
            OutputSpec("loss", gradient_scaled=True),
            OutputSpec("lse"),
            OutputSpec("correct", torch.bool, active=stats),
            OutputSpec("entropy", active=stats),
        )

    def side_inputs(self) -> Dict[str, Tensor]:
        return {"ce_scale": self.ce_scale, "z_scale": self.z_scale}

    def set_side_inputs(self, values: Dict[str, Tensor]) -> None:
        self.ce_scale = values.get("ce_scale", self.ce_scale)
        self.z_scale = values.get("z_scale", self.z_scale)

    def fp16_logit_grad_bound(self) -> Tensor:
        """Per token ``|ce_scale| w_max + |z_scale| 2 lam L`` (a row: softmax minus one-hot, times those)."""
        options = self.options
        w_max = options.class_weight.abs().max() if options.class_weight is not None else 1.0
        z_bound = 2.0 * options.lse_square_scale * _Z_LOSS_LSE_BOUND
        return (self.ce_scale.abs() * w_max + self.z_scale.abs() * z_bound).float()

    def tile_stats_suffice(self) -> bool:
        return self.takes_tile_lse and self.options.label_smoothing == 0.0 and not self.compute_stats

    @property
    def softcap(self) -> float:
        return self.options.softcap

    def __call__(
        self,
        logits: Tensor,
        target: Tensor,
        rows,
        side: Dict[str, Tensor],
        *,
        compute_grad: bool,
        grad_out: Optional[Tensor],
        tile_lse=None,
    ) -> ChunkOutputs:
        return self.kernel(
            logits,
            target,
            self.options,
            ce_scale=side["ce_scale"],
            z_scale=side["z_scale"],
            compute_grad=compute_grad,
            compute_stats=self.compute_stats,
            grad_out=grad_out,
            **({} if tile_lse is None else {"tile_lse": tile_lse}),
        )
