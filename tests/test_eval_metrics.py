"""FLCEMixin's evaluation metrics: one set per dataloader under Lightning's ``/dataloader_idx_N`` keys, shown in
the progress bar and on the console after each validation and at the end of fit."""

import copy
import logging

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_flce.eval_metrics import TokenMetrics
from lightning_flce.models.gpt import TinyGPT

VOCAB, SEQ = 53, 8
NAMES = ("loss", "perplexity", "token_accuracy")


def tiny_gpt(**kwargs) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=1e-2, **kwargs)


def batches(num_batches, seed):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(num_batches):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, : index + 1] = -100
        out.append({"input_ids": tokens[:, :-1], "labels": labels})
    return DataLoader(out, batch_size=None)


def trainer(**kwargs) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**options, **kwargs})


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_several_dataloaders_get_their_own_metrics(stage):
    prefix = "val" if stage == "validate" else "test"
    model = tiny_gpt()
    loaders = [batches(2, seed=0), batches(3, seed=1)]
    alone = [getattr(trainer(), stage)(copy.deepcopy(model), loader, verbose=False)[0] for loader in loaders]
    results = getattr(trainer(), stage)(model, loaders, verbose=False)
    assert len(results) == 2
    for index, (result, single) in enumerate(zip(results, alone)):
        # Lightning adds what is logged at epoch end to every dataloader's dict: both sets, no pooled one
        assert set(result) == {f"{prefix}/{name}/dataloader_idx_{i}" for name in NAMES for i in (0, 1)}
        for name in NAMES:
            assert result[f"{prefix}/{name}/dataloader_idx_{index}"] == pytest.approx(
                single[f"{prefix}/{name}"], rel=1e-6
            )
    assert alone[0][f"{prefix}/loss"] != pytest.approx(alone[1][f"{prefix}/loss"], rel=1e-3)  # not pooled


def test_validation_metrics_reach_the_progress_bar_and_the_console():
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    lightning_logger = logging.getLogger("lightning.pytorch")
    handler, level = Collect(), lightning_logger.level
    lightning_logger.addHandler(handler)
    lightning_logger.setLevel(logging.INFO)
    try:
        fit_trainer = trainer(max_epochs=2, num_sanity_val_steps=1, limit_val_batches=2)
        model = tiny_gpt()
        fit_trainer.fit(model, batches(2, seed=2), [batches(2, seed=3), batches(2, seed=4)])
    finally:
        lightning_logger.removeHandler(handler)
        lightning_logger.setLevel(level)
    lines = [message for message in messages if message.startswith("FLCEMixin")]
    # one line per validation (none for the sanity check), then the end-of-fit summary
    assert [line.split(":")[0] for line in lines] == [
        "FLCEMixin val (epoch 0, step 2)",
        "FLCEMixin val (epoch 1, step 4)",
        "FLCEMixin",
    ]
    assert lines[-1].startswith("FLCEMixin: last validation: [dataloader 0] loss ")
    last = model.flce_last_eval_metrics
    assert f"[dataloader 1] loss {last['val/loss/dataloader_idx_1']:.4f}" in lines[1]
    assert f"token accuracy {last['val/token_accuracy/dataloader_idx_0']:.4f}" in lines[1]
    assert {"val/loss/dataloader_idx_0", "val/loss/dataloader_idx_1"} <= set(fit_trainer.progress_bar_metrics)
    assert last["val/loss/dataloader_idx_0"] == pytest.approx(
        fit_trainer.callback_metrics["val/loss/dataloader_idx_0"].item()
    )


def test_token_metrics_without_a_trainer():
    metrics = TokenMetrics()
    metrics.start([0, 1], torch.device("cpu"))
    assert not metrics.pending
    metrics.add(0, torch.tensor(6.0), torch.tensor(1), torch.tensor(3))
    metrics.add(0, torch.tensor(2.0), torch.tensor(3), torch.tensor(1))
    assert metrics.pending
    (only,) = metrics.compute().items()  # dataloader 1 had no batch
    assert only[0] == 0
    assert only[1]["loss"].item() == pytest.approx(2.0)  # 8 over 4 tokens
    assert only[1]["perplexity"].item() == pytest.approx(torch.e**2)
    assert only[1]["token_accuracy"].item() == pytest.approx(1.0)
    assert only[1]["loss"].dtype == torch.float64
    assert not metrics.pending and metrics.compute() == {}
