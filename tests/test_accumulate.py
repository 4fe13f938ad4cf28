"""The version-gated dW accumulation: the decision table, the no-temporary guarantee, the fallbacks."""

from __future__ import annotations

import pytest
import torch
from reference import relative_error
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_flce import fused_linear_cross_entropy
from lightning_flce.accumulate import AccumulationPath, accumulate_grad_weight, choose_path, decide_path

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
