"""How one chunk's contribution reaches ``grad_weight``: ``grad_weight (+)= grad_logits.T @ input``.

The whole point is to never allocate a [V, H] temporary per chunk. The old idiom
``gw += torch.mm(g.t(), x).float()`` allocates two (the product, then its fp32 copy): 750 MiB each at
V=32000, H=4096. The paths, chosen by :func:`choose_path`:

================  ====================================================================  ==================
path              when                                                                  call
================  ====================================================================  ==================
``addmm_out``     CUDA, torch >= 2.8, operands fp16/bf16/fp32 of one dtype, grad_weight  ``torch.addmm(gw, g.t(), x,
                  of that dtype or fp32 (fp16/bf16 operands into fp32); bf16 needs       out_dtype=gw.dtype, out=gw)``
                  compute capability >= 8.0
``addmm_inplace`` any device or torch version, operands and grad_weight of one dtype      ``gw.addmm_(g.t(), x)``
``add_mm``        anything else (older torch, ROCm, older GPUs, CPU with mixed dtypes)    ``gw.add_(torch.mm(g.t(), x))``
================  ====================================================================  ==================

``addmm_out`` and ``addmm_inplace`` write the GEMM result straight into ``grad_weight`` (cuBLAS/BLAS
``beta=1``). ``add_mm`` allocates one [V, H] product in the operand dtype — still half of the old
idiom, and never an fp32 copy. With ``first=True`` the chunk overwrites instead (``beta=0``), so
``grad_weight`` can start as ``torch.empty`` without a zero-fill.
"""

from __future__ import annotations

import enum
from typing import Optional, Tuple

import torch

from lightning_flce._compat import TORCH_VERSION

# torch.addmm(..., out_dtype=...) (aten::addmm.dtype_out) exists from torch 2.8, CUDA only.
_ADDMM_OUT_DTYPE_MIN_TORCH = (2, 8)
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class AccumulationPath(str, enum.Enum):
    ADDMM_OUT = "addmm_out"
    ADDMM_INPLACE = "addmm_inplace"
    ADD_MM = "add_mm"


def choose_path(
    grad_weight: torch.Tensor,
    grad_logits: torch.Tensor,
    input: torch.Tensor,
    *,
    torch_version: Optional[Tuple[int, int]] = None,
    capability: Optional[Tuple[int, int]] = None,
    is_rocm: Optional[bool] = None,
) -> AccumulationPath:
    """Which accumulation path a (grad_weight, operands) triple takes.

    ``torch_version``, ``capability`` and ``is_rocm`` default to the running torch and the device of
    ``grad_weight``; tests inject them to check both sides of each gate.
    """
    operand_dtype = grad_logits.dtype
    if input.dtype != operand_dtype:
        raise TypeError(f"grad_logits ({operand_dtype}) and input ({input.dtype}) must share a dtype")
    same_dtype = grad_weight.dtype == operand_dtype
    if grad_weight.device.type == "cuda" and operand_dtype in _GEMM_DTYPES:
        torch_version = TORCH_VERSION if torch_version is None else torch_version
        is_rocm = torch.version.hip is not None if is_rocm is None else is_rocm
        if capability is None:
            capability = torch.cuda.get_device_capability(grad_weight.device)
        widening = grad_weight.dtype == torch.float32 and operand_dtype in _LOW_PRECISION
        bf16_ok = operand_dtype != torch.bfloat16 or capability >= (8, 0)
        if (
            torch_version >= _ADDMM_OUT_DTYPE_MIN_TORCH
            and not is_rocm
            and (same_dtype or widening)
            and bf16_ok
            and (not widening or capability >= (8, 0))
        ):
            return AccumulationPath.ADDMM_OUT
    if same_dtype:
        return AccumulationPath.ADDMM_INPLACE
    return AccumulationPath.ADD_MM


def accumulate_grad_weight(
    grad_weight: torch.Tensor,
    grad_logits: torch.Tensor,
    input: torch.Tensor,
    *,
    first: bool = False,
    path: Optional[AccumulationPath] = None,
) -> None:
    """``grad_weight += grad_logits.T @ input`` in place (``=`` when ``first``).

    Args:
        grad_weight: [V, H] accumulator, contiguous.
        grad_logits: [C, V] gradient of the loss w.r.t. one chunk's logits.
        input: [C, H] the chunk's hidden states (same dtype as ``grad_logits``).
        first: overwrite instead of accumulate, so ``grad_weight`` may be uninitialized memory.
        path: a precomputed :func:`choose_path` result (the chunk loop computes it once).
    """
    if path is None:
        path = choose_path(grad_weight, grad_logits, input)
    beta = 0 if first else 1
    if path is AccumulationPath.ADDMM_OUT:
        torch.addmm(
            grad_weight, grad_logits.t(), input, beta=beta, out_dtype=grad_weight.dtype, out=grad_weight
        )
    elif path is AccumulationPath.ADDMM_INPLACE:
        grad_weight.addmm_(grad_logits.t(), input, beta=beta)
    elif first:
        # Mixed dtypes without a widening GEMM: the product is a [V, H] temporary in the operand dtype.
        grad_weight.copy_(torch.mm(grad_logits.t(), input))
    else:
        grad_weight.add_(torch.mm(grad_logits.t(), input))
