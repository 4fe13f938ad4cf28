"""The op on CUDA (Triton path), against float64 and against the naive path in the same dtype.

Acceptance bar: relative L2 errors of dX and dW no worse than 1.1x those of naive
``F.cross_entropy(F.linear(x, W).float(), t)`` in the same dtype; loss relative error < 1e-4 for
bf16/fp16 and < 1e-6 for fp32 (TF32 off, torch's default for matmuls).
Run on the GPU machine: ``pytest -m cuda``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from reference import assert_matches_reference, grads_of, reference_loss, relative_error
from test_accumulate import OpRecorder
from test_op import FP64_TOL

from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOSS_TOL = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def make_problem(n_rows, hidden, vocab, dtype, seed=0, ignore_frac=0.1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n_rows, hidden, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden, device="cuda", generator=gen) * hidden**-0.5 * 2).to(dtype)
    target = torch.randint(0, vocab, (n_rows,), device="cuda", generator=gen)
    target[torch.rand(n_rows, device="cuda", generator=gen) < ignore_frac] = -100
    return x, weight, target


def naive(x, weight, target, reduction="mean", **kwargs):
    return F.cross_entropy(F.linear(x, weight).float(), target, reduction=reduction, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("n_rows", "hidden", "vocab"), [(4096, 512, 32003), (3000, 768, 50257)])
def test_errors_no_worse_than_naive(dtype, reduction, n_rows, hidden, vocab):
    x, weight, target = make_problem(n_rows, hidden, vocab, dtype)
    grad_output = torch.randn(n_rows, device="cuda") if reduction == "none" else None
    args = (x.requires_grad_(), weight.requires_grad_())
    loss, grads = grads_of(
        lambda a, b: fused_linear_cross_entropy(a, b, target, reduction=reduction),
        *args,
        grad_output=grad_output,
    )
    base_loss, base_grads = grads_of(
        lambda a, b: naive(a, b, target, reduction), *args, grad_output=grad_output
    )
    ref_loss, ref_grads = grads_of(
        lambda a, b: reference_loss(a, b, target, reduction=reduction),
        x.double().requires_grad_(),
        weight.double().requires_grad_(),
        grad_output=grad_output,
    )
    assert relative_error(loss, ref_loss) < max(LOSS_TOL[dtype], 1.1 * relative_error(base_loss, ref_loss))
    for name, got, base, want in zip(("dX", "dW"), grads, base_grads, ref_grads):
        assert got.dtype == dtype
        err, base_err = relative_error(got, want), relative_error(base, want)
        assert err <= 1.1 * base_err + 1e-7, (name, err, base_err)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp16", "autocast16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(("n_rows", "hidden", "vocab"), [(4096, 512, 32003), (16384, 256, 128256)])
def test_fp16_under_grad_scaler_no_worse_than_naive(autocast, reduction, n_rows, hidden, vocab):
    """fp16 with torch's GradScaler (loss x 2^16): the logit gradients ~p / N (below fp16's subnormals at
    these N V) must not be rounded before the scale arrives (see tests/test_fp16_grads.py). autocast16:
    fp32 x and W under ``torch.autocast(dtype=float16)`` (Lightning's precision="16-mixed")."""
    dtype = torch.float32 if autocast else torch.float16
    x, weight, target = make_problem(n_rows, hidden, vocab, dtype, seed=3)
    scale = 2.0**16
    if reduction == "none":
        grad_output = torch.full((n_rows,), scale / n_rows, device="cuda")
    else:
        grad_output = torch.tensor(scale, device="cuda")
    args = (x.requires_grad_(), weight.requires_grad_())
    with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
        _, grads = grads_of(
            lambda a, b: fused_linear_cross_entropy(a, b, target, reduction=reduction),
            *args,
            grad_output=grad_output,
        )
        _, base_grads = grads_of(lambda a, b: naive(a, b, target, reduction), *args, grad_output=grad_output)
    _, ref_grads = grads_of(
        lambda a, b: reference_loss(a, b, target, reduction=reduction),
        x.double().requires_grad_(),
        weight.double().requires_grad_(),
        grad_output=grad_output.double(),
    )
    for name, got, base, want in zip(("dX", "dW"), grads, base_grads, ref_grads):
        assert got.dtype == dtype
        err, base_err = relative_error(got, want), relative_error(base, want)
        print(
            f"[fp16 grad scaler] {n_rows}x{hidden}x{vocab} {reduction} autocast={autocast} {name}: "
            f"{err:.3e} (naive {base_err:.3e})"
        )
        assert err <= 1.1 * base_err + 1e-7, (name, err, base_err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_features_match_float64(dtype):
    x, weight, target = make_problem(2048, 256, 10007, dtype, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    bias = torch.randn(10007, device="cuda", generator=gen).to(dtype)
    class_weight = torch.rand(10007, device="cuda", generator=gen) + 0.5
    options = {
        "label_smoothing": 0.1,
        "class_weight": class_weight,
        "lse_square_scale": 1e-4,
        "softcap": 30.0,
        "reduction": "mean",
    }
    loss, grads = grads_of(
        lambda a, b, c: fused_linear_cross_entropy(a, b, target, c, **options),
        x.requires_grad_(),
        weight.requires_grad_(),
        bias.requires_grad_(),
    )
    ref_loss, ref_grads = grads_of(
        lambda a, b, c: reference_loss(a, b, target, c, **options),
        x.double().requires_grad_(),
        weight.double().requires_grad_(),
        bias.double().requires_grad_(),
    )
    assert relative_error(loss, ref_loss) < (1e-5 if dtype == torch.float32 else 1e-3)
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float64_runs_in_float64(monkeypatch, reduction):
    """fp64 on CUDA (impl "auto", i.e. Triton): the fp32-only chunk kernel never runs (the PyTorch twin
    computes in fp64), backward's grad_output scaling stays fp64 (the scale kernel multiplies fp64 tensors in fp64), and
    loss, LSE, dX, dW, d bias are within test_op.py's FP64_TOL of float64."""
    import lightning_flce.kernels.cross_entropy as chunk_kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the fp32 Triton chunk kernel ran on fp64 logits")

    monkeypatch.setattr(chunk_kernel, "cross_entropy_chunk_triton", refuse)
    x, weight, target = make_problem(1024, 128, 5003, torch.float64, seed=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    bias = torch.randn(5003, device="cuda", generator=gen, dtype=torch.float64)
    class_weight = torch.rand(5003, device="cuda", generator=gen, dtype=torch.float64) + 0.5
    options = {
        "label_smoothing": 0.1,
        "class_weight": class_weight,
        "lse_square_scale": 1e-4,
        "softcap": 30.0,
        "reduction": reduction,
    }
    grad_output = (
        torch.randn(1024, device="cuda", generator=gen, dtype=torch.float64)
        if reduction == "none"
        else torch.tensor(1.7, device="cuda", dtype=torch.float64)
    )
    args = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_())
    got = grads_of(
        lambda a, b, c: fused_linear_cross_entropy(a, b, target, c, chunk_size=256, **options),
        *args,
        grad_output=grad_output,
    )
    want = grads_of(
        lambda a, b, c: reference_loss(a, b, target, c, **options), *args, grad_output=grad_output
    )
    assert_matches_reference(got, want, torch.float64, FP64_TOL)
    lse = fused_linear_cross_entropy_with_stats(x, weight, target, bias, softcap=30.0).lse
    logits = 30.0 * torch.tanh(F.linear(x, weight, bias).detach() / 30.0)
    assert lse.dtype == torch.float64
    assert relative_error(lse, torch.logsumexp(logits, -1) * (target != -100)) < FP64_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_and_torch_paths_agree(dtype):
    x, weight, target = make_problem(1024, 256, 5000, dtype, seed=3)
    out = {}
    for impl in ("triton", "torch"):
        out[impl] = fused_linear_cross_entropy_with_stats(x, weight, target, impl=impl, label_smoothing=0.1)
    torch.testing.assert_close(out["triton"].loss, out["torch"].loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out["triton"].lse, out["torch"].lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["triton"].entropy, out["torch"].entropy, rtol=1e-4, atol=1e-4)
    assert (out["triton"].correct != out["torch"].correct).float().mean() < 1e-3


@pytest.mark.parametrize("config", [None, (8192, 8), (4096, 8), (1024, 4)], ids=str)
def test_ce_kernel_loss_with_targets_in_the_first_gradient_block(config):
    """Pass 2 starts at the row's last block and overwrites it: the target logit read for the loss must be
    read by every warp before any of them stores there (a missing barrier gave wrong losses on an H200)."""
    from lightning_flce.kernels import LossOptions
    from lightning_flce.kernels.cross_entropy import LaunchConfig, cross_entropy_chunk_triton
    from lightning_flce.kernels.cross_entropy_torch import cross_entropy_chunk_torch

    gen = torch.Generator(device="cuda").manual_seed(5)
    n_rows, vocab = 4096, 32000
    logits = torch.randn(n_rows, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    target = torch.randint(vocab - 700, vocab, (n_rows,), device="cuda", generator=gen)
    scale = torch.full((1,), 1.0 / n_rows, device="cuda")
    kwargs = {"ce_scale": scale, "z_scale": scale, "compute_grad": True, "compute_stats": False}
    want = cross_entropy_chunk_torch(logits.clone(), target, LossOptions(), **kwargs)
    launch = LaunchConfig(*config) if config else None
    for _ in range(5):
        got = cross_entropy_chunk_triton(logits.clone(), target, LossOptions(), config=launch, **kwargs)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("config", [None, (4096, 8), (1024, 4)], ids=str)
@pytest.mark.parametrize("vocab", [256000, 32003])
def test_ce_kernel_gradient_in_logits_rows_matches_a_separate_buffer(config, vocab):
    """The 16-bit gradient of fp32 logits written into the rows' own second halves (the wide-logits path's one
    buffer): every warp must have loaded a block before any warp stores into it (a barrier per block), else
    some values are overwritten before they are read. Bit for bit the gradient and losses of a separate bf16
    buffer, five times over, at rows of 16 to 250 blocks and with a softcap (its factor reads z again)."""
    from lightning_flce.kernels import LossOptions, gradient_in_logits_rows
    from lightning_flce.kernels.cross_entropy import LaunchConfig, cross_entropy_chunk_triton

    gen = torch.Generator(device="cuda").manual_seed(7)
    n_rows = 512
    logits = torch.randn(n_rows, vocab, device="cuda", generator=gen) * 4
    target = torch.randint(0, vocab, (n_rows,), device="cuda", generator=gen)
    target[::9] = -100
    options = LossOptions(softcap=30.0, label_smoothing=0.1)
    scale = torch.full((1,), 1.0 / n_rows, device="cuda")
    kwargs = {"ce_scale": scale, "z_scale": scale, "compute_grad": True, "compute_stats": True}
    launch = LaunchConfig(*config) if config else None
    separate = torch.empty(n_rows, vocab, device="cuda", dtype=torch.bfloat16)
    want = cross_entropy_chunk_triton(
        logits.clone(), target, options, grad_out=separate, config=launch, **kwargs
    )
    for _ in range(5):
        in_rows = logits.clone()
        grad = gradient_in_logits_rows(in_rows, torch.bfloat16)
        got = cross_entropy_chunk_triton(in_rows, target, options, grad_out=grad, config=launch, **kwargs)
        assert torch.equal(grad, separate)
        for name in ("loss", "lse", "entropy", "correct"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bf16_mixed_autocast_gives_fp32_weight_grad(hidden_dtype):
    """Lightning's bf16-mixed: fp32 head weight under autocast; bf16 hidden states, or fp32 ones (a final
    norm's output: dX is kept in bf16 and widened by backward's cast kernel, here with grad_output 3)."""
    x, weight, target = make_problem(2048, 512, 32000, torch.float32, seed=4)
    hidden = x.to(hidden_dtype).requires_grad_()
    w = weight.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, w, target)
    (loss * 3).backward()
    assert w.grad.dtype == torch.float32 and hidden.grad.dtype == hidden_dtype

    hidden_ref, w_ref = x.to(hidden_dtype).requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss = F.cross_entropy(F.linear(hidden_ref, w_ref).float(), target)
    (ref_loss * 3).backward()
    exact = reference_loss(x.bfloat16(), weight.bfloat16(), target)
    assert relative_error(loss, exact) < 1e-4
    assert relative_error(w.grad, w_ref.grad) < 1e-2
    assert relative_error(hidden.grad, hidden_ref.grad) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_never_materializes_vh_product(dtype):
    vocab, hidden = 8000, 256
    x, weight, target = make_problem(2048, hidden, vocab, dtype, seed=5)
    with OpRecorder() as recorder:
        fused_linear_cross_entropy(
            x.requires_grad_(), weight.requires_grad_(), target, chunk_size=256
        ).backward()
    assert recorder.allocating_matmuls((vocab, hidden)) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backward_casts_the_dw_accumulator_without_a_temporary(dtype):
    """ "mean" over several chunks keeps dW's fp32 accumulator for backward, whose rounding to the weight's dtype
    takes grad_output in the same pass and writes dW into the accumulator's own memory (its first row block):
    backward allocates nothing of [V, H] (a separate output would add 2 V H bytes, a product in fp32 first 4 V H
    more), only the rounding's first-slice temporary, and the result is the accumulator times grad_output."""
    from lightning_flce.accumulate import _FIRST_SLICE

    vocab, hidden = 16000, 1024
    x, weight, target = make_problem(8192, hidden, vocab, dtype, seed=9)
    weight.requires_grad_()
    loss = fused_linear_cross_entropy(x, weight, target, chunk_size=2048)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    (loss * 3.0).backward()
    torch.cuda.synchronize()
    rise = torch.cuda.max_memory_allocated() - before
    temporary_bytes = _FIRST_SLICE * weight.element_size()
    assert rise <= temporary_bytes + (1 << 20), (rise, temporary_bytes)
    _, (want,) = grads_of(
        lambda w: reference_loss(x.double(), w, target), weight.double(), grad_output=torch.tensor(3.0)
    )
    assert weight.grad.dtype == dtype
    assert relative_error(weight.grad, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_host_sync_in_forward_none_in_backward(dtype):
    """Forward syncs once (target validation + row count, and fp16's gradient bounds); the mean normalizer
    and the backward stay on device."""
    x, weight, target = make_problem(4096, 256, 8000, dtype, seed=6)
    x.requires_grad_()
    weight.requires_grad_()
    fused_linear_cross_entropy(x, weight, target).backward()  # warm-up: compile kernels
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as forward_syncs:
            warnings.simplefilter("always")
            loss = fused_linear_cross_entropy(x, weight, target)
        with warnings.catch_warnings(record=True) as backward_syncs:
            warnings.simplefilter("always")
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    sync = [w for w in forward_syncs if "synchroniz" in str(w.message)]
    assert len(sync) == 1, [str(w.message) for w in forward_syncs]
    assert not [w for w in backward_syncs if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("chunk_size", [None, 256], ids=["one-chunk", "chunks-of-256"])
def test_torch_compile_inductor_matches_eager(chunk_size):
    """Inductor around the op (several chunks: forward saves the fp32 dW accumulator, backward casts it)."""
    x, weight, target = make_problem(1024, 256, 4000, torch.bfloat16, seed=7)
    proj = torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)

    def model(inp, w):
        return fused_linear_cross_entropy(
            torch.nn.functional.gelu(proj(inp)), w, target, lse_square_scale=1e-4, chunk_size=chunk_size
        )

    compiled = torch.compile(model, fullgraph=True)
    got_loss, got_grads = grads_of(compiled, x.requires_grad_(), weight.requires_grad_())
    want_loss, want_grads = grads_of(model, x, weight)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-3, atol=1e-3)
    for got, want in zip(got_grads, want_grads):
        assert relative_error(got, want) < 2e-2


def test_deterministic_on_cuda():
    x, weight, target = make_problem(4096, 512, 32000, torch.bfloat16, seed=8)
    runs = [
        grads_of(
            lambda a, b: fused_linear_cross_entropy(a, b, target), x.requires_grad_(), weight.requires_grad_()
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)
