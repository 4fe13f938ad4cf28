"""Argument checks shared by the front ends of the op (the single-device and the vocab-parallel op): shapes,
dtypes, devices and the dtype the GEMMs run in, checked before any kernel runs."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_flce.kernels import LOW_PRECISION
from lightning_flce.options import FLCEOptions

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(
    input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], options: FLCEOptions
) -> torch.dtype:
    """Validate shapes, dtypes and devices (and the options' tensors); return the dtype the GEMMs run in.

    A weight with no rows is left to the caller (the vocab-parallel op reports a zero-row shard with every
    rank's shard sizes)."""
    if weight.numel() == 0 and weight.dim() != 2:
        raise ValueError(
            f"the head weight is empty (shape {tuple(weight.shape)}): a parameter partitioned by DeepSpeed ZeRO-3 "
            "(or another sharding scheme) must be gathered first - call the loss inside the head module's forward "
            "(FLCEMixin does) or within deepspeed.zero.GatheredParameters(head.weight)"
        )
    if input.dim() < 1 or weight.dim() != 2:
        raise ValueError(
            f"expected input [..., H] and weight [V, H], got {tuple(input.shape)} and {tuple(weight.shape)}"
        )
    hidden = input.shape[-1]
    for name, tensor in (("input", input), ("weight", weight), ("target", target)):
        if tensor.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    if weight.shape[1] != hidden:
        raise ValueError(
            f"hidden size mismatch: input has H={hidden}, weight is {tuple(weight.shape)} (expected [V, {hidden}])"
        )
    if target.shape != input.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match input's leading shape {tuple(input.shape[:-1])}"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    vocab = weight.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must be [V]=[{vocab}], got {tuple(bias.shape)}")
    for name, tensor in (("weight", weight), ("target", target), ("bias", bias)):
        if tensor is not None and tensor.device != input.device:
            raise ValueError(f"{name} is on {tensor.device} but input is on {input.device}")
    options.check_tensors(vocab, target, input.device)
    for name, tensor in (("input", input), ("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} dtype {tensor.dtype} is not supported (fp16, bf16, fp32, fp64)")

    autocast_dtype = _autocast_dtype(input.device.type)
    # Autocast leaves fp64 tensors alone (as F.linear does under it): fp64 in, fp64 GEMMs.
    if autocast_dtype is not None and torch.float64 not in (input.dtype, weight.dtype):
        # Like nn.Linear under autocast: GEMM operands in the autocast dtype, grads in the param dtypes.
        compute_dtype = autocast_dtype
    else:
        for name, tensor in (("weight", weight), ("bias", bias)):
            if tensor is not None and tensor.dtype != input.dtype:
                raise TypeError(
                    f"{name} dtype {tensor.dtype} differs from input dtype {input.dtype} outside autocast "
                    "(cast one of them, or run under torch.autocast as mixed precision does)"
                )
        compute_dtype = input.dtype
    check_accum_dtype(options.accum_dtype, weight, compute_dtype)
    return compute_dtype


def class_indices(target: Tensor) -> Tensor:
    """The target as int64. Narrower integer targets are widened first: compared in their own dtype,
    ignore_index (-100) would wrap around in uint8 (to 156, a class) and range checks would wrap too."""
    return target if target.dtype == torch.int64 else target.long()


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. "meta")
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def check_accum_dtype(accum_dtype: Optional[torch.dtype], weight: Tensor, compute_dtype: torch.dtype) -> None:
    """``accum_dtype`` is None, fp32, fp64 (for fp32/fp64 GEMMs) or the weight's own dtype."""
    if accum_dtype is None:
        return
    if accum_dtype == torch.float64 and compute_dtype in LOW_PRECISION:
        # No GEMM widens fp16/bf16 operands to fp64: each chunk's product would be rounded to 16 bits first,
        # a less accurate dW than an fp32 accumulator's (and fp64 dX GEMMs).
        raise ValueError(
            f"accum_dtype=torch.float64 needs fp32 or fp64 GEMMs, but they run in {compute_dtype} (autocast or"
            " half-precision inputs); use accum_dtype=torch.float32, the most accurate accumulator for them"
        )
    if accum_dtype not in (torch.float32, torch.float64, weight.dtype):
        raise ValueError(
            f"accum_dtype must be None, torch.float32, torch.float64 or the weight's dtype {weight.dtype},"
            f" got {accum_dtype}"
        )
