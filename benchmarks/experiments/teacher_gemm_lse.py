"""Would the teacher's 256-row logits GEMM pay for computing pass 1's statistics in its epilogue?

Inside the distillation op the teacher's logits are computed on blocks of ``engine.AUXILIARY_BLOCK_ROWS`` (256)
rows, ``x_t[256, H] @ W_t[V, H].T`` by cuBLAS, and the distillation kernel's first pass reads each teacher row
for its max and sum of exps. On an H100 cuBLAS runs that short GEMM at 60–69% of its full-size rate
(``bench_chunk_gemms.py``, 2026-12-07): the whole teacher head is read for 256 rows. A GEMM whose epilogue also
writes each row's per-tile (max, sum of exp) of ``z = logits * inv_t`` would let the kernel skip the teacher's
side of pass 1, so it pays if it is no slower than cuBLAS plus that pass.

Per shape (256 x H x V, bf16), timed with CUDA events (median of ``--reps`` after warm-up, the cases interleaved
over ``--rounds``):

- ``cublas``: ``torch.mm(x, W.t(), out=[256, V] bf16)`` (what the op runs);
- ``row_lse``: a Triton pass over the [256, V] bf16 logits computing each row's max and sum of exps, one program
  a row-slice (a stand-in for the teacher's share of the kernel's pass 1, which reads both sides' rows);
- ``cublas + row_lse``: the two in sequence (today's cost of that work);
- ``triton_gemm``: a plain Triton GEMM (one fp32 accumulator chain, grouped tile order so the two 128-row tiles
  of a column block share its read of W) writing bf16 logits;
- ``triton_gemm_lse``: the same with the epilogue's per-tile (max, sum of exps) of the bf16-rounded logits times
  ``inv_t``, merged per row afterwards (checked against ``torch.logsumexp`` in float64).

    python3 benchmarks/experiments/teacher_gemm_lse.py            # $OUT/teacher_gemm_lse.json and .md
    TRITON_INTERPRET=1 python3 benchmarks/experiments/teacher_gemm_lse.py --device cpu --small   # plumbing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common as C  # noqa: E402
import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = [(256, 4096, 128256), (256, 3584, 151936), (256, 2304, 256000)]
SMALL_SHAPES = [(32, 48, 200)]

if INTERPRET:
    GEMM_CONFIGS = [triton.Config({"BM": 16, "BN": 32, "BK": 16, "GROUP_M": 2}, num_warps=1, num_stages=1)]
else:
    GEMM_CONFIGS = [
        triton.Config({"BM": bm, "BN": bn, "BK": 64, "GROUP_M": gm}, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (128, 256, 8, 3),
            (128, 128, 4, 4),
            (128, 128, 8, 4),
            (64, 256, 4, 4),
            (256, 128, 8, 3),
            (64, 128, 4, 5),
        ]
        for gm in (2, 4)
    ]


@triton.autotune(configs=GEMM_CONFIGS, key=["M", "N", "K", "WITH_LSE"])
@triton.jit
def _gemm_lse_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    max_ptr,
    sum_ptr,
    M,
    N,
    K,
    inv_t,
    n_col_tiles,
    WITH_LSE: tl.constexpr,
    WIDEN: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    # grouped order: GROUP_M row tiles of one column block run next to each other (W's block read once from HBM)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(
            x_ptr + rows[:, None] * K + (k + ks)[None, :], mask=(rows[:, None] < M) & ((k + ks)[None, :] < K)
        )
        b = tl.load(
            w_ptr + cols[:, None] * K + (k + ks)[None, :], mask=(cols[:, None] < N) & ((k + ks)[None, :] < K)
        )
        if WIDEN:  # the interpreter's bf16 dot is wrong
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, tl.trans(b))
    logits = acc.to(out_ptr.dtype.element_ty)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], logits, mask=inside)
    if WITH_LSE:
        z = tl.where(inside, logits.to(tl.float32) * inv_t, float("-inf"))
        tile_max = tl.max(z, axis=1)
        tile_sum = tl.sum(tl.exp(z - tile_max[:, None]), axis=1)
        tl.store(max_ptr + rows * n_col_tiles + pid_n, tile_max, mask=rows < M)
        tl.store(sum_ptr + rows * n_col_tiles + pid_n, tile_sum, mask=rows < M)


@triton.jit
def _row_lse_kernel(logits_ptr, max_ptr, sum_ptr, N, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, N, BLOCK):
        z = tl.load(logits_ptr + row * N + start + cols, mask=start + cols < N, other=float("-inf"))
        z = z.to(tl.float32) * inv_t
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    tl.store(max_ptr + row, running_max)
    tl.store(sum_ptr + row, running_sum)


_PARTIALS: Dict[tuple, torch.Tensor] = {}


def _partials(device: torch.device, m: int, n: int, fill: float) -> torch.Tensor:
    """A reused [m, n] fp32 buffer, filled once (so that timed calls launch no fill kernel)."""
    key = (str(device), m, n, fill)
    if key not in _PARTIALS:
        _PARTIALS[key] = torch.full((m, n), fill, device=device, dtype=torch.float32)
    return _PARTIALS[key]


def gemm_lse(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, inv_t: float, with_lse: bool):
    m, k = x.shape
    n = w.shape[0]
    tile_n = min(c.kwargs["BN"] for c in GEMM_CONFIGS)  # partial buffers sized for the narrowest tile
    n_col_tiles = triton.cdiv(n, tile_n)
    # (a BN wider than the narrowest leaves entries unwritten: the timed calls do not read them, and the checked
    # call starts from -inf / 0)
    maxes = _partials(x.device, m, n_col_tiles, float("-inf"))
    sums = _partials(x.device, m, n_col_tiles, 0.0)

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

    _gemm_lse_kernel[grid](
        x, w, out, maxes, sums, m, n, k, inv_t, n_col_tiles, WITH_LSE=with_lse, WIDEN=INTERPRET
    )
    return maxes, sums


def merged_lse(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    top = maxes.max(dim=1, keepdim=True).values
    return (top.squeeze(1) + torch.log((sums * torch.exp(maxes - top)).sum(dim=1))).double()


def row_lse(logits: torch.Tensor, inv_t: float):
    m, n = logits.shape
    maxes = torch.empty(m, device=logits.device, dtype=torch.float32)
    sums = torch.empty(m, device=logits.device, dtype=torch.float32)
    _row_lse_kernel[(m,)](
        logits, maxes, sums, n, inv_t, BLOCK=64 if INTERPRET else 4096, num_warps=1 if INTERPRET else 8
    )
    return maxes, sums


def make_cases(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, inv_t: float
) -> Dict[str, Callable[[], object]]:
    cublas_out = torch.empty_like(out)
    return {
        "cublas": lambda: torch.mm(x, w.t(), out=cublas_out),
        "row_lse": lambda: row_lse(cublas_out, inv_t),
        "cublas + row_lse": lambda: row_lse(torch.mm(x, w.t(), out=cublas_out), inv_t),
        "triton_gemm": lambda: gemm_lse(x, w, out, inv_t, False),
        "triton_gemm_lse": lambda: gemm_lse(x, w, out, inv_t, True),
    }


def time_cases(cases: Dict[str, Callable[[], object]], device: torch.device, rounds: int, reps: int) -> Dict:
    samples: Dict[str, List[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up (and autotune)
        for _ in range(3):
            fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / reps)
            else:
                import time

                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                samples[name].append((time.perf_counter() - t0) * 1e3 / reps)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--small", action="store_true", help="one tiny shape (the interpreter's plumbing check)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    inv_t = 1.0 / 1.5
    records = []
    env = C.environment(device) if device.type == "cuda" else {"device": "cpu"}
    tflops = C.matmul_tflops(torch.bfloat16, device, 8192) if device.type == "cuda" else None
    for m, h, v in SMALL_SHAPES if args.small else SHAPES:
        x = torch.randn(m, h, device=device, dtype=torch.bfloat16)
        w = (torch.randn(v, h, device=device, dtype=torch.float32) * h**-0.5 * 3).to(torch.bfloat16)
        out = torch.empty(m, v, device=device, dtype=torch.bfloat16)
        ref_logits = x.double() @ w.double().t()
        # correctness first: the epilogue's statistics against float64 of the GEMM's own bf16 logits
        gemm_lse(x, w, out, inv_t, True)  # autotune: every configuration writes the partials its own way
        for (_, rows, _, fill), buffer in _PARTIALS.items():
            if rows == m:
                buffer.fill_(fill)
        maxes, sums = gemm_lse(x, w, out, inv_t, True)
        ref_lse = torch.logsumexp(out.double() * inv_t, dim=1)
        lse_err = (merged_lse(maxes, sums) - ref_lse).abs().max().item()
        logits_err = (out.double() - ref_logits).abs().max().item()
        rm, rs = row_lse(out, inv_t)
        row_err = (rm.double() + torch.log(rs.double()) - ref_lse).abs().max().item()
        cases = make_cases(x, w, out, inv_t)
        times = time_cases(cases, device, args.rounds, args.reps)
        flops = 2 * m * h * v
        for name, ms in times.items():
            rec = {
                "shape": f"{m}x{h}x{v}",
                "case": name,
                "ms": ms,
                "tflops": None if "gemm" not in name and name != "cublas" else flops / ms / 1e9,
                "pct_mm_rate": None
                if tflops is None or name == "row_lse"
                else 100 * flops / ms / 1e9 / tflops,
                "lse_err": lse_err,
                "row_lse_err": row_err,
                "logits_err": logits_err,
            }
            records.append(rec)
            print(
                f"{rec['shape']:18s} {name:18s} {ms:8.3f} ms  "
                f"{C.fmt(rec['pct_mm_rate'], '.0f'):>4s}% of mm  lse err {lse_err:.1e} row {row_err:.1e}",
                flush=True,
            )
        best = getattr(_gemm_lse_kernel, "best_config", None)
        print(f"  best config: {best}", flush=True)
    out_dir = C.out_dir()
    C.write_json(out_dir / "teacher_gemm_lse.json", {"env": env, "tflops_bf16": tflops, "records": records})
    lines = ["# The teacher's 256-row logits GEMM with pass 1's statistics in its epilogue", ""]
    if device.type == "cuda":
        lines += C.header_lines(env) + [f"- bf16 8192^3 torch.mm: {tflops:.0f} TFLOP/s", ""]
    lines += C.md_table(
        ["shape", "case", "ms", "% of mm rate", "LSE err (epilogue)", "LSE err (row pass)"],
        [
            [
                r["shape"],
                r["case"],
                f"{r['ms']:.3f}",
                C.fmt(r["pct_mm_rate"], ".0f"),
                f"{r['lse_err']:.1e}",
                f"{r['row_lse_err']:.1e}",
            ]
            for r in records
        ],
    )
    (out_dir / "teacher_gemm_lse.md").write_text("\n".join(lines) + "\n")
    print(f"-> {out_dir / 'teacher_gemm_lse.md'}")


if __name__ == "__main__":
    main()
