"""Focused benchmark of one chunk's weight-gradient accumulation: ``gw (+)= g.T @ x``.

V=32000, H=4096, C=512 tokens per chunk (defaults). For each (grad_weight dtype, operand dtype) case it
times and checks:

  old      the old idiom: ``gw += torch.mm(g.t(), x)`` (same dtype), ``gw += torch.mm(g.t(), x).float()``
           (fp32 grad_weight, fp16/bf16 operands)
  add_mm   ``gw.add_(torch.mm(g.t(), x))``
  project  ``lightning_flce.accumulate.accumulate_grad_weight(gw, g, x)`` (path from ``choose_path``)
  addmm_out_dtype  ``torch.addmm(gw, g.t(), x, out_dtype=gw.dtype, out=gw)`` (torch >= 2.8, CUDA)
  addmm_   ``gw.addmm_(g.t(), x)`` (same dtype only; the plain in-place GEMM for reference)

Columns: median ms per accumulation (CUDA events, after warm-up), p20/p80, TFLOP/s, temporary MiB (increase of
``max_memory_allocated`` over one accumulation), relative L2 error of ``gw0 + g.T @ x`` against float64.

Usage (GPU):  python3 benchmarks/bench_accumulation.py
      (CPU smoke, tiny sizes): python3 benchmarks/bench_accumulation.py --device cpu --quick
Writes ``$OUT/accumulation.json`` and ``$OUT/accumulation.md`` (``$OUT`` defaults to ./bench_out).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import _common as C
import torch

C.ensure_repo_on_path()

# (grad_weight dtype, operand dtype) cases, in table order.
CASES: List[Tuple[str, str]] = [
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("fp32", "fp32"),
    ("fp32", "bf16"),
    ("fp32", "fp16"),
]


def _old(gw: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    if gw.dtype == g.dtype:
        gw += torch.mm(g.t(), x)
    else:
        gw += torch.mm(g.t(), x).float()


def _add_mm(gw: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    gw.add_(torch.mm(g.t(), x))


def _addmm_out_dtype(gw: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    torch.addmm(gw, g.t(), x, out_dtype=gw.dtype, out=gw)


def _addmm_inplace(gw: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    if gw.dtype != g.dtype:
        raise TypeError("addmm_ needs grad_weight and operands of one dtype")
    gw.addmm_(g.t(), x)


def _project() -> Tuple[Optional[Callable[..., None]], Optional[Callable[..., Any]], Optional[str]]:
    """The project's accumulate function and path chooser, or the import error."""
    try:
        from lightning_flce.accumulate import accumulate_grad_weight, choose_path
    except Exception as exc:  # noqa: BLE001 - module not written yet / broken: record and skip the row
        return None, None, C.short_error(exc)
    return accumulate_grad_weight, choose_path, None


def _path_name(path: Any) -> str:
    return str(getattr(path, "value", path))


def _record(gw_name: str, op_name: str, method: str, args: argparse.Namespace, **kw: Any) -> Dict[str, Any]:
    rec: Dict[str, Any] = {
        "grad_weight_dtype": gw_name,
        "operand_dtype": op_name,
        "method": method,
        "call": None,
        "V": args.vocab,
        "H": args.hidden,
        "chunk": args.chunk,
        "ms": None,
        "p20_ms": None,
        "p80_ms": None,
        "tflops": None,
        "temp_mib": None,
        "rel_err": None,
        "rel_err_first": None,
        "path": None,
        "error": None,
    }
    rec.update(kw)
    return rec


def run_case(
    gw_name: str,
    op_name: str,
    args: argparse.Namespace,
    device: torch.device,
) -> List[Dict[str, Any]]:
    gw_dtype, op_dtype = C.DTYPES[gw_name], C.DTYPES[op_name]
    V, H, Cn = args.vocab, args.hidden, args.chunk
    flops = 2.0 * Cn * V * H
    gen = torch.Generator(device=device).manual_seed(args.seed)
    # Operands ~ N(0, 1): relative errors do not depend on the scale, and fp16 stays clear of
    # overflow/underflow at K=512 (sums ~ sqrt(512)).
    g = torch.randn(Cn, V, device=device, dtype=op_dtype, generator=gen)
    x = torch.randn(Cn, H, device=device, dtype=op_dtype, generator=gen)
    # A non-zero starting grad_weight of the update's magnitude, so "accumulate" is really tested.
    gw0 = (torch.randn(V, H, device=device, dtype=torch.float32, generator=gen) * (Cn**0.5)).to(gw_dtype)
    ref = gw0.to(torch.float64) + g.to(torch.float64).t() @ x.to(torch.float64)
    ref_first = g.to(torch.float64).t() @ x.to(torch.float64)

    accumulate, choose_path, project_err = _project()
    methods: List[Tuple[str, Optional[Callable[..., None]], Optional[str], str]] = [
        ("old", _old, None, "gw += mm(g.t(), x)" + (".float()" if gw_dtype != op_dtype else "")),
        ("add_mm", _add_mm, None, "gw.add_(mm(g.t(), x))"),
        ("project", accumulate, project_err, "accumulate_grad_weight(gw, g, x)"),
        ("addmm_out_dtype", _addmm_out_dtype, None, "torch.addmm(gw, g.t(), x, out_dtype=gw.dtype, out=gw)"),
    ]
    if gw_dtype == op_dtype:
        methods.append(("addmm_", _addmm_inplace, None, "gw.addmm_(g.t(), x)"))

    records = []
    for name, fn, pre_err, call in methods:
        rec = _record(gw_name, op_name, name, args, call=call, error=pre_err)
        records.append(rec)
        if fn is None:
            continue
        try:
            if name == "project" and choose_path is not None:
                rec["path"] = _path_name(choose_path(gw0, g, x))
            # Correctness: accumulate into gw0 and compare with the float64 reference.
            gw = gw0.clone()
            fn(gw, g, x)
            C.synchronize(device)
            rec["rel_err"] = C.rel_l2(gw, ref)
            if name == "project":
                gw.fill_(float("nan"))  # poison: first=True must overwrite every element
                fn(gw, g, x, first=True)
                C.synchronize(device)
                rec["rel_err_first"] = C.rel_l2(gw, ref_first)
            # Temporary memory: increase of the allocator's peak over one accumulation.
            rec["temp_mib"] = C.measure_peak_mib(lambda fn=fn, gw=gw: fn(gw, g, x), device)
            # Timing: warm-up, then >= args.reps samples with events around each accumulation.
            for _ in range(args.warmup):
                fn(gw, g, x)
            timers = []
            for _ in range(args.reps):
                t = C.Timer(device)
                t.start()
                fn(gw, g, x)
                t.stop()
                timers.append(t)
            C.synchronize(device)
            times = [t.ms() for t in timers]
            rec["ms"] = C.percentile(times, 50)
            rec["p20_ms"] = C.percentile(times, 20)
            rec["p80_ms"] = C.percentile(times, 80)
            rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
            del gw
        except Exception as exc:  # noqa: BLE001 - one failing method must not stop the table
            rec["error"] = C.short_error(exc)
        C.free_memory(device)
    g = x = gw0 = ref = ref_first = None  # drop the operands before emptying the cache
    C.free_memory(device)
    return records


def render(records: List[Dict[str, Any]], env: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    lines = [
        f"# Weight-gradient accumulation, V={args.vocab}, H={args.hidden}, chunk={args.chunk} tokens",
        "",
        *C.header_lines(env),
        f"- timing: median of {args.reps} samples after {args.warmup} warm-up calls; "
        "temp MiB = increase of max_memory_allocated over one call",
        "- rel err = ||gw0 + g.T@x - ref|| / ||ref|| against float64 (gw0 ~ update magnitude); "
        "first = the `first=True` overwrite",
        "",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                r["grad_weight_dtype"],
                r["operand_dtype"],
                r["method"] + (f" ({r['path']})" if r.get("path") else ""),
                C.fmt(r["ms"], ".3f"),
                C.fmt(r["p20_ms"], ".3f") + " / " + C.fmt(r["p80_ms"], ".3f"),
                C.fmt(r["tflops"], ".3g"),
                C.fmt(r["temp_mib"], ".0f"),
                C.fmt(r["rel_err"], ".2e"),
                C.fmt(r["rel_err_first"], ".2e"),
                (r["error"] or "")[:160],
            ]
        )
    headers = [
        "gw",
        "operands",
        "method",
        "ms",
        "p20 / p80",
        "TFLOP/s",
        "temp MiB",
        "rel err",
        "first",
        "error",
    ]
    lines += C.md_table(headers, rows)
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test of the plumbing)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument(
        "--cases",
        default=",".join(f"{a}:{b}" for a, b in CASES),
        help="comma list of GW:OPERANDS dtype pairs, e.g. fp32:bf16,bf16:bf16",
    )
    p.add_argument("--reps", type=int, default=50, help="timed samples per method (>= 20 recommended)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 GEMMs (default: off)")
    p.add_argument("--quick", action="store_true", help="tiny sizes on CPU, fewer samples on GPU")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu for the smoke test", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    if device.type == "cpu":
        torch.set_num_threads(1)  # smoke test on a shared machine
    if args.quick:
        args.reps, args.warmup = min(args.reps, 20), min(args.warmup, 3)
        if device.type == "cpu":
            args.vocab, args.hidden, args.chunk = 1000, 128, 64
    cases = []
    for item in args.cases.split(","):
        gw_name, _, op_name = item.strip().partition(":")
        if gw_name not in C.DTYPES or op_name not in C.DTYPES:
            p.error(f"bad case {item!r}; dtypes are {sorted(C.DTYPES)}")
        cases.append((gw_name, op_name))

    out = C.out_dir()
    env = C.environment(device)
    t0 = time.time()
    records: List[Dict[str, Any]] = []
    for gw_name, op_name in cases:
        try:
            records += run_case(gw_name, op_name, args, device)
        except Exception as exc:  # noqa: BLE001 - e.g. OOM making the inputs: record and go on
            records.append(_record(gw_name, op_name, "*", args, error=C.short_error(exc)))
        payload = {"env": env, "args": vars(args), "records": records, "elapsed_s": time.time() - t0}
        C.write_json(out / "accumulation.json", payload)
    lines = render(records, env, args)
    (out / "accumulation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(
        f"\n[bench_accumulation] {len(records)} rows in {time.time() - t0:.1f}s -> {out}/accumulation.{{json,md}}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
