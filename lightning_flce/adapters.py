"""Adapters on the LM head: the operands of the fused loss for a PEFT LoRA head.

A PEFT LoRA ``Linear`` computes ``base(x) + sum_a scale_a * B_a(A_a(dropout_a(x)))`` over its active, unmerged
adapters. The same logits are one linear map of concatenated operands::

    hidden' = cat([x, scale_a * A_a(dropout_a(x)) for a in adapters], -1)     # [N, H + sum r]
    weight' = cat([W, B_a.weight for a in adapters], 1)                        # [V, H + sum r]
    bias'   = b + sum_a scale_a * B_a.bias                                     # [V] (None without biases)

so ``fused_linear_cross_entropy(hidden', weight', labels, bias')`` is exact for any dropout and any number of
adapters, and autograd carries the gradients of ``A``, ``B``, ``x`` (and ``W`` if it is trainable) through the
concatenations. Cost: one copy of the weight, ``[V, H + sum r]`` in ``W``'s dtype, kept for backward; since
``weight'`` requires a gradient (``B`` does), backward computes the op's full ``[V, H + sum r]`` weight gradient
and drops the frozen ``W`` block: the head's backward costs what a trainable head's costs. The alternative, the
effective weight ``W + scale * B @ A``, needs the same ``[V, H]`` copy and the same full weight gradient, and is
exact only without dropout and for one adapter at a time, so the concatenation is used.

The low-rank activations are computed by calling ``lora_A`` and ``lora_dropout`` as PEFT does, and, where
those modules have hooks, ``W`` and ``B`` are read inside calls of ``base_layer`` and of each ``lora_B``
(nested, each module's ``forward`` bound to the next step): hooks that gather a sharded weight around a
module's call (DeepSpeed ZeRO-3 registers them on every module) see each weight in its gathered form.

PEFT is an optional dependency: it is never imported here; a head is recognised as a PEFT layer only when
``peft`` has been imported already (a PEFT head cannot exist otherwise).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import torch
from torch import Tensor, nn

from lightning_flce.module_calls import forward_bound_to, has_call_hooks

_Output = TypeVar("_Output")


class LinearOperands(NamedTuple):
    """The ``weight`` [V, K] and ``bias`` [V] (or None) of a linear map, read like a module's attributes."""

    weight: Tensor
    bias: Optional[Tensor]


def is_peft_lora_head(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA ``Linear`` whose loss :func:`lora_head_loss` computes.

    Raises:
        TypeError: for a PEFT tuner layer that the fused loss cannot compute (another tuner type, a LoRA
            variant such as DoRA, a LoRA layer over a quantized or non-linear base layer), naming it and what
            to do instead.
    """
    tuner_layer = _peft_class("peft.tuners.tuners_utils", "BaseTunerLayer")
    if tuner_layer is None or not isinstance(module, tuner_layer):
        return False
    lora_linear = _peft_class("peft.tuners.lora.layer", "Linear")
    name = f"{type(module).__module__}.{type(module).__qualname__}"
    if (
        lora_linear is None
        or not isinstance(module, lora_linear)
        or type(module).forward is not lora_linear.forward
    ):
        raise TypeError(
            f"The LM head is a PEFT {name} layer; the fused loss supports PEFT LoRA on the head only"
            " (peft.tuners.lora.layer.Linear, not quantized). Leave the head out of `target_modules` (train it fully"
            " with `modules_to_save=['lm_head']`), or use LoRA on it"
        )
    base = module.base_layer
    if not (isinstance(base, nn.Linear) and type(base).forward is nn.Linear.forward):
        raise TypeError(
            f"The LM head is a PEFT LoRA layer over a {type(base).__name__}; the fused loss needs the base layer to be"
            " an nn.Linear (F.linear(hidden, weight, bias)); leave the head out of `target_modules`"
        )
    for adapter in _unmerged_adapters(module):
        variants = getattr(module, "lora_variant", {})
        if adapter in variants or getattr(module, "use_dora", {}).get(adapter, False):
            variant = type(variants[adapter]).__name__ if adapter in variants else "DoRA"
            raise TypeError(
                f"The LM head's PEFT LoRA adapter {adapter!r} is a LoRA variant ({variant}: DoRA, aLoRA, ...), whose"
                " output is not base(x) + B(A(x)); the fused loss supports plain LoRA on the head. Use plain LoRA"
                " (e.g. use_dora=False) for the head, or leave it out of `target_modules`"
            )
    return True


def lora_head_loss(
    module: nn.Module, x: Tensor, loss_of: Callable[[LinearOperands, Tensor], _Output]
) -> _Output:
    """``loss_of(operands, hidden)`` of the PEFT LoRA ``module`` on its input ``x`` [..., H]: the operands and
    hidden states of one linear map that gives the module's logits (see the module docstring). Disabled
    adapters give the base layer's operands, as do merged ones (the base weight holds them)."""

    in_features = module.base_layer.in_features  # not its weight's shape: a sharded weight is empty here
    if x.shape[-1] != in_features:
        raise ValueError(
            f"hidden size {x.shape[-1]} does not match the LoRA head's in_features {in_features}"
        )
    adapters = _unmerged_adapters(module)
    if module.disable_adapters and module.merged:
        module.unmerge()  # as PEFT's forward does: disabled adapters leave the base weight alone
    lora_A, lora_B, dropout, scaling = module.lora_A, module.lora_B, module.lora_dropout, module.scaling
    low_rank = []
    for adapter in adapters:
        a = lora_A[adapter]
        low_rank.append(
            lora_A[adapter](dropout[adapter](_cast_input(module, x, a.weight.dtype))) * scaling[adapter]
        )
    modules = [module.base_layer, *(lora_B[adapter] for adapter in adapters)]
    module_inputs = [x, *low_rank]

    def innermost(inputs: list[Tensor]) -> _Output:
        # inside the calls of the base layer and of every lora_B: their weights are gathered here
        base_input, *low_rank_inputs = inputs
        base = module.base_layer
        weight = torch.cat([base.weight, *(lora_B[a].weight.to(base.weight.dtype) for a in adapters)], dim=1)
        hidden = torch.cat([base_input, *(low.to(base_input.dtype) for low in low_rank_inputs)], dim=-1)
        bias = base.bias
        for adapter in adapters:
            lora_bias = lora_B[adapter].bias
            if lora_bias is not None:
                scaled = lora_bias.to(base.weight.dtype) * scaling[adapter]
                bias = scaled if bias is None else bias + scaled
        return loss_of(LinearOperands(weight, bias), hidden)

    def call(index: int, received: list[Tensor]) -> Any:
        if index == len(modules):
            return innermost(received)
        # the module's forward gets its input as its hooks passed it on (cast by a mixed-precision hook, say)
        with forward_bound_to(modules[index], lambda own_input: call(index + 1, [*received, own_input])):
            return modules[index](module_inputs[index])

    if not any(map(has_call_hooks, modules)):
        # nothing to run around the reads (and torch.compile traces this, not the forward rebinding)
        return innermost(module_inputs)
    return call(0, [])


def _unmerged_adapters(module: nn.Module) -> list[str]:
    """The adapters whose low-rank product the module adds to the base output, in PEFT's order."""
    if module.disable_adapters or module.merged:
        return []
    return [adapter for adapter in module.active_adapters if adapter in module.lora_A]


def _cast_input(module: nn.Module, x: Tensor, dtype: torch.dtype) -> Tensor:
    # PEFT casts the adapters' input to their weights' dtype unless input casting is disabled
    if getattr(module, "cast_input_dtype_enabled", True) and x.dtype != dtype:
        return x.to(dtype)
    return x


def _peft_class(module_name: str, class_name: str) -> Optional[type]:
    module = sys.modules.get(module_name)
    return getattr(module, class_name, None) if module is not None else None
