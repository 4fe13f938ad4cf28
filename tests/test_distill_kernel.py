"""The Triton distillation chunk kernel (:mod:`lightning_flce.kernels.distill`) in Triton's interpreter,
against a float64 reference of the contract (autograd on upcast logits, written here from the definitions).

Run as the other interpreter tests, in their own invocation (the variable must be set before triton is
imported):

    TRITON_INTERPRET=1 pytest -m interpret tests/test_distill_kernel.py

Tiny shapes (at most 8 rows of 300 columns, blocks of 64: five per row, the last partial), in both launches:
whole rows (one program per row) and rows split into slices of whole blocks (three slices of at most two
blocks, the last partial; or five, one block each, so that row 0's first slice has no finite logit). Tolerances:
the kernel computes in fp32 (unit roundoff 6e-8); a KL row comes out as a sum over the row plus a
difference of the two LSEs (about |z| + log V, ~10 here), so a row's error is ~1e-6 absolute: 1e-5
relative and absolute per row, and 1e-5 for the gradient's relative norm, as test_triton_interpret.py. A
16-bit gradient is held to its own rounding on top: one unit in the last place (finfo.eps relative per
element, so in norm), since the interpreter truncates fp32 to bf16 where a GPU rounds to nearest.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.interpret

ROWS_TOL = {"rtol": 1e-5, "atol": 1e-5}
FP32_GRAD_TOL = 1e-5
VOCAB = 300
BLOCKS_OF_64 = (64, 4)  # DistillLaunchConfig(block_v, num_warps): five blocks per row of 300
# the same blocks, each row in slices: (block_v, num_warps, num_stages, row_splits)
THREE_SLICES = (64, 4, None, 3)
FIVE_SLICES = (64, 4, None, 5)
LAUNCHES = {"whole-rows": BLOCKS_OF_64, "3-slices": THREE_SLICES, "5-slices": FIVE_SLICES}


def _transform(logits: torch.Tensor, softcap: float, inv_temperature: torch.Tensor) -> torch.Tensor:
    if softcap > 0.0:
        logits = softcap * torch.tanh(logits / softcap)
    return logits * inv_temperature.double().reshape(-1, 1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """sum_j a_j (log a_j - log b_j) over the last dimension, 0 where a_j = 0 (also in the gradient)."""
    kept = log_a > float("-inf")
    log_a, log_b = torch.where(kept, log_a, 0.0), torch.where(kept, log_b, 0.0)
    return torch.where(kept, log_a.exp() * (log_a - log_b), 0.0).sum(-1)


def reference_distill(
    student: torch.Tensor,
    teacher: torch.Tensor,
    target: Optional[torch.Tensor],
    *,
    divergence: Optional[str],
    beta: float,
    student_inv_temperature: torch.Tensor,
    teacher_inv_temperature: torch.Tensor,
    ce_inv_temperature: torch.Tensor,
    student_softcap: float,
    teacher_softcap: float,
    hard_weight: float,
    token_scale: torch.Tensor,
):
    """The contract in float64: (loss rows, divergence rows, CE rows or None, d loss_rows.sum() / d student)."""
    raw = student.double().requires_grad_(True)
    log_p = torch.log_softmax(_transform(raw, student_softcap, student_inv_temperature), -1)
    log_q = torch.log_softmax(_transform(teacher.double(), teacher_softcap, teacher_inv_temperature), -1)
    if divergence == "forward_kl":
        div = _kl(log_q, log_p)
    elif divergence == "reverse_kl":
        div = _kl(log_p, log_q)
    elif divergence == "jsd":
        either = (log_p > float("-inf")) | (log_q > float("-inf"))
        log_m = torch.logaddexp(
            torch.where(either, log_q, 0.0) + math.log(beta),
            torch.where(either, log_p, 0.0) + math.log(1.0 - beta),
        )
        log_m = torch.where(either, log_m, float("-inf"))
        div = beta * _kl(log_q, log_m) + (1.0 - beta) * _kl(log_p, log_m)
    else:
        div = torch.zeros(student.shape[0], dtype=torch.float64, device=student.device)
    loss = (1.0 - hard_weight) * div if divergence is not None and hard_weight < 1.0 else 0.0 * div
    ce = None
    if hard_weight > 0.0:
        z_c = _transform(raw, student_softcap, ce_inv_temperature)
        ce = torch.logsumexp(z_c, -1) - z_c.gather(1, target[:, None]).squeeze(1)
        loss = loss + hard_weight * ce
    loss = token_scale.double() * loss
    loss.sum().backward()
    detached = None if ce is None else ce.detach()
    return loss.detach(), div.detach(), detached, raw.grad


def _problem(
    seed: int,
    *,
    n_rows: int = 8,
    vocab: int = VOCAB,
    masked: Optional[str] = "both",
    per_row: bool = False,
    own_ce: bool = False,
):
    """Student and teacher logits (fp32, related: the teacher a perturbed student), targets and the per-row
    inputs. ``masked``: -inf columns: "both" (padded vocabulary in every row, and row 0's first 70 columns,
    a whole first block), plus "teacher" or "student"-only columns (where the other side's KL stays
    finite)."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(n_rows, vocab, generator=gen) * 3
    teacher = student + torch.randn(n_rows, vocab, generator=gen) * 2
    target = torch.randint(0, vocab - 30, (n_rows,), generator=gen)
    if masked is not None:
        for logits in (student, teacher):
            logits[:, vocab - 20 :] = float("-inf")
            logits[0, :70] = float("-inf")
        target[0] = 70 + target[0] % 100
        one_side = torch.rand(n_rows, vocab, generator=gen) < 0.1
        one_side[torch.arange(n_rows), target] = False
        if masked in ("teacher", "both_sides"):
            teacher[one_side] = float("-inf")
        if masked in ("student", "both_sides"):
            other = torch.rand(n_rows, vocab, generator=gen) < 0.1
            other[torch.arange(n_rows), target] = False
            if masked == "both_sides":
                other &= ~one_side
            student[other] = float("-inf")
    rows = n_rows if per_row else 1
    student_inv_t = torch.rand(rows, generator=gen) + 0.5
    options = {
        "student_inv_temperature": student_inv_t,
        "teacher_inv_temperature": torch.rand(rows, generator=gen) + 0.5,
        "ce_inv_temperature": torch.rand(rows, generator=gen) + 0.5 if own_ce else student_inv_t.clone(),
        "token_scale": torch.rand(rows, generator=gen) + 0.5 if per_row else torch.tensor([0.7]),
    }
    return student, teacher, target, options


def _run(student, teacher, target, *, block=BLOCKS_OF_64, grad_out=None, compute_grad=True, **options):
    from lightning_flce.kernels.distill import DistillLaunchConfig, distill_chunk

    config = None if block is None else DistillLaunchConfig(*block)
    return distill_chunk(
        student, teacher, target, compute_grad=compute_grad, grad_out=grad_out, config=config, **options
    )


def _log_ratio_rounding_bound(student, teacher, options, want_grad) -> float:
    """JSD's gradient with ``log p - log M`` stored in the 16-bit teacher row as fp16 (u = 2^-11 per element)
    computes ``coef p (log p - log M + shift)`` from the rounded ratio: its error is at most
    ``u |coef p (log p - log M)|`` per element (the softcap's factor is at most 1), returned relative to the
    float64 gradient's norm."""
    beta, w = options["beta"], options["hard_weight"]
    inv_t_s = options["student_inv_temperature"].double().reshape(-1, 1)
    scale = options["token_scale"].double().reshape(-1, 1)
    log_p = torch.log_softmax(_transform(student.double(), options["student_softcap"], inv_t_s.flatten()), -1)
    log_q = torch.log_softmax(
        _transform(teacher.double(), options["teacher_softcap"], options["teacher_inv_temperature"]), -1
    )
    log_m = torch.logaddexp(log_q + math.log(beta), log_p + math.log(1.0 - beta))
    term = torch.where(log_p > float("-inf"), log_p.exp() * (log_p - log_m), 0.0)
    coef = scale * (1.0 - w) * (1.0 - beta) * inv_t_s
    return 2.0**-11 * (coef * term).norm().item() / want_grad.norm().item()


def _options(divergence, hard_weight, student_softcap=0.0, teacher_softcap=0.0, beta=0.3):
    return {
        "divergence": divergence,
        "beta": beta,
        "hard_weight": hard_weight,
        "student_softcap": student_softcap,
        "teacher_softcap": teacher_softcap,
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _check(got, want, grad):
    loss, div, ce = got
    want_loss, want_div, want_ce, want_grad = want
    assert loss.dtype == div.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, **ROWS_TOL)
    torch.testing.assert_close(div.double(), want_div, **ROWS_TOL)
    if want_ce is None:
        assert ce is None
    else:
        torch.testing.assert_close(ce.double(), want_ce, **ROWS_TOL)
    if grad is not None:
        assert torch.isfinite(grad).all()
        rounding = torch.finfo(grad.dtype).eps if grad.dtype != torch.float32 else 0.0
        assert _relative_error(grad, want_grad) < FP32_GRAD_TOL + rounding


DIVERGENCE_MASKS = {"forward_kl": "teacher", "reverse_kl": "student", "jsd": "both_sides", None: "student"}
# (hard_weight, whether the CE has its own inverse temperature): none, on the student's, on its own
CE_MODES = {"no-ce": (0.0, False), "ce-same-t": (0.4, False), "ce-own-t": (0.4, True)}


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per-row"])
@pytest.mark.parametrize(
    "divergence, ce_mode",
    [
        (divergence, ce_mode)
        for divergence in DIVERGENCE_MASKS
        for ce_mode in CE_MODES
        if divergence or ce_mode != "no-ce"
    ],
)
def test_divergences_against_float64(divergence, ce_mode, per_row, launch):
    """Every divergence (JSD at beta 0.3) with and without the hard-label CE (on the student's inverse
    temperature: the kernel reuses the student's LSE; on its own: a third online LSE), shared and per-row
    temperatures and token scales, over rows with -inf columns: padded columns, a whole first block of
    them, and columns -inf on one side only where the divergence stays finite; whole rows and split ones."""
    hard_weight, own_ce = CE_MODES[ce_mode]
    if divergence is None:  # the CE alone (weighted or not)
        hard_weight = 1.0 if own_ce else hard_weight
    student, teacher, target, per_row_inputs = _problem(
        10, masked=DIVERGENCE_MASKS[divergence], per_row=per_row, own_ce=own_ce
    )
    options = {**_options(divergence, hard_weight), **per_row_inputs}
    want = reference_distill(student, teacher, target, **options)
    grad = student.clone()
    got = _run(grad, teacher.clone(), target, block=LAUNCHES[launch], **options)
    _check(got, want, grad)


@pytest.mark.parametrize(
    "caps", [(5.0, 0.0), (0.0, 4.0), (3.0, 30.0)], ids=["student-cap", "teacher-cap", "both-caps"]
)
@pytest.mark.parametrize("launch", ["whole-rows", "3-slices"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_softcaps(divergence, caps, launch):
    """A softcap on either side or both (the student's enters the gradient as 1 - (softcap(r) / c)^2). A -inf
    logit is -c after a softcap: -inf columns only with both caps (one side's alone would make a KL
    infinite)."""
    masked = "both" if all(caps) else None
    student, teacher, target, per_row_inputs = _problem(11, masked=masked, per_row=True, own_ce=True)
    options = {**_options(divergence, 0.4, *caps), **per_row_inputs}
    want = reference_distill(student, teacher, target, **options)
    grad = student.clone()
    got = _run(grad, teacher, target, block=LAUNCHES[launch], **options)
    _check(got, want, grad)


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
    ids=["bf16", "fp16", "fp32-student-bf16-teacher", "bf16-student-fp32-teacher"],
)
@pytest.mark.parametrize("launch", ["whole-rows", "3-slices"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_dtypes(divergence, dtypes, launch):
    """16-bit and mixed logits: the rows in fp32 from the logits as they are (the reference upcasts the same
    values), the gradient in the student's dtype (16-bit: held to its rounding)."""
    student_dtype, teacher_dtype = dtypes
    student, teacher, target, per_row_inputs = _problem(12, masked="both", own_ce=True)
    student, teacher = student.to(student_dtype), teacher.to(teacher_dtype)
    options = {**_options(divergence, 0.4), **per_row_inputs}
    want = reference_distill(student, teacher, target, **options)
    grad = student.clone()
    got = _run(grad, teacher, target, block=LAUNCHES[launch], **options)
    _check(got, want, grad)


@pytest.mark.parametrize("block", [BLOCKS_OF_64, None], ids=["5-blocks", "1-block"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", None])
def test_gradient_in_logits_rows(divergence, grad_dtype, block):
    """The 16-bit gradient of fp32 student logits written into each row's second half
    (gradient_in_logits_rows, the wide-logits path): the same rows and bit for bit the same gradient as
    into a separate 16-bit buffer, and that gradient the reference's within 16-bit rounding. A pass that
    wrote before reading a block (first block first, or without the barrier) would change the values read."""
    from lightning_flce.kernels import gradient_in_logits_rows

    student, teacher, target, per_row_inputs = _problem(13, masked="both", per_row=True, own_ce=True)
    options = {**_options(divergence, 1.0 if divergence is None else 0.4, 2.0, 3.0), **per_row_inputs}
    separate = torch.full(student.shape, float("nan"), dtype=grad_dtype)
    want_rows = _run(student.clone(), teacher, target, grad_out=separate, block=block, **options)
    in_rows = student.clone()
    grad = gradient_in_logits_rows(in_rows, grad_dtype)
    got_rows = _run(in_rows, teacher, target, grad_out=grad, block=block, **options)
    for got, want in zip(got_rows, want_rows):
        assert torch.equal(got, want)
    assert torch.equal(grad, separate)
    _check(got_rows, reference_distill(student, teacher, target, **options), grad)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_gradient_in_logits_rows_keeps_whole_rows(divergence):
    """A split launch asked for with the 16-bit gradient in the fp32 rows runs whole rows (a slice's values land
    past it, in the slice after): bit for bit the whole-row launch's rows and gradient."""
    from lightning_flce.kernels import gradient_in_logits_rows

    student, teacher, target, per_row_inputs = _problem(19, masked="both", per_row=True, own_ce=True)
    options = {**_options(divergence, 0.4), **per_row_inputs}
    results = []
    for launch in (BLOCKS_OF_64, THREE_SLICES):
        in_rows = student.clone()
        grad = gradient_in_logits_rows(in_rows, torch.bfloat16)
        results.append((_run(in_rows, teacher, target, grad_out=grad, block=launch, **options), grad.clone()))
    (whole_rows, whole_grad), (split, split_grad) = results
    for got, want in zip(split, whole_rows):
        assert torch.equal(got, want)
    assert torch.equal(split_grad, whole_grad)
    _check(split, reference_distill(student, teacher, target, **options), split_grad)


@pytest.mark.parametrize("launch", ["whole-rows", "3-slices"])
def test_strided_rows_and_separate_grad_out(launch):
    """Student and teacher rows of different strides (slices of wider buffers), the gradient into a separate
    fp32 buffer of a third stride: the logits unchanged, the rest of the wide buffers untouched."""
    student, teacher, target, per_row_inputs = _problem(14, n_rows=6, masked="both", per_row=True)
    wide_student = torch.randn(6, VOCAB + 13)
    wide_teacher = torch.randn(6, VOCAB + 41).bfloat16()
    wide_student[:, 5 : 5 + VOCAB] = student
    wide_teacher[:, 17 : 17 + VOCAB] = teacher
    teacher = teacher.bfloat16()
    before = (wide_student.clone(), wide_teacher.clone())
    wide_grad = torch.full((6, VOCAB + 7), 123.0)
    options = {**_options("jsd", 0.4), **per_row_inputs}
    got = _run(
        wide_student[:, 5 : 5 + VOCAB],
        wide_teacher[:, 17 : 17 + VOCAB],
        target,
        grad_out=wide_grad[:, 7:],
        block=LAUNCHES[launch],
        **options,
    )
    assert torch.equal(wide_student, before[0]) and torch.equal(wide_teacher, before[1])
    assert torch.all(wide_grad[:, :7] == 123.0)
    _check(got, reference_distill(student, teacher, target, **options), wide_grad[:, 7:])


@pytest.mark.parametrize("launch", ["whole-rows", "3-slices"])
@pytest.mark.parametrize("own_ce", [False, True], ids=["ce-same-t", "ce-own-t"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_hard_weight_one(divergence, own_ce, launch):
    """hard_weight 1: the divergence rows still reported, the loss and the gradient the CE's alone."""
    student, teacher, target, per_row_inputs = _problem(18, masked="both", per_row=True, own_ce=own_ce)
    options = {**_options(divergence, 1.0), **per_row_inputs}
    want = reference_distill(student, teacher, target, **options)
    assert want[1].abs().min() > 1e-3  # a divergence that the loss visibly leaves out
    grad = student.clone()
    _check(_run(grad, teacher, target, block=LAUNCHES[launch], **options), want, grad)


@pytest.mark.parametrize("launch", ["whole-rows", "3-slices"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", None])
def test_without_gradient(divergence, launch):
    """compute_grad=False: the same rows, the logits untouched; target None without the CE."""
    student, teacher, target, per_row_inputs = _problem(15, masked="both")
    hard_weight = 1.0 if divergence is None else 0.0
    options = {**_options(divergence, hard_weight), **per_row_inputs}
    want = reference_distill(student, teacher, target, **options)
    logits = student.clone()
    got = _run(
        logits,
        teacher,
        target if hard_weight else None,
        compute_grad=False,
        block=LAUNCHES[launch],
        **options,
    )
    assert torch.equal(logits, student)
    _check(got, want, None)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_single_block_default_launch(divergence):
    """The default launch (one block for a row of 300): the same rows and gradient."""
    student, teacher, target, per_row_inputs = _problem(16, masked="both", own_ce=True)
    options = {**_options(divergence, 0.4, 4.0, 6.0), **per_row_inputs}
    want = reference_distill(student, teacher, target, **options)
    grad = student.clone()
    _check(_run(grad, teacher, target, block=None, **options), want, grad)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"divergence": "kl"}, "divergence must be one of"),
        ({"divergence": "jsd", "beta": 1.0}, "0 < beta < 1"),
        ({"hard_weight": 1.5}, "hard_weight must be in"),
        ({"hard_weight": 0.5, "target": None}, "needs a \\[4\\] target"),
        ({"token_scale": torch.ones(3)}, "token_scale must have shape"),
        ({"teacher_logits": torch.zeros(4, 99)}, "of one shape"),
        ({"student_logits": torch.zeros(4, 100, dtype=torch.float64)}, "16-bit or fp32"),
    ],
)
def test_bad_input_raises_before_the_kernel(change, message):
    from lightning_flce.kernels.distill import distill_chunk

    args = {
        "student_logits": torch.zeros(4, 100),
        "teacher_logits": torch.zeros(4, 100),
        "target": torch.zeros(4, dtype=torch.int64),
        **_options("forward_kl", 0.0),
        "student_inv_temperature": torch.ones(1),
        "teacher_inv_temperature": torch.ones(1),
        "ce_inv_temperature": torch.ones(1),
        "token_scale": torch.ones(1),
        "compute_grad": True,
    }
    args.update(change)
    positional = [args.pop(name) for name in ("student_logits", "teacher_logits", "target")]
    with pytest.raises(ValueError, match=message):
        distill_chunk(*positional, **args)


def test_registered_in_the_triton_backend():
    from lightning_flce.kernels import BACKENDS

    student, teacher, target, per_row_inputs = _problem(17, n_rows=2, masked=None)
    options = {**_options("forward_kl", 0.0), **per_row_inputs}
    kernels = BACKENDS["triton"].kernels()
    got = kernels.distill_chunk(student.clone(), teacher, None, compute_grad=False, **options)
    _check(got, reference_distill(student, teacher, target, **options), None)


def test_default_launch_rule_and_its_block_cap():
    """A warp per 512 columns (4 to 16) of blocks of at most 8192 columns; ``max_block_v`` caps the block and the
    warps follow (the benchmark's and the CUDA tests' candidate launches are this rule with another cap). Rows
    split into slices of whole blocks until ``rows`` make ``programs`` programs; none asked for: whole rows."""
    from lightning_flce.kernels.distill import default_distill_launch_config

    assert tuple(default_distill_launch_config(300)) == (512, 4, None, 1)
    assert tuple(default_distill_launch_config(128256)) == (8192, 16, None, 1)
    assert tuple(default_distill_launch_config(128256, max_block_v=4096))[:2] == (4096, 8)
    assert tuple(default_distill_launch_config(256000, max_block_v=2048))[:2] == (2048, 4)
    assert tuple(default_distill_launch_config(1000, max_block_v=4096))[:2] == (1024, 4)
    # 256 rows on 132 SMs at 8 programs an SM: 1056 programs, five slices (of the 32 blocks of 4096)
    assert default_distill_launch_config(128256, 4096, rows=256, programs=1056).row_splits == 5
    assert default_distill_launch_config(128256, 4096, rows=2048, programs=1056).row_splits == 1
    # no more slices than blocks
    assert default_distill_launch_config(5000, 4096, rows=4, programs=1056).row_splits == 2
    # the split launch's own blocks: at most 4096 columns x 8 warps (whole rows keep 8192 x 16)
    assert tuple(default_distill_launch_config(128256, rows=256, programs=1056)) == (4096, 8, None, 5)
    assert tuple(default_distill_launch_config(128256, rows=2048, programs=1056)) == (8192, 16, None, 1)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd", None])
def test_only_jsd_asks_for_the_split_launch(monkeypatch, divergence):
    """With a GPU's programs to fill (here 64), JSD's kernel (SPLIT_DIVERGENCES) asks the launch rule for them and
    runs split; the two-pass kernels ask for none and run whole rows; both match float64."""
    from lightning_flce.kernels import distill

    asked = []
    rule = distill.default_distill_launch_config

    def spy(vocab, max_block_v=64, **kwargs):
        config = rule(vocab, max_block_v, **kwargs)
        asked.append((kwargs["programs"], config.row_splits))
        return config

    monkeypatch.setattr(distill, "default_distill_launch_config", spy)
    monkeypatch.setattr(distill, "target_programs", lambda device: 64)
    hard_weight = 1.0 if divergence is None else 0.3
    student, teacher, target, per_row_inputs = _problem(21, masked=DIVERGENCE_MASKS[divergence], per_row=True)
    options = {**_options(divergence, hard_weight), **per_row_inputs}
    grad = student.clone()
    _check(
        _run(grad, teacher, target, block=None, **options),
        reference_distill(student, teacher, target, **options),
        grad,
    )
    assert asked == ([(64, 5)] if divergence == "jsd" else [(0, 1)])


@pytest.mark.parametrize(
    "dtypes, caps, ce_mode, launch",
    [
        ((torch.float32, torch.float32), (0.0, 0.0), "no-ce", "whole-rows"),
        ((torch.float32, torch.float32), (0.0, 0.0), "ce-own-t", "5-slices"),
        ((torch.bfloat16, torch.bfloat16), (0.0, 0.0), "no-ce", "3-slices"),
        ((torch.float16, torch.float16), (3.0, 30.0), "ce-own-t", "whole-rows"),
        ((torch.float16, torch.float16), (3.0, 30.0), "no-ce", "3-slices"),
        ((torch.float32, torch.bfloat16), (0.0, 4.0), "no-ce", "3-slices"),
        ((torch.float32, torch.bfloat16), (0.0, 4.0), "ce-own-t", "whole-rows"),
        ((torch.bfloat16, torch.float32), (5.0, 0.0), "ce-own-t", "5-slices"),
    ],
    ids=[
        "fp32-whole-rows",
        "fp32-ce-5-slices",
        "bf16-3-slices",
        "fp16-caps-ce-whole-rows",
        "fp16-caps-3-slices",
        "fp32-student-bf16-teacher-3-slices",
        "fp32-student-bf16-teacher-ce-whole-rows",
        "bf16-student-fp32-teacher-ce-5-slices",
    ],
)
def test_jsd_log_ratio_in_the_teacher_row(dtypes, caps, ce_mode, launch):
    """``teacher_scratch``: JSD's pass 2 stores ``log p - log M`` over the teacher row (fp16 in a 16-bit row, fp32
    in an fp32 one) and the gradient pass reads it there. The rows as the read-only kernel's (the same pass-2
    sums), the gradient against float64 within the kernel's tolerance plus the stored ratio's fp16 rounding
    (``_log_ratio_rounding_bound``) where the teacher row is 16-bit; over -inf columns on either side, whole and
    split rows, softcaps, per-row temperatures and the CE on its own temperature."""
    student_dtype, teacher_dtype = dtypes
    hard_weight, own_ce = CE_MODES[ce_mode]
    student, teacher, target, per_row_inputs = _problem(23, masked="both_sides", per_row=True, own_ce=own_ce)
    student, teacher = student.to(student_dtype), teacher.to(teacher_dtype)
    options = {**_options("jsd", hard_weight, *caps), **per_row_inputs}
    want = reference_distill(student, teacher, target, **options)
    read_only = _run(student.clone(), teacher.clone(), target, block=LAUNCHES[launch], **options)
    grad, scratch = student.clone(), teacher.clone()
    got = _run(grad, scratch, target, block=LAUNCHES[launch], teacher_scratch=True, **options)
    assert not torch.equal(scratch, teacher)  # the ratio is where the teacher's logits were
    for rows, same in zip(got, read_only):
        assert (rows is None and same is None) or torch.equal(rows, same)
    loss, div, ce = got
    torch.testing.assert_close(loss.double(), want[0], **ROWS_TOL)
    torch.testing.assert_close(div.double(), want[1], **ROWS_TOL)
    assert torch.isfinite(grad).all()
    rounding = torch.finfo(grad.dtype).eps if grad.dtype != torch.float32 else 0.0
    stored = _log_ratio_rounding_bound(student, teacher, options, want[3])
    if teacher_dtype == torch.float32:
        stored = 0.0
    assert _relative_error(grad, want[3]) < FP32_GRAD_TOL + rounding + stored


@pytest.mark.parametrize(
    "divergence, hard_weight, compute_grad",
    [("forward_kl", 0.3, True), ("reverse_kl", 0.3, True), ("jsd", 1.0, True), ("jsd", 0.3, False)],
    ids=["forward_kl", "reverse_kl", "jsd-ce-alone", "jsd-no-gradient"],
)
def test_teacher_scratch_left_unwritten_without_jsd_gradient(divergence, hard_weight, compute_grad):
    """``teacher_scratch`` is a permission, used only where JSD's gradient pass follows: the KLs, a JSD whose
    loss is the CE alone, and a JSD without the gradient leave the teacher row as it was."""
    student, teacher, target, per_row_inputs = _problem(24, masked="both", per_row=True)
    teacher = teacher.bfloat16()
    options = {**_options(divergence, hard_weight), **per_row_inputs}
    scratch = teacher.clone()
    _run(student.clone(), scratch, target, compute_grad=compute_grad, teacher_scratch=True, **options)
    assert torch.equal(scratch, teacher)
