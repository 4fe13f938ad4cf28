"""Finding a model's LM head, the logit transforms the model applies after it, and its logits path.

Used by :class:`~lightning_flce.mixin.FLCEMixin` at every loss and logits call (never cached: a tied,
resized or PEFT-wrapped head is found as it is now). Hugging Face models declare their transforms in their
config or as attributes: ``config.final_logit_softcapping`` (Gemma 2/3), ``logit_scale`` (Cohere:
``logits * logit_scale``) and ``config.logits_scaling`` (Granite: ``logits / logits_scaling``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flce.head import forward_bound_to, unwrap_head
from lightning_flce.parallel import VocabParallelHead


class ResolvedHead(NamedTuple):
    """An LM head as it is called, and the transforms of its logits."""

    #: the head module as the model calls it (possibly wrapped: FSDP1, PEFT)
    module: nn.Module
    #: logits are multiplied by it (None: 1)
    logit_scale: Optional[float]
    #: logits -> ``softcap * tanh(logits / softcap)`` after the scale (None: off)
    softcap: Optional[float]


def resolve_head(root: nn.Module, head_path: Optional[str], softcap: Optional[float]) -> ResolvedHead:
    """The LM head of ``root`` and its logit transforms.

    Args:
        root: the LightningModule (or model) that owns the head.
        head_path: attribute path of the head from ``root`` (``"model.lm_head"``); None:
            ``get_output_embeddings()`` of the Hugging Face model that is ``root`` or its only direct child that
            is one, else ``root.lm_head``.
        softcap: the user's softcap option; for a Hugging Face head it must equal the config's.

    Raises:
        AttributeError: no head at the path, or none found.
        TypeError: the head is not a module.
        ValueError: ``softcap`` disagrees with the model's config.
        NotImplementedError: the model's logit scale is a tensor.
    """
    hf_model = find_hf_model(root)
    if head_path is not None:
        head = root
        for name in head_path.split("."):
            if not hasattr(head, name):
                raise AttributeError(
                    f"flce_head={head_path!r}: {type(head).__name__} has no attribute {name!r}"
                )
            head = getattr(head, name)
    elif hf_model is not None:
        head = hf_model.get_output_embeddings()
        if head is None:
            raise AttributeError(
                f"{type(hf_model).__name__}.get_output_embeddings() returned None; set flce_head"
            )
    else:
        head = getattr(root, "lm_head", None)
        if head is None:
            raise AttributeError(
                f"{type(root).__name__} has no `lm_head`; set flce_head to the attribute path of the LM head"
            )
    if not isinstance(head, nn.Module):
        raise TypeError(f"The LM head must be an nn.Module, got {type(head).__name__}")
    if hf_model is None or head is not hf_model.get_output_embeddings():
        return ResolvedHead(head, None, softcap)
    return ResolvedHead(head, *hf_logit_transform(hf_model, softcap))


def find_hf_model(root: nn.Module) -> Optional[nn.Module]:
    """The Hugging Face model that is ``root`` or its only direct child with an LM head."""

    def is_hf_model(module: Any) -> bool:
        return callable(getattr(module, "get_output_embeddings", None)) and hasattr(module, "config")

    if is_hf_model(root):
        return root
    found = [child for child in root.children() if is_hf_model(child)]
    return found[0] if len(found) == 1 else None


def hf_logit_transform(
    hf_model: nn.Module, softcap: Optional[float] = None
) -> tuple[Optional[float], Optional[float]]:
    """(logit scale, softcap) that the Hugging Face model applies after its LM head; ``softcap`` (the user's
    option) must be None or the config's."""
    config = hf_model.config
    config_softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None and softcap != config_softcap:
        raise ValueError(
            f"flce_softcap={softcap} differs from the model's config.final_logit_softcapping={config_softcap};"
            " set the softcap in the model config so that inference applies it too"
        )
    scale = getattr(hf_model, "logit_scale", None)  # Cohere: logits * logit_scale
    if isinstance(scale, Tensor):
        raise NotImplementedError(
            f"{type(hf_model).__name__} has a tensor logit_scale (per-vocab or learned); FLCE supports scalars"
        )
    logits_scaling = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if logits_scaling is not None:
        scale = (1.0 if scale is None else scale) / logits_scaling
    return (None if scale is None or scale == 1.0 else float(scale)), config_softcap


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
    if resolved.softcap is not None:
        logits = resolved.softcap * torch.tanh(logits / resolved.softcap)
    return logits
