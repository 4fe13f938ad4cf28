"""fused_linear_logprobs against float64: per-token log p(target) and entropy of softmax(softcap(x W^T + b) / T),
their values and their gradients to x, W and b for random upstream gradients of both outputs.

Tolerances: fp32 inputs within 1e-5 relative (L2) of float64; fp64 within 1e-12. 16-bit inputs: the fused error
against float64 (of the same 16-bit values) no worse than 1.5x the unfused 16-bit formula's (logits from
``F.linear`` in the input dtype, then fp32, the same float64 truth), plus the gradients' final rounding to 16 bits.
The Triton kernels run in Triton's interpreter (``-m interpret``) at small shapes, against the PyTorch twins.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import relative_error

from lightning_flce import LogProbsOutput, fused_linear_logprobs

PRECISIONS = ["input", "fp32", "fp32_head", "fp32_compensated"]
FP32_TOL = 1e-5
FP64_TOL = 1e-12
IGNORE = -100
# name -> (options of the call, per-token temperature); every feature is also in "all"
FEATURES = {
    "plain": ({}, False),
    "bias": ({"bias": True}, False),
    "softcap": ({"softcap": 4.0}, False),
    "temperature": ({"temperature": 0.7}, False),
    "per_token_temperature": ({}, True),
    "all": ({"bias": True, "softcap": 4.0}, True),
}


def reference(x, w, t, b=None, *, temperature=1.0, softcap=None, ignore_index=IGNORE, dtype=torch.float64):
    """(log p(target), entropy) in ``dtype`` from the logits computed in ``dtype`` (float64: the truth)."""
    logits = F.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    return reference_of_logits(logits, t, temperature=temperature, softcap=softcap, ignore_index=ignore_index)


def reference_of_logits(logits, t, *, temperature=1.0, softcap=None, ignore_index=IGNORE):
    z = logits if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.to(z.dtype).unsqueeze(-1)
    else:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = t != ignore_index
    logp = logp_all.gather(-1, torch.where(valid, t, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)


def make_problem(
    shape=(48,), h=32, v=300, dtype=torch.float32, bias=False, per_token_temperature=False, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, h, generator=gen)
    w = torch.randn(v, h, generator=gen) / h**0.5 * 2
    b = 0.3 * torch.randn(v, generator=gen) if bias else None
    t = torch.randint(0, v, shape, generator=gen)
    t.view(-1)[::5] = IGNORE
    temperature = (0.5 + torch.rand(shape, generator=gen)) if per_token_temperature else None
    upstream = (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    cast = lambda a: None if a is None else a.to(dtype).requires_grad_()  # noqa: E731
    return cast(x), cast(w), t, cast(b), temperature, upstream


def values_and_grads(fn, x, w, b, upstream):
    """fn(x, w, b) -> (logp, entropy); returns (logp, entropy, [dx, dw, db]) for the upstream gradients."""
    leaves = [None if a is None else a.detach().clone().requires_grad_() for a in (x, w, b)]
    logp, entropy = fn(*leaves)
    g, h = upstream
    loss = (logp * g.to(logp.dtype)).sum() + (entropy * h.to(entropy.dtype)).sum()
    loss.backward()
    return logp.detach(), entropy.detach(), [None if a is None else a.grad for a in leaves]


def fused(t, temperature, **options):
    def fn(x, w, b):
        out = fused_linear_logprobs(x, w, t, b, temperature=temperature, return_entropy=True, **options)
        assert isinstance(out, LogProbsOutput)
        return out.logprobs, out.entropy

    return fn


def truth(t, temperature, softcap):
    return lambda x, w, b: reference(x, w, t, b, temperature=temperature, softcap=softcap)


@pytest.mark.parametrize("shape", [(48,), (3, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_matches_float64(feature, shape, dtype):
    options, per_token = FEATURES[feature]
    x, w, t, b, temperature, upstream = make_problem(
        shape, dtype=dtype, bias=options.get("bias", False), per_token_temperature=per_token
    )
    temperature = temperature if per_token else options.get("temperature", 1.0)
    softcap = options.get("softcap")
    got = values_and_grads(fused(t, temperature, softcap=softcap, chunk_size=16), x, w, b, upstream)
    want = values_and_grads(
        truth(t, temperature, softcap), x.double(), w.double(), None if b is None else b.double(), upstream
    )
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    want_dtype = torch.float32 if dtype == torch.float32 else torch.float64
    for index in range(2):
        assert got[index].dtype == want_dtype and got[index].shape == t.shape
        assert relative_error(got[index], want[index]) < tol, (index, relative_error(got[index], want[index]))
        assert (got[index][t == IGNORE] == 0).all()
    for index, (grad, ref) in enumerate(zip(got[2], want[2])):
        if ref is not None:
            assert grad.dtype == dtype
            assert relative_error(grad, ref) < tol, (index, relative_error(grad, ref))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_no_worse_than_unfused(precision, dtype):
    """16-bit inputs, all features, several chunks: every output's and gradient's error against float64 (of the same
    16-bit values) at most 1.5x the unfused 16-bit formula's, plus the 16-bit gradients' final rounding; the
    wide-logits precisions' log-probabilities within 1e-5 of float64."""
    x, w, t, b, temperature, upstream = make_problem(
        (64,), h=64, dtype=dtype, bias=True, per_token_temperature=True
    )
    softcap = 4.0
    got = values_and_grads(
        fused(t, temperature, softcap=softcap, chunk_size=16, logits_precision=precision), x, w, b, upstream
    )
    unfused = values_and_grads(
        lambda *a: reference_of_logits(F.linear(*a), t, temperature=temperature, softcap=softcap),
        x,
        w,
        b,
        upstream,
    )
    want = values_and_grads(truth(t, temperature, softcap), x.double(), w.double(), b.double(), upstream)
    rounding = torch.finfo(dtype).eps / 2
    for index in range(2):
        error = relative_error(got[index], want[index])
        assert error <= 1.5 * relative_error(unfused[index], want[index]) + 1e-6, (index, error)
        if precision in WIDE_LOGPROB_BOUND:
            bound = (WIDE_LOGPROB_BOUND, WIDE_ENTROPY_BOUND)[index][precision]
            assert (got[index].double() - want[index]).abs().max() <= bound, index
    for index, (grad, ref, plain) in enumerate(zip(got[2], want[2], unfused[2])):
        assert grad.dtype == dtype
        error = relative_error(grad, ref)
        assert error <= 1.5 * relative_error(plain, ref) + rounding, (
            index,
            error,
            relative_error(plain, ref),
        )


def test_gradcheck_float64():
    """Double-precision gradcheck of both outputs at a tiny shape with every feature."""
    x, w, t, b, temperature, _ = make_problem(
        (6,), h=5, v=11, dtype=torch.float64, bias=True, per_token_temperature=True
    )

    def fn(x, w, b):
        out = fused_linear_logprobs(
            x, w, t, b, temperature=temperature, return_entropy=True, softcap=3.0, chunk_size=4
        )
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fn, (x, w, b))


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_one_output_used(which):
    """Only one output reaches the loss (the other's upstream gradient is None): the gradients are that output's."""
    x, w, t, b, _, (g, _) = make_problem((40,), dtype=torch.float64, bias=True)
    out = fused_linear_logprobs(x, w, t, b, return_entropy=True, chunk_size=16)
    ref = reference(x, w, t, b)
    index = 0 if which == "logprobs" else 1
    got = torch.autograd.grad((out[index] * g).sum(), (x, w, b))
    want = torch.autograd.grad((ref[index] * g).sum(), (x, w, b))
    for grad, ref_grad in zip(got, want):
        assert relative_error(grad, ref_grad) < FP64_TOL


def test_without_entropy_and_ignored_rows():
    """return_entropy=False: entropy None, the log-probability gradient alone; ignored rows get zero gradient."""
    x, w, t, _, _, (g, _) = make_problem((30,), dtype=torch.float64)
    out = fused_linear_logprobs(x, w, t)
    assert out.entropy is None
    (grad_x,) = torch.autograd.grad((out.logprobs * g).sum(), (x,))
    (want,) = torch.autograd.grad((reference(x, w, t)[0] * g).sum(), (x,))
    assert relative_error(grad_x, want) < FP64_TOL
    assert (grad_x[t == IGNORE] == 0).all()


def test_all_ignored_and_no_grad():
    x, w, t, *_ = make_problem((8,))
    t = torch.full_like(t, IGNORE)
    out = fused_linear_logprobs(x, w, t, return_entropy=True)
    assert (out.logprobs == 0).all() and (out.entropy == 0).all()
    grad_x, grad_w = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (x, w))
    assert (grad_x == 0).all() and (grad_w == 0).all()
    with torch.no_grad():
        assert fused_linear_logprobs(x, w, t).logprobs.requires_grad is False


@pytest.mark.parametrize(
    "temperature, error, message",
    [
        (0.0, ValueError, "positive and finite"),
        (-1.0, ValueError, "positive and finite"),
        (float("inf"), ValueError, "positive and finite"),
        (float("nan"), ValueError, "positive and finite"),
        ("1.0", TypeError, "float or a tensor"),
        (torch.ones(7), ValueError, "target's shape"),
        (torch.ones(12, dtype=torch.int64), TypeError, "floating-point"),
        (torch.tensor([1.0] * 11 + [0.0]), ValueError, "positive and finite"),
        (torch.tensor([1.0] * 11 + [float("nan")]), ValueError, "positive and finite"),
        (torch.ones(12, device="meta"), ValueError, "is on meta but target is on cpu"),
    ],
)
def test_bad_temperature_raises_before_any_kernel(monkeypatch, temperature, error, message):
    import lightning_flce.engine as engine

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(engine, "run_chunks", no_kernel)
    x, w, t, *_ = make_problem((12,))
    with pytest.raises(error, match=message):
        fused_linear_logprobs(x, w, t, temperature=temperature)


def test_temperature_of_ignored_positions_is_not_checked():
    """Padding may hold any temperature (0 here): only the tokens that count are checked."""
    x, w, t, _, temperature, upstream = make_problem((12,), dtype=torch.float64, per_token_temperature=True)
    temperature = torch.where(t == IGNORE, 0.0, temperature)
    got = values_and_grads(fused(t, temperature), x, w, None, upstream)
    want = values_and_grads(truth(t, torch.where(t == IGNORE, 1.0, temperature), None), x, w, None, upstream)
    for a, r in zip([*got[:2], *got[2][:2]], [*want[:2], *want[2][:2]]):
        assert relative_error(a, r) < FP64_TOL


def test_bad_targets_and_options_raise():
    x, w, t, *_ = make_problem((12,), v=300)
    with pytest.raises(ValueError, match=r"outside \[0, 300\)"):
        fused_linear_logprobs(x, w, torch.full_like(t, 300))
    with pytest.raises(ValueError, match="target shape"):
        fused_linear_logprobs(x, w, t[:5])
    with pytest.raises(ValueError):
        fused_linear_logprobs(x, w, t, softcap=-1.0)
    with pytest.raises(ValueError):
        fused_linear_logprobs(x, w, t, logits_precision="fp16")


def test_under_bf16_autocast():
    """fp32 parameters under bf16 autocast: bf16 GEMMs, fp32 gradients, as close to float64 as plain bf16 inputs."""
    x, w, t, _, _, upstream = make_problem((32,), h=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = values_and_grads(fused(t, 1.0, chunk_size=16), x, w, None, upstream)
    want = values_and_grads(truth(t, 1.0, None), x.bfloat16().double(), w.bfloat16().double(), None, upstream)
    assert got[2][0].dtype == torch.float32 and got[2][1].dtype == torch.float32
    assert relative_error(got[0], want[0]) < 1e-2
    for grad, ref in zip(got[2][:2], want[2][:2]):
        assert relative_error(grad, ref) < 2e-2


# ----------------------------------------------------------------------------------------------
# The Triton kernels in the interpreter
# ----------------------------------------------------------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize("block_v", [128, None], ids=["3-blocks", "1-block"])
@pytest.mark.parametrize("softcap", [0.0, 4.0], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per-row"])
def test_kernels_match_torch_twins(block_v, softcap, per_row):
    from lightning_flce.kernels.cross_entropy import LaunchConfig
    from lightning_flce.kernels.logprobs import logprob_grad_triton, logprob_row_stats_triton
    from lightning_flce.kernels.logprobs_torch import logprob_grad_torch, logprob_row_stats_torch

    gen = torch.Generator().manual_seed(0)
    n, v = 6, 300
    logits = 3 * torch.randn(n, v, generator=gen)
    logits[0, :200] = float("-inf")  # leading blocks masked
    target = torch.randint(200, v, (n,), generator=gen)
    inv_t = 1 / (0.5 + torch.rand(n if per_row else 1, generator=gen))
    g = torch.randn(n if per_row else 1, generator=gen)
    h = torch.randn(n, generator=gen)
    config = LaunchConfig(block_v, 4) if block_v else None
    stats = dict(inv_temperature=inv_t, softcap=softcap, with_entropy=True)
    got = logprob_row_stats_triton(logits, target, config=config, **stats)
    want = logprob_row_stats_torch(logits, target, **stats)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for grad_entropy in (h, None):
        grad = dict(
            lse=want[1], entropy=want[2], grad_logprobs=g, grad_entropy=grad_entropy, inv_temperature=inv_t
        )
        got_grad, want_grad = logits.clone(), logits.clone()
        logprob_grad_triton(got_grad, target, softcap=softcap, config=config, **grad)
        logprob_grad_torch(want_grad, target, softcap=softcap, **grad)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.interpret
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grad_kernel_writes_gradient_in_logits_rows(grad_dtype):
    """fp32 logits, the 16-bit gradient into each row's second half (over several blocks)."""
    from lightning_flce.kernels import gradient_in_logits_rows
    from lightning_flce.kernels.cross_entropy import LaunchConfig
    from lightning_flce.kernels.logprobs import logprob_grad_triton
    from lightning_flce.kernels.logprobs_torch import logprob_grad_torch, logprob_row_stats_torch

    gen = torch.Generator().manual_seed(1)
    n, v = 5, 300
    logits = 3 * torch.randn(n, v, generator=gen)
    target = torch.randint(0, v, (n,), generator=gen)
    inv_t = torch.full((1,), 1 / 0.8)
    logp, lse, entropy = logprob_row_stats_torch(
        logits, target, inv_temperature=inv_t, softcap=0.0, with_entropy=True
    )
    grad = dict(lse=lse, entropy=entropy, grad_logprobs=torch.randn(n, generator=gen), inv_temperature=inv_t)
    grad["grad_entropy"] = torch.randn(n, generator=gen)
    want = logits.clone()
    logprob_grad_torch(want, target, softcap=0.0, **grad)
    buffer = logits.clone()
    out = gradient_in_logits_rows(buffer, grad_dtype)
    logprob_grad_triton(buffer, target, softcap=0.0, grad_out=out, config=LaunchConfig(128, 4), **grad)
    torch.testing.assert_close(out.float(), want.to(grad_dtype).float(), rtol=1e-2, atol=1e-3)


@pytest.mark.interpret
@pytest.mark.parametrize("precision", ["input", "fp32", "fp32_compensated"])
def test_op_triton_path_matches_float64(precision):
    """The op on the Triton backend (fp32 inputs; "fp32*" on bf16 values computed in fp32 GEMMs here, as the
    interpreter's bf16 dot is unreliable): values and gradients within fp32 tolerance of float64."""
    dtype = torch.float32
    x, w, t, b, temperature, upstream = make_problem(
        (2, 10), h=16, v=200, dtype=dtype, bias=True, per_token_temperature=True
    )
    fn = fused(t, temperature, softcap=4.0, chunk_size=8, impl="triton", logits_precision=precision)
    got = values_and_grads(fn, x, w, b, upstream)
    want = values_and_grads(truth(t, temperature, 4.0), x.double(), w.double(), b.double(), upstream)
    for index in range(2):
        assert relative_error(got[index], want[index]) < FP32_TOL
    for grad, ref in zip(got[2], want[2]):
        assert relative_error(grad, ref) < FP32_TOL


def test_compiles_as_one_node():
    """Both outputs and their gradients under torch.compile (fullgraph; the op is one opaque node)."""
    x, w, t, b, temperature, upstream = make_problem(
        (2, 8), dtype=torch.float64, bias=True, per_token_temperature=True
    )

    def fn(x, w, b):
        out = fused_linear_logprobs(x, w, t, b, temperature=temperature, return_entropy=True, softcap=4.0)
        return out.logprobs, out.entropy

    got = values_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x, w, b, upstream)
    want = values_and_grads(fn, x, w, b, upstream)
    for a, r in zip([*got[:2], *got[2]], [*want[:2], *want[2]]):
        assert relative_error(a, r) < FP64_TOL


# The largest per-token error of the log-probabilities and entropies against float64 on a GPU (bf16 inputs, the
# temperature down to 0.5 doubling the logits' errors): the exact GEMMs ("fp32_compensated": the sum over H
# compensated; "fp32_head": fp32 GEMMs, TF32 off) within issue 36's 1e-5; "fp32" keeps the tensor cores' own
# fp32 accumulation over H, uncompensated: 3.2e-5 measured on an H200 at H = 1024 (2026-12-04), as the
# cross-entropy's per-token loss there (2.8-5.2e-5 at H = 2304-4096, docs/op.md).
WIDE_LOGPROB_BOUND = {"fp32_compensated": 1e-5, "fp32_head": 1e-5, "fp32": 1e-4}
# The entropy (lse - sum p z, about 9 nats here) carries the fp32 sums over V of the chunk kernel besides the
# logits' error: 1.6e-5 / 2.3e-5 measured with "fp32_compensated" / "fp32_head" (2026-12-04), about 20 fp32 ulps of H.
WIDE_ENTROPY_BOUND = {"fp32_compensated": 4e-5, "fp32_head": 4e-5, "fp32": 1e-4}


@pytest.mark.cuda
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cuda_bf16_matches_float64(precision):
    """The Triton kernels on a GPU at a mid-size shape (bf16, bias, softcap 30, per-token temperature, several
    chunks): no worse than the unfused bf16 formula; the wide-logits precisions' log-probabilities within
    :data:`WIDE_LOGPROB_BOUND` of float64 (the entropies within :data:`WIDE_ENTROPY_BOUND`)."""
    gen = torch.Generator().manual_seed(0)
    n, h, v = 2048, 1024, 32003
    x = torch.randn(n, h, generator=gen).bfloat16().cuda().requires_grad_()
    w = (torch.randn(v, h, generator=gen) / h**0.5 * 2).bfloat16().cuda().requires_grad_()
    b = (0.1 * torch.randn(v, generator=gen)).bfloat16().cuda().requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen).cuda()
    t[::9] = IGNORE
    temperature = (0.5 + torch.rand(n, generator=gen)).cuda()
    upstream = (torch.randn(n, generator=gen).cuda(), torch.randn(n, generator=gen).cuda())
    fn = fused(t, temperature, softcap=30.0, chunk_size=512, logits_precision=precision)
    got = values_and_grads(fn, x, w, b, upstream)
    unfused = values_and_grads(
        lambda *a: reference_of_logits(F.linear(*a), t, temperature=temperature, softcap=30.0),
        x,
        w,
        b,
        upstream,
    )
    want = values_and_grads(truth(t, temperature, 30.0), x.double(), w.double(), b.double(), upstream)
    for index in range(2):
        assert (
            relative_error(got[index], want[index])
            <= 1.5 * relative_error(unfused[index], want[index]) + 1e-6
        )
        if precision in WIDE_LOGPROB_BOUND:
            bound = (WIDE_LOGPROB_BOUND, WIDE_ENTROPY_BOUND)[index][precision]
            assert (got[index].double() - want[index]).abs().max() <= bound, index
    for grad, ref, plain in zip(got[2], want[2], unfused[2]):
        assert relative_error(grad, ref) <= 1.5 * relative_error(plain, ref) + 2**-9


def test_flop_counter_counts_the_head_gemms():
    """Forward 2 N H V; backward (dX and dW) 4 N H V; the policy loss all 6 N H V in forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_flce import fused_linear_policy_loss

    b, t, h, v = 2, 8, 16, 50
    x = torch.randn(b, t, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    target = torch.randint(0, v, (b, t))
    with FlopCounterMode(display=False) as counter:
        out = fused_linear_logprobs(x, w, target)
    assert counter.get_total_flops() == 2 * b * t * h * v
    with FlopCounterMode(display=False) as counter:
        out.logprobs.sum().backward()
    assert counter.get_total_flops() == 4 * b * t * h * v
    with FlopCounterMode(display=False) as counter:
        fused_linear_policy_loss(x, w, target, advantages=torch.randn(b)).loss.backward()
    assert counter.get_total_flops() == 6 * b * t * h * v


@pytest.mark.interpret
def test_op_triton_path_bf16_fp32_logits():
    """bf16 inputs with logits_precision="fp32" on the Triton backend (the logits GEMM widened on the CPU, the kernels
    on fp32 logits writing the bf16 gradient into the logits' rows): log-probs and entropy within fp32 tolerance of
    float64, gradients as accurate as the PyTorch backend's up to the interpreter's rounding."""
    x, w, t, b, temperature, upstream = make_problem(
        (24,), h=16, v=300, dtype=torch.bfloat16, bias=True, per_token_temperature=True
    )
    want = values_and_grads(truth(t, temperature, 4.0), x.double(), w.double(), b.double(), upstream)
    results = {
        impl: values_and_grads(
            fused(t, temperature, softcap=4.0, chunk_size=8, impl=impl, logits_precision="fp32"),
            x,
            w,
            b,
            upstream,
        )
        for impl in ("triton", "torch")
    }
    got, twin = results["triton"], results["torch"]
    for index in range(2):
        assert relative_error(got[index], want[index]) < FP32_TOL
    for grad, ref, other in zip(got[2], want[2], twin[2]):
        assert grad.dtype == torch.bfloat16
        # 2x: Triton's interpreter converts fp32 to bf16 by truncation (measured: every value of the kernel's
        # gradient is the twin's truncated), twice round-to-nearest's error; the GPU rounds to nearest
        assert relative_error(grad, ref) <= 2 * relative_error(other, ref) + 1e-4
