"""Issue 23: where the time of ``logits_precision="fp32_compensated"`` goes, per chunk, for its two ways of handing
the logits GEMM's results to the chunk kernel.

- ``rows`` (``engine.RELATIVE_16BIT_LOGITS`` off): the compensated GEMM writes fp32 logits; the chunk kernel reads
  them twice (LSE, then gradient) and writes the 16-bit gradient into the rows' second halves;
- ``relative`` (the library's path): the GEMM's epilogue writes each row's LSE partials and target logit in fp32
  and stores the logits minus their tile's max in bf16; the chunk kernel reads that buffer once.

Against the default's parts (cuBLAS's bf16 GEMM, the chunk kernel's two passes over bf16 logits). Per benchmark
shape, on one chunk of the op's rows (``engine.chunk_rows``), bf16 inputs (logits of std ~2), no bias, no softcap
(the provider benchmark's problem): CUDA events, warm-up, the median over interleaved rounds; each chunk kernel's
input restored before each call, outside the timed region. The dX / dW GEMMs are the same for all three (they read
the 16-bit gradient) and are not timed here.

    python3 benchmarks/experiments/relative_logits_parts.py     # writes $OUT/relative_logits_parts.json
    TRITON_INTERPRET=1 python3 benchmarks/experiments/relative_logits_parts.py --device cpu --small   # plumbing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402
import torch

_common.ensure_repo_on_path()
from lightning_flce import engine  # noqa: E402
from lightning_flce.kernels import LossOptions, gradient_in_logits_rows  # noqa: E402
from lightning_flce.kernels import compensated_gemm as gemm  # noqa: E402
from lightning_flce.kernels import cross_entropy as ce  # noqa: E402

SHAPES = [(16384, 4096, 32000), (16384, 4096, 128256), (8192, 2304, 256000), (8192, 3584, 151936)]
# (path, part) -> what it times
PARTS = {
    ("default", "gemm"): "cuBLAS bf16 GEMM (torch.mm, bf16 out)",
    ("default", "chunk"): "chunk kernel on bf16 logits, two passes, gradient in place",
    ("fp32", "gemm"): "cuBLAS bf16 GEMM with fp32 out (torch.mm out_dtype)",
    ("rows", "gemm"): "compensated GEMM, fp32 out",
    ("rows", "chunk"): "chunk kernel on fp32 logits, two passes, bf16 gradient in the rows",
    ("tilelse", "gemm"): "compensated GEMM, fp32 out + LSE partials",
    ("relative", "gemm"): "compensated GEMM, bf16 relative out + LSE partials + target logits",
    ("relative", "chunk"): "chunk kernel on relative bf16 logits, one pass",
    ("relative_no_target", "gemm"): "compensated GEMM, bf16 relative out + LSE partials (no target logits)",
    ("target_torch", "gemm"): "the target logits apart: (x.float() * W[t].float()).sum(-1) in PyTorch",
}


def run_shape(shape, device, rounds, reps):
    n, h, v = shape
    rows = engine.chunk_rows(None, n, n, v, h, torch.bfloat16, True)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, h, device=device, generator=gen).bfloat16()
    w = (torch.randn(v, h, device=device, generator=gen) / h**0.5 * 2).bfloat16()
    target = torch.randint(0, v, (rows,), device=device, generator=gen)
    options = LossOptions()
    scale = torch.ones(1, device=device)
    out16 = torch.empty(rows, v, device=device, dtype=torch.bfloat16)
    out32 = torch.empty(rows, v, device=device)
    partials = gemm.empty_tile_lse(rows, v, device, with_target_logit=True)
    lse_only = partials._replace(target_logit=None)
    # the chunk kernels' inputs, restored before each call
    logits16 = torch.mm(x, w.t())
    logits32 = gemm.compensated_logits_mm(x, w, torch.empty(rows, v, device=device))
    relative = gemm.compensated_logits_mm(x, w, out16.clone(), tile_lse=partials, target=target)
    work16 = torch.empty_like(out16)
    work32 = torch.empty_like(out32)
    grad_rows = gradient_in_logits_rows(work32, torch.bfloat16)
    kwargs = {"ce_scale": scale, "z_scale": scale, "compute_grad": True, "compute_stats": False}

    def restore(dest, src):
        return lambda: dest.copy_(src)

    calls = {
        ("default", "gemm"): (None, lambda: torch.mm(x, w.t(), out=out16)),
        ("rows", "gemm"): (None, lambda: gemm.compensated_logits_mm(x, w, out32)),
        ("tilelse", "gemm"): (None, lambda: gemm.compensated_logits_mm(x, w, out32, tile_lse=lse_only)),
        ("relative", "gemm"): (
            None,
            lambda: gemm.compensated_logits_mm(x, w, out16, tile_lse=partials, target=target),
        ),
        ("relative_no_target", "gemm"): (
            None,
            lambda: gemm.compensated_logits_mm(x, w, out16, tile_lse=lse_only),
        ),
        ("target_torch", "gemm"): (None, lambda: (x.float() * w[target].float()).sum(-1)),
        ("default", "chunk"): (
            restore(work16, logits16),
            lambda: ce.cross_entropy_chunk_triton(work16, target, options, **kwargs),
        ),
        ("rows", "chunk"): (
            restore(work32, logits32),
            lambda: ce.cross_entropy_chunk_triton(work32, target, options, grad_out=grad_rows, **kwargs),
        ),
        ("relative", "chunk"): (
            restore(work16, relative),
            lambda: ce.cross_entropy_chunk_triton(work16, target, options, tile_lse=partials, **kwargs),
        ),
    }
    if device.type == "cuda":  # torch.mm's out_dtype: CUDA only
        calls["fp32", "gemm"] = (None, lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=out32))

    def setup(prepare, fn):
        def ready():
            if prepare:
                prepare()
            return fn

        return ready

    medians = _common.interleaved_medians(
        {key: setup(prepare, fn) for key, (prepare, fn) in calls.items()}, device, rounds, reps
    )
    ms = {f"{path}/{part}": value for (path, part), value in medians.items()}
    totals = {
        "default": ms["default/gemm"] + ms["default/chunk"],
        "rows": ms["rows/gemm"] + ms["rows/chunk"],
        "relative": ms["relative/gemm"] + ms["relative/chunk"],
    }
    return {"shape": list(shape), "chunk_rows": rows, "ms": ms, "gemm_plus_chunk_ms": totals}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="one tiny shape (plumbing)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = [(64, 40, 96)] if args.small else SHAPES
    env = _common.environment(device)
    results = []
    for shape in shapes:
        r = run_shape(shape, device, args.rounds, args.reps)
        results.append(r)
        print("x".join(map(str, shape)), f"chunk rows {r['chunk_rows']}", flush=True)
        for name, value in r["ms"].items():
            print(f"  {name:16s} {value:8.3f} ms")
        for name, value in r["gemm_plus_chunk_ms"].items():
            print(
                f"  {name + ' total':16s} {value:8.3f} ms ({value / r['gemm_plus_chunk_ms']['default']:.3f}x)"
            )
        _common.free_memory(device)
    _common.write_json(
        _common.out_dir() / "relative_logits_parts.json",
        {"env": env, "parts": PARTS_TEXT, "results": results},
    )


PARTS_TEXT = {f"{path}/{part}": text for (path, part), text in PARTS.items()}

if __name__ == "__main__":
    main()
