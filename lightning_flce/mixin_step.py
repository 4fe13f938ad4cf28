"""The Lightning wiring of ``flce_normalize``: the part of :class:`~lightning_flce.mixin.FLCEMixin` (and of
:class:`~lightning_flce.models.DistillationModule`, whose ``normalize`` it is) that counts
each loss call's normalizer into the optimizer step, joins it to the step when Lightning back-propagates it, and
rescales the gradients once after the step's last backward (before gradient clipping and the callbacks'
``on_before_optimizer_step``). The arithmetic (token totals, the fp16 divisor ``D``, the gradient scale) is
:class:`~lightning_flce.normalization.StepNormalizer`'s; the class docstring of ``FLCEMixin`` says what the
user sees.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_flce.normalization import StepNormalizer, UnweightedTermWatch, scale_gradients

if TYPE_CHECKING:
    # for type checkers the mixin's parts are LightningModules: their hooks override LightningModule's (and
    # are checked against them), and the Lightning API they call on self is typed. At run time they are plain
    # classes that go before LightningModule in the bases.
    from lightning.pytorch import LightningModule as MixinBase
else:
    MixinBase = object

__all__ = ["MixinBase", "StepNormalization"]


class _NormalizeBeforeCallbacks(Callback):
    """Manual optimization: the mixin's step normalization, ahead of every other callback's hook."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Optimizer) -> None:
        if isinstance(pl_module, StepNormalization):
            pl_module.flce_normalize_gradients()


class StepNormalization(MixinBase):
    """The step normalization's part of the mixin: the one place a loss call's normalizer joins the step
    (:meth:`_flce_count_for_step`), the hooks that only it uses (``optimizer_step``, ``on_before_optimizer_step``,
    ``clip_gradients``), and its steps of the hooks it shares with the mixin's other parts, which
    ``FLCEMixin``'s hooks call in order. ``FLCEMixin.__init__`` makes the state declared here.

    A LightningModule without the mixin uses it the same way (``DistillationModule``): the part before
    ``LightningModule`` in its bases, the state made in ``__init__``, and its ``on_fit_start``,
    ``on_train_batch_start`` and ``on_before_backward`` calling ``_flce_start_fit_normalization`` and
    ``_flce_add_normalize_callback``, ``_flce_start_micro_batch``, ``_flce_commit_micro_batch``; its training
    loss goes through :meth:`_flce_count_for_step`."""

    #: the arithmetic of flce_normalize (token totals of the optimizer step, fp16 divisor, gradient scale)
    flce_step_normalizer: StepNormalizer
    _flce_unweighted_term_watch: UnweightedTermWatch
    _flce_last_loss_weight: Optional[Tensor]
    #: the option that chose the mode, as the module's users spell it (in error messages)
    _flce_normalize_option = "flce_normalize"

    @property
    def flce_normalize(self) -> str:
        return self.flce_step_normalizer.mode

    @property
    def flce_last_loss_weight(self) -> Optional[Tensor]:
        """Weight that makes another loss term (a micro-batch mean) count per token like the last ``flce_loss``
        output: its tokens over ``D`` under ``flce_normalize="step"`` in training, else 1 (a 0-d tensor; None
        before the first call). See the class docstring."""
        self._flce_unweighted_term_watch.mark_weight_read()
        return self._flce_last_loss_weight

    def _flce_count_for_step(
        self, loss_sum: Tensor, count: Tensor, *, unit: str = "tokens", capacity: Union[int, Tensor]
    ) -> Tensor:
        """A training call's ``loss_sum`` over its normalizer ``count`` (in ``unit``: tokens, sequences, ...)
        joined to the step, as the loss to back-propagate (the micro-batch mean's value; under ``"step"`` the
        gradient of the sum over ``D``). ``capacity``: the most this micro-batch could count, from which fp16
        gradients agree on ``D`` at the first call (read only then: a tensor costs a host sync)."""
        normalizer = self.flce_step_normalizer
        if normalizer.needs_divisor:
            normalizer.agree_first_divisor(int(capacity), self._flce_mean_over_ranks(count.device))
        normalizer.count(loss_sum, count, unit)
        if not loss_sum.requires_grad:  # nothing to back-propagate: counted now
            normalizer.commit(self.trainer.global_step)
        loss, self._flce_last_loss_weight = normalizer.loss_to_backward(loss_sum, count)
        if normalizer.rescales:
            self._flce_unweighted_term_watch.record(loss)
        return loss

    def _flce_stage(self) -> Optional[str]:
        """The stage of the call in progress (only ``"train"`` calls join the step); None outside a Trainer."""
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return None
        if trainer.training:
            return "train"
        if trainer.sanity_checking or trainer.validating:
            return "val"
        if trainer.testing:
            return "test"
        return None

    def _flce_fp16_gradients(self) -> bool:
        return str(getattr(self.trainer, "precision", "")) in ("16-mixed", "16-true")

    def _flce_mean_over_ranks(self, device: torch.device) -> Optional[Callable[[Tensor], Tensor]]:
        trainer = self.trainer
        if trainer.world_size == 1:
            return None
        return lambda size: trainer.strategy.reduce(size.to(device), reduce_op="mean")

    # ----------------------------------------------------------------- hooks

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Union[Optimizer, LightningOptimizer],
        optimizer_closure: Optional[Callable[[], Any]] = None,
    ) -> None:
        """Normalizes the gradients right after the closure (the last backward of the step), so callbacks,
        ``on_before_optimizer_step`` and gradient clipping all see the normalized gradients."""
        if optimizer_closure is not None:
            optimizer_closure = functools.partial(
                self._flce_closure_then_normalize, optimizer_closure, optimizer
            )
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        # a no-op when optimizer_step (or, in manual optimization, the callback added at fit start) normalized
        self._flce_finish_step(optimizer)
        super().on_before_optimizer_step(optimizer)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        gradient_clip_val: Optional[Union[int, float]] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clips the normalized gradients: in manual optimization it normalizes first (automatic optimization
        has normalized by then, or the next training step raises for the override that skipped it)."""
        if not self.automatic_optimization:
            self._flce_finish_step(optimizer)
        super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------- helpers of the hooks FLCEMixin shares with its other parts

    def _flce_start_fit_normalization(self) -> None:
        """At fit start: fp16 gradients agree on ``D`` afresh at the first training call (this fit's ranks and
        batches may differ); DeepSpeed keeps gradients where ``"step"`` cannot rescale them."""
        self.flce_step_normalizer.start_fit(fp16_gradients=self._flce_fp16_gradients())
        if self.flce_normalize == "step" and "DeepSpeed" in type(self.trainer.strategy).__name__:
            option = self._flce_normalize_option
            raise ValueError(
                f"{option}='step' rescales param.grad, which DeepSpeed keeps in its own partitioned"
                f" buffers; use {option}='micro_batch' with DeepSpeed"
            )

    def _flce_add_normalize_callback(self) -> None:
        """Manual optimization: Lightning calls callbacks' ``on_before_optimizer_step`` before the module's, so
        the mixin's callback goes first in the list to normalize ahead of them."""
        if self.automatic_optimization:
            return
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]  # (set by Lightning's connector)
        if not any(isinstance(callback, _NormalizeBeforeCallbacks) for callback in callbacks):
            callbacks.insert(0, _NormalizeBeforeCallbacks())

    def _flce_start_micro_batch(self) -> None:
        """What a skipped batch (``training_step`` returned None) counted is never back-propagated: forget it."""
        self.flce_step_normalizer.discard_pending()
        self._flce_unweighted_term_watch.reset()

    def _flce_commit_micro_batch(self, loss: Tensor) -> None:
        """The micro-batch's loss calls are back-propagated now (``loss``): their counts join the step."""
        self.flce_step_normalizer.commit(self.trainer.global_step)
        # "step" rescales every gradient at the optimizer step for the LM loss's token sum, so a term added to
        # flce_loss's output without flce_last_loss_weight is silently weighted ~1 / tokens: warn once.
        if self._flce_unweighted_term_watch.should_warn(loss):
            rank_zero_warn(
                "FLCEMixin: the loss back-propagated in this training step has terms besides flce_loss's output."
                " With flce_normalize='step' every gradient is rescaled at the optimizer step for the LM loss's"
                " token sum, so another term (a micro-batch mean) keeps its weight only when multiplied by"
                " self.flce_last_loss_weight, e.g. `return self.flce_loss(hidden, labels) + aux *"
                " self.flce_last_loss_weight`; or use flce_normalize='micro_batch'. (Warned once.)"
            )

    # ------------------------------------------------------------ normalizing

    def flce_normalize_gradients(self) -> None:
        """Manual optimization: normalize the step's gradients now (see the class docstring); a no-op once done.
        Call it after the step's last ``manual_backward``, before reading gradients in ``training_step``."""
        self._flce_finish_step(None)

    def _flce_closure_then_normalize(
        self, closure: Callable[[], Any], optimizer: Union[Optimizer, LightningOptimizer]
    ) -> Any:
        result = closure()
        self._flce_finish_step(optimizer)
        return result

    def _flce_finish_step(self, optimizer: Union[Optimizer, LightningOptimizer, None]) -> None:
        """Sums the step's loss and tokens over ranks, logs ``train/loss`` and (``"step"``) rescales the grads:
        those of ``optimizer`` under automatic optimization (its only optimizer), else of every parameter
        (manual optimization may step several optimizers, and normalizes at the first)."""
        trainer = self.trainer
        # With a VocabParallelHead inside a DP x TP world, each token is counted once per TP rank here, and
        # world_size includes the TP ranks too: the TP factor cancels in the scale and the logged mean.
        # With one single-device Trainer per TP rank, world_size is 1 and the local count is the step's count.
        finished = self.flce_step_normalizer.finish(
            world_size=trainer.world_size,
            accumulation=trainer.accumulate_grad_batches if self.automatic_optimization else 1,
            fp16_gradients=self._flce_fp16_gradients(),
            sum_over_ranks=(
                (lambda totals: trainer.strategy.reduce(totals, reduce_op="sum"))
                if trainer.world_size > 1
                else None
            ),
        )
        if finished is None:
            return
        if finished.grad_scale is not None:
            if self.automatic_optimization and optimizer is not None:
                if isinstance(optimizer, LightningOptimizer):
                    optimizer = optimizer.optimizer
                params = [p for group in optimizer.param_groups for p in group["params"]]
            else:
                params = list(self.parameters())
            scale_gradients(params, finished.grad_scale)
        self.log(
            "train/loss",
            finished.mean_loss,
            on_step=True,
            on_epoch=True,
            prog_bar=True,
            batch_size=max(int(finished.num_tokens), 1),
            # the value is global already: Lightning's sync averages equal values (and does not warn)
            sync_dist=True,
        )
