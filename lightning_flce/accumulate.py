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

:class:`GradWeightAccumulator` holds the running sum when it is wider than the weight (fp32 for a bf16 or fp16
weight): in two row blocks, the first exactly the size of the finished dW, so that dW's final rounding is
written into the accumulator's own memory and the second block is freed. The LM head's peak is then the
accumulator's, two weight sizes for a 16-bit weight, not three (the accumulator and a separately allocated
result): 1 GiB less at V=128256, H=4096 where the chunk buffer is smaller than dW.
"""

from __future__ import annotations

import enum
from typing import Optional, Tuple

import torch
from torch import Tensor

from lightning_flce._compat import TORCH_VERSION
from lightning_flce.kernels.scale import scale_into

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


# ----------------------------------------------------------------------------------------------
# The accumulator, in two row blocks when it is wider than the weight
# ----------------------------------------------------------------------------------------------

# Elements of the first slice, which the rounding copies through a temporary (round_into_head_): 4 MiB in fp32.
_FIRST_SLICE = 1 << 20
# The tail block's GEMM reads the logit gradient from the head's row count on (a column offset): a multiple of 8
# keeps that operand 16-byte aligned for 16-bit GEMMs, as cuBLAS's fastest kernels want (at most 7 rows more
# in the head, a few KiB).
_HEAD_ROW_ALIGN = 8


def head_rows(vocab: int, accum_dtype: torch.dtype, final_dtype: torch.dtype) -> int:
    """Rows of a [vocab, H] accumulator in ``accum_dtype`` kept in its first block (see
    :class:`GradWeightAccumulator`): all of them unless the accumulator is at least twice as wide as the final
    dW, else the fewest whose memory holds the whole dW in ``final_dtype`` (half of them for fp32 and a 16-bit
    weight, a quarter for fp64), rounded up to a multiple of ``_HEAD_ROW_ALIGN``."""
    ratio = accum_dtype.itemsize // final_dtype.itemsize
    if ratio < 2:
        return vocab
    return min(vocab, -(-vocab // (ratio * _HEAD_ROW_ALIGN)) * _HEAD_ROW_ALIGN)


def round_into_head_(
    head: Tensor, tail: Tensor, dtype: torch.dtype, scale: Optional[Tensor] = None
) -> Tensor:
    """Round the accumulator ``(head; tail)`` (its rows in two blocks) times ``scale`` to ``dtype`` into the
    memory of ``head`` and return the result, a [rows, H] view of that memory. ``head`` must hold at least as many
    bytes as the result (:func:`head_rows`); its contents are overwritten, ``tail`` is only read (free it
    afterwards).

    The result's element ``i`` is written over bytes of ``head`` that hold accumulator elements ``< i``: in
    slices ``[a, b)`` with ``b <= ratio * a`` the written and the read bytes are disjoint, so each slice is one
    ordinary out-of-place kernel (no element is overwritten before it is read, in any order within the slice).
    The first slice, which overlaps itself, goes through a small temporary; the slices then grow by ``ratio``
    (9 launches for 256 M elements). The tail's rounded values land over the head's second part, read by then.
    Each value is rounded once, to the same bits as ``(accumulator * scale).to(dtype)``."""
    ratio = head.dtype.itemsize // dtype.itemsize
    hidden = head.shape[-1]
    rows = head.shape[0] + tail.shape[0]
    if ratio < 2 or head.numel() * ratio < rows * hidden:
        raise ValueError(
            f"round_into_head_: a {tuple(head.shape)} {head.dtype} head cannot hold {rows} x {hidden} {dtype}"
        )

    def write(out: Tensor, values: Tensor) -> Tensor:
        # without a scale, torch's own cast (Triton's interpreter truncates where scale_into's kernel rounds)
        return out.copy_(values) if scale is None else scale_into(out, values, scale)

    source = head.view(-1)
    result = source.view(dtype)  # the head's bytes as `dtype` elements (ratio per accumulator element)
    n_head = source.numel()
    if n_head:
        first = min(n_head, _FIRST_SLICE)
        result[:first].copy_(write(torch.empty(first, dtype=dtype, device=head.device), source[:first]))
        start = first
        while start < n_head:
            end = min(start * ratio, n_head)
            write(result[start:end], source[start:end])
            start = end
    if tail.numel():
        write(result[n_head : n_head + tail.numel()], tail.reshape(-1))
    return rounded_view(head, tail, dtype)


def rounded_view(head: Tensor, tail: Tensor, dtype: torch.dtype) -> Tensor:
    """The [rows, H] ``dtype`` result that :func:`round_into_head_` wrote into ``head`` (the same view)."""
    hidden = head.shape[-1]
    rows = head.shape[0] + tail.shape[0]
    return head.view(-1).view(dtype)[: rows * hidden].view(rows, hidden)


class GradWeightAccumulator:
    """dW's running sum over the chunks, [V, H] in ``dtype``, in two row blocks: ``head`` (the first
    :func:`head_rows` rows) and ``tail`` (the rest, empty when the accumulator is no wider than the weight).

    A wider accumulator is the accurate default (the chunks' products summed in fp32, rounded to the 16-bit
    weight's dtype once), and its final rounding used to set the LM head's memory peak: accumulator and result
    at once. Split this way, :meth:`result` rounds into the head's memory (:func:`round_into_head_`), so the result
    costs nothing beyond the accumulator; a forward that keeps the sum for backward returns :meth:`parts`, which
    backward rounds the same way (``lightning_flce.engine.finish_saved_grads``).
    """

    def __init__(self, head: Tensor, tail: Tensor) -> None:
        self.head = head
        self.tail = tail

    @classmethod
    def empty(
        cls, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, *, final_dtype: torch.dtype
    ) -> GradWeightAccumulator:
        rows = head_rows(vocab, dtype, final_dtype)
        return cls(
            torch.empty(rows, hidden, dtype=dtype, device=device),
            torch.empty(vocab - rows, hidden, dtype=dtype, device=device),
        )

    def parts(self) -> Tuple[Tensor, Tensor]:
        return self.head, self.tail

    def choose_path(self, operand: Tensor) -> AccumulationPath:
        """The accumulation path for GEMM operands of ``operand``'s dtype (the same for both blocks)."""
        return choose_path(self.head, operand, operand)

    def add(
        self,
        grad_logits: Tensor,
        input: Tensor,
        *,
        first: bool = False,
        path: Optional[AccumulationPath] = None,
        alpha: float = 1.0,
    ) -> None:
        """``dW (+)= alpha * grad_logits.T @ input`` (see :func:`accumulate_grad_weight`): one GEMM per block,
        each on its columns of ``grad_logits``."""
        split = self.head.shape[0]
        accumulate_grad_weight(self.head, grad_logits[:, :split], input, first=first, path=path, alpha=alpha)
        if self.tail.numel():
            accumulate_grad_weight(
                self.tail, grad_logits[:, split:], input, first=first, path=path, alpha=alpha
            )

    def zero_(self) -> None:
        self.head.zero_()
        self.tail.zero_()

    def result(self, dtype: torch.dtype) -> Tensor:
        """dW in ``dtype``: the head itself when that is its dtype, rounded into the head's memory when the
        accumulator is wider (which consumes it), else a cast."""
        if self.head.dtype.itemsize // dtype.itemsize < 2:  # then the head has every row (head_rows)
            return self.head.to(dtype)
        return round_into_head_(self.head, self.tail, dtype)
