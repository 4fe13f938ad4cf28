"""fused_linear_distillation against float64 on the torch backend: the loss of every divergence (forward KL, reverse
KL, the generalized JSD at two betas, the beta 0 / 1 limits) with every option and reduction, and the student's
gradients (dX, dW, d bias) against autograd through the unfused float64 formula (TRL's ``generalized_jsd_loss``
written with ``F.kl_div``); 16-bit inputs against the unfused 16-bit loss's own error; bad input before any kernel;
empty and all-ignored batches; torch.compile; the FLOP counter; the module.

Tolerances: fp64 inputs within 1e-10 relative (L2) of float64, fp32 within 2e-5 (the loss differences of two fp32
softmaxes over V = 40 columns, and logits from fp32 GEMMs).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from reference import relative_error

from lightning_flce import (
    FusedLinearDistillationLoss,
    fused_linear_distillation,
    fused_linear_distillation_from_top_k,
)
from lightning_flce.kernels import distill_torch

FP64_TOL = 1e-10
FP32_TOL = 2e-5


def make_problem(shape=(2, 5), hs=8, ht=12, v=40, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(*shape, hs, generator=gen)
    ws = torch.randn(v, hs, generator=gen) / hs**0.5 * 2
    bs = 0.3 * torch.randn(v, generator=gen)
    xt = torch.randn(*shape, ht, generator=gen)
    wt = torch.randn(v, ht, generator=gen) / ht**0.5 * 3
    bt = 0.3 * torch.randn(v, generator=gen)
    target = torch.randint(0, v, shape, generator=gen)
    if target.numel() > 2:
        target.view(-1)[[1, -1]] = -100
    extras = {
        "token_weight": torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.5,
        "temperature": 0.6 + torch.rand(*shape, generator=gen, dtype=torch.float64),
        "grad_output": torch.randn(*shape, generator=gen, dtype=torch.float64),
    }
    student = [t.to(dtype).requires_grad_() for t in (xs, ws, bs)]
    teacher = [t.to(dtype) for t in (xt, wt, bt)]
    return student, teacher, target, extras


def _transform(raw, softcap, logit_scale, temperature):
    z = raw * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        return z / temperature.double().unsqueeze(-1)
    return z / temperature


def reference_loss(xs, ws, xt, wt, target=None, *, student_bias=None, teacher_bias=None, student_logits=None,
                   teacher_logits=None, divergence="jsd", beta=0.5, temperature=1.0, hard_weight=0.0, top_k=None,
                   ignore_index=-100, reduction="mean", token_weight=None, student_softcap=None, teacher_softcap=None,
                   student_logit_scale=1.0, teacher_logit_scale=1.0, top_k_indices=None, top_k_logits=None,
                   **unused):  # fmt: skip
    """The unfused formula in float64 (of ``student_logits`` / ``teacher_logits`` when given; with
    ``top_k_indices`` / ``top_k_logits`` a cached teacher's top k: the student's logits gathered there, the teacher's
    only divided by the temperature, -inf entries left out of both sides)."""
    if student_logits is None:
        student_logits = F.linear(
            xs.double(), ws.double(), None if student_bias is None else student_bias.double()
        )
    if teacher_logits is None and top_k_indices is None:
        teacher_logits = F.linear(
            xt.double(), wt.double(), None if teacher_bias is None else teacher_bias.double()
        )
    rs = student_logits.double()
    zs = _transform(rs, student_softcap, student_logit_scale, temperature)
    if top_k_indices is not None:
        padding = top_k_logits == float("-inf")
        zs = zs.gather(-1, top_k_indices.masked_fill(padding, 0))  # a padding entry's index: anything
        zt = _transform(top_k_logits.double(), None, 1.0, temperature)
        # padding: a logit so low that both probabilities are exactly 0 in float64, and every log finite
        zs, zt = zs.masked_fill(padding, -1e30), zt.masked_fill(padding, -1e30)
    else:
        rt = teacher_logits.double()
        zt = _transform(rt, teacher_softcap, teacher_logit_scale, temperature)
    if top_k is not None:
        index = rt.topk(top_k, dim=-1).indices
        zs, zt = zs.gather(-1, index), zt.gather(-1, index)
    logp, logq = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if divergence == "forward_kl":
        beta = 0.0
    elif divergence == "reverse_kl":
        beta = 1.0
    # TRL's generalized_jsd_loss: F.kl_div(input, target, log_target=True) = exp(target) (target - input)
    if beta == 0.0:
        per_token = F.kl_div(logp, logq, reduction="none", log_target=True).sum(-1)
    elif beta == 1.0:
        per_token = F.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)
    else:
        b = torch.tensor(beta, dtype=torch.float64)
        log_m = torch.logsumexp(torch.stack([logp + torch.log1p(-b), logq + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(log_m, logq, reduction="none", log_target=True).sum(-1)
        kl_student = F.kl_div(log_m, logp, reduction="none", log_target=True).sum(-1)
        per_token = beta * kl_teacher + (1 - beta) * kl_student
    valid = torch.ones_like(per_token, dtype=torch.bool) if target is None else target != ignore_index
    if hard_weight:
        zc = _transform(rs, student_softcap, student_logit_scale, 1.0)
        ce = -torch.log_softmax(zc, -1).gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
        per_token = (1 - hard_weight) * per_token + hard_weight * ce
    if token_weight is not None:
        per_token = per_token * token_weight.double()
    per_token = torch.where(valid, per_token, 0.0)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum().clamp(min=1)


DIVERGENCES = {
    "forward_kl": {"divergence": "forward_kl"},
    "reverse_kl": {"divergence": "reverse_kl"},
    "jsd_0.5": {"divergence": "jsd", "beta": 0.5},
    "jsd_0.1": {"divergence": "jsd", "beta": 0.1},
}

# name -> options (True: the problem's tensor of that name)
OPTIONS = {
    "plain": {},
    "temperature": {"temperature": 2.0},
    "token_temperature": {"temperature": True},
    "hard_weight": {"hard_weight": 0.3},
    "hard_weight_1": {"hard_weight": 1.0},
    "no_target": {"target": None},
    "ignore_index": {"ignore_index": 3},
    "token_weight": {"token_weight": True},
    "student_bias": {"student_bias": True},
    "teacher_bias": {"teacher_bias": True},
    "student_softcap": {"student_softcap": 3.0},
    "teacher_softcap": {"teacher_softcap": 2.5},
    "student_logit_scale": {"student_logit_scale": 0.7},
    "teacher_logit_scale": {"teacher_logit_scale": 1.6},
    "top_k": {"top_k": 7},
    "top_k_hard": {"top_k": 5, "hard_weight": 0.4},
    "all": {
        "temperature": True,
        "hard_weight": 0.25,
        "token_weight": True,
        "student_bias": True,
        "teacher_bias": True,
        "student_softcap": 4.0,
        "teacher_softcap": 3.0,
        "student_logit_scale": 0.8,
        "teacher_logit_scale": 1.3,
    },
}


def resolve(student, teacher, target, extras, option, divergence):
    """(positional args, keyword args) of the call."""
    kwargs = dict(DIVERGENCES[divergence])
    for name, value in OPTIONS[option].items():
        kwargs[name] = value
    if kwargs.pop("target", True) is None:
        target = None
    for name in ("temperature", "token_weight"):
        if kwargs.get(name) is True:
            kwargs[name] = extras[name]
    if kwargs.get("student_bias") is True:
        kwargs["student_bias"] = student[2]
    if kwargs.get("teacher_bias") is True:
        kwargs["teacher_bias"] = teacher[2]
    if kwargs.get("ignore_index") == 3 and target is not None:
        target = torch.where(target == -100, 3, target)
        target.view(-1)[[0, 4]] = 3
    return (student[0], student[1], teacher[0], teacher[1], target), kwargs


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def _check(got, want, student, bias, tol, grad_output=None):
    assert relative_error(got, want) < tol
    upstream = 1.0 if grad_output is None else grad_output
    got_loss = (got * upstream).sum() if grad_output is not None else got
    want_loss = (want * upstream).sum() if grad_output is not None else want
    tensors = (student[0], student[1], bias)
    for g, r in zip(grads(got_loss, tensors), grads(want_loss, tensors)):
        assert g.dtype == student[0].dtype
        assert relative_error(g, r) < tol


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("divergence", list(DIVERGENCES))
def test_matches_float64(divergence, option, reduction):
    _run_against_float64(torch.float64, divergence, option, reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", ["all", "top_k_hard", "no_target"])
@pytest.mark.parametrize("divergence", list(DIVERGENCES))
def test_fp32_matches_float64(divergence, option, reduction):
    _run_against_float64(torch.float32, divergence, option, reduction)


def _run_against_float64(dtype, divergence, option, reduction):
    student, teacher, target, extras = make_problem(dtype=dtype)
    args, kwargs = resolve(student, teacher, target, extras, option, divergence)
    got = fused_linear_distillation(*args, reduction=reduction, chunk_size=3, impl="torch", **kwargs)
    want = reference_loss(*args, reduction=reduction, **kwargs)
    assert got.dtype == dtype and got.shape == want.shape
    grad_output = extras["grad_output"] if reduction == "none" else None
    bias = kwargs.get("student_bias")
    _check(got, want, student, bias, FP64_TOL if dtype == torch.float64 else FP32_TOL, grad_output)


@pytest.mark.parametrize("beta, divergence", [(0.0, "forward_kl"), (1.0, "reverse_kl")])
def test_jsd_limits_are_the_kls(beta, divergence):
    student, teacher, target, _ = make_problem()
    args = (student[0], student[1], teacher[0], teacher[1], target)
    got = fused_linear_distillation(*args, divergence="jsd", beta=beta)
    want = fused_linear_distillation(*args, divergence=divergence)
    assert relative_error(got, want) == 0
    assert relative_error(got, reference_loss(*args, divergence=divergence)) < FP64_TOL


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_2d_inputs_and_chunking(divergence):
    """2-D inputs; any chunk size (one chunk, several, one row each, the default) gives the float64 loss."""
    student, teacher, target, extras = make_problem(shape=(11,))
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    for chunk_size in (None, 1, 4, 11, 64):
        got = fused_linear_distillation(*args, chunk_size=chunk_size, **kwargs)
        want = reference_loss(*args, **kwargs)
        _check(got, want, student, kwargs["student_bias"], FP64_TOL)


def test_teacher_gets_no_gradient_and_x_grad_only():
    student, teacher, target, _ = make_problem()
    xs, ws, _ = student
    ws.requires_grad_(False)
    xt, wt, _ = teacher
    loss = fused_linear_distillation(xs, ws, xt, wt, target)
    (gx,) = torch.autograd.grad(loss, xs)
    (want,) = torch.autograd.grad(reference_loss(xs, ws, xt, wt, target), xs)
    assert relative_error(gx, want) < FP64_TOL
    assert xt.grad is None and wt.grad is None


def assert_no_worse_than_unfused(got, args, kwargs, student, teacher, dw_roundings=None):
    """A 16-bit mean loss ``got`` of ``fused_linear_distillation(*args, **kwargs)`` and its student gradients (dX, dW,
    d bias) within 1.5x the unfused 16-bit formula's error against float64 (both heads' logits from 16-bit GEMMs,
    widened after F.linear), plus the gradients' final 16-bit rounding. ``dw_roundings``: dW accumulated in the
    16-bit dtype, rounded that many times (once per chunk): within the unfused error plus sqrt(that many) roundings
    (u = eps / 2 each) in norm."""
    dtype = student[0].dtype
    want = reference_loss(*args, **kwargs)
    logits = dict(
        student_logits=F.linear(student[0], student[1], student[2]),
        teacher_logits=F.linear(teacher[0], teacher[1], teacher[2]),
    )
    unfused = reference_loss(*args, **kwargs, **logits)
    assert abs(got.double() - want).item() <= 1.5 * abs(unfused - want).item() + 1e-6
    eps = torch.finfo(dtype).eps
    tensors = (student[0], student[1], student[2])
    names = ("dX", "dW", "d bias")
    for name, g, ref, plain in zip(names, grads(got, tensors), grads(want, tensors), grads(unfused, tensors)):
        assert g.dtype == dtype
        bound = 1.5 * relative_error(plain, ref) + eps / 2
        if name == "dW" and dw_roundings is not None:
            bound = relative_error(plain, ref) + dw_roundings**0.5 * eps / 2
        assert relative_error(g, ref) <= bound, name


@pytest.mark.parametrize("precision", ["input", "fp32", "fp32_head", "fp32_compensated"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd_0.5"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_no_worse_than_unfused(dtype, divergence, precision):
    """16-bit inputs: the loss and gradients within the unfused 16-bit formula's error (assert_no_worse_than_unfused)."""
    student, teacher, target, extras = make_problem(dtype=dtype, hs=64, ht=48, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    got = fused_linear_distillation(*args, chunk_size=4, logits_precision=precision, impl="torch", **kwargs)
    assert_no_worse_than_unfused(got, args, kwargs, student, teacher)


@pytest.mark.parametrize("option", ["top_k", "top_k_hard"])
@pytest.mark.parametrize("precision", ["input", "fp32"])
def test_16bit_top_k_no_worse_than_unfused(precision, option):
    """bf16 top-k: the divergence's gradient added at the teacher's top-k columns of the 16-bit gradient (with
    ``"fp32"``: the gradient in the fp32 logits' rows), within the unfused bf16 loss's error."""
    student, teacher, target, extras = make_problem(dtype=torch.bfloat16, hs=64, ht=48, v=300)
    args, kwargs = resolve(student, teacher, target, extras, option, "jsd_0.5")
    kwargs.update(student_bias=student[2], temperature=extras["temperature"])
    got = fused_linear_distillation(*args, chunk_size=4, logits_precision=precision, impl="torch", **kwargs)
    want = reference_loss(*args, **kwargs)
    logits = dict(
        student_logits=F.linear(student[0], student[1], student[2]),
        teacher_logits=F.linear(teacher[0], teacher[1]),
    )
    unfused = reference_loss(*args, **kwargs, **logits)
    assert abs(got.double() - want).item() <= 1.5 * abs(unfused - want).item() + 1e-6
    tensors = (student[0], student[1], student[2])
    for g, ref, plain in zip(grads(got, tensors), grads(want, tensors), grads(unfused, tensors)):
        assert relative_error(g, ref) <= 1.5 * relative_error(plain, ref) + 2**-9


def test_autocast_runs_both_heads_in_the_autocast_dtype():
    """Under bf16 autocast the loss is the one of bf16 GEMMs on both heads (fp32 inputs), and the fp32 student
    parameters get fp32 gradients."""
    student, teacher, target, _ = make_problem(dtype=torch.float32, hs=32, ht=24, v=100)
    args = (student[0], student[1], teacher[0], teacher[1], target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_distillation(*args, student_bias=student[2], teacher_bias=teacher[2])
    bf16 = [t.detach().bfloat16() for t in (*student, *teacher)]
    want = fused_linear_distillation(
        bf16[0], bf16[1], bf16[3], bf16[4], target, student_bias=bf16[2], teacher_bias=bf16[5]
    )
    assert got.dtype == torch.float32
    assert relative_error(got, want) < 1e-6
    for g, t in zip(grads(got, student), student):
        assert g.dtype == torch.float32 and g.shape == t.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["empty", "all_ignored"])
def test_empty_and_all_ignored_batches(case, reduction):
    shape = (0,) if case == "empty" else (2, 3)
    student, teacher, target, _ = make_problem(shape=shape)
    if case == "all_ignored":
        target = torch.full_like(target, -100)
    args = (student[0], student[1], teacher[0], teacher[1], target)
    loss = fused_linear_distillation(*args, student_bias=student[2], hard_weight=0.5, reduction=reduction)
    assert loss.shape == (target.shape if reduction == "none" else ())
    assert torch.all(loss == 0)
    for g in grads(loss.sum(), student):
        assert torch.all(g == 0) and not torch.isnan(g).any()


def _no_kernel(*args, **kwargs):
    raise AssertionError("a kernel ran")


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"divergence": "kl"}, ValueError, "divergence must be one of"),
        ({"beta": 1.5}, ValueError, r"beta must be a float in \[0, 1\]"),
        ({"beta": -0.1}, ValueError, "beta must be"),
        ({"hard_weight": 1.2}, ValueError, "hard_weight must be"),
        ({"hard_weight": 0.5, "target": None}, ValueError, "pass target"),
        ({"top_k": 0}, ValueError, "top_k must be"),
        ({"top_k": 41}, ValueError, "top_k must be"),
        ({"temperature": 0.0}, ValueError, "positive and finite"),
        ({"temperature": -1.0}, ValueError, "positive and finite"),
        ({"temperature": torch.zeros(2, 5, dtype=torch.float64)}, ValueError, "positive and finite"),
        (
            {"temperature": torch.ones(5, 2, dtype=torch.float64)},
            ValueError,
            "temperature must be a float or",
        ),
        ({"student_softcap": 0.0}, ValueError, "student_softcap must be a positive"),
        ({"teacher_logit_scale": float("nan")}, ValueError, "teacher_logit_scale must be a positive"),
        ({"wt": torch.randn(41, 12, dtype=torch.float64)}, ValueError, "vocabulary mismatch"),
        ({"xt": torch.randn(2, 4, 12, dtype=torch.float64)}, ValueError, "leading shape"),
        (
            {"xt": torch.randn(2, 5, 13, dtype=torch.float64)},
            ValueError,
            "hidden size mismatch: teacher_input",
        ),
        ({"xs": torch.randn(2, 5, 9, dtype=torch.float64)}, ValueError, "hidden size mismatch"),
        ({"target": torch.zeros(2, 4, dtype=torch.int64)}, ValueError, "target shape"),
        ({"target": torch.full((2, 5), 40)}, ValueError, r"outside \[0, 40\)"),
        ({"token_weight": torch.ones(10, dtype=torch.float64)}, ValueError, "token_weight must have"),
        ({"teacher_bias": torch.zeros(39, dtype=torch.float64)}, ValueError, "teacher head: bias must be"),
        (
            {"xt": torch.randn(2, 5, 12, dtype=torch.float64, device="meta")},
            ValueError,
            "teacher_input is on meta",
        ),
        (
            {"wt": torch.randn(40, 12, dtype=torch.float64).requires_grad_()},
            ValueError,
            "teacher_weight requires",
        ),
        ({"xt": torch.randn(2, 5, 12, dtype=torch.float64).requires_grad_()}, ValueError, "torch.no_grad"),
        ({"wt": torch.randn(40, 12, dtype=torch.float32)}, TypeError, "teacher head: weight dtype"),
        ({"accum_dtype": torch.float16}, ValueError, "accum_dtype must be None, torch.float32"),
        ({"accum_dtype": "int8"}, ValueError, "accum_dtype must be a torch.dtype"),
    ],
)
def test_bad_input_raises_before_any_kernel(monkeypatch, change, error, message):
    import lightning_flce.engine as engine

    monkeypatch.setattr(engine, "run_chunks", _no_kernel)
    student, teacher, target, _ = make_problem()
    call = {"xs": student[0], "ws": student[1], "xt": teacher[0], "wt": teacher[1], "target": target}
    kwargs = {}
    for name, value in change.items():
        (call if name in call else kwargs)[name] = value
    with pytest.raises(error, match=message):
        fused_linear_distillation(*call.values(), **kwargs)


@pytest.mark.parametrize(
    "rows", [(40, 48), (48, 40), (44, 48)], ids=["teacher_padded", "student_padded", "both"]
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd_0.5"])
def test_vocab_size_distills_heads_padded_to_different_rows(divergence, reduction, rows):
    """Heads padded to different row counts for one tokenizer (Qwen2.5-7B's 152064 rows, 0.5B's 151936): the loss
    over the first vocab_size = 40 rows of each, in float64 against the formula on those rows; the student's rows
    past it get a zero gradient."""
    student_rows, teacher_rows = rows
    vocab = 40
    student, teacher, target, extras = make_problem(v=48)
    ws = student[1].detach()[:student_rows].clone().requires_grad_()
    bs = student[2].detach()[:student_rows].clone().requires_grad_()
    wt, bt = teacher[1][:teacher_rows], teacher[2][:teacher_rows]
    target = torch.where(target >= vocab, target - vocab, target)
    options = dict(DIVERGENCES[divergence], reduction=reduction, temperature=1.5, hard_weight=0.3)
    got = fused_linear_distillation(
        student[0], ws, teacher[0], wt, target, student_bias=bs, teacher_bias=bt, vocab_size=vocab, **options
    )
    want = reference_loss(
        student[0], ws[:vocab], teacher[0], wt[:vocab], target, student_bias=bs[:vocab], teacher_bias=bt[:vocab],
        **options,
    )  # fmt: skip
    assert relative_error(got, want) < FP64_TOL
    upstream = extras["grad_output"] if reduction == "none" else 1.0
    got_grads = grads((got * upstream).sum(), (student[0], ws, bs))
    want_grads = grads((want * upstream).sum(), (student[0], ws, bs))
    for g, r in zip(got_grads, want_grads):
        assert g.shape == r.shape and relative_error(g, r) < FP64_TOL
    assert not got_grads[1][vocab:].any() and not got_grads[2][vocab:].any()


def test_vocab_size_for_a_cached_teacher_and_its_errors():
    student, teacher, target, _ = make_problem(v=48)
    vocab = 40
    target = torch.where(target >= vocab, target - vocab, target)
    indices, logits = cached_top_k((teacher[0], teacher[1][:vocab]), 6)
    got = fused_linear_distillation_from_top_k(
        student[0], student[1], indices, logits, target, divergence="jsd", hard_weight=0.2, vocab_size=vocab
    )
    want = reference_loss(
        student[0], student[1][:vocab], None, None, target, divergence="jsd", hard_weight=0.2,
        top_k_indices=indices, top_k_logits=logits,
    )  # fmt: skip
    assert relative_error(got, want) < FP64_TOL
    args = (student[0], student[1], teacher[0], teacher[1][:44], target)
    with pytest.raises(ValueError, match="pass vocab_size"):
        fused_linear_distillation(*args)
    for bad in (45, 0, True, 40.0):
        with pytest.raises(ValueError, match=r"vocab_size must be None or an int in \[1, 44\]"):
            fused_linear_distillation(*args, vocab_size=bad)
    with pytest.raises(ValueError, match=r"outside \[0, 30\)"):  # targets must lie below it
        fused_linear_distillation(*args, vocab_size=30)


def test_backward_twice_raises_and_grad_output_scales():
    student, teacher, target, _ = make_problem()
    args = (student[0], student[1], teacher[0], teacher[1], target)
    loss = fused_linear_distillation(*args)
    (3.0 * loss).backward(retain_graph=True)
    (want,) = grads(3.0 * reference_loss(*args), student[:1])
    assert relative_error(student[0].grad, want) < FP64_TOL
    with pytest.raises(RuntimeError, match="twice through the same fused_linear_distillation"):
        loss.backward()
    loss = fused_linear_distillation(*args)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, student[0], create_graph=True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiles_as_one_node(reduction):
    student, teacher, target, extras = make_problem()
    args, kwargs = resolve(student, teacher, target, extras, "all", "jsd_0.5")
    kwargs.pop("student_bias")

    def fn(xs, ws, bs):
        loss = fused_linear_distillation(xs, ws, *args[2:], student_bias=bs, reduction=reduction, **kwargs)
        return loss if reduction == "mean" else (loss * extras["grad_output"]).sum()

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*student)
    want = reference_loss(*args, student_bias=student[2], reduction=reduction, **kwargs)
    if reduction == "none":
        want = (want * extras["grad_output"]).sum()
    _check(got, want, student, student[2], FP64_TOL)


def test_flop_counter():
    """2 N V (H_s + H_t) for the logits GEMMs, 4 N V H_s for dX and dW (the "none" recompute is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    student, teacher, target, _ = make_problem()
    n, hs, ht, v = 10, 8, 12, 40
    args = (student[0], student[1], teacher[0], teacher[1], target)
    for reduction in ("mean", "none"):
        with FlopCounterMode(display=False) as counter:
            fused_linear_distillation(*args, reduction=reduction).sum().backward()
        assert counter.get_total_flops() == 2 * n * v * (hs + ht) + 4 * n * v * hs
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fused_linear_distillation(*args)
    assert counter.get_total_flops() == 2 * n * v * (hs + ht)


def test_triton_impl_dispatches_to_the_backends_distill_chunk(monkeypatch):
    """impl="triton" runs lightning_flce.kernels.distill's distill_chunk (here a spy that delegates to the PyTorch
    twin: the kernel itself runs in tests/test_distill_kernel.py and, through the op, in the interpreter tests
    below)."""
    pytest.importorskip("triton")
    import lightning_flce.kernels as kernels
    from lightning_flce.kernels import distill as distill_kernel

    monkeypatch.setitem(
        kernels.BACKENDS,
        "triton",
        dataclasses.replace(kernels.BACKENDS["triton"], usable=lambda device: True),
    )
    calls = []

    def distill_chunk(*args, **kwargs):
        calls.append(kwargs["divergence"])
        return distill_torch.distill_chunk(*args, **kwargs)

    monkeypatch.setattr(distill_kernel, "distill_chunk", distill_chunk)
    student, teacher, target, _ = make_problem(dtype=torch.float32)
    args = (student[0], student[1], teacher[0], teacher[1], target)
    got = fused_linear_distillation(*args, impl="triton", divergence="reverse_kl", chunk_size=4)
    assert calls and set(calls) == {"reverse_kl"}
    assert relative_error(got, reference_loss(*args, divergence="reverse_kl")) < FP32_TOL


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_fp16_bound_holds(divergence):
    """The documented per-row bound of d divergence / dz_s (every element, and twice it for the row's sum) on
    random and peaked distributions; reverse KL's within its documented assumption (log-ratios ~ log V)."""
    from lightning_flce.losses.distillation import divergence_grad_bound

    gen = torch.Generator().manual_seed(1)
    v = 50
    zs = torch.randn(64, v, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 4, 64)[:, None].double()
    zt = torch.randn(64, v, generator=gen, dtype=torch.float64) * 2
    one = torch.ones(1, dtype=torch.float64)
    grad = zs.clone()
    distill_torch.distill_chunk(
        grad, zt, torch.zeros(64, dtype=torch.int64), divergence=divergence, beta=0.3, student_inv_temperature=one,
        teacher_inv_temperature=one, ce_inv_temperature=one, student_softcap=0.0, teacher_softcap=0.0,
        hard_weight=0.0, token_scale=one, compute_grad=True,
    )  # fmt: skip
    bound = divergence_grad_bound(divergence, 0.3, v)
    assert grad.abs().max() <= bound
    assert grad.abs().sum(1).max() <= 2 * bound
    if divergence == "jsd":
        assert bound == pytest.approx(0.7 * (1 / math.e + math.log(v) - 2 * math.log(0.7)))


def test_module_wraps_the_function():
    student, teacher, target, extras = make_problem()
    args = (student[0], student[1], teacher[0], teacher[1], target)
    module = FusedLinearDistillationLoss(divergence="reverse_kl", temperature=0.8, hard_weight=0.2)
    assert "reverse_kl" in repr(module)
    got = module(*args, student_bias=student[2], token_weight=extras["token_weight"])
    want = fused_linear_distillation(
        *args, student_bias=student[2], token_weight=extras["token_weight"], divergence="reverse_kl",
        temperature=0.8, hard_weight=0.2,
    )  # fmt: skip
    assert relative_error(got, want) == 0
    with pytest.raises(ValueError, match="divergence"):
        FusedLinearDistillationLoss(divergence="js")


def test_module_takes_the_functions_options_under_their_names_and_defaults():
    def keywords(function):
        parameters = inspect.signature(function).parameters.values()
        return {p.name: (p.default, p.annotation) for p in parameters if p.kind is p.KEYWORD_ONLY}

    function_options = keywords(fused_linear_distillation)
    for name in FusedLinearDistillationLoss.PER_CALL:
        function_options.pop(name)
    assert keywords(FusedLinearDistillationLoss.__init__) == function_options
    assert set(keywords(FusedLinearDistillationLoss.forward)) == set(FusedLinearDistillationLoss.PER_CALL)


def test_chunk_rule_counts_the_teacher_buffer():
    """The GPU rule: the teacher runs in blocks of AUXILIARY_BLOCK_ROWS, so its buffer is one block, counted with
    the student's chunk buffer within dW's own size (the fp32 accumulator, which dW's rounding reuses, dX and the
    buffers are the peak: at most 3 dW + dX). At the issue's shapes: 3, 3 and 4 chunks (two full-chunk buffers
    took 4, 5 and 8); at N 8192, H 4096, V 128256 (bf16) one more than the cross-entropy's 4096 rows (whose
    buffer alone is dW's size), at the other two the cross-entropy's rows."""
    from lightning_flce.engine import AUXILIARY_BLOCK_ROWS, chunk_rows

    for (n, h, v), chunks in zip(
        [(8192, 4096, 128256), (8192, 3584, 151936), (8192, 2304, 256000)], [3, 3, 4]
    ):
        alone = chunk_rows(None, n, n, v, h, torch.bfloat16, True)
        both = chunk_rows(None, n, n, v, h, torch.bfloat16, True, auxiliary_dtype=torch.bfloat16)
        assert -(-n // both) == chunks
        assert both == alone if v != 128256 else (both < alone and -(-n // alone) == 2)
        assert (both + AUXILIARY_BLOCK_ROWS) * v * 2 <= v * h * 2
    # a chunk smaller than a block is one block: both buffers with the chunk's rows
    small = chunk_rows(None, 512, 512, 50000, 64, torch.bfloat16, True, auxiliary_dtype=torch.bfloat16)
    assert small < AUXILIARY_BLOCK_ROWS and small * 2 * 50000 * 2 <= 32 * 2**20  # the rule's smallest budget
    n, h, v = 8192, 4096, 128256
    # the PyTorch path: the twin's workspace copies plus the teacher's buffer
    alone = chunk_rows(None, n, n, v, h, torch.float32, False, distill_torch.WORKSPACE_COPIES)
    both = chunk_rows(
        None, n, n, v, h, torch.float32, False, distill_torch.WORKSPACE_COPIES, auxiliary_dtype=torch.float32
    )
    assert both < alone


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd_0.5"])
def test_fp16_per_token_no_worse_than_unfused(divergence):
    """fp16 "none": backward recomputes with the per-token grad_output as the token scale (the fp16 factor from its
    per-token bound); gradients within the unfused fp16 loss's error."""
    student, teacher, target, extras = make_problem(dtype=torch.float16, hs=64, ht=48, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    upstream = extras["grad_output"]
    got = fused_linear_distillation(*args, reduction="none", chunk_size=4, impl="torch", **kwargs)
    want = reference_loss(*args, reduction="none", **kwargs)
    logits = dict(
        student_logits=F.linear(student[0], student[1], student[2]),
        teacher_logits=F.linear(teacher[0], teacher[1], teacher[2]),
    )
    unfused = reference_loss(*args, reduction="none", **kwargs, **logits)
    assert relative_error(got, want) <= 1.5 * relative_error(unfused, want) + 1e-6
    tensors = (student[0], student[1], student[2])
    pairs = zip(
        grads((got * upstream).sum(), tensors),
        grads((want * upstream).sum(), tensors),
        grads((unfused * upstream).sum(), tensors),
    )
    for g, ref, plain in pairs:
        assert g.dtype == torch.float16
        assert relative_error(g, ref) <= 1.5 * relative_error(plain, ref) + torch.finfo(torch.float16).eps / 2


def test_teacher_in_its_own_dtype():
    """Outside autocast each head runs in its inputs' dtype: a bf16 teacher beside an fp32 student is the float64
    formula of the bf16 teacher GEMM's logits (softmax in fp32)."""
    student, teacher, target, extras = make_problem(dtype=torch.float32)
    teacher = [t.bfloat16() for t in teacher]
    args, kwargs = resolve(student, teacher, target, extras, "all", "jsd_0.5")
    got = fused_linear_distillation(*args, chunk_size=4, **kwargs)
    want = reference_loss(*args, teacher_logits=F.linear(teacher[0], teacher[1], teacher[2]), **kwargs)
    _check(got, want, student, student[2], FP32_TOL)


def _spy_accumulators(monkeypatch) -> list:
    """(rows per chunk, rows that ran, the dW accumulator's dtype) of every chunk loop: the dtype "mean"/"sum"
    keep dW in, or the one run_chunks accumulates in before its cast ("none"'s backward)."""
    import lightning_flce.engine as engine

    seen = []
    run_chunks = engine.run_chunks

    def spy(*args, **kwargs):
        rows, n_valid = kwargs["chunk_size"], kwargs["n_valid"]
        accumulator = kwargs["grad_weight_dtype"] or engine.accumulator_dtype(
            kwargs["accum_dtype"], args[1], kwargs["compute_dtype"], n_chunks=-(-n_valid // rows)
        )
        seen.append((rows, n_valid, accumulator))
        return run_chunks(*args, **kwargs)

    monkeypatch.setattr(engine, "run_chunks", spy)
    return seen


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_accum_dtype_of_the_weight_rounds_dw_once_per_chunk(monkeypatch, divergence, reduction):
    """bf16 over 8 chunks: the default accumulates dW in fp32 (within 1.5x the unfused bf16 loss's error, as
    test_16bit_no_worse_than_unfused); ``accum_dtype=torch.bfloat16`` in bf16, rounding the running sum once per
    chunk: dW within the unfused error plus sqrt(chunks) bf16 roundings (u = 2^-8 each), while the loss and dX
    are bit for bit the default's (the accumulator touches dW only)."""
    seen = _spy_accumulators(monkeypatch)
    student, teacher, target, extras = make_problem(shape=(64,), dtype=torch.bfloat16, hs=64, ht=48, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    upstream = extras["grad_output"] if reduction == "none" else None
    tensors = (student[0], student[1])

    def gradients(loss):
        return grads(loss if upstream is None else (loss * upstream).sum(), tensors)

    results = {}
    for accum_dtype in (None, torch.bfloat16):
        seen.clear()
        loss = fused_linear_distillation(
            *args, chunk_size=8, accum_dtype=accum_dtype, reduction=reduction, impl="torch", **kwargs
        )
        results[accum_dtype] = (loss, *gradients(loss))
        rows, n_valid, accumulator = seen[-1]
        assert accumulator == (torch.float32 if accum_dtype is None else torch.bfloat16)
    n_chunks = -(-n_valid // rows)
    assert n_chunks == 8
    want = reference_loss(*args, reduction=reduction, **kwargs)
    logits = dict(
        student_logits=F.linear(student[0], student[1], student[2]),
        teacher_logits=F.linear(teacher[0], teacher[1], teacher[2]),
    )
    unfused = reference_loss(*args, reduction=reduction, **kwargs, **logits)
    (_, ref_dw), (_, plain_dw) = gradients(want), gradients(unfused)
    default, narrow = results[None], results[torch.bfloat16]
    assert torch.equal(default[0], narrow[0]) and torch.equal(default[1], narrow[1])
    assert narrow[2].dtype == torch.bfloat16
    eps = torch.finfo(torch.bfloat16).eps
    assert relative_error(default[2], ref_dw) <= 1.5 * relative_error(plain_dw, ref_dw) + eps / 2
    assert relative_error(narrow[2], ref_dw) <= relative_error(plain_dw, ref_dw) + n_chunks**0.5 * eps / 2
    # and it is measurably the less exact one (8 roundings of the running sum against one)
    assert relative_error(narrow[2], ref_dw) > relative_error(default[2], ref_dw)


def test_saved_accumulator_follows_the_distillation_chunk_rule(monkeypatch):
    """The dtype "mean" keeps dW in comes from the chunk count of the distillation's own rule (its twin's
    workspace and the teacher's buffer): at 2000 rows, V 4096, H 64 in bf16 the cross-entropy's rule would take
    one chunk (and keep a bf16 accumulator), the distillation's takes two, so dW accumulates in fp32."""
    from lightning_flce.engine import chunk_rows

    n, v, h = 2000, 4096, 64
    assert chunk_rows(None, n, n, v, h, torch.bfloat16, False) >= n
    seen = _spy_accumulators(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(n, h, generator=gen).bfloat16().requires_grad_()
    ws = (torch.randn(v, h, generator=gen) / h**0.5).bfloat16().requires_grad_()
    xt, wt = (
        torch.randn(n, h, generator=gen).bfloat16(),
        (torch.randn(v, h, generator=gen) / h**0.5).bfloat16(),
    )
    fused_linear_distillation(xs, ws, xt, wt, divergence="forward_kl", impl="torch").backward()
    rows, n_valid, accumulator = seen[-1]
    assert rows < n_valid == n and accumulator == torch.float32
    assert ws.grad.dtype == torch.bfloat16


def test_chunk_rule_with_a_bf16_accumulator_gives_the_buffers_three_quarters_of_the_floor():
    """``accum_dtype`` = the 16-bit weight's dtype: dW + dX + both buffers (the student's chunk, the teacher's block)
    stay within 1.75 memory floors at the issue's three shapes (Liger's fused JSD peaks at 1.87 at the first),
    while the fp32 accumulator's rule is unchanged; a loss without an auxiliary head ignores the flag."""
    from lightning_flce.engine import AUXILIARY_BLOCK_ROWS, chunk_rows

    for n, h, v in [(8192, 4096, 128256), (8192, 3584, 151936), (8192, 2304, 256000)]:
        floor = (n + v) * h * 2
        wide = chunk_rows(None, n, n, v, h, torch.bfloat16, True, auxiliary_dtype=torch.bfloat16)
        narrow = chunk_rows(
            None, n, n, v, h, torch.bfloat16, True, auxiliary_dtype=torch.bfloat16, narrow_accumulator=True
        )
        buffers = (narrow + AUXILIARY_BLOCK_ROWS) * v * 2
        # (at 128256 both balance to 3 chunks of 2816 rows: the fp32 accumulator's buffers get dW's size)
        assert narrow <= wide and buffers <= 0.75 * floor
        assert v * h * 2 + n * h * 2 + buffers <= 1.75 * floor
        alone = chunk_rows(None, n, n, v, h, torch.bfloat16, True)
        assert chunk_rows(None, n, n, v, h, torch.bfloat16, True, narrow_accumulator=True) == alone


def _spy_loss_rows(monkeypatch) -> list:
    """The row count of every distillation chunk-loss call."""
    from lightning_flce.losses.distillation import DistillationChunkLoss

    seen = []
    call = DistillationChunkLoss.__call__

    def spy(self, logits, *args, **kwargs):
        seen.append(logits.shape[0])
        return call(self, logits, *args, **kwargs)

    monkeypatch.setattr(DistillationChunkLoss, "__call__", spy)
    return seen


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("option", ["all", "top_k_hard", "ignore_index"])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd_0.5"])
def test_teacher_in_blocks_of_the_chunk(monkeypatch, divergence, option, reduction):
    """The teacher's GEMM and the loss on blocks of each chunk's rows, as on the GPU (AUXILIARY_BLOCK_ROWS, here 3
    rows on the PyTorch path): 21 tokens, two of them ignored (the chunks' rows an index tensor), in chunks of 8
    (the last one 3) and blocks of 3 (the last of a chunk 2): the float64 loss and gradients."""
    import lightning_flce.engine as engine

    seen = _spy_loss_rows(monkeypatch)
    monkeypatch.setattr(engine, "auxiliary_block_rows", lambda large_chunks: 3)
    student, teacher, target, extras = make_problem(shape=(3, 7))
    args, kwargs = resolve(student, teacher, target, extras, option, divergence)
    got = fused_linear_distillation(*args, reduction=reduction, chunk_size=8, impl="torch", **kwargs)
    assert seen[:6] == [3, 3, 2, 3, 3, 2] and max(seen) == 3
    want = reference_loss(*args, reduction=reduction, **kwargs)
    grad_output = extras["grad_output"] if reduction == "none" else None
    _check(got, want, student, kwargs.get("student_bias"), FP64_TOL, grad_output)


@pytest.mark.parametrize("precision", ["input", "fp32"])
def test_teacher_blocks_leave_16bit_results_unchanged(monkeypatch, precision):
    """bf16, with ``"fp32"`` the 16-bit gradient in the fp32 rows (the block's rows of that view): blocks of 3 rows
    give the values of one block a chunk (each row's loss and gradient do not depend on its neighbours), up to the
    last bit of an fp32 GEMM that sums in another order on 3 rows than on 8 (the CPU's fp32 GEMM of the teacher's
    ``"fp32"`` logits): the loss within 1e-6, the bf16 gradients within one rounding."""
    import lightning_flce.engine as engine

    student, teacher, target, extras = make_problem(shape=(3, 7), dtype=torch.bfloat16, hs=64, ht=48, v=300)
    args, kwargs = resolve(student, teacher, target, extras, "all", "jsd_0.5")
    results = []
    for block in (None, 3):
        if block is not None:
            monkeypatch.setattr(engine, "auxiliary_block_rows", lambda large_chunks, rows=block: rows)
        loss = fused_linear_distillation(
            *args, chunk_size=8, logits_precision=precision, impl="torch", **kwargs
        )
        results.append((loss, *grads(loss, (student[0], student[1], student[2]))))
    (loss, *gradients), (blocked_loss, *blocked_gradients) = results
    torch.testing.assert_close(blocked_loss, loss, rtol=1e-6, atol=0)
    for unblocked, blocked in zip(gradients, blocked_gradients):
        assert blocked.dtype == torch.bfloat16
        assert relative_error(blocked, unblocked) <= torch.finfo(torch.bfloat16).eps / 2


# ----------------------------------------------------------------------------- a cached teacher's top k
def student_side(kwargs):
    """The options a cached teacher takes (the teacher's own transforms are applied before caching)."""
    return {name: value for name, value in kwargs.items() if not name.startswith("teacher_")}


def cached_top_k(teacher, k):
    """The teacher head's top k (indices, raw logits; no bias) per token, as a cache would store them."""
    logits = F.linear(teacher[0], teacher[1])
    values, indices = logits.topk(k, dim=-1)
    return indices, values


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", ["plain", "all", "no_target", "ignore_index"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd_0.5", "jsd_0.1"])
def test_cached_top_k_is_the_heads_top_k(divergence, option, reduction):
    """The head's own top k, cached: the loss and student gradients of ``fused_linear_distillation(top_k=k)`` (to
    1e-12), and the float64 formula (FP64_TOL)."""
    student, teacher, target, extras = make_problem()
    args, kwargs = resolve(student, teacher, target, extras, option, divergence)
    kwargs = student_side(kwargs)
    indices, values = cached_top_k(teacher, 6)
    got = fused_linear_distillation_from_top_k(
        args[0], args[1], indices, values, args[4], reduction=reduction, chunk_size=3, **kwargs
    )
    head = fused_linear_distillation(*args, top_k=6, reduction=reduction, chunk_size=3, **kwargs)
    assert relative_error(got, head) < 1e-12
    want = reference_loss(*args, top_k_indices=indices, top_k_logits=values, reduction=reduction, **kwargs)
    grad_output = extras["grad_output"] if reduction == "none" else None
    _check(got, want, student, kwargs.get("student_bias"), FP64_TOL, grad_output)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd_0.5"])
def test_cached_top_k_with_padding_and_log_probs(divergence):
    """Tokens with fewer entries (-inf padding whose index may repeat a column or lie outside the vocabulary),
    teacher log-probabilities instead of logits (the same distributions over k), ignored tokens whose cache is
    garbage: the float64 formula, with padding left out of both sides."""
    student, teacher, target, extras = make_problem(shape=(3, 5))
    args, kwargs = resolve(student, teacher, target, extras, "all", divergence)
    kwargs = student_side(kwargs)
    indices, logits = cached_top_k(teacher, 7)
    log_probs = logits - torch.logsumexp(F.linear(teacher[0], teacher[1]), -1, keepdim=True)
    from_logits, from_log_probs = (
        fused_linear_distillation_from_top_k(args[0], args[1], indices, v, args[4], chunk_size=4, **kwargs)
        for v in (logits, log_probs)
    )
    assert relative_error(from_log_probs, from_logits) < 1e-12
    values = log_probs.clone()
    values[0, 0, 4:] = float("-inf")
    indices[0, 0, 4:] = indices[0, 0, 0]  # padding repeats a column
    values[1, 2, 1:] = float("-inf")
    indices[1, 2, -1] = 10**6  # padding outside [0, V)
    ignored = (target == -100).nonzero()[0].tolist()
    indices[tuple(ignored)] = -5  # an ignored token: its cache is never read
    got = fused_linear_distillation_from_top_k(
        args[0], args[1], indices, values, args[4], chunk_size=4, **kwargs
    )
    indices[tuple(ignored)] = 0
    want = reference_loss(*args, top_k_indices=indices, top_k_logits=values, **kwargs)
    _check(got, want, student, kwargs.get("student_bias"), FP64_TOL)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            {"indices": torch.zeros(2, 5, dtype=torch.int64)},
            ValueError,
            r"teacher_indices must be \[..., k\]",
        ),
        ({"indices": torch.zeros(2, 4, 3, dtype=torch.int64)}, ValueError, "leading shape"),
        ({"indices": torch.zeros(2, 5, 41, dtype=torch.int64)}, ValueError, "more than V=40"),
        ({"indices": torch.zeros(2, 5, 3)}, TypeError, "integer tensor"),
        ({"values": torch.zeros(2, 5, 4, dtype=torch.float64)}, ValueError, "teacher_indices' shape"),
        ({"values": torch.zeros(2, 5, 3, dtype=torch.int64)}, TypeError, "floating-point"),
        ({"values": torch.zeros(2, 5, 3, dtype=torch.float64).requires_grad_()}, ValueError, "detach"),
        ({"values": torch.zeros(2, 5, 3, dtype=torch.float64, device="meta")}, ValueError, "on meta"),
        ({"bad": (0, 1, 40)}, ValueError, r"outside \[0, 40\)"),
        ({"bad": (2, 0, -1)}, ValueError, "outside"),
        ({"bad": (0, 2, "nan")}, ValueError, "NaN or \\+inf"),
        ({"bad": (0, 2, "inf")}, ValueError, "NaN"),
        ({"bad": (3, 1, "all_padding")}, ValueError, "only padding"),
        ({"bad": (0, 3, "repeat")}, ValueError, "a column twice"),
        ({"divergence": "kl"}, ValueError, "divergence must be one of"),
        ({"hard_weight": 0.5, "target": None}, ValueError, "pass target"),
    ],
)
def test_cached_top_k_bad_input_raises_before_any_kernel(monkeypatch, change, error, message):
    """Shapes, dtypes, devices and gradients at the call; the values of the tokens that carry a loss (rows 1 and 9
    are ignored) in the op's host sync with the targets: all before any kernel."""
    import lightning_flce.engine as engine

    monkeypatch.setattr(engine, "run_chunks", _no_kernel)
    student, teacher, target, _ = make_problem()
    indices = torch.stack([torch.randperm(40)[:3] for _ in range(10)]).view(2, 5, 3)
    values = torch.randn(2, 5, 3, dtype=torch.float64)
    call = {"indices": indices, "values": values, "target": target}
    kwargs = {}
    for name, value in change.items():
        if name == "bad":
            row, entry, what = value
            flat_indices, flat_values = indices.view(-1, 3), values.view(-1, 3)
            if what == "nan" or what == "inf":
                flat_values[row, entry] = float(what)
            elif what == "all_padding":
                flat_values[row] = float("-inf")
            elif what == "repeat":
                flat_indices[row, 1] = flat_indices[row, 0]
            else:
                flat_indices[row, entry] = what
        else:
            (call if name in call else kwargs)[name] = value
    if "indices" in change and "values" not in change and call["indices"].dim() == 3:
        call["values"] = torch.zeros(call["indices"].shape, dtype=torch.float64)
    with pytest.raises(error, match=message):
        fused_linear_distillation_from_top_k(student[0], student[1], *call.values(), **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cached_top_k_compiles_as_one_node_and_counts_the_students_flops(reduction):
    """torch.compile(fullgraph=True) through the cached path (the float64 formula), and the FLOP counter: the
    student's logits, dX and dW GEMMs only (no teacher GEMM runs)."""
    from torch.utils.flop_counter import FlopCounterMode

    student, teacher, target, extras = make_problem()
    indices, values = cached_top_k(teacher, 5)

    def fn(xs, ws):
        loss = fused_linear_distillation_from_top_k(xs, ws, indices, values, target, reduction=reduction)
        return loss if reduction == "mean" else (loss * extras["grad_output"]).sum()

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(student[0], student[1])
    want = reference_loss(
        student[0],
        student[1],
        None,
        None,
        target,
        top_k_indices=indices,
        top_k_logits=values,
        reduction=reduction,
    )
    if reduction == "none":
        want = (want * extras["grad_output"]).sum()
    _check(got, want, student, None, FP64_TOL)
    n, hs, v = 10, 8, 40
    with FlopCounterMode(display=False) as counter:
        fn(student[0], student[1]).backward()
    assert counter.get_total_flops() == 2 * n * v * hs + 4 * n * v * hs
