"""Running code inside a module's own call: whether a call runs more than the module's forward (hooks), and
binding its forward to another function for one call. The fused loss runs as the head's forward so that
whatever hooks the head (FSDP, ZeRO-3, PEFT) runs around it (:mod:`lightning_flce.head`,
:mod:`lightning_flce.adapters`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

from torch import nn


def has_call_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs more than its forward: its own or global forward (pre-)hooks, which
    sharding (FSDP2, DeepSpeed ZeRO-3) uses to gather the weight, or backward hooks, which the call sets up."""
    hooks = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


@contextlib.contextmanager
def forward_bound_to(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Binds ``module.forward`` to ``forward`` for one call (an instance attribute shadows the class method)."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
