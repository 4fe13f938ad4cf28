"""The custom ops' two autograd paths (``lightning_flce/op_autograd.py``): an eager call with gradients runs a plain
``autograd.Function`` around the op, every other call torch.library's registered autograd. Both must give the same
bits (loss, metrics, dX, dW, d bias) for every front end, and the registered path must stay the one that
``torch.compile``, dispatch modes and calls without gradients see."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_flce import (
    fused_linear_cross_entropy,
    fused_linear_distillation,
    fused_linear_logprobs,
    fused_linear_policy_loss,
)
from lightning_flce.op import flce_forward
from lightning_flce.op_autograd import OpWithAutograd

B, T, H, V = 2, 6, 16, 40


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(V, H, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(V, generator=gen, dtype=torch.float64).requires_grad_()
    target = torch.randint(0, V, (B, T), generator=gen)
    target[0, :2] = -100
    teacher_x = torch.randn(B, T, H + 3, generator=gen, dtype=torch.float64)
    teacher_w = torch.randn(V, H + 3, generator=gen, dtype=torch.float64)
    side = {
        "advantages": torch.randn(B, generator=gen, dtype=torch.float64),
        "old_logprobs": -torch.rand(B, T, generator=gen, dtype=torch.float64) * 4,
        "upstream": torch.randn(B, T, generator=gen, dtype=torch.float64),
        "teacher": (teacher_x, teacher_w),
    }
    return x, w, b, target, side


def _cross_entropy_mean(x, w, b, target, side):
    return (fused_linear_cross_entropy(x, w, target, bias=b),)


def _cross_entropy_none(x, w, b, target, side):
    losses = fused_linear_cross_entropy(x, w, target, bias=b, reduction="none")
    return losses, (losses * side["upstream"]).sum()


def _logprobs(x, w, b, target, side):
    out = fused_linear_logprobs(x, w, target, b, return_entropy=True)
    return out.logprobs, out.entropy, (out.logprobs * side["upstream"]).sum() + out.entropy.sum()


def _policy(x, w, b, target, side):
    out = fused_linear_policy_loss(
        x, w, target, b, advantages=side["advantages"], old_logprobs=side["old_logprobs"], return_entropy=True
    )
    return out.logprobs, out.entropy, out.loss


def _distill(reduction):
    def call(x, w, b, target, side):
        teacher_x, teacher_w = side["teacher"]
        loss = fused_linear_distillation(
            x, w, teacher_x, teacher_w, target, student_bias=b, hard_weight=0.25, reduction=reduction
        )
        return (loss,) if reduction != "none" else (loss, (loss * side["upstream"]).sum())

    return call


FRONT_ENDS = {
    "cross_entropy_mean": _cross_entropy_mean,
    "cross_entropy_none": _cross_entropy_none,
    "logprobs": _logprobs,
    "policy_loss": _policy,
    "distillation_jsd_mean": _distill("mean"),
    "distillation_jsd_none": _distill("none"),
}


def _outputs_and_grads(front_end, decisions):
    x, w, b, target, side = _inputs()
    outputs = front_end(x, w, b, target, side)
    outputs[-1].backward()
    assert decisions, "no op was called"
    return [o.detach() for o in outputs] + [x.grad, w.grad, b.grad]


@pytest.mark.parametrize("name", list(FRONT_ENDS))
def test_eager_function_gives_the_registered_autograd_bits(name, monkeypatch):
    decide = OpWithAutograd.takes_eager_function
    decisions = []

    def spy(self, args):
        decisions.append(decide(self, args))
        return decisions[-1]

    monkeypatch.setattr(OpWithAutograd, "takes_eager_function", spy)
    eager = _outputs_and_grads(FRONT_ENDS[name], decisions)
    assert all(decisions), "an eager call with gradients must take the autograd.Function"

    decisions.clear()
    monkeypatch.setattr(OpWithAutograd, "takes_eager_function", lambda self, args: decisions.append(False))
    registered = _outputs_and_grads(FRONT_ENDS[name], decisions)
    assert len(eager) == len(registered)
    for got, expected in zip(eager, registered):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_eager_function_keeps_the_single_backward_check():
    x, w, b, target, _ = _inputs()
    loss = fused_linear_cross_entropy(x, w, target, bias=b)
    assert type(loss.grad_fn).__name__ == "flce_forward_eagerBackward"
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_registered_autograd_where_the_op_must_be_seen():
    x, w, b, target, _ = _inputs()
    args = (x, w, b)
    assert flce_forward.takes_eager_function(args)
    with torch.no_grad():
        assert not flce_forward.takes_eager_function(args)
    assert not flce_forward.takes_eager_function((x.detach(), w.detach(), None))
    with FlopCounterMode(display=False):
        assert not flce_forward.takes_eager_function(args)
    with _Passthrough():
        assert not flce_forward.takes_eager_function(args)

    class Subclass(torch.Tensor):
        pass

    assert not flce_forward.takes_eager_function((x.as_subclass(Subclass), w, b))


def test_compiled_graph_holds_the_op_not_the_function():
    x, w, b, target, _ = _inputs()
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    fn = torch.compile(lambda x, w, b: fused_linear_cross_entropy(x, w, target, bias=b), backend=backend)
    fn(x, w, b).backward()
    assert torch.ops.lightning_flce.flce_forward.default in targets
    assert x.grad is not None and w.grad is not None


def test_flop_counter_still_counts_the_op():
    x, w, b, target, _ = _inputs()
    with FlopCounterMode(display=False) as counter:
        fused_linear_cross_entropy(x, w, target, bias=b).backward()
    assert counter.get_total_flops() == 3 * 2 * B * T * H * V
