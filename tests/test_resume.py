"""Resuming with the shipped configs: `--ckpt_path last` continues at the step where the previous run stopped,
after a finished run and after Ctrl-C or SIGTERM (whose line names the checkpoint and the command that resumes),
with FLCEMemoryCallback's history continuing and validation at its interval; a plain rerun starts afresh and
overwrites last.ckpt; a checkpoint of another model is never loaded (its own folder, or refused)."""

import logging
import os
import shlex
import signal
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_flce.callbacks import FLCEMemoryCallback, LastStepCheckpoint
from lightning_flce.callbacks.checkpoint import resume_command, resume_hint
from lightning_flce.callbacks.checkpoint_identity import (
    IDENTITY_KEY,
    CheckpointModelMismatch,
    check_resumed_model,
    model_identity,
)
from lightning_flce.cli import FLCELightningCLI
from lightning_flce.models import TinyGPT

# the default config's, relative to the working directory: "lightning_logs/default/{model}/checkpoints"
CHECKPOINTS = "lightning_logs/default/tinygpt/checkpoints"


class StartStep(pl.Callback):
    """Records the global step at which training starts (the step resumed from)."""

    def __init__(self) -> None:
        self.start_step = None

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step


class ValidationSteps(pl.Callback):
    """Records the global step at which each validation (not the sanity check) ran."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.steps.append(trainer.global_step)


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


class CtrlCInBackward(pl.Callback):
    """Raises KeyboardInterrupt in the backward of the batch after optimizer step `step`: Ctrl-C mid-batch."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


class SigtermAt(pl.Callback):
    """Sends this process a SIGTERM, as a cluster's preemption would, once the optimizer step `step` is done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class Lines(logging.Handler):
    """Collects the messages of Lightning's loggers (rank_zero_info)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def lightning_lines():
    handler = Lines()
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.INFO)  # rank_zero_info's level, whatever an earlier test left
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def _small(tmp_path) -> list:
    return [
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


def _fit(tmp_path, *args, callbacks=()):
    cli = FLCELightningCLI(
        args=["fit", "--config", "default", *_small(tmp_path), *args],
        trainer_defaults={"callbacks": list(callbacks)},
    )
    return cli.trainer


def _memory_callback(trainer) -> FLCEMemoryCallback:
    (callback,) = [c for c in trainer.callbacks if isinstance(c, FLCEMemoryCallback)]
    return callback


def _saved_step(path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def test_finished_run_continues_at_its_last_step(tmp_path):
    # max_steps=5 between two validations (every 3 steps): last.ckpt must be of step 5, not of step 3
    validations = ValidationSteps()
    first = _fit(tmp_path, "--trainer.max_steps=5", "--trainer.val_check_interval=3", callbacks=[validations])
    assert first.global_step == 5
    assert validations.steps == [3]
    assert _saved_step(tmp_path / CHECKPOINTS / "last.ckpt") == 5
    history = [row["step"] for row in _memory_callback(first).history]

    start, validations = StartStep(), ValidationSteps()
    second = _fit(
        tmp_path,
        "--trainer.max_steps=8",
        "--trainer.val_check_interval=3",
        "--ckpt_path=last",
        callbacks=[start, validations],
    )
    assert start.start_step == 5
    assert second.global_step == 8
    assert validations.steps == [6]  # still every 3 steps counted from 0
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


def test_a_plain_rerun_starts_afresh_and_replaces_last_ckpt(tmp_path):
    # Without --ckpt_path a rerun trains from step 0 (Lightning's OnExceptionCheckpoint would make it resume)
    folder = tmp_path / CHECKPOINTS
    _fit(tmp_path, "--trainer.max_steps=4", "--trainer.val_check_interval=2")
    assert sorted(os.listdir(folder)) == ["last.ckpt"]  # no periodic epoch=..-step=...ckpt beside it
    assert _saved_step(folder / "last.ckpt") == 4
    start = StartStep()
    trainer = _fit(tmp_path, "--trainer.max_steps=3", "--trainer.val_check_interval=2", callbacks=[start])
    assert start.start_step == 0 and trainer.global_step == 3
    # overwritten, not last-v1.ckpt beside it (which `--ckpt_path last` would pick)
    assert sorted(os.listdir(folder)) == ["last.ckpt"]
    assert _saved_step(folder / "last.ckpt") == 3

    start = StartStep()
    _fit(tmp_path, "--trainer.max_steps=4", "--ckpt_path=last", callbacks=[start])
    assert start.start_step == 3


def test_without_a_checkpoint_last_starts_from_scratch(tmp_path):
    # `--ckpt_path last` can be set before the first run: Lightning warns and trains from step 0
    start = StartStep()
    with pytest.warns(UserWarning, match="no last checkpoint"):
        trainer = _fit(tmp_path, "--trainer.max_steps=2", "--ckpt_path=last", callbacks=[start])
    assert start.start_step == 0 and trainer.global_step == 2


def test_last_step_checkpoint_requires_save_last(tmp_path):
    with pytest.raises(ValueError, match="save_last"):
        LastStepCheckpoint(dirpath=tmp_path, save_last=False)


def test_interrupt_mid_batch_says_how_to_resume_and_validation_keeps_its_interval(
    tmp_path, monkeypatch, lightning_lines
):
    # Ctrl-C in the backward of step 6: last.ckpt of step 5, and the line that names it and the command
    args = [
        "fit",
        "--config",
        "default",
        *_small(tmp_path),
        "--trainer.max_steps=12",
        "--trainer.val_check_interval=4",
    ]
    monkeypatch.setattr(sys, "argv", ["lightning-flce", *args])
    validations = ValidationSteps()
    with pytest.raises(SystemExit):
        FLCELightningCLI(args=args, trainer_defaults={"callbacks": [CtrlCInBackward(5), validations]})
    assert validations.steps == [4]
    last = tmp_path / CHECKPOINTS / "last.ckpt"
    assert _saved_step(last) == 5

    (line,) = [message for message in lightning_lines if message.startswith("Ctrl-C")]
    assert f"step 5 is in {last}" in line
    command = line.splitlines()[-1].strip()
    assert shlex.split(command) == ["lightning-flce", *args, "--ckpt_path", "last"]

    start, validations = StartStep(), ValidationSteps()
    cli = FLCELightningCLI(
        args=shlex.split(command)[1:], trainer_defaults={"callbacks": [start, validations]}
    )
    assert start.start_step == 5 and cli.trainer.global_step == 12
    # every 4 steps counted from 0, as without the interrupt (Lightning's batch counter ran one ahead: 7, 11)
    assert validations.steps == [8, 12]


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
def test_sigterm_says_how_to_resume(tmp_path, lightning_lines):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SIGTERMException):
            _fit(
                tmp_path, "--trainer.max_steps=6", "--trainer.val_check_interval=4", callbacks=[SigtermAt(3)]
            )
    finally:
        signal.signal(signal.SIGTERM, handler)
    last = tmp_path / CHECKPOINTS / "last.ckpt"
    assert _saved_step(last) == 3
    (line,) = [message for message in lightning_lines if message.startswith("SIGTERM")]
    assert f"step 3 is in {last}" in line
    # run through FLCELightningCLI(args=...) with sys.argv of no command: the Trainer.fit argument
    assert f"ckpt_path={str(last)!r}" in line


def test_another_model_of_the_same_config_gets_its_own_folder(tmp_path):
    # docs/adapters.md's LitGPT overlay over the default config: its checkpoints beside TinyGPT's, not over them
    pytest.importorskip("litgpt")
    overlay = tmp_path / "litgpt.yaml"
    overlay.write_text(
        "model:\n"
        "  class_path: lightning_flce.models.LitGPTCausalLM\n"
        "  init_args:\n"
        "    config: {n_layer: 1, n_head: 2, n_embd: 32, block_size: 32}\n"
    )
    _fit(tmp_path, "--trainer.max_steps=2")
    _fit(tmp_path, "--config", str(overlay), "--trainer.max_steps=1")
    litgpt_last = tmp_path / "lightning_logs/default/litgptcausallm/checkpoints/last.ckpt"
    saved = torch.load(litgpt_last, map_location="cpu", weights_only=True)  # as LightningCLI reads it
    assert saved[IDENTITY_KEY]["class"] == "lightning_flce.models.litgpt.LitGPTCausalLM"
    hparams = saved[IDENTITY_KEY]["hyper_parameters"]
    assert hparams["config"]["n_embd"] == 32 and "_class_path" not in hparams  # LightningCLI's own entry
    assert saved["global_step"] == 1
    assert _saved_step(tmp_path / CHECKPOINTS / "last.ckpt") == 2

    start = StartStep()
    trainer = _fit(tmp_path, "--trainer.max_steps=3", "--ckpt_path=last", callbacks=[start])
    assert type(trainer.lightning_module) is TinyGPT and start.start_step == 2


# --- the model check, with a Trainer of its own (a fixed dirpath shared by two models) ---

VOCAB, SEQ = 64, 8


class OtherGPT(TinyGPT):
    """Another class with TinyGPT's parameters."""


def _batches():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=generator)
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in tokens]


def _small_model(cls=TinyGPT, **kwargs):
    options = dict(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, warmup_steps=0)
    return cls(**{**options, **kwargs})


def _trainer_fit(model, dirpath, max_steps, ckpt_path=None, callbacks=()):
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[LastStepCheckpoint(dirpath=dirpath), *callbacks],
    )
    trainer.fit(model, DataLoader(_batches(), batch_size=2), ckpt_path=ckpt_path)
    return trainer


def test_resuming_into_another_model_is_refused_before_the_weights_load(tmp_path):
    dirpath = tmp_path / "shared"
    _trainer_fit(_small_model(), dirpath, max_steps=2)
    # the same class with another width: Lightning would fail in load_state_dict with size mismatches
    with pytest.raises(CheckpointModelMismatch) as wider:
        _trainer_fit(_small_model(d_model=32), dirpath, max_steps=3, ckpt_path="last")
    message = str(wider.value)
    assert str(dirpath / "last.ckpt") in message
    assert "checkpoint: lightning_flce.models.gpt.TinyGPT" in message
    assert "this run:   lightning_flce.models.gpt.TinyGPT" in message
    assert "d_model: 16 -> 32" in message
    assert "of another shape" in message and "tok_emb.weight [64, 16] -> [64, 32]" in message
    assert "drop --ckpt_path" in message and "dirpath" in message

    # another class with the same parameters: still another model
    with pytest.raises(CheckpointModelMismatch) as other:
        _trainer_fit(_small_model(OtherGPT), dirpath, max_steps=3, ckpt_path="last")
    assert "this run:   tests.test_resume.OtherGPT" in str(other.value) or "OtherGPT" in str(other.value)
    assert "checkpoint: lightning_flce.models.gpt.TinyGPT" in str(other.value)


def test_the_cli_reports_a_resume_into_another_model_in_a_few_lines(tmp_path, monkeypatch, capsys):
    from lightning_flce.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FLCE_DEBUG", raising=False)
    _fit(tmp_path, "--trainer.max_steps=1")
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["fit", "--config", "default", *_small(tmp_path), "--model.init_args.d_model=32"]
            + ["--trainer.max_steps=2", "--ckpt_path=last"]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "lightning-flce: error:" in err and "d_model: 128 -> 32" in err
    assert "Traceback" not in err


def test_resuming_with_changed_hyper_parameters_warns_and_resumes(tmp_path):
    dirpath = tmp_path / "shared"
    _trainer_fit(_small_model(), dirpath, max_steps=2)
    start = StartStep()
    with pytest.warns(UserWarning, match=r"changed hyper-parameters .*weight_decay: 0\.1 -> 0\.2"):
        trainer = _trainer_fit(
            _small_model(weight_decay=0.2), dirpath, max_steps=3, ckpt_path="last", callbacks=[start]
        )
    assert start.start_step == 2 and trainer.global_step == 3


def test_model_placeholder_keys_the_folder_by_class(tmp_path):
    template = str(tmp_path / "runs" / "{model}" / "checkpoints")
    _trainer_fit(_small_model(), template, max_steps=1)
    _trainer_fit(_small_model(OtherGPT), template, max_steps=2)
    assert _saved_step(tmp_path / "runs/tinygpt/checkpoints/last.ckpt") == 1
    assert _saved_step(tmp_path / "runs/othergpt/checkpoints/last.ckpt") == 2
    start = StartStep()
    _trainer_fit(_small_model(), template, max_steps=2, ckpt_path="last", callbacks=[start])
    assert start.start_step == 1


def test_a_checkpoint_without_the_identity_is_judged_by_its_parameters():
    # checkpoints written before the identity was stored: Lightning's hyper_parameters and the weights
    old = _small_model()
    checkpoint = {"state_dict": old.state_dict(), "hyper_parameters": dict(old.hparams)}
    check_resumed_model(checkpoint, _small_model())  # the same model: no error
    with pytest.raises(CheckpointModelMismatch, match="does not record") as error:
        check_resumed_model(checkpoint, _small_model(n_layers=2))
    assert "n_layers: 1 -> 2" in str(error.value)
    assert "missing from the checkpoint: blocks.1." in str(error.value)


def test_model_identity_is_plain_data():
    model = _small_model(flce_accum_dtype=torch.float64)
    model.hparams["_instantiator"] = "lightning.pytorch.cli.instantiate_module"  # as LightningCLI adds it
    identity = model_identity(model)
    assert "_instantiator" not in identity["hyper_parameters"]
    assert identity["class"] == "lightning_flce.models.gpt.TinyGPT"
    assert identity["hyper_parameters"]["d_model"] == 16
    assert identity["hyper_parameters"]["flce_accum_dtype"] == "torch.float64"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["lightning-flce", "fit", "--config", "default"],
            "lightning-flce fit --config default --ckpt_path last",
        ),
        (
            [
                "lightning-flce",
                "fit",
                "--config",
                "my run.yaml",
                "--ckpt_path",
                "a.ckpt",
                "--trainer.max_steps=9",
            ],
            "lightning-flce fit --config 'my run.yaml' --trainer.max_steps=9 --ckpt_path last",
        ),
        (["lightning-flce", "fit", "--ckpt_path=last"], "lightning-flce fit --ckpt_path last"),
        (["/nowhere/bin/lightning-flce", "fit"], "/nowhere/bin/lightning-flce fit --ckpt_path last"),
        (["train.py", "fit"], None),
        (["lightning-flce", "configs"], None),
        ([], None),
    ],
)
def test_resume_command(argv, expected):
    assert resume_command(argv) == expected


def test_resume_command_of_python_m(monkeypatch):
    import lightning_flce.__main__ as entry

    monkeypatch.setattr(sys, "executable", "/nowhere/python3")
    command = resume_command([entry.__file__, "fit", "--config", "default"])
    assert command == "/nowhere/python3 -m lightning_flce fit --config default --ckpt_path last"


def test_resume_hint_outside_the_cli():
    hint = resume_hint("Ctrl-C", "/ckpt/last.ckpt", 7, argv=["train.py"])
    assert hint == (
        "Ctrl-C: the checkpoint of step 7 is in /ckpt/last.ckpt. "
        "Resume with trainer.fit(..., ckpt_path='/ckpt/last.ckpt') (or ckpt_path='last')."
    )
