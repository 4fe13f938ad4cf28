"""FLCEMixin with a vocab-parallel head: 2 CPU processes (gloo), each running its own single-device ``Trainer``
on the same data, against one float64 process with the full head.

Layout (pure head tensor parallelism, data replicated): the test starts this file twice as a script; each rank
joins a gloo group through a file store, builds the same model from the same seed and replaces the full
``nn.Linear`` head by ``VocabParallelHead.from_linear`` (its rows of the same weight), then trains with
``Trainer(accelerator="cpu", devices=1)``. ``DDPStrategy`` would be wrong here: it all-reduces every gradient
(averaging head shards of different rows) and assumes each rank has its own data; the mixin refuses it. With a
single-device strategy per process the only collectives are the op's own (over the head's group, here the
world), both ranks see the same batches, and ``trainer.world_size == 1`` so the step's token count is the local
(= global) one.

Each rank saves, for the 2 optimizer steps (2 micro-batches each, ``flce_normalize="step"``, SGD so the second
step depends on the first): the logged ``train/loss``, the body gradients (full on every rank: dX is
all-reduced by the op) and its head shard gradients with their rows; then the validation loss/accuracy (the
``loss_with_stats`` path), ``flce_logits`` (all-gathered), ``flce_last_logits_shape`` and what a forward
pre-hook on the head saw. The parent concatenates the head shards and compares everything with a float64 copy
trained by one process through the plain logits path (``flce_naive=True``, full ``nn.Linear`` head).
Errors (``flce_naive=True``, ``DDPStrategy``) must raise on both ranks without a hang.

Tolerances as in ``test_mixin.py`` (fp32 vs float64 through a small network: rtol 1e-4, atol 1e-6).
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from ranks import end_worker, run_ranks
from torch import nn
from torch.utils.data import DataLoader

from lightning_flce.mixin import FLCEMixin

VOCAB = 37  # odd: 19 + 18 rows
HIDDEN = 16
SEQ = 6
BATCH = 2
FP32 = {"rtol": 1e-4, "atol": 1e-6}
OPTIONS = {
    "flce_label_smoothing": 0.1,
    "flce_lse_square_scale": 1e-3,
    "flce_softcap": 5.0,
    "flce_chunk_size": 5,
}
TIMEOUT_S = 90


class TinyLM(FLCEMixin, pl.LightningModule):
    """Embedding -> Linear + tanh -> LM head (``nn.Linear`` with bias, or its vocab-parallel shard)."""

    def __init__(self, vocab_parallel: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        full = nn.Linear(HIDDEN, VOCAB, bias=True)
        with torch.no_grad():
            full.bias.normal_()
        if vocab_parallel:
            from lightning_flce.parallel import VocabParallelHead

            self.lm_head = VocabParallelHead.from_linear(full)
        else:
            self.lm_head = full

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.embed(input_ids)))

    def training_step(self, batch, batch_idx):
        return self.flce_loss(self.hidden(batch["input_ids"]), batch["labels"])

    def validation_step(self, batch, batch_idx):
        self.flce_loss(self.hidden(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def batches() -> list[dict[str, torch.Tensor]]:
    """4 micro-batches (2 optimizer steps of 2); micro-batch i ignores 2 * i + 1 labels."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for index in range(4):
        input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels.view(-1)[torch.randperm(BATCH * SEQ, generator=generator)[: 2 * index + 1]] = -100
        out.append({"input_ids": input_ids, "labels": labels})
    return out


def loader() -> DataLoader:
    return DataLoader(batches(), batch_size=None)


class SaveSteps(Callback):
    """Gradients (after FLCEMixin normalized them) and the logged loss of each optimizer step."""

    def __init__(self) -> None:
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = {
            name: p.grad.detach().clone() for name, p in pl_module.named_parameters() if p.grad is not None
        }
        self.steps.append({"grads": grads})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps and "loss" not in self.steps[-1] and "train/loss_step" in trainer.callback_metrics:
            self.steps[-1]["loss"] = trainer.callback_metrics["train/loss_step"].item()


def fit(model: TinyLM, **trainer_kwargs) -> tuple[pl.Trainer, SaveSteps]:
    save = SaveSteps()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[save],
        **trainer_kwargs,
    )
    trainer.fit(model, loader())
    return trainer, save


def weighted_loss_and_grads(model: TinyLM) -> dict:
    """flce_loss with per-token weights (negative and zero ones too), outside a Trainer: the mean of the
    weighted token losses over the unweighted token count, and its gradients."""
    batch = batches()[1]
    token_weight = torch.randn(BATCH, SEQ, generator=torch.Generator().manual_seed(9))
    token_weight[0, :2] = 0.0
    loss = model.flce_loss(model.hidden(batch["input_ids"]), batch["labels"], token_weight=token_weight)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads}


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # recorded for the parent to check
        return f"{type(exc).__name__}: {exc}"
    return None


# ----------------------------------------------------------------------------------------------
# Worker (this file run as a script, one process per rank)
# ----------------------------------------------------------------------------------------------


def worker(out_dir: str, world: int, rank: int) -> None:
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=world
    )
    start = time.perf_counter()
    model = TinyLM(vocab_parallel=True, **OPTIONS)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    trainer, save = fit(model)
    calls_in_fit = len(seen)
    result = {
        "rows": (model.lm_head.vocab_start, model.lm_head.vocab_start + model.lm_head.weight.shape[0]),
        "steps": save.steps,
        "world_size": trainer.world_size,
        "hook_calls": calls_in_fit,
        "hook_shape": seen[0] if seen else None,
        "last_logits_shape": model.flce_last_logits_shape,
        "head_weight": model.lm_head.weight.detach().clone(),
        "body": {
            name: p.detach().clone() for name, p in model.named_parameters() if not name.startswith("lm_head")
        },
    }
    metrics = trainer.validate(model, loader(), verbose=False)[0]
    result["val"] = {key: metrics[key] for key in ("val/loss", "val/token_accuracy")}
    with torch.no_grad():
        result["logits"] = model.flce_logits(model.hidden(batches()[0]["input_ids"]))

    result["weighted"] = weighted_loss_and_grads(TinyLM(vocab_parallel=True, **OPTIONS))

    naive = TinyLM(vocab_parallel=True, flce_naive=True)
    result["naive_error"] = _error_of(lambda: fit(naive))
    ddp = TinyLM(vocab_parallel=True)
    ddp._trainer = types.SimpleNamespace(strategy=DDPStrategy(), world_size=2)
    result["ddp_error"] = _error_of(ddp._flce_check_vocab_parallel_layout)
    result["seconds"] = time.perf_counter() - start
    dist.barrier()  # the errors left the group usable
    dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def _launch(world: int, out_dir: Path) -> list[dict]:
    return run_ranks(
        world, lambda rank: [__file__, out_dir, world, rank], out_dir, TIMEOUT_S, label="vocab-parallel mixin"
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _launch(2, tmp_path_factory.mktemp("vp_mixin"))


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, float64, full head, plain logits + cross-entropy."""
    model = TinyLM(flce_naive=True, **OPTIONS).double()
    trainer, save = fit(model, precision="64-true")
    metrics = trainer.validate(model, loader(), verbose=False)[0]
    with torch.no_grad():
        logits = model.flce_logits(model.hidden(batches()[0]["input_ids"]))
    return {"steps": save.steps, "model": model, "val": metrics, "logits": logits}


def _full_head(ranks: list[dict], shards: list[torch.Tensor]) -> torch.Tensor:
    full = torch.full((VOCAB, *shards[0].shape[1:]), float("nan"), dtype=shards[0].dtype)
    for r, shard in zip(ranks, shards):
        start, end = r["rows"]
        assert shard.shape[0] == end - start
        full[start:end] = shard
    assert not full.isnan().any(), "the shards do not cover the vocabulary"
    return full


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **FP32, msg=lambda m: f"{what}: {m}")


def test_two_steps_equal_one_float64_process_with_the_full_head(ranks, reference):
    assert [r["rows"] for r in ranks] == [(0, 19), (19, 37)]
    assert [r["world_size"] for r in ranks] == [1, 1]  # a single-device strategy per rank
    assert len(reference["steps"]) == 2
    for index, expected in enumerate(reference["steps"]):
        grads = expected["grads"]
        for rank, r in enumerate(ranks):
            step = r["steps"][index]
            assert step["loss"] == pytest.approx(expected["loss"], rel=1e-5), f"step {index} rank {rank} loss"
            assert set(step["grads"]) == set(grads), f"step {index} rank {rank}"
            for name in grads:
                if not name.startswith("lm_head"):
                    _close(step["grads"][name], grads[name], f"step {index} rank {rank} d{name}")
        for name in ("lm_head.weight", "lm_head.bias"):
            full = _full_head(ranks, [r["steps"][index]["grads"][name] for r in ranks])
            _close(full, grads[name], f"step {index} d{name} (gathered shards)")
    params = dict(reference["model"].named_parameters())
    _close(
        _full_head(ranks, [r["head_weight"] for r in ranks]), params["lm_head.weight"], "head after 2 steps"
    )
    for r in ranks:
        for name, value in r["body"].items():
            _close(value, params[name], f"{name} after 2 steps")


def test_loss_runs_inside_the_head_call_and_reports_the_full_vocabulary(ranks):
    for r in ranks:
        # 4 micro-batches; the forward pre-hook saw the hidden states of each
        assert r["hook_calls"] == 4 and r["hook_shape"] == (BATCH, SEQ, HIDDEN)
        assert r["last_logits_shape"] == (BATCH * SEQ, VOCAB)


def test_validation_and_logits(ranks, reference):
    for r in ranks:
        assert r["val"]["val/loss"] == pytest.approx(reference["val"]["val/loss"], rel=1e-5)
        assert r["val"]["val/token_accuracy"] == pytest.approx(
            reference["val"]["val/token_accuracy"], abs=1e-6
        )
        assert r["logits"].shape == (BATCH, SEQ, VOCAB)
        _close(r["logits"], reference["logits"], "flce_logits")


def test_token_weights_through_the_vocab_parallel_head(ranks):
    expected = weighted_loss_and_grads(TinyLM(flce_naive=True, **OPTIONS).double())
    for rank, r in enumerate(ranks):
        _close(r["weighted"]["loss"], expected["loss"], f"rank {rank} weighted loss")
        for name, grad in expected["grads"].items():
            if not name.startswith("lm_head"):
                _close(r["weighted"]["grads"][name], grad, f"rank {rank} d{name}")
    for name in ("lm_head.weight", "lm_head.bias"):
        full = _full_head(ranks, [r["weighted"]["grads"][name] for r in ranks])
        _close(full, expected["grads"][name], f"weighted d{name} (gathered shards)")


def test_unsupported_options_and_strategies_raise_on_every_rank(ranks):
    for r in ranks:
        assert r["naive_error"] is not None and r["naive_error"].startswith("NotImplementedError: naive=True")
        assert r["ddp_error"] is not None and "DDPStrategy" in r["ddp_error"], r["ddp_error"]


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    end_worker()
