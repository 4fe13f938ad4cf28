"""What :class:`~lightning_flce.mixin.FLCEMixin` checks of the module it is mixed into, so that a mistake fails
early and says what to change: its ``flce_*`` keyword arguments (a misspelled one named with the closest
option), its head once the module is built (a mistyped ``flce_head``), and at fit start whether the strategy
can train a :class:`~lightning_flce.parallel.VocabParallelHead`.
"""

from __future__ import annotations

import abc
import difflib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Optional, TypeVar, cast

from lightning_flce.head import unwrap_head
from lightning_flce.head_discovery import HeadNotFoundError, resolve_head
from lightning_flce.parallel import VocabParallelHead

__all__ = [
    "ChecksHeadWhenBuilt",
    "check_head_when_built",
    "check_no_unknown_flce_options",
    "check_vocab_parallel_layout",
]

_Module = TypeVar("_Module")


def check_no_unknown_flce_options(
    kwargs: Mapping[str, Any], known: list[str], aliases: Mapping[str, str], later_classes: Iterable[type]
) -> None:
    """A misspelled ``flce_*`` option would otherwise reach ``LightningModule.__init__`` as an unexpected
    keyword argument of an unrelated class: name it and the option it was likely meant to be (``known``: the
    mixin's options; ``aliases``: deprecated name -> its new name, suggested as the new one). Names that a
    class after the mixin in the MRO takes (its own ``flce_`` argument) pass on to it."""
    taken_later = {
        name
        for cls in later_classes
        if "__init__" in vars(cls)
        for name in inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    }
    for name in kwargs:
        if name.startswith("flce_") and name not in taken_later:
            close = difflib.get_close_matches(name, [*known, *aliases], n=1, cutoff=0.75)
            hint = (
                f"; did you mean {aliases.get(close[0], close[0])!r}?"
                if close
                else f"; the options are {', '.join(known)}"
            )
            raise TypeError(f"FLCEMixin got an unknown option {name!r}{hint}")


class ChecksHeadWhenBuilt(abc.ABCMeta):
    """Checks ``flce_head`` once the module is built (:func:`check_head_when_built`): the mixin's ``__init__``
    runs before the subclass's ``__init__`` creates the head, so the check runs when the outermost ``__init__``
    has returned. (A wrapper of ``__init__`` would hide the subclasses' arguments from
    ``save_hyperparameters``, which reads the frames of the ``__init__`` chain.) An ``ABCMeta``, so that a module
    may also derive from an ``abc.ABC`` base (a class's metaclass must derive from each of its bases'
    metaclasses)."""

    def __call__(cls: type[_Module], *args: Any, **kwargs: Any) -> _Module:
        module = cast(_Module, type.__call__(cls, *args, **kwargs))
        check_head_when_built(module)
        return module


def check_head_when_built(module: Any) -> None:
    """Resolves the head of ``module`` (an ``FLCEMixin``) as soon as the module is built, so a mistyped
    ``flce_head`` (with a close match), a head that is not a module or a logit transform that cannot be applied
    fails at construction, not at fit. A head that does not exist yet is checked at fit start instead: no
    ``flce_head`` and no head found, an owner on the path that is still None, or a first attribute missing from
    a module that builds its layers in ``configure_model`` or ``setup`` (unless a submodule's name is close to
    the path)."""
    try:
        resolve_head(module, module.flce_head, module.flce_softcap)
    except HeadNotFoundError as err:
        owner_built_later = err.parent_missing or (
            err.parent_path == "" and err.suggestion is None and _builds_layers_lazily(type(module))
        )
        if not owner_built_later:
            raise
    except AttributeError:
        if module.flce_head is not None:
            raise


def _builds_layers_lazily(cls: type) -> bool:
    """Whether a class of the module overrides Lightning's ``configure_model`` or ``setup`` (where layers may be
    built after ``__init__``)."""
    for hook in ("configure_model", "setup"):
        owner = next((klass for klass in cls.__mro__ if hook in vars(klass)), None)
        if owner is not None and not owner.__module__.startswith(("lightning.", "pytorch_lightning.")):
            return True
    return False


def check_vocab_parallel_layout(module: Any, trainer: Any) -> None:
    """Checks the head of ``module`` (an ``FLCEMixin``; its errors raise at fit start, after ``configure_model``)
    and raises for the strategies that cannot train a vocab-parallel head (see ``FLCEMixin``'s docstring)."""
    head = unwrap_head(resolve_head(module, module.flce_head, module.flce_softcap).module)
    check_vocab_parallel_strategy(head, trainer, "FLCEMixin")


def whole_world_strategy(trainer: Any) -> Optional[str]:
    """The name of the data-parallel strategy the trainer's is or derives from (DDP, DeepSpeed or FSDP: each rank
    gets its own batches and every gradient is reduced over the whole world), else None (one device, or a strategy
    with its own process groups, as ModelParallelStrategy)."""
    names = {cls.__name__ for cls in type(trainer.strategy).__mro__}
    return next(
        (name for name in ("DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy") if name in names), None
    )


def check_vocab_parallel_strategy(head: Any, trainer: Any, owner: str) -> None:
    """Raises for the strategies that cannot train ``head`` when it is a :class:`VocabParallelHead` sharded over
    more than one rank (``owner`` names who trains it in the errors)."""
    if not isinstance(head, VocabParallelHead):
        return
    import torch.distributed as dist

    tp_size = dist.get_world_size(head.group)
    if tp_size == 1:
        return
    strategy = trainer.strategy
    found = whole_world_strategy(trainer)
    if found:
        raise ValueError(
            f"{owner}: the head is a VocabParallelHead sharded over {tp_size} ranks, but {type(strategy).__name__}"
            f" ({found}) reduces every gradient over the whole world, which would average head shards"
            " of different vocabulary rows. Run one single-device Trainer per TP rank (data replicated), or a"
            " strategy that reduces gradients over the data-parallel ranks only (ModelParallelStrategy)"
        )
    world_size = trainer.world_size
    if world_size > 1 and world_size % tp_size:
        raise ValueError(
            f"{owner}: the trainer's world size {world_size} is not a multiple of the VocabParallelHead's"
            f" group size {tp_size}; the head's group must be a tensor-parallel group inside the world"
        )
