"""Train TinyGPT with FLCEMixin and a vocab-parallel LM head: each of 2 processes holds half the head's rows.

Layout "pure head tensor-parallelism, data replicated": one process per rank, each with its own single-device
Trainer, the same model and the same batches; only the LM head is sharded (over the vocabulary). The script
starts the ranks itself (CPU/gloo, under a minute; or one GPU per rank with NCCL):

    python examples/vocab_parallel_head.py
    python examples/vocab_parallel_head.py --devices cuda                # NCCL, one GPU per rank
    python examples/vocab_parallel_head.py --world-size 4 --max-steps 20
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import warnings

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_flce.models import TinyGPT
from lightning_flce.parallel import VocabParallelHead

SEQ_LEN = 64


def synthetic_tokens(vocab_size: int, num_sequences: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Each next token is ``(7 * token + 1) % V`` half the time, else a Zipf-distributed random token."""
    generator = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab_size + 1)
    tokens = torch.multinomial(zipf, num_sequences * (SEQ_LEN + 1), replacement=True, generator=generator)
    tokens = tokens.view(num_sequences, SEQ_LEN + 1)
    follow = torch.rand(num_sequences, SEQ_LEN + 1, generator=generator) < 0.5
    for t in range(SEQ_LEN):
        successor = (7 * tokens[:, t] + 1) % vocab_size
        tokens[:, t + 1] = torch.where(follow[:, t + 1], successor, tokens[:, t + 1])
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in tokens]


class LossHistory(Callback):
    """``train/loss`` (FLCEMixin: the token mean of the optimizer step) after each optimizer step."""

    def __init__(self) -> None:
        self.losses = {}

    def on_train_batch_end(self, trainer, *args) -> None:
        if "train/loss_step" in trainer.callback_metrics:
            self.losses[trainer.global_step] = trainer.callback_metrics["train/loss_step"].item()


def worker(args: argparse.Namespace) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.devices == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")  # env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo")

    # every rank logs the global value already (no sync_dist needed); validation runs after fit
    warnings.filterwarnings("ignore", ".*sync_dist=True.*|.*no `val_dataloader`.*")
    L.seed_everything(0, verbose=False)  # the same body and full head on every rank
    model = TinyGPT(
        vocab_size=args.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=SEQ_LEN,
        tie_embeddings=False,  # a vocab-parallel head cannot be tied to the (full) input embedding
        lr=3e-3,
        warmup_steps=5,
        flce_normalize="step",
    )
    full_head_params = model.lm_head.weight.numel()
    # Keep this rank's rows only; the mixin's loss then runs the vocab-parallel op over the group. group=None is
    # the default group (all ranks); a group object kept by the model (a Trainer<->model reference cycle) would
    # outlive destroy_process_group and can abort gloo's worker threads at interpreter exit.
    model.lm_head = VocabParallelHead.from_linear(model.lm_head, group=None)

    # Same batches in the same order on every rank (the op checks the labels agree): the same seeded shuffle.
    same_order = torch.Generator().manual_seed(0)
    train_tokens = synthetic_tokens(args.vocab_size, 512, seed=1)
    train = DataLoader(train_tokens, batch_size=8, shuffle=True, generator=same_order)
    val = DataLoader(synthetic_tokens(args.vocab_size, 32, seed=2), batch_size=8)

    # A single-device Trainer per rank, not DDPStrategy: DDP would average every gradient over the ranks,
    # mixing head shards of different rows, and expects different data per rank (FLCEMixin refuses it).
    # The op itself all-reduces dX, so the body's gradients are already the full ones on every rank.
    history = LossHistory()
    trainer = L.Trainer(
        accelerator=args.devices,
        devices=[rank] if args.devices == "cuda" else 1,  # this rank's own GPU
        max_steps=args.max_steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history],
    )
    trainer.fit(model, train)
    metrics = trainer.validate(model, val, verbose=False)[0]
    logits_shape = tuple(model(val.dataset[0]["input_ids"][None].to(model.device)).shape)  # all-gathered

    head = model.lm_head
    shard = (head.vocab_start, head.vocab_start + head.weight.shape[0], head.weight.numel())
    shards = [None] * world_size
    dist.all_gather_object(shards, shard)
    if rank == 0:
        for r, (start, end, numel) in enumerate(shards):
            share = f"{numel} of {full_head_params} ({numel / full_head_params:.1%})"
            print(f"rank {r}: head rows [{start}, {end}), head parameters {share}")
        for step, loss in history.losses.items():
            if step == 1 or step % 10 == 0 or step == trainer.global_step:
                print(f"step {step:3d}  train/loss {loss:.3f}")
        losses = list(history.losses.values())
        print(f"train/loss first {losses[0]:.3f} -> last {losses[-1]:.3f}")
        print(
            f"val/loss {metrics['val/loss']:.3f}  val/perplexity {metrics['val/perplexity']:.1f}"
            f"  val/token_accuracy {metrics['val/token_accuracy']:.3f}"
        )
        print(f"inference logits (gathered from all ranks): {logits_shape}")
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> int:
    """Starts this script once per rank (torchrun-style environment); returns a failure's exit code or 0."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(args.world_size),
        NCCL_NVLS_ENABLE="0",  # no NVLink multicast
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONUNBUFFERED="1",  # rank 0's lines in order with the log messages
    )
    procs = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=dict(env, RANK=str(rank)))
        for rank in range(args.world_size)
    ]
    while any(proc.poll() is None for proc in procs):
        if any(proc.poll() for proc in procs):  # a rank failed: the others would wait in a collective forever
            for proc in procs:
                proc.kill()
        time.sleep(0.2)
    return next((proc.returncode for proc in procs if proc.returncode), 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL")
    parser.add_argument("--world-size", type=int, default=2, help="processes (head shards)")
    parser.add_argument("--vocab-size", type=int, default=4099, help="odd: uneven shards")
    parser.add_argument("--max-steps", type=int, default=40)
    args = parser.parse_args()
    sys.exit(worker(args) if "RANK" in os.environ else launch(args))
