"""``logits_dtype=torch.float32`` ("wide logits") on the CPU (PyTorch chunk path).

bf16 inputs: the reference is float64 of the same bf16-rounded inputs, so the only errors left are the
op's own roundings. The default path rounds the logits to bf16 (relative 2^-9 of logits of magnitude
~4-12 here: absolute errors of 1e-2 in the softmax's exponent), then the gradient and dX/dW. The wide
path keeps the fp32 GEMM outputs (exact products of bf16 operands, summed in fp32 over H = 64: ~1e-7),
so its loss is fp32-accurate (bar 1e-6) and its gradients carry only the bf16 rounding of d logits and
of dX/dW themselves: dX must come out clearly better than the default's (bar: 0.7x; measured 0.36-0.63x),
dW and d bias too (bar 0.8x; measured up to 0.70x with a bf16 accumulator, which also rounds once per
chunk). The softcap features use Gemma 2's cap of 30: the small caps of test_op.py (3, 4) squash the
logits, and with them the logit rounding that the wide path removes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import grads_of, reference_loss, relative_error
from test_op import FEATURES

from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
from lightning_flce.accumulate import accumulate_grad_weight, choose_path, widening_gemm_available
from lightning_flce.op import _resolve_chunk_size, default_chunk_size, logits_gemm

WIDE_FEATURES = {
    name: ({**feature, "softcap": 30.0} if "softcap" in feature else feature)
    for name, feature in FEATURES.items()
}
N_ROWS, HIDDEN, VOCAB = 256, 64, 1000


def make_bf16_problem(seed=0, n_rows=N_ROWS, hidden=HIDDEN, vocab=VOCAB):
    """bf16 x, W, b with logits of standard deviation ~4 (max ~12), 20% ignored targets."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, hidden, generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 4).bfloat16()
    bias = torch.randn(vocab, generator=gen).bfloat16()
    class_weight = torch.rand(vocab, generator=gen) + 0.5
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    target[torch.rand(n_rows, generator=gen) < 0.2] = -100
    return x, weight, target, bias, class_weight


def _run(fn, x, weight, bias, grad_output):
    return grads_of(
        fn,
        x.requires_grad_(),
        weight.requires_grad_(),
        bias.requires_grad_() if bias is not None else None,
        grad_output=grad_output,
    )


@pytest.mark.parametrize("accum_dtype", [None, torch.bfloat16], ids=["accum_auto", "accum_bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature_name", list(WIDE_FEATURES))
def test_wide_logits_more_accurate_than_default(feature_name, reduction, accum_dtype):
    x, weight, target, bias, class_weight = make_bf16_problem()
    feature = WIDE_FEATURES[feature_name]
    kwargs = {k: v for k, v in feature.items() if k not in ("bias", "class_weight")}
    b = bias if feature.get("bias") else None
    cw = class_weight if feature.get("class_weight") else None
    grad_output = (
        torch.randn(N_ROWS, generator=torch.Generator().manual_seed(1)) if reduction == "none" else None
    )

    def op(logits_dtype):
        def fn(x_, w_, b_):
            return fused_linear_cross_entropy(
                x_,
                w_,
                target,
                b_,
                reduction=reduction,
                class_weight=cw,
                logits_dtype=logits_dtype,
                accum_dtype=accum_dtype,
                chunk_size=64,  # 4 chunks of the ~205 non-ignored rows
                **kwargs,
            )

        return fn

    wide_loss, wide_grads = _run(op(torch.float32), x, weight, b, grad_output)
    default_loss, default_grads = _run(op(None), x, weight, b, grad_output)
    ref_loss, ref_grads = _run(
        lambda x_, w_, b_: reference_loss(x_, w_, target, b_, reduction=reduction, class_weight=cw, **kwargs),
        x.double(),
        weight.double(),
        b.double() if b is not None else None,
        grad_output,
    )
    assert wide_loss.dtype == torch.float32 and wide_loss.shape == ref_loss.shape
    assert relative_error(wide_loss, ref_loss) < 1e-6
    assert relative_error(wide_loss, ref_loss) < relative_error(default_loss, ref_loss)
    for index, (wide, default, ref) in enumerate(zip(wide_grads, default_grads, ref_grads)):
        if ref is None:
            continue
        assert wide.dtype == torch.bfloat16
        bar = 0.7 if index == 0 else 0.8
        assert relative_error(wide, ref) < bar * relative_error(default, ref), (index, feature_name)


def test_wide_logits_errors_vs_default_and_naive():
    """The headline numbers (printed with -s): wide vs the default op vs naive bf16 PyTorch."""
    x, weight, target, *_ = make_bf16_problem()
    ref_loss, ref_grads = _run(
        lambda a, b, _: reference_loss(a, b, target), x.double(), weight.double(), None, None
    )

    def errors(fn):
        loss, grads = _run(fn, x, weight, None, None)
        return [relative_error(loss, ref_loss)] + [
            relative_error(g, r) for g, r in zip(grads[:2], ref_grads[:2])
        ]

    results = {
        "wide": errors(lambda a, b, _: fused_linear_cross_entropy(a, b, target, logits_dtype=torch.float32)),
        "wide+accum_bf16": errors(
            lambda a, b, _: fused_linear_cross_entropy(
                a, b, target, logits_dtype=torch.float32, accum_dtype=torch.bfloat16, chunk_size=64
            )
        ),
        "default": errors(lambda a, b, _: fused_linear_cross_entropy(a, b, target)),
        "naive": errors(lambda a, b, _: F.cross_entropy(F.linear(a, b).float(), target)),
    }
    for name, (loss, dx, dw) in results.items():
        print(
            f"[wide logits, bf16 N={N_ROWS} H={HIDDEN} V={VOCAB}] {name:16s} loss {loss:.2e} dX {dx:.2e} dW {dw:.2e}"
        )
    assert results["wide"][1] < 0.7 * results["naive"][1]
    assert results["wide"][2] < 0.7 * results["naive"][2]
    assert results["wide+accum_bf16"][1] < 0.7 * results["naive"][1]
    # Rounding dW to bf16 after each of 4 chunks still beats naive's single rounding of worse gradients.
    assert results["wide+accum_bf16"][2] < results["naive"][2]


def test_wide_logits_stats():
    """LSE and entropy from the fp32 logits: fp32-accurate against float64 of the bf16 inputs."""
    x, weight, target, bias, _ = make_bf16_problem(seed=2)
    out = fused_linear_cross_entropy_with_stats(
        x, weight, target, bias, logits_dtype=torch.float32, chunk_size=50, softcap=30.0
    )
    logits = 30.0 * torch.tanh(F.linear(x.double(), weight.double(), bias.double()) / 30.0)
    valid = target != -100
    torch.testing.assert_close(out.lse.double(), torch.logsumexp(logits, -1) * valid, rtol=1e-6, atol=1e-6)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) * valid
    torch.testing.assert_close(out.entropy.double(), entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.correct, (logits.argmax(-1) == target) & valid)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_logits_dtype_equal_to_compute_dtype_is_the_default(dtype):
    """logits_dtype=<compute dtype> (and float32 for fp32 inputs) is None: bit for bit."""
    x, weight, target, bias, _ = make_bf16_problem(seed=3, n_rows=40, vocab=300)
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)

    def run(logits_dtype):
        return _run(
            lambda a, b, c: fused_linear_cross_entropy(
                a, b, target, c, logits_dtype=logits_dtype, chunk_size=16, label_smoothing=0.1
            ),
            x,
            weight,
            bias,
            None,
        )

    (loss_a, grads_a), (loss_b, grads_b) = run(None), run(dtype)
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


def test_wide_logits_under_autocast():
    """bf16 autocast, fp32 parameters: the compute dtype is bf16, so float32 logits are wide; grads fp32."""
    x, weight, target, bias, _ = make_bf16_problem(seed=4)
    w32, b32 = weight.float() * 1.001, bias.float()  # fp32 parameters that are not bf16 values

    def run(logits_dtype):
        def fn(a, b, c):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fused_linear_cross_entropy(a, b, target, c, logits_dtype=logits_dtype, chunk_size=64)

        return _run(fn, x, w32, b32, None)

    (wide_loss, wide_grads), (default_loss, default_grads) = run(torch.float32), run(None)
    # What the GEMM sees: bf16 operands (autocast), the bias added in fp32 as given.
    ref_loss, ref_grads = _run(
        lambda a, b, c: reference_loss(a, b, target, c),
        x.double(),
        w32.bfloat16().double(),
        b32.double(),
        None,
    )
    assert [g.dtype for g in wide_grads] == [torch.bfloat16, torch.float32, torch.float32]
    assert relative_error(wide_loss, ref_loss) < 1e-6 < relative_error(default_loss, ref_loss)
    assert relative_error(wide_grads[0], ref_grads[0]) < 0.7 * relative_error(default_grads[0], ref_grads[0])
    assert relative_error(wide_grads[1], ref_grads[1]) < 0.8 * relative_error(default_grads[1], ref_grads[1])


def test_wide_logits_no_grad_and_frozen_head():
    """Forward only (the buffer keeps fp32 logits) and dX only (no dW)."""
    x, weight, target, *_ = make_bf16_problem(seed=5, n_rows=64, vocab=200)
    with torch.no_grad():
        eval_loss = fused_linear_cross_entropy(x, weight, target, logits_dtype=torch.float32, chunk_size=16)
    xg = x.clone().requires_grad_()
    train_loss = fused_linear_cross_entropy(xg, weight, target, logits_dtype=torch.float32, chunk_size=16)
    train_loss.backward()
    assert torch.equal(eval_loss, train_loss.detach())
    assert xg.grad.dtype == torch.bfloat16 and weight.grad is None


def test_default_chunk_size_halves_rows_for_wide_logits():
    """Same byte budget: the wide buffer's 4 bytes per logit give half the rows of bf16's 2."""
    n_rows, vocab, hidden = 16384, 32000, 4096
    narrow = default_chunk_size(n_rows, vocab, hidden, 2, use_triton=True)
    wide = default_chunk_size(n_rows, vocab, hidden, 2, use_triton=True, logits_itemsize=4)
    assert wide == narrow // 2 and wide % 64 == 0
    assert wide * vocab * 4 <= (n_rows + vocab) * hidden * 2 // 4
    assert default_chunk_size(n_rows, vocab, hidden, 2, True, logits_itemsize=2) == narrow
    # PyTorch path: its fp32 working copies (12 bytes per logit) plus the buffer's 2 extra bytes.
    torch_narrow = default_chunk_size(4096, 32000, 1024, 2, use_triton=False)
    torch_wide = default_chunk_size(4096, 32000, 1024, 2, use_triton=False, logits_itemsize=4)
    assert torch_wide < torch_narrow
    # The op resolves chunk_size=None with the buffer's itemsize.
    x, weight = (
        torch.empty(n_rows, hidden, dtype=torch.bfloat16),
        torch.empty(vocab, hidden, dtype=torch.bfloat16),
    )
    assert _resolve_chunk_size(0, x, weight, torch.bfloat16, "triton", torch.float32) == wide
    assert _resolve_chunk_size(0, x, weight, torch.bfloat16, "triton", torch.bfloat16) == narrow


def test_strided_gradient_reaches_the_gemms_without_a_copy():
    """The wide gradient view (row stride 2V) goes to dX's mm and dW's addmm as it is, no copy."""
    from torch.profiler import ProfilerActivity, profile

    n_rows, hidden, vocab = 32, 16, 100
    buffer = torch.randn(n_rows, vocab)
    grad = buffer.view(torch.bfloat16)[:, :vocab]
    grad.copy_(torch.randn(n_rows, vocab))
    assert grad.stride() == (2 * vocab, 1)
    x_c = torch.randn(n_rows, hidden).bfloat16()
    weight = torch.randn(vocab, hidden).bfloat16()
    grad_weight = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    grad_input = torch.empty(n_rows, hidden, dtype=torch.bfloat16)
    path = choose_path(grad_weight, grad, x_c)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        accumulate_grad_weight(grad_weight, grad, x_c, first=True, path=path)
        torch.mm(grad, weight, out=grad_input)
    copies = [
        e.key for e in prof.key_averages() if e.key in ("aten::copy_", "aten::clone", "aten::contiguous")
    ]
    assert not copies, copies
    contiguous = grad.contiguous()
    torch.testing.assert_close(
        grad_weight, contiguous.t().float().mm(x_c.float()).bfloat16(), rtol=1e-2, atol=1e-2
    )
    torch.testing.assert_close(
        grad_input, contiguous.float().mm(weight.float()).bfloat16(), rtol=1e-2, atol=1e-2
    )


def test_widening_gemm_call_on_meta():
    """The CUDA branch (mm with out_dtype, then the fp32 bias) has the right call shape: checked on the meta
    device, which registers aten::mm.dtype_out (the CPU does not have that kernel)."""
    x_c = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(30, 16, dtype=torch.bfloat16, device="meta")
    out = torch.empty(8, 30, dtype=torch.float32, device="meta")
    logits_gemm(x_c, weight, torch.empty(30, device="meta"), out, widening=True)
    logits_gemm(x_c, weight, None, out, widening=True)
    assert out.dtype == torch.float32 and out.shape == (8, 30)
    assert not widening_gemm_available(torch.device("cpu"), torch.bfloat16)
    assert not widening_gemm_available(torch.device("cpu"), torch.float32)


def test_upcast_gemm_matches_float64():
    """The CPU branch: fp32 operands into the fp32 buffer (+ fp32 bias)."""
    x, weight, _, bias, _ = make_bf16_problem(seed=6, n_rows=16, vocab=50)
    out = torch.empty(16, 50)
    logits_gemm(x, weight.float(), bias.float(), out)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert relative_error(out, expected) < 1e-6


def test_wide_logits_torch_compile_and_flops():
    """The op's schema with logits_dtype: one opaque node under torch.compile; FLOPs unchanged."""
    from torch.utils.flop_counter import FlopCounterMode

    x, weight, target, bias, _ = make_bf16_problem(seed=7, n_rows=32, hidden=16, vocab=64)

    def model(a, w, b):
        return fused_linear_cross_entropy(a, w, target, b, logits_dtype=torch.float32, label_smoothing=0.1)

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got_loss, got_grads = _run(compiled, x, weight, bias, None)
    want_loss, want_grads = _run(model, x, weight, bias, None)
    torch.testing.assert_close(got_loss, want_loss)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want)
    for reduction in ("mean", "none"):
        with FlopCounterMode(display=False) as counter:
            fused_linear_cross_entropy(
                x.requires_grad_(),
                weight.requires_grad_(),
                target,
                reduction=reduction,
                logits_dtype=torch.float32,
            ).sum().backward()
        assert counter.get_total_flops() == 3 * 2 * 32 * 16 * 64
