"""In-place ``tensor *= scale`` that does nothing when ``scale`` is 1, decided on the device.

The backward of "mean"/"sum" only rescales gradients computed in forward by ``grad_output``, which is
1 in the usual ``loss.backward()``. Reading it on the host (``.item()``, ``torch.equal``) would stall
the CPU until the GPU catches up; this kernel reads it on the device and every program exits at once
when it is 1.
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
        scale = tl.load(scale_ptr).to(tl.float32)
        if scale != 1.0:
            offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n_elements
            x = tl.load(x_ptr + offsets, mask=mask)
            tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=mask)


_BLOCK = 4096


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
