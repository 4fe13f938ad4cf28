"""The autograd of the package's custom ops: registered once with ``torch.library``, run in eager mode by a plain
``torch.autograd.Function`` of the same ``setup_context`` and backward.

``CustomOpDef.register_autograd`` is what ``torch.compile``, the dispatch modes (``torch.utils.flop_counter``,
fake tensors) and direct ``torch.ops.lightning_flce`` calls see, and those keep it. In an eager call with gradients
its wrapper costs host time that grows with the square of the op's argument count: before ``setup_context`` it
rebuilds the schema's argument list once per argument (``torch._library.utils.fill_defaults`` reads
``schema.arguments``, a fresh list, in its loop): at the loss ops' 16-31 arguments 0.08-0.25 ms of a small call
on a 2-core CPU machine, and 0.47 ms of the distillation forward's 1.34 on an H100 host
(``benchmarks/experiments/call_overhead.py``, ``benchmarks/results/*_call_overhead_*``). RL and distillation run
the head once per micro-batch, often at shapes where the GPU finishes first, so :class:`OpWithAutograd` runs an
eager call through a ``torch.autograd.Function`` whose forward calls the op with grad mode off (the op's own
no-grad path, no ``fill_defaults``) and then the same ``setup_context``; its backward is the registered backward.
Both paths return the same tensors (``tests/test_op_autograd.py`` compares them bit for bit).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

SetupContext = Callable[[Any, tuple, Any], None]
Backward = Callable[..., tuple]

# ``torch._C`` probes of the state under which an eager call must keep torch.library's autograd: a dispatch mode
# (FLOP counter, fake tensors, tracing) and a torch.func transform see the op as registered.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _plain(value: Any) -> bool:
    """A non-tensor argument, or a tensor without ``__torch_dispatch__`` of its own (Tensor, Parameter)."""
    return not isinstance(value, Tensor) or type(value) in (Tensor, torch.nn.Parameter)


class OpWithAutograd:
    """A ``torch.library`` custom op with its autograd, called like the op (positional arguments, in schema
    order).

    Registers ``backward`` and ``setup_context`` as ``op``'s autograd. A call takes that registered path under
    ``torch.compile``, dispatch modes, ``torch.func`` transforms and tensor subclasses, and where no gradient is
    needed; an eager call with gradients takes :attr:`eager_function` (see the module's doc)."""

    def __init__(self, op: Any, backward: Backward, *, setup_context: SetupContext) -> None:
        op.register_autograd(backward, setup_context=setup_context)
        self.op = op

        def forward(ctx: Any, *args: Any) -> Any:
            # Inside Function.forward grad mode is off: the op dispatches through its no-grad path.
            output = op(*args)
            setup_context(ctx, args, output)
            return output

        name = op._name.split("::")[-1]
        #: The ``torch.autograd.Function`` of eager calls (its backward node is named after it).
        self.eager_function: Any = type(
            f"{name}_eager",
            (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(backward)},
        )

    def takes_eager_function(self, args: tuple) -> bool:
        """Whether a call with ``args`` runs :attr:`eager_function` (else the op with its registered autograd)."""
        if torch.compiler.is_compiling():  # first: dynamo must not trace the torch._C probes below
            return False
        if not torch.is_grad_enabled() or _dispatch_modes() or _functorch_active():
            return False
        tensors = [value for value in args if isinstance(value, Tensor)]
        return any(t.requires_grad for t in tensors) and all(_plain(t) for t in tensors)

    def __call__(self, *args: Any) -> Any:
        if self.takes_eager_function(args):
            return self.eager_function.apply(*args)
        return self.op(*args)
