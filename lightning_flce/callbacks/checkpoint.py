"""LastStepCheckpoint: a ``ModelCheckpoint`` whose ``last.ckpt`` is the step a run stopped at, for resuming.

Lightning's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only when it saves a periodic checkpoint
(after a validation, every ``every_n_train_steps``...): a run whose ``max_steps`` falls between two of them, or
that is stopped with Ctrl-C, leaves a ``last.ckpt`` of an earlier step, and ``--ckpt_path last`` trains those
steps again. This subclass also writes ``last.ckpt`` when fit ends and when it is interrupted (Ctrl-C, or the
SIGTERM of a cluster's preemption), so ``--ckpt_path last`` continues where the run stopped.

Lightning's own ``OnExceptionCheckpoint`` is not used for the interrupt: with one among the callbacks, Lightning
turns every ``fit(ckpt_path=None)`` into ``ckpt_path="last"``, so a plain rerun of a config (after editing it,
say) would silently resume from the previous run instead of starting afresh.

``dirpath`` must be a fixed directory, not one under the logger's ``version_N`` folder: the ``"last"`` lookup
of a new run searches the ModelCheckpoint's directory, and a new run's logger has a new version.

YAML (what the shipped configs use)::

    trainer:
      callbacks:
        - class_path: lightning_flce.callbacks.LastStepCheckpoint
          init_args:
            dirpath: lightning_logs/default/checkpoints

Python::

    trainer = L.Trainer(max_steps=1000, callbacks=[LastStepCheckpoint(dirpath="checkpoints")])
    trainer.fit(model, datamodule, ckpt_path="last")  # no checkpoint yet: starts at step 0 (Lightning warns)
"""

from typing import Any, Literal, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import exceptions as _pl_exceptions
from typing_extensions import override

# Ctrl-C, and Lightning's exception for SIGTERM (newer Lightning) where it has one. Other exceptions (a bug, an
# out-of-memory error) resume from the last periodic checkpoint: the state at such an error may be half a step.
_INTERRUPTS = (KeyboardInterrupt,) + (
    (_pl_exceptions.SIGTERMException,) if hasattr(_pl_exceptions, "SIGTERMException") else ()
)


class LastStepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with ``save_last=True`` that also saves ``last.ckpt`` at the end of fit and on an
    interrupt when the last periodic save was of an earlier step. Every other argument is ``ModelCheckpoint``'s.
    """

    def __init__(self, *args: Any, save_last: Union[bool, Literal["link"]] = True, **kwargs: Any) -> None:
        if not save_last:
            raise ValueError("LastStepCheckpoint exists to keep last.ckpt: save_last must be True or 'link'")
        super().__init__(*args, save_last=save_last, **kwargs)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_step(trainer)

    @override
    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        super().on_exception(
            trainer, pl_module, exception
        )  # ModelCheckpoint(save_on_exception=...) of newer Lightning
        if isinstance(exception, _INTERRUPTS):
            self._save_last_step(trainer)

    def _save_last_step(self, trainer: "pl.Trainer") -> None:
        # skips fast_dev_run, sanity checking, stages other than fit and a step already saved
        if self._should_skip_saving_checkpoint(trainer):
            return
        # save_last="link" would link to the newest top-k file, of an earlier step: write a real file here
        save_last, self.save_last = self.save_last, True
        try:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        finally:
            self.save_last = save_last
