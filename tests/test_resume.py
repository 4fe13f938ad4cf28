"""Resuming with the shipped configs: `--ckpt_path last` continues at the step where the previous run stopped,
after a finished run and after Ctrl-C, with FLCEMemoryCallback's history continuing; a plain rerun starts afresh."""

import signal
import sys

import lightning.pytorch as pl
import pytest
import torch

from lightning_flce.callbacks import FLCEMemoryCallback, LastStepCheckpoint
from lightning_flce.cli import FLCELightningCLI

CHECKPOINTS = "lightning_logs/default/checkpoints"  # the default config's, relative to the working directory


class StartStep(pl.Callback):
    """Records the global step at which training starts (the step resumed from)."""

    def __init__(self) -> None:
        self.start_step = None

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step


class CtrlCAt(pl.Callback):
    """Raises KeyboardInterrupt, as Ctrl-C would, once the optimizer step `step` is done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-flce"])
    # Lightning ignores SIGINT from a KeyboardInterrupt on (so that a second Ctrl-C cannot cut its shutdown)
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def _fit(tmp_path, *args, callbacks=()):
    small = [
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        "--data.init_args.vocab_size=512",
        "--data.init_args.max_chars=300000",
        "--data.init_args.seq_len=32",
        "--data.init_args.batch_size=4",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]
    cli = FLCELightningCLI(
        args=["fit", "--config", "default", *small, *args], trainer_defaults={"callbacks": list(callbacks)}
    )
    return cli.trainer


def _memory_callback(trainer) -> FLCEMemoryCallback:
    (callback,) = [c for c in trainer.callbacks if isinstance(c, FLCEMemoryCallback)]
    return callback


def _saved_step(path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def test_finished_run_continues_at_its_last_step(tmp_path):
    # max_steps=5 between two validations (every 3 steps): last.ckpt must be of step 5, not of step 3
    first = _fit(tmp_path, "--trainer.max_steps=5", "--trainer.val_check_interval=3")
    assert first.global_step == 5
    assert _saved_step(tmp_path / CHECKPOINTS / "last.ckpt") == 5
    history = [row["step"] for row in _memory_callback(first).history]

    start = StartStep()
    second = _fit(
        tmp_path,
        "--trainer.max_steps=8",
        "--trainer.val_check_interval=3",
        "--ckpt_path=last",
        callbacks=[start],
    )
    assert start.start_step == 5
    assert second.global_step == 8
    assert _saved_step(tmp_path / CHECKPOINTS / "last.ckpt") == 8
    resumed = [row["step"] for row in _memory_callback(second).history]
    assert resumed[: len(history)] == history  # restored from the checkpoint
    assert len(resumed) == len(history) + 3 and resumed == sorted(set(resumed))


def test_interrupted_run_continues_at_the_interrupted_step(tmp_path):
    # no periodic checkpoint before step 3 (validation every 4): only the one saved on the interrupt exists
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown after a KeyboardInterrupt exits with 1
        _fit(tmp_path, "--trainer.max_steps=6", "--trainer.val_check_interval=4", callbacks=[CtrlCAt(3)])
    last = tmp_path / CHECKPOINTS / "last.ckpt"
    assert _saved_step(last) == 3

    start = StartStep()
    second = _fit(
        tmp_path,
        "--trainer.max_steps=6",
        "--trainer.val_check_interval=4",
        "--ckpt_path=last",
        callbacks=[start],
    )
    assert start.start_step == 3
    assert second.global_step == 6
    steps = [row["step"] for row in _memory_callback(second).history]
    assert len(steps) == 6 and steps == sorted(set(steps))  # 3 steps before the interrupt, 3 after
    assert _saved_step(last) == 6


def test_a_plain_rerun_starts_afresh(tmp_path):
    # Without --ckpt_path a rerun trains from step 0 (Lightning's OnExceptionCheckpoint would make it resume)
    _fit(tmp_path, "--trainer.max_steps=2")
    start = StartStep()
    trainer = _fit(tmp_path, "--trainer.max_steps=2", callbacks=[start])
    assert start.start_step == 0 and trainer.global_step == 2


def test_without_a_checkpoint_last_starts_from_scratch(tmp_path):
    # `--ckpt_path last` can be set before the first run: Lightning warns and trains from step 0
    start = StartStep()
    with pytest.warns(UserWarning, match="no last checkpoint"):
        trainer = _fit(tmp_path, "--trainer.max_steps=2", "--ckpt_path=last", callbacks=[start])
    assert start.start_step == 0 and trainer.global_step == 2


def test_last_step_checkpoint_requires_save_last(tmp_path):
    with pytest.raises(ValueError, match="save_last"):
        LastStepCheckpoint(dirpath=tmp_path, save_last=False)
