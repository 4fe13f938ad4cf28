"""A teacher's top k per token, what a distillation cache stores: ``fused_linear_top_k`` against what a user runs
without it (the head's logits, upcast to fp32, ``log_softmax``, ``topk``: a Hugging Face model's logits, then the
two calls), at the distillation issue's teacher shapes, bf16, in one run.

Per shape and provider: median ms of ``--repeats`` calls after warm-up (CUDA events; providers interleaved per
round), the peak ``max_memory_allocated`` increase over the inputs, the time of the one logits GEMM at this shape
(``torch.mm`` into a preallocated [N, V] bf16 output: the floor) and the provider's share of it, and the largest
error of the values against float64 on the first 256 tokens (the same bf16 inputs upcast).

    python3 benchmarks/bench_top_k.py --out $OUT/top_k.json     # GPU
    python3 benchmarks/bench_top_k.py --device cpu --shapes 256x64x1000 --repeats 3   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

C.ensure_repo_on_path()
from lightning_flce import fused_linear_top_k  # noqa: E402

SHAPES = ["8192x4096x128256", "8192x3584x151936", "8192x2304x256000"]


def providers(k: int) -> Dict[str, Callable[..., Any]]:
    return {
        "unfused": lambda x, w: F.linear(x, w).float().log_softmax(-1).topk(k, dim=-1),
        "flce": lambda x, w: fused_linear_top_k(x, w, k),
        "flce_logits": lambda x, w: fused_linear_top_k(x, w, k, log_probs=False),
        "flce_fp32_logits": lambda x, w: fused_linear_top_k(x, w, k, logits_precision="fp32"),
    }


def gemm_floor_ms(x: torch.Tensor, w: torch.Tensor, device: torch.device, repeats: int) -> float:
    """The logits GEMM alone (into a preallocated [N, V] output), median ms; its buffer freed on return."""
    logits = torch.empty(x.shape[0], w.shape[0], device=device, dtype=x.dtype)
    setups = {"gemm": lambda: lambda: torch.mm(x, w.t(), out=logits)}
    return C.interleaved_medians(setups, device, rounds=1, reps=repeats)["gemm"]


def run_shape(shape: str, args: argparse.Namespace, device: torch.device) -> List[Dict[str, Any]]:
    n, h, v = (int(part) for part in shape.split("x"))
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(v, h, device=device, generator=gen) / h**0.25).to(torch.bfloat16)
    rows = min(n, 256)
    ref = F.linear(x[:rows].double(), w.double())
    ref_log_probs = ref.log_softmax(-1).topk(args.k, dim=-1).values
    ref_logits = ref.topk(args.k, dim=-1).values
    del ref

    gemm_ms = gemm_floor_ms(x, w, device, args.repeats)

    C.free_memory(device)
    records = []
    calls = providers(args.k)
    for name in list(calls):
        record: Dict[str, Any] = {"shape": shape, "N": n, "H": h, "V": v, "k": args.k, "provider": name}
        try:
            out = calls[name](x, w)
            want = ref_logits if name == "flce_logits" else ref_log_probs
            record["max_abs_err"] = (out.values[:rows].double() - want).abs().max().item()
            del out
            record["peak_mib"] = C.measure_peak_mib(lambda name=name: calls[name](x, w), device)
            record["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - an OOM: recorded, the run goes on
            record.update(status="error", error=C.short_error(exc))
            del calls[name]
        records.append(record)
        C.free_memory(device)
    times = C.interleaved_medians(
        {name: (lambda fn=fn: lambda: fn(x, w)) for name, fn in calls.items()},
        device,
        rounds=args.repeats,
        reps=1,
        warmup=args.warmup,
    )
    for record in records:
        if record["provider"] in times:
            record["ms"] = times[record["provider"]]
            record["gemm_ms"] = gemm_ms
            record["gemm_share"] = gemm_ms / record["ms"]
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="NxHxV")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    records = []
    for shape in args.shapes:
        records += run_shape(shape, args, device)
        for record in records[-len(providers(args.k)) :]:
            print(json.dumps(record), flush=True)
    payload = {"env": C.environment(device), "args": {**vars(args), "out": str(args.out)}, "records": records}
    if args.out is not None:
        C.write_json(args.out, payload)
    print("| shape | provider | ms | peak MiB | GEMM's share | max abs err |")
    print("|---|---|---|---|---|---|")
    for r in records:
        if r["status"] != "ok":
            print(f"| {r['shape']} | {r['provider']} | {r['status']}: {r.get('error', '')} | | | |")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
        print(
            f"| {r['shape']} | {r['provider']} | {r['ms']:.2f} | {peak} | {100 * r['gemm_share']:.0f}% |"
            f" {r['max_abs_err']:.1e} |"
        )


if __name__ == "__main__":
    main()
