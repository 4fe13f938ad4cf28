"""Two-process CPU DDP (gloo) with gradient accumulation: ``flce_policy_loss`` under ``flce_normalize="step"``
gives the loss and gradients of one call of :func:`fused_linear_policy_loss` on the step's sequences of both
ranks (each loss type's normalizer summed over micro-batches and ranks).

The test runs this file as a script (Lightning's DDP launcher starts rank 1 by running it again, as
``tests/test_ddp_cpu.py`` does); each rank saves the gradients it holds before the optimizer step and the
``train/loss`` it logged. float64 (``precision="64-true"``), so the tolerances are rounding only.
"""

import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from ranks import SaveStep, clean_env, end_worker
from test_policy_mixin import TOL, PolicyLM, make_batch, one_call_grads
from torch.utils.data import DataLoader

# rank 0 takes micro-batches 0 and 1, rank 1 takes 2 and 3: different sequences and masked tokens per rank
MICRO_BATCHES = [
    make_batch(11, batch_size=2, n_masked=9),
    make_batch(12, batch_size=3, n_masked=4),
    make_batch(13, batch_size=1, n_masked=5),
    make_batch(14, batch_size=2, n_masked=1),
]


class RankMicroBatches(torch.utils.data.Sampler):
    """Rank r takes micro-batches 2r and 2r + 1 (the rank is known once the process group exists)."""

    def __iter__(self):
        rank = torch.distributed.get_rank()
        return iter([2 * rank, 2 * rank + 1])

    def __len__(self) -> int:
        return 2


def options_of(loss_type: str) -> dict:
    return {"loss_type": loss_type, "epsilon_low": 0.1, "epsilon_high": 0.15}


def run_ddp(out_dir: str, loss_type: str) -> None:
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        precision="64-true",
        max_steps=1,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveStep(out_dir)],
        use_distributed_sampler=False,
    )
    model = PolicyLM(**{f"flce_{name}": value for name, value in options_of(loss_type).items()})
    trainer.fit(model, DataLoader(MICRO_BATCHES, batch_size=None, sampler=RankMicroBatches()))


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_ddp_policy_step_equals_one_call_on_both_ranks_sequences(tmp_path, loss_type):
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path), loss_type],
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loss, expected = one_call_grads(PolicyLM(), MICRO_BATCHES, **options_of(loss_type))
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["world_size"] == 2
        assert saved["loss"] == pytest.approx(loss.item(), rel=1e-6)
        assert saved["grads"].keys() == expected.keys()
        for name, grad in saved["grads"].items():
            torch.testing.assert_close(grad, expected[name], **TOL, msg=f"rank {rank}: {name}")


if __name__ == "__main__":
    run_ddp(sys.argv[1], sys.argv[2])
    end_worker()
