"""Gradient accumulation: with ``flce_normalize="step"`` the gradients of an optimizer step are those of the
token mean over all its micro-batches, as if they were one big batch, whatever their numbers of ignored labels.

The learning rate is 0, so the weights stay at their initial values across steps and every step can be
checked against the same float64 reference (fp32 tolerances as in ``test_mixin.py``: rounding through a
1-layer model, about 1e-6 relative).
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_flce.models.gpt import TinyGPT

VOCAB = 89
SEQ = 10
FP32 = {"rtol": 1e-4, "atol": 1e-6}


def tiny_gpt(**kwargs) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0, **kwargs)


def make_batches(ignored_per_batch, batch_size: int = 2) -> list[dict[str, torch.Tensor]]:
    """One batch per entry: that many labels (of batch_size * SEQ) set to -100."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for num_ignored in ignored_per_batch:
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels.view(-1)[torch.randperm(labels.numel(), generator=generator)[:num_ignored]] = -100
        batches.append({"input_ids": tokens[:, :-1], "labels": labels})
    return batches


def fit(model, batches, **trainer_kwargs) -> "StepRecorder":
    recorder = StepRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(batches, batch_size=None))
    return recorder


class StepRecorder(Callback):
    """Gradients before each optimizer step and the ``train/loss`` logged for it."""

    def __init__(self) -> None:
        self.grads = []
        self.losses = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self.losses) < len(self.grads):
            self.losses.append(trainer.callback_metrics["train/loss_step"].item())


def reference(model: TinyGPT, batches, *, mean_of_means: bool = False):
    """Float64 (loss, grads) of the token mean over ``batches`` joined into one batch, or of the mean of the
    per-batch means (what plain per-micro-batch normalization computes)."""
    model = copy.deepcopy(model).double()
    sums = torch.stack(
        [
            F.cross_entropy(
                model(b["input_ids"]).reshape(-1, VOCAB), b["labels"].reshape(-1), reduction="sum"
            )
            for b in batches
        ]
    )
    counts = torch.stack([(b["labels"] != -100).sum() for b in batches]).double()
    loss = (sums / counts.clamp(min=1)).mean() if mean_of_means else sums.sum() / counts.sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(actual, expected) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name].float(), **FP32, msg=name)


def test_accumulated_step_equals_one_big_batch():
    # micro-batches of 20 labels with 1, 15 and 4 ignored: a plain mean of means would overweight the second;
    # the third is alone in the last, partial accumulation window of the epoch
    batches = make_batches([1, 15, 4])
    model = tiny_gpt()
    expected = [reference(model, batches[:2]), reference(model, batches[2:])]
    recorder = fit(model, batches, accumulate_grad_batches=2)

    assert len(recorder.grads) == 2
    for step, (expected_loss, expected_grads) in enumerate(expected):
        assert_grads_close(recorder.grads[step], expected_grads)
        assert recorder.losses[step] == pytest.approx(expected_loss, rel=1e-5)

    # the check can fail: here the mean of means differs from the token mean by far more than the tolerance
    _, mean_of_means_grads = reference(model, batches[:2], mean_of_means=True)
    difference = (mean_of_means_grads["tok_emb.weight"] - expected[0][1]["tok_emb.weight"]).abs().max()
    assert difference > 100 * FP32["atol"]


def test_micro_batch_normalization_is_the_mean_of_micro_batch_means():
    batches = make_batches([1, 15])
    model = tiny_gpt(flce_normalize="micro_batch")
    _, expected_grads = reference(model, batches, mean_of_means=True)
    recorder = fit(model, batches, accumulate_grad_batches=2)
    assert_grads_close(recorder.grads[0], expected_grads)


def test_all_ignored_micro_batch_in_the_step():
    batches = make_batches([3, 2 * SEQ])  # the second micro-batch has no label at all
    model = tiny_gpt()
    expected_loss, expected_grads = reference(model, batches[:1])
    recorder = fit(model, batches, accumulate_grad_batches=2)
    assert_grads_close(recorder.grads[0], expected_grads)
    assert recorder.losses[0] == pytest.approx(expected_loss, rel=1e-5)


class ManualGPT(TinyGPT):
    """Manual optimization: two micro-batches per ``optimizer.step()``, no division by their number."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.captured = []

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(self.flce_loss(self.hidden_states(batch["input_ids"]), batch["labels"]))
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)  # normalizes
        self.captured.append({n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})


def test_manual_optimization_normalizes_at_optimizer_step():
    batches = make_batches([2, 12])
    torch.manual_seed(0)
    model = ManualGPT(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0)
    _, expected_grads = reference(model, batches)
    fit(model, batches)
    assert len(model.captured) == 1
    assert_grads_close(model.captured[0], expected_grads)
