"""Runs a test file on several processes: start them, wait under one deadline, load each rank's results.

Each worker writes ``out_dir / f"rank{rank}.pt"``; a hang (e.g. in a collective) kills every rank and fails
the test instead of blocking the suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback

REPO = str(Path(__file__).resolve().parent.parent)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Set in this (pytest) process by Lightning's subprocess launcher during earlier DDP tests; a worker that
# inherits them sees another job's world (torch 2.4's device mesh then hangs the 3-rank vocab-parallel run).
_LAUNCHER_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
)


def clean_env(**extra: str) -> dict:
    """This process's environment without the launcher variables of earlier tests, with this checkout first on
    ``PYTHONPATH`` (the workers test it, not whichever copy of the package is installed), plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def torchrun_env(rank: int, world: int, port: int, **extra: str) -> dict:
    """The environment torchrun would give ``rank`` (one node), plus ``extra``."""
    return clean_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        **extra,
    )


def run_ranks(
    world: int,
    args: Callable[[int], list],
    out_dir: Path,
    timeout_s: float,
    *,
    env: Optional[Callable[[int], dict]] = None,
    cwd: Optional[Path] = None,
    label: str = "",
    echo: bool = False,
) -> list:
    """Starts ``python *args(rank)`` for every rank, waits at most ``timeout_s`` for all of them, checks that
    each exited 0 and returns the loaded ``rank{r}.pt`` files (``echo``: print the end of rank 0's output)."""

    def default_env(rank: int) -> dict:
        return clean_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    env = env or default_env
    procs = [
        subprocess.Popen(
            [sys.executable, *map(str, args(rank))],
            env=env(rank),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
        )
        for rank in range(world)
    ]
    outputs = []
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = "\n".join(proc.communicate()[0][-2000:] for proc in procs)
        pytest.fail(
            f"{label}: the {world} ranks did not finish in {timeout_s} s (a hang in a collective?)\n{tails}"
        )
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"{label} rank {rank} failed:\n{out[-4000:]}"
    if echo:
        print(outputs[0][-1000:])
    return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world)]


def error_in_step(call: Callable[[], Any]) -> Optional[str]:
    """In a worker: the exception ``call()`` raises on this rank as ``"Type: message"`` (for the parent to
    check), or None; then a barrier of the default group, so no rank starts the next case early."""
    import torch.distributed as dist

    try:
        call()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    dist.barrier()
    return error


class SaveStep(Callback):
    """A DDP worker's callback: at the first optimizer step, saves this rank's gradients, the logged step loss and
    the world size into ``out_dir / f"rank{rank}.pt"`` (what :func:`run_ranks` loads)."""

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


def cpu_fsdp_strategy(**kwargs: Any):
    """Lightning's ``FSDPStrategy`` (FSDP1) for CPU processes: Lightning refuses ``FSDPStrategy`` itself on the CPU
    (exactly that type) and wraps with ``device_id=None``, which torch's FSDP1 refuses there, while FSDP1 itself runs
    on the CPU with gloo. A subclass that wraps with ``device_id="cpu"`` first (Lightning then keeps the wrapped
    model, and warns that it ignores its ``auto_wrap_policy``: the wrap here applied it, from ``kwargs``)."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model):
            model = FullyShardedDataParallel(
                model,
                sharding_strategy=self.sharding_strategy,
                mixed_precision=self.mixed_precision_config,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            return super()._setup_model(model)

    return CPUFSDPStrategy(process_group_backend="gloo", **kwargs)


def end_worker() -> None:
    """The end of a DDP worker script, once it has saved its results: wait for the other ranks, then exit without
    the process group's and the interpreter's teardown, in which gloo sometimes aborted a rank ("terminate called
    without an active exception", exit code -6) after everything had been saved."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
