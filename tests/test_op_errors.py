"""Bad input: clear Python exceptions before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from lightning_flce import fused_linear_cross_entropy

N, H, V = 8, 6, 20


def _args(**overrides):
    args = {
        "input": torch.randn(N, H),
        "weight": torch.randn(V, H),
        "target": torch.randint(0, V, (N,)),
    }
    args.update(overrides)
    return args


def _call(kwargs=None, **overrides):
    return fused_linear_cross_entropy(**_args(**overrides), **(kwargs or {}))


@pytest.mark.parametrize("bad_target", [V, V + 5, -1, -7])
def test_out_of_range_target(bad_target):
    target = torch.randint(0, V, (N,))
    target[3] = bad_target
    with pytest.raises(ValueError, match=r"outside \[0, 20\)"):
        _call(target=target)


def test_ignore_index_is_not_out_of_range():
    target = torch.randint(0, V, (N,))
    target[2] = -1
    loss = fused_linear_cross_entropy(torch.randn(N, H), torch.randn(V, H), target, ignore_index=-1)
    assert torch.isfinite(loss)


def test_out_of_range_check_runs_before_any_gradient():
    x = torch.randn(N, H, requires_grad=True)
    target = torch.full((N,), V)
    with pytest.raises(ValueError):
        fused_linear_cross_entropy(x, torch.randn(V, H), target)
    assert x.grad is None


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"weight": torch.randn(V, H + 1)}, ValueError, "hidden size mismatch"),
        ({"weight": torch.randn(V)}, ValueError, "weight"),
        ({"target": torch.randint(0, V, (N + 1,))}, ValueError, "target shape"),
        ({"target": torch.randint(0, V, (2, N // 2))}, ValueError, "target shape"),
        ({"target": torch.rand(N)}, TypeError, "integer"),
        ({"target": torch.ones(N, dtype=torch.bool)}, TypeError, "integer"),
        ({"input": torch.randint(0, 3, (N, H))}, TypeError, "not supported"),
        ({"input": torch.randn(N, H, dtype=torch.bfloat16)}, TypeError, "differs from input dtype"),
        ({"input": torch.randn(N, H, device="meta")}, ValueError, "is on cpu but input is on meta"),
        ({"bias": torch.randn(V + 1)}, ValueError, "bias"),
        ({"bias": torch.randn(V, dtype=torch.float64)}, TypeError, "bias dtype"),
        ({"input": torch.randn(N, 0), "weight": torch.randn(V, 0)}, ValueError, "must be non-empty"),
        ({"weight": torch.randn(0, H)}, ValueError, "must be non-empty"),
        ({"weight": torch.randn(V, H).to_sparse()}, TypeError, "dense"),
    ],
    ids=[
        "H-mismatch",
        "weight-1d",
        "target-length",
        "target-shape",
        "float-target",
        "bool-target",
        "int-input",
        "dtype-mismatch",
        "device-mismatch",
        "bias-shape",
        "bias-dtype",
        "hidden-0",
        "vocab-0",
        "sparse-weight",
    ],
)
def test_bad_tensors(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"class_weight": torch.rand(V - 1)}, ValueError, "class_weight must be"),
        ({"class_weight": torch.ones(V, dtype=torch.long)}, TypeError, "floating point"),
        ({"label_smoothing": -0.1}, ValueError, "label_smoothing"),
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": -3.0}, ValueError, "softcap"),
        ({"reduction": "avg"}, ValueError, "reduction"),
        ({"lse_square_scale": -1.0}, ValueError, "lse_square_scale"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"impl": "cuda"}, ValueError, "impl"),
        ({"accum_dtype": 32}, TypeError, "accum_dtype must be a torch.dtype"),
        # a dtype's name is accepted (YAML); an unknown one names the choices
        ({"accum_dtype": "fp32"}, ValueError, "accum_dtype must be a torch.dtype, one of"),
        ({"lse_square_scale": float("nan")}, ValueError, "lse_square_scale"),
        ({"lse_square_scale": float("inf")}, ValueError, "lse_square_scale"),
        ({"softcap": float("inf")}, ValueError, "softcap"),
        ({"chunk_size": 2.5}, ValueError, "chunk_size"),
        ({"chunk_size": True}, ValueError, "chunk_size"),
        ({"chunk_size": torch.tensor(-4)}, ValueError, "chunk_size"),
        ({"accum_dtype": torch.float16}, ValueError, "torch.float32, torch.float64 or the weight's dtype"),
        ({"ignore_index": -100.7}, TypeError, "ignore_index"),
        ({"ignore_index": 2**64}, ValueError, "ignore_index must fit in int64"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp64_accumulator_of_half_precision_gemms_raises(dtype):
    """No GEMM widens fp16/bf16 operands to fp64: an fp64 dW accumulator would sum products rounded to 16 bits
    (less accurate than fp32's), so it is refused, under autocast as for half-precision inputs."""
    args = _args()
    with pytest.raises(ValueError, match="use accum_dtype=torch.float32"), torch.autocast("cpu", dtype=dtype):
        fused_linear_cross_entropy(**args, accum_dtype=torch.float64)
    half = {**args, "input": args["input"].to(dtype), "weight": args["weight"].to(dtype)}
    with pytest.raises(ValueError, match="needs fp32 or fp64 GEMMs"):
        fused_linear_cross_entropy(**half, accum_dtype=torch.float64)


def test_class_weight_requiring_grad_raises():
    """As F.cross_entropy's weight, class_weight gets no gradient: refused rather than left silently without one
    (no_grad and a detached copy are fine)."""
    args = _args()
    class_weight = torch.rand(args["weight"].shape[0], requires_grad=True)
    with pytest.raises(ValueError, match="class_weight.detach"):
        fused_linear_cross_entropy(**args, class_weight=class_weight)
    with torch.no_grad():
        fused_linear_cross_entropy(**args, class_weight=class_weight)
    fused_linear_cross_entropy(**args, class_weight=class_weight.detach())


def test_chunk_size_takes_any_integer_type():
    """Integer types other than int (numpy's, a 0-d integer tensor) are chunk sizes, as ignore_index takes them."""
    args = _args()
    expected = fused_linear_cross_entropy(**args, chunk_size=4)
    for chunk_size in (torch.tensor(4), pytest.importorskip("numpy").int64(4)):
        torch.testing.assert_close(fused_linear_cross_entropy(**args, chunk_size=chunk_size), expected)


@pytest.mark.parametrize(
    ("dtype", "vocab", "targets", "ignore_index"),
    [
        (torch.uint8, 200, [156, 156, 7, 100, 0, 199], -100),  # -100 is 156 in uint8
        (torch.uint8, 256, [1, 2, 3, 255, 0, 128], -100),  # all of uint8 is in range
        (torch.int8, 200, [-100, 5, 127, -100, 0, 64], -100),
        (torch.int16, 40000, [32000, -100, 3, 32767, 0, 12], -100),
        (torch.int32, 50, [0, 2, 3, 49, 0, 1], 2**32),  # 2**32 is 0 in int32
    ],
    ids=["uint8-wraps-ignore-index", "uint8-full-range", "int8", "int16", "int32-big-ignore-index"],
)
def test_narrow_integer_targets_are_class_indices(dtype, vocab, targets, ignore_index):
    """Targets are compared as int64 values, never in their own (wrapping) dtype."""
    from reference import grads_of, reference_loss, relative_error

    x, weight = torch.randn(len(targets), H, dtype=torch.float64), torch.randn(vocab, H, dtype=torch.float64)
    target = torch.tensor(targets, dtype=dtype)
    class_weight = torch.rand(vocab, dtype=torch.float64) + 0.5
    for kwargs in ({}, {"class_weight": class_weight, "label_smoothing": 0.1}):
        got = grads_of(
            lambda x_, w_, kw=kwargs: fused_linear_cross_entropy(
                x_, w_, target, ignore_index=ignore_index, **kw
            ),
            x.clone().requires_grad_(),
            weight.clone().requires_grad_(),
        )
        want = grads_of(
            lambda x_, w_, kw=kwargs: reference_loss(x_, w_, target.long(), ignore_index=ignore_index, **kw),
            x.clone().requires_grad_(),
            weight.clone().requires_grad_(),
        )
        # fp64 throughout (test_op.py's FP64_TOL); a misread target is O(1).
        assert relative_error(got[0], want[0]) < 1e-12
        for a, b in zip(got[1], want[1]):
            assert relative_error(a, b) < 1e-12


def test_second_backward_through_mean_or_sum_is_refused():
    """ "mean"/"sum" hand out the gradients computed in forward once (they are scaled in place); a second
    backward (retain_graph) raises a clear error instead of scaling them again. "none" recomputes."""
    x = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    target = torch.randint(0, V, (N,))
    for reduction in ("mean", "sum"):
        loss = fused_linear_cross_entropy(x, weight, target, reduction=reduction)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward ran twice"):
            loss.backward()
    x.grad = weight.grad = None
    loss = fused_linear_cross_entropy(x, weight, target, reduction="none").sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_double_backward_is_refused(dtype):
    """create_graph=True (a gradient penalty through the head) would get "mean"/"sum" gradients that carry
    no graph, and the penalty's term through the head would vanish silently: refused with a clear error.
    ("none" recomputes in backward: its gradients can be taken with create_graph=True, and differentiating
    them again raises the same error.)"""
    x = torch.randn(N, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    target = torch.randint(0, V, (N,))
    for reduction in ("mean", "sum"):
        loss = fused_linear_cross_entropy(x, weight, target, reduction=reduction, chunk_size=4)
        with pytest.raises(RuntimeError, match="does not support double backward"):
            torch.autograd.grad(loss, weight, create_graph=True)
    loss = fused_linear_cross_entropy(x, weight, target, reduction="none").sum()
    (grad_weight,) = torch.autograd.grad(loss, weight, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        grad_weight.square().sum().backward()


def test_empty_partitioned_weight_is_explained():
    """DeepSpeed ZeRO-3 leaves a partitioned parameter as a 1-D tensor with numel 0 outside its module's forward."""
    with pytest.raises(ValueError, match="ZeRO-3"):
        _call(weight=torch.empty(0))


def test_triton_impl_on_cpu_without_interpreter_is_refused():
    with pytest.raises(RuntimeError, match="impl='triton'"):
        _call({"impl": "triton"})


def test_stats_variants_show_and_check_the_loss_options():
    """help() of the ``*_with_stats`` functions lists the loss's options, and a misspelled one names them."""
    import inspect

    from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
    from lightning_flce.parallel import (
        vocab_parallel_fused_linear_cross_entropy,
        vocab_parallel_fused_linear_cross_entropy_with_stats,
    )

    for loss, with_stats in [
        (fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats),
        (vocab_parallel_fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy_with_stats),
    ]:
        assert inspect.signature(with_stats).parameters == inspect.signature(loss).parameters
    x, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(
        TypeError, match=r"fused_linear_cross_entropy_with_stats\(\) got unexpected .*\['chunk'\]"
    ):
        fused_linear_cross_entropy_with_stats(x, w, t, chunk=2)
    assert fused_linear_cross_entropy_with_stats(x, w, t, chunk_size=2).lse.shape == (4,)


def test_torch_func_transforms_as_documented():
    """docs/op.md: torch.func's autograd transforms raise (torch's error for a custom op's autograd), vmap runs
    one call per sample (torch's fallback) and gives each sample's loss."""
    x = torch.randn(3, N, H, dtype=torch.float64)
    weight = torch.randn(V, H, dtype=torch.float64)
    target = torch.randint(0, V, (N,))
    with pytest.raises(RuntimeError):
        torch.func.grad(lambda w: fused_linear_cross_entropy(x[0], w, target))(weight)
    losses = torch.vmap(lambda xs: fused_linear_cross_entropy(xs, weight, target))(x)
    expected = torch.stack([torch.nn.functional.cross_entropy(xs @ weight.T, target) for xs in x])
    torch.testing.assert_close(losses, expected)
