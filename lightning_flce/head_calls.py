"""Running a fused loss inside an LM head's own call, on the head's operands: what the mixin's RL calls
(:mod:`lightning_flce.rl.head_calls`) and :class:`~lightning_flce.models.DistillationModule` compute once a head is
found (:func:`~lightning_flce.head_discovery.resolve_head`).

As for the cross-entropy (:class:`~lightning_flce.head.FLCEHeadLoss`), the head's weight is read only inside a call
of the head whose ``forward`` is bound to the loss, so that whatever hooks the head runs around the loss: FSDP2's
unsharding of a sharded head (and the reduce-scatter of its gradient), DeepSpeed ZeRO-3's gathering, PEFT's
``ModulesToSaveWrapper`` dispatch. A bare head, with no wrapper and no hooks, is used directly (which
``torch.compile`` can trace). The model's logit scale multiplies the hidden states and the bias; the softcap is
left to the loss. A PEFT LoRA head is computed as one linear map with its logits
(:func:`~lightning_flce.adapters.lora_head_loss`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

from torch import Tensor, nn

from lightning_flce.adapters import is_peft_lora_head, lora_head_loss
from lightning_flce.head import scaled_head_input, unwrap_head
from lightning_flce.head_discovery import ResolvedHead
from lightning_flce.module_calls import forward_bound_to, has_call_hooks
from lightning_flce.parallel import VocabParallelHead

__all__ = ["run_in_head"]


def run_in_head(
    resolved: ResolvedHead,
    hidden: Tensor,
    loss_of: Callable[[Tensor, Tensor, Optional[Tensor]], Any],
    *,
    caller: str,
    vocab_parallel: bool = False,
) -> Any:
    """``loss_of(hidden, weight, bias)`` inside the head's call, the head's logit scale applied to ``hidden`` and
    ``bias``. A tuple result comes back as a plain tuple (hooks that rebuild their outputs may not handle
    NamedTuples): the caller rebuilds its own type. ``caller`` names the feature in the errors, as their plural
    subject ("the RL calls ...", "DistillationModule's heads"). ``vocab_parallel``: the caller runs a vocab-parallel
    op for a :class:`~lightning_flce.parallel.VocabParallelHead` (its ``loss_of`` gets this rank's rows of the weight
    and bias; the head's group and ``vocab_start`` are the caller's to pass).

    Raises:
        NotImplementedError: for a :class:`~lightning_flce.parallel.VocabParallelHead` without ``vocab_parallel``.
        TypeError: for a head that does not compute ``F.linear(hidden, weight, bias)`` (nor a PEFT LoRA head).
        RuntimeError: when calling the head did not reach the module that holds the weight.
    """
    head = resolved.module
    module = unwrap_head(head)
    sharded = isinstance(module, VocabParallelHead)
    if sharded and not vocab_parallel:
        raise NotImplementedError(f"{caller} do not support a VocabParallelHead yet; use a replicated head")
    # (is_peft_lora_head raises for the PEFT layers the fused ops cannot compute)
    lora = not sharded and is_peft_lora_head(module)
    is_linear = isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
    if not (lora or is_linear or sharded or isinstance(module, nn.Embedding)):
        raise TypeError(
            "The LM head must compute F.linear(hidden, head.weight, head.bias): an nn.Linear that keeps"
            f" nn.Linear.forward or an nn.Embedding used as the tied output matrix; got {type(module).__name__}"
        )
    ran = []

    def with_operands(head_input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Any:
        head_input, bias = scaled_head_input(head_input, weight, bias, resolved.logit_scale)
        result = loss_of(head_input, weight, bias)
        return tuple(result) if isinstance(result, tuple) else result

    def as_forward(head_input: Tensor) -> Any:
        ran.append(True)
        if lora:  # one linear map with the LoRA head's logits (lightning_flce/adapters.py)
            return lora_head_loss(module, head_input, lambda ops, h: with_operands(h, ops.weight, ops.bias))
        return with_operands(head_input, cast(Tensor, module.weight), getattr(module, "bias", None))

    if head is module and "forward" not in module.__dict__ and not has_call_hooks(module):
        return as_forward(hidden)
    with forward_bound_to(module, as_forward):
        output = head(hidden)
    if not ran:
        raise RuntimeError(
            f"Calling the head {type(head).__name__} did not reach {type(module).__name__}.forward, so the loss of"
            f" {caller} was not computed; the model's head must be the module that holds the output weight"
        )
    return output
