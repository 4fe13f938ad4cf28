"""Issue 37: where does one forward + backward of ``fused_linear_distillation`` spend its GPU time?

At the issue's shapes (``bench_distill.SHAPES``, its inputs), per divergence: the wall time of a call (CUDA events,
median) and, from ``torch.profiler``, the summed kernel time per call in three groups: the GEMMs (cuBLAS /
CUTLASS kernels: both heads' logits, the student's dX and dW), the distillation chunk kernel
(``kernels/distill.py``'s ``_distill_kernel``) and everything else (casts, copies, reductions; the five largest
by name). The gap between the wall time and the kernels' sum is launch and host time the GPU sat idle.

    python3 benchmarks/experiments/profile_distill.py                      # $OUT/profile_distill.json
    python3 benchmarks/experiments/profile_distill.py --shapes 2 --divergences jsd --accum-dtype bfloat16
    python3 benchmarks/experiments/profile_distill.py --divergences jsd --launches default,4096@8   # the split launch beside
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common, bench_distill

import contextlib  # noqa: E402

import _common  # noqa: E402
import bench_distill  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

_common.ensure_repo_on_path()
from lightning_flce import fused_linear_distillation  # noqa: E402

GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "cublas")


def group_of(name: str) -> str:
    lowered = name.lower()
    if "_distill_kernel" in lowered:
        return "distill kernel"
    if any(marker in lowered for marker in GEMM_MARKERS):
        return "GEMM"
    return "other"


def kernel_times(step, calls: int):
    """Summed device time (ms per call) of each kernel name over ``calls`` calls of ``step``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    per_name = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "cuda_time_total", 0.0)
        if device_us:
            per_name[event.key] += device_us / 1e3 / calls
    return dict(per_name)


def kernel_launch(launch: str):
    """``default``: the library's launch of the distillation kernel; ``<block>@<programs an SM>``: blocks of at most
    that many columns, rows split for that many programs an SM for every divergence (0: whole rows)."""
    if launch == "default":
        return contextlib.nullcontext()
    block, programs = (int(value) for value in launch.split("@"))
    return bench_distill.launch_override(block, programs)


def make_step(inputs, divergence: str, accum_dtype):
    """One forward + backward of the loss on ``inputs`` (the student's gradients cleared first)."""
    xs, ws, xt, wt, target = inputs

    def step():
        xs.grad = ws.grad = None
        loss = fused_linear_distillation(
            xs, ws, xt, wt, target, divergence=divergence, beta=0.5, accum_dtype=accum_dtype
        )
        loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0,1,2")
    parser.add_argument("--divergences", default="forward_kl,jsd")
    parser.add_argument("--accum-dtype", default=None)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--launches", default="default", help="default and/or <block>@<programs an SM>, e.g. default,4096@8"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    env = _common.environment(device)
    records, table = [], []
    for shape in bench_distill.parse_shapes(args.shapes):
        xs, ws, xt, wt, target = bench_distill.make_inputs(shape, device, seed=0, ignore_fraction=0.0)
        cases = [(div, launch) for div in args.divergences.split(",") for launch in args.launches.split(",")]
        for divergence, launch in cases:
            with kernel_launch(launch):
                step = make_step((xs, ws, xt, wt, target), divergence, args.accum_dtype)

                for _ in range(2):  # compiles, autotuning, allocator warm-up
                    step()
                times = []
                for _ in range(args.repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
                wall = sorted(times)[len(times) // 2]
                per_name = kernel_times(step, args.calls)
                groups = defaultdict(float)
                for name, ms in per_name.items():
                    groups[group_of(name)] += ms
                others = sorted(
                    ((ms, name) for name, ms in per_name.items() if group_of(name) == "other"), reverse=True
                )[:5]
                record = {
                    "shape": shape,
                    "divergence": divergence,
                    "launch": launch,
                    "accum_dtype": args.accum_dtype,
                    "wall_ms": wall,
                    "groups_ms": dict(groups),
                    "kernels_ms": per_name,
                    "largest_other": [[name, ms] for ms, name in others],
                }
                records.append(record)
                kernels = sum(groups.values())
                table.append(
                    [
                        "x".join(map(str, shape)),
                        f"{divergence} {launch}",
                        _common.fmt(wall),
                        _common.fmt(groups["GEMM"]),
                        _common.fmt(groups["distill kernel"]),
                        _common.fmt(groups["other"]),
                        _common.fmt(wall - kernels),
                        "; ".join(f"{name[:40]} {ms:.2f}" for ms, name in others[:3]),
                    ]
                )
        del xs, ws, xt, wt, target, step
        _common.free_memory(device)
    _common.write_json(_common.out_dir() / "profile_distill.json", {"environment": env, "records": records})
    print(*_common.header_lines(env), sep="\n")
    headers = [
        "shape",
        "divergence, launch",
        "wall ms",
        "GEMM ms",
        "distill kernel ms",
        "other ms",
        "idle ms",
        "largest other",
    ]
    print(*_common.text_table(headers, table), sep="\n")


if __name__ == "__main__":
    main()
