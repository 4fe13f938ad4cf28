"""fused_linear_distillation on the Triton backend, end to end through Triton's interpreter (the CPU): the op, the
engine's teacher head and the Triton chunk kernel (lightning_flce.kernels.distill) against the float64 formula.

Run as a separate invocation, since the variable must be set before triton is imported:

    TRITON_INTERPRET=1 pytest -m interpret tests/test_distill_interpret.py

The kernel alone, over every option at the chunk level, is tested in tests/test_distill_kernel.py; here the
front end's options reach it (fp32: within FP32_TOL of float64, as tests/test_distill.py's torch path; 16-bit: within
the unfused 16-bit loss's own error).
"""

from __future__ import annotations

import pytest
import torch
from test_distill import (
    FP32_TOL,
    _check,
    assert_no_worse_than_unfused,
    grads,
    make_problem,
    reference_loss,
    relative_error,
    resolve,
)

from lightning_flce import fused_linear_distillation

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "option", ["plain", "all", "top_k_hard", "no_target", "hard_weight_1", "ignore_index"]
)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd_0.1"])
def test_fp32_matches_float64(divergence, option, reduction):
    student, teacher, target, extras = make_problem(dtype=torch.float32, v=300)
    args, kwargs = resolve(student, teacher, target, extras, option, divergence)
    got = fused_linear_distillation(*args, reduction=reduction, chunk_size=4, impl="triton", **kwargs)
    want = reference_loss(*args, reduction=reduction, **kwargs)
    grad_output = extras["grad_output"] if reduction == "none" else None
    _check(got, want, student, kwargs.get("student_bias"), FP32_TOL, grad_output)


@pytest.mark.parametrize("precision", ["input", "fp32"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_bf16_no_worse_than_unfused(divergence, precision):
    """bf16 heads: the 16-bit logits in place, or (``"fp32"``) fp32 logits with the bf16 gradient in their rows;
    loss and gradients within 1.5x the unfused bf16 formula's error against float64."""
    student, teacher, target, extras = make_problem(dtype=torch.bfloat16, hs=32, ht=24, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    got = fused_linear_distillation(*args, chunk_size=4, logits_precision=precision, impl="triton", **kwargs)
    assert_no_worse_than_unfused(got, args, kwargs, student, teacher)


def test_triton_and_torch_backends_agree():
    """The two backends' losses and gradients on the same fp32 call (every option): within fp32 rounding."""
    student, teacher, target, extras = make_problem(dtype=torch.float32, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", "jsd_0.5")
    tensors = (student[0], student[1], kwargs["student_bias"])
    results = []
    for impl in ("torch", "triton"):
        loss = fused_linear_distillation(*args, chunk_size=5, impl=impl, **kwargs)
        results.append((loss, grads(loss, tensors)))
    (loss_t, grads_t), (loss_k, grads_k) = results
    assert relative_error(loss_k, loss_t) < 1e-6
    for a, b in zip(grads_k, grads_t):
        assert relative_error(a, b) < 1e-5


def _split_rows(monkeypatch) -> None:
    """The GPU's default launch in the interpreter: blocks of 64 columns, rows split for 64 programs (3-row
    blocks of 300 columns: five slices of one block)."""
    from functools import partial

    from lightning_flce.kernels import distill

    monkeypatch.setattr(
        distill,
        "default_distill_launch_config",
        partial(distill.default_distill_launch_config, max_block_v=64),
    )
    monkeypatch.setattr(distill, "target_programs", lambda device: 64)
    # every divergence split here (the GPU splits JSD's kernel only), so that forward KL's split steps run too
    monkeypatch.setattr(distill, "SPLIT_DIVERGENCES", frozenset(distill.DIVERGENCES))


@pytest.mark.parametrize("launch", ["whole-rows", "split-rows"])
@pytest.mark.parametrize("option", ["all", "top_k_hard", "ignore_index"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_teacher_in_blocks_of_the_chunk(monkeypatch, divergence, option, launch):
    """The GPU path's teacher blocks (AUXILIARY_BLOCK_ROWS, here 3 rows) in chunks of 8 of 21 fp32 tokens: the Triton
    kernel on each block's rows of the chunk buffer (whole rows, or split as the GPU's default launch splits
    them), the float64 loss and gradients."""
    from test_distill import _spy_loss_rows

    import lightning_flce.engine as engine

    monkeypatch.setattr(engine, "AUXILIARY_BLOCK_ROWS", 3)
    if launch == "split-rows":
        _split_rows(monkeypatch)
    seen = _spy_loss_rows(monkeypatch)
    student, teacher, target, extras = make_problem(shape=(3, 7), dtype=torch.float32, v=300)
    args, kwargs = resolve(student, teacher, target, extras, option, divergence)
    got = fused_linear_distillation(*args, chunk_size=8, impl="triton", **kwargs)
    assert max(seen) == 3 and len(seen) >= 7
    want = reference_loss(*args, **kwargs)
    _check(got, want, student, kwargs.get("student_bias"), FP32_TOL)


@pytest.mark.parametrize("precision", ["input", "fp32"])
def test_bf16_teacher_blocks_no_worse_than_unfused(monkeypatch, precision):
    """bf16 in teacher blocks of 3 rows; with ``"fp32"`` the kernel writes each block's bf16 gradient into its rows
    of the fp32 buffer's second halves: within 1.5x the unfused bf16 formula's error against float64."""
    import lightning_flce.engine as engine

    monkeypatch.setattr(engine, "AUXILIARY_BLOCK_ROWS", 3)
    student, teacher, target, extras = make_problem(shape=(3, 7), dtype=torch.bfloat16, hs=32, ht=24, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", "jsd_0.5")
    got = fused_linear_distillation(*args, chunk_size=8, logits_precision=precision, impl="triton", **kwargs)
    assert_no_worse_than_unfused(got, args, kwargs, student, teacher)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_cached_top_k_on_the_triton_backend(divergence):
    """A cached teacher's top k (with padding) on the Triton backend: the top-k divergence in PyTorch, the
    cross-entropy part by the Triton kernel; fp32 within FP32_TOL of float64."""
    from test_distill import cached_top_k, student_side

    from lightning_flce import fused_linear_distillation_from_top_k

    student, teacher, target, extras = make_problem(dtype=torch.float32, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    kwargs = student_side(kwargs)
    indices, values = cached_top_k(teacher, 9)
    values[0, 0, 5:] = float("-inf")
    got = fused_linear_distillation_from_top_k(
        args[0], args[1], indices, values, args[4], chunk_size=4, impl="triton", **kwargs
    )
    want = reference_loss(*args, top_k_indices=indices, top_k_logits=values, **kwargs)
    _check(got, want, student, kwargs.get("student_bias"), FP32_TOL)
