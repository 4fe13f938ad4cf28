"""The per-token inputs of the losses, declared once.

A per-token input is a tensor in the target's shape that a loss reads one value of per token: the
cross-entropy's ``token_weight``, the policy losses' ``advantages``, ``old_logprobs``, ``ref_logprobs``,
``mask``, ``token_weight`` and a per-token ``temperature``. What the code around a loss does with such a tensor
is the same for each, up to a few facts declared here in one :class:`PerTokenInput` row of
:data:`PER_TOKEN_INPUTS`:

- the checks before any kernel runs (:func:`check_per_token`: a tensor, its shape, its dtype, its device,
  dense), with the dtype rule (``floating``) and the other shapes it may have (``per_sequence``: [B]);
- the mixin's ``shift`` (:func:`shift_per_token`): position t takes t + 1's value, the last position
  ``shift_pad`` (so it carries no loss, or leaves the logits as they are);
- the vocab-parallel op (:mod:`lightning_flce.parallel`): whether it all-gathers the input over the
  sequence-parallel ranks (``sequence_parallel_gather``) and whether the ranks of the group must agree on it
  (``ranks_agree``: a fingerprint in the agreement all-reduce, its presence a flag);
- the single-device op's ``"none"`` backward, which recomputes the chunks: the schema of
  :mod:`lightning_flce.op` takes the cross-entropy's per-token inputs (:data:`CROSS_ENTROPY_INPUTS`) as
  tensor arguments, which are saved for backward.

So a new per-token input is one row here plus its use in its loss (and its keyword in the public signatures).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = [
    "CROSS_ENTROPY_INPUTS",
    "PER_TOKEN_INPUTS",
    "POLICY_INPUTS",
    "PerTokenInput",
    "check_per_token",
    "shift_per_token",
    "shift_per_token_inputs",
]


class PerTokenInput(NamedTuple):
    """One per-token input of a loss (see the module docstring for who reads each field)."""

    name: str
    #: what it is (for the docs and the errors' readers)
    meaning: str
    #: its dtype rule: floating point (True), or any dtype, read as ``!= 0`` (False: a mask)
    floating: bool = True
    #: it may also be [B], one value per sequence of a [B, T] target (broadcast over the tokens)
    per_sequence: bool = False
    #: the value the mixin's ``shift`` puts at the last position of each sequence
    shift_pad: float = 0.0
    #: the vocab-parallel op all-gathers it over the sequence-parallel ranks (each holds its tokens' values)
    sequence_parallel_gather: bool = True
    #: the ranks of a vocab-parallel group must hold the same values (without sequence parallelism)
    ranks_agree: bool = True


#: Every per-token input by name.
PER_TOKEN_INPUTS: Mapping[str, PerTokenInput] = {
    spec.name: spec
    for spec in (
        PerTokenInput("token_weight", "a factor of each token's loss (advantages, soft masks); no gradient"),
        PerTokenInput(
            "advantages", "each sequence's or token's advantage in the policy loss", per_sequence=True
        ),
        PerTokenInput("old_logprobs", "the sampling policy's log-probabilities (the ratio's denominator)"),
        PerTokenInput("ref_logprobs", "the reference model's log-probabilities (the KL term)"),
        PerTokenInput("mask", "the tokens that count (bool or 0/1)", floating=False),
        PerTokenInput("temperature", "the sampler's temperature dividing each token's logits", shift_pad=1.0),
    )
}
#: The cross-entropy's per-token inputs (fields of :class:`~lightning_flce.options.FLCEOptions`, and tensor
#: arguments of the single-device op's schema).
CROSS_ENTROPY_INPUTS: tuple[str, ...] = ("token_weight",)
#: The policy losses' per-token inputs given per call (besides the target), in their signature's order.
POLICY_INPUTS: tuple[str, ...] = ("advantages", "old_logprobs", "ref_logprobs", "mask", "token_weight")


def check_per_token(
    name: str,
    value: Any,
    target: Tensor,
    *,
    device: Optional[torch.device] = None,
    shape_error: Optional[str] = None,
    dtype_error: Optional[str] = None,
) -> None:
    """Raises a clear error for a per-token input ``value`` that is not a dense tensor of the target's shape
    (or [B], for a ``per_sequence`` input of a 2-D target), of its dtype rule, on ``device`` (the input's;
    default the target's). ``shape_error`` / ``dtype_error``: the front end's wording of those errors, formatted
    with ``name``, ``shape`` (the allowed shapes), ``target`` and ``got``."""
    spec = PER_TOKEN_INPUTS[name]
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(value).__name__}")
    allowed = [tuple(target.shape)]
    if spec.per_sequence and target.dim() == 2:
        allowed.insert(0, tuple(target.shape[:1]))
    if tuple(value.shape) not in allowed:
        shapes = " or ".join(str(shape) for shape in allowed)
        template = shape_error or "{name} must have the target's shape {shape}, got {got}"
        raise ValueError(
            template.format(name=name, shape=shapes, target=tuple(target.shape), got=tuple(value.shape))
        )
    if spec.floating and not value.dtype.is_floating_point:
        template = dtype_error or "{name} must be floating point, got {got}"
        raise TypeError(template.format(name=name, got=value.dtype))
    expected = target.device if device is None else device
    if value.device != expected:
        against = "target" if device is None else "input"
        raise ValueError(f"{name} is on {value.device} but {against} is on {expected}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")


def shift_per_token(name: str, value: Optional[Tensor]) -> Optional[Tensor]:
    """A per-token tensor [..., T] of the input ids' positions moved to the positions that predict them, as the
    mixin's ``shift`` moves the target: position t gets t + 1's value, the last position the input's
    ``shift_pad``. None, and the [B] value of a ``per_sequence`` input, pass unchanged."""
    spec = PER_TOKEN_INPUTS[name]
    if value is None or (spec.per_sequence and value.dim() < 2):
        return value
    pad = value.new_full((*value.shape[:-1], 1), spec.shift_pad)
    return torch.cat([value[..., 1:], pad], dim=-1)


def shift_per_token_inputs(values: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`shift_per_token` of each per-token tensor of ``values`` (by name); other values unchanged."""
    return {
        name: shift_per_token(name, value)
        if name in PER_TOKEN_INPUTS and isinstance(value, Tensor)
        else value
        for name, value in values.items()
    }
