"""Finding a model's LM head, the logit transforms the model applies after it, and its logits path.

Used by :class:`~lightning_flce.mixin.FLCEMixin` at every loss and logits call (never cached: a tied,
resized or PEFT-wrapped head is found as it is now).

The transforms follow one rule: every module on the path from the root (the LightningModule) to the head, the
head's *owners*, may declare a logit transform by an attribute of a name in :data:`LOGIT_TRANSFORMS` or in its
``config`` (and the config's ``text_config``); each declared transform is applied to the loss as the model
applies it to its logits, or the call is refused. That covers Hugging Face models (Gemma's
``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``, ...), LitGPT's ``GPT``
(``config.final_logit_softcapping``) and a custom module whose config carries one of those names.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flce.head import forward_bound_to, unwrap_head
from lightning_flce.kernels.transform_torch import transformed_logits
from lightning_flce.parallel import VocabParallelHead

TransformKind = Literal["multiply", "divide", "softcap"]

#: the attribute and config names of the logit transforms models apply after their LM head, and how:
#: ``multiply`` / ``divide`` the logits by the value, or ``softcap``: ``c * tanh(logits / c)`` after the scale
LOGIT_TRANSFORMS: dict[str, TransformKind] = {
    "logit_scale": "multiply",  # Cohere, Cohere 2, Aya Vision
    "lm_head_multiplier": "multiply",  # Falcon-H1
    "output_multiplier": "multiply",  # Muse (before its softcap)
    "logits_scaling": "divide",  # Granite, MiniCPM3 (HyperCLOVAX multiplies: _MULTIPLYING_LOGITS_SCALING)
    "final_logit_softcapping": "softcap",  # Gemma 2/3/4, PaliGemma, LitGPT's Config
    "output_logit_soft_cap": "softcap",  # xLSTM
}
#: model types whose ``logits_scaling`` multiplies the logits (``logits = lm_head(h) * logits_scaling``)
_MULTIPLYING_LOGITS_SCALING = ("hyperclovax",)
_MISSING = object()


class ResolvedHead(NamedTuple):
    """An LM head as it is called, and the transforms of its logits."""

    #: the head module as the model calls it (possibly wrapped: FSDP1, PEFT)
    module: nn.Module
    #: logits are multiplied by it (None: 1)
    logit_scale: Optional[float]
    #: logits -> ``softcap * tanh(logits / softcap)`` after the scale (None: off)
    softcap: Optional[float]


class HeadNotFoundError(AttributeError):
    """``flce_head`` names an attribute that is not there. ``parent_path`` is the path of the object that lacks
    it (``""``: the root); ``parent_missing`` is True when that object is None (a placeholder built later)."""

    def __init__(
        self, message: str, parent_path: str, parent_missing: bool, suggestion: Optional[str]
    ) -> None:
        super().__init__(message)
        self.parent_path = parent_path
        self.parent_missing = parent_missing
        self.suggestion = suggestion


class _Declaration(NamedTuple):
    where: str  # "GPT.config.final_logit_softcapping", for the errors
    name: str
    kind: TransformKind
    value: Any


def resolve_head(root: nn.Module, head_path: Optional[str], softcap: Optional[float]) -> ResolvedHead:
    """The LM head of ``root`` and its logit transforms.

    Args:
        root: the LightningModule (or model) that owns the head.
        head_path: attribute path of the head from ``root`` (``"model.lm_head"``); None:
            ``get_output_embeddings()`` of the Hugging Face model that is ``root`` or its only direct child that
            is one, else ``root.lm_head``.
        softcap: the user's softcap option; where an owner of the head declares a softcap it must equal it.

    Raises:
        HeadNotFoundError: no head at the path (an ``AttributeError``, with a close match when there is one).
        AttributeError: no head found without a path.
        TypeError: the head is not a module, or a declared transform is not a number.
        ValueError: ``softcap`` disagrees with a declared softcap, owners declare different values, or a value
            cannot be applied (a softcap <= 0, a zero divisor).
        NotImplementedError: a declared transform is a tensor (learned or per-vocab).
    """
    owners: list[Any]
    if head_path is not None:
        head, owners = follow_head_path(root, head_path)
    else:
        hf_model = find_hf_model(root)
        owners = [root]
        if hf_model is not None:
            # a method that nn.Module's attribute types do not know
            get_output_embeddings: Any = hf_model.get_output_embeddings
            head = get_output_embeddings()
            if head is None:
                raise AttributeError(
                    f"{type(hf_model).__name__}.get_output_embeddings() returned None (a model without an LM head);"
                    " set flce_head to the attribute path of the LM head"
                )
            if hf_model is not root:
                owners.append(hf_model)
        else:
            head = getattr(root, "lm_head", None)
            if head is None:
                raise AttributeError(
                    f"{type(root).__name__} has no `lm_head`; set flce_head to the attribute path of the LM head"
                    + _suggestion(root, "lm_head")
                )
    if not isinstance(head, nn.Module):
        raise TypeError(f"The LM head must be an nn.Module, got {type(head).__name__}")
    return ResolvedHead(head, *logit_transform(owners, softcap))


def follow_head_path(root: nn.Module, head_path: str) -> tuple[Any, list[Any]]:
    """The object at ``head_path`` from ``root`` and its owners (the objects on the path), the root first."""
    owners: list[Any] = [root]
    obj: Any = root
    names = head_path.split(".")
    for i, name in enumerate(names):
        if not hasattr(obj, name):
            parent_path = ".".join(names[:i])
            ancestors = {".".join(names[:j]) for j in range(1, len(names))}
            candidates = [path for path in _head_paths(root) if path not in ancestors]
            close = difflib.get_close_matches(head_path, candidates, n=1, cutoff=0.6)
            hint = f"; did you mean flce_head={close[0]!r}?" if close else ""
            what = (
                f"{parent_path} is None" if obj is None else f"{type(obj).__name__} has no attribute {name!r}"
            )
            raise HeadNotFoundError(
                f"flce_head={head_path!r}: {what}{hint}",
                parent_path,
                obj is None,
                close[0] if close else None,
            )
        obj = getattr(obj, name)
        if i < len(names) - 1:
            owners.append(obj)
    return obj, owners


def find_hf_model(root: nn.Module) -> Optional[nn.Module]:
    """The Hugging Face model that is ``root`` or its only direct child with an LM head."""
    if is_hf_model(root):
        return root
    found = [child for child in root.children() if is_hf_model(child)]
    return found[0] if len(found) == 1 else None


def is_hf_model(module: Any) -> bool:
    """Whether ``module`` looks like a Hugging Face model with an LM head (``get_output_embeddings``, ``config``)."""
    return callable(getattr(module, "get_output_embeddings", None)) and hasattr(module, "config")


def logit_transform(
    owners: list[Any], softcap: Optional[float] = None
) -> tuple[Optional[float], Optional[float]]:
    """(logit scale, softcap) that the head's owners declare (see the module docstring). ``softcap`` (the
    user's option) is applied where no owner decides the softcap; an owner that declares one (or declares it
    off: None in its config, or a Hugging Face model, whose forward decides its logits) makes a different
    ``softcap`` an error. Several owners declaring one name must agree (a wrapper and its model sharing a
    config do)."""
    found: dict[str, _Declaration] = {}
    softcap_decided_by: Optional[_Declaration] = None  # an owner that fixes the softcap (maybe as None)
    for declaration in _declarations(owners):
        if declaration.kind == "softcap" and (softcap_decided_by is None or softcap_decided_by.value is None):
            softcap_decided_by = declaration
        if declaration.value is None:
            continue
        earlier = found.setdefault(declaration.name, declaration)
        if not _same_value(earlier.value, declaration.value):
            raise ValueError(
                f"{earlier.where}={earlier.value!r} and {declaration.where}={declaration.value!r} declare one"
                " transform of the LM head's logits with different values; FLCE cannot tell which the model"
                " applies: make them agree"
            )
    scale, declared_softcap = 1.0, None
    for declaration in found.values():
        value = _as_number(declaration)
        if declaration.kind == "softcap":
            if value <= 0:
                raise ValueError(f"{declaration.where}={value}: a softcap must be > 0 (or None: off)")
            if declared_softcap is not None and declared_softcap.value != value:
                raise ValueError(
                    f"{declared_softcap.where}={declared_softcap.value} and {declaration.where}={value} declare"
                    " two softcaps of the LM head's logits; FLCE applies one: make them agree"
                )
            declared_softcap = declaration._replace(value=value)
        elif declaration.kind == "multiply":
            scale *= value
        else:
            if value == 0:
                raise ValueError(f"{declaration.where}=0: the logits cannot be divided by it")
            scale /= value
    if softcap_decided_by is not None:
        decided = None if declared_softcap is None else declared_softcap.value
        where = softcap_decided_by.where if declared_softcap is None else declared_softcap.where
        if softcap is not None and softcap != decided:
            raise ValueError(
                f"flce_softcap={softcap} differs from the model's {where.split('.', 1)[1]}={decided} ({where});"
                " set the softcap in the model config so that inference applies it too, and leave flce_softcap"
                " unset"
            )
        softcap = decided
    return (None if scale == 1.0 else scale), softcap


def _declarations(owners: list[Any]) -> list[_Declaration]:
    """Every transform an owner declares, None (off) included: by its own attribute (Cohere keeps
    ``logit_scale`` on the model), else in its config or the config's ``text_config`` (multimodal models). A
    Hugging Face model declares its softcap off when its config has none."""
    found = []
    for owner in owners:
        owner_name = type(owner).__name__
        config = getattr(owner, "config", None)
        text_config = _get(config, "text_config") if config is not None else None
        sources = [(owner_name, owner, False)]
        if config is not None:
            sources.append((f"{owner_name}.config", config, True))
        if text_config is not _MISSING and text_config is not None:
            sources.append((f"{owner_name}.config.text_config", text_config, True))
        softcap_declared = False
        for name, kind in LOGIT_TRANSFORMS.items():
            for where, source, is_config in sources:
                value = _get(source, name) if is_config else getattr(source, name, _MISSING)
                if value is _MISSING:
                    continue
                if name == "logits_scaling" and str(_get(source, "model_type")).startswith(
                    _MULTIPLYING_LOGITS_SCALING
                ):
                    kind = "multiply"
                found.append(_Declaration(f"{where}.{name}", name, kind, value))
                softcap_declared = softcap_declared or kind == "softcap"
                break  # the first source that has the name decides (the module's own attribute first)
        if not softcap_declared and is_hf_model(owner):
            found.append(_Declaration(f"{owner_name}.config.final_logit_softcapping", "", "softcap", None))
    return found


def _get(config: Any, name: str) -> Any:
    """``config.name`` of a config object or mapping (``_MISSING`` when absent)."""
    if isinstance(config, Mapping):
        return config.get(name, _MISSING)
    return getattr(config, name, _MISSING)


def _as_number(declaration: _Declaration) -> float:
    value = declaration.value
    if isinstance(value, Tensor):
        raise NotImplementedError(
            f"{declaration.where}: a tensor {declaration.name} (learned or per-vocab), which FLCE cannot apply"
            " inside the fused loss (it applies a float scale and a float softcap); make it a float if it is a"
            " constant, or compute this model's loss from its logits"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(
            f"{declaration.where}={value!r}: FLCE applies a finite number here (or None: off); set it to one"
        )
    return float(value)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return bool(a == b)


def _head_paths(root: nn.Module) -> list[str]:
    """The paths of the submodules that could be a head (those with a weight tensor)."""
    return [
        name
        for name, module in root.named_modules()
        if name and isinstance(getattr(module, "weight", None), Tensor)
    ]


def _suggestion(root: nn.Module, wanted: str) -> str:
    """``"; did you mean flce_head='model.lm_head'?"`` for a submodule named like ``wanted``, else ``""``."""
    paths = _head_paths(root)
    close = [path for path in paths if path.rsplit(".", 1)[-1] == wanted] or difflib.get_close_matches(
        wanted, paths, n=1, cutoff=0.6
    )
    return f"; did you mean flce_head={close[0]!r}?" if close else ""


def head_logits(resolved: ResolvedHead, hidden: Tensor) -> Tensor:
    """Logits of the head on ``hidden`` with its logit scale and softcap (the inference path)."""
    head = resolved.module
    module = unwrap_head(head)
    if isinstance(module, VocabParallelHead):
        # its own call gives this rank's columns only: all-gather the full [..., V]
        logits = module.gather_logits(hidden)
    elif isinstance(module, nn.Embedding):
        # the output matrix of a tied head: called (hooks gather a sharded weight) with a linear forward
        with forward_bound_to(module, lambda h: F.linear(h, module.weight)):
            logits = head(hidden)
    else:
        logits = head(hidden)
    if resolved.logit_scale is not None:
        logits = logits * resolved.logit_scale
    logits, _ = transformed_logits(logits, resolved.softcap)
    return logits
