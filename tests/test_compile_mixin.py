"""``torch.compile(model)`` of a LightningModule with FLCEMixin (Lightning compiles its training, validation,
test and predict steps): the mixin adds no graph and no recompilation to the plain module's count.

Counted with Dynamo's counting backend, which compiles nothing (fast on CPU): each graph break or
recompilation is one more frame. Before the mixin counted tokens without a tensor hook and summed its
metrics as plain tensors, this training step gave 3 graphs and the validation step 9 (against 1 and 1).
"""

import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_flce.mixin import FLCEMixin

torch_dynamo_testing = pytest.importorskip("torch._dynamo.testing")

VOCAB, HIDDEN, SEQ = 37, 16, 8


@pytest.fixture(autouse=True)
def _quiet_lightning():
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    yield  # restored: a later test file may read the INFO lines
    lightning_logger.setLevel(level)


class PlainLM(pl.LightningModule):
    """The logits path: what compiling the module gives without the mixin."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def hidden_states(self, input_ids):
        return torch.tanh(self.mlp(self.embedding(input_ids)))

    def loss(self, batch):
        logits = self.lm_head(self.hidden_states(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FusedLM(FLCEMixin, PlainLM):
    def loss(self, batch):
        return self.flce_loss(self.hidden_states(batch["input_ids"]), batch["labels"])


class WeightedFusedLM(FusedLM):
    """Per-token weights and a softcap: more per-call options, still no graph."""

    def loss(self, batch):
        token_weight = (batch["labels"] % 3).float() - 0.5
        return self.flce_loss(
            self.hidden_states(batch["input_ids"]), batch["labels"], token_weight=token_weight
        )


def loader(num_batches):
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(num_batches):
        labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
        labels[0, :2] = -100
        batches.append(
            {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=generator), "labels": labels}
        )
    return DataLoader(batches, batch_size=None)


def trainer(**kwargs):
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**options, **kwargs})


def graphs(cls, stage, **module_kwargs):
    torch._dynamo.reset()
    counter = torch_dynamo_testing.CompileCounter()
    model = cls(**module_kwargs)
    compiled = torch.compile(model, backend=counter)
    if stage == "fit":
        fit = trainer(max_steps=3, limit_val_batches=0, accumulate_grad_batches=2)
        fit.fit(compiled, loader(6))
    else:
        trainer().validate(compiled, loader(3), verbose=False)
    return counter.frame_count, model


@pytest.mark.parametrize("stage", ["fit", "validate"])
@pytest.mark.parametrize("normalize", ["step", "micro_batch"])
def test_the_mixin_adds_no_graph_to_a_compiled_module(stage, normalize):
    plain, _ = graphs(PlainLM, stage)
    fused, model = graphs(FusedLM, stage, flce_normalize=normalize)
    assert plain >= 1
    assert fused == plain


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_token_weights_and_a_softcap_add_no_graph(stage):
    assert graphs(WeightedFusedLM, stage, flce_softcap=5.0)[0] == graphs(PlainLM, stage)[0]


def test_a_compiled_training_step_normalizes_like_the_eager_one():
    _, compiled = graphs(FusedLM, "fit")
    eager = FusedLM()
    trainer(max_steps=3, limit_val_batches=0, accumulate_grad_batches=2).fit(eager, loader(6))
    for (name, got), want in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_compiled_validation_metrics_equal_the_eager_ones():
    """aot_eager, so the metrics' in-place sums go through AOTAutograd's handling of mutated inputs."""
    torch._dynamo.reset()
    want = trainer().validate(FusedLM(), loader(3), verbose=False)
    got = trainer().validate(torch.compile(FusedLM(), backend="aot_eager"), loader(3), verbose=False)
    assert got[0].keys() == want[0].keys() == {"val/loss", "val/perplexity", "val/token_accuracy"}
    for name, value in want[0].items():
        assert got[0][name] == pytest.approx(value, rel=1e-6), name
    torch._dynamo.reset()
