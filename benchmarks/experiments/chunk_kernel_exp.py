"""Issue 23: what do libdevice's exponentials cost the chunk kernel on fp32 logits, and what would the GPU's
fast exp2 cost the LSE's accuracy?

With ``logits_precision="fp32"`` / ``"fp32_compensated"`` the chunk kernel reads fp32 logits and, until run88,
took every exponential from libdevice (``exp_precision`` in ``kernels/cross_entropy.py``): ~10 instructions an
element where ``tl.exp`` is one multiply and ``ex2.approx``. The two numbers first (H200, ~4.5 TB/s measured
copy, 132 SMs x 128 lanes x ~1.98 GHz = 33e12 lane-instructions/s): the gradient pass moves 6 bytes an element
(fp32 read, 16-bit write), so at full bandwidth it has ~44 instructions an element to spend; the first pass 4
bytes (~30). A 10-instruction exp is a large part of either: the passes may be compute-bound. Per benchmark
shape, on one chunk of the op's rows (``engine.chunk_rows``), this script times the chunk kernel (CUDA events,
warm-up, median over interleaved rounds; the logits restored before each call, outside the timed region):

- ``bf16``: 16-bit logits, the gradient in place (the default's kernel, the floor of the comparison);
- ``fp32_precise``: fp32 logits, the 16-bit gradient in the rows' second halves, libdevice exp in both passes
  (the kernel until run88);
- ``fp32_fast_grad``: the gradient pass's exps through ``tl.exp`` (its 16-bit result rounds far more coarsely
  than the fast exp errs): ``exp_precision``'s rule since run88;
- ``fp32_fast``: both passes.

and each variant's LSE and per-token loss error against float64 (logits of std 2, softcap 30 as the CUDA tests,
and without softcap), and the gradient's error against float64's (max absolute, in units of the 16-bit
gradient's own rounding).

Run88 (H200): the fp32 kernel runs at 4.3-4.4 TB/s with libdevice's exp too: memory-bound after all; the fast
exp saves 1-5% of it with the same errors (``benchmarks/results/*_run88_*``).

    python3 benchmarks/experiments/chunk_kernel_exp.py      # writes $OUT/chunk_kernel_exp.json
    TRITON_INTERPRET=1 python3 benchmarks/experiments/chunk_kernel_exp.py --device cpu --small   # plumbing
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
from lightning_flce._compat import TRITON_INTERPRET  # noqa: E402
from lightning_flce.kernels import LossOptions, gradient_in_logits_rows  # noqa: E402
from lightning_flce.kernels import cross_entropy as ce  # noqa: E402

SHAPES = [(16384, 4096, 32000), (16384, 4096, 128256), (8192, 2304, 256000), (8192, 3584, 151936)]
# (first pass precise, gradient pass precise) per fp32 variant
FP32_VARIANTS = {"fp32_precise": (True, True), "fp32_fast_grad": (True, False), "fp32_fast": (False, False)}


def run_variant(logits_src, target, options, precision, out_dtype):
    """One call of the chunk kernel on a fresh copy of ``logits_src``: (loss, lse, gradient as float64)."""
    logits = logits_src.clone()
    grad_out = None if logits.dtype != torch.float32 else gradient_in_logits_rows(logits, out_dtype)
    scale = torch.ones(1, device=logits.device)
    with _precision(precision):
        out = ce.cross_entropy_chunk_triton(
            logits, target, options, ce_scale=scale, z_scale=scale, compute_grad=True, compute_stats=False,
            grad_out=grad_out,
        )  # fmt: skip
    grad = logits if grad_out is None else grad_out
    return out.loss, out.lse, grad.double()


class _precision:
    """``exp_precision`` fixed to ``precision`` ((first pass, gradient pass); None: the library's rule, as
    under the interpreter, which has no libdevice)."""

    def __init__(self, precision):
        self.precision = precision

    def __enter__(self):
        self.rule = ce.exp_precision
        if self.precision is not None and not TRITON_INTERPRET:
            ce.exp_precision = lambda logits_dtype, grad_dtype: (
                self.precision if logits_dtype == torch.float32 else (False, False)
            )

    def __exit__(self, *exc):
        ce.exp_precision = self.rule


def reference(z64, target, softcap):
    """float64 (loss, lse, d loss / d logits) of fp32 logits (softcap applied in float64)."""
    z = z64.clone().requires_grad_(True)
    zc = softcap * torch.tanh(z / softcap) if softcap else z
    lse = torch.logsumexp(zc, dim=1)
    loss = lse - zc.gather(1, target[:, None])[:, 0]
    loss.sum().backward()
    return loss.detach(), lse.detach(), z.grad


def run_shape(shape, device, rounds, reps, small):
    n, h, v = shape
    rows = engine.chunk_rows(None, n, n, v, h, torch.bfloat16, True)
    gen = torch.Generator(device=device).manual_seed(0)
    z32 = 2.0 * torch.randn(rows, v, device=device, generator=gen)
    target = torch.randint(0, v, (rows,), device=device, generator=gen)
    result = {"shape": list(shape), "chunk_rows": rows, "ms": {}, "errors": {}}
    for softcap in (30.0, 0.0):
        options = LossOptions(softcap=softcap)
        # A few hundred rows suffice for the errors and keep float64's autograd small.
        check_rows = min(rows, 256)
        zc, tc = z32[:check_rows], target[:check_rows]
        loss64, lse64, grad64 = reference(zc.double(), tc, softcap)
        grad_ulp = grad64.abs().clamp_min(torch.finfo(torch.bfloat16).tiny) * 2.0**-8  # one bf16 ulp (upper)
        for name, precision in FP32_VARIANTS.items():
            loss, lse, grad = run_variant(zc, tc, options, precision, torch.bfloat16)
            result["errors"].setdefault(name, {})[f"softcap{softcap:g}"] = {
                "loss_err_max": (loss.double() - loss64).abs().max().item(),
                "lse_err_max": (lse.double() - lse64).abs().max().item(),
                "lse_err_mean": (lse.double() - lse64).abs().mean().item(),
                "grad_err_max_bf16_ulps": ((grad - grad64).abs() / grad_ulp).max().item(),
            }
        del loss64, lse64, grad64, grad_ulp
    if device.type != "cuda":
        return result
    options = LossOptions()
    z16 = z32.bfloat16()
    work32 = torch.empty_like(z32)
    work16 = torch.empty_like(z16)
    scale = torch.ones(1, device=device)
    grad_rows = gradient_in_logits_rows(work32, torch.bfloat16)

    def call(precision):
        if precision is None:
            work16.copy_(z16)
            return lambda: ce.cross_entropy_chunk_triton(
                work16, target, options, ce_scale=scale, z_scale=scale, compute_grad=True, compute_stats=False
            )
        work32.copy_(z32)

        def fn():
            with _precision(precision):
                ce.cross_entropy_chunk_triton(
                    work32, target, options, ce_scale=scale, z_scale=scale, compute_grad=True,
                    compute_stats=False, grad_out=grad_rows,
                )  # fmt: skip

        return fn

    variants = {"bf16": None, **FP32_VARIANTS}
    # call(precision) restores the logits (outside the timed region) and returns the kernel's call
    medians = _common.interleaved_medians(
        {name: (lambda p=precision: call(p)) for name, precision in variants.items()}, device, rounds, reps
    )
    bytes_per = {"bf16": 2 * 2 + 2}  # two 16-bit reads, one 16-bit write
    for name in FP32_VARIANTS:
        bytes_per[name] = 2 * 4 + 2  # two fp32 reads, one 16-bit write
    for name, ms in medians.items():
        result["ms"][name] = {"ms": ms, "gbps": rows * v * bytes_per[name] / ms / 1e6}
    return result


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
        r = run_shape(shape, device, args.rounds, args.reps, args.small)
        results.append(r)
        print("x".join(map(str, shape)), f"chunk rows {r['chunk_rows']}", flush=True)
        for name, t in r["ms"].items():
            print(f"  {name:15s} {t['ms']:.3f} ms  {t['gbps']:.0f} GB/s")
        for name, errs in r["errors"].items():
            for case, e in errs.items():
                print(
                    f"  {name:15s} {case:10s} loss err {e['loss_err_max']:.2e}  lse err {e['lse_err_max']:.2e}"
                    f" (mean {e['lse_err_mean']:.1e})  grad err {e['grad_err_max_bf16_ulps']:.2f} bf16 ulps"
                )
        _common.free_memory(device)
    _common.write_json(_common.out_dir() / "chunk_kernel_exp.json", {"env": env, "results": results})


if __name__ == "__main__":
    main()
