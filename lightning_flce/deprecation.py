"""Renamed options: one table of old names and the two helpers every front end uses to keep them working.

The option vocabulary is the op's keyword names (:class:`~lightning_flce.options.FLCEOptions`' fields and
``target``); :class:`~lightning_flce.head.FLCEHeadLoss` takes the same names and
:class:`~lightning_flce.FLCEMixin` takes them with an ``flce_`` prefix. A name that changed stays one release as
an alias in :data:`RENAMED`: :func:`accepts_renamed` maps it to the new name (its value converted where the
meaning changed form) with a ``FutureWarning`` that names the new one, and :func:`renamed_property` keeps an
attribute of the old name readable. The old names stay out of the signatures, so ``help()``, ``LightningCLI``
and the docs show only the new ones.

Renaming an option later: add its row to :data:`RENAMED` and the old name to the front ends' decorators.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, NamedTuple, TypeVar

import torch

__all__ = ["RENAMED", "Renamed", "accepts_renamed", "renamed_property"]

F = TypeVar("F", bound=Callable[..., Any])

#: The release whose front ends no longer take the old names.
REMOVED_IN = "0.2.0"


def _same(value: Any) -> Any:
    return value


def _accum_fp32_as_dtype(accum_fp32: Any) -> Any:
    return torch.float32 if accum_fp32 else None


def _dtype_is_fp32(accum_dtype: Any) -> bool:
    return accum_dtype == torch.float32


class Renamed(NamedTuple):
    """A renamed option: its new name, the old value under the new name, and the new value read back under
    the old name (for :func:`renamed_property`)."""

    new: str
    to_new: Callable[[Any], Any] = _same
    to_old: Callable[[Any], Any] = _same
    #: how the old value reads under the new name, for the warning (empty when it is the same value;
    #: ``{old}`` and ``{new}`` stand for the names as the front end spells them)
    hint: str = ""


#: old name -> its new name (without the mixin's ``flce_`` prefix, which both carry there).
RENAMED = {
    "z_loss": Renamed("lse_square_scale"),
    "accum_fp32": Renamed(
        "accum_dtype",
        _accum_fp32_as_dtype,
        _dtype_is_fp32,
        hint=' ({old}=True is {new}="float32", {old}=False is {new}=None)',
    ),
    "labels": Renamed("target"),
}


def _warn(where: str, old: str, new: str, hint: str, stacklevel: int) -> None:
    warnings.warn(
        f"{where}: {old!r} is deprecated and will be removed in lightning-flce {REMOVED_IN}; use {new!r}"
        + hint.format(old=old, new=new),
        FutureWarning,
        stacklevel=stacklevel + 1,
    )


def accepts_renamed(*old_names: str, prefix: str = "") -> Callable[[F], F]:
    """Decorator: the function also takes the keywords ``prefix + old`` of :data:`RENAMED` for each of
    ``old_names``, as ``prefix + new`` (converted), with a ``FutureWarning``. Its signature, as
    ``inspect.signature`` and ``LightningCLI`` see it, keeps only the new names. Passing both names raises a
    ``TypeError``."""
    renames = tuple((prefix + old, prefix + RENAMED[old].new, RENAMED[old]) for old in old_names)

    def decorate(function: F) -> F:
        where = function.__qualname__.replace(".__init__", "")

        @functools.wraps(function)
        def with_old_names(*args: Any, **kwargs: Any) -> Any:
            for old, new, renamed in renames:  # a loop over a tuple: Dynamo traces it without a graph break
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{where} got both {old!r} (deprecated) and {new!r}; pass only {new!r}"
                        )
                    _warn(where, old, new, renamed.hint, stacklevel=2)
                    kwargs[new] = renamed.to_new(kwargs.pop(old))
            return function(*args, **kwargs)

        # the aliases it takes, old -> new (tests and docs/options.md are checked against it)
        with_old_names.__renamed__ = {old: new for old, new, _ in renames}  # type: ignore[attr-defined]
        return with_old_names  # type: ignore[return-value]

    return decorate


def renamed_property(old: str) -> property:
    """A read-only attribute ``old`` of :data:`RENAMED` that reads the attribute of its new name (converted
    back), with a ``FutureWarning``."""
    renamed = RENAMED[old]

    def read(self: Any) -> Any:
        _warn(type(self).__name__, old, renamed.new, renamed.hint, stacklevel=2)
        return renamed.to_old(getattr(self, renamed.new))

    return property(read, doc=f"Deprecated: read ``{renamed.new}``.")
