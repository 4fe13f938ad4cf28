"""The options record is the one declaration: the public signatures list exactly its fields, the custom
ops' schemas are its declaration, and every option reaches the op by name."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import get_args

import pytest
import torch

from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
from lightning_flce.kernels import BACKENDS
from lightning_flce.op import BACKWARD_ARGS, FORWARD_ARGS, OPTION_ARG_NAMES, ForwardArgs
from lightning_flce.options import IMPLS, LOGITS_PRECISIONS, OPTION_NAMES, FLCEOptions, ImplName
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


@pytest.mark.parametrize(
    ("op", "with_stats"),
    [
        (fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats),
        (vocab_parallel_fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy_with_stats),
    ],
    ids=lambda f: f.__name__,
)
def test_with_stats_has_the_ops_parameters_and_returns_flce_output(op, with_stats):
    # what help() shows; type checkers read the same through takes_options_of's ParamSpec
    # (tests/typing/user_project.py checks what mypy infers)
    op_signature, stats_signature = inspect.signature(op), inspect.signature(with_stats)
    assert stats_signature.parameters == op_signature.parameters
    assert op_signature.return_annotation == "Tensor"
    assert stats_signature.return_annotation == "FLCEOutput"


def test_public_defaults_are_the_record_defaults():
    defaults = FLCEOptions()
    for name, parameter in inspect.signature(fused_linear_cross_entropy).parameters.items():
        if parameter.kind is parameter.KEYWORD_ONLY:
            assert parameter.default == getattr(defaults, name), name


@pytest.mark.parametrize(
    ("op_name", "declared", "returns"),
    [("flce_forward", FORWARD_ARGS, 9), ("flce_backward", BACKWARD_ARGS, 3)],
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
    # the static type of impl (a Literal, which cannot be built from the registry) lists the same names
    assert get_args(ImplName) == IMPLS
    with pytest.raises(ValueError, match="impl must be one of"):
        FLCEOptions.of(impl="cuda")


def test_named_errors_use_the_front_ends_names():
    with pytest.raises(ValueError, match="flce_lse_square_scale must be finite"):
        FLCEOptions.named({"lse_square_scale": "flce_lse_square_scale"}, lse_square_scale=-1.0)
    with pytest.raises(ValueError, match="flce_accum_dtype must be a torch.dtype, one of"):
        FLCEOptions.named({"accum_dtype": "flce_accum_dtype"}, accum_dtype="fp32")


@pytest.mark.parametrize("name", ["float32", "float64", "bfloat16", "float16", "torch.float32"])
def test_accum_dtype_takes_a_dtype_name(name):
    """YAML and the CLI set ``accum_dtype`` by name: the record holds the dtype, and the op computes what it
    computes with the dtype itself."""
    dtype = getattr(torch, name.removeprefix("torch."))
    assert FLCEOptions.of(accum_dtype=name).accum_dtype is dtype
    with pytest.raises(TypeError, match="accum_dtype must be a torch.dtype"):
        FLCEOptions.of(accum_dtype=32)
    if dtype in (torch.bfloat16, torch.float16):
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=gen, requires_grad=True)
    weight = torch.randn(20, 8, generator=gen, requires_grad=True)
    target = torch.randint(0, 20, (12,), generator=gen)
    grads = []
    for accum_dtype in (name, dtype):
        loss = fused_linear_cross_entropy(x, weight, target, accum_dtype=accum_dtype, chunk_size=4)
        grads.append((loss, *torch.autograd.grad(loss, (x, weight))))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


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


@pytest.mark.parametrize("precision", LOGITS_PRECISIONS)
def test_every_logits_precision_reaches_the_engine_from_every_front_end(precision, tmp_path, monkeypatch):
    """Each ``logits_precision`` name is accepted by the op, its ``_with_stats`` variant, the vocab-parallel op
    (a group of one), ``FLCEHeadLoss`` and the mixin's ``flce_logits_precision``, and reaches the chunk engine:
    as itself with bf16 GEMMs, except "fp32_head", which runs as fp32 GEMMs of "input" logits. The losses agree
    across the front ends (fp32 softmax of the same logits: 1e-5 relative covers the shard kernels' order)."""
    import torch.distributed as dist
    from torch import nn

    import lightning_flce.op as op
    import lightning_flce.parallel.op as parallel_op
    from lightning_flce.head import FLCEHeadLoss
    from lightning_flce.models.gpt import TinyGPT

    seen = []
    for module in (op, parallel_op):

        def spy(*args, _run=module.run_chunks, **kwargs):
            seen.append((kwargs["logits_precision"], kwargs["compute_dtype"]))
            return _run(*args, **kwargs)

        monkeypatch.setattr(module, "run_chunks", spy)
    want = ("input", torch.float32) if precision == "fp32_head" else (precision, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=gen).bfloat16()
    head = nn.Linear(16, 40, bias=False).bfloat16()
    weight = head.weight.detach()
    target = torch.randint(0, 40, (24,), generator=gen)
    kwargs = {"logits_precision": precision}

    losses = {
        "op": fused_linear_cross_entropy(x, weight, target, **kwargs),
        "with_stats": fused_linear_cross_entropy_with_stats(x, weight, target, **kwargs).loss,
        "head_loss": FLCEHeadLoss(logits_precision=precision)(head, x, target),
    }
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        losses["vocab_parallel"] = vocab_parallel_fused_linear_cross_entropy(x, weight, target, **kwargs)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    model = TinyGPT(
        vocab_size=40,
        d_model=16,
        n_layers=1,
        n_heads=2,
        max_seq_len=24,
        lr=0.0,
        flce_logits_precision=precision,
    )
    assert model.flce_options.logits_precision == precision
    with torch.no_grad():
        model.lm_head.weight.copy_(weight.float())
    model = model.bfloat16()
    losses["mixin"] = model.flce_loss(x, target)

    assert seen == [want] * len(losses)
    for name, loss in losses.items():
        assert torch.allclose(loss.double(), losses["op"].double(), rtol=1e-5, atol=0), name


# ------------------------------------------------------------ one vocabulary across the front ends and the docs

OPTIONS_DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"
# the loss options a front end does not take, and why (a new option must be taken or added here on purpose)
NOT_TAKEN = {
    "`FLCEHeadLoss`": {"class_weight": "a tensor: FLCEHeadLoss.from_options takes a record with it"},
    "`FLCEMixin`": {
        "class_weight": "a tensor, not an __init__ option",
        "reduction": "flce_normalize decides how the token losses are summed",
    },
}


def _keyword_defaults(function) -> dict:
    parameters = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}


def _front_ends() -> dict:
    """Each front end's column in docs/options.md -> {its option name: default}, from the signatures; and the
    names each takes per call."""
    from lightning_flce.head import FLCEHeadLoss
    from lightning_flce.mixin import FLCEMixin

    mixin_init = _keyword_defaults(FLCEMixin.__init__)
    return {
        "op": _keyword_defaults(fused_linear_cross_entropy),
        "vocab-parallel op": _keyword_defaults(vocab_parallel_fused_linear_cross_entropy),
        "`FLCEHeadLoss`": {
            **_keyword_defaults(FLCEHeadLoss.__init__),
            **_keyword_defaults(FLCEHeadLoss.forward),
        },
        "`FLCEMixin`": {
            **{name: default for name, default in mixin_init.items() if name.startswith("flce_")},
            **_keyword_defaults(FLCEMixin.flce_loss),
        },
    }


def _names(cell: str) -> list:
    """The option names of a front end's cell: its backticked words outside parentheses."""
    return re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cell))


def _table(text: str) -> tuple:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()]
    rows = [row for row in rows if len(row) > 1 and not set(row[0]) <= set("-")]
    return rows[0], rows[1:]


def _options_table() -> tuple:
    text = OPTIONS_DOC.read_text()
    options, deprecated = text.split("## Deprecated names")
    header, rows = _table(options[options.index("| option") :])
    return header, {_names(row[0])[0]: dict(zip(header, row)) for row in rows}, _table(deprecated)[1]


def _as_documented(default) -> str:
    return f'"{default}"' if isinstance(default, str) else repr(default)


def test_options_doc_lists_every_option_of_every_front_end_with_its_default():
    """docs/options.md's columns list exactly the keyword options the signatures take, each option under its
    own row's name (``flce_``-prefixed in the mixin's constructor), with the signatures' default."""
    header, rows, _ = _options_table()
    front_ends = _front_ends()
    assert list(front_ends) == header[3:]
    from lightning_flce.mixin import FLCEMixin

    mixin_calls = _keyword_defaults(FLCEMixin.flce_loss)
    for column, taken in front_ends.items():
        documented = [name for row in rows.values() for name in _names(row[column])]
        assert set(documented) == set(taken), column
        for option, row in rows.items():
            for name in _names(row[column]):
                canonical = option if column != "`FLCEMixin`" or name in mixin_calls else f"flce_{option}"
                assert name == canonical, (column, option)
                assert _names(row["default"]) == [_as_documented(taken[name])], (column, name)


def test_every_front_end_takes_the_loss_options_under_their_names():
    """Each FLCEOptions field is an option of the op, the vocab-parallel op, FLCEHeadLoss and (with its
    ``flce_`` prefix, or per call) the mixin, under the field's name, unless NOT_TAKEN says why not; and the
    docs' row of the field says so."""
    _, rows, _ = _options_table()
    from lightning_flce.mixin import FLCEMixin

    mixin_calls = _keyword_defaults(FLCEMixin.flce_loss)
    for column, taken in _front_ends().items():
        excused = NOT_TAKEN.get(column, {})
        assert set(excused) <= set(OPTION_NAMES), column
        for field in OPTION_NAMES:
            name = f"flce_{field}" if column == "`FLCEMixin`" and field not in mixin_calls else field
            assert (name in taken) != (field in excused), (column, field)
            documented = _names(rows[field][column])
            expected = set() if field in excused else {name}
            assert set(documented) == expected and (documented or field in excused), (column, field)


def _aliases() -> dict:
    """(front end, old name) -> new name, from the decorators of the functions that take old names."""
    from lightning_flce.head import FLCEHeadLoss
    from lightning_flce.mixin import FLCEMixin

    functions = (FLCEHeadLoss.__init__, FLCEHeadLoss.forward, FLCEMixin.__init__, FLCEMixin.flce_loss)
    return {
        (function.__qualname__, old): new
        for function in functions
        for old, new in getattr(function, "__renamed__", {}).items()
    }


def test_options_doc_lists_every_deprecated_name():
    from lightning_flce.deprecation import RENAMED

    _, _, deprecated = _options_table()
    documented = sorted((_names(row[0])[0], _names(row[1])[0]) for row in deprecated)
    aliases = _aliases()
    assert documented == sorted((old, new) for (_, old), new in aliases.items())
    # every row of the table of old names is taken by some front end, under its own or the mixin's prefix
    assert {old.removeprefix("flce_") for _, old in aliases} == set(RENAMED)
