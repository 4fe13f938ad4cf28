"""What identifies the model a checkpoint holds, and the check that a resumed run loads the same model.

:func:`model_identity` records a LightningModule's class and hyper-parameters (``self.hparams``) as plain data;
:class:`~lightning_flce.callbacks.LastStepCheckpoint` stores it in every checkpoint under
:data:`IDENTITY_KEY`. :func:`check_resumed_model` compares a loaded checkpoint with the module it is about to be
loaded into: another class, or parameters of other names or shapes, raise :class:`CheckpointModelMismatch`
naming both models and what differs; the same class and parameters with changed hyper-parameters (a learning
rate, ``flce_impl``) only warn. A checkpoint written before the identity was stored is judged by its
parameters and Lightning's ``hyper_parameters`` entry.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional

import lightning.pytorch as pl

#: The checkpoint's top-level key for :func:`model_identity`.
IDENTITY_KEY = "lightning_flce_model"

_PLAIN = (bool, int, float, str, type(None))
_LISTED = 4  # parameter names shown per kind of difference


class CheckpointModelMismatch(ValueError):
    """A checkpoint holds another model than the one it was to be loaded into."""


def model_identity(pl_module: pl.LightningModule) -> dict[str, Any]:
    """The module's class (``module.QualName``) and hyper-parameters, as plain data."""
    cls = type(pl_module)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "hyper_parameters": _hyper_parameters(getattr(pl_module, "hparams", None) or {}),
    }


def check_resumed_model(
    checkpoint: Mapping[str, Any], pl_module: pl.LightningModule, path: Optional[object] = None
) -> None:
    """Raises :class:`CheckpointModelMismatch` if ``checkpoint`` holds another model than ``pl_module``: another
    class, or parameters that ``load_state_dict`` would refuse (missing or unexpected names under
    ``pl_module.strict_loading``, other shapes). Warns when only hyper-parameters differ."""
    here = model_identity(pl_module)
    stored = checkpoint.get(IDENTITY_KEY)
    there_class = stored["class"] if stored else None
    there_hparams = (
        stored["hyper_parameters"] if stored else _hyper_parameters(checkpoint.get("hyper_parameters") or {})
    )
    hparam_lines = _differences(there_hparams, here["hyper_parameters"])
    state = checkpoint.get("state_dict")
    param_lines = (
        _parameter_differences(state, pl_module, strict=getattr(pl_module, "strict_loading", True))
        if isinstance(state, Mapping)
        else []
    )
    other_class = there_class is not None and there_class != here["class"]
    where = f" {str(path)!r}" if path is not None else ""
    if other_class or param_lines:
        lines = [
            f"Cannot resume from the checkpoint{where}: it holds another model than this run's.",
            f"  checkpoint: {there_class or 'a model whose class it does not record (an older checkpoint)'}",
            f"  this run:   {here['class']}",
        ]
        if hparam_lines:
            lines.append("  hyper-parameters that differ (checkpoint -> this run):")
            lines += [f"    {line}" for line in hparam_lines]
        if param_lines:
            lines.append("  parameters that differ:")
            lines += [f"    {line}" for line in param_lines]
        lines.append(
            "Train this model from scratch (drop --ckpt_path, or ckpt_path=None), resume from a checkpoint of this "
            "model, or give the checkpoint callback a dirpath of its own (LastStepCheckpoint's '{model}' in "
            "dirpath keys the folder by the model's class)."
        )
        raise CheckpointModelMismatch("\n".join(lines))
    if hparam_lines:
        warnings.warn(
            f"Resuming from the checkpoint{where} with changed hyper-parameters (checkpoint -> this run): "
            + "; ".join(hparam_lines)
            + ". The weights fit; the values of this run apply from now on.",
            UserWarning,
            stacklevel=2,
        )


def _hyper_parameters(hparams: Mapping[str, Any]) -> dict[str, Any]:
    # without the entries LightningCLI adds (`_class_path`, `_instantiator`): a run from Python has none
    return {str(name): _plain(value) for name, value in hparams.items() if not str(name).startswith("_")}


def _plain(value: Any) -> Any:
    """``value`` as comparable plain data: containers recursively, other objects by a repr without an address."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def _differences(there: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    unset = "(unset)"
    return [
        f"{name}: {there.get(name, unset)!r} -> {here.get(name, unset)!r}"
        for name in sorted(set(there) | set(here))
        if there.get(name, unset) != here.get(name, unset)
    ]


def _parameter_differences(
    state: Mapping[str, Any], pl_module: pl.LightningModule, strict: bool
) -> list[str]:
    expected = {name: tuple(tensor.shape) for name, tensor in pl_module.state_dict().items()}
    found = {name: tuple(getattr(tensor, "shape", ())) for name, tensor in state.items()}
    lines = []
    if strict:
        missing = [name for name in expected if name not in found]
        unexpected = [name for name in found if name not in expected]
        lines += _listed("missing from the checkpoint", missing)
        lines += _listed("in the checkpoint only", unexpected)
    reshaped = [
        f"{name} {list(found[name])} -> {list(shape)}"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    lines += _listed("of another shape (checkpoint -> this run)", reshaped)
    return lines


def _listed(what: str, names: list[str]) -> list[str]:
    if not names:
        return []
    more = f", and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return [f"{len(names)} {what}: {', '.join(names[:_LISTED])}{more}"]
