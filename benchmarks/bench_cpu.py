"""CPU: the PyTorch chunk path against naive PyTorch, fwd+bwd, time and peak memory.

    python benchmarks/bench_cpu.py [--shape 4096,1024,32000] [--repeats 5] [--out benchmarks/results/cpu.json]

Each provider runs in its own fresh process (so one's allocations cannot hide another's peak):
inputs are allocated first, then one warm-up fwd+bwd, then ``--repeats`` timed fwd+bwd (median,
``time.perf_counter``). Peak memory is the increase of the process's peak RSS (``ru_maxrss``) over
one fwd+bwd beyond the inputs: the first call's peak, measured before any other run could raise it.
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


def run_one(provider: str, n_rows: int, hidden: int, vocab: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from lightning_flce import fused_linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(n_rows, hidden, requires_grad=True)
    weight = (torch.randn(vocab, hidden) * hidden**-0.5).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,))
    target[::10] = -100

    def step():
        if provider == "naive":
            loss = F.cross_entropy(F.linear(x, weight), target)
        else:
            loss = fused_linear_cross_entropy(x, weight, target)
        loss.backward()
        x.grad = weight.grad = None
        return loss.item()

    base = _peak_rss_mib()
    loss = step()
    peak = _peak_rss_mib() - base
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return {
        "provider": provider,
        "shape": f"{n_rows}x{hidden}x{vocab}",
        "loss": loss,
        "ms": statistics.median(times),
        "ms_all": times,
        "peak_mib": peak,
        "floor_mib": (n_rows + vocab) * hidden * 4 / 2**20,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4096,1024,32000", help="N,H,V")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the records as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    n_rows, hidden, vocab = (int(v) for v in args.shape.split(","))
    if args.child:
        print(json.dumps(run_one(args.child, n_rows, hidden, vocab, args.repeats)))
        return
    records = []
    for provider in PROVIDERS:
        cmd = [sys.executable, __file__, "--shape", args.shape, "--repeats", str(args.repeats), "--child", provider]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        records.append(json.loads(out.strip().splitlines()[-1]))
    naive = records[0]
    print(f"CPU fwd+bwd, fp32, {args.shape} (N,H,V), {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"{'provider':10s} {'ms':>9s} {'x naive':>8s} {'peak MiB':>9s} {'x naive':>8s} {'loss':>10s}")
    for rec in records:
        print(
            f"{rec['provider']:10s} {rec['ms']:9.1f} {rec['ms'] / naive['ms']:8.2f} {rec['peak_mib']:9.0f} "
            f"{rec['peak_mib'] / naive['peak_mib']:8.3f} {rec['loss']:10.5f}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cores": os.cpu_count(),
                       "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
