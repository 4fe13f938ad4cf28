"""The per-token inputs' table (lightning_flce/per_token.py): every consumer reads the same names, the mixin's
shift puts each input's pad value at the last position, and the checks refuse bad tensors with the front ends'
messages."""

import inspect

import pytest
import torch

from lightning_flce import FusedLinearPolicyLoss, fused_linear_policy_loss
from lightning_flce.mixin import FLCEMixin
from lightning_flce.op import FORWARD_ARGS
from lightning_flce.options import FLCEOptions
from lightning_flce.per_token import (
    CROSS_ENTROPY_INPUTS,
    PER_TOKEN_INPUTS,
    POLICY_INPUTS,
    check_per_token,
    shift_per_token,
    shift_per_token_inputs,
)


def test_the_declared_inputs_are_the_ones_the_front_ends_take():
    assert set(CROSS_ENTROPY_INPUTS) | set(POLICY_INPUTS) <= set(PER_TOKEN_INPUTS)
    schema = dict(FORWARD_ARGS)
    for name in CROSS_ENTROPY_INPUTS:
        assert name in FLCEOptions.field_names()
        assert schema[name] == "Tensor?"  # a tensor argument: saved for "none"'s backward
        assert name in inspect.signature(FLCEMixin.flce_loss).parameters
    assert FusedLinearPolicyLoss.PER_CALL == POLICY_INPUTS
    for function in (fused_linear_policy_loss, FusedLinearPolicyLoss.forward, FLCEMixin.flce_policy_loss):
        parameters = inspect.signature(function).parameters
        assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in POLICY_INPUTS)


def test_shift_moves_each_input_and_pads_with_its_value():
    values = torch.arange(1.0, 7.0).reshape(2, 3)
    for name, spec in PER_TOKEN_INPUTS.items():
        shifted = shift_per_token(name, values)
        expected = torch.tensor([[2.0, 3.0, spec.shift_pad], [5.0, 6.0, spec.shift_pad]])
        torch.testing.assert_close(shifted, expected, rtol=0, atol=0)
    assert PER_TOKEN_INPUTS["temperature"].shift_pad == 1.0  # the last position's logits left as they are
    # one value per sequence (advantages [B]) is not a position's: unchanged; so is a missing input
    per_sequence = torch.tensor([0.5, -0.5])
    shifted = shift_per_token_inputs({"advantages": per_sequence, "old_logprobs": None, "loss_type": "grpo"})
    assert shifted == {"advantages": per_sequence, "old_logprobs": None, "loss_type": "grpo"}
    # a bool mask stays bool, its last position out
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert shift_per_token("mask", mask).tolist() == [[True, True, False]] * 2
    # a 1-D sequence (the mixin's flce_loss takes [T] targets) shifts too
    assert shift_per_token("token_weight", torch.tensor([1.0, 2.0, 3.0])).tolist() == [2.0, 3.0, 0.0]


@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [
        ("token_weight", [1.0] * 6, TypeError, "token_weight must be a tensor"),
        ("token_weight", torch.ones(6), ValueError, r"token_weight must have the target's shape \(2, 3\)"),
        ("old_logprobs", torch.ones(2), ValueError, "old_logprobs must have the target's shape"),
        (
            "ref_logprobs",
            torch.ones(2, 3, dtype=torch.int64),
            TypeError,
            "ref_logprobs must be floating point",
        ),
        (
            "token_weight",
            torch.ones(2, 3, device="meta"),
            ValueError,
            "token_weight is on meta but target is on cpu",
        ),
        ("token_weight", torch.ones(2, 3).to_sparse(), TypeError, "dense"),
    ],
)
def test_check_refuses_bad_inputs(name, value, error, match):
    with pytest.raises(error, match=match):
        check_per_token(name, value, torch.zeros(2, 3, dtype=torch.long))


def test_check_takes_each_inputs_shapes_and_dtypes():
    target = torch.zeros(2, 3, dtype=torch.long)
    check_per_token("advantages", torch.ones(2), target)  # one per sequence
    check_per_token("advantages", torch.ones(2, 3), target)
    check_per_token("mask", torch.ones(2, 3, dtype=torch.bool), target)  # any dtype, read as != 0
    check_per_token("mask", torch.ones(2, 3, dtype=torch.int64), target)
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\) or \(2, 3\) \(target is"):
        check_per_token(
            "advantages",
            torch.ones(3),
            target,
            shape_error="{name} must have shape {shape} (target is {target})",
        )
