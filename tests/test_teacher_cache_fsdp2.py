"""A teacher's top-k cache made with the teacher sharded by FSDP2: Lightning's ``ModelParallelStrategy(
data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")`` on 2 CPU ranks, a TinyGPT teacher
sharded by :meth:`TeacherTopKModule.configure_model` (its own ``configure_model``: each block, an untied head, then
the model; this module the root unit), ``trainer.predict`` with :class:`TopKCacheWriter`.

As ``test_fsdp2_cpu.py``, the test starts this file twice as a script with torchrun's variables set. Each rank
writes the batches of its share; the parent checks that the cache holds each of the 8 sequences once, with the
top k of one unsharded process (float64 log-probabilities and columns of the same weights; the ranks compute in
fp32: within 1e-5), that ``fused_linear_top_k`` got the whole ``[V, H]`` head weight as a plain tensor (not a
``DTensor`` shard) on every call, with the head tied to the embeddings (in the teacher's root unit, kept unsharded
for the top k, then resharded) and untied (a unit of its own), and that the head's unit is resharded after each
batch.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from ranks import end_worker, free_port, run_ranks, torchrun_env
from test_fsdp2_cpu import needs_cpu_fsdp2, samples, tiny_gpt
from torch.utils.data import DataLoader

import lightning_flce.models.teacher_cache as teacher_cache
from lightning_flce import TeacherTopKModule, TopKCacheDataset, TopKCacheWriter

K = 5
TIMEOUT_S = 150
VARIANTS = {"tied": True, "untied": False}


def sequences() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples()]


class RecordHead(pl.Callback):
    """After each batch: whether the head's weight is sharded again (a DTensor parameter)."""

    def __init__(self) -> None:
        self.sharded_after = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        weight = pl_module.teacher.lm_head.weight
        self.sharded_after.append(type(weight.data).__name__ == "DTensor")


def run_variant(out_dir: str, tied: bool) -> dict:
    seen = []
    original = teacher_cache.fused_linear_top_k

    def recording_op(hidden, weight, *args, **kwargs):
        seen.append((type(weight).__name__, tuple(weight.shape)))
        return original(hidden, weight, *args, **kwargs)

    teacher_cache.fused_linear_top_k = recording_op
    record = RecordHead()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
        ),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TopKCacheWriter(out_dir), record],
    )
    module = TeacherTopKModule(tiny_gpt(tie_embeddings=tied), k=K)
    try:
        trainer.predict(module, DataLoader(sequences(), batch_size=2), return_predictions=False)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        teacher_cache.fused_linear_top_k = original
    return {"error": None, "op_weights": seen, "sharded_after": record.sharded_after}


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {name: run_variant(os.path.join(out_dir, name), tied) for name, tied in VARIANTS.items()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_worker()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("cache_fsdp2")
    port = free_port()
    ranks = run_ranks(
        2,
        lambda rank: [__file__, out_dir],
        out_dir,
        TIMEOUT_S,
        env=lambda rank: torchrun_env(rank, 2, port, OMP_NUM_THREADS="1"),
        cwd=out_dir,
        label="teacher cache under fsdp2",
    )
    return out_dir, ranks


@pytest.mark.slow
@needs_cpu_fsdp2
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp2_sharded_teacher_writes_the_unsharded_teachers_top_k(results, variant):
    out_dir, ranks = results
    for rank in ranks:
        saved = rank[variant]
        assert saved["error"] is None, saved["error"]
        # 2 batches a rank, each on the whole head weight, which is sharded again after each
        assert len(saved["op_weights"]) == 2, saved["op_weights"]
        for type_name, shape in saved["op_weights"]:  # the unsharded parameter's data, never a DTensor shard
            assert type_name in ("Parameter", "Tensor") and shape == (83, 16), saved["op_weights"]
        assert saved["sharded_after"] == [True, True]
    dataset = TopKCacheDataset(str(out_dir / variant))
    teacher = tiny_gpt(tie_embeddings=VARIANTS[variant]).double().eval()
    seen = set()
    for item in dataset:
        seen.add(tuple(item["input_ids"].tolist()))
        with torch.no_grad():
            want = teacher(item["input_ids"][None])[0].log_softmax(-1).topk(K, dim=-1)
        torch.testing.assert_close(item["teacher_top_k_logits"].double(), want.values, rtol=0, atol=1e-5)
        assert torch.equal(item["teacher_top_k_indices"].long(), want.indices)
    assert seen == {tuple(s["input_ids"].tolist()) for s in sequences()}
    assert len(dataset) == len(seen) == 8


if __name__ == "__main__":
    worker(sys.argv[1])
