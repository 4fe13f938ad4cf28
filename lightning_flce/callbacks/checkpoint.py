"""LastStepCheckpoint: a ``ModelCheckpoint`` whose ``last.ckpt`` is the step a run stopped at, of the run's
model, for resuming.

- **The step a run stopped at.** Lightning's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only
  when it saves a periodic checkpoint (after a validation, every ``every_n_train_steps``...): a run whose
  ``max_steps`` falls between two of them, or that is stopped with Ctrl-C, leaves a ``last.ckpt`` of an earlier
  step. This subclass also writes ``last.ckpt`` when fit ends and when it is interrupted (Ctrl-C, or the SIGTERM
  of a cluster's preemption), and then says on rank zero where it went and the command that resumes.
- **One file.** Without a ``monitor`` the periodic save *is* ``last.ckpt`` (``save_top_k=0``: no
  ``epoch=..-step=...ckpt`` beside it), and a rerun overwrites it (``enable_version_counter=False``: no
  ``last-v1.ckpt``, which ``ckpt_path="last"`` would then pick). With a ``monitor``, ``save_top_k`` is
  ``ModelCheckpoint``'s.
- **The same model.** ``"{model}"`` in ``dirpath`` becomes the LightningModule's class name in lower case, so
  two models trained from one config write to two folders. Every checkpoint records the model's class and
  hyper-parameters, and resuming into another model (another class, or parameters of other names or shapes)
  is refused before Lightning loads the weights, with a message naming both
  (:mod:`~lightning_flce.callbacks.checkpoint_identity`).
- **Validation on time after an interrupt.** A Ctrl-C in the middle of a batch leaves Lightning's batch
  counter one ahead of the optimizer steps, and a resumed run validated one step early (at 299, 399, 499 with
  ``val_check_interval=100``); the checkpoint saved on the interrupt counts finished batches only.

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
            dirpath: "lightning_logs/default/{model}/checkpoints"

Python::

    trainer = L.Trainer(max_steps=1000, callbacks=[LastStepCheckpoint(dirpath="checkpoints/{model}")])
    trainer.fit(model, datamodule, ckpt_path="last")  # no checkpoint yet: starts at step 0 (Lightning warns)
"""

from __future__ import annotations

import copy
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import exceptions as _pl_exceptions
from torch import Tensor
from typing_extensions import override

from lightning_flce.callbacks.checkpoint_identity import IDENTITY_KEY, check_resumed_model, model_identity

# Ctrl-C, and Lightning's exception for SIGTERM (newer Lightning) where it has one. Other exceptions (a bug, an
# out-of-memory error) resume from the last periodic checkpoint: the state at such an error may be half a step.
_INTERRUPTS = (KeyboardInterrupt,) + (
    (_pl_exceptions.SIGTERMException,) if hasattr(_pl_exceptions, "SIGTERMException") else ()
)
MODEL_PLACEHOLDER = "{model}"
_CLI_NAMES = ("lightning-flce", "lightning-flce.exe", "lightning-flce-script.py")


class LastStepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with ``save_last=True`` that also saves ``last.ckpt`` at the end of fit and on an
    interrupt, keeps a single ``last.ckpt`` without a ``monitor``, keys ``dirpath`` by the model with
    ``"{model}"`` and refuses to resume into another model. Every other argument is ``ModelCheckpoint``'s.

    Args:
        save_top_k: ``None`` (default): 0 without a ``monitor`` (``last.ckpt`` is the only file), else 1.
        enable_version_counter: ``False`` (default): a rerun overwrites ``last.ckpt`` instead of writing
            ``last-v1.ckpt``.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        *,
        save_last: Union[bool, Literal["link"]] = True,
        save_top_k: Optional[int] = None,
        enable_version_counter: bool = False,
        **kwargs: Any,
    ) -> None:
        if not save_last:
            raise ValueError("LastStepCheckpoint exists to keep last.ckpt: save_last must be True or 'link'")
        if save_top_k is None:
            save_top_k = 0 if monitor is None else 1
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            save_last=save_last,
            save_top_k=save_top_k,
            enable_version_counter=enable_version_counter,
            **kwargs,
        )
        # `{model}` is filled in per run (setup, and the "last" lookup that comes before it)
        self._dirpath_template = (
            str(self.dirpath) if self.dirpath is not None and MODEL_PLACEHOLDER in str(self.dirpath) else None
        )
        self._saving_on_interrupt = False
        self._restore_load: Optional[Callable[[], None]] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fill_dirpath(pl_module)
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._check_model_on_load(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._restore_load is not None:
            self._restore_load()
            self._restore_load = None
        super().teardown(trainer, pl_module, stage)

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Lightning resolves ckpt_path="last" before `setup`
        if trainer.lightning_module is not None:
            self._fill_dirpath(trainer.lightning_module)
        return super()._find_last_checkpoints(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        checkpoint[IDENTITY_KEY] = model_identity(pl_module)
        if self._saving_on_interrupt:
            _count_finished_batches_only(checkpoint)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_step(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        super().on_exception(trainer, pl_module, exception)  # ModelCheckpoint(save_on_exception=...)
        if isinstance(exception, _INTERRUPTS):
            self._saving_on_interrupt = True
            try:
                self._save_last_step(trainer)
            finally:
                self._saving_on_interrupt = False
            if self.last_model_path and trainer.state.fn == TrainerFn.FITTING:
                what = "Ctrl-C" if isinstance(exception, KeyboardInterrupt) else "SIGTERM"
                rank_zero_info(resume_hint(what, self.last_model_path, trainer.global_step))

    @override
    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if self.save_top_k == 0:
            # no periodic file beside last.ckpt: the periodic save is last.ckpt
            self._save_last_checkpoint(trainer, monitor_candidates)
        else:
            super()._save_topk_checkpoint(trainer, monitor_candidates)

    @override
    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        # ModelCheckpoint saves last.ckpt right after the periodic save, which with save_top_k=0 wrote it already
        written = self.last_model_path and self._last_checkpoint_saved == self.last_model_path
        if self.save_top_k == 0 and written and self._last_global_step_saved == trainer.global_step:
            return
        super()._save_last_checkpoint(trainer, monitor_candidates)

    def _save_last_step(self, trainer: pl.Trainer) -> None:
        # skips fast_dev_run, sanity checking, stages other than fit and a step already saved
        if self._should_skip_saving_checkpoint(trainer):
            return
        # save_last="link" would link to the newest top-k file, of an earlier step: write a real file here
        save_last, self.save_last = self.save_last, True
        try:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        finally:
            self.save_last = save_last

    def _fill_dirpath(self, pl_module: pl.LightningModule) -> None:
        if self._dirpath_template is not None:
            self.dirpath = self._dirpath_template.replace(MODEL_PLACEHOLDER, type(pl_module).__name__.lower())

    def _check_model_on_load(self, trainer: pl.Trainer) -> None:
        """Checks the checkpoint a fit resumes from before Lightning loads its weights.

        Lightning restores the module's weights before any callback's ``on_load_checkpoint``, and the weights of
        another model fail there with a list of missing and unexpected keys: the check wraps the strategy's
        ``load_model_state_dict`` for this fit (undone in ``teardown``).
        """
        strategy = trainer.strategy
        if self._restore_load is not None or "load_model_state_dict" in vars(strategy):
            return  # already wrapped (by this callback or another LastStepCheckpoint)
        load = strategy.load_model_state_dict

        def load_checked(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
            check_resumed_model(checkpoint, trainer.lightning_module, trainer.ckpt_path)
            return load(checkpoint, *args, **kwargs)

        strategy.load_model_state_dict = load_checked  # type: ignore[method-assign]

        def restore() -> None:
            if vars(strategy).get("load_model_state_dict") is load_checked:
                delattr(strategy, "load_model_state_dict")

        self._restore_load = restore


def _count_finished_batches_only(checkpoint: dict[str, Any]) -> None:
    """Rolls the fit loop's batch counters in ``checkpoint`` back to the last finished batch.

    An interrupt inside a batch (its data, forward or backward) leaves the batch counted as ``ready`` and
    ``started`` but not ``processed``. On resume Lightning resets only the per-epoch counter, so the run-wide
    counter, which ``val_check_interval`` counts with ``check_val_every_n_epoch=None``, stays one ahead of the
    optimizer steps and every later validation ran one step early. A batch interrupted in
    ``on_train_batch_end`` (processed) is left as it is: Lightning completes it on resume.
    """
    loops = checkpoint.get("loops") or {}
    progress = (loops.get("fit_loop") or {}).get("epoch_loop.batch_progress")
    if not progress:
        return
    progress = copy.deepcopy(progress)
    for counter in ("total", "current"):
        tracker = progress.get(counter)
        if tracker and tracker["processed"] < tracker["ready"]:
            tracker["ready"] = tracker["started"] = tracker["processed"]
    loops["fit_loop"]["epoch_loop.batch_progress"] = progress


def resume_hint(what: str, path: str, step: int, argv: Optional[Sequence[str]] = None) -> str:
    """The line printed on an interrupt: where the checkpoint is and how to resume.

    ``argv`` (default ``sys.argv``) of a ``lightning-flce fit`` (or ``python -m lightning_flce fit``) command
    gives that command with ``--ckpt_path last`` in place of any ``--ckpt_path``; other programs get the
    ``Trainer.fit`` argument.
    """
    head = f"{what}: the checkpoint of step {step} is in {path}."
    command = resume_command(sys.argv if argv is None else argv)
    if command is None:
        return f"{head} Resume with trainer.fit(..., ckpt_path={path!r}) (or ckpt_path='last')."
    return f"{head} Resume with:\n    {command}"


def resume_command(argv: Sequence[str]) -> Optional[str]:
    """``argv`` of a ``lightning-flce fit`` command, with ``--ckpt_path last``; ``None`` for other commands."""
    if not argv:
        return None
    program = argv[0]
    if os.path.basename(program) in _CLI_NAMES:
        prefix = [_shortest(program, "lightning-flce")]
    elif os.path.normpath(program).endswith(os.path.join("lightning_flce", "__main__.py")):
        prefix = [_shortest(sys.executable, "python"), "-m", "lightning_flce"]
    else:
        return None
    args = list(argv[1:])
    if not args or args[0] != "fit":
        return None
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return " ".join(shlex.quote(part) for part in [*prefix, *kept, "--ckpt_path", "last"])


def _shortest(path: str, name: str) -> str:
    """``name`` when the shell finds ``path`` under it, else ``path``."""
    found = shutil.which(name)
    if path == name or (found is not None and os.path.realpath(found) == os.path.realpath(path)):
        return name
    return path
