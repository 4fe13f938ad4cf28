"""A tensor-parallel teacher's top-k cache: a TinyGPT teacher whose LM head is a ``VocabParallelHead`` (rows 0..23 and
24..47 of the same weights on 2 CPU processes, gloo), each rank running its own single-device ``Trainer.predict``
with :class:`TeacherTopKModule` and :class:`TopKCacheWriter` on the same data.

Checked against one process with the full head, in float64: the cache holds every batch once (only the head group's
first rank writes), each position's top k equal to the model's own ``log_softmax(logits).topk(k)`` to 1e-12 with the
same columns, padding positions -inf; ``teacher_top_k`` returns the same on both ranks; and, on both ranks without a
hang, clear errors for ranks given different tokens (the input ids' fingerprint in the ranks' agreement) and for a
strategy that gives each rank its own batches (DDP).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from ranks import end_worker, error_in_step, run_ranks
from test_distill_lightning import make_batch, tiny_teacher, trainer
from torch.utils.data import DataLoader

from lightning_flce import TeacherTopKModule, TopKCacheDataset, TopKCacheWriter, teacher_top_k

WORLD = 2
K = 6
TIMEOUT_S = 180


def batches() -> list[dict]:
    out = [make_batch(seed, n_ignored=3) for seed in range(3)]
    out[1]["attention_mask"] = torch.ones_like(out[1]["input_ids"])
    out[1]["attention_mask"][0, 9:] = 0  # right padding: skipped (values -inf)
    return out


def sharded_teacher():
    import torch.distributed as dist

    from lightning_flce.parallel import VocabParallelHead

    teacher = tiny_teacher(tie_embeddings=False).double()
    teacher.lm_head = VocabParallelHead.from_linear(teacher.lm_head, group=dist.group.WORLD)
    return teacher


def run(out_dir: Path, rank: int) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    result: dict = {}
    teacher = sharded_teacher()
    result["rows"] = tuple(teacher.lm_head.weight.shape)
    data = batches()
    writer = TopKCacheWriter(str(out_dir / "cache"))
    module = TeacherTopKModule(teacher, k=K)
    result["writes_predictions"] = module.writes_predictions
    predictions = trainer(callbacks=[writer], precision="64-true").predict(
        module, DataLoader(data, batch_size=None)
    )
    result["predictions_none"] = [p is None for p in predictions]
    top = teacher_top_k(teacher, data[1]["input_ids"], K, attention_mask=data[1]["attention_mask"])
    result["values"], result["indices"] = top.values, top.indices
    tokens = data[0]["input_ids"] if rank == 0 else data[0]["input_ids"].roll(1, dims=1)
    result["tokens_differ"] = error_in_step(lambda: teacher_top_k(teacher, tokens, K))
    module._trainer = SimpleNamespace(strategy=DDPStrategy(), world_size=WORLD)
    result["ddp"] = error_in_step(lambda: module.setup("predict"))
    return result


def worker(out_dir: str, rank: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD)
    try:
        result = run(Path(out_dir), rank)
    except Exception:  # every rank saves what it has: the parent shows the traceback
        result = {"failed": traceback.format_exc()}
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    end_worker()


def test_tensor_parallel_teacher_writes_one_cache_equal_to_the_full_head(tmp_path):
    ranks = run_ranks(
        WORLD,
        lambda rank: [__file__, tmp_path, rank],
        tmp_path,
        TIMEOUT_S,
        label="tensor-parallel teacher cache",
    )
    for rank in ranks:
        assert "failed" not in rank, rank.get("failed")
    assert [r["rows"] for r in ranks] == [(24, 32), (24, 32)]
    assert [r["writes_predictions"] for r in ranks] == [True, False]
    assert ranks[0]["predictions_none"] == [False] * 3 and ranks[1]["predictions_none"] == [True] * 3

    # one file a batch, all from the first rank (each rank's Trainer is its own rank 0: one writer of the group)
    cache = tmp_path / "cache"
    assert sorted(p.name for p in cache.iterdir()) == [f"part-r00000-d000-b{i:09d}.pt" for i in range(3)]
    teacher = tiny_teacher(tie_embeddings=False).double().eval()  # the same weights, the full head
    data = batches()
    dataset = TopKCacheDataset(str(cache))
    assert len(dataset) == 6
    for index, item in enumerate(dataset):
        batch = data[index // 2]
        with torch.no_grad():
            want = teacher(batch["input_ids"][index % 2][None])[0].log_softmax(-1).topk(K, dim=-1)
        keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))[index % 2].bool()
        values = item["teacher_top_k_logits"].double()
        # the cache's fp32 values: within fp32's rounding of the float64 log-probabilities
        torch.testing.assert_close(values[keep], want.values[keep], rtol=0, atol=1e-6)
        assert torch.equal(item["teacher_top_k_indices"].long()[keep], want.indices[keep])
        assert torch.isneginf(values[~keep]).all()

    # teacher_top_k on both ranks: the same, the full head's in float64
    assert torch.equal(ranks[0]["values"], ranks[1]["values"])
    assert torch.equal(ranks[0]["indices"], ranks[1]["indices"])
    with torch.no_grad():
        want = teacher(data[1]["input_ids"]).log_softmax(-1).topk(K, dim=-1)
    keep = data[1]["attention_mask"].bool()
    torch.testing.assert_close(ranks[0]["values"][keep], want.values[keep], rtol=0, atol=1e-12)
    assert torch.equal(ranks[0]["indices"][keep], want.indices[keep])

    for rank in ranks:
        assert rank["tokens_differ"] is not None and "disagree on their targets" in rank["tokens_differ"]
        assert rank["ddp"] is not None and "VocabParallelHead sharded over 2 ranks" in rank["ddp"]


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
