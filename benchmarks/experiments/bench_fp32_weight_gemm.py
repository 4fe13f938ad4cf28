"""Experiment (issue 4, e2e peak): can Triton GEMMs that read an fp32 head weight and round its tiles to
bf16 in registers replace cuBLAS on the bf16 weight copy the op makes under autocast (501 MiB at the e2e
head, 128256 x 2048)? Without that copy a 2048-row chunk would fit under Liger's head peak (NOTES.md,
session 9). The two products of a chunk that read the weight:

    logits [c, V] = x [c, H] @ W.T      (bf16 out)
    dX     [c, H] = G [c, V] @ W        (fp32 accumulate, bf16 out)

Each in two orientations: the weight as the dot's second operand (``tl.dot(x, w.T)``) or as its first
(``tl.dot(w, x.T)``, the transposed product, stored transposed), where Hopper's wgmma can take the converted
tile from registers. Compared with cuBLAS on the bf16 copy (and the copy's cast) at the e2e chunk shape.

    python benchmarks/experiments/bench_fp32_weight_gemm.py                 # H200: all configs, JSON + table under $OUT
    TRITON_INTERPRET=1 python benchmarks/experiments/bench_fp32_weight_gemm.py --device cpu --check-only
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile_ids(pid, num_m, num_n, M_FASTEST: tl.constexpr):
    # M_FASTEST: consecutive programs share an N tile (the weight's tile is read once from HBM, then L2).
    if M_FASTEST:
        return pid % num_m, pid // num_m
    return pid // num_n, pid % num_n


@triton.jit
def _logits_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FIRST: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x[M, K] @ w[N, K].T with w fp32 rounded to x's dtype per tile; fp32 accumulation."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), True)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    if W_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k[None, :] < K - k0
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_mask, other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & k_mask, other=0.0).to(x.dtype)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong: same rounded values, fp32 tiles
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc) if W_FIRST else tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = acc.to(out_ptr.dtype.element_ty)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if W_FIRST:
        out = tl.trans(out)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


@triton.jit
def _dx_kernel(
    g_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr,
    stride_gm, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FIRST: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """out[M, N] = g[M, K] @ w[K, N] with w fp32 rounded to g's dtype per tile; fp32 accumulation."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), True)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = g_ptr + offs_m[:, None] * stride_gm + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :]
    if W_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        g = tl.load(g_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0).to(g.dtype)
        if DOT_FP32:
            g, w = g.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(tl.trans(w), tl.trans(g), acc) if W_FIRST else tl.dot(g, w, acc)
        g_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    out = acc.to(out_ptr.dtype.element_ty)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if W_FIRST:
        out = tl.trans(out)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


def logits(x, w, cfg):
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    bm, bn, bk, warps, stages, w_first = cfg
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    kw = {} if INTERPRET else dict(num_warps=warps, num_stages=stages)
    _logits_kernel[grid](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), bm, bn, bk, w_first, INTERPRET, **kw
    )
    return out


def dx(g, w, cfg):
    M, K = g.shape
    N = w.shape[1]
    out = torch.empty(M, N, device=g.device, dtype=g.dtype)
    bm, bn, bk, warps, stages, w_first = cfg
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    kw = {} if INTERPRET else dict(num_warps=warps, num_stages=stages)
    _dx_kernel[grid](
        g, w, out, M, N, K, g.stride(0), w.stride(0), out.stride(0), bm, bn, bk, w_first, INTERPRET, **kw
    )
    return out


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def check(device, dtype):
    """Odd shapes (masks), fresh random inputs, output poisoned by torch.empty; vs float64 of the bf16-rounded
    operands (what cuBLAS on the bf16 copy computes)."""
    torch.manual_seed(0)
    M, H, V = 70, 96, 333
    x = torch.randn(M, H, device=device).to(dtype)
    w = torch.randn(V, H, device=device) * 0.05
    g = torch.randn(M, V, device=device).to(dtype)
    wr = w.to(dtype).double()
    ref_logits, ref_dx = x.double() @ wr.T, g.double() @ wr
    cfgs = [(32, 32, 32, 4, 2, False), (32, 32, 32, 4, 2, True), (16, 64, 16, 4, 2, True)]
    worst = 0.0
    for cfg in cfgs:
        for name, out, ref in (("logits", logits(x, w, cfg), ref_logits), ("dx", dx(g, w, cfg), ref_dx)):
            err = rel_err(out, ref)
            worst = max(worst, err)
            # bf16 output rounding is ~1.7e-3 here; the interpreter truncates fp32 -> bf16 (twice: W and out)
            assert torch.isfinite(out).all() and err < (8e-3 if INTERPRET else 3e-3), (name, cfg, err)
    print(f"check passed ({dtype}, {len(cfgs)} configs, worst relative error {worst:.1e})")


CONFIGS = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, w_first)
    (128, 128, 64, 8, 3, False),
    (128, 128, 64, 8, 4, False),
    (128, 256, 64, 8, 2, False),
    (128, 128, 64, 4, 3, False),
    (128, 128, 64, 8, 3, True),
    (128, 128, 64, 8, 4, True),
    (128, 256, 64, 8, 2, True),
    (64, 256, 64, 8, 3, True),
    (128, 128, 32, 8, 4, True),
    (128, 128, 32, 8, 4, False),
    (128, 256, 64, 8, 3, True),
    (128, 128, 128, 8, 3, True),
    (128, 128, 128, 8, 3, False),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    args = p.parse_args()
    check(args.device, torch.bfloat16)
    if args.check_only:
        return
    from triton.testing import do_bench

    c, H, V = args.rows, args.hidden, args.vocab
    torch.manual_seed(1)
    x = torch.randn(c, H, device="cuda").bfloat16()
    w = torch.randn(V, H, device="cuda") * 0.02
    g = (torch.randn(c, V, device="cuda") * 1e-5).bfloat16()
    wb = w.bfloat16()
    ref_l, ref_dx = x @ wb.T, g @ wb
    flop = 2 * c * H * V
    mm = torch.randn(8192, 8192, device="cuda").bfloat16()
    rate = 2 * 8192**3 / (do_bench(lambda: mm @ mm, warmup=100, rep=500, return_mode="median") * 1e-3)
    floor_ms = flop / rate * 1e3
    rows = []

    def bench(name, fn, ref=None):
        ms = do_bench(fn, warmup=100, rep=400, return_mode="median")
        err = rel_err(fn(), ref.double()) if ref is not None else None
        rows.append(
            dict(name=name, ms=ms, pct_floor=floor_ms / ms * 100 if ref is not None else None, err=err)
        )
        print(
            f"{name:44s} {ms:8.3f} ms"
            + (f"  {floor_ms / ms * 100:5.1f}% floor  err vs cuBLAS {err:.1e}" if err is not None else "")
        )

    bench("cast W fp32->bf16 (cuBLAS path's copy)", lambda: w.bfloat16())
    bench("cublas logits x @ Wb.T", lambda: x @ wb.T, ref_l)
    bench("cublas dX G @ Wb", lambda: g @ wb, ref_dx)
    # Control: the same kernels on the bf16 copy (the in-register cast a no-op) separate the cast's cost
    # from the kernel's own distance to cuBLAS.
    for cfg in CONFIGS:
        for name, fn, ref in (
            ("logits", lambda cfg=cfg: logits(x, w, cfg), ref_l),
            ("dx", lambda cfg=cfg: dx(g, w, cfg), ref_dx),
            ("logits bf16 W", lambda cfg=cfg: logits(x, wb, cfg), ref_l),
            ("dx bf16 W", lambda cfg=cfg: dx(g, wb, cfg), ref_dx),
        ):
            try:
                bench(f"triton {name} {cfg}", fn, ref)
            except Exception as exc:  # out of shared memory etc.
                print(f"triton {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                rows.append(
                    dict(name=f"triton {name} {cfg}", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                )
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fp32_weight_gemm.json"), "w") as f:
        json.dump(
            dict(shape=[c, H, V], bf16_rate_tflops=rate / 1e12, floor_ms=floor_ms, rows=rows), f, indent=1
        )
    print(f"bf16 rate {rate / 1e12:.1f} TFLOP/s, floor {floor_ms:.3f} ms per product")


if __name__ == "__main__":
    main()
