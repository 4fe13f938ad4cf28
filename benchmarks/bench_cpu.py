"""CPU: the PyTorch chunk path against naive PyTorch, fwd+bwd, time and peak memory.

    python benchmarks/bench_cpu.py [--shape 4096,1024,32000] [--repeats 5] [--out benchmarks/results/cpu.json]

Peak memory: each provider runs in its own fresh process (so one's allocations cannot hide another's
peak); it is the increase of the process's peak RSS (``ru_maxrss``) over the first full-size fwd+bwd,
beyond the inputs (after a tiny warm-up call, so one-time library setup is not counted). Time: one process runs the providers interleaved (round-robin, so load from other processes
on a shared machine hits them alike), one warm-up each, then ``--repeats`` rounds; median of
``time.perf_counter`` per fwd+bwd.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

PROVIDERS = {
    "naive": "F.cross_entropy(F.linear(x, W), t)",
    "flce": "lightning_flce.fused_linear_cross_entropy(x, W, t) (torch path, default chunks)",
}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _problem(n_rows: int, hidden: int, vocab: int):
    import torch

    torch.manual_seed(0)
    x = torch.randn(n_rows, hidden, requires_grad=True)
    # In place: a temporary [V, H] here would raise the baseline peak and hide part of a provider's.
    weight = torch.randn(vocab, hidden).mul_(hidden**-0.5).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,))
    target[::10] = -100
    return x, weight, target


def _step(provider: str, x, weight, target) -> float:
    import torch.nn.functional as F

    from lightning_flce import fused_linear_cross_entropy

    if provider == "naive":
        loss = F.cross_entropy(F.linear(x, weight), target)
    else:
        loss = fused_linear_cross_entropy(x, weight, target)
    loss.backward()
    x.grad = weight.grad = None
    return loss.item()


def peak_of(provider: str, n_rows: int, hidden: int, vocab: int) -> dict:
    # A tiny call first, so one-time library setup (BLAS buffers, thread pools) is not counted.
    _step(provider, *_problem(64, 64, 128))
    problem = _problem(n_rows, hidden, vocab)
    base = _peak_rss_mib()
    loss = _step(provider, *problem)
    return {"provider": provider, "loss": loss, "peak_mib": _peak_rss_mib() - base}


def times_of(n_rows: int, hidden: int, vocab: int, repeats: int) -> dict:
    problem = _problem(n_rows, hidden, vocab)
    times = {name: [] for name in PROVIDERS}
    for name in PROVIDERS:
        _step(name, *problem)  # warm-up
    for _ in range(repeats):
        for name in PROVIDERS:
            start = time.perf_counter()
            _step(name, *problem)
            times[name].append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="4096,1024,32000", help="N,H,V")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the records as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    n_rows, hidden, vocab = (int(v) for v in args.shape.split(","))
    if args.child:
        print(json.dumps(peak_of(args.child, n_rows, hidden, vocab)))
        return
    import torch

    records = []
    for provider in PROVIDERS:
        cmd = [sys.executable, __file__, "--shape", args.shape, "--child", provider]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        records.append(json.loads(out.strip().splitlines()[-1]))
    times = times_of(n_rows, hidden, vocab, args.repeats)
    for rec in records:
        rec.update(
            shape=f"{n_rows}x{hidden}x{vocab}",
            ms=statistics.median(times[rec["provider"]]),
            ms_all=times[rec["provider"]],
            floor_mib=(n_rows + vocab) * hidden * 4 / 2**20,
            threads=torch.get_num_threads(),
            torch=torch.__version__,
        )
    naive = records[0]
    print(
        f"CPU fwd+bwd, fp32, {args.shape} (N,H,V), {platform.machine()}, {os.cpu_count()} cores, {naive['threads']} threads"
    )
    print(f"{'provider':10s} {'ms':>9s} {'x naive':>8s} {'peak MiB':>9s} {'x naive':>8s} {'loss':>10s}")
    for rec in records:
        print(
            f"{rec['provider']:10s} {rec['ms']:9.1f} {rec['ms'] / naive['ms']:8.2f} {rec['peak_mib']:9.0f} "
            f"{rec['peak_mib'] / naive['peak_mib']:8.3f} {rec['loss']:10.5f}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            summary = {
                "date": time.strftime("%Y-%m-%d"),
                "machine": platform.machine(),
                "cores": os.cpu_count(),
            }
            json.dump({**summary, "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
