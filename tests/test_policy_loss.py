"""fused_linear_policy_loss against float64: the loss of every loss type (TRL's GRPOTrainer normalizers) with its
options, and its gradients (computed in forward) to x, W and b, against autograd through the unfused float64
formula; the per-token derivatives against autograd; metrics; bad input before any kernel; the Triton path in the
interpreter.

Tolerances: fp32 inputs within 1e-5 relative (L2) of float64, fp64 within 1e-10 (the loss sums terms of ratios).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import relative_error

from lightning_flce import PolicyLossOutput, fused_linear_policy_loss
from lightning_flce.losses.policy import LOSS_TYPES, per_token_policy_grads, per_token_policy_loss

FP32_TOL = 1e-5
FP64_TOL = 1e-10


def make_problem(b=3, t=9, h=16, v=120, dtype=torch.float64, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, generator=gen)
    w = torch.randn(v, h, generator=gen) / h**0.5 * 2
    bias_ = 0.3 * torch.randn(v, generator=gen) if bias else None
    target = torch.randint(0, v, (b, t), generator=gen)
    target[0, -2:] = -100
    mask = torch.rand(b, t, generator=gen) > 0.25
    mask[2] = False  # a sequence with no counted token
    logp = torch.log_softmax(F.linear(x, w, bias_), -1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    # old / reference log-probs near the policy's: ratios around 1, some outside the clip range
    old = (logp + 0.3 * torch.randn(b, t, generator=gen)).double()
    ref = (logp + 0.2 * torch.randn(b, t, generator=gen)).double()
    cast = lambda a: None if a is None else a.to(dtype).requires_grad_()  # noqa: E731
    extras = {
        "old_logprobs": old,
        "ref_logprobs": ref,
        "mask": mask,
        "advantages": torch.randn(b, generator=gen, dtype=torch.float64),
        "token_advantages": torch.randn(b, t, generator=gen, dtype=torch.float64),
        "token_weight": torch.rand(b, t, generator=gen, dtype=torch.float64) + 0.5,
        "temperature": 0.6 + torch.rand(b, t, generator=gen, dtype=torch.float64),
    }
    return cast(x), cast(w), target, cast(bias_), extras


def reference_loss(x, w, target, bias, *, logits=None, advantages, old_logprobs=None, ref_logprobs=None, mask=None,
                   loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0, entropy_coef=0.0,
                   temperature=1.0, token_weight=None, max_completion_length=None, softcap=None):  # fmt: skip
    """The unfused formula in float64 (TRL's normalizers), of ``logits`` when given (else float64 ones)."""
    if logits is None:
        logits = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    logits = logits.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.double().unsqueeze(-1)
    else:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, -1)
    valid = target != -100
    logp = log_probs.gather(-1, torch.where(valid, target, 0)[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    b, t = target.shape
    adv = advantages.double()
    adv = adv[:, None].expand(b, t) if adv.dim() == 1 else adv
    per_token = per_token_policy_loss(
        logp, entropy, adv, old_logprobs, ref_logprobs if beta else None, loss_type=loss_type,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, entropy_coef=entropy_coef,
    )  # fmt: skip
    counted = valid & (mask if mask is not None else True)
    m = counted.double()
    if token_weight is not None:
        per_token = per_token * token_weight
    per_token = torch.where(counted, per_token, 0.0)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (b * (max_completion_length or t))
    return (per_token * m).sum() / m.sum().clamp(min=1)


# name -> options; each loss type runs each of them
OPTIONS = {
    "on_policy": {},
    "clipped_asymmetric": {"old_logprobs": True, "epsilon_high": 0.28},
    "kl": {"old_logprobs": True, "ref_logprobs": True, "beta": 0.04},
    "entropy": {"entropy_coef": 0.01},
    "all": {
        "old_logprobs": True,
        "ref_logprobs": True,
        "beta": 0.1,
        "entropy_coef": -0.02,
        "temperature": True,
        "token_weight": True,
        "softcap": 5.0,
        "epsilon_low": 0.1,
        "epsilon_high": 0.3,
    },
}


def resolve(options, extras, loss_type):
    kwargs = {"mask": extras["mask"], "loss_type": loss_type}
    kwargs["advantages"] = extras["token_advantages" if loss_type == "ppo" else "advantages"]
    for name, value in options.items():
        kwargs[name] = extras[name] if value is True else value
    if loss_type == "cispo" and "epsilon_high" in kwargs:
        kwargs["epsilon_high"] = 1.2  # cispo's bound on the detached ratio
    return kwargs


def grads(loss, tensors):
    return torch.autograd.grad(loss, [a for a in tensors if a is not None])


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_matches_float64(loss_type, option, dtype):
    x, w, target, bias, extras = make_problem(dtype=dtype)
    kwargs = resolve(OPTIONS[option], extras, loss_type)
    out = fused_linear_policy_loss(x, w, target, bias, chunk_size=8, **kwargs)
    assert isinstance(out, PolicyLossOutput) and out.loss.dim() == 0
    want = reference_loss(x, w, target, bias, **kwargs)
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    assert relative_error(out.loss, want) < tol
    for got, ref in zip(grads(out.loss, (x, w, bias)), grads(want, (x, w, bias))):
        assert got.dtype == dtype
        assert relative_error(got, ref) < tol


def test_dr_grpo_max_completion_length():
    x, w, target, bias, extras = make_problem()
    kwargs = resolve({}, extras, "dr_grpo")
    out = fused_linear_policy_loss(x, w, target, bias, max_completion_length=32, **kwargs)
    want = reference_loss(x, w, target, bias, max_completion_length=32, **kwargs)
    assert relative_error(out.loss, want) < FP64_TOL


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_per_token_grads_match_autograd(loss_type):
    gen = torch.Generator().manual_seed(3)
    n = 200
    logp = (-3 * torch.rand(n, generator=gen, dtype=torch.float64)).requires_grad_()
    entropy = (3 * torch.rand(n, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)
    ref = logp.detach() + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    terms = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=0.05, entropy_coef=0.01)
    for old_ in (old, None):
        loss = per_token_policy_loss(logp, entropy, adv, old_, ref, **terms)
        want = torch.autograd.grad(loss.sum(), (logp, entropy))
        got = per_token_policy_grads(logp.detach(), entropy.detach(), adv, old_, ref, **terms)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_metrics_and_outputs():
    x, w, target, bias, extras = make_problem()
    kwargs = resolve({"old_logprobs": True, "ref_logprobs": True, "beta": 0.04}, extras, "grpo")
    out = fused_linear_policy_loss(x, w, target, bias, return_entropy=True, **kwargs)
    counted = (target != -100) & extras["mask"]
    log_probs = torch.log_softmax(F.linear(x, w, bias), -1).detach()
    logp = torch.where(counted, log_probs.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    torch.testing.assert_close(out.logprobs, logp)
    torch.testing.assert_close(out.entropy[counted], entropy[counted])
    ratio = torch.exp(logp - extras["old_logprobs"])[counted]
    adv = extras["advantages"][:, None].expand_as(target)[counted]
    delta = (extras["ref_logprobs"] - logp)[counted]
    want = {
        "clip_fraction_low": ((ratio < 0.8) & (adv < 0)).double().mean(),
        "clip_fraction_high": ((ratio > 1.2) & (adv > 0)).double().mean(),
        "ratio_mean": ratio.mean(),
        "kl_mean": (torch.exp(delta) - delta - 1).mean(),
        "entropy_mean": entropy[counted].mean(),
    }
    assert set(out.metrics) == set(want)
    for name, value in want.items():
        assert not out.metrics[name].requires_grad
        torch.testing.assert_close(out.metrics[name], value, msg=name)
    assert (
        0 < want["clip_fraction_low"] + want["clip_fraction_high"] < 1
    )  # the problem exercises the clipping


def test_backward_twice_raises_and_grad_output_scales():
    x, w, target, bias, extras = make_problem()
    kwargs = resolve({"old_logprobs": True}, extras, "bnpo")
    out = fused_linear_policy_loss(x, w, target, bias, **kwargs)
    (3.0 * out.loss).backward(retain_graph=True)
    want = grads(3.0 * reference_loss(x, w, target, bias, **kwargs), (x,))[0]
    assert relative_error(x.grad, want) < FP64_TOL
    with pytest.raises(RuntimeError, match="twice through the same fused_linear_policy_loss"):
        out.loss.backward()
    out = fused_linear_policy_loss(x, w, target, bias, **kwargs)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.loss, x, create_graph=True)


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"loss_type": "reinforce"}, ValueError, "loss_type"),
        ({"advantages": torch.ones(4)}, ValueError, "advantages must have shape"),
        ({"advantages": torch.tensor([1.0, float("nan"), 0.0], dtype=torch.float64)}, ValueError, "finite"),
        ({"old_logprobs": torch.zeros(3, 8)}, ValueError, "old_logprobs must have shape"),
        ({"ref_logprobs": torch.zeros(3, 9, dtype=torch.int64)}, TypeError, "floating-point"),
        ({"mask": torch.ones(9, 3)}, ValueError, "mask must have shape"),
        ({"beta": 0.1}, ValueError, "needs ref_logprobs"),
        ({"epsilon_low": -0.1}, ValueError, ">= 0"),
        ({"beta": float("nan")}, ValueError, "finite"),
        ({"temperature": 0.0}, ValueError, "positive and finite"),
        ({"temperature": torch.zeros(3, 9)}, ValueError, "positive and finite"),
        ({"max_completion_length": 0}, ValueError, "max_completion_length"),
    ],
)
def test_bad_input_raises_before_any_kernel(monkeypatch, change, error, message):
    import lightning_flce.engine as engine

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(engine, "run_chunks", no_kernel)
    x, w, target, bias, extras = make_problem()
    kwargs = {**resolve({}, extras, "grpo"), **change}
    with pytest.raises(error, match=message):
        fused_linear_policy_loss(x, w, target, bias, **kwargs)


@pytest.mark.parametrize("precision", ["input", "fp32", "fp32_head", "fp32_compensated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_no_worse_than_unfused(precision, dtype):
    """16-bit inputs: the loss and gradients within 1.5x the unfused 16-bit formula's error against float64, plus
    the gradients' final 16-bit rounding (fp16: the engine's scaled logit gradient)."""
    x, w, target, bias, extras = make_problem(dtype=dtype, h=64, v=300)
    kwargs = resolve(OPTIONS["all"], extras, "grpo")
    out = fused_linear_policy_loss(x, w, target, bias, chunk_size=8, logits_precision=precision, **kwargs)
    want = reference_loss(x.double(), w.double(), target, bias.double(), **kwargs)

    # the same formula on the logits of 16-bit GEMMs (widened after F.linear)
    unfused = reference_loss(None, None, target, None, logits=F.linear(x, w, bias), **kwargs)
    err = abs(out.loss.double() - want).item()
    assert err <= 1.5 * abs(unfused - want).item() + 1e-6
    for got, ref, plain in zip(
        grads(out.loss, (x, w, bias)), grads(want, (x, w, bias)), grads(unfused, (x, w, bias))
    ):
        assert got.dtype == dtype
        assert relative_error(got, ref) <= 1.5 * relative_error(plain, ref) + torch.finfo(dtype).eps / 2


@pytest.mark.interpret
@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_triton_path_matches_float64(loss_type):
    x, w, target, bias, extras = make_problem(dtype=torch.float32, v=200)
    kwargs = resolve(OPTIONS["all"], extras, loss_type)
    out = fused_linear_policy_loss(x, w, target, bias, chunk_size=8, impl="triton", **kwargs)
    want = reference_loss(x, w, target, bias, **kwargs)
    assert relative_error(out.loss, want) < FP32_TOL
    for got, ref in zip(grads(out.loss, (x, w, bias)), grads(want, (x, w, bias))):
        assert relative_error(got, ref) < FP32_TOL


def test_compiles_as_one_node():
    x, w, target, bias, extras = make_problem()
    kwargs = resolve(OPTIONS["all"], extras, "grpo")

    def fn(x, w, b):
        return fused_linear_policy_loss(x, w, target, b, **kwargs).loss

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w, bias)
    want = reference_loss(x, w, target, bias, **kwargs)
    assert relative_error(got, want) < FP64_TOL
    for a, r in zip(grads(got, (x, w, bias)), grads(want, (x, w, bias))):
        assert relative_error(a, r) < FP64_TOL


def test_module_wraps_the_function():
    from lightning_flce import FusedLinearPolicyLoss

    x, w, target, bias, extras = make_problem()
    module = FusedLinearPolicyLoss(loss_type="dapo", beta=0.04, epsilon_high=0.28, temperature=0.8)
    assert "dapo" in repr(module)
    per_call = {name: extras[name] for name in ("old_logprobs", "ref_logprobs", "mask")}
    out = module(x, w, target, bias, advantages=extras["advantages"], **per_call)
    want = fused_linear_policy_loss(
        x, w, target, bias, advantages=extras["advantages"], loss_type="dapo", beta=0.04, epsilon_high=0.28,
        temperature=0.8, **per_call,
    )  # fmt: skip
    assert relative_error(out.loss, want.loss) == 0
    with pytest.raises(TypeError, match="advantages"):  # a per-call argument, not an option
        FusedLinearPolicyLoss(advantages=1.0)
    with pytest.raises(ValueError, match="loss_type"):
        FusedLinearPolicyLoss(loss_type="gspo")


def test_module_takes_the_functions_options_under_their_names_and_defaults():
    # the constructor's typed keywords are the function's, less the per-call tensors: derived, so that an option
    # added to one and not the other fails here
    import inspect

    from lightning_flce import FusedLinearPolicyLoss

    def keywords(function):
        parameters = inspect.signature(function).parameters.values()
        return {p.name: (p.default, p.annotation) for p in parameters if p.kind is p.KEYWORD_ONLY}

    function_options = keywords(fused_linear_policy_loss)
    for name in FusedLinearPolicyLoss.PER_CALL:
        function_options.pop(name)
    assert keywords(FusedLinearPolicyLoss.__init__) == function_options
    assert set(keywords(FusedLinearPolicyLoss.forward)) == set(FusedLinearPolicyLoss.PER_CALL)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["input", "fp32_compensated"])
def test_cuda_bf16_grpo_no_worse_than_unfused(precision):
    """The Triton path on a GPU (bf16, 8 x 256 tokens, H 1024, V 32003, every option): loss and gradients no worse
    than the unfused bf16 formula against float64."""
    gen = torch.Generator().manual_seed(0)
    b, t, h, v = 8, 256, 1024, 32003
    x = torch.randn(b, t, h, generator=gen).bfloat16().cuda().requires_grad_()
    w = (torch.randn(v, h, generator=gen) / h**0.5 * 2).bfloat16().cuda().requires_grad_()
    target = torch.randint(0, v, (b, t), generator=gen).cuda()
    with torch.no_grad():
        logp = -torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(x.double(), w.double()).transpose(1, 2), target, reduction="none"
        )
    noise = torch.randn(b, t, generator=gen, dtype=torch.float64).cuda()
    kwargs = dict(
        advantages=torch.randn(b, generator=gen, dtype=torch.float64).cuda(),
        old_logprobs=logp + 0.2 * noise,
        ref_logprobs=logp - 0.2 * noise,
        mask=(torch.rand(b, t, generator=gen) > 0.1).cuda(),
        beta=0.04,
        entropy_coef=0.01,
        temperature=(0.6 + torch.rand(b, t, generator=gen, dtype=torch.float64)).cuda(),
        softcap=30.0,
    )
    out = fused_linear_policy_loss(x, w, target, logits_precision=precision, **kwargs)
    want = reference_loss(x.double(), w.double(), target, None, **kwargs)
    unfused = reference_loss(None, None, target, None, logits=torch.nn.functional.linear(x, w), **kwargs)
    assert abs(out.loss.double() - want).item() <= 1.5 * abs(unfused - want).item() + 1e-6
    for got, ref, plain in zip(grads(out.loss, (x, w)), grads(want, (x, w)), grads(unfused, (x, w))):
        assert relative_error(got, ref) <= 1.5 * relative_error(plain, ref) + 2**-9
