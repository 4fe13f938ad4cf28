"""Issue 23: where does the fp32-logits option's per-token error come from, and what removes it at what cost?

bf16 inputs (exact in fp32), so every product is exact and the error of a logit is its summation's. Per GEMM
variant this script measures, at the benchmark shapes, the logits' error against float64 (max / mean
absolute), the per-token loss error of ``F.cross_entropy`` on those fp32 logits (bias and softcap applied in
fp32) against float64, and the GEMM's time for all N rows (CUDA events, warm-up, median):

- ``tc``: cuBLAS's bf16 GEMM writing fp32 (``torch.mm(..., out_dtype=torch.float32)``; the option today);
- ``tc_split{S}``: the same over S slices of K, summed by ``addmm`` into the fp32 output (beta = 1: the
  epilogue adds in fp32 with round-to-nearest);
- ``fp32``: the operands widened, cuBLAS's fp32 GEMM with TF32 off (``logits_precision="fp32_head"``);
- ``fp64``: the float64 GEMM, rounded once to fp32 (the floor an fp32 loss can reach from exact logits);
- ``triton`` / ``triton_kahan``: a plain Triton GEMM (accumulator chained through ``tl.dot``) and one that
  takes each BK-long block's ``tl.dot`` from a zero accumulator and adds it into a Kahan-compensated fp32 sum
  (the library's ``kernels/compensated_gemm.py``, which run72 measured as this script's own copy of it).

Also the op itself (``reduction="none"``) with ``logits_precision`` "fp32" / "fp32_head" / "input".

    python3 benchmarks/experiments/fp32_logits_accuracy.py            # writes $OUT/fp32_logits_accuracy.json
    TRITON_INTERPRET=1 python3 benchmarks/experiments/fp32_logits_accuracy.py --device cpu --small   # plumbing
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common and the benchmarks

import _common  # noqa: E402
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_common.ensure_repo_on_path()
from lightning_flce import fused_linear_cross_entropy  # noqa: E402
from lightning_flce.kernels.compensated_gemm import (  # noqa: E402
    INTERPRET_CONFIG,
    MEASURED_CONFIG,
    GemmConfig,
    compensated_logits_mm,
    grouped_tile,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mm_fp32_out(
    a_ptr, b_ptr, c_ptr, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # A plain Triton GEMM: C[M, N] = A[M, K] @ B[N, K].T, row-major, M % BM == N % BN == K % BK == 0 (the
    # experiment's shapes), the accumulator chained through tl.dot over all of K (as cuBLAS's).
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = a_ptr + rm[:, None] * K + rk[None, :]
    b = b_ptr + rn[None, :] * K + rk[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, K // BK):
        av = tl.load(a)
        bv = tl.load(b)
        if UPCAST:  # the interpreter's bf16 dot is wrong
            av = av.to(tl.float32)
            bv = bv.to(tl.float32)
        acc = tl.dot(av, bv, acc)
        a += BK
        b += BK
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def triton_mm(a, b, bm=128, bn=256, bk=64, warps=8, stages=3):
    m, k = a.shape
    n = b.shape[0]
    if INTERPRET:
        bm, bn, bk = 16, 16, 16
    c = torch.empty(m, n, device=a.device, dtype=torch.float32)
    grid = ((m // bm) * (n // bn),)
    _mm_fp32_out[grid](
        a, b, c, m, n, k, BM=bm, BN=bn, BK=bk, GROUP=8, UPCAST=INTERPRET, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def kahan_mm(a, b, config):
    """The library's compensated GEMM (per-block dots, Kahan's sum) at ``config`` (the interpreter's there)."""
    c = torch.empty(a.shape[0], b.shape[0], device=a.device, dtype=torch.float32)
    return compensated_logits_mm(a, b, c, config=INTERPRET_CONFIG if INTERPRET else config)


def gemm_variants(x, w, device):
    out = {}
    if device.type == "cuda":
        out["tc"] = lambda: torch.mm(x, w.t(), out_dtype=torch.float32)
        for s in (2, 4, 8):
            k = x.shape[1] // s

            def split(s=s, k=k):
                c = torch.mm(x[:, :k], w[:, :k].t(), out_dtype=torch.float32)
                for i in range(1, s):
                    sl = slice(i * k, (i + 1) * k)
                    torch.addmm(c, x[:, sl], w[:, sl].t(), out_dtype=torch.float32, out=c)
                return c

            out[f"tc_split{s}"] = split
    x32, w32 = x.float(), w.float()
    out["fp32"] = lambda: x32 @ w32.t()
    out["fp64"] = lambda: (x.double() @ w.double().t()).float()
    # Kahan keeps two [BM, BN] fp32 tiles in registers: 128 x 128 over 8 warps (128 x 256 would spill)
    out["triton"] = lambda: triton_mm(x, w)
    out["triton_128"] = lambda: triton_mm(x, w, bn=128, stages=4)
    out["triton_kahan"] = lambda: kahan_mm(x, w, GemmConfig(128, 128, 64, 8, 4))
    out["triton_kahan_bk128"] = lambda: kahan_mm(x, w, GemmConfig(128, 128, 128, 8, 3))
    out["triton_library_default"] = lambda: kahan_mm(x, w, MEASURED_CONFIG)
    return out


def timed_ms(fn, device, reps):
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(2):
        fn()
    times = []
    timer = _common.Timer(device)
    for _ in range(reps):
        timer.start()
        fn()
        timer.stop()
        times.append(timer.ms())
    return sorted(times)[len(times) // 2]


def loss_from_logits(logits, bias, softcap, target):
    logits = logits + bias.to(logits.dtype)
    logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, target, reduction="none").double()


def run(shape, dist, device, reps, softcap=30.0):
    n, h, v = shape
    gen = torch.Generator(device=device).manual_seed(0)
    scale = 2.0 if dist == "test" else 1.0  # test_logits_precision's CUDA test: logits std 2; bench_flce: 1
    x = torch.randn(n, h, device=device, generator=gen).bfloat16()
    w = (torch.randn(v, h, device=device, generator=gen) / h**0.5 * scale).bfloat16()
    b = (0.1 * torch.randn(v, device=device, generator=gen)).bfloat16()
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    with torch.no_grad():
        exact = x.double() @ w.double().t()
        truth = loss_from_logits(exact, b, softcap, t)
        rows = {}
        for name, fn in gemm_variants(x, w, device).items():
            try:
                logits = fn()
                err = (logits.double() - exact).abs()
                loss_err = (loss_from_logits(logits, b, softcap, t) - truth).abs()
                rows[name] = {
                    "logit_err_max": float(err.max()),
                    "logit_err_mean": float(err.mean()),
                    "loss_err_max": float(loss_err.max()),
                    "loss_err_mean": float(loss_err.mean()),
                    "ms": timed_ms(fn, device, reps),
                }
                del logits, err
            except Exception as exc:  # a variant that does not run here is recorded, not fatal
                rows[name] = {"error": _common.short_error(exc)}
            print(f"  {name:20s} {rows[name]}", flush=True)
        del exact
        for precision in ("input", "fp32", "fp32_head"):
            got = fused_linear_cross_entropy(
                x, w, t, b, softcap=softcap, reduction="none", logits_precision=precision
            )
            err = (got.double() - truth).abs()
            rows[f"op_{precision}"] = {"loss_err_max": float(err.max()), "loss_err_mean": float(err.mean())}
            print(f"  op_{precision:17s} {rows[f'op_{precision}']}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="one tiny shape (the interpreter's plumbing check)")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(64, 64, 256)] if args.small else [(16384, 4096, 32000), (8192, 2304, 256000)]
    env = _common.environment(device)
    results = []
    for shape in shapes:
        for dist in ("test", "bench"):
            print(f"{'x'.join(map(str, shape))} {dist}", flush=True)
            results.append({"shape": shape, "dist": dist, "rows": run(shape, dist, device, args.reps)})
            _common.free_memory(device)
    _common.write_json(_common.out_dir() / "fp32_logits_accuracy.json", {"env": env, "results": results})


if __name__ == "__main__":
    main()
