"""``logits_precision``: each chunk's logits kept in fp32 ("fp32": 16-bit GEMM operands, fp32 accumulation and
output; "fp32_compensated": the same with the sum over H compensated, see
``lightning_flce/kernels/compensated_gemm.py``) or the head's GEMMs in fp32 ("fp32_head"), so per-token
log-probabilities are as exact as an fp32 head's (or, compensated, as exactly rounded logits allow).

The LSE cases follow Apple CCE's ``test_lse`` (its shapes and inputs, re-written here: half the classifier
rows equal to embeddings, so some logits are large and the softmax is peaked; a small bias or a softcap):
the op's per-token LSE must be no worse than PyTorch's LSE of in-dtype logits plus 1e-5, against the fp32
truth of the same (16-bit) values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import grads_of, reference_loss, relative_error

from lightning_flce import engine, fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
from lightning_flce._compat import TORCH_VERSION
from lightning_flce.options import WIDE_LOGITS_PRECISIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The precisions whose chunk logits come out of the 16-bit GEMM in fp32 (sorted: a stable parametrization order).
WIDE_PRECISIONS = sorted(WIDE_LOGITS_PRECISIONS)
SHAPES = [(256, 512, 128), (255, 507, 128), (256, 512, 64)]


def cce_lse_problem(shape, dtype, with_bias, seed=0):
    n, v, d = shape
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(n, d, generator=gen) / d**0.5
    c = torch.randn(v, d, generator=gen)
    c[: min(n, v) // 2] = e[: min(n, v) // 2]
    bias = 0.02 * torch.randn(v, generator=gen) if with_bias else None
    cast = None if bias is None else bias.to(dtype)
    return e.to(dtype), c.to(dtype), cast, torch.randint(0, v, (n,), generator=gen)


def lse_truth(e, c, bias, softcap):
    logits = e.double() @ c.double().T
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.logsumexp(logits, -1)


def lse_in_dtype(e, c, bias, softcap):
    logits = F.linear(e, c, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.logsumexp(logits, -1)


@pytest.mark.parametrize("precision", WIDE_PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["no-softcap", "softcap20"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_lse_no_worse_than_pytorch_in_dtype(dtype_name, with_bias, softcap, shape, precision):
    """36 cases per wide precision: with logits_precision="fp32" (or "fp32_compensated"), the per-token LSE
    error is within PyTorch's in-dtype error + 1e-5 (for fp32 inputs the option changes nothing)."""
    dtype = DTYPES[dtype_name]
    e, c, bias, target = cce_lse_problem(shape, dtype, with_bias)
    out = fused_linear_cross_entropy_with_stats(
        e, c, target, bias, softcap=softcap, logits_precision=precision
    )
    truth = lse_truth(e, c, bias, softcap)
    expected_error = (lse_in_dtype(e, c, bias, softcap).double() - truth).abs()
    error = (out.lse.double() - truth).abs()
    assert torch.all(error <= expected_error + 1e-5), float((error - expected_error).max())


@pytest.mark.parametrize("precision", WIDE_PRECISIONS)
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["no-softcap", "softcap20"])
def test_default_lse_rounds_like_pytorch_and_fp32_does_better(softcap, precision):
    """The default keeps today's semantics (logits rounded to bf16 as F.linear rounds them); "fp32" (and
    "fp32_compensated") is far closer to the truth: at most 1e-5 absolute per token."""
    e, c, bias, target = cce_lse_problem(SHAPES[0], torch.bfloat16, True)
    truth = lse_truth(e, c, bias, softcap)
    default = fused_linear_cross_entropy_with_stats(e, c, target, bias, softcap=softcap).lse.double()
    wide = fused_linear_cross_entropy_with_stats(
        e, c, target, bias, softcap=softcap, logits_precision=precision
    )
    assert (default - truth).abs().max() > 1e-4  # bf16-rounded logits
    assert (wide.lse.double() - truth).abs().max() <= 1e-5


@pytest.mark.parametrize("precision", ["fp32", "fp32_head", "fp32_compensated"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_per_token_loss_within_1e5_of_float64_and_grads_no_worse(precision, reduction):
    """bf16 inputs with bias, softcap, smoothing, z-loss and token weights over several chunks: per-token loss
    within 1e-5 absolute of float64 (of the same bf16 values); dX/dW (and d bias) no less accurate than the
    default option's."""
    gen = torch.Generator().manual_seed(1)
    n, h, v = 96, 64, 700
    x = torch.randn(n, h, generator=gen).bfloat16()
    w = (torch.randn(v, h, generator=gen) / h**0.5 * 3).bfloat16()
    b = (0.1 * torch.randn(v, generator=gen)).bfloat16()
    t = torch.randint(0, v, (n,), generator=gen)
    t[::7] = -100
    options = {"softcap": 15.0, "label_smoothing": 0.05, "lse_square_scale": 1e-4}
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    grad_output = torch.randn(n, generator=gen) if reduction == "none" else None

    def fused(precision_):
        return grads_of(
            lambda *a: fused_linear_cross_entropy(
                *a[:2], t, a[2], reduction=reduction, logits_precision=precision_, chunk_size=32, **options
            ),
            x,
            w,
            b,
            grad_output=grad_output,
        )

    want = grads_of(
        lambda *a: reference_loss(a[0], a[1], t, a[2], reduction=reduction, **options),
        x.double(),
        w.double(),
        b.double(),
        grad_output=grad_output,
    )
    got, default = fused(precision), fused("input")
    assert (got[0].double() - want[0]).abs().max() <= 1e-5
    for index, (g, d, ref) in enumerate(zip(got[1], default[1], want[1])):
        assert g.dtype == torch.bfloat16
        # the gradients are rounded to bf16 at the end either way: "no worse" up to that final rounding
        assert relative_error(g, ref) <= 1.05 * relative_error(d, ref) + 1e-3, index


def test_fp32_head_uses_fp32_gemms_and_fp32_accumulator(monkeypatch):
    """ "fp32_head": the chunk GEMMs see fp32 operands (widened once), dW accumulates in fp32."""
    import lightning_flce.accumulate as accumulation

    seen = set()
    accumulate = accumulation.accumulate_grad_weight

    def spy(grad_weight, grad_logits, x_c, **kwargs):
        seen.add((grad_weight.dtype, grad_logits.dtype, x_c.dtype))
        return accumulate(grad_weight, grad_logits, x_c, **kwargs)

    monkeypatch.setattr(accumulation, "accumulate_grad_weight", spy)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(300, 32, generator=gen).bfloat16().requires_grad_()
    t = torch.randint(0, 300, (64,), generator=gen)
    fused_linear_cross_entropy(x, w, t, logits_precision="fp32_head", chunk_size=16).backward()
    assert seen == {(torch.float32, torch.float32, torch.float32)}
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_fp32_compensated_cpu_fallback_rounds_the_float64_gemm_once(monkeypatch):
    """ "fp32_compensated" on the CPU (no Triton there): the float64 GEMM of the 16-bit values, rounded once to
    fp32, then the bias added in fp32, are exactly the logits the chunk kernel sees (bit for bit), in an fp32
    buffer (the 16-bit gradient in its rows); dX/dW come back in bf16. "fp32" (fp32 sums over H = 512) does not give
    exactly rounded logits here, so the comparison tells the two GEMMs apart."""
    import lightning_flce.engine as engine
    import lightning_flce.kernels.cross_entropy_torch as twin

    gemms, chunk_logits = [], []
    wide_gemm, chunk_kernel = engine.WideLogitsGemm, twin.cross_entropy_chunk_torch

    def gemm_spy(weight, **kwargs):
        gemm = wide_gemm(weight, **kwargs)
        gemms.append((gemm.mode, gemm.weight_wide.dtype))
        return gemm

    def kernel_spy(logits, *args, **kwargs):
        chunk_logits.append(logits.clone())  # before the kernel overwrites them with their gradient
        return chunk_kernel(logits, *args, **kwargs)

    monkeypatch.setattr(engine, "WideLogitsGemm", gemm_spy)
    monkeypatch.setattr(twin, "cross_entropy_chunk_torch", kernel_spy)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(300, 512, generator=gen) / 512**0.5 * 3).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(300, generator=gen)).bfloat16()
    t = torch.randint(0, 300, (64,), generator=gen)
    exact = (x.detach().double() @ w.detach().double().T).float() + b.float()

    def logits_of(precision):
        chunk_logits.clear()
        loss = fused_linear_cross_entropy(x, w, t, b, logits_precision=precision, chunk_size=16)
        return loss, torch.cat(chunk_logits)

    loss, logits = logits_of("fp32_compensated")
    assert gemms == [("float64", torch.float64)]
    assert logits.dtype == torch.float32 and torch.equal(logits, exact)
    loss.backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    _, fp32_logits = logits_of("fp32")
    assert not torch.equal(fp32_logits, exact)


@pytest.mark.parametrize("precision", WIDE_PRECISIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_wide_logits_keep_one_buffer_of_the_default_rows(monkeypatch, precision, dtype):
    """The wide precisions' chunks have the default's rows (the default's chunk count: dW's accumulator is read
    and written once per chunk) and one fp32 buffer, twice the default's 16-bit one: the issue's "at most one
    extra chunk buffer". The 16-bit gradient the chunk kernel writes is that buffer's own rows
    (gradient_in_logits_rows), not a second [C, V] tensor, and the loss and gradients match float64 as the
    chunk-size-independent path does (rows of several chunks here)."""
    import lightning_flce.kernels.cross_entropy_torch as twin
    from lightning_flce.kernels import gradient_in_logits_rows

    seen = []
    chunk_kernel = twin.cross_entropy_chunk_torch

    def kernel_spy(logits, *args, grad_out=None, **kwargs):
        seen.append((logits.dtype, logits.shape, grad_out))
        if grad_out is not None:
            view = gradient_in_logits_rows(logits, grad_out.dtype)
            assert (grad_out.data_ptr(), grad_out.stride()) == (view.data_ptr(), view.stride())
        return chunk_kernel(logits, *args, grad_out=grad_out, **kwargs)

    monkeypatch.setattr(twin, "cross_entropy_chunk_torch", kernel_spy)
    gen = torch.Generator().manual_seed(5)
    n, h, v = 600, 32, 64000
    x = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    loss = fused_linear_cross_entropy(x, w, t, logits_precision=precision, impl="torch")
    loss.backward()
    rows = engine.chunk_rows(None, n, n, v, h, dtype, False)
    assert rows < n  # several chunks
    assert [shape[0] for _, shape, _ in seen] == [rows] * (n // rows) + ([n % rows] if n % rows else [])
    assert all(logits_dtype == torch.float32 and grad is not None for logits_dtype, _, grad in seen)
    ref, ref_grads = grads_of(lambda a, b: reference_loss(a, b, t), x.double(), w.double())
    assert abs(loss.item() - ref.item()) < 1e-5
    # dX / dW: the 16-bit gradient's rounding (bf16 2^-9, fp16 2^-11 relative) and the 16-bit outputs
    tol = 2**-7 if dtype == torch.bfloat16 else 2**-9
    assert relative_error(x.grad, ref_grads[0]) < tol and relative_error(w.grad, ref_grads[1]) < tol


def test_gradient_in_logits_rows_is_narrowed_in_place_safely():
    """copy_gradient narrows fp32 values into their own rows' second halves block by block (a plain copy_
    would overwrite values before reading them; torch does not refuse the overlap), and any other overlap
    of grad_out and the logits is refused, not silently misread."""
    from lightning_flce.kernels import copy_gradient, gradient_in_logits_rows, is_gradient_in_logits_rows

    gen = torch.Generator().manual_seed(6)
    grad = torch.randn(10, 37, generator=gen)
    want = grad.to(torch.bfloat16)
    view = gradient_in_logits_rows(grad, torch.bfloat16)
    assert view.shape == grad.shape and is_gradient_in_logits_rows(grad, view)
    copy_gradient(grad, view, rows_per_copy=3)
    assert torch.equal(view, want)
    separate = torch.empty_like(want)
    assert not is_gradient_in_logits_rows(grad, separate)
    with pytest.raises(ValueError, match="overlaps the logits"):
        is_gradient_in_logits_rows(grad, grad.view(torch.bfloat16)[:, :37])
    with pytest.raises(ValueError, match="fp32"):
        gradient_in_logits_rows(want, torch.bfloat16)


def test_bad_logits_precision_is_refused():
    with pytest.raises(ValueError, match="logits_precision must be one of"):
        fused_linear_cross_entropy(
            torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), logits_precision="tf32"
        )


def _cuda_problem(shape):
    """bf16 hidden states, head (logits of std ~2), bias and targets of a benchmark shape on the GPU."""
    n, h, v = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5 * 2).bfloat16()
    b = (0.1 * torch.randn(v, device="cuda", generator=gen)).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    return x, w, b, t


def _softcapped_loss(x, w, b, t, dtype, softcap=30.0):
    """Per-token loss (float64) of F.linear in ``dtype`` with the softcap, 2048 rows at a time."""
    out = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    w, b = w.to(dtype), b.to(dtype)
    with torch.no_grad():
        for rows in torch.arange(x.shape[0], device=x.device).split(2048):
            logits = F.linear(x[rows].to(dtype), w, b)
            logits = softcap * torch.tanh(logits / softcap)
            out[rows] = F.cross_entropy(logits, t[rows], reduction="none").double()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "shape", [(16384, 4096, 32000), (8192, 2304, 256000)], ids=lambda s: "x".join(map(str, s))
)
def test_cuda_fp32_logits_at_benchmark_shapes(shape):
    """On the GPU (the native fp32-output GEMM on torch >= 2.8): bf16 inputs with bias and softcap at the
    benchmark shapes. Against float64, the default's per-token loss is off by up to ~2e-2 (bf16-rounded
    logits); with fp32 logits by at most 1e-4 and 2e-5 on average, at least 100x better. Measured on an H200
    (results/*_run70_*): max 5.2e-5 / 2.8e-5, mean 1.5e-5 / 8.2e-6 at the two shapes, against the fp32 head's
    (F.linear of the widened values in fp32, TF32 off) 1.2e-5 / 8.5e-6: the tensor cores' fp32 accumulation of
    16-bit products is less exact than an fp32 GEMM's; logits_precision="fp32_head" runs that fp32 GEMM."""
    x, w, b, t = _cuda_problem(shape)
    got = fused_linear_cross_entropy(x, w, t, b, softcap=30.0, reduction="none", logits_precision="fp32")
    default = fused_linear_cross_entropy(x, w, t, b, softcap=30.0, reduction="none")
    want = _softcapped_loss(x, w, b, t, torch.float64)
    fp32_head = _softcapped_loss(x, w, b, t, torch.float32)
    error = (got.double() - want).abs()
    fp32_head_error = (fp32_head - want).abs()
    default_error = (default.double() - want).abs()
    print(
        f"max |error|: fp32 logits {error.max():.2e}, fp32 head {fp32_head_error.max():.2e},"
        f" default {default_error.max():.2e}; mean {error.mean():.2e}"
    )
    assert error.max() <= 1e-4
    assert error.mean() <= 2e-5
    assert error.max() < default_error.max() / 100


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("relative", "lse_from_gemm"),
    [(True, False), (False, False), (False, True)],
    ids=["relative-16bit", "fp32-two-pass", "fp32-lse-from-gemm"],
)
@pytest.mark.parametrize(
    "shape", [(16384, 4096, 32000), (8192, 2304, 256000)], ids=lambda s: "x".join(map(str, s))
)
def test_cuda_fp32_compensated_logits_at_benchmark_shapes(shape, relative, lse_from_gemm, monkeypatch):
    """The problem of test_cuda_fp32_logits_at_benchmark_shapes with "fp32_compensated" (the Triton GEMM with
    short tensor-core chains over H): per-token loss within 1e-5 of float64 and at least 5 sqrt(256 / chain)
    times closer than "fp32"'s (its one chain over H; a chain's rounding grows like the square root of its
    length). Measured on an H200 (benchmarks/results/2026-12-01_h200_torch2.11_triton3.6_run72_*, the GEMM
    alone): 2.3e-6 / 2.1e-6 max at the two shapes with Kahan's sum of 128-long chains, against "fp32"'s
    5.2e-5 / 2.8e-5 (13-22x); chains of 512 (run84): 4.4-5.2e-6. ``relative``: the library's path, the LSE and
    target logits from the GEMM's epilogue and 16-bit relative logits (``engine.RELATIVE_16BIT_LOGITS``); else
    the fp32 buffer, with and without the LSE from the epilogue's partials (``engine.LSE_FROM_LOGITS_GEMM``)."""
    from lightning_flce.kernels.compensated_gemm import launch_config

    monkeypatch.setattr(engine, "RELATIVE_16BIT_LOGITS", relative)
    monkeypatch.setattr(engine, "RELATIVE_MIN_VOCAB", 0)  # both shapes on the path asked for
    monkeypatch.setattr(engine, "LSE_FROM_LOGITS_GEMM", lse_from_gemm)
    x, w, b, t = _cuda_problem(shape)
    options = {"softcap": 30.0, "reduction": "none"}
    got = fused_linear_cross_entropy(x, w, t, b, logits_precision="fp32_compensated", **options)
    fp32 = fused_linear_cross_entropy(x, w, t, b, logits_precision="fp32", **options)
    want = _softcapped_loss(x, w, b, t, torch.float64)
    error = (got.double() - want).abs()
    fp32_error = (fp32.double() - want).abs()
    config = launch_config(x.device)
    chain = config.block_k * config.chain_blocks
    print(f"max |error|: fp32_compensated {error.max():.2e}, fp32 {fp32_error.max():.2e} (chains of {chain})")
    assert error.max() <= 1e-5
    assert error.max() * 5 * (256 / chain) ** 0.5 <= fp32_error.max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [32003, 32000], ids=["masked-store", "tma-store"])
def test_cuda_compensated_gemm_tile_lse_partials(n):
    """The epilogue's LSE partials on the GPU (libdevice exp, softcap 30, bias, 4099 rows: an M tail; N = 32003
    has a 3-column last tile) against float64 from the stored logits: maxima within 1e-6 relative, sums within
    1e-5; the LSE they combine to within 2e-6 of float64's."""
    from lightning_flce.kernels.compensated_gemm import compensated_logits_mm, empty_tile_lse, launch_config

    m, k, softcap = 4099, 2048, 30.0
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5 * 2).bfloat16()
    b = 0.1 * torch.randn(n, device="cuda", generator=gen)
    config = launch_config(x.device)
    partials = empty_tile_lse(m, n, x.device, softcap)
    out = compensated_logits_mm(x, w, torch.empty(m, n, device="cuda"), b, tile_lse=partials)
    z = softcap * torch.tanh(out.double() / softcap)
    tiles = partials.max.shape[1]
    padded = F.pad(z, (0, tiles * config.block_n - n), value=float("-inf")).view(m, tiles, config.block_n)
    want_max = padded.amax(dim=2)
    want_sum = (padded - want_max[..., None]).exp().sum(dim=2)
    assert torch.allclose(partials.max.double(), want_max, rtol=1e-6, atol=1e-6)
    assert torch.allclose(partials.sum_exp.double(), want_sum, rtol=1e-5, atol=0)
    lse = partials.max.double().amax(dim=1)
    lse = lse + (partials.sum_exp.double() * (partials.max.double() - lse[:, None]).exp()).sum(dim=1).log()
    assert (lse - torch.logsumexp(z, dim=1)).abs().max() <= 2e-6


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [32003, 32000], ids=["masked-store", "tma-store"])
def test_cuda_compensated_gemm_relative_logits_and_target_logits(n):
    """The epilogue's 16-bit store on the GPU (bf16 out, softcap 30, bias, 4099 rows; N = 32003: the warps'
    masked stores, 32000: the copy engine's): every value is the fp32 logit through the softcap minus its row's
    tile maximum, rounded once to bf16 (against the same GEMM into fp32: within half a bf16 ulp of that
    difference plus the fp32 GEMM's own few ulps), and each row's target logit is its float64 value (through the
    softcap) within 1e-6 relative and 2e-5 absolute; rows with target -100 keep their buffer's NaN."""
    from lightning_flce.kernels.compensated_gemm import compensated_logits_mm, empty_tile_lse, launch_config

    m, k, softcap = 4099, 2048, 30.0
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5 * 2).bfloat16()
    b = 0.1 * torch.randn(n, device="cuda", generator=gen)
    t = torch.randint(0, n, (m,), device="cuda", generator=gen)
    t[::5] = -100
    config = launch_config(x.device)
    fp32_partials = empty_tile_lse(m, n, x.device, softcap)
    exact = compensated_logits_mm(x, w, torch.empty(m, n, device="cuda"), b, tile_lse=fp32_partials)
    z = softcap * torch.tanh(exact.double() / softcap)
    partials = empty_tile_lse(m, n, x.device, softcap, with_target_logit=True)
    partials.target_logit.fill_(float("nan"))
    out = compensated_logits_mm(
        x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), b, tile_lse=partials, target=t
    )
    assert torch.equal(partials.max, fp32_partials.max)
    tile_max = partials.max.double().repeat_interleave(config.block_n, dim=1)[:, :n]
    relative = z - tile_max
    bound = torch.finfo(torch.bfloat16).eps / 2 * relative.abs() + 1e-5 * (1 + z.abs())  # half a bf16 ulp
    assert ((out.double() - relative).abs() <= bound).all()
    valid = t != -100
    # its own fp32 dot product (compensated_gemm.target_logits) against float64's: a few ulps, and the softcap's
    # tanh through the GPU's exp (~2^-22 relative of its argument's exp, times c = 30)
    exact = (x[valid].double() * w[t[valid]].double()).sum(-1) + b[t[valid]].double()
    want = softcap * torch.tanh(exact / softcap)
    assert torch.allclose(partials.target_logit[valid].double(), want, rtol=1e-6, atol=2e-5)
    assert partials.target_logit[~valid].isnan().all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("k", "n"),
    [(2050, 32003), (2048, 32003), (2048, 32000)],
    ids=["k2050-pointer", "k2048-tma", "k2048-tma-store"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_compensated_gemm_alone_at_a_tail_shape(dtype, k, n):
    """The kernel at shapes with M and N tails (4099 x 32003 / 32000) and a bias, writing into a row slice of a
    wider buffer, against the float64 product. K = 2050 (rows of 4100 bytes: the pointer kernel, with a K tail)
    and 2048 (the TMA kernel on a Hopper GPU; persistent, with N = 32000 storing through the copy engine, whose
    store must stop at the slice's rows). The products of 16-bit values are exact in fp32; what is left is each
    chain's fp32 sum (chain_blocks x 128 products; measured ~4.8 ulps of fp32 at max |logit| for 256-long chains
    at K = 4096, run80), the plain sum of the K / chain chains (at most half an ulp each) and the bias add
    (0.5 ulp). A chain's rounding grows like the square root of its length (a random walk of half-ulp
    roundings), so the bound is 8 sqrt(chain / 256) + 0.5 additions ulps, and the tensor cores' plain fp32
    chain over K ("fp32") is at least 4 sqrt(256 / chain) times further off (4x at 256, measured at run84's
    2 x 128 default)."""
    from lightning_flce.kernels.compensated_gemm import compensated_logits_mm, launch_config

    m = 4099
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5 * 2).to(dtype)
    b = 0.1 * torch.randn(n, device="cuda", generator=gen)
    buffer = torch.full((m + 5, n), float("nan"), device="cuda")
    out = compensated_logits_mm(x, w, buffer[2 : m + 2], b)
    exact = x.double() @ w.double().T + b.double()
    error = (out.double() - exact).abs().max().item()
    ulp = 2.0 ** (torch.frexp(exact.abs().max()).exponent.item() - 24)
    config = launch_config(x.device)
    chain = config.block_k * config.chain_blocks
    additions = 0 if config.kahan else -(-k // chain)
    assert torch.isnan(buffer[:2]).all() and torch.isnan(buffer[m + 2 :]).all()  # nothing outside the slice
    assert error <= (8 * (chain / 256) ** 0.5 + 0.5 * additions) * ulp, (error, ulp, chain)
    if TORCH_VERSION >= (2, 8):  # torch.mm(..., out_dtype=): the GEMM of logits_precision="fp32"
        native = torch.mm(x, w.t(), out_dtype=torch.float32) + b
        assert 4 * (256 / chain) ** 0.5 * error <= (native.double() - exact).abs().max().item()


def test_chunk_kernel_exp_precision_follows_what_the_exponentials_become():
    """The chunk kernel's exponentials: libdevice's (exact within an ulp) where their result is fp32, the fast
    exp where it is rounded to 16 bits. fp32 logits: the first pass (LSE, loss) precise; the gradient pass
    precise only for an fp32 gradient; 16-bit logits: neither; the interpreter has no libdevice (neither)."""
    pytest.importorskip("triton")
    from lightning_flce.kernels import cross_entropy as chunk_kernel

    rule = chunk_kernel.exp_precision
    if chunk_kernel.TRITON_INTERPRET:
        for logits, grad in [
            (torch.float32, torch.float32),
            (torch.float32, torch.bfloat16),
            (torch.bfloat16, None),
        ]:
            assert rule(logits, grad) == (False, False)
        return
    assert rule(torch.float32, torch.float32) == (True, True)  # fp32 operands: an fp32 gradient
    assert rule(torch.float32, None) == (True, True)  # no gradient: the LSE and loss only
    assert rule(torch.float32, torch.bfloat16) == (True, False)  # logits_precision="fp32*" on bf16
    assert rule(torch.float32, torch.float16) == (True, False)
    assert rule(torch.bfloat16, torch.bfloat16) == (False, False)  # the default's 16-bit logits
    assert rule(torch.float16, None) == (False, False)
