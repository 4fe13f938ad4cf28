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
``upcast_addmm``  CPU, fp16/bf16 operands into an fp32 grad_weight; anywhere, fp32       ``gw.addmm_(g.t().to(gw.dtype),
                  operands into an fp64 grad_weight                                     x.to(gw.dtype))``
``add_mm``        anything else (older torch, ROCm, older GPUs)                         ``gw.add_(torch.mm(g.t(), x))``
================  ====================================================================  ==================

``addmm_out``, ``addmm_inplace`` and ``upcast_addmm`` write the GEMM result straight into
``grad_weight`` (BLAS ``beta=1``); ``upcast_addmm`` copies only the chunk-sized operands to the
accumulator's dtype (there is no widening GEMM for these pairs; a CPU's fp32 GEMM is as fast as its bf16
one, and a datacenter GPU's fp64 GEMM as fast as its non-TF32 fp32 one). ``add_mm`` allocates one
[V, H] product in the operand dtype — half of the old idiom, never an fp32 copy — and rounds each
chunk's product once. With ``first=True`` the chunk overwrites instead (``beta=0``), so
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
    UPCAST_ADDMM = "upcast_addmm"
    ADD_MM = "add_mm"


def choose_path(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, input: torch.Tensor
) -> AccumulationPath:
    """Which accumulation path these tensors take (see :func:`decide_path`)."""
    if input.dtype != grad_logits.dtype:
        raise TypeError(f"grad_logits ({grad_logits.dtype}) and input ({input.dtype}) must share a dtype")
    device = grad_weight.device
    is_cuda = device.type == "cuda"
    return decide_path(
        device_type=device.type,
        operand_dtype=grad_logits.dtype,
        grad_weight_dtype=grad_weight.dtype,
        torch_version=TORCH_VERSION,
        capability=torch.cuda.get_device_capability(device) if is_cuda else None,
        is_rocm=torch.version.hip is not None,
    )


def decide_path(
    *,
    device_type: str,
    operand_dtype: torch.dtype,
    grad_weight_dtype: torch.dtype,
    torch_version: Tuple[int, int],
    capability: Optional[Tuple[int, int]],
    is_rocm: bool,
) -> AccumulationPath:
    """The decision table of this module, as a pure function of the facts it depends on."""
    same_dtype = grad_weight_dtype == operand_dtype
    widening = grad_weight_dtype == torch.float32 and operand_dtype in _LOW_PRECISION
    if (
        device_type == "cuda"
        and not is_rocm
        and torch_version >= _ADDMM_OUT_DTYPE_MIN_TORCH
        and operand_dtype in _GEMM_DTYPES
        and (same_dtype or widening)
        and capability is not None
        # bf16 GEMMs, and widening fp16/bf16 GEMMs, need Ampere (sm_80) or newer.
        and (capability >= (8, 0) or (operand_dtype != torch.bfloat16 and not widening))
    ):
        return AccumulationPath.ADDMM_OUT
    if same_dtype:
        return AccumulationPath.ADDMM_INPLACE
    if (device_type == "cpu" and widening) or (
        grad_weight_dtype == torch.float64 and operand_dtype == torch.float32
    ):
        return AccumulationPath.UPCAST_ADDMM
    return AccumulationPath.ADD_MM


def accumulate_grad_weight(
    grad_weight: torch.Tensor,
    grad_logits: torch.Tensor,
    input: torch.Tensor,
    *,
    first: bool = False,
    path: Optional[AccumulationPath] = None,
    alpha: float = 1.0,
) -> None:
    """``grad_weight += alpha * grad_logits.T @ input`` in place (``=`` when ``first``).

    Args:
        grad_weight: [V, H] accumulator, contiguous.
        grad_logits: [C, V] gradient of the loss w.r.t. one chunk's logits.
        input: [C, H] the chunk's hidden states (same dtype as ``grad_logits``).
        first: overwrite instead of accumulate, so ``grad_weight`` may be uninitialized memory.
        path: a precomputed :func:`choose_path` result (the chunk loop computes it once).
        alpha: applied in the GEMM's fp32 epilogue, before any rounding to the output dtype (the op
            unscales fp16 logit gradients with it, see ``lightning_flce.op``).
    """
    if path is None:
        path = choose_path(grad_weight, grad_logits, input)
    beta = 0 if first else 1
    if path is AccumulationPath.ADDMM_OUT:
        torch.addmm(
            grad_weight,
            grad_logits.t(),
            input,
            beta=beta,
            alpha=alpha,
            out_dtype=grad_weight.dtype,
            out=grad_weight,
        )
    elif path is AccumulationPath.ADDMM_INPLACE:
        grad_weight.addmm_(grad_logits.t(), input, beta=beta, alpha=alpha)
    elif path is AccumulationPath.UPCAST_ADDMM:
        grad_weight.addmm_(
            grad_logits.t().to(grad_weight.dtype), input.to(grad_weight.dtype), beta=beta, alpha=alpha
        )
    else:
        # Mixed dtypes without a widening GEMM: the product is a [V, H] temporary in the operand dtype
        # (alpha inside the GEMM, so a scaled fp16 product cannot overflow before it).
        product = torch.empty(grad_weight.shape, dtype=input.dtype, device=input.device)
        torch.addmm(product, grad_logits.t(), input, beta=0, alpha=alpha, out=product)
        if first:
            grad_weight.copy_(product)
        else:
            grad_weight.add_(product)
