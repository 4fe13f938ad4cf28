"""FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``) for language models that compute their loss with
FLCE: sharding helper and the registration of the step methods as FSDP forward methods."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import nn

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _fsdp2():
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    except ImportError:  # torch 2.4/2.5
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    return FSDPModule, fully_shard, register_fsdp_forward_method


def is_fsdp2_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return isinstance(module, _fsdp2()[0])


def fsdp2_unit_of(root: nn.Module, parameter: nn.Parameter) -> Optional[nn.Module]:
    """The FSDP2 unit in ``root``'s tree (``root`` included) that manages ``parameter``: the module ``fully_shard``
    was applied to whose parameters, less those of the units nested in it, hold it; None when no unit does. (A
    parameter tied into two modules belongs to the first unit sharded around it, e.g. a decoder's embeddings.)"""
    for unit in root.modules():
        if not is_fsdp2_module(unit):
            continue
        nested = {
            id(p)
            for other in unit.modules()
            if other is not unit and is_fsdp2_module(other)
            for p in other.parameters()
        }
        if any(p is parameter and id(p) not in nested for p in unit.parameters()):
            return unit
    return None


def register_fsdp_step_methods(module: nn.Module) -> list:
    """Registers the step methods that a LightningModule overrides as FSDP2 forward methods; returns their
    names. A no-op for a module that is not FSDP2-sharded, and for methods already registered.

    FSDP2 unshards a module's parameters around ``forward`` only. Lightning calls ``training_step`` (and the
    other steps) directly, and :class:`~lightning_flce.FLCEMixin` computes the loss inside them, so the
    parameters that the root FSDP unit manages (e.g. the embeddings, and a head tied to them) would still be
    sharded ``DTensor`` s there.
    """
    if not is_fsdp2_module(module):
        return []
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    registered = []
    for name in _STEP_METHODS:
        if isinstance(module, pl.LightningModule) and not is_overridden(name, module, pl.LightningModule):
            continue
        if register_fsdp_method(module, name):
            registered.append(name)
    return registered


def register_fsdp_method(module: nn.Module, name: str) -> bool:
    """Registers ``module.<name>`` as an FSDP2 forward method, so that calling it unshards the parameters of
    ``module``'s own FSDP unit as ``forward`` does (e.g. a model's ``hidden_states``, which a loss calls instead of
    ``forward``). Returns whether it did: not for a module that is not FSDP2-sharded, a method already registered
    (patched on the instance, by the user or an earlier call), or an attribute that is not callable."""
    if not is_fsdp2_module(module) or name in module.__dict__:
        return False
    if not callable(getattr(module, name, None)):
        return False
    _fsdp2()[2](module, name)
    return True


def fully_shard_lm(
    module: nn.Module,
    mesh: Optional[Any] = None,
    *,
    blocks: Iterable[nn.Module] = (),
    head: Optional[nn.Module] = None,
    register_steps: bool = True,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """FSDP2 for a language model that computes its loss with FLCE: ``fully_shard`` each of ``blocks``, the
    (untied) ``head`` as its own unit, then ``module`` as the root; then :func:`register_fsdp_step_methods`.

    Call it in ``configure_model`` under Lightning's ``ModelParallelStrategy``::

        def configure_model(self):
            if self.device_mesh is not None:
                fully_shard_lm(self, self.device_mesh["data_parallel"], blocks=self.blocks, head=self.lm_head)

    A head tied to the input embedding must stay in the root unit (``head=None``): FSDP2 cannot shard one
    parameter in two units, and this raises instead. The head's weight is unsharded by its own forward
    call (or the root's), which is where the fused loss reads it, so the op always sees the full ``[V, H]``
    weight and the gradient lands, reduce-scattered, in the sharded parameter. ``fully_shard_kwargs`` (e.g.
    ``mp_policy``, ``reshard_after_forward``) go to every ``fully_shard`` call. A module that is already
    sharded is left as it is (``configure_model`` may run again, e.g. for ``trainer.validate`` after ``fit``).
    """
    fsdp_module, fully_shard, _ = _fsdp2()
    if isinstance(module, fsdp_module):
        if register_steps:
            register_fsdp_step_methods(module)
        return module
    if head is not None:
        head_params = {id(p) for p in head.parameters()}
        head_modules = {id(m) for m in head.modules()}
        outside = {
            id(p) for m in module.modules() if id(m) not in head_modules for p in m.parameters(recurse=False)
        }
        if head_params & outside:
            raise ValueError(
                "the head shares a parameter with the rest of the model (tied embeddings): leave it in the root"
                " unit (head=None)"
            )
    for block in blocks:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    if head is not None:
        fully_shard(head, mesh=mesh, **fully_shard_kwargs)
    fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    if register_steps:
        register_fsdp_step_methods(module)
    return module
