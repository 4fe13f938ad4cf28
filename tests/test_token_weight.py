"""Per-token loss weights (``token_weight=``) against a float64 reference, for every reduction with every
other option; the fast path (gradients in forward) for "mean"/"sum"; bad weights refused before any kernel."""

from __future__ import annotations

import pytest
import torch
from reference import assert_matches_reference, grads_of, reference_loss

from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats

N, H, V = 50, 16, 97
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 5.0},
    "class_weight": {"class_weight": "random"},
    "all": {"label_smoothing": 0.15, "lse_square_scale": 1e-3, "softcap": 4.0, "class_weight": "random"},
}


def problem(dtype=torch.float32, seed=0, shape=(N,)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5 * 2).to(dtype)
    bias = torch.randn(V, generator=gen).to(dtype)
    target = torch.randint(0, V, shape, generator=gen)
    target[torch.rand(shape, generator=gen) < 0.2] = -100
    # advantages and soft masks: negative, zero and > 1 weights
    token_weight = torch.rand(shape, generator=gen) * 3 - 1
    token_weight.view(-1)[3] = 0.0
    class_weight = torch.rand(V, generator=gen) + 0.5
    return x, weight, bias, target, token_weight, class_weight


def resolved(options: dict, class_weight: torch.Tensor) -> dict:
    return {k: (class_weight if v == "random" else v) for k, v in options.items()}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_token_weight_matches_float64_reference(reduction, name, with_bias):
    """fp32 inputs over 4 chunks: loss, dX, dW, d bias within fp32 rounding of the float64 reference."""
    x, weight, bias, target, token_weight, class_weight = problem()
    options = resolved(OPTIONS[name], class_weight)
    b = bias if with_bias else None

    def op(x_, w_, b_):
        return fused_linear_cross_entropy(
            x_, w_, target, b_, reduction=reduction, token_weight=token_weight, chunk_size=16, **options
        )

    def ref(x_, w_, b_):
        return reference_loss(
            x_, w_, target, b_, reduction=reduction, token_weight=token_weight.double(), **options
        )

    grad_output = torch.randn(N) if reduction == "none" else torch.tensor(0.7)
    got = grads_of(
        op,
        x.requires_grad_(),
        weight.requires_grad_(),
        None if b is None else b.requires_grad_(),
        grad_output=grad_output,
    )
    want = grads_of(
        ref, x.double(), weight.double(), None if b is None else b.double(), grad_output=grad_output
    )
    want = (want[0].float(), [None if g is None else g.float() for g in want[1]])
    # fp32 GEMMs over H = 16 and a softmax over V = 97 in fp32: a few ulps of fp32 relative
    assert_matches_reference(got, want, torch.float32, 2e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_weight_float64_is_exact(reduction):
    """fp64 inputs run the fp64 softmax: equal to the reference to fp64 rounding (the weights enter exactly)."""
    x, weight, bias, target, token_weight, class_weight = problem(torch.float64, seed=1, shape=(5, 9))
    options = resolved(OPTIONS["all"], class_weight.double())
    tw = token_weight.double()
    got = grads_of(
        lambda x_, w_: fused_linear_cross_entropy(
            x_, w_, target, reduction=reduction, token_weight=tw, chunk_size=8, **options
        ),
        x.requires_grad_(),
        weight.requires_grad_(),
    )
    want = grads_of(
        lambda x_, w_: reference_loss(x_, w_, target, reduction=reduction, token_weight=tw, **options),
        x,
        weight,
    )
    assert_matches_reference(got, want, torch.float64, 1e-12)


def test_unit_weights_equal_the_unweighted_loss_bitwise():
    """Weights of 1 multiply each row's scale by 1: the same loss and gradients as no weights."""
    x, weight, _, target, _, _ = problem(seed=2)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    plain = grads_of(lambda x_, w_: fused_linear_cross_entropy(x_, w_, target, chunk_size=16), x, weight)
    ones = torch.ones(N)
    weighted = grads_of(
        lambda x_, w_: fused_linear_cross_entropy(x_, w_, target, token_weight=ones, chunk_size=16), x, weight
    )
    assert torch.equal(plain[0], weighted[0])
    for a, b in zip(plain[1], weighted[1]):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_mean_keeps_the_unweighted_denominator():
    """ "mean" of weights w equals the "sum" of weights w over the number of non-ignored tokens."""
    x, weight, _, target, token_weight, _ = problem(seed=3)
    mean = fused_linear_cross_entropy(x, weight, target, token_weight=token_weight)
    total = fused_linear_cross_entropy(x, weight, target, token_weight=token_weight, reduction="sum")
    torch.testing.assert_close(mean, total / (target != -100).sum(), rtol=1e-6, atol=0)


def test_token_weight_gets_no_gradient_and_stats_are_unweighted():
    x, weight, _, target, token_weight, _ = problem(seed=4)
    weighted = fused_linear_cross_entropy_with_stats(x, weight, target, token_weight=token_weight)
    plain = fused_linear_cross_entropy_with_stats(x, weight, target)
    for name in ("lse", "correct", "entropy"):
        assert torch.equal(getattr(weighted, name), getattr(plain, name)), name


def test_mean_sum_weighted_runs_the_fast_path(monkeypatch):
    """ "mean"/"sum" with weights compute the gradients in forward: backward never recomputes the chunks."""
    import lightning_flce.op as op

    def refuse(*args):
        raise AssertionError("backward recomputed the chunks")

    monkeypatch.setattr(op, "_backward_recompute", refuse)
    x, weight, _, target, token_weight, _ = problem(seed=5)
    x.requires_grad_()
    fused_linear_cross_entropy(x, weight, target, token_weight=token_weight, reduction="sum").backward()
    assert x.grad is not None


@pytest.mark.parametrize(
    ("make_weight", "error", "match"),
    [
        (lambda t: torch.ones(t.numel() + 1), ValueError, "token_weight must have the target's shape"),
        (lambda t: torch.ones(t.shape, dtype=torch.int64), TypeError, "token_weight must be floating point"),
        (lambda t: torch.ones(t.shape, device="meta"), ValueError, "token_weight is on meta"),
        (lambda t: torch.ones(t.shape, requires_grad=True), ValueError, "token_weight.detach"),
        (lambda t: [1.0] * t.numel(), TypeError, "token_weight must be a tensor"),
    ],
)
def test_bad_token_weight_is_refused_before_any_kernel(make_weight, error, match):
    x, weight, _, target, _, _ = problem(seed=6)
    x.requires_grad_()
    with pytest.raises(error, match=match):
        fused_linear_cross_entropy(x, weight, target, token_weight=make_weight(target))
    assert x.grad is None


def test_token_weight_under_bf16_autocast_is_as_accurate_as_unfused():
    """bf16 GEMMs: the weighted loss and gradients within bf16 rounding of the float64 reference, no worse
    than the unfused bf16 loss times its weights."""
    x, weight, _, target, token_weight, _ = problem(seed=7)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    got = grads_of(
        lambda x_, w_: fused_linear_cross_entropy(
            x_.bfloat16(), w_.bfloat16(), target, token_weight=token_weight
        ),
        x,
        weight,
    )
    want = grads_of(
        lambda x_, w_: reference_loss(x_, w_, target, token_weight=token_weight.double()),
        x.double(),
        weight.double(),
    )
    tol = 8 * torch.finfo(torch.bfloat16).eps
    assert abs(float(got[0]) - float(want[0])) <= tol * abs(float(want[0])) + 1e-3
    for g, w in zip(got[1], want[1]):
        assert (g.double() - w).norm() <= tol * w.norm()
