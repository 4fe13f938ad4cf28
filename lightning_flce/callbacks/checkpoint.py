"""LastStepCheckpoint: a ``ModelCheckpoint`` whose ``last.ckpt`` is the last step trained, for resuming.

Lightning's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only when it saves a periodic checkpoint
(after a validation, every ``every_n_train_steps``...): a run whose ``max_steps`` falls between two of them ends
with a ``last.ckpt`` of an earlier step, and ``--ckpt_path last`` then trains those steps again. This subclass
also writes ``last.ckpt`` when fit ends. Together with Lightning's ``OnExceptionCheckpoint`` (a checkpoint on
Ctrl-C or any other exception, found by the same ``ckpt_path="last"`` lookup) every way a run stops leaves a
checkpoint of the step it stopped at.

``dirpath`` must be a fixed directory, not one under the logger's ``version_N`` folder: the ``"last"`` lookup
of a new run searches the ModelCheckpoint's directory, and a new run's logger has a new version.

YAML (what the shipped configs use)::

    trainer:
      callbacks:
        - class_path: lightning_flce.callbacks.LastStepCheckpoint
          init_args:
            dirpath: lightning_logs/default/checkpoints
        - class_path: lightning.pytorch.callbacks.OnExceptionCheckpoint
          init_args:
            dirpath: lightning_logs/default/checkpoints
            filename: interrupted

Python::

    trainer = L.Trainer(callbacks=[LastStepCheckpoint(dirpath="ckpt"), OnExceptionCheckpoint("ckpt", "interrupted")])
    trainer.fit(model, ckpt_path="last")  # no checkpoint yet: starts at step 0 (Lightning warns)
"""

from typing import Any, Literal, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class LastStepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with ``save_last=True`` that also saves ``last.ckpt`` at the end of fit when the
    last periodic save was of an earlier step. Every other argument is ``ModelCheckpoint``'s."""

    def __init__(self, *args: Any, save_last: Union[bool, Literal["link"]] = True, **kwargs: Any) -> None:
        if not save_last:
            raise ValueError("LastStepCheckpoint exists to keep last.ckpt: save_last must be True or 'link'")
        super().__init__(*args, save_last=save_last, **kwargs)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_end(trainer, pl_module)
        # skips fast_dev_run, a step already saved, and stages other than fit
        if self._should_skip_saving_checkpoint(trainer):
            return
        # save_last="link" links to the newest top-k file, which is of an earlier step: write a real file.
        save_last, self.save_last = self.save_last, True
        try:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        finally:
            self.save_last = save_last
