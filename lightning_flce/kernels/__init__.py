"""Per-chunk cross-entropy kernels: given one chunk's logits, the loss per row, its LSE, and (in place)
d loss / d logits.

Two implementations share one contract (:func:`cross_entropy_chunk`):

- :mod:`lightning_flce.kernels.cross_entropy` — a Triton kernel (CUDA, or the CPU interpreter in tests);
- :mod:`lightning_flce.kernels.cross_entropy_torch` — plain PyTorch, for the CPU and devices without Triton.

The vocab-parallel op (:mod:`lightning_flce.parallel`) splits the same math around its all-reduces
(:func:`shard_row_stats`, then :func:`shard_softmax_grad`), again as a Triton kernel pair
(:mod:`~lightning_flce.kernels.cross_entropy_shard`) and its PyTorch twin
(:mod:`~lightning_flce.kernels.cross_entropy_shard_torch`).

The softmax runs in :func:`softmax_dtype` of the logits: fp32, or fp64 for fp64 logits. The Triton kernels
compute in fp32 only, so fp64 logits go to the PyTorch twins (:func:`chunk_kernels_use_triton`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


def softmax_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax, the loss and the statistics of ``logits_dtype`` logits run in: fp32 for
    fp16/bf16/fp32, fp64 for fp64 (as ``F.cross_entropy`` of upcast logits)."""
    return torch.promote_types(logits_dtype, torch.float32)


def chunk_kernels_use_triton(impl: str, compute_dtype: torch.dtype) -> bool:
    """Whether the per-chunk softmax runs the Triton kernels (else their PyTorch twins) for a resolved
    ``impl`` and GEMMs in ``compute_dtype``: the kernels compute in fp32, so fp64 GEMMs (an accuracy
    dtype, not a speed one) run the twins in fp64, on CUDA too."""
    return impl == "triton" and softmax_dtype(compute_dtype) == torch.float32


class LossOptions(NamedTuple):
    """The loss definition shared by every chunk of one call.

    ``class_weight`` is [V] in the softmax dtype, or None; ``class_weight_sum`` its sum as a [1] device
    tensor (the label-smoothing term needs it; kept on device to avoid a host sync). ``softcap`` 0.0 means
    off.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float = 0.0
    class_weight: Optional[torch.Tensor] = None
    class_weight_sum: Optional[torch.Tensor] = None


class ChunkOutputs(NamedTuple):
    """Per-row outputs of one chunk ([C] each in the softmax dtype; ``correct`` bool). Stats are None unless
    asked."""

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
    rows); ``ce_scale``/``z_scale`` are in the softmax dtype, of shape [1] (shared) or [C] (per row), so
    the same kernel serves "mean" (1 / normalizer), "sum" (1) and the per-token grad_output of "none".
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


class ShardRowStats(NamedTuple):
    """Per-row statistics of one shard's columns of a chunk, relative to the shard's own row maximum
    ([C] each in the softmax dtype; ``argmax`` int64). The optional ones are None unless asked for."""

    max: torch.Tensor  # max_j z_j over the local columns (after the softcap)
    sum_exp: torch.Tensor  # sum_j exp(z_j - max)
    z_target: torch.Tensor  # z at the target column if this shard holds it, else 0
    z_sum: Optional[torch.Tensor] = None  # sum_j z_j (label smoothing)
    exp_z_sum: Optional[torch.Tensor] = None  # sum_j exp(z_j - max) z_j (entropy)
    argmax: Optional[torch.Tensor] = None  # local index of the first maximum (accuracy)

    @classmethod
    def empty(
        cls,
        n_rows: int,
        device: torch.device,
        *,
        with_z_sum: bool,
        with_stats: bool,
        dtype: torch.dtype = torch.float32,
    ) -> ShardRowStats:
        """Uninitialized outputs for ``n_rows`` rows in ``dtype`` (the optional ones only when asked for)."""

        def rows(row_dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(n_rows, dtype=row_dtype, device=device)

        return cls(
            rows(),
            rows(),
            rows(),
            rows() if with_z_sum else None,
            rows() if with_stats else None,
            rows(torch.int64) if with_stats else None,
        )


def shard_row_stats(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    *,
    softcap: float,
    with_z_sum: bool,
    with_stats: bool,
    use_triton: bool,
) -> ShardRowStats:
    """One read of a shard's [C, V_r] chunk logits: :class:`ShardRowStats` (``local_target`` = target -
    the shard's first global column; the shard holds the target iff it is in ``[0, V_r)``)."""
    if use_triton:
        from lightning_flce.kernels.cross_entropy_shard import shard_row_stats_triton as impl
    else:
        from lightning_flce.kernels.cross_entropy_shard_torch import shard_row_stats_torch as impl
    return impl(logits, local_target, softcap=softcap, with_z_sum=with_z_sum, with_stats=with_stats)


def shard_softmax_grad(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    lse: torch.Tensor,
    p_coef: torch.Tensor,
    smoothing: Optional[torch.Tensor],
    target_coef: torch.Tensor,
    *,
    softcap: float,
    use_triton: bool,
) -> None:
    """Overwrite a shard's chunk logits with ``p_coef_i exp(z_ij - lse_i) - smoothing_i - target_coef_i
    [j == local_target_i]`` (the last term only where the shard holds the target), times ``1 - (z_ij / c)^2``
    with a softcap ``c``; ``lse`` is the global log-sum-exp and every coefficient a [C] tensor in the softmax
    dtype."""
    if use_triton:
        from lightning_flce.kernels.cross_entropy_shard import shard_softmax_grad_triton as impl
    else:
        from lightning_flce.kernels.cross_entropy_shard_torch import shard_softmax_grad_torch as impl
    impl(logits, local_target, lse, p_coef, smoothing, target_coef, softcap=softcap)
