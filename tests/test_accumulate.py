"""The version-gated dW accumulation: the decision table, the no-temporary guarantee, the fallbacks."""

from __future__ import annotations

import pytest
import torch
from reference import relative_error
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_flce import fused_linear_cross_entropy
from lightning_flce.accumulate import (
    AccumulationPath,
    GradWeightAccumulator,
    accumulate_grad_weight,
    choose_path,
    decide_path,
    head_rows,
    round_into_head_,
)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class OpRecorder(TorchDispatchMode):
    """Records every aten op, with the shapes of the tensors it allocated (outputs that are not
    written into one of its arguments, as ``out=`` and in-place variants are)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        input_storages = {a.untyped_storage().data_ptr() for a in inputs if a.numel()}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        allocated = [
            tuple(o.shape)
            for o in outs
            if isinstance(o, torch.Tensor)
            and o.numel()
            and o.untyped_storage().data_ptr() not in input_storages
        ]
        self.calls.append((func.overloadpacket.__name__, allocated))
        return out

    def allocating_matmuls(self, shape):
        """Matmuls that allocated a result of ``shape``: the [V, H] temporaries we forbid."""
        return [
            name
            for name, shapes in self.calls
            if name in ("mm", "matmul", "addmm", "bmm") and shape in shapes
        ]


def _decide(device="cuda", operands=BF16, grad_weight=BF16, version=(2, 8), capability=(9, 0), rocm=False):
    return decide_path(
        device_type=device,
        operand_dtype=operands,
        grad_weight_dtype=grad_weight,
        torch_version=version,
        capability=capability if device == "cuda" else None,
        is_rocm=rocm,
    )


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_cuda_new_torch_same_dtype_uses_addmm_out(dtype):
    assert _decide(operands=dtype, grad_weight=dtype) is AccumulationPath.ADDMM_OUT


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_cuda_new_torch_widening_uses_addmm_out(dtype):
    assert _decide(operands=dtype, grad_weight=F32) is AccumulationPath.ADDMM_OUT


@pytest.mark.parametrize("version", [(2, 4), (2, 7)])
def test_older_torch_falls_back(version):
    """Below 2.8 there is no out_dtype addmm: same dtype stays in place, widening allocates one product."""
    assert _decide(operands=BF16, grad_weight=BF16, version=version) is AccumulationPath.ADDMM_INPLACE
    assert _decide(operands=BF16, grad_weight=F32, version=version) is AccumulationPath.ADD_MM
    assert _decide(operands=BF16, grad_weight=F32, version=(2, 8)) is AccumulationPath.ADDMM_OUT
    assert _decide(operands=BF16, grad_weight=F32, version=(3, 0)) is AccumulationPath.ADDMM_OUT


def test_capability_gate():
    # bf16 and widening GEMMs need sm_80; fp16/fp32 same-dtype run on older GPUs too.
    assert _decide(operands=BF16, grad_weight=BF16, capability=(7, 5)) is AccumulationPath.ADDMM_INPLACE
    assert _decide(operands=F16, grad_weight=F32, capability=(7, 5)) is AccumulationPath.ADD_MM
    assert _decide(operands=F16, grad_weight=F16, capability=(7, 5)) is AccumulationPath.ADDMM_OUT
    assert _decide(operands=F32, grad_weight=F32, capability=(7, 0)) is AccumulationPath.ADDMM_OUT
    assert _decide(operands=BF16, grad_weight=F32, capability=(8, 0)) is AccumulationPath.ADDMM_OUT


def test_rocm_and_cpu_never_use_addmm_out():
    assert _decide(operands=BF16, grad_weight=F32, rocm=True) is AccumulationPath.ADD_MM
    assert _decide(operands=F32, grad_weight=F32, rocm=True) is AccumulationPath.ADDMM_INPLACE
    assert _decide(device="cpu", operands=F32, grad_weight=F32) is AccumulationPath.ADDMM_INPLACE
    assert _decide(device="cpu", operands=BF16, grad_weight=F32) is AccumulationPath.UPCAST_ADDMM
    # fp64 or fp16 operands into a bf16 accumulator: no GEMM does that, the product is materialized.
    assert _decide(device="cpu", operands=F16, grad_weight=BF16) is AccumulationPath.ADD_MM


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp32_into_fp64_upcasts_operands(device):
    assert _decide(device=device, operands=F32, grad_weight=torch.float64) is AccumulationPath.UPCAST_ADDMM


def test_choose_path_rejects_mixed_operands():
    with pytest.raises(TypeError, match="share a dtype"):
        choose_path(torch.empty(4, 3), torch.empty(2, 4), torch.empty(2, 3, dtype=BF16))


def _operands(dtype, grad_weight_dtype, device="cpu", vocab=96, hidden=40, chunk=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grad_logits = torch.randn(chunk, vocab, generator=gen).to(device=device, dtype=dtype)
    x = torch.randn(chunk, hidden, generator=gen).to(device=device, dtype=dtype)
    grad_weight = torch.randn(vocab, hidden, generator=gen).to(device=device, dtype=grad_weight_dtype)
    return grad_weight, grad_logits, x


@pytest.mark.parametrize(
    ("dtype", "gw_dtype", "tol"),
    [(F32, F32, 1e-6), (BF16, BF16, 1e-2), (BF16, F32, 1e-6), (F16, F32, 1e-6), (F32, torch.float64, 1e-12)],
)
def test_accumulate_and_overwrite_match_float64(dtype, gw_dtype, tol):
    """Accumulate (beta=1) and the first chunk's overwrite (beta=0, over NaN garbage).

    Tolerances: fp32 accumulators hold the exact products of bf16/fp16 operands up to fp32 rounding;
    a bf16 accumulator rounds the sum to bf16 (2^-9 relative)."""
    grad_weight, grad_logits, x = _operands(dtype, gw_dtype)
    expected = grad_weight.double() + grad_logits.double().t() @ x.double()
    accumulate_grad_weight(grad_weight, grad_logits, x)
    assert grad_weight.dtype == gw_dtype
    assert relative_error(grad_weight, expected) < tol

    garbage = torch.full_like(grad_weight, float("nan"))
    accumulate_grad_weight(garbage, grad_logits, x, first=True)
    assert relative_error(garbage, grad_logits.double().t() @ x.double()) < tol


def test_add_mm_fallback_is_correct():
    """The generic fallback (older torch / ROCm / old GPUs), forced on the CPU."""
    grad_weight, grad_logits, x = _operands(F16, F32)
    expected = grad_weight.double() + grad_logits.double().t() @ x.double()
    accumulate_grad_weight(grad_weight, grad_logits, x, path=AccumulationPath.ADD_MM)
    assert relative_error(grad_weight, expected) < 1e-3  # one fp16 rounding of the product
    accumulate_grad_weight(grad_weight, grad_logits, x, first=True, path=AccumulationPath.ADD_MM)
    assert relative_error(grad_weight, grad_logits.double().t() @ x.double()) < 1e-3


@pytest.mark.parametrize(("dtype", "gw_dtype"), [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_cpu_accumulation_allocates_no_vh_temporary(dtype, gw_dtype):
    grad_weight, grad_logits, x = _operands(dtype, gw_dtype)
    with OpRecorder() as recorder:
        accumulate_grad_weight(grad_weight, grad_logits, x)
    assert recorder.allocating_matmuls(tuple(grad_weight.shape)) == []
    assert [name for name, _ in recorder.calls if name == "addmm_"] == ["addmm_"]


def test_recorder_catches_the_old_idiom():
    """The recorder is not vacuous: the old `gw += mm(...).float()` is flagged."""
    grad_weight, grad_logits, x = _operands(BF16, F32)
    with OpRecorder() as recorder:
        grad_weight += torch.mm(grad_logits.t(), x).float()
    assert recorder.allocating_matmuls(tuple(grad_weight.shape)) == ["mm"]


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_whole_op_never_materializes_vh_product(dtype):
    """Through the full op on the CPU (several chunks), dW never passes through an allocating matmul."""
    vocab, hidden = 96, 40
    x = torch.randn(64, hidden, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (64,))
    with OpRecorder() as recorder:
        fused_linear_cross_entropy(x, weight, target, chunk_size=16).backward()
    assert recorder.allocating_matmuls((vocab, hidden)) == []


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_allocates_no_zero_gradients(reduction):
    """Backward of "mean" only rescales the saved gradients; nothing [N, H] or [V, H] is zero-filled."""
    x = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(100, 16, requires_grad=True)
    loss = fused_linear_cross_entropy(x, weight, torch.randint(0, 100, (64,)), reduction=reduction)
    with OpRecorder() as recorder:
        loss.sum().backward()
    assert not [name for name, _ in recorder.calls if name in ("zeros", "zeros_like", "new_zeros", "fill_")]
    if reduction == "mean":
        # Only scalars (the sum, grad_output) are allocated.
        assert all(shape == () for _, shapes in recorder.calls for shape in shapes), recorder.calls


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "gw_dtype"), [(F16, F16), (BF16, BF16), (F32, F32), (F16, F32), (BF16, F32)]
)
def test_cuda_supported_cases_take_the_inplace_gemm(dtype, gw_dtype):
    from lightning_flce._compat import TORCH_VERSION

    if TORCH_VERSION < (2, 8):
        pytest.skip("out_dtype addmm needs torch >= 2.8")
    grad_weight, grad_logits, x = _operands(dtype, gw_dtype, device="cuda", vocab=1000, hidden=256, chunk=128)
    assert choose_path(grad_weight, grad_logits, x) is AccumulationPath.ADDMM_OUT
    expected = grad_weight.double() + grad_logits.double().t() @ x.double()
    with OpRecorder() as recorder:
        accumulate_grad_weight(grad_weight, grad_logits, x)
    assert recorder.allocating_matmuls(tuple(grad_weight.shape)) == []
    assert not any(name in ("add", "add_", "copy_", "_to_copy") for name, _ in recorder.calls), recorder.calls
    # tf32 off by default for matmuls: fp32 accumulators are exact to fp32 rounding; bf16/fp16 ones to theirs.
    tol = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}[gw_dtype]
    assert relative_error(grad_weight, expected) < tol
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.max_memory_allocated()
    accumulate_grad_weight(grad_weight, grad_logits, x)
    assert torch.cuda.max_memory_allocated() - before < grad_weight.numel() * grad_weight.element_size() // 4


def test_scale_into_rounds_once_and_bounds_its_cpu_temporary(monkeypatch):
    """``scale_into`` (backward's cast of dW's fp32 accumulator with grad_output folded in): exactly the
    once-rounded product, in slices on the CPU (torch.mul into a narrower ``out`` goes through a temporary
    of the product's dtype, as large as its input)."""
    import lightning_flce.kernels.scale as scale

    gen = torch.Generator().manual_seed(3)
    src = torch.randn(100, 37, generator=gen)
    monkeypatch.setattr(scale, "_CPU_SLICE", 1000)  # 4 slices, the last one partial
    for dtype in (torch.bfloat16, torch.float16):
        out = scale.scale_into(torch.empty(100, 37, dtype=dtype), src, torch.tensor([0.7]))
        assert torch.equal(out, (src.double() * torch.tensor(0.7, dtype=torch.float32).double()).to(dtype))
    with pytest.raises(ValueError, match="shapes differ"):
        scale.scale_into(torch.empty(3, dtype=torch.bfloat16), src, torch.tensor([1.0]))


# ------------------------------------------------------------------------------ the two-block accumulator


@pytest.mark.parametrize(
    ("accum", "final", "vocab", "hidden"),
    [
        (F32, BF16, 300, 40),  # even V: the head is exactly the result's size
        (F32, F16, 301, 37),  # odd V: one row more in the head, one result row's bytes spare
        (F32, BF16, 1, 8),  # a single row: no tail
        (torch.float64, F32, 97, 24),  # fp32 weights' fp64 accumulator
        (torch.float64, BF16, 203, 16),  # ratio 4: a quarter of the rows in the head
    ],
    ids=str,
)
@pytest.mark.parametrize("scaled", [True, False], ids=["grad_output-folded-in", "plain-cast"])
def test_round_into_head_is_the_once_rounded_cast_in_the_heads_memory(
    monkeypatch, accum, final, vocab, hidden, scaled
):
    """dW's final rounding written over the accumulator's first block: bit for bit ``(sum * scale).to(dtype)``,
    in the head's memory (nothing [V, H] allocated), through many slices (the first one via a temporary, then
    growing ones whose read and written bytes are disjoint); a wrongly ordered or overlapping slice would
    overwrite accumulator values before reading them."""
    import lightning_flce.accumulate as accumulation

    monkeypatch.setattr(accumulation, "_FIRST_SLICE", 7)  # many slices, the first and last partial
    gen = torch.Generator().manual_seed(5)
    full = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 3).to(accum)
    accumulator = GradWeightAccumulator.empty(vocab, hidden, accum, torch.device("cpu"), final_dtype=final)
    rows = head_rows(vocab, accum, final)
    assert accumulator.head.shape == (rows, hidden) and accumulator.tail.shape == (vocab - rows, hidden)
    # the fewest rows that hold dW in the final dtype, rounded up to 8 (the tail GEMM's operand alignment)
    assert rows * accum.itemsize >= vocab * final.itemsize
    assert rows == vocab or (rows % 8 == 0 and (rows - 8) * accum.itemsize < vocab * final.itemsize)
    accumulator.head.copy_(full[:rows])
    accumulator.tail.copy_(full[rows:])
    scale = torch.tensor([0.7]) if scaled else None
    with OpRecorder() as recorder:
        result = round_into_head_(accumulator.head, accumulator.tail, final, scale)
    assert torch.equal(result, (torch.mul(full, scale) if scaled else full).to(final))
    assert result.shape == (vocab, hidden) and result.is_contiguous()
    assert result.untyped_storage().data_ptr() == accumulator.head.untyped_storage().data_ptr()
    assert not [shapes for _, shapes in recorder.calls if (vocab, hidden) in shapes]


def test_round_into_head_refuses_a_head_too_small():
    with pytest.raises(ValueError, match="cannot hold"):
        round_into_head_(torch.zeros(2, 4), torch.zeros(3, 4), BF16)
    with pytest.raises(ValueError, match="cannot hold"):
        round_into_head_(torch.zeros(4, 4, dtype=BF16), torch.zeros(0, 4, dtype=BF16), BF16)


@pytest.mark.parametrize(("dtype", "accum"), [(BF16, F32), (F16, F32), (BF16, BF16), (F32, torch.float64)])
def test_two_block_accumulator_matches_float64(dtype, accum):
    """Chunks accumulated block by block (one GEMM per block, on its columns of the logit gradient) and rounded
    into the head: the float64 sum of the chunks' products, to the accumulator's precision, then rounded once to
    the weight's dtype (within one of its ulps); an accumulator as narrow as the weight is a single block."""
    vocab, hidden, chunk = 301, 24, 16
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(chunk, vocab, generator=gen).to(dtype) for _ in range(4)]
    inputs = [torch.randn(chunk, hidden, generator=gen).to(dtype) for _ in range(4)]
    accumulator = GradWeightAccumulator.empty(vocab, hidden, accum, torch.device("cpu"), final_dtype=dtype)
    assert accumulator.tail.numel() == (
        0 if accum == dtype else (vocab - head_rows(vocab, accum, dtype)) * hidden
    )
    assert accumulator.tail.numel() > 0 or accum == dtype
    path = accumulator.choose_path(inputs[0])
    for i, (g, x) in enumerate(zip(grads, inputs)):
        accumulator.add(g, x, first=i == 0, path=path)
    expected = sum(g.double().t() @ x.double() for g, x in zip(grads, inputs))
    result = accumulator.result(dtype)
    assert result.dtype == dtype and result.shape == (vocab, hidden)
    ulp = torch.finfo(dtype).eps * (4 if accum == dtype else 1)  # a narrow accumulator rounds every chunk
    assert relative_error(result, expected) < ulp


def test_op_rounds_dw_into_its_accumulator():
    """Through the op (bf16 over several chunks, an fp32 accumulator kept for backward): backward rounds dW
    into the accumulator's first block, allocating nothing of the weight's size, so the head's peak is the
    accumulator, not accumulator + result. (The recomputing backward of "none", one opaque op here, is
    test_op.py's test_chunk_buffer_released_before_the_dw_cast.)"""
    vocab, hidden = 96, 40
    x = torch.randn(64, hidden, dtype=BF16, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=BF16, requires_grad=True)
    loss = fused_linear_cross_entropy(x, weight, torch.randint(0, vocab, (64,)), chunk_size=16)
    with OpRecorder() as recorder:
        loss.backward()
    names = [name for name, _ in recorder.calls]
    assert "flce_round_grad_weight_" in names and "flce_cast_grad" not in names, names
    # Only scalars (grad_output) are allocated.
    assert all(shape == () for _, shapes in recorder.calls for shape in shapes), recorder.calls
    assert weight.grad.dtype == BF16
    assert weight.grad.untyped_storage().nbytes() == weight.numel() * weight.element_size()
