"""The three GEMMs of one chunk, and dW's accumulator layout, timed alone (the op's per-stage floor check).

For each default chunk shape of ``bench_flce.py`` (C rows of x [C, H] against W [V, H], bf16) this times,
with CUDA events (median of ``--reps`` after warm-up):

- ``logits``: ``torch.mm(x, W.t(), out=[C, V])`` (the op's logits GEMM);
- ``dX``: ``torch.mm(G, W)`` with G [C, V] (the op's dX GEMM);
- ``dW [V,H]``: ``addmm(acc, G.t(), x, out_dtype=fp32, out=acc)`` into an fp32 [V, H] accumulator (the op's
  path, beta = 1), and ``dW first`` the same with beta = 0 (the first chunk);
- ``dW [V,H], 2C rows``: one accumulation over twice the rows (what a chunk twice as large would pay);
- ``dW^T [H,V]``: the same product accumulated transposed, ``addmm(acc_t, x.t(), G, ...)`` into [H, V]
  (cuBLAS picks other tiles for a short-and-wide output);
- ``cast``: the final fp32 -> bf16 cast of the accumulator, ``acc.to(bf16)`` for [V, H] and
  ``acc_t.t().contiguous()`` -> bf16 (a transposing cast) for [H, V].

Each row gives ms, % of its floor (2 C H V FLOPs at the 8192^3 ``torch.mm`` rate of this run; for the casts
read + write bytes at the measured copy bandwidth) and the accumulator bytes moved per call. Needs CUDA and
torch >= 2.8 (``addmm(..., out_dtype=)``).

GPU: python3 benchmarks/experiments/bench_chunk_gemms.py [--shapes 2048x2304x256000] [--reps 20]
Writes ``$OUT/chunk_gemms.json`` and ``$OUT/chunk_gemms.md`` ($OUT defaults to ./bench_out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common and the benchmarks

import _common as C  # noqa: E402
import torch

# (C, H, V): the op's default chunk at each bench_flce.py shape (about 10% of the rows ignored)
GPU_SHAPES = [(3840, 4096, 32000), (3840, 4096, 128256), (2048, 2304, 256000), (2560, 3584, 151936)]


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 3) -> Tuple[float, float, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return C.percentile(times, 50), C.percentile(times, 20), C.percentile(times, 80)


def measure_shape(rows: int, hidden: int, vocab: int, tflops: float, gbps: float, reps: int) -> List[Dict]:
    dev = torch.device("cuda")
    bf16, fp32 = torch.bfloat16, torch.float32
    x = torch.randn(rows, hidden, device=dev, dtype=bf16)
    weight = torch.randn(vocab, hidden, device=dev, dtype=bf16) * hidden**-0.5
    grad = torch.randn(rows, vocab, device=dev, dtype=bf16) * 1e-4
    logits = torch.empty(rows, vocab, device=dev, dtype=bf16)
    acc = torch.zeros(vocab, hidden, device=dev, dtype=fp32)
    acc_t = torch.zeros(hidden, vocab, device=dev, dtype=fp32)
    # one call over two chunks' rows: how much of the accumulator cost is per call
    x2, grad2 = torch.cat([x, x]), torch.cat([grad, grad])
    gemm_floor = 2 * rows * hidden * vocab / (tflops * 1e12) * 1e3
    acc_bytes = vocab * hidden * 4
    cast_floor = (acc_bytes + acc_bytes // 2) / (gbps * 1e9) * 1e3

    cases: List[Tuple[str, Callable[[], Any], float, int]] = [
        ("logits", lambda: torch.mm(x, weight.t(), out=logits), gemm_floor, 0),
        ("dX", lambda: torch.mm(grad, weight), gemm_floor, 0),
        (
            "dW [V,H] first (beta 0)",
            lambda: torch.addmm(acc, grad.t(), x, beta=0, out_dtype=fp32, out=acc),
            gemm_floor,
            acc_bytes,
        ),
        (
            "dW [V,H]",
            lambda: torch.addmm(acc, grad.t(), x, out_dtype=fp32, out=acc),
            gemm_floor,
            2 * acc_bytes,
        ),
        (
            "dW [V,H], 2C rows",
            lambda: torch.addmm(acc, grad2.t(), x2, out_dtype=fp32, out=acc),
            2 * gemm_floor,
            2 * acc_bytes,
        ),
        (
            "dW^T [H,V]",
            lambda: torch.addmm(acc_t, x.t(), grad, out_dtype=fp32, out=acc_t),
            gemm_floor,
            2 * acc_bytes,
        ),
        ("cast [V,H] -> bf16", lambda: acc.to(bf16), cast_floor, acc_bytes + acc_bytes // 2),
        (
            "cast [H,V] -> [V,H] bf16",
            lambda: acc_t.t().to(bf16, memory_format=torch.contiguous_format),
            cast_floor,
            acc_bytes + acc_bytes // 2,
        ),
    ]
    records = []
    for name, fn, floor, nbytes in cases:
        try:
            ms, p20, p80 = time_ms(fn, reps)
            error = None
        except Exception as exc:  # an unsupported path is a result, not a crash
            ms = p20 = p80 = None
            error = C.short_error(exc)
        records.append(
            {
                "shape": f"{rows}x{hidden}x{vocab}",
                "case": name,
                "ms": ms,
                "p20": p20,
                "p80": p80,
                "floor_ms": floor,
                "pct_floor": None if ms is None else 100.0 * floor / ms,
                "acc_bytes": nbytes,
                "error": error,
            }
        )
        print(
            f"{rows}x{hidden}x{vocab} {name:28s} {C.fmt(ms, '.3f'):>8s} ms  {C.fmt(records[-1]['pct_floor'], '.0f')}%"
            + (f"  {error}" if error else ""),
            flush=True,
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="all", help="'all' or CxHxV items, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_chunk_gemms.py needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = (
        GPU_SHAPES
        if args.shapes == "all"
        else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    )
    dev = torch.device("cuda")
    env = C.environment(dev)
    tflops = C.matmul_tflops(torch.bfloat16, dev, 8192)
    gbps = C.copy_bandwidth_gbps(dev)
    t0 = time.time()
    records = []
    for rows, hidden, vocab in shapes:
        records += measure_shape(rows, hidden, vocab, tflops, gbps, args.reps)
        torch.cuda.empty_cache()
    out = C.out_dir()
    C.write_json(
        out / "chunk_gemms.json", {"env": env, "tflops_bf16": tflops, "copy_gbps": gbps, "records": records}
    )
    lines = ["# One chunk's GEMMs and dW accumulator layouts (bf16 operands, fp32 accumulator)", ""]
    lines += C.header_lines(env)
    lines += [
        f"- bf16 matmul rate (8192^3 torch.mm): {tflops:.0f} TFLOP/s; copy bandwidth {gbps:.0f} GB/s; "
        f"median of {args.reps}; wall {time.time() - t0:.0f}s",
        "",
    ]
    lines += C.md_table(
        ["shape CxHxV", "case", "ms", "p20 / p80", "% floor", "acc GB moved", "error"],
        [
            [
                r["shape"],
                r["case"],
                C.fmt(r["ms"], ".3f"),
                f"{C.fmt(r['p20'], '.3f')} / {C.fmt(r['p80'], '.3f')}",
                C.fmt(r["pct_floor"], ".0f"),
                C.fmt(r["acc_bytes"] / 1e9, ".2f"),
                r["error"] or "",
            ]
            for r in records
        ],
    )
    (out / "chunk_gemms.md").write_text("\n".join(lines) + "\n")
    print(f"-> {out / 'chunk_gemms.md'}")


if __name__ == "__main__":
    main()
