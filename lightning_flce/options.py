"""The loss options, declared once.

:class:`FLCEOptions` is the one record that carries the options of a fused linear cross-entropy call from the
public API (:func:`~lightning_flce.fused_linear_cross_entropy`, the vocab-parallel op, :class:`~lightning_flce.head.FLCEHeadLoss`,
:class:`~lightning_flce.FLCEMixin`) down to the chunk engine. It validates its scalar options when it is built;
the checks that need the call's tensors (class and token weights against the vocabulary and the target) are
:meth:`FLCEOptions.check_tensors`. Everything below the front ends reads the options by name from the record.

Adding an option: a field here (with its check in ``_validated``), the keyword in the public signatures
(``tests/test_options.py`` checks they list exactly these fields), and the code that uses it. A per-token
input (a tensor in the target's shape) is also a row of :data:`~lightning_flce.per_token.PER_TOKEN_INPUTS`
and a name in :data:`~lightning_flce.per_token.CROSS_ENTROPY_INPUTS`: its checks, the mixin's shift, the
vocab-parallel op's gathering and agreement and the op's schema read them there.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import sys
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, TypeVar, Union, get_args

import torch
from torch import Tensor

from lightning_flce.kernels import BACKENDS, LOW_PRECISION
from lightning_flce.per_token import CROSS_ENTROPY_INPUTS, check_per_token

if sys.version_info >= (3, 10):
    from typing import ParamSpec
else:
    from typing_extensions import ParamSpec

P = ParamSpec("P")
R = TypeVar("R")

# The string options' values, declared once as the ``Literal`` types of the public signatures (a type checker
# then catches ``reduction="avg"``); the tuples the checks use are read from them.
#: ``reduction``: a mean over the non-ignored tokens, their sum, or one loss per token.
Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)
#: ``impl``: "auto" and the registered backends (``tests/test_options.py`` checks it lists exactly those).
ImplName = Literal["auto", "triton", "torch"]
#: Valid ``impl`` values: "auto" and the registered backends.
IMPLS: tuple[str, ...] = ("auto", *BACKENDS)
#: ``logits_precision`` (see :func:`~lightning_flce.fused_linear_cross_entropy`).
LogitsPrecision = Literal["input", "fp32", "fp32_head", "fp32_compensated"]
#: Valid ``logits_precision`` values (see :class:`FLCEOptions`).
LOGITS_PRECISIONS: tuple[str, ...] = get_args(LogitsPrecision)
#: The ``logits_precision`` values whose 16-bit GEMMs write each chunk's logits into an fp32 buffer (the chunk
#: engine's wide-logits path: the default's rows, the logit gradient in the GEMMs' dtype in each fp32 row's
#: second half, ``lightning_flce.kernels.gradient_in_logits_rows``).
#: They differ only in the logits GEMM (``lightning_flce.engine.WideLogitsGemm``): "fp32" accumulates in the
#: tensor cores' fp32, "fp32_compensated" compensates the sum over H.
WIDE_LOGITS_PRECISIONS = frozenset({"fp32", "fp32_compensated"})
#: The dtype names ``accum_dtype`` takes besides a ``torch.dtype`` (so YAML and the CLI can set it).
AccumDtypeName = Literal["float32", "float64", "bfloat16", "float16"]
ACCUM_DTYPE_NAMES = get_args(AccumDtypeName)
#: ``normalize`` (``FLCEMixin``'s ``flce_normalize``, ``DistillationModule``'s ``normalize``): a training loss as
#: the token mean of the whole optimizer step, or of each micro-batch.
NormalizeMode = Literal["step", "micro_batch"]
NORMALIZE_MODES: tuple[str, ...] = get_args(NormalizeMode)
#: What ``accum_dtype`` takes: a dtype, its name, or None (the op chooses).
AccumDtype = Union[torch.dtype, AccumDtypeName, None]


class FLCEOptions(NamedTuple):
    """Options of one fused linear cross-entropy call (see :func:`~lightning_flce.fused_linear_cross_entropy`
    for their meaning): an immutable tuple, a plain value that ``torch.compile`` traces through (torch 2.4's
    included). Build it with :meth:`of` (or :meth:`named`), which validate and normalize the values; the
    front ends do, and everything below reads the fields by name.

    ``softcap=None`` is off; ``accum_dtype=None`` and ``chunk_size=None`` let the op choose; ``accum_dtype``
    may be given by name (``"float32"``), the record holds the ``torch.dtype``. ``class_weight`` is ``[V]``,
    ``token_weight`` the target's shape; both are float tensors that receive no gradient.
    """

    ignore_index: int = -100
    reduction: Reduction = "mean"
    label_smoothing: float = 0.0
    class_weight: Optional[Tensor] = None
    lse_square_scale: float = 0.0
    softcap: Optional[float] = None
    token_weight: Optional[Tensor] = None
    logits_precision: LogitsPrecision = "input"
    accum_dtype: Optional[torch.dtype] = None
    chunk_size: Optional[int] = None
    impl: ImplName = "auto"

    @classmethod
    def of(cls, **values: Any) -> FLCEOptions:
        """The validated record of ``values`` (the fields by name; the others keep their defaults)."""
        return _validated(cls(**values), {})

    @classmethod
    def named(cls, names: Mapping[str, str], **values: Any) -> FLCEOptions:
        """The record from a front end whose arguments have other names (``names``: field -> the front end's
        name, e.g. ``{"lse_square_scale": "flce_lse_square_scale"}``): an invalid value's error names the
        argument the user passed."""
        return _validated(cls(**values), names)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return cls._fields

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of the public functions."""
        return _fields_of(self)

    def replace(self, **changes: Any) -> FLCEOptions:
        """A copy with ``changes`` (validated)."""
        return type(self).of(**{**_fields_of(self), **changes})

    def check_tensors(self, vocab: int, target: Tensor, device: torch.device) -> None:
        """The checks that need the call's tensors: class and token weights against the vocabulary, the
        target and the input's ``device``."""
        class_weight = self.class_weight
        if class_weight is not None:
            if class_weight.shape != (vocab,):
                raise ValueError(f"class_weight must be [V]=[{vocab}], got {tuple(class_weight.shape)}")
            if not class_weight.dtype.is_floating_point:
                raise TypeError(f"class_weight must be floating point, got {class_weight.dtype}")
            if class_weight.requires_grad and torch.is_grad_enabled():
                raise ValueError(
                    "class_weight requires grad, but the loss is not differentiable with respect to it (nor is"
                    " F.cross_entropy's weight): pass class_weight.detach()"
                )
            if class_weight.device != device:
                raise ValueError(f"class_weight is on {class_weight.device} but input is on {device}")
            if class_weight.layout != torch.strided:
                raise TypeError(
                    f"class_weight must be a dense (strided) tensor, got layout {class_weight.layout}"
                )
        for name in CROSS_ENTROPY_INPUTS:
            value = getattr(self, name)
            if value is None:
                continue
            check_per_token(name, value, target, device=device)
            if value.requires_grad and torch.is_grad_enabled():
                raise ValueError(
                    f"{name} requires grad, but the loss takes no gradient with respect to it (a per-token input"
                    f" is data: advantages, soft masks): pass {name}.detach()"
                )


OPTION_NAMES = FLCEOptions.field_names()


def _validated(options: FLCEOptions, names: Mapping[str, str]) -> FLCEOptions:
    """``options`` checked, with normalized values (ints and floats of Python's types)."""

    def name(field: str) -> str:
        return names.get(field, field)

    ignore_index = options.ignore_index
    if isinstance(ignore_index, bool):
        raise TypeError(f"{name('ignore_index')} must be an int, got {ignore_index!r}")
    try:
        ignore_index = operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"{name('ignore_index')} must be an int, got {ignore_index!r}") from None
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"{name('ignore_index')} must fit in int64, got {ignore_index}")
    if options.reduction not in REDUCTIONS:
        raise ValueError(f"{name('reduction')} must be one of {REDUCTIONS}, got {options.reduction!r}")
    if not 0.0 <= options.label_smoothing <= 1.0:
        raise ValueError(f"{name('label_smoothing')} must be in [0, 1], got {options.label_smoothing}")
    if not 0.0 <= options.lse_square_scale < math.inf:
        raise ValueError(
            f"{name('lse_square_scale')} must be finite and >= 0, got {options.lse_square_scale}"
        )
    softcap = options.softcap
    if softcap is not None:
        if not 0.0 < softcap < math.inf:
            raise ValueError(f"{name('softcap')} must be finite and > 0 (or None), got {softcap}")
        softcap = float(softcap)
    if options.logits_precision not in LOGITS_PRECISIONS:
        raise ValueError(
            f"{name('logits_precision')} must be one of {LOGITS_PRECISIONS}, got {options.logits_precision!r}"
        )
    accum_dtype = _as_dtype(options.accum_dtype, name("accum_dtype"))
    chunk_size = options.chunk_size
    if chunk_size is not None:
        check_chunk_size(chunk_size, name("chunk_size"))
        chunk_size = operator.index(chunk_size)
    if options.impl not in IMPLS:
        raise ValueError(f"{name('impl')} must be one of {IMPLS}, got {options.impl!r}")
    for field in ("class_weight", *CROSS_ENTROPY_INPUTS):
        value = getattr(options, field)
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{name(field)} must be a tensor or None, got {type(value).__name__}")
    normalized = {
        "ignore_index": ignore_index,
        "label_smoothing": float(options.label_smoothing),
        "lse_square_scale": float(options.lse_square_scale),
        "softcap": softcap,
        "accum_dtype": accum_dtype,
        "chunk_size": chunk_size,
    }
    return type(options)(**{**_fields_of(options), **normalized})


def _as_dtype(accum_dtype, name: str) -> Optional[torch.dtype]:
    """``accum_dtype`` as a ``torch.dtype`` (or None): a name such as ``"float32"`` (or ``"torch.float32"``)
    is looked up among :data:`ACCUM_DTYPE_NAMES`."""
    if accum_dtype is None or isinstance(accum_dtype, torch.dtype):
        return accum_dtype
    if isinstance(accum_dtype, str):
        short = accum_dtype[len("torch.") :] if accum_dtype.startswith("torch.") else accum_dtype
        if short in ACCUM_DTYPE_NAMES:
            return getattr(torch, short)
        raise ValueError(
            f"{name} must be a torch.dtype, one of {ACCUM_DTYPE_NAMES} or None, got {accum_dtype!r}"
        )
    raise TypeError(f"{name} must be a torch.dtype, one of {ACCUM_DTYPE_NAMES} or None, got {accum_dtype!r}")


def _fields_of(options: FLCEOptions) -> dict[str, Any]:
    # not NamedTuple's _asdict/_replace: torch 2.4's dynamo does not trace into collections' helpers
    return {name: getattr(options, name) for name in FLCEOptions._fields}


def check_chunk_size(chunk_size: Any, name: str = "chunk_size") -> None:
    """``chunk_size`` is None or a positive integer (of any integer type, as ``operator.index`` takes it)."""
    if chunk_size is None:
        return
    try:
        positive = not isinstance(chunk_size, bool) and operator.index(chunk_size) > 0
    except TypeError:
        positive = False
    if not positive:
        raise ValueError(f"{name} must be a positive int (or None), got {chunk_size!r}")


def takes_options_of(loss_function: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Decorator of a ``*_with_stats`` function that forwards ``**kwargs`` to the op: it takes the keyword
    options of ``loss_function``, which ``help()``, ``inspect.signature`` and type checkers (through the
    ``ParamSpec``) then show with the decorated function's return type, and a misspelled one raises a
    ``TypeError`` that names the public function (not the internal one it forwards to). The options stay
    declared once, in ``loss_function``'s signature."""
    signature = inspect.signature(loss_function)
    options = {name for name, param in signature.parameters.items() if param.kind is param.KEYWORD_ONLY}

    def decorate(function: Callable[..., R]) -> Callable[P, R]:
        @functools.wraps(function)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            unknown = [name for name in kwargs if name not in options]  # (torch 2.4's dynamo: no set ops)
            if unknown:
                raise TypeError(
                    f"{function.__name__}() got unexpected keyword arguments {sorted(unknown)};"
                    f" options: {sorted(options)}"
                )
            return function(*args, **kwargs)

        checked.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(function).return_annotation
        )
        return checked

    return decorate


def resolve_logits_precision(options: FLCEOptions, compute_dtype: torch.dtype) -> tuple:
    """``logits_precision="fp32_head"`` as what runs: fp32 GEMMs (16-bit operands widened) with an fp32 dW
    accumulator unless one was given; the other settings as they are. Returns (options, compute dtype)."""
    if options.logits_precision != "fp32_head" or compute_dtype not in LOW_PRECISION:
        return options, compute_dtype
    accum_dtype = options.accum_dtype if options.accum_dtype is not None else torch.float32
    return options.replace(logits_precision="input", accum_dtype=accum_dtype), torch.float32
