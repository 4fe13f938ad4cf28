"""The Triton distillation chunk kernel on a GPU at realistic shapes (256 rows of 32003 and 128256 columns),
against the float64 reference of test_distill_kernel.py, and the op end to end on the GPU (cuBLAS and the
compensated Triton GEMM, the teacher in blocks of AUXILIARY_BLOCK_ROWS of each chunk, both dW accumulators)
against the float64 formula of test_distill.py. Run on the GPU machine: ``pytest -m cuda``.

Compiled, the kernel takes what the interpreter cannot check: vectorized loads over rows whose stride is
no multiple of 16 bytes (V = 32003), libdevice's exp and log for fp32 logits, the fast exp for 16-bit ones,
the per-block barrier of the 16-bit gradient in fp32 rows, and warps that run ahead of each other.
Tolerances: the rows in fp32 (sums over 128K columns in blocks: 1e-5 relative, 2e-5 absolute on values
of ~10); the gradient 1e-5 in relative norm in fp32, plus one unit in the last place of a 16-bit one.
"""

from __future__ import annotations

import pytest
import torch
from test_distill import (
    FP32_TOL,
    _spy_loss_rows,
    assert_no_worse_than_unfused,
    make_problem,
    reference_loss,
    resolve,
)
from test_distill import (
    _check as check_op,
)
from test_distill_kernel import reference_distill

from lightning_flce import fused_linear_distillation

pytestmark = pytest.mark.cuda

ROWS_TOL = {"rtol": 1e-5, "atol": 2e-5}
FP32_GRAD_TOL = 1e-5


def _problem(vocab: int, dtype: torch.dtype, seed: int, n_rows: int = 256, padded: int = 0):
    """Student logits of std 3, the teacher's a perturbed copy (so the divergences are O(0.1-1)), per-row
    temperatures and token scales, a CE on its own inverse temperature; ``padded`` trailing -inf columns."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    student = torch.randn(n_rows, vocab, device="cuda", generator=gen) * 3
    teacher = student + torch.randn(n_rows, vocab, device="cuda", generator=gen) * 2
    if padded:
        student[:, -padded:] = teacher[:, -padded:] = float("-inf")
    target = torch.randint(0, vocab - padded, (n_rows,), device="cuda", generator=gen)

    def per_row():
        return torch.rand(n_rows, device="cuda", generator=gen) + 0.5

    options = {
        "student_inv_temperature": per_row(),
        "teacher_inv_temperature": per_row(),
        "ce_inv_temperature": per_row(),
        "token_scale": per_row(),
    }
    return student.to(dtype), teacher.to(dtype), target, options


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _check(got, want, grad):
    for got_rows, want_rows in zip(got[:3], want[:3]):
        torch.testing.assert_close(got_rows.double(), want_rows, **ROWS_TOL)
    rounding = torch.finfo(grad.dtype).eps if grad.dtype != torch.float32 else 0.0
    assert torch.isfinite(grad).all()
    assert _relative_error(grad, want[3]) < FP32_GRAD_TOL + rounding


def _options(divergence, hard_weight=0.4, student_softcap=0.0, teacher_softcap=0.0):
    return {
        "divergence": divergence,
        "beta": 0.3,
        "hard_weight": hard_weight,
        "student_softcap": student_softcap,
        "teacher_softcap": teacher_softcap,
    }


def _whole_rows(vocab: int):
    """The whole-row launch (one program per row) at the default blocks, whatever the default launch."""
    from lightning_flce.kernels.distill import default_distill_launch_config

    return default_distill_launch_config(vocab)


def _launch(name: str, vocab: int, rows: int = 256):
    """None (the default launch), whole rows, or the split launch at 8 programs an SM (blocks of 4096 x 8)."""
    from lightning_flce.kernels.distill import default_distill_launch_config

    if name == "whole-rows":
        return _whole_rows(vocab)
    if name == "split":
        programs = 8 * torch.cuda.get_device_properties(0).multi_processor_count
        return default_distill_launch_config(vocab, max_block_v=4096, rows=rows, programs=programs)
    return None


@pytest.mark.parametrize("launch", ["default", "whole-rows", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("vocab", [32003, 128256])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", None])
def test_kernel_against_float64(divergence, vocab, dtype, launch):
    """Every divergence with the hard-label CE mixed in (CE alone for None), in place over the student rows, in
    the default launch, in whole rows and split into slices."""
    from lightning_flce.kernels.distill import distill_chunk

    student, teacher, target, per_row = _problem(vocab, dtype, seed=vocab % 97, padded=37)
    options = {**_options(divergence, 1.0 if divergence is None else 0.4), **per_row}
    want = reference_distill(student, teacher, target, **options)
    grad = student.clone()
    got = distill_chunk(grad, teacher, target, compute_grad=True, config=_launch(launch, vocab), **options)
    _check(got, want, grad)


@pytest.mark.parametrize("vocab", [32003, 128256])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_fp32_rows_with_bf16_teacher_and_gradient_in_rows(divergence, vocab):
    """fp32 student logits (the wide-logits path) with a bf16 teacher and softcaps on both sides, the bf16
    gradient in the rows' second halves (always whole rows): bit for bit the whole-row launch's gradient into a
    separate bf16 buffer (a missing barrier would let a warp overwrite values another has yet to read), the
    reference's within bf16."""
    from lightning_flce.kernels import gradient_in_logits_rows
    from lightning_flce.kernels.distill import distill_chunk

    student, teacher, target, per_row = _problem(vocab, torch.float32, seed=3)
    teacher = teacher.bfloat16()
    options = {**_options(divergence, 0.4, 30.0, 50.0), **per_row}
    separate = torch.full(student.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    want_rows = distill_chunk(
        student.clone(),
        teacher,
        target,
        compute_grad=True,
        grad_out=separate,
        config=_whole_rows(vocab),
        **options,
    )
    in_rows = student.clone()
    grad = gradient_in_logits_rows(in_rows, torch.bfloat16)
    got = distill_chunk(in_rows, teacher, target, compute_grad=True, grad_out=grad, **options)
    for got_rows, want in zip(got, want_rows):
        assert torch.equal(got_rows, want)
    assert torch.equal(grad, separate)
    _check(got, reference_distill(student, teacher, target, **options), grad)


@pytest.mark.parametrize("launch", ["whole-rows", "split"])
@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_repeatable(divergence, launch):
    """The same inputs give bit-identical rows and gradients run after run (a moving result is a race), whole
    rows and split."""
    from lightning_flce.kernels.distill import distill_chunk

    student, teacher, target, per_row = _problem(128256, torch.bfloat16, seed=5, n_rows=512)
    options = {**_options(divergence), **per_row}
    config = _launch(launch, 128256, rows=512)
    runs = []
    for _ in range(3):
        grad = student.clone()
        rows = distill_chunk(grad, teacher, target, compute_grad=True, config=config, **options)
        runs.append((*rows, grad))
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------- the op
DEVICE = "cuda"


def _op_problem(dtype, shape=(2, 300), hs=64, ht=48, v=1000, seed=0):
    """test_distill.py's problem on the GPU (student leaves that require grad, the teacher's without)."""
    student, teacher, target, extras = make_problem(shape=shape, dtype=dtype, hs=hs, ht=ht, v=v, seed=seed)
    student = [t.detach().to(DEVICE).requires_grad_() for t in student]
    teacher = [t.to(DEVICE) for t in teacher]
    return student, teacher, target.to(DEVICE), {k: t.to(DEVICE) for k, t in extras.items()}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("option", ["plain", "all", "top_k_hard", "no_target", "ignore_index"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd_0.5"])
def test_op_fp32_matches_float64(monkeypatch, divergence, option, reduction):
    """fp32 end to end (impl "auto": the Triton kernel, cuBLAS's fp32 GEMMs): 600 tokens in one chunk, the
    teacher's GEMM and the kernel in blocks of 256, 256 and 88 rows; within FP32_TOL of float64."""
    seen = _spy_loss_rows(monkeypatch)
    student, teacher, target, extras = _op_problem(torch.float32)
    args, kwargs = resolve(student, teacher, target, extras, option, divergence)
    got = fused_linear_distillation(*args, reduction=reduction, **kwargs)
    assert max(seen) == 256 and len(seen) >= 3
    want = reference_loss(*args, reduction=reduction, **kwargs)
    grad_output = extras["grad_output"] if reduction == "none" else None
    check_op(got, want, student, kwargs.get("student_bias"), FP32_TOL, grad_output)


@pytest.mark.parametrize("accum_dtype", [None, torch.bfloat16], ids=["fp32_accumulator", "bf16_accumulator"])
@pytest.mark.parametrize("precision", ["input", "fp32", "fp32_compensated"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_op_bf16_no_worse_than_unfused(divergence, precision, accum_dtype):
    """bf16 end to end in 4 chunks of 512 rows (V = 32003: rows with no 16-byte stride), each chunk's teacher in
    two blocks: the loss and dX within 1.5x the unfused bf16 formula's error against float64 (both heads' logits
    from cuBLAS's bf16 GEMMs); dW too with the fp32 accumulator, and with the bf16 one within the unfused error
    plus one bf16 rounding (u = 2^-8) of the running sum per chunk, sqrt(4) of them in norm."""
    student, teacher, target, extras = _op_problem(torch.bfloat16, shape=(4, 512), hs=256, ht=192, v=32003)
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    got = fused_linear_distillation(
        *args, chunk_size=512, logits_precision=precision, accum_dtype=accum_dtype, **kwargs
    )
    assert_no_worse_than_unfused(
        got, args, kwargs, student, teacher, dw_roundings=None if accum_dtype is None else 4
    )


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd_0.5"])
def test_op_cached_top_k_matches_float64(divergence):
    """A cached teacher's top 20 (some tokens padded) end to end on the GPU, fp32: within FP32_TOL of float64."""
    from test_distill import cached_top_k, student_side

    from lightning_flce import fused_linear_distillation_from_top_k

    student, teacher, target, extras = _op_problem(torch.float32)
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    kwargs = student_side(kwargs)
    indices, values = cached_top_k(teacher, 20)
    values[:, ::7, 12:] = float("-inf")
    got = fused_linear_distillation_from_top_k(args[0], args[1], indices, values, args[4], **kwargs)
    want = reference_loss(*args, top_k_indices=indices, top_k_logits=values, **kwargs)
    check_op(got, want, student, kwargs.get("student_bias"), FP32_TOL)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_op_vocab_size_over_padded_heads_matches_float64(divergence):
    """Heads padded to different rows (student 1000, teacher 1008) distilled over vocab_size = 993 rows, fp32 on the
    GPU (the kernel's rows of 993 columns are views of the heads' first rows): within FP32_TOL of float64 on those
    rows, the gradients of the whole student head included (zero in its rows past them)."""
    student, teacher, target, extras = _op_problem(torch.float32)
    vocab = 993
    target = torch.where(target >= vocab, target - vocab, target)
    wt = torch.cat([teacher[1], teacher[1][:8]])  # 1008 rows
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    kwargs["teacher_bias"] = torch.cat([teacher[2], teacher[2][:8]])
    got = fused_linear_distillation(args[0], args[1], args[2], wt, args[4], vocab_size=vocab, **kwargs)
    want_kwargs = {
        **kwargs,
        "student_bias": kwargs["student_bias"][:vocab],
        "teacher_bias": teacher[2][:vocab],
    }
    want = reference_loss(args[0], args[1][:vocab], args[2], teacher[1][:vocab], args[4], **want_kwargs)
    check_op(got, want, student, kwargs.get("student_bias"), FP32_TOL)
