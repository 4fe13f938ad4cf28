"""Issue 37: when is the GPU idle during one forward + backward of ``fused_linear_distillation``, and why?

``profile_distill.py`` reports the idle time of a call (its wall time less the sum of its kernels' times: 3.6 ms
of 60.9 at the first shape on an H100, 2026-12-06). This script finds where it is: one call under
``torch.profiler`` with CPU and CUDA activities (once without Python stacks, whose tracing slows the host, then
with them), then every gap of the GPU timeline (from the call's start to its last kernel) longer than
``--min-gap-us``, with the kernel that ends it, the host call that launched that kernel (the aten ops and the
library's Python frames around the launch) and the runtime calls that made the host wait during the gap
(:data:`SYNC_CALLS`).

    python3 benchmarks/experiments/distill_gaps.py --shape 0 --divergence jsd    # $OUT/distill_gaps_*.txt
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common, bench_distill

import _common  # noqa: E402
import bench_distill  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

_common.ensure_repo_on_path()
from lightning_flce import fused_linear_distillation  # noqa: E402

# Runtime calls that make the host wait for the GPU, by exact name: a copy to the host (``.tolist()``) shows as
# cudaMemcpyAsync then cudaStreamSynchronize (the asynchronous copies of the chunk loop are device to device and
# do not wait); cudaFree (the caching allocator releasing memory to allocate anew) and cudaMalloc synchronize too.
SYNC_CALLS = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaFree",
        "cudaMalloc",
    }
)
LIBRARY_MARKERS = ("lightning_flce", "bench_distill", "distill_gaps")


def trace_events(prof, folder: Path, tag: str):
    path = folder / f"distill_gaps_{tag}.json"
    prof.export_chrome_trace(str(path))
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    with gzip.open(str(path) + ".gz", "wt") as file:
        json.dump({"traceEvents": events}, file)
    os.remove(path)
    return events


def python_frames(events, tid, ts):
    """The library's Python frames and the aten ops (outermost first) that enclose host time ``ts`` on ``tid``."""
    frames = [
        e
        for e in events
        if e.get("tid") == tid
        and e["ts"] <= ts <= e["ts"] + e.get("dur", 0)
        and (
            e.get("cat") == "cpu_op"
            or (e.get("cat") == "python_function" and any(m in e["name"] for m in LIBRARY_MARKERS))
        )
    ]
    frames.sort(key=lambda e: e["ts"])
    return [e["name"].split("/")[-1] for e in frames]


def analyse(events, min_gap_us: float, start_ts: float, top: int):
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] >= start_ts),
        key=lambda e: e["ts"],
    )
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    syncs = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNC_CALLS]
    gaps = []
    previous_end = start_ts
    busy = 0.0
    for kernel in kernels:
        busy += kernel.get("dur", 0)
        gap = kernel["ts"] - previous_end
        if gap >= min_gap_us:
            launch = runtime.get(kernel.get("args", {}).get("correlation"))
            during = [
                s["name"] for s in syncs if s["ts"] < kernel["ts"] and s["ts"] + s["dur"] > previous_end
            ]
            gaps.append(
                {
                    "gap_us": gap,
                    "at_us": previous_end - start_ts,
                    "next_kernel": kernel["name"][:90],
                    "launched_by": python_frames(events, launch["tid"], launch["ts"])[-4:] if launch else [],
                    "syncs_during": during,
                }
            )
        previous_end = max(previous_end, kernel["ts"] + kernel.get("dur", 0))
    total = previous_end - start_ts
    lines = [
        f"call span {total / 1e3:.2f} ms, kernels busy {busy / 1e3:.2f} ms, idle {(total - busy) / 1e3:.2f} ms; "
        f"{len(kernels)} kernels; gaps >= {min_gap_us} us: {len(gaps)}, "
        f"{sum(g['gap_us'] for g in gaps) / 1e3:.2f} ms",
    ]
    by_site = {}
    for g in gaps:
        key = " > ".join(g["launched_by"]) or "?"
        count, summed = by_site.get(key, (0, 0.0))
        by_site[key] = (count + 1, summed + g["gap_us"])
    lines.append("gaps by the launching site (count, ms):")
    for key, (count, summed) in sorted(by_site.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {count:4d} {summed / 1e3:7.3f}  {key}")
    lines.append("synchronizing calls in the call (at ms, us, frames):")
    for sync in sorted(syncs, key=lambda e: e["ts"]):
        if sync["ts"] >= start_ts:
            frames = " > ".join(python_frames(events, sync["tid"], sync["ts"])[-4:])
            lines.append(
                f"  {(sync['ts'] - start_ts) / 1e3:7.3f} {sync['dur']:8.1f}  {sync['name']}  {frames}"
            )
    lines.append(f"the {top} largest gaps:")
    for g in sorted(gaps, key=lambda g: -g["gap_us"])[:top]:
        lines.append(
            f"  {g['gap_us']:8.1f} us at {g['at_us'] / 1e3:7.3f} ms before {g['next_kernel']}\n"
            f"      launched by {' > '.join(g['launched_by'])}; syncs during: {g['syncs_during']}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, default=0)
    parser.add_argument("--divergence", default="jsd")
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    device = torch.device("cuda")
    shape = bench_distill.SHAPES[args.shape]
    xs, ws, xt, wt, target = bench_distill.make_inputs(shape, device, 0, 0.0)

    def step():
        xs.grad = ws.grad = None
        loss = fused_linear_distillation(xs, ws, xt, wt, target, divergence=args.divergence, beta=0.5)
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    marker = torch.ones(1, device=device)  # a kernel that marks the call's start on the GPU timeline
    tag = f"{'x'.join(map(str, shape))}_{args.divergence}"
    lines = [f"shape {tag}; {torch.cuda.get_device_name()}; torch {torch.__version__}"]
    # Without Python stacks first (their tracing slows the host, which makes gaps of its own), then with them.
    for with_stack in (False, True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
            torch.cuda.synchronize()
            marker.add_(1)
            step()
            torch.cuda.synchronize()
        events = trace_events(prof, out, f"{tag}_{'stack' if with_stack else 'plain'}")
        kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
        start_ts = kernels[0]["ts"] + kernels[0].get("dur", 0)  # the marker's end
        lines.append(f"\n## with_stack={with_stack}")
        lines += analyse(events, args.min_gap_us, start_ts, args.top)
    text = "\n".join(lines)
    print(text)
    (out / f"distill_gaps_{tag}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
