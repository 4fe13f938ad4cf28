"""The options record is the one declaration: the public signatures list exactly its fields, the custom
ops' schemas are its declaration, and every option reaches the op by name."""

from __future__ import annotations

import inspect

import pytest
import torch

from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
from lightning_flce.kernels import BACKENDS
from lightning_flce.op import BACKWARD_ARGS, FORWARD_ARGS, OPTION_ARG_NAMES, ForwardArgs
from lightning_flce.options import IMPLS, OPTION_NAMES, FLCEOptions
from lightning_flce.parallel import (
    vocab_parallel_fused_linear_cross_entropy,
    vocab_parallel_fused_linear_cross_entropy_with_stats,
)

VOCAB_PARALLEL_ONLY = {"group", "vocab_start", "sequence_parallel"}


def keyword_options(function) -> set:
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize(
    "function",
    [
        fused_linear_cross_entropy,
        fused_linear_cross_entropy_with_stats,
        vocab_parallel_fused_linear_cross_entropy,
        vocab_parallel_fused_linear_cross_entropy_with_stats,
    ],
    ids=lambda f: f.__name__,
)
def test_public_signatures_list_exactly_the_record_fields(function):
    options = keyword_options(function) - VOCAB_PARALLEL_ONLY
    assert options == set(OPTION_NAMES)


def test_public_defaults_are_the_record_defaults():
    defaults = FLCEOptions()
    for name, parameter in inspect.signature(fused_linear_cross_entropy).parameters.items():
        if parameter.kind is parameter.KEYWORD_ONLY:
            assert parameter.default == getattr(defaults, name), name


@pytest.mark.parametrize(
    ("op_name", "declared", "returns"),
    [("flce_forward", FORWARD_ARGS, 8), ("flce_backward", BACKWARD_ARGS, 3)],
)
def test_custom_op_schemas_are_the_declaration(op_name, declared, returns):
    schema = str(getattr(torch.ops.lightning_flce, op_name).default._schema)
    arguments = ", ".join(f"{kind} {name}" for name, kind in declared)
    assert schema == f"lightning_flce::{op_name}({arguments}) -> ({', '.join(['Tensor'] * returns)})"


def test_every_option_is_an_op_argument():
    op_args = set(ForwardArgs._fields)
    for name in OPTION_NAMES:
        assert OPTION_ARG_NAMES.get(name, name) in op_args, name


def test_impl_names_come_from_the_backend_registry():
    assert ("auto", *BACKENDS) == IMPLS
    with pytest.raises(ValueError, match="impl must be one of"):
        FLCEOptions.of(impl="cuda")


def test_named_errors_use_the_front_ends_names():
    with pytest.raises(ValueError, match="z_loss must be finite"):
        FLCEOptions.named({"lse_square_scale": "z_loss"}, lse_square_scale=-1.0)


def test_record_normalizes_and_replace_revalidates():
    import numpy as np

    options = FLCEOptions.of(ignore_index=np.int64(-1), chunk_size=np.int32(64), softcap=30)
    assert (
        type(options.ignore_index) is int
        and type(options.chunk_size) is int
        and type(options.softcap) is float
    )
    with pytest.raises(ValueError, match="label_smoothing"):
        options.replace(label_smoothing=2.0)
