"""Data parallel x vocab-parallel head on the CPU: Lightning's ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=2, process_group_backend="gloo")`` on 4 processes, against one float64 process on the
same global batch.

Layout (the *DP x TP* case of ``FLCEMixin``'s docstring): the mesh is ``[[0, 1], [2, 3]]`` with dimensions
``("data_parallel", "tensor_parallel")``. In ``configure_model`` each rank replaces the untied TinyGPT head by
its ``VocabParallelHead`` rows over its tensor-parallel group ({0, 1} or {2, 3}: 42 + 41 of the 83 rows), then
``fully_shard``s the blocks and the root over its data-parallel group ({0, 2} or {1, 3}); the head's rows stay
in the root unit, so FSDP2 shards them over the data-parallel pair and reduce-scatters their gradient there.
Lightning's sampler splits the data over the data-parallel ranks only, so both ranks of a tensor-parallel
group see the same micro-batches (the op checks that on every call).

One optimizer step (2 micro-batches of 2 samples per data-parallel rank; data-parallel rank 1's second
micro-batch has no label), ``flce_normalize="step"``: the logged ``train/loss`` must be the token mean of the 8
samples, every body gradient (gathered over the data-parallel group) the float64 one, and each rank's head
gradient the rows of the float64 head gradient that it holds. Tolerances as in ``test_fsdp2_cpu.py``.
"""

import os
import sys
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from ranks import end_worker, free_port, run_ranks, torchrun_env
from test_fsdp2_cpu import FP32, VOCAB, _reference, needs_cpu_fsdp2, samples, tiny_gpt
from torch.utils.data import DataLoader

from lightning_flce.models.gpt import TinyGPT
from lightning_flce.parallel import VocabParallelHead, fully_shard_lm

WORLD = 4
TIMEOUT_S = 180


class DPxTPTinyGPT(TinyGPT):
    """Untied TinyGPT whose head becomes vocab-parallel over the TP group; FSDP2 over the DP group."""

    def configure_model(self) -> None:
        if isinstance(self.lm_head, VocabParallelHead):  # configure_model may run again (validate after fit)
            return
        mesh = self.device_mesh
        self.lm_head = VocabParallelHead.from_linear(self.lm_head, group=mesh["tensor_parallel"].get_group())
        fully_shard_lm(self, mesh["data_parallel"], blocks=self.blocks, head=None)


class SaveStep(Callback):
    """Every gradient at the optimizer step, gathered over the data-parallel group, and the logged loss."""

    def __init__(self) -> None:
        self.result = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from torch.distributed.tensor import DTensor

        grads = {}
        for name, param in pl_module.named_parameters():
            if param.grad is not None:
                assert isinstance(param.grad, DTensor), name
                grads[name] = param.grad.full_tensor().clone()  # a collective over the data-parallel group
        head = pl_module.lm_head
        self.result = {
            "grads": grads,
            "rows": (head.vocab_start, head.vocab_start + head.weight.shape[0]),
            "world_size": trainer.world_size,
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.result is not None and "loss" not in self.result:
            self.result["loss"] = trainer.callback_metrics["train/loss_step"].item()


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    start = time.perf_counter()
    save = SaveStep()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=2, process_group_backend="gloo"
        ),
        max_steps=1,
        accumulate_grad_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[save],
    )
    model = tiny_gpt(DPxTPTinyGPT, tie_embeddings=False)
    result = {"error": None}
    try:
        trainer.fit(model, DataLoader(samples(), batch_size=2))
        result.update(save.result)
    except Exception as exc:  # recorded for the parent
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = time.perf_counter() - start
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dp_tp")
    port = free_port()
    return run_ranks(
        WORLD,
        lambda rank: [__file__, out_dir],
        out_dir,
        TIMEOUT_S,
        env=lambda rank: torchrun_env(rank, WORLD, port, OMP_NUM_THREADS="1"),
        cwd=out_dir,
        label="dp x tp",
    )


@pytest.mark.slow
@needs_cpu_fsdp2
def test_dp_x_vocab_parallel_step_equals_one_process_on_the_global_batch(ranks):
    ref_loss, ref_grads = _reference(tie_embeddings=False)
    head_rows = {0: (0, 42), 1: (42, VOCAB)}  # torch.chunk-like split of 83 rows over 2 ranks
    for rank, saved in enumerate(ranks):
        assert saved["error"] is None, saved["error"]
        assert saved["world_size"] == WORLD
        assert saved["loss"] == pytest.approx(ref_loss, rel=1e-5)
        start, end = saved["rows"]
        assert (start, end) == head_rows[rank % 2]  # tensor-parallel rank = rank % 2
        grads = saved["grads"]
        assert grads.keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            if name.startswith("lm_head."):
                want = want[start:end]
            torch.testing.assert_close(grads[name], want, **FP32, msg=f"rank {rank}: {name}")


if __name__ == "__main__":
    worker(sys.argv[1])
    end_worker()
