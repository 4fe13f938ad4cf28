"""Fused linear cross-entropy providers compared in one run: fwd+bwd of the whole LM-head loss.

For each (shape, dtype, input distribution) config:
  1. make x [N, H], W [V, H], t [N] (~10% ignored) on the device; compute a float64 reference
     (loss, dX, dW) in row chunks on the device;
  2. correctness gate: one fwd+bwd per provider (also its first warm-up / compile), loss rel err and
     dX/dW relative L2 errors against float64;
  3. peak memory: increase of max_memory_allocated over one fwd+bwd per provider (inputs allocated
     beforehand, allocator cache emptied, peak stats reset), measured apart from the timing;
  4. timing: warm-up, then --samples rounds; each round calls every provider once (round-robin, order
     rotated every round), each call timed with CUDA events; median, p20, p80.
Floors: FLOP floor = 6*N*H*V at this run's measured 8192^3 torch.mm rate in the config's dtype; memory
floor = dX + dW in the input dtype.

Usage (GPU):       python3 benchmarks/bench_flce.py [--quick] [--shapes 0,2] [--dtypes bf16] ...
CPU smoke test:    python3 benchmarks/bench_flce.py --device cpu --quick
Writes $OUT/flce.json (all records) and $OUT/flce.md (tables); $OUT defaults to ./bench_out.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _common as C
import _providers as P
import torch

C.ensure_repo_on_path()

Shape = Tuple[int, int, int]  # (N tokens, H hidden, V vocab)

SHAPES: List[Shape] = [
    (16384, 4096, 32000),  # Llama-2-7B-like head
    (16384, 4096, 128256),  # Llama-3-8B-like head
    (8192, 2304, 256000),  # Gemma-2-2B-like head
    (8192, 3584, 151936),  # Qwen2-7B-like head
]
CPU_SHAPES: List[Shape] = [(128, 32, 512), (96, 48, 1501)]  # smoke tests of the plumbing only
DISTS = ["random", "trained"]

# Correctness-gate tolerances per input dtype: (loss rel err, dX/dW relative L2 error). A provider over
# them is flagged FAIL in the tables but still timed; NaN/inf or an exception is an error and is not timed.
TOLERANCES = {"bf16": (2e-2, 5e-2), "fp16": (1e-2, 2e-2), "fp32": (1e-3, 5e-3)}


# ------------------------------------------------------------------------------------------------ data
def trained_alpha(V: int, target_loss: float) -> float:
    """Target-direction scale so the mean loss is ~target_loss.

    With W rows ~ N(0, I/H) (norm ~1) and x = noise + alpha * W[t]/|W[t]|, noise ~ N(0, I): the target
    logit is ~alpha, the V-1 others ~N(0, 1), so Z ~ V*e^0.5 + e^alpha and loss = log Z - alpha
    = log(1 + V e^0.5 / e^alpha). Solve for alpha.
    """
    return math.log(V) + 0.5 - math.log(math.expm1(target_loss))


def make_data(
    shape: Shape,
    dtype: torch.dtype,
    dist: str,
    device: torch.device,
    seed: int,
    ignore_frac: float,
    target_loss: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, H, V = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    # W ~ N(0, 1/H): unit-norm-ish rows, so with x ~ N(0, 1) every logit is ~N(0, 1).
    w32 = torch.randn(V, H, device=device, generator=gen) / math.sqrt(H)
    t = torch.randint(0, V, (N,), device=device, generator=gen)
    x32 = torch.randn(N, H, device=device, generator=gen)
    if dist == "trained":
        rows = w32.index_select(0, t)
        x32.add_(rows / rows.norm(dim=1, keepdim=True), alpha=trained_alpha(V, target_loss))
        del rows
    elif dist != "random":
        raise ValueError(f"unknown dist {dist!r}")
    ignored = torch.rand(N, device=device, generator=gen) < ignore_frac
    t.masked_fill_(ignored, P.IGNORE_INDEX)
    x = x32.to(dtype).requires_grad_(True)
    w = w32.to(dtype).requires_grad_(True)
    del x32, w32
    return x, w, t


@torch.no_grad()
def reference(
    x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, rows: int, token_weight: Optional[torch.Tensor] = None
) -> Tuple[float, torch.Tensor, torch.Tensor]:
    """float64 mean loss, dX, dW of cross_entropy(x @ W.T, t, ignore_index=-100), ``rows`` tokens at a time.

    With ``token_weight`` ([N]) every token's summand is multiplied by its weight; the denominator stays the
    number of non-ignored tokens (the op's ``token_weight=`` semantics).
    """
    N, H = x.shape
    V = w.shape[0]
    w64 = w.detach().to(torch.float64)
    dx = torch.empty(N, H, dtype=torch.float64, device=x.device)
    dw = torch.zeros(V, H, dtype=torch.float64, device=x.device)
    valid_all = t != P.IGNORE_INDEX
    n_valid = max(int(valid_all.sum()), 1)
    scale_all = valid_all.to(torch.float64)
    if token_weight is not None:
        scale_all = scale_all * token_weight.to(torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, N, rows):
        xc = x.detach()[s : s + rows].to(torch.float64)
        tc = t[s : s + rows]
        scale = scale_all[s : s + rows]
        tcl = tc.clamp(min=0).unsqueeze(1)
        logits = xc @ w64.t()
        lse = torch.logsumexp(logits, dim=1)
        loss_sum += ((lse - logits.gather(1, tcl).squeeze(1)) * scale).sum()
        grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
        grad.scatter_add_(1, tcl, -torch.ones_like(tcl, dtype=grad.dtype))
        grad.mul_((scale / n_valid).unsqueeze(1))
        dx[s : s + rows] = grad @ w64
        dw.addmm_(grad.t(), xc)
        del xc, logits, grad, lse
    return float(loss_sum) / n_valid, dx, dw


def make_token_weight(N: int, device: torch.device, seed: int) -> torch.Tensor:
    """Per-token weights uniform in [-1, 2], float32, fixed per config (zero and negative ones included, as
    policy-gradient advantages have them)."""
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    return torch.rand(N, device=device, generator=gen) * 3.0 - 1.0


def ref_rows(N: int, V: int, budget_bytes: int) -> int:
    """Rows per reference chunk so a float64 [rows, V] logits block stays within budget_bytes."""
    rows = max(16, budget_bytes // (8 * V))
    return int(min(N, 1 << (rows.bit_length() - 1)))


# ---------------------------------------------------------------------------------------------- running
def _clear_grads(x: torch.Tensor, w: torch.Tensor) -> None:
    x.grad = None
    w.grad = None


def _fwd_bwd(
    fn: P.LossFn,
    x: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    loss_scale: float = 1.0,
    token_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One fwd+bwd; ``loss_scale`` is the grad_output (as torch's GradScaler gives it, for fp16); a weighted
    provider gets ``token_weight``."""
    loss = fn(x, w, t) if token_weight is None else fn(x, w, t, token_weight)
    loss.backward(None if loss_scale == 1.0 else torch.full_like(loss, loss_scale))
    return loss.detach()


def _cfg_stub(shape: Shape, dtype_name: str, dist: str) -> Dict[str, Any]:
    N, H, V = shape
    return {
        "shape": f"{N}x{H}x{V}",
        "N": N,
        "H": H,
        "V": V,
        "dtype": dtype_name,
        "dist": dist,
        "ref_loss": None,
        "floor_ms": None,
        "mem_floor_mib": None,
    }


def _blank_record(provider: P.Provider, cfg: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "provider": provider.name,
        **cfg,
        "ms": None,
        "p20_ms": None,
        "p80_ms": None,
        "samples": 0,
        "peak_mib": None,
        "pct_flop_floor": None,
        "peak_over_mem_floor": None,
        "loss": None,
        "loss_rel_err": None,
        "dx_rel_err": None,
        "dw_rel_err": None,
        "dw_dtype": None,
        "token_weighted": provider.weighted,
        "gate": None,
        "error": provider.error,
        "note": provider.note,
    }


def run_config(
    shape: Shape,
    dtype_name: str,
    dist: str,
    providers: Sequence[P.Provider],
    args: argparse.Namespace,
    device: torch.device,
    rates: Dict[str, float],
    seed: int,
) -> List[Dict[str, Any]]:
    N, H, V = shape
    dtype = C.DTYPES[dtype_name]
    flops = 6.0 * N * H * V
    itemsize = torch.empty((), dtype=dtype).element_size()
    cfg = _cfg_stub(shape, dtype_name, dist)
    if rates.get(dtype_name):
        cfg["floor_ms"] = flops / (rates[dtype_name] * 1e12) * 1e3
    cfg["mem_floor_mib"] = (N * H + V * H) * itemsize / C.MIB
    # fp16 trains with a loss scale (GradScaler): without one, the "mean" gradients of every provider
    # underflow fp16 alike and the errors say nothing about the providers.
    loss_scale = args.fp16_loss_scale if dtype_name == "fp16" else 1.0
    cfg["loss_scale"] = loss_scale
    records = {p.name: _blank_record(p, cfg) for p in providers}
    tol_loss, tol_grad = TOLERANCES[dtype_name]

    x, w, t = make_data(shape, dtype, dist, device, seed, args.ignore_frac, args.target_loss)
    rows = ref_rows(N, V, args.ref_chunk_mib * C.MIB)
    # Weighted providers get the same per-token weights and are gated against the weighted reference.
    tw = make_token_weight(N, device, seed) if any(p.weighted for p in providers) else None
    refs: Dict[bool, Tuple[float, torch.Tensor, torch.Tensor]] = {}
    if any(not p.weighted for p in providers):
        refs[False] = reference(x, w, t, rows)
    if tw is not None:
        refs[True] = reference(x, w, t, rows, token_weight=tw)
    ref_loss = refs[False][0] if False in refs else refs[True][0]
    cfg["ref_loss"] = ref_loss
    if True in refs:
        cfg["ref_loss_token_weighted"] = refs[True][0]
    for p in providers:
        records[p.name]["ref_loss"] = refs[p.weighted][0]

    def weights_of(p: P.Provider) -> Optional[torch.Tensor]:
        return tw if p.weighted else None

    # 2. correctness gate (first call of each provider: includes its compilation).
    passed: List[P.Provider] = []
    ref_dx = ref_dw = None
    for p in providers:
        rec = records[p.name]
        if p.fn is None:
            continue
        p_ref_loss, ref_dx, ref_dw = refs[p.weighted]
        try:
            _clear_grads(x, w)
            loss = _fwd_bwd(p.fn, x, w, t, loss_scale, weights_of(p))
            C.synchronize(device)
            rec["loss"] = float(loss.float())
            if x.grad is None or w.grad is None:
                raise RuntimeError("backward produced no dX or no dW")
            rec["dw_dtype"] = C.DTYPE_NAMES.get(w.grad.dtype, str(w.grad.dtype))
            rec["loss_rel_err"] = abs(rec["loss"] - p_ref_loss) / max(abs(p_ref_loss), 1e-30)
            rec["dx_rel_err"] = C.rel_l2(x.grad, ref_dx, ref_scale=loss_scale)
            rec["dw_rel_err"] = C.rel_l2(w.grad, ref_dw, ref_scale=loss_scale)
            errs = [rec["loss_rel_err"], rec["dx_rel_err"], rec["dw_rel_err"]]
            if not all(math.isfinite(e) for e in errs):
                rec["gate"] = "error"
                rec["error"] = "non-finite loss or gradient"
            else:
                ok = errs[0] <= tol_loss and errs[1] <= tol_grad and errs[2] <= tol_grad
                rec["gate"] = "pass" if ok else "FAIL"
                passed.append(p)
        except Exception as exc:  # noqa: BLE001 - OOM or a provider bug: record, go on
            rec["gate"] = "error"
            rec["error"] = ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc)
        finally:
            _clear_grads(x, w)
            loss = None
            C.free_memory(device)
    del refs, ref_dx, ref_dw
    C.free_memory(device)

    # 3. peak memory, one provider at a time.
    for p in list(passed):
        rec = records[p.name]
        try:
            _clear_grads(x, w)
            rec["peak_mib"] = C.measure_peak_mib(
                lambda p=p: _fwd_bwd(p.fn, x, w, t, loss_scale, weights_of(p)), device
            )
            if rec["peak_mib"] is not None:
                rec["peak_over_mem_floor"] = rec["peak_mib"] / cfg["mem_floor_mib"]
        except Exception as exc:  # noqa: BLE001
            rec["error"] = ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc)
            passed.remove(p)
        finally:
            _clear_grads(x, w)
            C.free_memory(device)

    # 4. timing: warm-up, then round-robin samples with a rotating order.
    active = list(passed)
    timers: Dict[str, List[C.Timer]] = {p.name: [] for p in active}

    def one_round(order: Sequence[P.Provider], timed: bool) -> None:
        for p in order:
            if p not in active or (
                timed and p.max_samples is not None and len(timers[p.name]) >= p.max_samples
            ):
                continue
            try:
                _clear_grads(x, w)
                tm = C.Timer(device)
                tm.start()
                _fwd_bwd(p.fn, x, w, t, loss_scale, weights_of(p))
                tm.stop()
                if timed:
                    timers[p.name].append(tm)
            except Exception as exc:  # noqa: BLE001
                records[p.name]["error"] = ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc)
                active.remove(p)
                C.free_memory(device)
        _clear_grads(x, w)

    for _ in range(args.warmup):
        one_round(active, timed=False)
    for i in range(args.samples):
        k = i % max(1, len(active))
        one_round(active[k:] + active[:k], timed=True)
    C.synchronize(device)
    for p in passed:
        rec = records[p.name]
        times = [tm.ms() for tm in timers[p.name]]
        if p not in active or not times:
            continue
        rec["samples"] = len(times)
        rec["ms"] = C.percentile(times, 50)
        rec["p20_ms"] = C.percentile(times, 20)
        rec["p80_ms"] = C.percentile(times, 80)
        if cfg["floor_ms"] is not None:
            rec["pct_flop_floor"] = 100.0 * cfg["floor_ms"] / rec["ms"]
    x = w = t = tw = None  # drop the inputs before emptying the cache
    C.free_memory(device)
    return list(records.values())


# ---------------------------------------------------------------------------------------------- output
def _cell_status(r: Dict[str, Any]) -> Optional[str]:
    if r.get("gate") == "skipped" or (r.get("error") or "").startswith("skipped"):
        return "skip"
    if r.get("gate") == "error" or r.get("ms") is None:
        if (r.get("error") or "").startswith("unavailable"):
            return "n/a"
        return "OOM" if "OOM" in (r.get("error") or "") else "ERR"
    return None


def summary_lines(
    records: List[Dict[str, Any]], provider_names: List[str], max_errors: int = 12
) -> List[str]:
    """Two compact pivots (config x provider): time and peak memory. Printed last by gpu_check.sh."""
    configs: List[Tuple[str, str, str]] = []
    by_key: Dict[Tuple[str, str, str, str], Dict[str, Any]] = {}
    for r in records:
        key = (r["shape"], r["dtype"], r["dist"])
        if key not in configs:
            configs.append(key)
        by_key[key + (r["provider"],)] = r
    lines: List[str] = []
    for title, cell in (
        ("median ms (% of FLOP floor); '!' = correctness gate FAIL", "time"),
        ("peak MiB over inputs (x memory floor)", "mem"),
    ):
        rows = []
        for key in configs:
            row: List[Any] = [f"{key[0]} {key[1]} {key[2]}"]
            for name in provider_names:
                r = by_key.get(key + (name,))
                if r is None:
                    row.append("")
                    continue
                status = _cell_status(r)
                if status:
                    row.append(status)
                elif cell == "time":
                    pct = r.get("pct_flop_floor")
                    row.append(
                        f"{r['ms']:.1f}"
                        + (f" ({pct:.0f}%)" if pct is not None else "")
                        + ("!" if r.get("gate") == "FAIL" else "")
                    )
                else:
                    pk, ratio = r.get("peak_mib"), r.get("peak_over_mem_floor")
                    row.append("-" if pk is None else f"{pk:.0f} ({ratio:.2f}x)")
            rows.append(row)
        lines += [f"== {title}"] + C.text_table(["config"] + provider_names, rows) + [""]
    lines += ratio_lines(configs, by_key)
    errors = [r for r in records if r.get("error") and not (r["error"] or "").startswith("skipped")]
    seen = set()
    if errors:
        lines.append("== errors (first per provider+message; all in the full table)")
        for r in errors:
            k = (r["provider"], r["error"][:80])
            if k in seen:
                continue
            seen.add(k)
            if len(seen) > max_errors:
                lines.append("  ...")
                break
            lines.append(f"  {r['provider']} @ {r['shape']} {r['dtype']} {r['dist']}: {r['error'][:220]}")
    return lines


# (row, against it, goal on the time ratio, what it checks): the "must hold" of issue 18 and the cost rows
# of issue 23, printed when both providers of a pair ran.
RATIO_GOALS: List[Tuple[str, str, float, str]] = [
    ("flce", "flce_base", 1.02, "the op within 2% of the baseline commit's"),
    ("flce_tw", "flce", 1.03, "token_weight within 3% of the unweighted op"),
    ("flce_tw", "flce_none_x_w", 1 / 1.15, "token_weight >= 15% faster than reduction='none' * w"),
    ("flce_fp32logits", "flce", 1.10, "fp32 logits <= 10% slower than the default"),
    ("flce_fp32comp", "flce", 1.10, "compensated fp32 logits <= 10% slower than the default"),
    ("flce_fp32comp", "flce_fp32logits", None, "compensated against plain fp32 logits (no goal)"),
    (
        "flce_fp32comp_rows",
        "flce",
        None,
        "compensated, the fp32 chunk buffer (run89's path), against the default",
    ),
    ("flce_fp32comp", "flce_fp32comp_rows", None, "16-bit relative logits against the fp32 chunk buffer"),
    ("flce_fp32head", "flce", None, "fp32 head against the default (no goal)"),
]


def ratio_lines(
    configs: List[Tuple[str, str, str]], by_key: Dict[Tuple[str, str, str, str], Dict[str, Any]]
) -> List[str]:
    """Per config: time ratio a / b (and peak difference a - b in MiB) of the pairs in ``RATIO_GOALS``."""
    pairs = [
        g for g in RATIO_GOALS if any(key + (g[0],) in by_key and key + (g[1],) in by_key for key in configs)
    ]
    if not pairs:
        return []
    rows = []
    verdicts: Dict[str, List[bool]] = {f"{a}/{b}": [] for a, b, _, _ in pairs}
    for key in configs:
        row: List[Any] = [f"{key[0]} {key[1]} {key[2]}"]
        for a, b, goal, _ in pairs:
            ra, rb = by_key.get(key + (a,)), by_key.get(key + (b,))
            if ra is None or rb is None or _cell_status(ra) or _cell_status(rb):
                row.append("-")
                continue
            ratio = ra["ms"] / rb["ms"]
            dpeak = (
                None
                if ra.get("peak_mib") is None or rb.get("peak_mib") is None
                else ra["peak_mib"] - rb["peak_mib"]
            )
            ok = goal is None or ratio <= goal
            if goal is not None:
                verdicts[f"{a}/{b}"].append(ok)
            row.append(f"{ratio:.3f}{'' if ok else '!'}" + ("" if dpeak is None else f" ({dpeak:+.0f})"))
        rows.append(row)
    lines = ["== time ratio (peak difference MiB); '!' = misses the goal"]
    lines += C.text_table(["config"] + [f"{a}/{b}" for a, b, _, _ in pairs], rows)
    for a, b, goal, what in pairs:
        got = verdicts[f"{a}/{b}"]
        if goal is None or not got:
            continue
        lines.append(f"goal {a}/{b} <= {goal:.3f} ({what}): {sum(got)}/{len(got)} configs")
    return lines + [""]


def markdown(
    records: List[Dict[str, Any]], env: Dict[str, Any], meta: Dict[str, Any], providers: Sequence[P.Provider]
) -> List[str]:
    names = [p.name for p in providers]
    lines = [
        "# Fused linear cross-entropy: fwd+bwd providers",
        "",
        *C.header_lines(env),
        f"- matmul rates ({meta['matmul_n']}^3 torch.mm, median of 10): "
        + ", ".join(f"{k} {v:.4g} TFLOP/s" for k, v in meta["rates_tflops"].items()),
        f"- {meta['samples']} timed samples per provider (round-robin, rotating order) after "
        f"{meta['warmup']} warm-up rounds; ignored targets ~{meta['ignore_frac']:.0%}; "
        f"trained dist target loss ~{meta['target_loss']}",
        f"- fp16 backward with grad_output = {meta.get('fp16_loss_scale', 1.0):g} (a GradScaler's loss scale); "
        "errors are of the unscaled gradients",
        f"- wall time {meta['elapsed_s']:.0f}s",
        "",
        "Providers:",
        *[
            f"- `{p.name}`: {p.description}"
            + (f" [{p.note}]" if p.note else "")
            + (f" ({p.max_samples} timed samples at most)" if p.max_samples else "")
            + (f" — {p.error}" if p.error else "")
            for p in providers
        ],
        "",
        "```",
        *summary_lines(records, names),
        "```",
        "",
        "Columns: ms = median fwd+bwd (p20/p80); %floor = FLOP floor / ms; peak = max_memory_allocated increase "
        "over one fwd+bwd; xfloor = peak / (dX + dW bytes in input dtype); errors vs float64 "
        "(loss: relative; dX, dW: relative L2). Token-weighted rows (`*_tw`, `flce_none_x_w`: per-token weights "
        "uniform in [-1, 2], the same for every such row of a config) are gated against the weighted float64 "
        "reference, and their `ref loss` is its loss.",
        "",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                r["shape"],
                r["dtype"],
                r["dist"],
                r["provider"],
                C.fmt(r["ms"], ".2f"),
                C.fmt(r["p20_ms"], ".2f") + " / " + C.fmt(r["p80_ms"], ".2f"),
                C.fmt(r["pct_flop_floor"], ".0f"),
                C.fmt(r["peak_mib"], ".0f"),
                C.fmt(r["peak_over_mem_floor"], ".2f"),
                C.fmt(r["ref_loss"], ".3f"),
                C.fmt(r["loss_rel_err"], ".1e"),
                C.fmt(r["dx_rel_err"], ".1e"),
                C.fmt(r["dw_rel_err"], ".1e"),
                r.get("dw_dtype") or "-",
                r.get("gate") or "-",
                (r.get("error") or "")[:200],
            ]
        )
    headers = [
        "shape NxHxV",
        "dtype",
        "data",
        "provider",
        "ms",
        "p20 / p80",
        "%floor",
        "peak MiB",
        "xfloor",
        "ref loss",
        "loss err",
        "dX err",
        "dW err",
        "dW dtype",
        "gate",
        "error",
    ]
    return lines + C.md_table(headers, rows)


# ------------------------------------------------------------------------------------------------ main
def parse_shapes(spec: str, device: torch.device) -> List[Shape]:
    base = CPU_SHAPES if device.type == "cpu" else SHAPES
    if spec == "all":
        return list(base)
    shapes = []
    for item in spec.split(","):
        item = item.strip()
        if "x" in item:
            n, h, v = (int(s) for s in item.split("x"))
            shapes.append((n, h, v))
        else:
            shapes.append(base[int(item)])
    return shapes


def parse_variants(items: List[str]) -> Dict[str, Dict[str, Any]]:
    """The default lightning_flce variants plus/overridden by ``--flce-variant NAME=JSON`` items."""
    return {**P.FLCE_VARIANTS, **C.parse_flce_variants(items, "--flce-variant")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test: tiny shapes)")
    p.add_argument(
        "--shapes",
        default="all",
        help="'all', indices into the shape list (0..3) or NxHxV, comma-separated. "
        "GPU list: " + ", ".join(f"{i}={n}x{h}x{v}" for i, (n, h, v) in enumerate(SHAPES)),
    )
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma list of bf16, fp16, fp32")
    p.add_argument(
        "--fp32-shapes",
        default="0",
        help="shapes (same syntax as --shapes) at which fp32 runs; default: the first only",
    )
    p.add_argument("--dists", default="random,trained", help="comma list of random, trained")
    p.add_argument("--providers", default="all", help="comma list of provider names (see --list)")
    p.add_argument(
        "--flce-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="extra/overriding lightning_flce variant, e.g. flce_c2k='{\"chunk_size\": 2048}'",
    )
    p.add_argument("--samples", type=int, default=10, help="timed samples per provider (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds after the correctness call")
    p.add_argument("--ignore-frac", type=float, default=0.1)
    p.add_argument("--target-loss", type=float, default=2.0, help="mean loss the 'trained' data aims at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fp16-loss-scale",
        type=float,
        default=2.0**16,
        help="grad_output of the fp16 runs (torch.amp.GradScaler's init_scale 2^16 by default; 1 = none)",
    )
    p.add_argument("--ref-chunk-mib", type=int, default=2048, help="float64 reference logits block size")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip configs predicted to end after this many seconds (results so far are kept)",
    )
    p.add_argument("--tag", default="", help="suffix for the output files (flce<tag>.json/.md)")
    p.add_argument(
        "--torch213-dir",
        type=Path,
        default=P.DEFAULT_TORCH213_DIR,
        help="folder with torch 2.13's linear_cross_entropy*.py (benchmarks/fetch_peers.sh)",
    )
    p.add_argument(
        "--force-torch213-copy",
        action="store_true",
        help="use the copied modules even if this torch has F.linear_cross_entropy (testing)",
    )
    p.add_argument(
        "--baseline-dir",
        type=Path,
        default=P.DEFAULT_BASELINE_DIR,
        help="folder holding lightning_flce_base/ for the flce_base row (benchmarks/make_baseline.py REV)",
    )
    p.add_argument(
        "--baseline-commit",
        default=None,
        metavar="REV",
        help="flce_base = the op of git revision REV, materialized now (needs git history; else --baseline-dir)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="GPU: shapes 0,2, bf16, both dists, warm-up 1; CPU: one tiny shape, fp32+bf16, 3 samples",
    )
    p.add_argument("--list", action="store_true", help="list providers and configs, then exit")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available() and not args.list:
        print("CUDA is not available; use --device cpu for the smoke test", file=sys.stderr)
        return 2
    if args.quick:
        if device.type == "cpu":
            args.shapes = "0" if args.shapes == "all" else args.shapes
            args.dtypes = "fp32,bf16" if args.dtypes == parser.get_default("dtypes") else args.dtypes
            args.fp32_shapes = "all"
            args.samples = min(args.samples, 3)
        else:
            args.shapes = "0,2" if args.shapes == "all" else args.shapes
            args.dtypes = "bf16" if args.dtypes == parser.get_default("dtypes") else args.dtypes
        args.warmup = min(args.warmup, 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cpu":
        torch.set_num_threads(1)  # smoke test on a shared machine: steadier, and leaves cores to others

    shapes = parse_shapes(args.shapes, device)
    fp32_shapes = parse_shapes(args.fp32_shapes, device)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    dists = [d.strip() for d in args.dists.split(",") if d.strip()]
    for d in dtypes:
        if d not in C.DTYPES:
            parser.error(f"unknown dtype {d!r}")
    for d in dists:
        if d not in DISTS:
            parser.error(f"unknown dist {d!r}")
    providers = P.make_providers(
        parse_variants(args.flce_variant),
        args.torch213_dir,
        args.force_torch213_copy,
        baseline_dir=args.baseline_dir,
        baseline_commit=args.baseline_commit,
    )
    if args.providers != "all":
        wanted = [s.strip() for s in args.providers.split(",") if s.strip()]
        unknown = set(wanted) - {p.name for p in providers}
        if unknown:
            parser.error(f"unknown providers {sorted(unknown)}; known: {[p.name for p in providers]}")
        providers = [p for p in providers if p.name in wanted]
    else:
        providers = [p for p in providers if p.default]
    configs = [
        (shape, dt, dist)
        for shape in shapes
        for dt in dtypes
        if dt != "fp32" or shape in fp32_shapes
        for dist in dists
    ]
    if args.list:
        for p in providers:
            print(f"{p.name:14s} {p.description}")
        for shape, dt, dist in configs:
            print(f"config {shape} {dt} {dist}")
        return 0

    t0 = time.time()
    out = C.out_dir()
    env = C.environment(device)
    P.build_all(providers, device)
    for p in providers:
        print(
            f"[bench_flce] provider {p.name}: {p.error or 'ok'}{' [' + p.note + ']' if p.note else ''}",
            flush=True,
        )

    mm_n = 8192 if device.type == "cuda" else 256
    rates: Dict[str, float] = {}
    for d in dtypes:
        try:
            rates[d] = C.matmul_tflops(C.DTYPES[d], device, mm_n)
        except Exception as exc:  # noqa: BLE001
            print(f"[bench_flce] matmul rate {d} failed: {C.short_error(exc)}", flush=True)
    C.free_memory(device)
    print(
        "[bench_flce] matmul rates: " + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in rates.items()),
        flush=True,
    )

    records: List[Dict[str, Any]] = []
    secs_per_flop: List[float] = []
    names = [p.name for p in providers]
    meta: Dict[str, Any] = {
        "rates_tflops": rates,
        "matmul_n": mm_n,
        "samples": args.samples,
        "warmup": args.warmup,
        "ignore_frac": args.ignore_frac,
        "fp16_loss_scale": args.fp16_loss_scale,
        "target_loss": args.target_loss,
        "tolerances": TOLERANCES,
        "args": {k: str(v) for k, v in vars(args).items()},
        "elapsed_s": 0.0,
    }
    stem = "flce" + args.tag

    def flush() -> None:
        meta["elapsed_s"] = time.time() - t0
        C.write_json(out / f"{stem}.json", {"env": env, "meta": meta, "records": records})
        (out / f"{stem}.md").write_text("\n".join(markdown(records, env, meta, providers)) + "\n")

    for idx, (shape, dt, dist) in enumerate(configs):
        N, H, V = shape
        flops = 6.0 * N * H * V
        label = f"[{idx + 1}/{len(configs)}] {N}x{H}x{V} {dt} {dist}"
        elapsed = time.time() - t0
        if args.budget_s is not None and secs_per_flop:
            # Optimistic (fastest config so far, per FLOP): a config cut by the outer timeout loses only
            # itself, since results are written after every config.
            predicted = min(secs_per_flop) * flops
            if elapsed + predicted > args.budget_s:
                print(
                    f"{label}: skipped (time budget: {elapsed:.0f}s + ~{predicted:.0f}s > {args.budget_s:.0f}s)"
                )
                for p in providers:
                    rec = _blank_record(p, _cfg_stub(shape, dt, dist))
                    rec["gate"] = "skipped"
                    rec["error"] = "skipped: time budget"
                    records.append(rec)
                flush()
                continue
        c0 = time.time()
        try:
            recs = run_config(shape, dt, dist, providers, args, device, rates, args.seed + idx)
        except Exception as exc:  # noqa: BLE001 - e.g. OOM building the inputs or the reference
            err = ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc)
            recs = []
            for p in providers:
                rec = _blank_record(p, _cfg_stub(shape, dt, dist))
                rec["gate"] = "error"
                rec["error"] = "config failed: " + err
                recs.append(rec)
            C.free_memory(device)
        records += recs
        secs_per_flop.append((time.time() - c0) / flops)
        parts = []
        for r in recs:
            status = _cell_status(r)
            parts.append(f"{r['provider']}={status or format(r['ms'], '.2f')}")
        ref = recs[0].get("ref_loss") if recs else None
        print(
            f"{label} ref_loss={C.fmt(ref, '.3f')} ({time.time() - c0:.1f}s): " + " ".join(parts), flush=True
        )
        flush()

    flush()
    print()
    print("\n".join(summary_lines(records, names)))
    print(f"\n[bench_flce] {len(configs)} configs in {time.time() - t0:.1f}s -> {out}/{stem}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
