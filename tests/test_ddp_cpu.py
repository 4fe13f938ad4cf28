"""Two-process CPU DDP (gloo) with gradient accumulation gives the loss and gradients of one process on the
same global batch: the token mean over every micro-batch of every rank (``flce_normalize="step"``).

The test runs this file as a script; Lightning's DDP launcher starts rank 1 by running the same command
again. Each rank saves the gradients it holds before the optimizer step and the ``train/loss`` it logged.
The reference is a float64 copy of the model on all samples at once. fp32 tolerances as in ``test_mixin.py``
(rounding through a 1-layer model, about 1e-6 relative; the gloo all-reduce adds one fp32 rounding);
``16-mixed`` (fp16 autocast on the CPU, Lightning's GradScaler at 2^16) within 1e-2 relative L2 per gradient:
1.1e-3 measured, and 0.34 when the ranks take their own fp16 divisors in ``FLCEMixin`` instead of agreeing.
With per-token weights (the batch key ``token_weight``), the step's loss is the weighted token sum over the
unweighted token count of both ranks.
"""

import copy
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from ranks import SaveStep, clean_env, end_worker
from torch.utils.data import DataLoader

from lightning_flce.models.gpt import TinyGPT

VOCAB = 83
SEQ = 8
NUM_SAMPLES = 8  # 2 ranks x 2 micro-batches x 2 samples: one optimizer step
FP32 = {"rtol": 1e-4, "atol": 1e-6}


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0)


SHORT = (1, 3)  # samples that end after 3 tokens (their later labels ignored)


def samples(weighted: bool = False) -> list[dict[str, torch.Tensor]]:
    """Sample i ignores its first i labels, samples 5 and 7 all of theirs, samples 1 and 3 every label after
    the third. :class:`EveryOtherSample` gives rank 1 the odd samples, so its second micro-batch ([5, 7]) has no label
    at all, and its first ([1, 3]) is cut to 3 positions by :func:`trim`: 6 labels against rank 0's 16, so
    under fp16 the ranks must agree on one divisor (16), not take 8 and 16."""
    generator = torch.Generator().manual_seed(2)
    weights = torch.Generator().manual_seed(3)
    data = []
    for index in range(NUM_SAMPLES):
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[: SEQ if index in (5, 7) else index] = -100
        if index in SHORT:
            labels[3:] = -100
        data.append({"input_ids": tokens[:-1], "labels": labels})
        if weighted:  # negative and zero weights too (advantages)
            data[-1]["token_weight"] = torch.randn(SEQ, generator=weights).clamp(min=-0.5)
    return data


class EveryOtherSample(torch.utils.data.Sampler):
    """Rank r takes samples r, r + 2, ... in order (the rank is known once the process group exists)."""

    def __iter__(self):
        return iter(range(torch.distributed.get_rank(), NUM_SAMPLES, 2))

    def __len__(self) -> int:
        return NUM_SAMPLES // 2


def trim(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stacks a micro-batch and drops the trailing positions no sample has a label at (dynamic padding; the
    model is causal, so the positions before them do not change)."""
    input_ids = torch.stack([s["input_ids"] for s in batch])
    labels = torch.stack([s["labels"] for s in batch])
    used = (labels != -100).any(0).nonzero()
    length = int(used.max()) + 1 if used.numel() else 1
    trimmed = {"input_ids": input_ids[:, :length], "labels": labels[:, :length]}
    if "token_weight" in batch[0]:
        trimmed["token_weight"] = torch.stack([s["token_weight"] for s in batch])[:, :length]
    return trimmed


def run_ddp(out_dir: str, precision: str, weighted: bool) -> None:
    torch.set_num_threads(1)  # two processes on a small CPU
    # Trainer(precision="16-mixed") turns into bf16-mixed on the CPU; the plugin keeps fp16 and its scaler
    fp16 = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if precision == "16-mixed" else []
    trainer = pl.Trainer(
        plugins=fp16,
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
        use_distributed_sampler=False,  # EveryOtherSample: Lightning's would shuffle
    )
    loader = DataLoader(samples(weighted), batch_size=2, sampler=EveryOtherSample(), collate_fn=trim)
    trainer.fit(tiny_gpt(), loader)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "weighted"),
    [("32-true", False), ("16-mixed", False), ("32-true", True)],
    ids=["32-true", "16-mixed", "32-true-token-weights"],
)
def test_ddp_step_equals_one_process_on_the_global_batch(tmp_path, precision, weighted):
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path), precision, str(int(weighted))],
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(),  # this checkout first on PYTHONPATH
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    reference = copy.deepcopy(tiny_gpt()).double()
    data = samples(weighted)
    input_ids = torch.stack([s["input_ids"] for s in data])
    labels = torch.stack([s["labels"] for s in data]).reshape(-1)
    per_token = F.cross_entropy(reference(input_ids).reshape(-1, VOCAB), labels, reduction="none")
    if weighted:
        per_token = per_token * torch.stack([s["token_weight"] for s in data]).reshape(-1).double()
    loss = per_token.sum() / (labels != -100).sum()
    loss.backward()

    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["world_size"] == 2
        assert saved["loss"] == pytest.approx(loss.item(), rel=1e-5 if precision == "32-true" else 1e-2)
        grads = saved["grads"]
        assert grads.keys() == {n for n, p in reference.named_parameters() if p.grad is not None}
        for name, param in reference.named_parameters():
            if precision == "32-true":
                torch.testing.assert_close(
                    grads[name], param.grad.float(), **FP32, msg=f"rank {rank}: {name}"
                )
            else:
                error = ((grads[name].double() - param.grad).norm() / param.grad.norm()).item()
                assert error < 1e-2, f"rank {rank}: {name}: relative error {error:.1e}"


if __name__ == "__main__":
    run_ddp(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
    end_worker()
