"""Gradient accumulation with FLCEMixin: ``flce_normalize="step"`` averages over the tokens of the whole
optimizer step, ``"micro_batch"`` averages micro-batch means.

References are computed on a float64 copy of the model with plain logits + ``F.cross_entropy``; ``lr=0``
keeps the parameters fixed, so every optimizer step of a run can be compared with the same copy. The
fp32 runs differ from float64 by rounding only (~1e-6 relative): ``FP32_TOL`` leaves margin while any
normalization error is >= 1e-2 here (the micro-batches have 15 and 3 ignored labels out of 16 / 24).
"""

import copy
import logging

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_flce.models.gpt import TinyGPT

VOCAB, SEQ = 50, 8
FP32_TOL = 1e-5


@pytest.fixture(autouse=True)
def _quiet_lightning():
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    yield  # restored: a later test file may read the INFO lines
    lightning_logger.setLevel(level)


def tiny_gpt(cls=TinyGPT, **kwargs):
    torch.manual_seed(0)
    return cls(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0, **kwargs)


def make_batch(seed, batch_size, n_ignored):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    labels.view(-1)[torch.randperm(labels.numel(), generator=gen)[:n_ignored]] = -100
    return {"input_ids": input_ids, "labels": labels}


# two micro-batches of different sizes and very different numbers of real tokens (1 vs 21)
MICRO_BATCHES = [make_batch(1, batch_size=2, n_ignored=15), make_batch(2, batch_size=3, n_ignored=3)]


def fit(model, batches, **trainer_kwargs):
    capture = GradCapture()
    trainer_kwargs["callbacks"] = [capture, *trainer_kwargs.get("callbacks", [])]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        max_epochs=1,
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(batches, batch_size=None, shuffle=False))
    return trainer, capture


class GradCapture(L.Callback):
    """Gradients as the optimizer sees them, once per optimizer step."""

    def __init__(self):
        self.grads = []
        self.losses = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "train/loss_step" in trainer.callback_metrics:
            self.losses.append(trainer.callback_metrics["train/loss_step"].item())


def token_mean_loss(model, batches):
    """Plain float64 loss: one mean over all non-ignored tokens of ``batches``."""
    logits = torch.cat([model(b["input_ids"]).flatten(0, 1) for b in batches])
    return F.cross_entropy(logits, torch.cat([b["labels"].flatten() for b in batches]))


def reference_grads(model, loss_fn):
    ref = copy.deepcopy(model).double()
    loss = loss_fn(ref)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def assert_grads_close(actual, expected, tol=FP32_TOL):
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        err = ((actual[name].double() - grad).norm() / grad.norm()).item()
        assert err < tol, f"{name}: relative error {err:.2e}"


def test_step_normalization_equals_one_big_batch():
    model = tiny_gpt()
    ref_loss, ref_grads = reference_grads(model, lambda m: token_mean_loss(m, MICRO_BATCHES))
    trainer, capture = fit(model, MICRO_BATCHES, accumulate_grad_batches=2)
    assert len(capture.grads) == 1
    assert_grads_close(capture.grads[0], ref_grads)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(ref_loss, rel=FP32_TOL)


class WithAuxiliaryTerm(TinyGPT):
    """Adds a second loss term, a micro-batch mean (here the same cross-entropy from plain logits), weighted
    by ``flce_last_loss_weight`` as the mixin's docstring says: every gradient must come out twice the LM's."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        logits = self(batch["input_ids"]).flatten(0, 1)
        aux = F.cross_entropy(logits, batch["labels"].flatten())  # these micro-batches all have labels
        return loss + aux * self.flce_last_loss_weight


@pytest.mark.parametrize(
    "normalize, fp16",
    [("step", False), ("micro_batch", False), ("step", True)],
    ids=["step", "micro_batch", "step-fp16"],
)
def test_another_loss_term_weighted_like_the_lm_loss(normalize, fp16):
    """fp16 (16-mixed through its plugin: Trainer(precision="16-mixed") becomes bf16 on the CPU) makes "step"
    divide the token sums by 16 here, which the weight must carry; fp16 autocast errors are ~1e-3."""
    model = tiny_gpt(WithAuxiliaryTerm, flce_normalize=normalize)
    if normalize == "step":
        loss_fn = lambda m: 2 * token_mean_loss(m, MICRO_BATCHES)  # noqa: E731
    else:
        loss_fn = lambda m: sum(2 * token_mean_loss(m, [b]) for b in MICRO_BATCHES) / len(MICRO_BATCHES)  # noqa: E731
    _, ref_grads = reference_grads(model, loss_fn)
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if fp16 else []
    _, capture = fit(model, MICRO_BATCHES + MICRO_BATCHES[::-1], accumulate_grad_batches=2, plugins=plugins)
    assert len(capture.grads) == 2
    for grads in capture.grads:
        assert_grads_close(grads, ref_grads, tol=1e-2 if fp16 else FP32_TOL)


def test_micro_batch_normalization_averages_micro_batch_means():
    model = tiny_gpt(flce_normalize="micro_batch")
    ref_loss, ref_grads = reference_grads(
        model, lambda m: sum(token_mean_loss(m, [b]) for b in MICRO_BATCHES) / len(MICRO_BATCHES)
    )
    step_loss, step_grads = reference_grads(model, lambda m: token_mean_loss(m, MICRO_BATCHES))
    trainer, capture = fit(model, MICRO_BATCHES, accumulate_grad_batches=2)
    assert_grads_close(capture.grads[0], ref_grads)
    # the two modes really differ on this data, so the step test above can fail
    assert abs(ref_loss - step_loss) > 1e-2
    # train/loss is the per-token mean of the step in both modes
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(step_loss, rel=FP32_TOL)


def test_all_ignored_micro_batch_does_not_dilute_the_step():
    empty = make_batch(3, batch_size=2, n_ignored=2 * SEQ)
    model = tiny_gpt()
    ref_loss, ref_grads = reference_grads(model, lambda m: token_mean_loss(m, [MICRO_BATCHES[1]]))
    trainer, capture = fit(model, [empty, MICRO_BATCHES[1]], accumulate_grad_batches=2)
    assert_grads_close(capture.grads[0], ref_grads)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(ref_loss, rel=FP32_TOL)


def test_partial_accumulation_window_at_epoch_end():
    # 3 micro-batches with accumulate_grad_batches=2: the second step has one micro-batch, which Lightning
    # still divides by 2; the step normalization must undo exactly that
    third = make_batch(4, batch_size=1, n_ignored=2)
    model = tiny_gpt()
    _, first_grads = reference_grads(model, lambda m: token_mean_loss(m, MICRO_BATCHES))
    _, second_grads = reference_grads(model, lambda m: token_mean_loss(m, [third]))
    _, capture = fit(model, [*MICRO_BATCHES, third], accumulate_grad_batches=2)
    assert len(capture.grads) == 2
    assert_grads_close(capture.grads[0], first_grads)
    assert_grads_close(capture.grads[1], second_grads)


def test_clipping_sees_normalized_gradients():
    model = tiny_gpt()
    _, ref_grads = reference_grads(model, lambda m: token_mean_loss(m, MICRO_BATCHES))
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])).item()
    clip = norm / 4  # clipping scales the normalized gradients by 1/4; unnormalized ones by far less
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
        accumulate_grad_batches=2,
        gradient_clip_val=clip,
        callbacks=[after := GradAfterStep()],
    )
    trainer.fit(model, DataLoader(MICRO_BATCHES, batch_size=None))
    assert_grads_close(after.grads[0], {n: g * (clip / norm) for n, g in ref_grads.items()}, tol=1e-4)


class GradAfterStep(L.Callback):
    """Gradients the optimizer stepped with, read after the step of every second batch."""

    def __init__(self):
        self.grads = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % 2 == 1:
            self.grads.append(
                {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            )


class ManualTinyGPT(TinyGPT):
    """Manual optimization accumulating two micro-batches per optimizer step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        if batch_idx % 2 == 0:
            optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        if batch_idx % 2 == 1:
            optimizer.step()


def test_manual_optimization_normalizes_at_optimizer_step():
    # ahead of the callbacks' on_before_optimizer_step (GradCapture), which see the optimizer's gradients
    model = tiny_gpt(ManualTinyGPT)
    ref_loss, ref_grads = reference_grads(model, lambda m: token_mean_loss(m, MICRO_BATCHES))
    trainer, capture = fit(model, MICRO_BATCHES, callbacks=[after := GradAfterStep()])
    assert len(capture.grads) == len(after.grads) == 1
    assert_grads_close(capture.grads[0], ref_grads)
    assert_grads_close(after.grads[0], ref_grads)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(ref_loss, rel=FP32_TOL)


class ManualTwoOptimizers(TinyGPT):
    """Manual optimization with two optimizers (token embedding / the rest), clipping before the steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.seen_by_clipping = []

    def configure_optimizers(self):
        rest = [p for p in self.parameters() if p is not self.tok_emb.weight]
        return [torch.optim.SGD([self.tok_emb.weight], lr=0.0), torch.optim.SGD(rest, lr=0.0)]

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        if batch_idx % 2 == 0:
            first.zero_grad()
            second.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        if batch_idx % 2 == 1:
            self.clip_gradients(second, gradient_clip_val=1e9, gradient_clip_algorithm="norm")  # no-op clip
            self.seen_by_clipping.append(
                {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}
            )
            first.step()
            second.step()


def test_manual_optimization_normalizes_every_optimizers_gradients_before_clipping():
    """The first normalization point (here clip_gradients, for the second optimizer) rescales the gradients of
    every parameter: the first optimizer's step must not leave the second's as token sums."""
    model = tiny_gpt(ManualTwoOptimizers)
    _, ref_grads = reference_grads(model, lambda m: token_mean_loss(m, MICRO_BATCHES))
    _, capture = fit(model, MICRO_BATCHES, callbacks=[after := GradAfterStep()])
    assert len(model.seen_by_clipping) == len(after.grads) == 1 and len(capture.grads) == 2
    for grads in (model.seen_by_clipping[0], *capture.grads, after.grads[0]):
        assert_grads_close(grads, ref_grads)


class SkipsSecondBatch(TinyGPT):
    """A training_step that computes the loss, then skips the batch by returning None."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


def test_a_skipped_micro_batch_adds_no_tokens():
    model = tiny_gpt(SkipsSecondBatch)
    ref_loss, ref_grads = reference_grads(model, lambda m: token_mean_loss(m, MICRO_BATCHES[:1]))
    trainer, capture = fit(model, MICRO_BATCHES, accumulate_grad_batches=2)
    assert len(capture.grads) == 1
    assert_grads_close(capture.grads[0], ref_grads)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(ref_loss, rel=FP32_TOL)


class WithUnweightedTerm(TinyGPT):
    """The mistake the mixin warns about under "step": a micro-batch-mean term added without the weight."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0.1 * self(batch["input_ids"]).float().pow(2).mean()


class TwoLMLosses(TinyGPT):
    """Two flce_loss outputs summed and scaled (two heads, say): all normalized by the mixin, nothing to warn."""

    def training_step(self, batch, batch_idx):
        hidden = self.hidden_states(batch["input_ids"])
        return (self.flce_loss(hidden, batch["labels"]) + self.flce_loss(hidden, batch["labels"])) / 2


@pytest.mark.parametrize(
    "cls, normalize, accumulate, fp16, warns",
    [
        (WithUnweightedTerm, "step", 1, False, True),
        (WithUnweightedTerm, "step", 2, False, True),
        (WithUnweightedTerm, "step", 2, True, True),
        (WithUnweightedTerm, "micro_batch", 1, False, False),
        (WithAuxiliaryTerm, "step", 2, False, False),
        (WithAuxiliaryTerm, "step", 2, True, False),
        (TinyGPT, "step", 2, False, False),
        (TwoLMLosses, "step", 2, False, False),
    ],
    ids=[
        "unweighted",
        "unweighted-accumulated",
        "unweighted-fp16",
        "unweighted-micro_batch",
        "weighted",
        "weighted-fp16",
        "lm-only",
        "two-lm-losses",
    ],
)
def test_warns_once_about_a_term_without_the_loss_weight(cls, normalize, accumulate, fp16, warns):
    """Lightning hands on_before_backward the loss divided by accumulate_grad_batches, and under 16-mixed
    multiplied by the GradScaler's scale: both are arithmetic the check follows."""
    import warnings

    model = tiny_gpt(cls, flce_normalize=normalize)
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if fp16 else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, MICRO_BATCHES * 2, accumulate_grad_batches=accumulate, plugins=plugins)
    messages = [str(w.message) for w in caught if "flce_last_loss_weight" in str(w.message)]
    assert len(messages) == (1 if warns else 0), messages
