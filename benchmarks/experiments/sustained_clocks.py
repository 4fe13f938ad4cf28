"""Sustained load vs short bursts: does a workload slow down when it runs back to back (power-capped clocks)?

    python benchmarks/experiments/sustained_clocks.py [--seconds 12] [--shape 8192,2304,256000] [--out DIR]

Runs, one after the other, for ``--seconds`` each: the bf16 matmul-rate probe (8192^3 ``torch.mm``, the FLOP
floor's denominator in bench_flce.py) and flce's fwd+bwd at ``--shape`` (bf16, random data, 10% ignored), each
call timed with CUDA events, while a thread samples ``nvidia-smi`` (SM clock, power draw, temperature) every
0.25 s. Prints and writes (``sustained_clocks.{json,md}``) the per-second medians: a workload whose later seconds
run slower at a lower SM clock near the power cap is throttled, and its short-burst timings overstate it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common and the benchmarks

import _common as C  # noqa: E402
import torch  # noqa: E402
from bench_flce import make_data  # noqa: E402

QUERY = "clocks.sm,power.draw,temperature.gpu"


def sample_smi(stop: threading.Event, out: List[Dict[str, float]], t0: float, period_s: float = 0.25) -> None:
    while not stop.is_set():
        try:
            line = subprocess.run(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            sm, power, temp = (float(v) for v in line.split(",")[:3])
            out.append({"t": time.perf_counter() - t0, "sm_mhz": sm, "power_w": power, "temp_c": temp})
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
        stop.wait(period_s)


def run_for(
    fn: Callable[[], Any], seconds: float, device: torch.device, t_start: float
) -> Tuple[float, List[Dict[str, float]]]:
    """Calls ``fn`` back to back for ``seconds`` after one warm-up call (Triton compiles there); returns the
    start of the timed calls (s after ``t_start``, the sampler's zero) and [{t (start, s), ms}] per call."""
    fn()
    C.synchronize(device)
    calls, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tm = C.Timer(device)
        start = time.perf_counter() - t0
        tm.start()
        fn()
        tm.stop()
        tm_ms = tm.ms()  # synchronizes: one call in flight, as a training step would have
        calls.append({"t": start, "ms": tm_ms})
    return t0 - t_start, calls


def per_second(calls: List[Dict[str, float]], smi: List[Dict[str, float]], offset: float) -> List[List[Any]]:
    rows = []
    last = int(max((c["t"] for c in calls), default=0))
    for second in range(last + 1):
        ms = [c["ms"] for c in calls if second <= c["t"] < second + 1]
        window = [s for s in smi if second <= s["t"] - offset < second + 1]
        rows.append(
            [
                second,
                len(ms),
                C.fmt(C.percentile(ms, 50) if ms else None, ".2f"),
                C.fmt(C.percentile([s["sm_mhz"] for s in window], 50) if window else None, ".0f"),
                C.fmt(C.percentile([s["power_w"] for s in window], 50) if window else None, ".0f"),
                C.fmt(max((s["temp_c"] for s in window), default=None), ".0f"),
            ]
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--shape", default="8192,2304,256000", help="N,H,V of the flce workload")
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/_common.out_dir())")
    args = p.parse_args()
    device = torch.device("cuda")
    shape = tuple(int(v) for v in args.shape.split(","))

    C.ensure_repo_on_path()
    from lightning_flce import fused_linear_cross_entropy

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    x, w, t = make_data(shape, torch.bfloat16, "random", device, 0, 0.1, 2.0)

    def flce() -> None:
        x.grad = w.grad = None
        fused_linear_cross_entropy(x, w, t).backward()

    workloads = {"mm_8192_bf16": lambda: torch.mm(a, b), f"flce_{'x'.join(map(str, shape))}_bf16": flce}
    smi: List[Dict[str, float]] = []
    stop = threading.Event()
    t_start = time.perf_counter()
    sampler = threading.Thread(target=sample_smi, args=(stop, smi, t_start), daemon=True)
    sampler.start()
    results: Dict[str, Any] = {"env": C.environment(device), "seconds": args.seconds, "workloads": {}}
    lines: List[str] = ["# Sustained load: per-second medians", ""] + C.header_lines(results["env"]) + [""]
    for name, fn in workloads.items():
        time.sleep(3.0)  # idle between workloads: let clocks and power settle
        offset, calls = run_for(fn, args.seconds, device, t_start)
        results["workloads"][name] = {"offset_s": offset, "calls": calls}
        rows = per_second(calls, smi, offset)
        lines += [f"## {name}", ""] + C.md_table(
            ["second", "calls", "median ms", "SM MHz", "power W", "max C"], rows
        )
        lines.append("")
        print("\n".join(C.text_table(["second", "calls", "median ms", "SM MHz", "power W", "max C"], rows)))
    stop.set()
    sampler.join(timeout=10)
    results["smi"] = smi
    out = C.out_dir() if args.out is None else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    C.write_json(out / "sustained_clocks.json", results)
    (out / "sustained_clocks.md").write_text("\n".join(lines) + "\n")
    print(f"[sustained_clocks] -> {out}/sustained_clocks.{{json,md}}")


if __name__ == "__main__":
    main()
