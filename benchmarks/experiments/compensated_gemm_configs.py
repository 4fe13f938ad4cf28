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
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402
import torch

_common.ensure_repo_on_path()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fp32_logits_accuracy import loss_from_logits  # noqa: E402  (this folder: the script's own)

from lightning_flce import engine  # noqa: E402
from lightning_flce.kernels.compensated_gemm import (  # noqa: E402
    INTERPRET_CONFIG,
    GemmConfig,
    _tensor_descriptor,
    chain_step,
    compensated_logits_mm,
    grouped_tile,
    kernel_constants,
    store_tile,
    tma_blocks,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
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


# Persistent variants of the library's TMA kernel (experiments, not library paths yet): one program per SM
# walks its tiles, so the next tile's loads can be in flight while a tile's fp32 result (64 KiB) is stored.
# Same chains and sums (the library's chain_step / store_tile). Two loop shapes:
# - "manual": one hand-flattened loop over (tile, K block), the tile's store under `if k == k_blocks - 1`;
# - "nested": a loop over tiles with the K loop inside, `tl.range(..., flatten=True)` asking Triton to flatten
#   and pipeline the nest itself (its persistent-matmul pattern on Hopper; warp specialization is
#   Blackwell-only in Triton 3.6), optionally with the tile stored through a TMA descriptor in two
#   [BM, BN/2] halves (an asynchronous store from shared memory instead of 8 warps' masked st.global;
#   half tiles so the epilogue's buffer, 32 KiB, fits beside 3 stages of 128-long blocks).
PERSISTENT = {
    "persistent_tma_bk128_c2_plain": (
        GemmConfig(128, 128, 128, 8, 3, chain_blocks=2, kahan=False, tma=True),
        {},
    ),
    "persistent_tma_bk128_c4_plain": (
        GemmConfig(128, 128, 128, 8, 3, chain_blocks=4, kahan=False, tma=True),
        {},
    ),
    "persistent_tma_bk64_c4_plain": (
        GemmConfig(128, 128, 64, 8, 4, chain_blocks=4, kahan=False, tma=True),
        {},
    ),
    "persistent_tma_bk64_one_chain": (
        GemmConfig(128, 128, 64, 8, 4, chain_blocks=1 << 20, kahan=False, tma=True),
        {},
    ),
    "nested_bk128_c2_plain": (
        GemmConfig(128, 128, 128, 8, 3, chain_blocks=2, kahan=False, tma=True),
        {"nested": True},
    ),
    "nested_bk128_c2_plain_tmastore": (
        GemmConfig(128, 128, 128, 8, 3, chain_blocks=2, kahan=False, tma=True),
        {"nested": True, "tma_store": True},
    ),
    "nested_bk128_s2_c2_plain_tmastore": (
        GemmConfig(128, 128, 128, 8, 2, chain_blocks=2, kahan=False, tma=True),
        {"nested": True, "tma_store": True},
    ),
    "nested_bk64_c4_plain_tmastore": (
        GemmConfig(128, 128, 64, 8, 4, chain_blocks=4, kahan=False, tma=True),
        {"nested": True, "tma_store": True},
    ),
    "nested_bk64_one_chain_tmastore": (
        GemmConfig(128, 128, 64, 8, 4, chain_blocks=1 << 20, kahan=False, tma=True),
        {"nested": True, "tma_store": True},
    ),
    "nested_noflatten_bk128_c2_plain_tmastore": (
        GemmConfig(128, 128, 128, 8, 3, chain_blocks=2, kahan=False, tma=True),
        {"nested": True, "tma_store": True, "flatten": False},
    ),
}


@triton.jit
def _persistent_mm_kernel(
    x_desc,
    w_desc,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    out_row_stride,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHAIN_BLOCKS: tl.constexpr,
    KAHAN: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    first = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    steps = tl.cdiv(num_tiles - first, NUM_PROGRAMS) * k_blocks
    tile = first - NUM_PROGRAMS
    k = -1
    off_m = 0
    off_n = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, steps):
        k = tl.where(k == k_blocks - 1, 0, k + 1)
        if k == 0:
            tile += NUM_PROGRAMS
            pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
        a, b = tma_blocks(x_desc, w_desc, off_m, off_n, k, BLOCK_K, UPCAST)
        part, acc, comp = chain_step(a, b, part, acc, comp, k, k_blocks, CHAIN_BLOCKS, KAHAN)
        if k == k_blocks - 1:
            rm = off_m + tl.arange(0, BLOCK_M)
            rn = off_n + tl.arange(0, BLOCK_N)
            store_tile(acc, bias_ptr, out_ptr, M, N, out_row_stride, rm, rn, HAS_BIAS)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _persistent_nested_mm_kernel(
    x_desc,
    w_desc,
    out_desc,  # TensorDescriptor of out, blocks [BLOCK_M, BLOCK_N // 2] (read only with TMA_STORE)
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    out_row_stride,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHAIN_BLOCKS: tl.constexpr,
    KAHAN: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    first = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_blocks = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile from its own counter: once Triton flattens and pipelines the nest, the
    # store of tile i runs beside the loads of tile i + 1, and nothing of the loads' indices must live that long.
    stored = first - NUM_PROGRAMS
    for tile in tl.range(first, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        comp = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_blocks):
            a, b = tma_blocks(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k, BLOCK_K, UPCAST)
            part, acc, comp = chain_step(a, b, part, acc, comp, k, k_blocks, CHAIN_BLOCKS, KAHAN)
        stored += NUM_PROGRAMS
        pid_m, pid_n = grouped_tile(stored, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        if TMA_STORE:  # no bias here (the sweep's GEMMs have none); the copy engine clips rows past M, N
            left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left)
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right)
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            store_tile(acc, bias_ptr, out_ptr, M, N, out_row_stride, rm, rn, HAS_BIAS)


def persistent_mm(x, w, out, config, options=None, num_programs=None):
    """``out = x @ w.T`` through one of the persistent kernels (no bias: the sweep's GEMMs have none).
    ``options``: ``nested`` (the tl.range kernel), ``flatten`` (default True), ``tma_store``."""
    options = options or {}
    descriptor = _tensor_descriptor()
    m, k = x.shape
    n = w.shape[0]
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 3
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    programs = min(num_programs, tiles)
    x_desc = descriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = descriptor.from_tensor(w, [config.block_n, config.block_k])
    constants = kernel_constants(config, has_bias=False)
    if not options.get("nested"):
        _persistent_mm_kernel[(programs,)](
            x_desc, w_desc, out, out, m, n, k, out.stride(0), NUM_PROGRAMS=programs, **constants
        )
        return out
    tma_store = bool(options.get("tma_store"))
    out_desc = descriptor.from_tensor(out, [config.block_m, config.block_n // 2]) if tma_store else x_desc
    _persistent_nested_mm_kernel[(programs,)](
        x_desc,
        w_desc,
        out_desc,
        out,
        out,
        m,
        n,
        k,
        out.stride(0),
        NUM_PROGRAMS=programs,
        FLATTEN=bool(options.get("flatten", True)),
        TMA_STORE=tma_store,
        **constants,
    )
    return out


def run_gemm(name, config, x, w, out):
    """The GEMM a configuration name runs: the library's launcher, or a persistent experiment."""
    if name in PERSISTENT or name.startswith(("persistent_", "nested_")):
        config, options = PERSISTENT.get(name, (config, {"nested": name.startswith("nested_")}))
        if "tmastore" in name:
            options = {**options, "tma_store": True}
        return persistent_mm(x, w, out, config, options)
    return compensated_logits_mm(x, w, out, config=config)


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
                name: (lambda name=name, c=c, w=w: run_gemm(name, c, x, w, out))
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
            name: (lambda name=name, c=c: run_gemm(name, c, x, w, out))
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
            "persistent_interpret_c2_plain": INTERPRET_CONFIG._replace(chain_blocks=2, kahan=False, tma=True),
            "nested_interpret_c2_plain": INTERPRET_CONFIG._replace(chain_blocks=2, kahan=False, tma=True),
            "nested_interpret_c2_plain_tmastore": INTERPRET_CONFIG._replace(
                chain_blocks=2, kahan=False, tma=True
            ),
        }
    else:
        shapes = SHAPES
        every = {**CONFIGS, **{name: config for name, (config, _) in PERSISTENT.items()}}
        configs = every if args.configs == "all" else {k: every[k] for k in args.configs.split(",")}
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
