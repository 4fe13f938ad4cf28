"""Backward's rescaling of the gradients forward computed, by ``grad_output`` read on the device.

``scale_``: in-place ``tensor *= scale`` that does nothing when ``scale`` is 1. The backward of
"mean"/"sum" only rescales gradients computed in forward by ``grad_output``, which is 1 in the usual
``loss.backward()``. Reading it on the host (``.item()``, ``torch.equal``) would stall the CPU until the
GPU catches up; this kernel reads it on the device and every program exits at once when it is 1.

``scale_into``: ``out = src * scale`` into another dtype, one read and one write, rounded once (dW's
wide accumulator to the weight's dtype, dX kept in the GEMM's dtype to x's).
"""

from __future__ import annotations

import torch

from lightning_flce._compat import HAS_TRITON, triton_usable

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_kernel(
        x_ptr,  # contiguous tensor scaled in place
        scale_ptr,  # [1] scale, any float dtype
        n_elements,
        BLOCK: tl.constexpr,
    ):
        scale = tl.load(scale_ptr)
        if scale != 1.0:
            offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n_elements
            x = tl.load(x_ptr + offsets, mask=mask)
            # fp64 tensors (fp64 GEMMs) multiply in fp64, the others in fp32
            if x_ptr.dtype.element_ty == tl.float64:
                scaled = x * scale.to(tl.float64)
            else:
                scaled = (x.to(tl.float32) * scale.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + offsets, scaled, mask=mask)

    @triton.jit
    def _scale_into_kernel(
        out_ptr,  # contiguous output, e.g. bf16/fp16
        src_ptr,  # contiguous source of the same shape, e.g. fp32/fp64
        scale_ptr,  # [1] scale, any float dtype
        n_elements,
        BLOCK: tl.constexpr,
    ):
        scale = tl.load(scale_ptr).to(tl.float32)
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n_elements
        x = tl.load(src_ptr + offsets, mask=mask)
        # fp64 sources: round the product to fp32 first (Triton's interpreter turns fp64 -> bf16 into 0).
        tl.store(out_ptr + offsets, (x * scale).to(tl.float32).to(out_ptr.dtype.element_ty), mask=mask)


_BLOCK = 4096
# Elements per torch.mul on the CPU: with an output dtype other than the product's, it writes through a
# temporary of the product's dtype, so slices bound that temporary (16 Mi elements, 64 MiB in fp32).
_CPU_SLICE = 1 << 24


def scale_(tensor: torch.Tensor, scale: torch.Tensor) -> None:
    """``tensor *= scale`` in place; free when ``scale == 1`` (no host sync on CUDA)."""
    if tensor.numel() == 0:
        return
    if triton_usable(tensor.device) and tensor.is_contiguous():
        grid = (triton.cdiv(tensor.numel(), _BLOCK),)
        _scale_kernel[grid](tensor, scale.reshape(1), tensor.numel(), BLOCK=_BLOCK)
    elif tensor.device.type == "cpu":
        # No asynchronous device to stall: decide on the host (a Python scalar multiplies in fp32).
        value = scale.item()
        if value != 1.0:
            tensor.mul_(value)
    else:
        tensor.mul_(scale)


def scale_into(out: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out = src * scale`` (``scale``: [1] on ``src``'s device) in one pass without a full-size temporary."""
    if out.shape != src.shape:
        raise ValueError(f"scale_into: shapes differ, {tuple(out.shape)} and {tuple(src.shape)}")
    if not out.is_contiguous():
        raise ValueError("scale_into: out must be contiguous")
    src = src.contiguous()  # a no-op for the accumulator the op passes
    if out.numel() == 0:
        return out
    scale = scale.reshape(1)
    if triton_usable(src.device):
        grid = (triton.cdiv(src.numel(), _BLOCK),)
        _scale_into_kernel[grid](out, src, scale, src.numel(), BLOCK=_BLOCK)
    else:
        flat_out, flat_src = out.view(-1), src.reshape(-1)
        for start in range(0, flat_src.numel(), _CPU_SLICE):
            part = slice(start, start + _CPU_SLICE)
            torch.mul(flat_src[part], scale, out=flat_out[part])
    return out
