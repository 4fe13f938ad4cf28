"""Two-process CPU DDP (gloo) with gradient accumulation gives the loss and gradients of one process on the
same global batch: the token mean over every micro-batch of every rank (``flce_normalize="step"``).

The test runs this file as a script; Lightning's DDP launcher starts rank 1 by running the same command
again. Each rank saves the gradients it holds before the optimizer step and the ``train/loss`` it logged.
The reference is a float64 copy of the model on all samples at once; fp32 tolerances as in ``test_mixin.py``
(rounding through a 1-layer model, about 1e-6 relative; the gloo all-reduce adds one fp32 rounding).
"""

import copy
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_flce.models.gpt import TinyGPT

VOCAB = 83
SEQ = 8
NUM_SAMPLES = 8  # 2 ranks x 2 micro-batches x 2 samples: one optimizer step
FP32 = {"rtol": 1e-4, "atol": 1e-6}


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0)


def samples() -> list[dict[str, torch.Tensor]]:
    """Sample i ignores i labels, and samples 3, 5 and 7 ignore all of theirs. DistributedSampler gives rank 1
    the odd samples, so its second micro-batch ([5, 7]) has no label at all, and its first ([1, 3]) 7 labels
    against rank 0's 14: the ranks must agree on one gradient divisor (8), not take 4 and 8."""
    generator = torch.Generator().manual_seed(2)
    data = []
    for index in range(NUM_SAMPLES):
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[: SEQ if index in (3, 5, 7) else index] = -100
        data.append({"input_ids": tokens[:-1], "labels": labels})
    return data


class SaveStep(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.grads = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.grads is not None:
            loss = trainer.callback_metrics["train/loss_step"].item()
            result = {"grads": self.grads, "loss": loss, "world_size": trainer.world_size}
            torch.save(result, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))
            self.grads = None


def run_ddp(out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a small CPU
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=1,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveStep(out_dir)],
    )
    trainer.fit(tiny_gpt(), DataLoader(samples(), batch_size=2))


@pytest.mark.slow
def test_ddp_step_equals_one_process_on_the_global_batch(tmp_path):
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    reference = copy.deepcopy(tiny_gpt()).double()
    data = samples()
    input_ids = torch.stack([s["input_ids"] for s in data])
    labels = torch.stack([s["labels"] for s in data])
    loss = F.cross_entropy(reference(input_ids).reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()

    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["world_size"] == 2
        assert saved["loss"] == pytest.approx(loss.item(), rel=1e-5)
        grads = saved["grads"]
        assert grads.keys() == {n for n, p in reference.named_parameters() if p.grad is not None}
        for name, param in reference.named_parameters():
            torch.testing.assert_close(grads[name], param.grad.float(), **FP32, msg=f"rank {rank}: {name}")


if __name__ == "__main__":
    run_ddp(sys.argv[1])
    # Both ranks end here: skip gloo's teardown at interpreter exit, which sometimes aborted a rank
    # ("terminate called without an active exception") after everything had been saved.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
