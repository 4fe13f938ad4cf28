"""Issue 23: which launch configuration of the compensated logits GEMM (``kernels/compensated_gemm.py``) is
fast enough, and how much accuracy does each give up?

The kernel's cost is the MMA pipeline broken at every compensated addition: with ``chain_blocks = 1`` each
BK-long block's MMAs must finish before their sum is added (run74: 1.85x cuBLAS's fp32-output GEMM, the op
1.33-1.41x the default). ``chain_blocks = C`` lets the tensor cores chain C blocks (C x BK products, still far
shorter than K = H) before each addition; ``kahan=False`` adds the chains' sums plainly (one fp32 register tile
less than Kahan's two). Run76 measured the Kahan configurations (chaining did not pay); the plain ones are next. Per configuration and benchmark shape this script measures, on the
rows of one chunk of the op's ``fp32_compensated`` path (``engine.chunk_rows``: the GEMM the op runs):

- the GEMM's time (CUDA events, warm-up, median over interleaved rounds: every configuration and cuBLAS in
  each round, so clock changes hit all alike) against cuBLAS's bf16 GEMM writing bf16 (the default's logits
  GEMM) and writing fp32 (``logits_precision="fp32"``);
- the logits' error against float64 and the per-token loss error (bias and softcap 30 applied in fp32, as
  test_logits_precision's CUDA tests) against float64, for logits of std 2 (the tests' data) and std 1
  (bench_flce's).

    python3 benchmarks/experiments/compensated_gemm_configs.py      # writes $OUT/compensated_gemm_configs.json
    TRITON_INTERPRET=1 python3 benchmarks/experiments/compensated_gemm_configs.py --device cpu --small  # plumbing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402
import torch

_common.ensure_repo_on_path()
from fp32_logits_accuracy import loss_from_logits  # noqa: E402  (this folder: the script's own)

from lightning_flce import engine  # noqa: E402
from lightning_flce.kernels.compensated_gemm import (  # noqa: E402
    INTERPRET_CONFIG,
    GemmConfig,
    compensated_logits_mm,
)

SOFTCAP = 30.0  # as test_logits_precision's CUDA tests
SHAPES = [(16384, 4096, 32000), (16384, 4096, 128256), (8192, 2304, 256000), (8192, 3584, 151936)]
# Two fp32 [BM, BN] tiles (the sum and its compensation) plus the MMA's own accumulator live in registers:
# 128 x 128 over 8 warps (64 registers each per thread); wider tiles or 4 warps would spill. A plain sum
# (kahan=False) holds one tile less.
CONFIGS = {
    "bk128_c1_s3": GemmConfig(128, 128, 128, 8, 3),  # Kahan over 128-long chains: the default until run80
    "bk128_c2_s3": GemmConfig(128, 128, 128, 8, 3, chain_blocks=2),
    "bk128_c4_s3": GemmConfig(128, 128, 128, 8, 3, chain_blocks=4),
    "bk64_c1_s4": GemmConfig(128, 128, 64, 8, 4, chain_blocks=1),
    "bk64_c2_s4": GemmConfig(128, 128, 64, 8, 4, chain_blocks=2),
    "bk64_c4_s4": GemmConfig(128, 128, 64, 8, 4, chain_blocks=4),
    "bk64_c4_s5": GemmConfig(128, 128, 64, 8, 5, chain_blocks=4),
    "bk64_c8_s4": GemmConfig(128, 128, 64, 8, 4, chain_blocks=8),
    # The chains' sums added plainly (kahan=False): one register tile less (run76 measured the Kahan ones only)
    "bk64_c2_plain": GemmConfig(128, 128, 64, 8, 4, chain_blocks=2, kahan=False),
    "bk64_c4_plain": GemmConfig(128, 128, 64, 8, 4, chain_blocks=4, kahan=False),
    "bk128_c2_plain": GemmConfig(128, 128, 128, 8, 3, chain_blocks=2, kahan=False),
    "bk64_c8_plain": GemmConfig(128, 128, 64, 8, 4, chain_blocks=8, kahan=False),
    "bn256_bk64_c4_plain": GemmConfig(128, 256, 64, 8, 3, chain_blocks=4, kahan=False),
    # References, not candidates: one chain over all of K (a plain Triton GEMM, the error of "fp32"), Triton's
    # own speed at this tile: what the compensated sums cost beyond it, and how far Triton is from cuBLAS
    "bk64_one_chain": GemmConfig(128, 128, 64, 8, 4, chain_blocks=1 << 20, kahan=False),
    "bk128_one_chain": GemmConfig(128, 128, 128, 8, 3, chain_blocks=1 << 20, kahan=False),
    "bn256_bk64_one_chain": GemmConfig(128, 256, 64, 8, 3, chain_blocks=1 << 20, kahan=False),
    # The operand blocks through the tensor-memory accelerator (tma=True): run79 put Triton's own pointer-load
    # GEMM (one chain) at 1.30-1.44x cuBLAS, most of what the compensated sums seemed to cost
    "tma_bk64_one_chain": GemmConfig(128, 128, 64, 8, 4, chain_blocks=1 << 20, kahan=False, tma=True),
    "tma_bk128_one_chain": GemmConfig(128, 128, 128, 8, 3, chain_blocks=1 << 20, kahan=False, tma=True),
    "tma_bk128_c1": GemmConfig(128, 128, 128, 8, 3, tma=True),
    "tma_bk64_c1_s5": GemmConfig(128, 128, 64, 8, 5, tma=True),
    "tma_bk128_c2_plain": GemmConfig(128, 128, 128, 8, 3, chain_blocks=2, kahan=False, tma=True),
    "tma_bk128_c4_plain": GemmConfig(128, 128, 128, 8, 3, chain_blocks=4, kahan=False, tma=True),
    "tma_bk64_c4_plain": GemmConfig(128, 128, 64, 8, 4, chain_blocks=4, kahan=False, tma=True),
    "tma_bk64_c4_plain_s5": GemmConfig(128, 128, 64, 8, 5, chain_blocks=4, kahan=False, tma=True),
    "tma_bk64_c8_plain": GemmConfig(128, 128, 64, 8, 4, chain_blocks=8, kahan=False, tma=True),
    "tma_bk128_c2_kahan": GemmConfig(128, 128, 128, 8, 3, chain_blocks=2, tma=True),
}


# The library's TMA kernel walking tiles with one program per SM (``persistent``) and storing through a tensor
# descriptor (``tma_store``), alone and together (run83 measured an experiment's version of both: commit 8cb2ecc;
# Triton's flattened loop nest, ``tl.range(flatten=True)``, was 1.3-1.7x slower there and is not kept).
PERSISTENT_STORE = {"persistent": True, "tma_store": True}
CONFIGS.update(
    {
        "tma_bk128_c2_plain_persistent": CONFIGS["tma_bk128_c2_plain"]._replace(persistent=True),
        "tma_bk128_c2_plain_store": CONFIGS["tma_bk128_c2_plain"]._replace(tma_store=True),
        "tma_bk128_c2_plain_persistent_store": CONFIGS["tma_bk128_c2_plain"]._replace(**PERSISTENT_STORE),
        "tma_bk128_c4_plain_persistent_store": CONFIGS["tma_bk128_c4_plain"]._replace(**PERSISTENT_STORE),
        "tma_bk64_c4_plain_persistent_store": CONFIGS["tma_bk64_c4_plain"]._replace(**PERSISTENT_STORE),
        # Triton's own GEMM in the same loop (one chain over K: "fp32"'s error), the ceiling of this kernel
        "tma_bk128_one_chain_persistent_store": CONFIGS["tma_bk128_one_chain"]._replace(**PERSISTENT_STORE),
        "tma_bk64_one_chain_persistent_store": CONFIGS["tma_bk64_one_chain"]._replace(**PERSISTENT_STORE),
    }
)
# Run88's candidates around the measured configuration of the time (tma_bk128_c4_plain_persistent_store): the
# same chains of 512 products from BK = 64 blocks (half the shared memory per stage, so 4-6 stages; 5 stages the
# measured configuration since). Triton's automatic warp specialization of the tile loop was measured in the same
# run (commit cd9f10c, configs *_ws): no faster, and the kernel does without it.
CONFIGS.update(
    {
        f"tma_bk64_c8_plain_persistent_store_s{stages}": GemmConfig(
            128, 128, 64, 8, stages, chain_blocks=8, kahan=False, tma=True, **PERSISTENT_STORE
        )
        for stages in (4, 5, 6)
    }
)

# Run89's candidates around the measured configuration (``MEASURED_CONFIG``, the s5 row above), for issue 23's
# 8192x2304x256000 where it is 1.29x cuBLAS: row groups that read each weight block from memory once per chunk
# (``group_m``: the chunks have 16-32 row tiles of 128), and 64-row tiles over one warp group with two programs
# per SM (``programs_per_sm``), so one program's epilogue (a fp32 tile through the copy engine) overlaps the
# other's MMAs, as cuBLAS's ping-pong kernels do with two warp groups.
_MEASURED = GemmConfig(128, 128, 64, 8, 5, chain_blocks=8, kahan=False, tma=True, **PERSISTENT_STORE)
CONFIGS.update(
    {
        "measured_g16": _MEASURED._replace(group_m=16),
        "measured_g32": _MEASURED._replace(group_m=32),
        "m64_w4_s3_p2": _MEASURED._replace(block_m=64, num_warps=4, num_stages=3, programs_per_sm=2),
        "m64_w4_s4_p2": _MEASURED._replace(block_m=64, num_warps=4, num_stages=4, programs_per_sm=2),
        "m64_w4_s4_p2_g32": _MEASURED._replace(
            block_m=64, num_warps=4, num_stages=4, programs_per_sm=2, group_m=32
        ),
        "m64_n256_w8_s4": _MEASURED._replace(block_m=64, block_n=256, num_stages=4),
        "one_chain_g16": CONFIGS["tma_bk64_one_chain_persistent_store"]._replace(num_stages=5, group_m=16),
    }
)

# Run89's second call, around the configuration the first one found (m64_w4_s4_p2, the library's since):
# its row groups, shorter chains, BK = 128 over two stages, masked stores, the transposed tile, and its one-chain
# reference (Triton's own GEMM at that tile).
_M64P2 = CONFIGS["m64_w4_s4_p2"]
CONFIGS.update(
    {
        "m64_p2_g4": _M64P2._replace(group_m=4),
        "m64_p2_g16": _M64P2._replace(group_m=16),
        "m64_p2_c4": _M64P2._replace(chain_blocks=4),
        "m64_p2_bk128_s2": _M64P2._replace(block_k=128, num_stages=2, chain_blocks=4),
        "m64_p2_masked_store": _M64P2._replace(tma_store=False),
        "m128_n64_w4_s4_p2": _M64P2._replace(block_m=128, block_n=64),
        "m64_p2_one_chain": _M64P2._replace(chain_blocks=1 << 20),
    }
)
# Run89's third call: masked stores (call 2 measured them faster at three shapes), chains of 10 / 12 blocks (640 /
# 768 products: fewer drains of the MMA pipeline, an error between 512's and 1024's), three programs per SM.
CONFIGS.update(
    {
        "m64_p2_c10": _M64P2._replace(chain_blocks=10),
        "m64_p2_c12": _M64P2._replace(chain_blocks=12),
        "m64_p2_c12_masked_store": _M64P2._replace(chain_blocks=12, tma_store=False),
        "m64_p3_s3_masked_store": _M64P2._replace(num_stages=3, programs_per_sm=3, tma_store=False),
    }
)


def timed_ms(fns, device, rounds, reps):
    """{name: median ms} over ``rounds`` interleaved rounds of ``reps`` calls each (after two warm-up calls)."""
    if device.type != "cuda":
        return {name: None for name in fns}
    for fn in fns.values():
        fn()
        fn()
    times = {name: [] for name in fns}
    timer = _common.Timer(device)
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(reps):
                timer.start()
                fn()
                timer.stop()
                times[name].append(timer.ms())
    return {name: _common.percentile(values, 50) for name, values in times.items()}


def run_shape(shape, device, rounds, reps, configs):
    n, h, v = shape
    rows = engine.chunk_rows(None, n, n, v, h, torch.bfloat16, True)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, h, device=device, generator=gen).bfloat16()
    w_unit = torch.randn(v, h, device=device, generator=gen) / h**0.5
    b = (0.1 * torch.randn(v, device=device, generator=gen)).bfloat16()
    t = torch.randint(0, v, (rows,), device=device, generator=gen)
    out = torch.empty(rows, v, device=device, dtype=torch.float32)
    result = {"shape": list(shape), "chunk_rows": rows, "configs": {}, "errors": {}}
    with torch.no_grad():
        for dist, scale in (("test", 2.0), ("bench", 1.0)):
            w = (w_unit * scale).bfloat16()
            exact = x.double() @ w.double().t()
            truth = loss_from_logits(exact, b, SOFTCAP, t)
            variants = {
                name: (lambda c=c, w=w: compensated_logits_mm(x, w, out, config=c))
                for name, c in configs.items()
            }
            if device.type == "cuda":
                variants["cublas_fp32_out"] = lambda w=w: torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
            for name, fn in variants.items():
                try:
                    # A variant that leaves elements unwritten then shows nan, not the previous variant's values.
                    out.fill_(float("nan"))
                    fn()
                    err = (out.double() - exact).abs().max().item()
                    loss_err = (loss_from_logits(out, b, SOFTCAP, t) - truth).abs().max().item()
                    result["errors"].setdefault(name, {})[dist] = {
                        "logit_err_max": err,
                        "loss_err_max": loss_err,
                    }
                except Exception as exc:  # a configuration that does not compile or run here is recorded
                    result["errors"].setdefault(name, {})[dist] = {"error": _common.short_error(exc)}
            del exact, truth
        w = (w_unit * 2.0).bfloat16()
        out_bf16 = torch.empty(rows, v, device=device, dtype=torch.bfloat16)
        fns = {
            name: (lambda c=c: compensated_logits_mm(x, w, out, config=c))
            for name, c in configs.items()
            if "error" not in result["errors"][name]["test"]
        }
        if device.type == "cuda":
            fns["cublas_bf16_out"] = lambda: torch.mm(x, w.t(), out=out_bf16)
            fns["cublas_fp32_out"] = lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        ms = timed_ms(fns, device, rounds, reps)
    for name, value in ms.items():
        result["configs"][name] = {"ms": value}
    base = ms.get("cublas_fp32_out")
    for name, value in ms.items():
        errs = result["errors"].get(name, {})
        ratio = f"{value / base:.3f}x" if base and value else "-"
        test_err = errs.get("test", {}).get("loss_err_max")
        print(
            f"  {name:16s} {_common.fmt(value, '.3f')} ms ({ratio} cuBLAS fp32-out) loss err {_common.fmt(test_err)}"
        )
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="one tiny shape, the interpreter's config (plumbing)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--configs", default="all", help="comma list of names in CONFIGS (default all)")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.small:
        shapes = [(64, 40, 96)]
        configs = {
            "interpret_c1": INTERPRET_CONFIG,
            "interpret_c2": INTERPRET_CONFIG._replace(chain_blocks=2),
            "interpret_c2_plain": INTERPRET_CONFIG._replace(chain_blocks=2, kahan=False),
            "interpret_tma_c2_plain": INTERPRET_CONFIG._replace(chain_blocks=2, kahan=False, tma=True),
            "interpret_tma_c2_plain_persistent_store": INTERPRET_CONFIG._replace(
                chain_blocks=2, kahan=False, tma=True, **PERSISTENT_STORE
            ),
            "interpret_tma_c2_plain_persistent_store_g2_p2": INTERPRET_CONFIG._replace(
                chain_blocks=2, kahan=False, tma=True, group_m=2, programs_per_sm=2, **PERSISTENT_STORE
            ),
        }
    else:
        shapes = SHAPES
        configs = CONFIGS if args.configs == "all" else {k: CONFIGS[k] for k in args.configs.split(",")}
    env = _common.environment(device)
    results = []
    for shape in shapes:
        print("x".join(map(str, shape)), flush=True)
        results.append(run_shape(shape, device, args.rounds, args.reps, configs))
        _common.free_memory(device)
    payload = {"env": env, "configs": {k: c._asdict() for k, c in configs.items()}, "results": results}
    _common.write_json(_common.out_dir() / "compensated_gemm_configs.json", payload)


if __name__ == "__main__":
    main()
