"""The cross-entropy as a chunk loss, with its options record (:func:`kernel_options`) and per-token scales
(:func:`loss_scales`): the single-device op's (a backend's chunk kernel on the whole vocabulary)
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
from lightning_flce.kernels import ChunkOutputs, LossOptions, softmax_dtype

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


def loss_scales(
    target: Tensor,
    reduction: str,
    ignore_index: int,
    class_weight: Optional[Tensor],
    token_weight: Optional[Tensor],
    dtype: torch.dtype,
) -> Tuple[Tensor, Tensor]:
    """The multipliers of each token's CE and z-loss terms in ``dtype`` (the softmax dtype), computed on the
    device (no host sync): [1] shared, or [N] with per-token weights (the shared ones times ``token_weight``:
    every summand of a token's loss is multiplied by its weight, the normalizer stays the unweighted one).

    "mean" divides CE by the summed class weight of the valid targets (the count without weights), as
    ``F.cross_entropy`` does, and the z-loss by the count; an all-ignored batch (or a zero total weight) gets
    0, not NaN.
    """
    if reduction != "mean":
        ce_scale = z_scale = torch.ones(1, dtype=dtype, device=target.device)
    else:
        ce_scale, z_scale = _mean_scales(target, ignore_index, class_weight, dtype)
    if token_weight is None:
        return ce_scale, z_scale
    weight = token_weight.reshape(-1).to(dtype)
    return ce_scale * weight, z_scale * weight


def _mean_scales(
    target: Tensor, ignore_index: int, class_weight: Optional[Tensor], dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    target = target.reshape(-1)
    valid = target != ignore_index
    count = valid.sum(dtype=dtype).reshape(1)
    if class_weight is not None:
        safe = torch.where(valid, target, 0)
        ce_norm = (class_weight.to(dtype)[safe] * valid).sum().reshape(1)
    else:
        ce_norm = count
    # A zero total weight gives 0 (F.cross_entropy gives NaN); a negative one is a valid, if odd, normalizer.
    ce_scale = torch.where(ce_norm != 0, 1.0 / ce_norm, 0.0).to(dtype)
    z_scale = torch.where(count > 0, 1.0 / count, 0.0).to(dtype)
    return ce_scale, z_scale


def kernel_options(
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    class_weight: Optional[Tensor],
    compute_dtype: torch.dtype,
) -> LossOptions:
    class_weight_sum = None
    if class_weight is not None:
        class_weight = class_weight.to(softmax_dtype(compute_dtype)).contiguous()
        class_weight_sum = class_weight.sum().reshape(1)
    return LossOptions(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        class_weight=class_weight,
        class_weight_sum=class_weight_sum,
    )
