"""Tests of FLCEMemoryCallback: real CPU fits with a CSVLogger, the CUDA branch with mocks, and a real GPU run."""

import csv
import gc
import os
import pickle
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_flce.callbacks import FLCEMemoryCallback
from lightning_flce.callbacks import memory as memory_module

MIB = 2**20
HIDDEN, VOCAB, SEQ, BATCH = 8, 32, 5, 2
TOKENS = BATCH * SEQ  # N of each loss call
# the unfused head in fp32: the upcast logits (a no-op in fp32 makes them the GEMM's), log_softmax's output
# and logsumexp's temporary, 4 bytes each (tests/test_memory_model.py measures it)
UNFUSED_MIB = TOKENS * VOCAB * 12 / MIB


class TinyLM(LightningModule):
    """An LM head on random hidden states; it reports its logits shape and bytes like FLCEMixin does."""

    def __init__(self, num_batches: int = 16, report_bytes: bool = True, big_alloc_step: int = -1) -> None:
        super().__init__()
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.num_batches = num_batches
        self.report_bytes = report_bytes
        self.big_alloc_step = big_alloc_step

    def training_step(self, batch, batch_idx):
        hidden, target = batch
        if self.global_step == self.big_alloc_step:
            # a known 64 MiB spike, to check that the peak window sees it and is reset after the log
            spike = torch.empty(64 * MIB, dtype=torch.uint8, device=self.device)
            spike.fill_(1)
            del spike
        logits = self.head(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        self.flce_last_logits_shape = (target.numel(), VOCAB)
        if self.report_bytes:
            self.flce_last_logits_bytes = target.numel() * VOCAB * 4
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(self.num_batches * BATCH, SEQ, HIDDEN, generator=generator)
        target = torch.randint(0, VOCAB, (self.num_batches * BATCH, SEQ), generator=generator)
        return DataLoader(TensorDataset(hidden, target), batch_size=BATCH)


def _trainer(tmp_path, callback, **kwargs):
    kwargs.setdefault("log_every_n_steps", 1)
    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _read_metrics(trainer):
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as file:
        return list(csv.DictReader(file))


def _rows_with(rows, name):
    return [row for row in rows if row.get(name)]


def _proc_status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


CUDA_FUNCTIONS = (
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "reset_peak_memory_stats",
    "get_device_properties",
    "get_device_name",
)
GPU_TOTAL = 80 * 1024 * MIB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks against /proc/self/status")
def test_cpu_metrics_in_csv(tmp_path):
    callback = FLCEMemoryCallback()
    trainer = _trainer(tmp_path, callback, max_steps=4)
    with mock.patch.multiple(torch.cuda, **{name: mock.DEFAULT for name in CUDA_FUNCTIONS}) as cuda_mocks:
        trainer.fit(TinyLM())
    for name, cuda_mock in cuda_mocks.items():
        assert not cuda_mock.called, f"torch.cuda.{name} called on CPU"
    peak_hwm_mib = _proc_status_kib("VmHWM") / 1024

    rows = _rows_with(_read_metrics(trainer), "memory/peak_rss_mib")
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3]
    for row in rows:
        peak_rss, rss = float(row["memory/peak_rss_mib"]), float(row["memory/rss_mib"])
        # the logged peak is at least the logged RSS (the kernel's high-water mark can trail it)
        assert 0 < rss <= peak_rss
        # the high-water mark read after the fit bounds every peak logged during it, up to the kernel's
        # approximate per-CPU RSS counters (seen 2.4 MiB apart on a 32-core machine): 16 MiB of slack
        assert peak_rss <= peak_hwm_mib + 16
        assert float(row["memory/unfused_head_mib"]) == pytest.approx(UNFUSED_MIB, rel=1e-12)
        # so tiny a vocabulary saves nothing: the fused head's dW and chunk outweigh 12 bytes a logit
        assert float(row["memory/saved_by_fused_head_mib"]) == 0.0
        assert not row.get("memory/peak_allocated_mib")
    # the deprecated alias of saved_by_fused_head is gone from metrics.csv
    assert "memory/logits_avoided_mib" not in rows[0]
    # the in-memory history holds what the logger got
    assert [row["step"] for row in callback.history] == [0, 1, 2, 3]
    for logged, kept in zip(rows, callback.history):
        assert float(logged["memory/peak_rss_mib"]) == pytest.approx(kept["memory/peak_rss_mib"], rel=1e-6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_rss_readers_match_proc_status():
    current = memory_module._current_rss_bytes()
    peak = memory_module._peak_rss_bytes()
    vm_rss, vm_hwm = _proc_status_kib("VmRSS") * 1024, _proc_status_kib("VmHWM") * 1024
    # both read the same kernel counters a moment apart: a few MiB of tolerance
    assert abs(current - vm_rss) < 8 * MIB
    assert abs(peak - vm_hwm) < 8 * MIB


def test_head_figures_from_shape_when_bytes_missing(tmp_path):
    callback = FLCEMemoryCallback()
    _trainer(tmp_path, callback, max_steps=2).fit(TinyLM(report_bytes=False))
    assert [row["memory/unfused_head_mib"] for row in callback.history] == [UNFUSED_MIB] * 2


def test_head_figures_without_attributes():
    callback = FLCEMemoryCallback()
    trainer = SimpleNamespace(precision="32-true")
    module = SimpleNamespace()
    assert callback._head_figures(trainer, module) == (None, None, None)
    # only the bytes: taken as the module states them
    module.flce_last_logits_bytes = 7 * MIB
    assert callback._head_figures(trainer, module) == (None, 7.0, 7.0)
    # a shape: the unfused head's model; no [V, H] parameter, so nothing subtracted for the fused buffers
    module.flce_last_logits_shape = (3, 5)
    estimate, unfused, saved = callback._head_figures(trainer, module)
    assert unfused == saved == 3 * 5 * 12 / MIB
    assert estimate.hidden_size is None
    # the mixin's naive path reports 0 bytes: nothing saved
    module.flce_last_logits_bytes = 0
    assert callback._head_figures(trainer, module)[1:] == (3 * 5 * 12 / MIB, 0.0)
    module.flce_last_logits_bytes = None
    module.flce_naive = True
    assert callback._head_figures(trainer, module)[2] == 0.0
    # 64-true: everything in fp64
    module.flce_naive = False
    assert callback._head_figures(SimpleNamespace(precision="64-true"), module)[1] == 3 * 5 * 24 / MIB


@pytest.mark.parametrize("logits_precision", ["input", "fp32", "fp32_compensated"])
def test_head_figures_follow_the_loss_logits_precision(logits_precision):
    """The fused head's buffers are modelled with the loss's own ``logits_precision`` (fp32 chunk logits, the
    fallbacks' weight copies, fp32 GEMMs: other buffers than the default's, on this PyTorch path smaller for
    "fp32" as its fp32 chunk needs no upcast), read from the module's FLCEHeadLoss."""
    from lightning_flce.callbacks.memory_model import HeadMemoryModel
    from lightning_flce.head import FLCEHeadLoss

    vocab, hidden, tokens = 512, 16, 64
    module = torch.nn.Module()
    module.head = torch.nn.Linear(hidden, vocab, bias=False).bfloat16()
    module.flce_head_loss = FLCEHeadLoss(impl="torch", logits_precision=logits_precision)
    module.flce_last_logits_shape = (tokens, vocab)
    estimate, _, saved = FLCEMemoryCallback()._head_figures(SimpleNamespace(precision="bf16-true"), module)
    model = HeadMemoryModel(
        "bf16-true", torch.bfloat16, hidden, impl="torch", logits_precision=logits_precision
    )
    assert estimate == model.estimate(tokens, vocab)
    default = HeadMemoryModel("bf16-true", torch.bfloat16, hidden, impl="torch").estimate(tokens, vocab)
    assert (estimate.fused_bytes != default.fused_bytes) == (logits_precision != "input")


@pytest.mark.parametrize("shape", [(3,), (3, 5, 7), (3.5, 5), (-1, 5), "ab"])
def test_bad_logits_shape_raises(shape):
    with pytest.raises(ValueError, match="flce_last_logits_shape"):
        memory_module._logits_shape(SimpleNamespace(flce_last_logits_shape=shape))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"snapshot_steps": [2, -1]}, ValueError, "snapshot_steps"),
        ({"snapshot_steps": [1.5]}, ValueError, "snapshot_steps"),
        ({"snapshot_steps": "10"}, ValueError, "snapshot_steps"),
        ({"snapshot_max_entries": 0}, ValueError, "snapshot_max_entries"),
        ({"snapshot_max_entries": 1.5}, ValueError, "snapshot_max_entries"),
        ({"plot": "no"}, TypeError, "`plot` must be a bool"),  # a truthy string would switch the plot on
        ({"verbose": 0}, TypeError, "`verbose` must be a bool"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        FLCEMemoryCallback(**kwargs)


def test_one_snapshot_step_may_be_an_int():
    assert FLCEMemoryCallback(snapshot_steps=5).snapshot_steps == [5]
    assert FLCEMemoryCallback(snapshot_steps=[7, 3, 7]).snapshot_steps == [3, 7]


@pytest.mark.parametrize(("max_steps", "every", "accumulate"), [(7, 3, 1), (4, 2, 2)])
def test_log_every_n_steps(tmp_path, max_steps, every, accumulate):
    callback = FLCEMemoryCallback()
    trainer = _trainer(
        tmp_path, callback, max_steps=max_steps, log_every_n_steps=every, accumulate_grad_batches=accumulate
    )
    trainer.fit(TinyLM())
    expected_steps = [step - 1 for step in range(1, max_steps + 1) if step % every == 0]
    rows = _read_metrics(trainer)
    memory_steps = [int(row["step"]) for row in _rows_with(rows, "memory/peak_rss_mib")]
    assert memory_steps == expected_steps
    # the same steps at which Lightning wrote the module's own `self.log` values
    assert memory_steps == [int(row["step"]) for row in _rows_with(rows, "train_loss")]
    assert [row["step"] for row in callback.history] == expected_steps


def test_fast_dev_run_logs_every_step():
    """Under fast_dev_run Lightning logs every step (to a dummy logger): so does the callback."""
    callback = FLCEMemoryCallback(verbose=False)
    trainer = Trainer(
        fast_dev_run=3,
        accelerator="cpu",
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM())
    assert [row["step"] for row in callback.history] == [0, 1, 2]


def test_prog_bar(tmp_path):
    callback = FLCEMemoryCallback(prog_bar=True)
    trainer = _trainer(tmp_path, callback, max_steps=1)
    trainer.fit(TinyLM())
    # a short name in GiB, not the logger's MiB key
    assert set(trainer.progress_bar_metrics) == {"peak_rss_GiB"}
    assert trainer.progress_bar_metrics["peak_rss_GiB"] == pytest.approx(
        callback.history[-1]["memory/peak_rss_mib"] / 1024, rel=1e-6
    )
    assert "peak_rss_GiB" not in _read_metrics(trainer)[0]
    trainer = _trainer(tmp_path, FLCEMemoryCallback(), max_steps=1)
    trainer.fit(TinyLM())
    assert trainer.progress_bar_metrics == {}


class _PostfixProbe(Callback):
    """Reads the TQDM bar's postfix after the bar's own update of each batch."""

    def __init__(self, bar):
        self.bar = bar
        self.postfixes = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.postfixes.append(self.bar.train_progress_bar.postfix)


def test_prog_bar_text_is_short(tmp_path):
    """What the TQDM bar prints: `peak_rss_GiB=0.57`, not a truncated `memory/peak_rss_mib=...`."""
    bar = TQDMProgressBar()
    probe = _PostfixProbe(bar)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_steps=2,
        log_every_n_steps=1,
        logger=False,
        callbacks=[FLCEMemoryCallback(prog_bar=True, verbose=False), bar, probe],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM())
    postfix = probe.postfixes[-1]
    (figure,) = [part for part in postfix.split(", ") if part.startswith("peak_rss_GiB=")]
    assert len(figure) <= len("peak_rss_GiB=") + 5
    assert float(figure.split("=")[1]) > 0
    assert "memory/" not in postfix


def test_plot_written(tmp_path):
    callback = FLCEMemoryCallback(plot=True, verbose=False)
    trainer = _trainer(tmp_path, callback, max_steps=3)
    trainer.fit(TinyLM())
    with open(os.path.join(trainer.log_dir, "memory.png"), "rb") as image:
        assert image.read(8) == b"\x89PNG\r\n\x1a\n"
    # the machine's RAM is the capacity on CPU
    assert callback.capacity_bytes > callback.history[-1]["memory/peak_rss_mib"] * MIB


def test_plot_needs_matplotlib(monkeypatch):
    monkeypatch.setattr(memory_module, "_MATPLOTLIB_AVAILABLE", False)
    with pytest.raises(ModuleNotFoundError, match="matplotlib"):
        FLCEMemoryCallback(plot=True)


def test_summary_table(tmp_path):
    callback = FLCEMemoryCallback()
    callback.history = [
        {"step": 0, "memory/peak_rss_mib": 10.0, "memory/saved_by_fused_head_mib": 2.0},
        {"step": 1, "memory/peak_rss_mib": 30.0, "memory/saved_by_fused_head_mib": 2.0},
        {"step": 2, "memory/peak_rss_mib": 14.0, "memory/saved_by_fused_head_mib": 4.0},
    ]
    lines = callback.summary().splitlines()
    assert "3 logged steps" in lines[0]
    assert lines[2].split() == ["memory/peak_rss_mib", "30.0", "14.0"]
    assert lines[3].split() == ["memory/saved_by_fused_head_mib", "4.0", "2.0"]


def test_summary_covers_metrics_that_appear_later():
    callback = FLCEMemoryCallback()
    callback.history = [
        {"step": 0, "memory/peak_rss_mib": 5.0},
        {"step": 1, "memory/saved_by_fused_head_mib": 3.0},
    ]
    assert [line.split()[0] for line in callback.summary().splitlines()[2:]] == [
        "memory/peak_rss_mib",
        "memory/saved_by_fused_head_mib",
    ]


def test_plot_warns_when_nothing_logged(tmp_path):
    callback = FLCEMemoryCallback(plot=True)
    with pytest.warns(UserWarning, match="no step was logged"):
        _trainer(tmp_path, callback, max_steps=2, log_every_n_steps=5).fit(TinyLM())
    assert not os.path.exists(os.path.join(tmp_path, "logs", "version_0", "memory.png"))


def test_summary_printed_at_train_end(tmp_path):
    callback = FLCEMemoryCallback()
    with mock.patch.object(memory_module, "rank_zero_info") as info:
        _trainer(tmp_path, callback, max_steps=2).fit(TinyLM())
    info.assert_called_once_with(callback.summary())


def test_history_survives_resume(tmp_path):
    first = FLCEMemoryCallback()
    trainer = _trainer(tmp_path, first, max_steps=3)
    trainer.fit(TinyLM())
    ckpt_path = str(tmp_path / "after3.ckpt")
    trainer.save_checkpoint(ckpt_path)
    assert (
        torch.load(ckpt_path, weights_only=False)["callbacks"]["FLCEMemoryCallback"]["history"]
        == first.history
    )

    resumed = FLCEMemoryCallback()
    _trainer(tmp_path, resumed, max_steps=6).fit(TinyLM(), ckpt_path=ckpt_path)
    assert [row["step"] for row in resumed.history] == [0, 1, 2, 3, 4, 5]
    assert resumed.history[:3] == first.history


class ValidatedLM(TinyLM):
    def validation_step(self, batch, batch_idx):
        hidden, target = batch
        self.log("val_loss", F.cross_entropy(self.head(hidden).flatten(0, 1), target.flatten()))

    def val_dataloader(self):
        return self.train_dataloader()


def test_validation_steps_marked(tmp_path):
    callback = FLCEMemoryCallback(verbose=False)
    trainer = _trainer(tmp_path, callback, max_steps=7, val_check_interval=3, limit_val_batches=1)
    trainer.fit(ValidatedLM())
    # after the optimizer steps of index 2 and 5; the sanity check is not a validation of the run
    assert callback.validation_steps == [2, 5]
    # a standalone validation is not part of the fit's picture
    trainer.validate(ValidatedLM(), verbose=False)
    assert callback.validation_steps == [2, 5]


def test_state_round_trip_and_old_checkpoints():
    callback = FLCEMemoryCallback()
    callback.history = [{"step": 0, "memory/peak_allocated_mib": 5.0}]
    callback.validation_steps = [0]
    callback.peak_breakdown = memory_module.MemoryBreakdown(0, 5 * MIB, MIB, MIB, 2 * MIB)
    module = SimpleNamespace(flce_last_logits_shape=(TOKENS, VOCAB))
    callback.head_estimate = callback._head_figures(SimpleNamespace(precision="bf16-mixed"), module)[0]
    state = pickle.loads(pickle.dumps(callback.state_dict()))  # what a checkpoint holds: plain data
    resumed = FLCEMemoryCallback()
    resumed.load_state_dict(state)
    assert resumed.history == callback.history
    assert resumed.validation_steps == [0]
    assert resumed.peak_breakdown == callback.peak_breakdown
    assert resumed.head_estimate == callback.head_estimate
    assert resumed.summary() == callback.summary()
    # a checkpoint of an earlier version holds the history only
    old = FLCEMemoryCallback()
    old.load_state_dict({"history": callback.history})
    assert (old.history, old.validation_steps, old.peak_breakdown) == (callback.history, [], None)


def test_old_checkpoints_with_the_deprecated_alias():
    # earlier versions logged saved_by_fused_head twice, the second time as memory/logits_avoided_mib
    rows = [
        {"step": 0, "memory/peak_rss_mib": 10.0, "memory/saved_by_fused_head_mib": 2.0},
        {"step": 1, "memory/peak_rss_mib": 12.0, "memory/saved_by_fused_head_mib": 3.0},
    ]
    old_rows = [{**row, "memory/logits_avoided_mib": row["memory/saved_by_fused_head_mib"]} for row in rows]
    old_rows.append({"step": 2, "memory/peak_rss_mib": 11.0, "memory/logits_avoided_mib": 5.0})  # alias only
    state = pickle.loads(pickle.dumps({"history": old_rows, "validation_steps": [1]}))
    callback = FLCEMemoryCallback()
    callback.load_state_dict(state)
    assert callback.history == [
        *rows,
        {"step": 2, "memory/peak_rss_mib": 11.0, "memory/saved_by_fused_head_mib": 5.0},
    ]
    assert callback.validation_steps == [1]
    names = [line.split()[0] for line in callback.summary().splitlines()[2:]]
    assert names == ["memory/peak_rss_mib", "memory/saved_by_fused_head_mib"]
    assert "logits_avoided" not in callback.summary()
    assert state["history"] == old_rows  # the checkpoint's own data is left as it was


def test_validation_steps_and_history_continue_after_resume(tmp_path):
    first = FLCEMemoryCallback(verbose=False)
    trainer = _trainer(tmp_path, first, max_steps=4, val_check_interval=2, limit_val_batches=1)
    trainer.fit(ValidatedLM())
    ckpt_path = str(tmp_path / "after4.ckpt")
    trainer.save_checkpoint(ckpt_path)
    assert first.validation_steps == [1, 3]

    resumed = FLCEMemoryCallback(verbose=False)
    _trainer(tmp_path, resumed, max_steps=8, val_check_interval=2, limit_val_batches=1).fit(
        ValidatedLM(), ckpt_path=ckpt_path
    )
    assert [row["step"] for row in resumed.history] == list(range(8))
    assert resumed.history[:4] == first.history
    assert resumed.validation_steps == [1, 3, 5, 7]


# --- the CUDA branch on CPU, with torch.cuda mocked and the hooks driven by hand ---


def _fake_trainer(tmp_path, **overrides):
    attributes = {
        "global_step": 0,
        "log_every_n_steps": 1,
        "fast_dev_run": False,
        "should_stop": False,
        "world_size": 1,
        "global_rank": 0,
        "is_global_zero": True,
        "loggers": [mock.Mock()],
        "log_dir": str(tmp_path / "logs"),
        "default_root_dir": str(tmp_path),
        "strategy": mock.Mock(),
        "precision": "32-true",
        "optimizers": [],
        "sanity_checking": False,
    }
    attributes.update(overrides)
    return SimpleNamespace(**attributes)


def _fake_cuda_module():
    return SimpleNamespace(
        device=torch.device("cuda", 0),
        log=mock.Mock(),
        log_dict=mock.Mock(),
        flce_last_logits_shape=(TOKENS, VOCAB),
        parameters=lambda: iter([]),
    )


def _run_steps(callback, trainer, module, num_steps):
    for batch_idx in range(num_steps):
        callback.on_train_batch_start(trainer, module, None, batch_idx)
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, None, None, batch_idx)


@pytest.fixture
def cuda_mocks():
    """torch.cuda's statistics mocked; `manager.peak` is what max_memory_allocated returns (bytes)."""
    manager = mock.Mock()
    manager.peak = 300 * MIB
    values = {
        "max_memory_reserved": 512 * MIB,
        "memory_allocated": 100 * MIB,
        "get_device_properties": SimpleNamespace(total_memory=GPU_TOTAL),
        "get_device_name": "Fake GPU",
    }
    with mock.patch.multiple(torch.cuda, **{name: mock.DEFAULT for name in CUDA_FUNCTIONS}) as mocks:
        for name, cuda_mock in mocks.items():
            cuda_mock.return_value = values.get(name)
            manager.attach_mock(cuda_mock, name)
        mocks["max_memory_allocated"].side_effect = lambda device: manager.peak
        yield manager


def test_cuda_branch_mocked(tmp_path, cuda_mocks):
    callback = FLCEMemoryCallback(prog_bar=True)
    trainer, module = _fake_trainer(tmp_path, log_every_n_steps=2), _fake_cuda_module()
    cuda_mocks.attach_mock(module.log, "log")
    cuda_mocks.attach_mock(module.log_dict, "log_dict")
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    callback.on_train_start(trainer, module)
    assert callback.capacity_bytes == GPU_TOTAL
    with mock.patch.object(memory_module, "_peak_rss_bytes") as peak_rss:
        _run_steps(callback, trainer, module, 5)
    peak_rss.assert_not_called()

    device = module.device
    one_log = [
        mock.call.max_memory_allocated(device),
        mock.call.max_memory_reserved(device),
        mock.call.memory_allocated(device),
        mock.call.log_dict(
            {
                "memory/allocated_mib": 100.0,
                "memory/peak_allocated_mib": 300.0,
                "memory/peak_reserved_mib": 512.0,
                "memory/saved_by_fused_head_mib": TOKENS * VOCAB * 12 / MIB,
                "memory/unfused_head_mib": TOKENS * VOCAB * 12 / MIB,
            },
            logger=True,
            on_step=True,
            on_epoch=False,
        ),
        mock.call.log("peak_GiB", 300 / 1024, prog_bar=True, logger=False, on_step=True, on_epoch=False),
        mock.call.max_memory_allocated(device),
    ]
    # each logged step's breakdown is counted (one more read of the peak): the first, as there is none, the
    # second, as the first's window held the first step, which ran before any gradient existed
    one_log.append(mock.call.max_memory_allocated(device))
    first = [*one_log, mock.call.reset_peak_memory_stats(device)]
    second = [*one_log, mock.call.reset_peak_memory_stats(device)]
    calls = [c for c in cuda_mocks.mock_calls if c[0] not in ("get_device_properties", "get_device_name")]
    # a reset when training starts, then each logged step (global steps 2 and 4) ends with a reset
    assert calls == [mock.call.reset_peak_memory_stats(device), *first, *second]
    assert [row["step"] for row in callback.history] == [1, 3]
    assert callback.history[0]["memory/peak_reserved_mib"] == 512.0


def _count_cpu_tensors(monkeypatch):
    """MemoryBreakdown.measure without its device filter, so that CPU tensors stand in for CUDA ones."""
    measure = memory_module.MemoryBreakdown.measure.__func__
    monkeypatch.setattr(
        memory_module.MemoryBreakdown,
        "measure",
        classmethod(lambda cls, *args, device=None, **kwargs: measure(cls, *args, device=None, **kwargs)),
    )


def test_breakdown_at_the_peak_step_mocked(tmp_path, cuda_mocks, monkeypatch):
    _count_cpu_tensors(monkeypatch)
    weight = torch.nn.Parameter(torch.zeros(VOCAB, HIDDEN))  # the head: 1 KiB
    other = torch.nn.Parameter(torch.zeros(1024, 256))  # 1 MiB
    optimizer = torch.optim.Adam([weight, other])
    module = _fake_cuda_module()
    module.parameters = lambda: iter([weight, other, weight])  # tied: counted once
    trainer = _fake_trainer(tmp_path, optimizers=[optimizer])
    callback = FLCEMemoryCallback(verbose=False)
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    for step, peak_mib in enumerate([300, 700, 500]):
        cuda_mocks.peak = peak_mib * MIB
        if step == 1:  # gradients and Adam's state exist from this step on
            for parameter in (weight, other):
                parameter.grad = torch.ones_like(parameter)
            optimizer.step()
        _run_steps(callback, trainer, module, 1)
    breakdown = callback.peak_breakdown
    param_bytes = (VOCAB * HIDDEN + 1024 * 256) * 4
    assert (breakdown.step, breakdown.peak_bytes) == (1, 700 * MIB)
    assert breakdown.parameter_bytes == param_bytes
    assert breakdown.gradient_bytes == param_bytes
    # exp_avg and exp_avg_sq per parameter, and a 0-d fp32 step counter each
    assert breakdown.optimizer_state_bytes == 2 * param_bytes + 2 * 4
    assert breakdown.rest_bytes == 700 * MIB - 4 * param_bytes - 8
    # the hidden size comes from the [V, H] parameter: the fused head's buffers are subtracted
    assert callback.head_estimate.hidden_size == HIDDEN
    assert callback.head_estimate.fused_bytes > 0

    logger = mock.Mock()
    trainer.loggers = [logger]
    callback.on_train_end(trainer, module)
    # logged once, at the step of the peak
    logger.log_metrics.assert_called_once_with(breakdown.metrics(), step=1)
    metrics = breakdown.metrics()
    assert metrics["memory/peak_breakdown/parameters_mib"] == param_bytes / MIB
    assert sum(metrics.values()) == pytest.approx(700)

    summary = callback.summary()
    assert "Where the peak goes (step 1, 700.0 MiB):" in summary
    assert "fused head's chunk buffer" in summary
    (rest,) = [line for line in summary.splitlines() if "activations + temporaries" in line]
    assert float(rest.split()[3]) == pytest.approx(breakdown.rest_bytes / MIB, abs=0.05)


def test_cuda_plot_mocked(tmp_path, cuda_mocks):
    callback = FLCEMemoryCallback(plot=True, verbose=False)
    trainer, module = _fake_trainer(tmp_path), _fake_cuda_module()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    for peak_mib in (300, 900, 400):
        cuda_mocks.peak = peak_mib * MIB
        _run_steps(callback, trainer, module, 1)
    callback.on_validation_end(trainer, module)
    callback.on_train_end(trainer, module)
    path = tmp_path / "logs" / "memory.png"
    assert path.is_file()
    drawn = callback.save_plot(str(tmp_path / "again.png"))
    assert drawn["title"].startswith("GPU memory (Fake GPU): peak 900 MiB")
    # 80 GiB is far above 0.9 GiB: said in the title, not drawn
    assert not drawn["capacity_drawn"]
    assert drawn["capacity_note"] == "GPU 80.0 GiB, far above (the peak uses 1.1%)"
    assert drawn["ylim"][0] == 0
    assert callback.validation_steps == [2]


def test_breakdown_prefers_windows_after_the_first_step(tmp_path, cuda_mocks):
    callback = FLCEMemoryCallback(verbose=False)
    trainer, module = _fake_trainer(tmp_path), _fake_cuda_module()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    callback.on_train_start(trainer, module)
    for peak_mib in (900, 500, 600, 550):  # the first step's peak is the highest (warm-up, autotuning)
        cuda_mocks.peak = peak_mib * MIB
        _run_steps(callback, trainer, module, 1)
    assert (callback.peak_breakdown.step, callback.peak_breakdown.peak_bytes) == (2, 600 * MIB)


def test_memory_breakdown_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        FLCEMemoryCallback().memory_breakdown(SimpleNamespace(), SimpleNamespace())


def test_cuda_metrics_max_over_ranks(tmp_path, cuda_mocks):
    callback = FLCEMemoryCallback()
    # sorted names: allocated, peak_allocated, peak_reserved, saved_by_fused_head, unfused_head
    other_rank = torch.tensor([0.0, 999.0, 1.0, 4.0, 5.0], dtype=torch.float64)

    def reduce(tensor, reduce_op):
        assert reduce_op == "max"
        return torch.maximum(tensor, other_rank)

    trainer = _fake_trainer(tmp_path, world_size=2, strategy=SimpleNamespace(reduce=reduce))
    module = _fake_cuda_module()
    module.device = torch.device("cpu")  # the tensor sent to the collective is made on the module's device
    module.parameters = lambda: iter([])
    callback._cuda_device = torch.device("cuda", 0)
    _run_steps(callback, trainer, module, 1)
    assert callback.history == [
        {
            "step": 0,
            "memory/allocated_mib": 100.0,
            "memory/peak_allocated_mib": 999.0,
            "memory/peak_reserved_mib": 512.0,
            "memory/saved_by_fused_head_mib": 4.0,
            "memory/unfused_head_mib": 5.0,
        }
    ]


def test_missing_metric_on_every_rank_is_dropped(tmp_path, cuda_mocks):
    callback = FLCEMemoryCallback()
    trainer = _fake_trainer(
        tmp_path, world_size=2, strategy=SimpleNamespace(reduce=lambda tensor, reduce_op: tensor)
    )
    module = _fake_cuda_module()
    del module.flce_last_logits_shape
    module.device = torch.device("cpu")
    module.parameters = lambda: iter([])
    callback._cuda_device = torch.device("cuda", 0)
    _run_steps(callback, trainer, module, 1)
    for name in ("logits_avoided", "saved_by_fused_head", "unfused_head"):
        assert f"memory/{name}_mib" not in callback.history[0]


@pytest.fixture
def snapshot_mocks():
    manager = mock.Mock()
    record_patch = mock.patch.object(torch.cuda.memory, "_record_memory_history")
    dump_patch = mock.patch.object(torch.cuda.memory, "_dump_snapshot")
    with record_patch as record, dump_patch as dump:
        manager.attach_mock(record, "record")
        manager.attach_mock(dump, "dump")
        yield manager


def test_snapshot_steps_mocked(tmp_path, cuda_mocks, snapshot_mocks):
    callback = FLCEMemoryCallback(
        snapshot_steps=[1], snapshot_dir=str(tmp_path / "snaps"), snapshot_max_entries=77
    )
    trainer, module = _fake_trainer(tmp_path), _fake_cuda_module()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    callback.on_train_batch_start(trainer, module, None, 0)
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, module, None, None, 0)
    assert snapshot_mocks.mock_calls == []

    callback.on_train_batch_start(trainer, module, None, 1)
    assert snapshot_mocks.mock_calls == [mock.call.record(enabled="all", max_entries=77)]
    trainer.global_step = 2
    callback.on_train_batch_end(trainer, module, None, None, 1)
    path = str(tmp_path / "snaps" / "memory_snapshot_step1_rank0.pickle")
    assert snapshot_mocks.mock_calls[1:] == [mock.call.dump(path), mock.call.record(enabled=None)]
    assert callback.snapshot_paths == [path]

    _run_steps(callback, trainer, module, 2)
    callback.on_train_end(trainer, module)
    assert len(snapshot_mocks.mock_calls) == 3


def test_snapshot_of_last_step_dumped_at_train_end(tmp_path, cuda_mocks, snapshot_mocks):
    callback = FLCEMemoryCallback(snapshot_steps=[0], verbose=False)
    trainer, module = _fake_trainer(tmp_path), _fake_cuda_module()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    callback.on_train_batch_start(trainer, module, None, 0)
    callback.on_train_batch_end(trainer, module, None, None, 0)  # no optimizer step: training stopped early
    callback.on_train_end(trainer, module)
    path = str(tmp_path / "logs" / "memory_snapshot_step0_rank0.pickle")
    assert snapshot_mocks.mock_calls[1:] == [mock.call.dump(path), mock.call.record(enabled=None)]


def test_record_on_oom_mocked(tmp_path, cuda_mocks, snapshot_mocks):
    callback = FLCEMemoryCallback(record_on_oom=True, snapshot_steps=[0])
    trainer, module = _fake_trainer(tmp_path, global_rank=1, is_global_zero=False), _fake_cuda_module()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    assert snapshot_mocks.mock_calls == [mock.call.record(enabled="all", max_entries=100_000)]
    # the step snapshot leaves the out-of-memory recording running
    _run_steps(callback, trainer, module, 1)
    step_path = str(tmp_path / "logs" / "memory_snapshot_step0_rank1.pickle")
    assert snapshot_mocks.mock_calls[1:] == [mock.call.dump(step_path)]

    oom_path = str(tmp_path / "logs" / "memory_snapshot_oom_rank1.pickle")
    with pytest.warns(UserWarning, match=r"\[rank: 1\].*" + oom_path.replace("\\", "\\\\")):
        callback.on_exception(trainer, module, torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert snapshot_mocks.mock_calls[2:] == [mock.call.dump(oom_path), mock.call.record(enabled=None)]
    assert callback.snapshot_paths == [step_path, oom_path]


def test_other_exception_stops_recording_without_dump(tmp_path, cuda_mocks, snapshot_mocks):
    callback = FLCEMemoryCallback(record_on_oom=True)
    trainer, module = _fake_trainer(tmp_path), _fake_cuda_module()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    callback.on_exception(trainer, module, RuntimeError("not memory"))
    assert snapshot_mocks.mock_calls == [
        mock.call.record(enabled="all", max_entries=100_000),
        mock.call.record(enabled=None),
    ]


def test_failed_oom_dump_keeps_quiet_about_itself(tmp_path, cuda_mocks, snapshot_mocks):
    callback = FLCEMemoryCallback(record_on_oom=True)
    trainer, module = _fake_trainer(tmp_path), _fake_cuda_module()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    snapshot_mocks.dump.side_effect = OSError("disk full")
    with pytest.warns(UserWarning, match="dumping the allocator history failed.*disk full"):
        callback.on_exception(trainer, module, torch.cuda.OutOfMemoryError("CUDA out of memory."))


def test_legacy_record_signature(tmp_path, cuda_mocks):
    calls = []

    def legacy_record(
        enabled, record_context=True, trace_alloc_max_entries=1, trace_alloc_record_context=False
    ):
        calls.append((enabled, trace_alloc_max_entries, trace_alloc_record_context))

    callback = FLCEMemoryCallback(record_on_oom=True, snapshot_max_entries=5)
    trainer, module = _fake_trainer(tmp_path), _fake_cuda_module()
    with mock.patch.object(torch.cuda.memory, "_record_memory_history", legacy_record):
        callback.setup(trainer, module, "fit")
        callback.on_fit_start(trainer, module)
        callback.teardown(trainer, module, "fit")
    assert calls == [(True, 5, True), (False, 1, False)]


def test_snapshot_options_ignored_on_cpu(tmp_path, snapshot_mocks):
    callback = FLCEMemoryCallback(snapshot_steps=[0], record_on_oom=True, verbose=False)
    with pytest.warns(UserWarning, match="need a CUDA device"):
        _trainer(tmp_path, callback, max_steps=2).fit(TinyLM())
    assert snapshot_mocks.mock_calls == []


# --- configuration ---


def test_yaml_config_with_lightning_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  log_every_n_steps: 3\n"
        "  callbacks:\n"
        "    - class_path: lightning_flce.callbacks.FLCEMemoryCallback\n"
        "      init_args:\n"
        "        prog_bar: true\n"
        "        snapshot_steps: [4, 2]\n"
        f"        snapshot_dir: {tmp_path / 'snaps'}\n"
        "        record_on_oom: true\n"
        "        snapshot_max_entries: 1000\n"
    )
    cli = LightningCLI(
        TinyLM,
        args=[
            "--config",
            str(config),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--seed_everything",
            "0",
            "--trainer.logger",
            "false",
        ],
        run=False,
        save_config_callback=None,
    )
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, FLCEMemoryCallback)]
    assert callback.prog_bar is True
    assert callback.snapshot_steps == [2, 4]
    assert callback.snapshot_dir == str(tmp_path / "snaps")
    assert callback.record_on_oom is True
    assert callback.snapshot_max_entries == 1000
    assert callback.plot is False


# --- several processes: the logged value is the max over ranks ---


class RankDependentLM(TinyLM):
    """Rank r reports (r + 1) times the logits, so the max over ranks is the last rank's."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.flce_last_logits_shape = (TOKENS * (self.global_rank + 1), VOCAB)
        return loss


@pytest.mark.parametrize(
    "accelerator",
    [
        pytest.param("cpu", marks=pytest.mark.slow),
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
            ],
        ),
    ],
)
def test_max_over_ranks_ddp(tmp_path, accelerator):
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator=accelerator,
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        log_every_n_steps=1,
        # a fixed version: this process would otherwise pick the next one after the workers' run
        logger=CSVLogger(tmp_path, name="logs", version=0),
        callbacks=[FLCEMemoryCallback(verbose=False)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RankDependentLM())
    rows = _rows_with(_read_metrics(trainer), "memory/unfused_head_mib")
    assert [float(row["memory/unfused_head_mib"]) for row in rows] == pytest.approx([2 * UNFUSED_MIB] * 2)
    headline = "memory/peak_allocated_mib" if accelerator == "cuda" else "memory/peak_rss_mib"
    assert all(float(row[headline]) > 0 for row in rows)


# --- a real GPU ---


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_real(tmp_path):
    # an earlier test's garbage (reference cycles holding CUDA tensors) freed by a collection inside step 0 would
    # sit in step 0's peak window: collected before the run
    gc.collect()
    torch.cuda.empty_cache()
    callback = FLCEMemoryCallback(plot=True, snapshot_steps=[1], verbose=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cuda",
        devices=1,
        max_steps=3,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM(big_alloc_step=1))
    steps = {row["step"]: row for row in callback.history}
    assert sorted(steps) == [0, 1, 2]
    for row in steps.values():
        assert (
            0
            < row["memory/allocated_mib"]
            <= row["memory/peak_allocated_mib"]
            <= row["memory/peak_reserved_mib"]
        )
    # the 64 MiB spike of step 1 is in its window only: the peak was reset after step 1's log. Compared with
    # the other steps' peaks, as the baseline (weights, cuBLAS workspace) is itself tens of MiB
    peaks = [steps[step]["memory/peak_allocated_mib"] for step in range(3)]
    assert peaks[1] - max(peaks[0], peaks[2]) == pytest.approx(64, abs=1)

    rows = _rows_with(_read_metrics(trainer), "memory/peak_allocated_mib")
    assert [float(row["memory/peak_allocated_mib"]) for row in rows] == pytest.approx(
        [steps[step]["memory/peak_allocated_mib"] for step in range(3)], rel=1e-6
    )
    (snapshot_path,) = callback.snapshot_paths
    with open(snapshot_path, "rb") as file:
        snapshot = pickle.load(file)
    assert "segments" in snapshot
    assert os.path.getsize(os.path.join(trainer.log_dir, "memory.png")) > 0


class OOMLM(TinyLM):
    def training_step(self, batch, batch_idx):
        torch.empty(1 << 50, dtype=torch.uint8, device=self.device)  # a petabyte: always out of memory
        return super().training_step(batch, batch_idx)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_oom_real(tmp_path):
    callback = FLCEMemoryCallback(record_on_oom=True, verbose=False)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cuda",
        devices=1,
        max_steps=1,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="ran out of memory"), pytest.raises(torch.cuda.OutOfMemoryError):
        trainer.fit(OOMLM())
    (snapshot_path,) = callback.snapshot_paths
    with open(snapshot_path, "rb") as file:
        assert "segments" in pickle.load(file)
