"""The op against its float64 definition on the CPU (PyTorch chunk path).

Tolerances: fp32 results are compared with relative L2 errors of 1e-5. fp32 rounding is 6e-8 per
operation; the longest reductions here (logsumexp over V <= 32003, GEMMs over H <= 65 or N <= 64
tokens) grow it to ~1e-6, well under 1e-5, while a wrong term (a missing smoothing or z-loss
contribution, a wrong normalizer) moves the result by more than 1e-3. bf16 is held to the bar of
the naive path in the same dtype (see test_bf16_no_worse_than_naive). fp64 inputs run the softmax in fp64
too, and are held to 1e-12 (see FP64_TOL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import assert_matches_reference, grads_of, reference_loss, relative_error, unfused_loss

from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
from lightning_flce.engine import default_chunk_size
from lightning_flce.kernels import BACKENDS, backend_for
from lightning_flce.op import BackwardArgs, ForwardArgs

FP32_TOL = 1e-5
# fp64 rounding is 1.1e-16 per operation; grown over these reductions (logsumexp over V <= 1000, GEMMs over
# H <= 65 or N <= 64) it stays near 1e-15 (measured: at most 1e-15). An fp32 step anywhere (the softmax, a
# scale, the d bias sum) shows as ~1e-8..1e-7, so 1e-12 tells them apart with margin on both sides.
FP64_TOL = 1e-12

FEATURES = {
    "plain": {},
    "bias": {"bias": True},
    "smoothing": {"label_smoothing": 0.1},
    "class_weight": {"class_weight": True},
    "z_loss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 4.0},
    "smoothing+class_weight": {"label_smoothing": 0.2, "class_weight": True},
    "all": {
        "bias": True,
        "label_smoothing": 0.15,
        "class_weight": True,
        "lse_square_scale": 1e-3,
        "softcap": 3.0,
    },
}


def op_args(x, weight, target, bias, **overrides) -> ForwardArgs:
    """flce_forward's arguments by name: defaults of a plain "mean" call on the torch backend, all grads."""
    args = {
        "x": x,
        "weight": weight,
        "target": target,
        "bias": bias,
        "class_weight": None,
        "token_weight": None,
        "ignore_index": -100,
        "reduction": "mean",
        "label_smoothing": 0.0,
        "lse_square_scale": 0.0,
        "softcap": 0.0,
        "logits_precision": "input",
        "compute_dtype": x.dtype,
        "accum_dtype": None,
        "chunk_size": 0,
        "backend": "torch",
        "need_grad_input": True,
        "need_grad_weight": True,
        "need_grad_bias": bias is not None,
        "compute_stats": False,
    }
    args.update(overrides)
    return ForwardArgs(**args)


def make_problem(n_rows, hidden, vocab, *, dtype=torch.float32, ignore_frac=0.2, seed=0, lead_shape=None):
    gen = torch.Generator().manual_seed(seed)
    shape = lead_shape if lead_shape is not None else (n_rows,)
    x = torch.randn(*shape, hidden, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5 * 2).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target[torch.rand(shape, generator=gen) < ignore_frac] = -100
    bias = torch.randn(vocab, generator=gen).to(dtype)
    class_weight = torch.rand(vocab, generator=gen) + 0.5
    return x, weight, target, bias, class_weight


def run_case(x, weight, target, bias, class_weight, feature, reduction, grad_output, **op_kwargs):
    """Returns ((loss, grads) of the op, (loss, grads) of the float64 reference)."""
    kwargs = {k: v for k, v in feature.items() if k not in ("bias", "class_weight")}
    use_bias = feature.get("bias", False)
    cw = class_weight if feature.get("class_weight", False) else None
    b = bias.requires_grad_() if use_bias else None
    x.requires_grad_()
    weight.requires_grad_()

    def op(x_, w_, b_):
        return fused_linear_cross_entropy(
            x_, w_, target, b_, reduction=reduction, class_weight=cw, **kwargs, **op_kwargs
        )

    def ref(x_, w_, b_):
        return reference_loss(x_, w_, target, b_, reduction=reduction, class_weight=cw, **kwargs)

    got = grads_of(op, x, weight, b, grad_output=grad_output)
    want = grads_of(
        ref, x.double(), weight.double(), b.double() if b is not None else None, grad_output=grad_output
    )
    return got, want


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature_name", list(FEATURES))
@pytest.mark.parametrize(
    ("lead_shape", "hidden", "vocab", "chunk_size"),
    [((37,), 17, 1000, 8), ((2, 19), 33, 257, 16), ((5,), 65, 1000, None)],
    ids=["N37-H17-V1000-chunk8", "B2xT19-H33-V257-chunk16", "N5-H65-default-chunk"],
)
def test_matches_float64_reference(reduction, feature_name, lead_shape, hidden, vocab, chunk_size):
    x, weight, target, bias, class_weight = make_problem(None, hidden, vocab, lead_shape=lead_shape)
    # A random, non-1 grad_output: per token (the target's shape) for "none", a scalar otherwise.
    grad_output = torch.randn(target.shape) if reduction == "none" else torch.tensor(1.7)
    got, want = run_case(
        x,
        weight,
        target,
        bias,
        class_weight,
        FEATURES[feature_name],
        reduction,
        grad_output,
        chunk_size=chunk_size,
    )
    assert_matches_reference(got, want, torch.float32, FP32_TOL)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vocab_32003(reduction):
    x, weight, target, bias, class_weight = make_problem(64, 7, 32003, seed=1)
    grad_output = torch.randn(64) if reduction == "none" else None
    (loss, grads), (ref_loss, ref_grads) = run_case(
        x, weight, target, bias, class_weight, FEATURES["all"], reduction, grad_output, chunk_size=24
    )
    assert relative_error(loss, ref_loss) < FP32_TOL
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < FP32_TOL


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature_name", ["plain", "all"])
def test_bf16_no_worse_than_naive(reduction, feature_name):
    """bf16: the error vs float64 is within 1.1x (+1e-4 for noise) of the naive bf16 path's error.

    The naive path is F.cross_entropy(F.linear(x, W).float()) with bf16 x, W, b, i.e. what users would
    otherwise run in the same dtype; both round logits and their gradient to bf16. A scalar grad_output
    is a power of two here (exact in any float format); see test_bf16_scalar_grad_output_rounding.
    """
    _check_bf16_against_naive(reduction, feature_name, grad_scale=0.5, ratio=1.1)


def test_bf16_scalar_grad_output_rounding():
    """A scalar grad_output that is not a power of two rescales dX after it was rounded to bf16 in forward:
    one extra bf16 rounding (at most a factor sqrt(2) on a rounding-dominated error). dW here (3 chunks) has
    an fp32 accumulator, which backward casts with grad_output folded in: one rounding, see
    test_wide_dw_accumulator_is_cast_once_in_backward."""
    _check_bf16_against_naive("mean", "plain", grad_scale=0.7, ratio=1.5)


def _check_bf16_against_naive(reduction, feature_name, grad_scale, ratio):
    x, weight, target, bias, class_weight = make_problem(96, 48, 1000, dtype=torch.bfloat16, seed=2)
    feature = FEATURES[feature_name]
    grad_output = torch.randn(96) if reduction == "none" else torch.tensor(grad_scale)
    (loss, grads), (ref_loss, ref_grads) = run_case(
        x, weight, target, bias, class_weight, feature, reduction, grad_output, chunk_size=32
    )
    kwargs = {k: v for k, v in feature.items() if k not in ("bias", "class_weight")}
    cw = class_weight if feature.get("class_weight") else None
    use_bias = feature.get("bias", False)

    def naive(x_, w_, b_):
        return unfused_loss(x_, w_, target, b_, reduction=reduction, class_weight=cw, **kwargs)

    naive_loss, naive_grads = grads_of(naive, x, weight, bias if use_bias else None, grad_output=grad_output)
    assert relative_error(loss, ref_loss) <= 1.1 * relative_error(naive_loss, ref_loss) + 1e-4
    for got, want, base in zip(grads, ref_grads, naive_grads):
        if want is not None:
            assert got.dtype == torch.bfloat16
            assert relative_error(got, want) <= ratio * relative_error(base, want) + 1e-4


def test_bf16_weight_accumulation_modes():
    """accum_dtype=None/float32 accumulate dW in fp32 over chunks; the weight's dtype rounds every chunk."""
    x, weight, target, *_ = make_problem(512, 32, 300, dtype=torch.bfloat16, ignore_frac=0.0, seed=3)
    _, (_, ref_dw) = grads_of(
        lambda a, b: reference_loss(a, b, target, reduction="sum"),
        x.double(),
        weight.double().requires_grad_(),
    )

    def dw_error(accum_dtype):
        _, (_, dw) = grads_of(
            lambda a, b: fused_linear_cross_entropy(
                a, b, target, reduction="sum", chunk_size=16, accum_dtype=accum_dtype
            ),
            x,
            weight.requires_grad_(),
        )
        assert dw.dtype == torch.bfloat16
        return relative_error(dw, ref_dw)

    auto, fp32, in_param = dw_error(None), dw_error(torch.float32), dw_error(torch.bfloat16)
    assert auto == fp32
    # 32 chunks rounded to bf16 one after another: clearly worse than one final rounding.
    assert in_param > 2 * fp32
    with pytest.raises(ValueError, match="accum_dtype"):
        fused_linear_cross_entropy(x, weight, target, accum_dtype=torch.float16)


def test_fp64_accumulation_for_fp32_weight():
    """accum_dtype=float64 (the "auto" choice for fp32 weights on A100/H100-class GPUs): dW rounds once."""
    x, weight, target, *_ = make_problem(512, 32, 300, ignore_frac=0.1, seed=3)
    _, (ref_dx, ref_dw) = grads_of(
        lambda a, b: reference_loss(a, b, target, reduction="sum"),
        x.double().requires_grad_(),
        weight.double().requires_grad_(),
    )
    _, (dx, dw) = grads_of(
        lambda a, b: fused_linear_cross_entropy(
            a, b, target, reduction="sum", chunk_size=16, accum_dtype=torch.float64
        ),
        x.requires_grad_(),
        weight.requires_grad_(),
    )
    assert dw.dtype == torch.float32 and dx.dtype == torch.float32
    assert relative_error(dw, ref_dw) < 1e-6
    # dX's GEMM runs in fp64 alongside the fp64 accumulator.
    assert relative_error(dx, ref_dx) < 1e-6


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature_name", ["plain", "all", "smoothing+class_weight"])
def test_float64_matches_float64_reference(reduction, feature_name):
    """fp64 GEMMs get an fp64 softmax (as F.cross_entropy on fp64 logits): loss, LSE, entropy, dX, dW and
    d bias within FP64_TOL of the reference, over several chunks with ignored rows; fp64 out."""
    x, weight, target, bias, class_weight = make_problem(37, 17, 1000, dtype=torch.float64)
    feature = FEATURES[feature_name]
    grad_output = torch.randn(37, dtype=torch.float64) if reduction == "none" else torch.tensor(1.7)
    got, want = run_case(
        x, weight, target, bias, class_weight.double(), feature, reduction, grad_output, chunk_size=8
    )
    assert_matches_reference(got, want, torch.float64, FP64_TOL)

    softcap = feature.get("softcap")
    b = bias if feature.get("bias") else None
    out = fused_linear_cross_entropy_with_stats(x, weight, target, b, softcap=softcap, chunk_size=8)
    logits = F.linear(x, weight, b).detach()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    valid = target != -100
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) * valid
    assert out.lse.dtype == out.entropy.dtype == torch.float64
    assert relative_error(out.lse, torch.logsumexp(logits, -1) * valid) < FP64_TOL
    assert relative_error(out.entropy, entropy) < FP64_TOL


class _RecomputedInBackward(torch.autograd.Function):
    """``fn(*inputs)`` whose backward runs ``fn`` again and differentiates that call: gradcheck backpropagates
    twice through one graph (its reentrancy check), which "mean"/"sum" refuse by design (their gradients are
    computed in forward and handed out once). grad_output still reaches the op's own backward."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            return (None, *torch.autograd.grad(ctx.fn(*inputs), inputs, grad_output))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature_name", ["plain", "all", "smoothing+class_weight"])
def test_float64_gradcheck(reduction, feature_name):
    """torch.autograd.gradcheck (default tolerances) w.r.t. input, weight and bias, over 3 chunks (6 valid
    rows, 4 ignored; "none": on the op itself; "mean"/"sum" through _RecomputedInBackward, times 1.7 so the op's
    backward scales by a grad_output other than 1)."""
    x, weight, target, bias, class_weight = make_problem(10, 4, 13, dtype=torch.float64, seed=5)
    assert int((target == -100).sum()) == 4
    feature = FEATURES[feature_name]
    kwargs = {k: v for k, v in feature.items() if k not in ("bias", "class_weight")}
    cw = class_weight.double() if feature.get("class_weight") else None

    def op(x_, w_, b_):
        return fused_linear_cross_entropy(
            x_, w_, target, b_, reduction=reduction, class_weight=cw, chunk_size=2, **kwargs
        )

    inputs = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_())
    if reduction == "none":
        assert torch.autograd.gradcheck(op, inputs)
    else:
        assert torch.autograd.gradcheck(lambda *t: 1.7 * _RecomputedInBackward.apply(op, *t), inputs)


def test_float64_runs_the_torch_softmax_also_for_triton():
    """The Triton kernels compute in fp32: fp64 GEMMs take the PyTorch twin whatever the impl (on CUDA too)."""

    def chunk_kernels_use_triton(impl, dtype):
        return backend_for(BACKENDS[impl], dtype).name == "triton"

    assert not chunk_kernels_use_triton("triton", torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert chunk_kernels_use_triton("triton", dtype)
        assert not chunk_kernels_use_triton("torch", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_all_ignored_gives_zero_with_connected_graph(dtype):
    x, weight, target, bias, _ = make_problem(12, 8, 50)
    target.fill_(-100)
    for reduction in ("mean", "sum", "none"):
        xg, wg, bg = (t.to(dtype).requires_grad_() for t in (x, weight, bias))
        loss = fused_linear_cross_entropy(xg, wg, target, bg, reduction=reduction, lse_square_scale=1e-3)
        assert loss.requires_grad
        assert torch.all(loss == 0) and not torch.isnan(loss).any()
        loss.sum().backward()
        for grad in (xg.grad, wg.grad, bg.grad):
            assert grad is not None and torch.all(grad == 0)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp64_under_autocast_stays_fp64(autocast_dtype):
    """Autocast leaves fp64 tensors alone (F.linear under it runs in fp64): so does the op."""
    x, weight, target, bias, _ = make_problem(12, 8, 50)
    x, weight, bias = (t.double().requires_grad_() for t in (x, weight, bias))
    with torch.autocast("cpu", dtype=autocast_dtype):
        got = grads_of(lambda x_, w_, b_: fused_linear_cross_entropy(x_, w_, target, b_), x, weight, bias)
    want = grads_of(lambda x_, w_, b_: reference_loss(x_, w_, target, b_), x, weight, bias)
    assert got[0].dtype == torch.float64 and relative_error(got[0], want[0]) < FP64_TOL
    for a, b in zip(got[1], want[1]):
        assert a.dtype == torch.float64 and relative_error(a, b) < FP64_TOL


def test_fp16_zero_gradient_bounds():
    """fp16 sizes its gradient scales from bounds on the gradients; a zero bound is no division by zero.
    All-zero hidden states bound dW by 0: dW is exactly 0, the loss and dX (not 0: (p - onehot) W) are the
    float64 reference's. Every valid target weighted 0 under "mean": the loss and every gradient are exactly
    0, the op's documented value for a zero total weight (F.cross_entropy's 0 / 0 is NaN; its numerator, the
    "sum" loss, and that loss's gradients are exactly 0)."""
    x, weight, target, _, class_weight = make_problem(12, 8, 50)
    xg, wg = torch.zeros_like(x).half().requires_grad_(), weight.half().requires_grad_()
    loss, (dx, dw) = grads_of(lambda a, b: fused_linear_cross_entropy(a, b, target, reduction="sum"), xg, wg)
    ref_loss, (ref_dx, ref_dw) = grads_of(
        lambda a, b: reference_loss(a, b, target, reduction="sum"), xg.double(), wg.double()
    )
    assert torch.equal(dw, torch.zeros_like(dw)) and torch.equal(ref_dw, torch.zeros_like(ref_dw))
    # logits of exactly 0 (the fp16 inputs are the reference's): the fp32 softmax's rounding
    assert relative_error(loss, ref_loss) < FP32_TOL
    # dX in fp16: the logit gradient and dX rounded to fp16 once each (half an fp16 epsilon each)
    assert dx.dtype == torch.float16 and relative_error(dx, ref_dx) < torch.finfo(torch.float16).eps

    zero = torch.zeros_like(class_weight)
    xg = x.half().requires_grad_()
    loss, grads = grads_of(lambda a, b: fused_linear_cross_entropy(a, b, target, class_weight=zero), xg, wg)
    ref_sum, ref_grads = grads_of(
        lambda a, b: reference_loss(a, b, target, class_weight=zero, reduction="sum"),
        xg.double(),
        wg.double(),
    )
    assert torch.isnan(reference_loss(x, weight, target, class_weight=zero))
    assert loss.item() == 0.0 and ref_sum.item() == 0.0
    for grad, ref_grad in zip(grads, ref_grads):
        assert torch.equal(grad, torch.zeros_like(grad)) and torch.equal(ref_grad, torch.zeros_like(ref_grad))


def test_negative_class_weights_mean_matches_reference():
    """A negative total target weight is a valid normalizer for "mean" (F.cross_entropy divides by it)."""
    x, weight, target, _, class_weight = make_problem(12, 8, 50)
    class_weight[target] = -1.0
    x.requires_grad_()
    weight.requires_grad_()
    got = grads_of(
        lambda x_, w_: fused_linear_cross_entropy(x_, w_, target, class_weight=class_weight), x, weight
    )
    want = grads_of(lambda x_, w_: reference_loss(x_, w_, target, class_weight=class_weight), x, weight)
    assert relative_error(got[0], want[0]) < FP32_TOL
    for a, b in zip(got[1], want[1]):
        assert relative_error(a, b) < FP32_TOL


def test_all_ignored_mean_with_class_weight_is_zero():
    x, weight, target, _, class_weight = make_problem(6, 8, 50)
    target.fill_(-100)
    loss = fused_linear_cross_entropy(x, weight, target, class_weight=class_weight)
    assert loss.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_input(reduction, dtype):
    x = torch.randn(0, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(20, 8, dtype=dtype, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long)
    loss = fused_linear_cross_entropy(x, weight, target, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    loss.sum().backward()
    assert x.grad.shape == (0, 8)
    assert torch.all(weight.grad == 0)


def test_non_contiguous_input_and_weight():
    x, weight, target, bias, class_weight = make_problem(40, 24, 100, seed=4)
    x_nc = torch.randn(24, 40).t()  # column-major view
    x_nc.copy_(x)
    w_nc = torch.randn(24, 100).t()
    w_nc.copy_(weight)
    assert not x_nc.is_contiguous() and not w_nc.is_contiguous()
    (loss, grads), (ref_loss, ref_grads) = run_case(
        x_nc, w_nc, target, bias, class_weight, FEATURES["all"], "mean", None, chunk_size=7
    )
    assert relative_error(loss, ref_loss) < FP32_TOL
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < FP32_TOL


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_propagate_like_reference(bad):
    x, weight, target, *_ = make_problem(10, 8, 30, ignore_frac=0.0)
    x[3, 2] = bad
    per_token = fused_linear_cross_entropy(x, weight, target, reduction="none", chunk_size=4)
    ref = reference_loss(x, weight, target, reduction="none")
    assert torch.equal(torch.isnan(per_token), torch.isnan(ref))
    assert torch.allclose(per_token[~torch.isnan(ref)], ref[~torch.isnan(ref)].float(), rtol=1e-5)
    assert torch.isnan(fused_linear_cross_entropy(x, weight, target)).item()


def test_deterministic():
    x, weight, target, bias, class_weight = make_problem(50, 16, 200, seed=5)

    def run():
        return run_case(
            x.clone(),
            weight.clone(),
            target,
            bias.clone(),
            class_weight,
            FEATURES["all"],
            "mean",
            None,
            chunk_size=8,
        )[0]

    (loss_a, grads_a), (loss_b, grads_b) = run(), run()
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


def test_chunk_size_does_not_change_result():
    x, weight, target, *_ = make_problem(64, 16, 300, seed=6)
    losses = [fused_linear_cross_entropy(x, weight, target, chunk_size=c) for c in (1, 7, 64, 1000, None)]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], rtol=1e-6, atol=0)


def test_default_chunk_size_follows_budget():
    from lightning_flce.engine import _MIN_TRITON_CHUNK_ROWS

    floor = lambda n, v, h, b: (n + v) * h * b  # noqa: E731 - dX + dW bytes
    # GPU: at least _MIN_TRITON_CHUNK_ROWS rows while the chunk's logits fit in the floor (dX + dW) ...
    assert default_chunk_size(16384, 32000, 4096, 2, large_chunks=True) == _MIN_TRITON_CHUNK_ROWS
    assert default_chunk_size(16384, 128256, 4096, 2, large_chunks=True) == _MIN_TRITON_CHUNK_ROWS
    # ... else as many whole 256-row blocks as fit in it: 8192 x 2304 x 256000 bf16 -> 2304 rows of 512000 B
    rows = default_chunk_size(8192, 256000, 2304, 2, large_chunks=True)
    assert rows % 256 == 0 and rows * 256000 * 2 <= floor(8192, 256000, 2304, 2) < (rows + 256) * 256000 * 2
    # the CUDA tests' shapes: 512 and 768 rows (see _FLOOR_LIMITED_ALIGN)
    assert default_chunk_size(4096, 32003, 512, 2, large_chunks=True) == 512
    assert default_chunk_size(3000, 50257, 768, 2, large_chunks=True) == 768
    # a quarter of the floor when that is more (many tokens, small vocabulary)
    rows = default_chunk_size(65536, 4000, 8192, 2, large_chunks=True)
    assert rows * 4000 * 2 <= floor(65536, 4000, 8192, 2) // 4 < (rows + 64) * 4000 * 2
    # CPU (PyTorch path): a quarter of the floor at 12 bytes per logit, at least 128 MiB
    rows = default_chunk_size(16384, 32000, 4096, 4, large_chunks=False)
    assert rows * 32000 * 12 <= floor(16384, 32000, 4096, 4) // 4 < (rows + 64) * 32000 * 12
    # tiny problems keep the 32 MiB minimum: 32 MiB / (1000 x 4 B) rows, capped at N
    assert default_chunk_size(100000, 1000, 8, 4, large_chunks=True) == 32 * 2**20 // 4000 // 64 * 64
    assert default_chunk_size(10, 32000, 4096, 2, large_chunks=True) == 10  # never beyond N
    assert default_chunk_size(0, 32000, 64, 4, large_chunks=False) == 1


def test_stats_match_reference():
    x, weight, target, bias, _ = make_problem(45, 12, 150, seed=7)
    out = fused_linear_cross_entropy_with_stats(x, weight, target, bias, softcap=5.0, chunk_size=8)
    logits = F.linear(x.double(), weight.double(), bias.double())
    logits = 5.0 * torch.tanh(logits / 5.0)
    valid = target != -100
    torch.testing.assert_close(out.lse.double(), torch.logsumexp(logits, -1) * valid, rtol=1e-6, atol=1e-6)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) * valid
    torch.testing.assert_close(out.entropy.double(), entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.correct, (logits.argmax(-1) == target) & valid)
    assert out.correct.dtype == torch.bool
    torch.testing.assert_close(
        out.loss.double(), reference_loss(x, weight, target, bias, softcap=5.0), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_per_token_outputs_take_the_target_shape(reduction):
    """[B, T, H] hidden states give "none" losses and statistics of shape [B, T] (as F.cross_entropy's "none"
    follows its target), equal to the flattened call's, and take a [B, T] grad_output."""
    x, weight, target, bias, _ = make_problem(None, 12, 150, lead_shape=(3, 7), seed=3)
    options = {"reduction": reduction, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "chunk_size": 8}
    x3, x2 = x.clone().requires_grad_(), x.reshape(21, 12).clone().requires_grad_()
    out3 = fused_linear_cross_entropy_with_stats(x3, weight, target, bias, **options)
    out2 = fused_linear_cross_entropy_with_stats(x2, weight, target.reshape(21), bias, **options)
    assert out3.loss.shape == (target.shape if reduction == "none" else ())
    for got, flat in zip(out3, out2):
        if got.dim():
            assert got.shape == target.shape
        torch.testing.assert_close(got.reshape(flat.shape), flat, rtol=0, atol=0)
    grad_output = torch.randn(out3.loss.shape)
    out3.loss.backward(grad_output)
    out2.loss.backward(grad_output.reshape(out2.loss.shape))
    torch.testing.assert_close(x3.grad.reshape(21, 12), x2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inside_activation_checkpointing(reduction, use_reentrant):
    """Under ``torch.utils.checkpoint`` the op's forward runs again in backward (where "mean" computes its
    gradients once more): the same gradients as without checkpointing, also for a layer before the op."""
    x, weight, target, *_ = make_problem(40, 16, 50, seed=4, dtype=torch.float64)
    proj = torch.nn.Linear(16, 16, dtype=torch.float64)

    def head_loss(x_, w_):
        return fused_linear_cross_entropy(proj(x_), w_, target, reduction=reduction, chunk_size=8)

    def checkpointed(x_, w_):
        return torch.utils.checkpoint.checkpoint(head_loss, x_, w_, use_reentrant=use_reentrant)

    got = grads_of(checkpointed, x.requires_grad_(), weight.requires_grad_())
    want = grads_of(head_loss, x, weight)
    proj_grads = []
    for fn in (checkpointed, head_loss):
        proj.zero_grad()
        grads_of(fn, x, weight)
        proj_grads.append(proj.weight.grad.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(proj_grads[0], proj_grads[1], rtol=0, atol=0)


def test_only_requested_gradients():
    """A frozen head (LoRA-style) gets no dW; a frozen input gets no dX."""
    x, weight, target, *_ = make_problem(20, 8, 40)
    x.requires_grad_()
    fused_linear_cross_entropy(x, weight, target).backward()
    assert x.grad is not None and weight.grad is None
    x.grad = None
    x.requires_grad_(False)
    weight.requires_grad_()
    fused_linear_cross_entropy(x, weight, target).backward()
    assert weight.grad is not None


def test_no_grad_forward_equals_training_forward():
    x, weight, target, *_ = make_problem(30, 8, 40)
    with torch.no_grad():
        eval_loss = fused_linear_cross_entropy(x, weight, target)
    train_loss = fused_linear_cross_entropy(x.requires_grad_(), weight, target)
    assert torch.equal(eval_loss, train_loss.detach())


def test_autocast_bf16_matches_autocast_reference():
    """Under autocast (Lightning's bf16-mixed): bf16 hidden states, fp32 weight -> fp32 weight grad."""
    x, weight, target, bias, _ = make_problem(64, 32, 200, seed=8)
    hidden = x.bfloat16().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, w, target, b, chunk_size=16)
    loss.backward()
    assert (
        w.grad.dtype == torch.float32
        and b.grad.dtype == torch.float32
        and hidden.grad.dtype == torch.bfloat16
    )

    hidden_ref = x.bfloat16().requires_grad_()
    w_ref = weight.clone().requires_grad_()
    b_ref = bias.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden_ref, w_ref, b_ref)
    F.cross_entropy(logits.float(), target).backward()
    ref_loss = reference_loss(x.bfloat16(), weight.bfloat16(), target, bias.bfloat16())
    # Same bf16 GEMM operands as the autocast reference: within bf16 rounding of each other.
    assert relative_error(loss, ref_loss) < 1e-3
    for got, want in ((hidden.grad, hidden_ref.grad), (w.grad, w_ref.grad), (b.grad, b_ref.grad)):
        assert relative_error(got, want) < 1e-2


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_fp32_hidden_states_keep_grad_input_in_gemm_dtype(autocast_dtype):
    """fp32 hidden states under autocast (a final norm's output under Lightning's "*-mixed"): forward keeps dX
    in the GEMM's dtype, whose values it holds anyway (half the memory at forward's peak), and backward widens
    it with grad_output. (An fp64 accumulator, which the public API refuses for these GEMMs, would run dX's
    GEMM in fp64: there dX is kept in fp32.)"""
    x, weight, target, bias, _ = make_problem(64, 32, 200, seed=10)
    for accum, saved_dtype in ((None, autocast_dtype), (torch.float64, torch.float32)):
        args = op_args(
            x, weight, target, bias, compute_dtype=autocast_dtype, accum_dtype=accum, chunk_size=16
        )
        saved_dx = torch.ops.lightning_flce.flce_forward.default(*args)[4]
        assert saved_dx.dtype == saved_dtype

    def op(hidden, w, b):
        with torch.autocast("cpu", dtype=autocast_dtype):
            return fused_linear_cross_entropy(hidden, w, target, b, chunk_size=16)

    grad_output = torch.tensor(3.0)
    got = grads_of(
        op, x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), grad_output=grad_output
    )
    # The reference in float64 on the GEMM operands as autocast rounds them.
    rounded = [t.to(autocast_dtype).double() for t in (x, weight, bias)]
    want = grads_of(
        lambda *ts: reference_loss(ts[0], ts[1], target, ts[2]), *rounded, grad_output=grad_output
    )
    # Logits and dX are rounded to the GEMM dtype: a few units of its epsilon (bf16 2^-8, fp16 2^-11).
    tol = 4 * torch.finfo(autocast_dtype).eps
    assert_matches_reference(got, (want[0].float(), [g.float() for g in want[1]]), torch.float32, tol)


@pytest.mark.parametrize("autocast", [True, False])
def test_auto_accumulator_follows_gemm_dtype(monkeypatch, autocast):
    """The "auto" accumulator: from the GEMMs' dtype, not the weight's storage: an fp32 weight under
    bf16 autocast accumulates in fp32 (fp64 there would run every dW/dX GEMM in fp64: 10x slower on an
    H100); without autocast, fp32 GEMMs get fp64 on GPUs with full-rate fp64 (forced here on the CPU)."""
    import lightning_flce.accumulate as accumulation
    import lightning_flce.engine as op

    accumulator_dtypes = set()

    def spy(grad_weight, grad_logits, x, **kwargs):
        accumulator_dtypes.add((grad_weight.dtype, grad_logits.dtype))
        return accumulate(grad_weight, grad_logits, x, **kwargs)

    accumulate = accumulation.accumulate_grad_weight
    monkeypatch.setattr(accumulation, "accumulate_grad_weight", spy)
    monkeypatch.setattr(op, "_has_full_rate_fp64", lambda device: True)
    x, weight, target, *_ = make_problem(64, 32, 200, seed=9)
    hidden = (x.bfloat16() if autocast else x).requires_grad_()
    w = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused_linear_cross_entropy(hidden, w, target, chunk_size=16).backward()
    assert w.grad.dtype == torch.float32
    if autocast:
        assert accumulator_dtypes == {(torch.float32, torch.bfloat16)}
    else:
        assert accumulator_dtypes == {(torch.float64, torch.float32)}


def test_flop_counter_reports_model_flops():
    from torch.utils.flop_counter import FlopCounterMode

    n_rows, hidden, vocab = 24, 16, 50
    x, weight, target, *_ = make_problem(n_rows, hidden, vocab)
    x.requires_grad_()
    weight.requires_grad_()
    gemm = 2 * n_rows * hidden * vocab
    for reduction in ("mean", "none"):
        with FlopCounterMode(display=False) as counter:
            fused_linear_cross_entropy(x, weight, target, reduction=reduction).sum().backward()
        assert counter.get_total_flops() == 3 * gemm
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fused_linear_cross_entropy(x, weight, target)
    assert counter.get_total_flops() == gemm


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_lightning_measure_flops_counts_the_head(device):
    """Lightning's measure_flops (what ThroughputMonitor uses; it recommends meta-device models) sees
    6*N*H*V for the head's fwd+bwd and 2*N*H*V forward-only."""
    from lightning.fabric.utilities.throughput import measure_flops

    n_rows, hidden, vocab = 32, 16, 80
    with torch.device(device):
        head = torch.nn.Linear(hidden, vocab, bias=False)
        x = torch.randn(n_rows, hidden, requires_grad=True)
        target = torch.randint(0, vocab, (n_rows,))

    def forward():
        return fused_linear_cross_entropy(x, head.weight, target)

    assert measure_flops(head, forward, loss_fn=lambda loss: loss) == 6 * n_rows * hidden * vocab
    with torch.no_grad():  # inference: no gradient work happens in forward
        assert measure_flops(head, forward) == 2 * n_rows * hidden * vocab


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-chunk", "chunks-of-8"])
def test_torch_compile_fullgraph_matches_eager(dtype, chunk_size):
    """The op is one opaque node: a compiled model around it has no graph break (fp16: the forward's
    extra output, the inverse gradient scales, has the shape the fake implementation promises; bf16/fp16
    over several chunks: the saved dW is the fp32 accumulator, cast by backward's own op; fp64: the fake
    implementation's fp64 loss)."""
    x, weight, target, bias, _ = make_problem(32, 16, 64, seed=9, dtype=dtype)
    proj = torch.nn.Linear(16, 16, dtype=dtype)

    def model(inp, w, b):
        return fused_linear_cross_entropy(
            torch.relu(proj(inp)), w, target, b, label_smoothing=0.1, chunk_size=chunk_size
        )

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got_loss, got_grads = grads_of(
        compiled, x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()
    )
    want_loss, want_grads = grads_of(model, x, weight, bias)
    torch.testing.assert_close(got_loss, want_loss)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_permuted_input_and_weight(reduction, monkeypatch, tmp_path):
    """Sequence-first hidden states transposed to batch-first, a head stored [H, V] and passed as ``.t()``:
    the fake implementations promise contiguous gradients, as the real ones return (inductor asserts the
    real strides against the fake ones; a fresh cache, whose keys do not cover the fake's code)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(13)
    hidden_seq_first = torch.randn(5, 3, 16, generator=gen)
    weight_t = torch.randn(16, 64, generator=gen)
    target = torch.randint(0, 64, (3, 5), generator=gen)

    def model(h, wt):
        return fused_linear_cross_entropy(h.transpose(0, 1), wt.t(), target, reduction=reduction).sum()

    compiled = torch.compile(model, fullgraph=True)
    got_loss, got_grads = grads_of(compiled, hidden_seq_first.requires_grad_(), weight_t.requires_grad_())
    want_loss, want_grads = grads_of(model, hidden_seq_first, weight_t)
    torch.testing.assert_close(got_loss, want_loss)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want)


def test_torch_compile_dynamic_shapes_match_eager():
    """dynamic=True: one graph for several token counts (the fake implementation's shapes are symbolic),
    bf16 over several chunks (the saved fp32 accumulator and backward's cast op)."""
    weight = torch.randn(64, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(12))

    def model(inp, w, t):
        return fused_linear_cross_entropy(torch.relu(inp), w, t, chunk_size=8)

    compiled = torch.compile(model, backend="aot_eager", dynamic=True, fullgraph=True)
    for n_rows in (32, 48, 40):
        x, _, target, _, _ = make_problem(n_rows, 16, 64, seed=n_rows, dtype=torch.bfloat16)
        inputs = (x.requires_grad_(), weight.requires_grad_(), target)
        got_loss, got_grads = grads_of(compiled, *inputs)
        want_loss, want_grads = grads_of(model, *inputs)
        torch.testing.assert_close(got_loss, want_loss)
        for got, want in zip(got_grads[:2], want_grads[:2]):
            torch.testing.assert_close(got, want)


def test_default_chunks_are_balanced_over_the_valid_rows():
    from lightning_flce.engine import balanced_chunk_rows

    # 8192 rows at most 2304 apiece: 4 x 2048 (3 x 2304 + 1280 before)
    assert balanced_chunk_rows(8192, 2304, 256) == 2048
    # 10% ignored: 7373 valid rows in 4 chunks of 2048 (the last 1229), not 3 x 2304 + 461
    assert balanced_chunk_rows(7373, 2304, 256) == 2048
    # never above the maximum, whatever the alignment
    assert balanced_chunk_rows(3300, 1600, 256) == 1280  # 3 chunks: 1100 -> 1280
    assert balanced_chunk_rows(3300, 1200, 512) == 1200  # 1100 -> 1536 > 1200: the maximum
    assert balanced_chunk_rows(100, 4096, 256) == 100  # one chunk
    assert balanced_chunk_rows(0, 4096, 256) == 4096
    for n_rows in range(1, 3000, 37):
        rows = balanced_chunk_rows(n_rows, 512, 64)
        assert rows <= 512 and -(-n_rows // rows) == -(-n_rows // 512)  # same number of chunks


def test_default_chunk_size_is_balanced_in_the_op(monkeypatch):
    """The op runs the balanced size: 3000 rows under a 1088-row maximum -> 1024, 1024, 952 (CPU: 64-row
    steps), not 1088, 1088, 824."""
    import lightning_flce.engine as op

    monkeypatch.setattr(op, "default_chunk_size", lambda *args, **kwargs: 1088)
    seen = []
    real_mm = torch.mm

    def spy_mm(a, b, *args, **kwargs):
        if a.dim() == 2 and b.dim() == 2 and b.shape[0] == 16 and b.shape[1] == 300:  # x_c @ W.T
            seen.append(a.shape[0])
        return real_mm(a, b, *args, **kwargs)

    x, weight, target, *_ = make_problem(3000, 16, 300, ignore_frac=0.0, seed=3)
    monkeypatch.setattr(torch, "mm", spy_mm)
    fused_linear_cross_entropy(x.requires_grad_(), weight.requires_grad_(), target)
    assert seen == [1024, 1024, 952], seen


def test_chunk_buffer_released_before_the_dw_cast(monkeypatch):
    """With an fp32 accumulator, dW's rounding to the weight's dtype ends the chunk loop (in the backward of
    "none", which recomputes the chunks); the chunk's logits buffer must be gone by then, and the rounding
    writes dW into the accumulator's own memory (its first row block) instead of allocating it, so the peak
    holds the accumulator alone: not accumulator + output (+ buffer)."""
    import gc
    import weakref

    import lightning_flce.accumulate as accumulation

    x, weight, target, *_ = make_problem(600, 16, 300, ignore_frac=0.0, seed=4)
    x, weight = x.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    buffers, alive_at_cast, heads = [], [], []
    real_empty, real_round = torch.empty, accumulation.round_into_head_

    def spy_empty(*size, **kwargs):
        tensor = real_empty(*size, **kwargs)
        if tensor.dim() == 2 and tensor.shape[1] == 300 and tensor.dtype == torch.bfloat16:
            buffers.append(weakref.ref(tensor))
        return tensor

    def spy_round(head, tail, dtype, *args, **kwargs):
        gc.collect()
        alive_at_cast.append([ref() is not None for ref in buffers])
        heads.append((head.dtype, head.shape[0] + tail.shape[0], head.untyped_storage().data_ptr()))
        return real_round(head, tail, dtype, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy_empty)
    monkeypatch.setattr(accumulation, "round_into_head_", spy_round)
    fused_linear_cross_entropy(x, weight, target, chunk_size=128, reduction="none").sum().backward()
    # One buffer in forward (the loss), one in backward's recompute.
    assert len(buffers) == 2 and alive_at_cast == [[False, False]], (len(buffers), alive_at_cast)
    assert heads == [(torch.float32, 300, weight.grad.untyped_storage().data_ptr())]
    # the head's rows: half of V's rounded up to 8 (152 of 300 here), a few rows' bytes more than dW
    weight_bytes = weight.numel() * weight.element_size()
    assert weight_bytes <= weight.grad.untyped_storage().nbytes() <= weight_bytes + 8 * 16 * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("masked_to_one_chunk", [False, True], ids=["4-chunks", "valid-rows-in-1-chunk"])
def test_wide_dw_accumulator_is_cast_once_in_backward(dtype, masked_to_one_chunk):
    """ "mean"/"sum" keep dW's fp32 accumulator for backward, which casts it with grad_output folded in: dW
    is rounded to the weight's dtype once, as naive's is, also for a grad_output that is not a power of
    two (a cast in forward and a scaling in backward rounded it twice: 1.21x (bf16) and 1.23x (fp16)
    naive's error here). The accumulator's dtype follows the shape's chunk count (what the fake
    implementation knows), so a batch whose valid rows fit one chunk keeps an fp32 one too; with only 32
    valid rows the two one-rounding errors differ by up to 1.3x with the seed, hence 1.5x there (a wrong
    or stale accumulator is off by O(1))."""
    x, weight, target, *_ = make_problem(128, 48, 1000, dtype=dtype, ignore_frac=0.1, seed=11)
    if masked_to_one_chunk:
        target[32:] = -100
    forward = torch.ops.lightning_flce.flce_forward(
        *op_args(x, weight, target, None, compute_dtype=dtype, chunk_size=32, need_grad_bias=False)
    )
    assert forward[5].dtype == torch.float32

    def op(x_, w_):
        return fused_linear_cross_entropy(x_, w_, target, chunk_size=32)

    grad_output = torch.tensor(0.7 * 2**12 if dtype == torch.float16 else 0.7)  # fp16: a loss scale
    _, (_, got) = grads_of(op, x.requires_grad_(), weight.requires_grad_(), grad_output=grad_output)
    _, (_, want) = grads_of(
        lambda x_, w_: reference_loss(x_, w_, target), x.double(), weight.double(), grad_output=grad_output
    )
    _, (_, naive) = grads_of(lambda x_, w_: unfused_loss(x_, w_, target), x, weight, grad_output=grad_output)
    assert got.dtype == dtype
    assert relative_error(got, want) <= (1.5 if masked_to_one_chunk else 1.1) * relative_error(naive, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False), (False, False, False)])
@pytest.mark.parametrize("chunk_size", [0, 8], ids=["one-chunk", "chunks-of-8"])
def test_custom_ops_fake_implementations_match(dtype, reduction, needs, chunk_size):
    """torch.library.opcheck: schema, and every output's metadata from the fake implementation (what
    torch.compile traces with) equals the real one's, e.g. fp16's extra inverse-scales output, the
    saved dW accumulator's dtype (fp32 for bf16/fp16 over several chunks) and fp64's fp64 loss and stats."""
    x, weight, target, bias, _ = make_problem(32, 16, 64, seed=10, dtype=dtype)
    target[8:] = -100  # the valid rows fit one chunk; the shape has four
    ops = torch.ops.lightning_flce
    need_grads = dict(zip(("need_grad_input", "need_grad_weight", "need_grad_bias"), needs))
    forward_args = op_args(
        x,
        weight,
        target,
        bias,
        reduction=reduction,
        label_smoothing=0.1,
        lse_square_scale=1e-3,
        compute_dtype=dtype,
        chunk_size=chunk_size,
        compute_stats=True,
        **need_grads,
    )
    # Not "test_aot_dispatch_dynamic": it differentiates through every output, and the saved-gradient
    # outputs are scaled in place by backward, which AOTAutograd refuses for a graph output ("Node ... was
    # invalid, but is output"). The public wrapper never returns them; test_torch_compile_* compile it.
    checks = ("test_schema", "test_faketensor")
    loss_dtype = torch.promote_types(dtype, torch.float32)
    torch.library.opcheck(ops.flce_forward.default, tuple(forward_args), test_utils=checks)
    if reduction == "none":
        grad_loss = torch.randn(32, dtype=loss_dtype)
        backward_args = BackwardArgs(grad_loss, *forward_args)
        torch.library.opcheck(ops.flce_backward.default, tuple(backward_args), test_utils=checks)
    forward_out = ops.flce_forward.default(*forward_args)
    assert forward_out[0].dtype == forward_out[1].dtype == loss_dtype
    saved_grad_weight = forward_out[5]
    if reduction == "mean" and needs[1] and dtype in (torch.float16, torch.bfloat16):
        assert saved_grad_weight.dtype == (torch.float32 if chunk_size else dtype)
        inverse_scales = torch.tensor([1.0, 0.5, 1.0]) if dtype == torch.float16 else torch.empty(0)
        cast_args = (saved_grad_weight, torch.tensor(3.0), inverse_scales, 1, dtype)
        torch.library.opcheck(ops.flce_cast_grad.default, cast_args, test_utils=checks)
