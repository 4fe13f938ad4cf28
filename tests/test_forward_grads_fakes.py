"""The fake implementations of the distillation, policy-loss and log-probability custom ops (what
``torch.compile`` traces with) against their real outputs: ``torch.library.opcheck`` on the arguments the public
functions pass, for every dtype and set of needed gradients (fp16's inverse-scales output, the dW accumulator's
two blocks in fp32 over several chunks, the empty outputs of gradients not needed), and the recomputing backward
ops of reduction "none" and of the log-probabilities. The cross-entropy op's: ``tests/test_op.py``."""

from __future__ import annotations

import pytest
import torch

import lightning_flce.distill.functional as distill_functional
import lightning_flce.rl.logprobs as logprobs_module
import lightning_flce.rl.policy as policy_module
from lightning_flce import fused_linear_distillation, fused_linear_logprobs, fused_linear_policy_loss
from lightning_flce.kernels import softmax_dtype

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
NEEDS = [(True, True, True), (False, True, False), (False, False, False)]
# Not "test_aot_dispatch_dynamic": the saved gradients are outputs that backward scales in place (test_op.py)
CHECKS = ("test_schema", "test_faketensor")


def _captured_args(monkeypatch, module, name: str, call) -> tuple:
    """The arguments ``call`` passes to ``module.name`` (an op with autograd), the call then run for real."""
    captured = []
    op = getattr(module, name)

    def spy(*args):
        captured.append(args)
        return op(*args)

    monkeypatch.setattr(module, name, spy)
    call()
    (args,) = captured
    return args


def _leaves(dtype, needs, *shapes, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes]
    return [t.requires_grad_(need) for t, need in zip(tensors, needs)] + tensors[len(needs) :]


def _distillation_args(monkeypatch, op_name: str, dtype, needs, **options) -> tuple:
    """The arguments ``fused_linear_distillation`` passes to its op ``op_name`` (student H 16, teacher H 8, V 40,
    24 tokens of which 5 ignored)."""
    x, weight, bias, teacher_x, teacher_weight = _leaves(
        dtype, needs, (24, 16), (40, 16), (40,), (24, 8), (40, 8)
    )
    target = torch.randint(0, 40, (24,), generator=torch.Generator().manual_seed(1))
    target[:5] = -100
    return _captured_args(
        monkeypatch,
        distill_functional,
        op_name,
        lambda: fused_linear_distillation(
            x, weight, teacher_x, teacher_weight, target, student_bias=bias, **options
        ),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("needs", NEEDS, ids=str)
@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-chunk", "chunks-of-8"])
@pytest.mark.parametrize("hard_weight", [0.0, 0.3])
def test_distillation_fake_matches_the_op(monkeypatch, dtype, needs, chunk_size, hard_weight):
    args = _distillation_args(
        monkeypatch, "flce_distill", dtype, needs, hard_weight=hard_weight, chunk_size=chunk_size
    )
    torch.library.opcheck(torch.ops.lightning_flce.flce_distill.default, args, test_utils=CHECKS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("needs", NEEDS, ids=str)
@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-chunk", "chunks-of-8"])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_policy_loss_fake_matches_the_op(monkeypatch, dtype, needs, chunk_size, return_entropy):
    x, weight, bias = _leaves(dtype, needs, (2, 12, 16), (40, 16), (40,))
    target = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    advantages = torch.tensor([0.5, -1.0])
    args = _captured_args(
        monkeypatch,
        policy_module,
        "flce_policy_loss",
        lambda: fused_linear_policy_loss(
            x,
            weight,
            target,
            bias=bias,
            advantages=advantages,
            return_entropy=return_entropy,
            chunk_size=chunk_size,
        ),
    )
    torch.library.opcheck(torch.ops.lightning_flce.flce_policy_loss.default, args, test_utils=CHECKS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("needs", NEEDS, ids=str)
@pytest.mark.parametrize("hard_weight", [0.0, 0.3])
def test_per_token_distillation_and_its_backward_fakes_match_the_ops(monkeypatch, dtype, needs, hard_weight):
    args = _distillation_args(
        monkeypatch, "flce_distill_per_token", dtype, needs, hard_weight=hard_weight, reduction="none"
    )
    ops = torch.ops.lightning_flce
    torch.library.opcheck(ops.flce_distill_per_token.default, args, test_utils=CHECKS)
    grad_loss = torch.randn(24, dtype=softmax_dtype(dtype))
    torch.library.opcheck(ops.flce_distill_backward.default, (grad_loss, *args), test_utils=CHECKS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("needs", NEEDS, ids=str)
@pytest.mark.parametrize("return_entropy", [False, True])
def test_logprobs_and_their_backward_fakes_match_the_ops(monkeypatch, dtype, needs, return_entropy):
    x, weight, bias = _leaves(dtype, needs, (2, 12, 16), (40, 16), (40,))
    target = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    args = _captured_args(
        monkeypatch,
        logprobs_module,
        "flce_logprobs",
        lambda: fused_linear_logprobs(x, weight, target, bias=bias, return_entropy=return_entropy),
    )
    ops = torch.ops.lightning_flce
    torch.library.opcheck(ops.flce_logprobs.default, args, test_utils=CHECKS)
    loss_dtype = softmax_dtype(dtype)
    grad_entropy = torch.randn(24, dtype=loss_dtype) if return_entropy else torch.empty(0, dtype=loss_dtype)
    backward_args = (torch.randn(24, dtype=loss_dtype), grad_entropy, *args)
    torch.library.opcheck(ops.flce_logprobs_backward.default, backward_args, test_utils=CHECKS)
