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
        ({"accum_dtype": "float32"}, TypeError, "accum_dtype"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(kwargs)


def test_empty_partitioned_weight_is_explained():
    """DeepSpeed ZeRO-3 leaves a partitioned parameter as a 1-D tensor with numel 0 outside its module's forward."""
    with pytest.raises(ValueError, match="ZeRO-3"):
        _call(weight=torch.empty(0))


def test_triton_impl_on_cpu_without_interpreter_is_refused():
    with pytest.raises(RuntimeError, match="impl='triton'"):
        _call({"impl": "triton"})
