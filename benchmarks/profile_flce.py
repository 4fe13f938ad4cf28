"""Per-kernel time profile of one fwd+bwd of ``lightning_flce.fused_linear_cross_entropy``, grouped by stage.

For each shape x variant (variant = keyword arguments of the op): random inputs as in ``bench_flce.py``
(x ~ N(0, 1), W ~ N(0, 1/H) so logits are O(1), ~10% of the targets ignored), ``--warmup`` calls, the
median of 5 unprofiled calls timed with CUDA events (the wall time), then ONE fwd+bwd under
``torch.profiler`` with ``record_shapes=True``. Device (kernel) time is reported per aten op and input
shapes (``key_averages(group_by_input_shape=True)``, self device time) and per stage: logits GEMM, dX
GEMM, dW accumulation, CE kernel (the Triton ``_cross_entropy_chunk_kernel``), casts/copies,
gather/scatter, other. Each kernel is assigned through the op that launched it (its name, input shapes
and enclosing ops), so the stage sums add up to the profiled kernel total. Floors: 6*N*H*V at the
measured 8192^3 ``torch.mm`` rate; per stage, 2*n*H*V FLOPs per GEMM (n = tokens that reach the GEMMs,
ignored ones are dropped), the CE kernel's 2*n*V*itemsize bytes (read the logits, write their gradient)
and the dW accumulator's 2*V*H*itemsize per call (1x for the first call, which only writes) at the
bandwidth of a 1 GiB device-to-device copy. With ``--device cpu`` (smoke test, tiny shapes) there are no
kernels: the tables hold each op's self CPU time and no floors are measured. Writes
``$OUT/profile<tag>.json`` and ``$OUT/profile<tag>.md`` ($OUT defaults to ./bench_out).

GPU run:          python3 benchmarks/profile_flce.py [--shape 16384x4096x32000] [--dtype bf16] [--tag _run1]
CPU smoke test:   python benchmarks/profile_flce.py --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import _common as C
import torch
from bench_flce import SHAPES as GPU_SHAPES  # the issue's four shapes
from bench_flce import Shape, make_data
from torch.profiler import ProfilerActivity, profile, record_function

C.ensure_repo_on_path()

CPU_SHAPES: List[Shape] = [(256, 64, 1000)]
DEFAULT_VARIANTS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "minmem": {"chunk_size": 512, "accum_dtype": "param"},
}
MM_N = 8192  # matmul-rate probe: MM_N^3 torch.mm
COPY_BYTES = 1 << 30  # bandwidth probe: one device-to-device copy of this size

LOGITS, DX, DW, CE, CAST, GATHER, OTHER = (
    "logits GEMM",
    "dX GEMM",
    "dW accumulation",
    "CE kernel",
    "casts/copies",
    "gather/scatter",
    "other",
)
CATEGORIES = [LOGITS, DX, DW, CE, CAST, GATHER, OTHER]
CE_KERNEL = "_cross_entropy_chunk_kernel"
CAST_KERNEL = "_scale_into_kernel"  # backward's cast of dW's accumulator (grad_output folded in)
LOGITS_KERNEL = "_compensated_mm"  # logits_precision="fp32_compensated": the Triton logits GEMM (no aten op)
# record_function label put around the op's per-chunk CE call during the profiled call, so the PyTorch
# implementation's many small ops (CPU, or impl="torch") also land in "CE kernel".
CE_LABEL = "flce::cross_entropy_chunk"
CAST_OPS = {
    "aten::copy_",
    "aten::_to_copy",
    "aten::to",
    "aten::clone",
    "aten::contiguous",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
}
GATHER_OPS = {
    "aten::index_select",
    "aten::index_copy_",
    "aten::index_copy",
    "aten::argsort",
    "aten::sort",
    "aten::gather",
    "aten::scatter",
    "aten::scatter_",
    "aten::scatter_add_",
    "aten::index",
    "aten::index_put_",
    "aten::_index_put_impl_",
    "aten::take",
    "aten::masked_select",
    "aten::nonzero",
}


# ------------------------------------------------------------------------------------------ arguments
def parse_shapes(values: Optional[List[str]], device: torch.device) -> List[Shape]:
    """``--shape`` values: ``N,H,V`` or a comma list of ``NxHxV``; none given: the device's defaults."""
    if not values:
        return list(GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    shapes: List[Shape] = []
    for value in values:
        if "x" in value:
            items = [s.strip() for s in value.split(",") if s.strip()]
            dims = [tuple(int(d) for d in item.split("x")) for item in items]
        else:
            dims = [tuple(int(d) for d in value.split(","))]
        for d in dims:
            if len(d) != 3 or min(d) <= 0:
                raise argparse.ArgumentTypeError(f"--shape wants N,H,V or NxHxV[,NxHxV...], got {value!r}")
            shapes.append((d[0], d[1], d[2]))
    return shapes


def parse_variants(items: Optional[List[str]]) -> Dict[str, Dict[str, Any]]:
    if not items:
        return {k: dict(v) for k, v in DEFAULT_VARIANTS.items()}
    return C.parse_flce_variants(items, "--variant")


# ------------------------------------------------------------------------------------------ probes
class Rates:
    """Measured matmul TFLOP/s per dtype (lazily, cached) and copy GB/s; all None off CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tflops: Dict[str, float] = {}
        self.copy_gbps: Optional[float] = None
        if device.type == "cuda":
            self.copy_gbps = C.copy_bandwidth_gbps(device, COPY_BYTES)
            C.free_memory(device)

    def matmul(self, dtype: torch.dtype) -> Optional[float]:
        if self.device.type != "cuda":
            return None
        key = str(dtype).replace("torch.", "")
        if key not in self.tflops:
            self.tflops[key] = C.matmul_tflops(dtype, self.device, MM_N)
            C.free_memory(self.device)
        return self.tflops[key]


# ------------------------------------------------------------------------------------------ profiling
@contextlib.contextmanager
def instrument(log: Dict[str, List[Dict[str, Any]]]) -> Iterator[None]:
    """Record the op's per-chunk CE and dW calls (shapes, dtypes, path) and label the CE calls.

    Wraps ``lightning_flce.op.cross_entropy_chunk`` and ``lightning_flce.accumulate.accumulate_grad_weight`` (the
    names the chunk loop looks up at call time; dW's accumulator calls the latter once per row block); a name the
    modules no longer have is left alone.
    """
    import lightning_flce.accumulate as accumulation
    import lightning_flce.op as op

    orig_ce = getattr(op, "cross_entropy_chunk", None)
    orig_acc = getattr(accumulation, "accumulate_grad_weight", None)

    def ce(logits, *args, **kwargs):
        log["ce"].append({"rows": int(logits.shape[0]), "cols": int(logits.shape[1]), "dtype": logits.dtype})
        with record_function(CE_LABEL):
            return orig_ce(logits, *args, **kwargs)

    def acc(grad_weight, grad_logits, input, *args, **kwargs):
        path = kwargs.get("path")
        log["acc"].append(
            {
                "rows": int(grad_logits.shape[0]),
                "shape": tuple(grad_weight.shape),
                "dtype": grad_weight.dtype,
                "operand_dtype": grad_logits.dtype,
                "first": bool(kwargs.get("first", False)),
                "path": getattr(path, "value", None if path is None else str(path)),
            }
        )
        return orig_acc(grad_weight, grad_logits, input, *args, **kwargs)

    if orig_ce is not None:
        op.cross_entropy_chunk = ce
    if orig_acc is not None:
        accumulation.accumulate_grad_weight = acc
    try:
        yield
    finally:
        if orig_ce is not None:
            op.cross_entropy_chunk = orig_ce
        if orig_acc is not None:
            accumulation.accumulate_grad_weight = orig_acc


def _us(evt: Any, *names: str) -> float:
    """The first of ``names`` that ``evt`` has, in us (``self_device_time_total`` is
    ``self_cuda_time_total`` before torch 2.4; the latter warns on newer versions)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                value = getattr(evt, name)
            except AttributeError:
                continue
            if value is not None:
                return float(value)
    return 0.0


def self_device_us(evt: Any) -> float:
    return _us(evt, "self_device_time_total", "self_cuda_time_total")


def _is_cpu_event(evt: Any) -> bool:
    return getattr(evt, "device_type", None) == torch.autograd.DeviceType.CPU


def _mat(shapes: Sequence[Sequence[int]], i: int) -> Optional[Tuple[int, int]]:
    if len(shapes) > i and len(shapes[i]) == 2:
        return int(shapes[i][0]), int(shapes[i][1])
    return None


def gemm_category(name: str, shapes: Sequence[Sequence[int]], H: int, V: int) -> Optional[str]:
    """Stage of a GEMM op from its operand shapes (None: not one of the op's GEMMs)."""
    if name in ("aten::addmm", "aten::addmm_"):
        if _mat(shapes, 0) == (V, H):  # accumulating into the [V, H] dW
            return DW
        a, b = _mat(shapes, 1), _mat(shapes, 2)
    elif name in ("aten::mm", "aten::matmul"):
        a, b = _mat(shapes, 0), _mat(shapes, 1)
    else:
        return None
    if a is None or b is None:
        return None
    rows, k, cols = a[0], a[1], b[1]
    if cols == V and k == H:
        return LOGITS  # [c, H] x [H, V] -> [c, V]
    if cols == H and k == V:
        return DX  # [c, V] x [V, H] -> [c, H]
    if (rows, cols) == (V, H):
        return DW  # add_mm path: [V, c] x [c, H] product, then added to dW
    return None


def classify(evt: Any, H: int, V: int, kernel_name: Optional[str] = None) -> str:
    """Stage of a kernel (or, on CPU, of an op's self time) from the kernel name and the op stack."""
    if kernel_name and CE_KERNEL in kernel_name:
        return CE
    if kernel_name and CAST_KERNEL in kernel_name:
        return CAST
    if kernel_name and LOGITS_KERNEL in kernel_name:
        return LOGITS
    node = evt
    in_accumulate_grad = False
    while node is not None:
        name = node.name or ""
        if name == CE_LABEL or CE_KERNEL in name:
            return CE
        if "AccumulateGrad" in name:  # autograd adding into an existing .grad: not the op's dW
            in_accumulate_grad = True
            break
        cat = gemm_category(name, node.input_shapes or [], H, V)
        if cat is not None:
            return cat
        node = getattr(node, "cpu_parent", None)
    name, shapes = evt.name or "", evt.input_shapes or []
    if name in CAST_OPS or CAST_KERNEL in name or name == "lightning_flce::flce_cast_grad":
        return CAST
    if name in GATHER_OPS:
        return GATHER
    if name == "aten::add_" and not in_accumulate_grad and _mat(shapes, 0) == _mat(shapes, 1) == (V, H):
        return DW  # add_mm path: dW += product
    return OTHER


def shapes_str(shapes: Optional[Sequence[Sequence[int]]]) -> str:
    parts = ["x".join(str(d) for d in s) for s in (shapes or []) if s]
    return ", ".join(parts) if parts else "-"


def _is_annotation(evt: Any) -> bool:
    return bool(getattr(evt, "is_user_annotation", False))


def _elapsed_us(evt: Any) -> float:
    try:
        return float(evt.time_range.elapsed_us())
    except AttributeError:
        return 0.0


def _kernel_owners(events: Sequence[Any], skip_names: set) -> List[Tuple[Any, List[Tuple[str, float]]]]:
    """(launching op, its kernels) with every kernel once.

    torch attaches a kernel to each CPU event of its correlation id: besides the op, profiler overhead
    records nested in it can carry the same id (pytorch#193392), and a record_function's GPU-side
    annotation is attached like a kernel (pytorch#130730). Keep one event per id (the longest: the op,
    not a record nested in it) and drop the annotations (``skip_names``).
    """
    owners: Dict[Any, Tuple[Any, List[Tuple[str, float]]]] = {}
    for evt in events:
        if not _is_cpu_event(evt) or getattr(evt, "is_async", False):
            continue
        kernels = getattr(evt, "kernels", None)
        if kernels is None:  # a torch without per-event kernel lists: the event's own self device time
            pieces = [(None, self_device_us(evt))]
        else:
            pieces = [(k.name, float(k.duration)) for k in kernels if k.name not in skip_names]
        pieces = [(n, us) for n, us in pieces if us > 0]
        if not pieces:
            continue
        key = getattr(evt, "id", None)
        key = ("id", key) if key else ("evt", len(owners))
        cur = owners.get(key)
        if cur is None or _elapsed_us(evt) > _elapsed_us(cur[0]):
            owners[key] = (evt, pieces)
    return list(owners.values())


def analyze(prof: Any, device: torch.device, H: int, V: int) -> Dict[str, Any]:
    """Stage totals, the op table (per op + input shapes) and, on CUDA, the kernel table. Times in ms.

    CUDA: the kernels (device events, without record_function annotations) are the ground truth; each is
    assigned to the op that launched it and classified from the kernel name and that op's stack. CPU:
    each op's self CPU time, classified from its stack.
    """
    on_gpu = device.type == "cuda"
    events = prof.events()
    cat_us: Dict[str, float] = defaultdict(float)
    cat_calls: Dict[str, int] = defaultdict(int)
    key_us: Dict[Tuple[str, str], Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernel_cat: Dict[str, str] = {}
    device_total_us = 0.0
    if on_gpu:
        annotations = {e.name for e in events if not _is_cpu_event(e) and _is_annotation(e)}
        device_total_us = sum(
            self_device_us(e) for e in events if not _is_cpu_event(e) and not _is_annotation(e)
        )
        owned = _kernel_owners(events, annotations)
    else:
        owned = [
            (e, [(None, _us(e, "self_cpu_time_total"))])
            for e in events
            if _is_cpu_event(e) and not getattr(e, "is_async", False)
        ]
    attributed_us = 0.0
    for evt, pieces in owned:
        key = (evt.name, str(evt.input_shapes))
        seen = set()
        for kname, us in pieces:
            if us <= 0:
                continue
            cat = classify(evt, H, V, kname)
            if kname is not None:
                kernel_cat.setdefault(kname, cat)
            cat_us[cat] += us
            key_us[key][cat] += us
            attributed_us += us
            if cat not in seen:
                cat_calls[cat] += 1
                seen.add(cat)
    unattributed_us = max(0.0, device_total_us - attributed_us) if on_gpu else 0.0
    if unattributed_us > 0:
        cat_us[OTHER] += unattributed_us
    total_us = sum(cat_us.values())

    ops = []
    kernels_rows = []
    torch_self_us = 0.0
    for avg in prof.key_averages(group_by_input_shape=True):
        if not _is_cpu_event(avg):
            if on_gpu and not _is_annotation(avg) and self_device_us(avg) > 0:
                kernels_rows.append(
                    {
                        "kernel": avg.key,
                        "calls": int(avg.count),
                        "ms": self_device_us(avg) / 1e3,
                        "stage": kernel_cat.get(avg.key, OTHER),
                    }
                )
            continue
        torch_us = self_device_us(avg) if on_gpu else _us(avg, "self_cpu_time_total")
        torch_self_us += torch_us
        cats = key_us.get((avg.key, str(avg.input_shapes)), {})
        us = sum(cats.values())
        if us <= 0 and torch_us <= 0:
            continue
        stage = max(cats, key=cats.get) if cats else OTHER
        if len([c for c, v in cats.items() if v > 0.05 * us]) > 1:
            stage += " (mixed)"
        ops.append(
            {
                "op": avg.key,
                "shapes": shapes_str(avg.input_shapes),
                "input_shapes": avg.input_shapes,
                "calls": int(avg.count),
                "ms": us / 1e3,  # kernels attributed to this op (CPU: its self CPU time)
                "torch_self_ms": torch_us / 1e3,  # key_averages' self device (CPU: self CPU) time
                "stage": stage,
            }
        )
    ops.sort(key=lambda r: -r["ms"])
    kernels_rows.sort(key=lambda r: -r["ms"])
    return {
        "time_kind": "self device (kernel) time" if on_gpu else "self CPU time",
        "total_ms": total_us / 1e3,
        "device_total_ms": device_total_us / 1e3 if on_gpu else None,
        "attributed_ms": attributed_us / 1e3,
        "unattributed_ms": unattributed_us / 1e3,
        "key_averages_self_ms": torch_self_us / 1e3,
        "stages": {c: {"ms": cat_us.get(c, 0.0) / 1e3, "calls": cat_calls.get(c, 0)} for c in CATEGORIES},
        "ops": ops,
        "kernels": kernels_rows,
    }


def add_floors(
    rec: Dict[str, Any], log: Dict[str, List[Dict[str, Any]]], rates: Rates, dtype: torch.dtype
) -> None:
    """Per-stage FLOP/byte counts from the recorded chunk calls, and their floors where rates exist."""
    N, H, V = rec["N"], rec["H"], rec["V"]
    ce_rows = sum(c["rows"] for c in log["ce"])
    ce_bytes = sum(2 * c["rows"] * c["cols"] * c["dtype"].itemsize for c in log["ce"])
    acc_dtype = log["acc"][0]["dtype"] if log["acc"] else None
    acc_rows = sum(a["rows"] for a in log["acc"])
    acc_bytes = sum(
        (1 if a["first"] else 2) * a["shape"][0] * a["shape"][1] * a["dtype"].itemsize for a in log["acc"]
    )
    wide = acc_dtype == torch.float64  # fp64 accumulator: dX and dW GEMMs run in fp64 (op.run_chunks)
    gemm_dtype = torch.float64 if wide else dtype
    rate = rates.matmul(dtype)
    rate_wide = rates.matmul(gemm_dtype)
    bw = rates.copy_gbps
    rec.update(
        {
            "chunks": len(log["ce"]),
            "chunk_rows": sorted({c["rows"] for c in log["ce"]}, reverse=True),
            "gemm_rows": ce_rows,
            "acc_dtype": str(acc_dtype).replace("torch.", "") if acc_dtype else None,
            "acc_path": log["acc"][0]["path"] if log["acc"] else None,
            "acc_calls": len(log["acc"]),
            "matmul_tflops": rate,
            "matmul_tflops_dx_dw": rate_wide,
            "copy_gbps": bw,
            "flop_floor_ms": 6.0 * N * H * V / (rate * 1e12) * 1e3 if rate else None,
            "flop_floor_valid_ms": 6.0 * ce_rows * H * V / (rate * 1e12) * 1e3 if rate else None,
        }
    )

    def flop_ms(flops: float, r: Optional[float]) -> Optional[float]:
        return flops / (r * 1e12) * 1e3 if r else None

    def byte_ms(nbytes: float) -> Optional[float]:
        return nbytes / (bw * 1e9) * 1e3 if bw else None

    st = rec["stages"]
    gemm_flops = 2.0 * ce_rows * H * V
    st[LOGITS].update(flops=gemm_flops, floor_ms=flop_ms(gemm_flops, rate), basis="2nHV FLOPs")
    st[DX].update(flops=gemm_flops, floor_ms=flop_ms(gemm_flops, rate_wide), basis="2nHV FLOPs")
    dw_flops = 2.0 * acc_rows * H * V
    dw_f, dw_b = flop_ms(dw_flops, rate_wide), byte_ms(acc_bytes)
    st[DW].update(
        flops=dw_flops,
        bytes=acc_bytes,
        flop_floor_ms=dw_f,
        byte_floor_ms=dw_b,
        floor_ms=max(dw_f, dw_b) if dw_f is not None and dw_b is not None else (dw_f or dw_b),
        basis="max(2nHV FLOPs, acc r+w bytes)",
    )
    st[CE].update(bytes=ce_bytes, floor_ms=byte_ms(ce_bytes), basis="2nV itemsize bytes")
    for s in st.values():
        s["pct_of_floor"] = 100.0 * s["floor_ms"] / s["ms"] if s.get("floor_ms") and s["ms"] > 0 else None


def profile_config(
    shape: Shape,
    dtype_name: str,
    name: str,
    kwargs: Dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
    rates: Rates,
    seed: int,
) -> Dict[str, Any]:
    from lightning_flce import fused_linear_cross_entropy

    N, H, V = shape
    dtype = C.DTYPES[dtype_name]
    rec: Dict[str, Any] = {
        "shape": f"{N}x{H}x{V}",
        "N": N,
        "H": H,
        "V": V,
        "dtype": dtype_name,
        "variant": name,
        "kwargs": json.dumps(kwargs, sort_keys=True),
        "error": None,
    }
    x, w, t = make_data(shape, dtype, "random", device, seed, args.ignore_frac, 2.0)
    rec["n_valid"] = int((t != -100).sum())
    op_kwargs = C.resolve_flce_kwargs(kwargs, w.dtype)

    def fwd_bwd() -> None:
        x.grad = None
        w.grad = None
        fused_linear_cross_entropy(x, w, t, **op_kwargs).backward()

    for _ in range(args.warmup):
        fwd_bwd()
    C.synchronize(device)

    times = []
    for _ in range(args.timed):
        x.grad = None
        w.grad = None
        tm = C.Timer(device)
        tm.start()
        fused_linear_cross_entropy(x, w, t, **op_kwargs).backward()
        tm.stop()
        times.append(tm)
    C.synchronize(device)
    wall = [tm.ms() for tm in times]
    rec["wall_ms"] = C.percentile(wall, 50)
    rec["wall_ms_all"] = wall

    x.grad = None
    w.grad = None
    C.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    log: Dict[str, List[Dict[str, Any]]] = {"ce": [], "acc": []}
    with profile(activities=activities, record_shapes=True) as prof:
        with instrument(log):
            fused_linear_cross_entropy(x, w, t, **op_kwargs).backward()
        C.synchronize(device)
    rec.update(analyze(prof, device, H, V))
    del prof
    rec["busy_pct"] = 100.0 * rec["total_ms"] / rec["wall_ms"] if device.type == "cuda" else None
    add_floors(rec, log, rates, dtype)
    rec["pct_of_flop_floor"] = (
        100.0 * rec["flop_floor_ms"] / rec["wall_ms"] if rec.get("flop_floor_ms") else None
    )
    x = w = t = None
    C.free_memory(device)
    return rec


# ------------------------------------------------------------------------------------------ output
def _ms(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return C.fmt(float(value), ".3f" if value < 10 else ".2f")


def config_lines(rec: Dict[str, Any], top: int, with_kernels: bool) -> List[str]:
    title = f"### {rec['shape']} {rec['dtype']} `{rec['variant']}` {rec['kwargs']}"
    if rec.get("error"):
        return [title, "", f"ERROR: {rec['error']}", ""]
    on_gpu = rec.get("device_total_ms") is not None
    info = (
        f"n_valid={rec['n_valid']}/{rec['N']}, {rec['chunks']} CE calls (rows {rec['chunk_rows'][:3]}), "
        f"dW acc {rec['acc_dtype']} via {rec['acc_path']} ({rec['acc_calls']} calls); "
        f"wall (unprofiled, median of {len(rec['wall_ms_all'])}) {_ms(rec['wall_ms'])} ms; "
        f"profiled {rec['time_kind']} sum {_ms(rec['total_ms'])} ms"
    )
    if on_gpu:
        info += f" ({C.fmt(rec['busy_pct'], '.0f')}% of wall; unattributed {_ms(rec['unattributed_ms'])} ms)"
        ka, att = rec.get("key_averages_self_ms"), rec.get("attributed_ms")
        if ka is not None and att and abs(ka - att) > 0.01 * att:
            info += (
                f"; NOTE key_averages' op self device times sum to {_ms(ka)} ms vs {_ms(att)} ms of attributed "
                "kernels (profiler double counting?): the tables use the kernel-level attribution"
            )
    if rec.get("flop_floor_ms") is not None:
        info += (
            f"; FLOP floor 6NHV {_ms(rec['flop_floor_ms'])} ms ({C.fmt(rec['pct_of_flop_floor'], '.0f')}% of "
            f"wall; {rec['matmul_tflops']:.0f} TFLOP/s, copy {rec['copy_gbps']:.0f} GB/s)"
        )
    rows = []
    total = rec["total_ms"] or 0.0
    for cat in CATEGORIES:
        s = rec["stages"][cat]
        rows.append(
            [
                cat,
                _ms(s["ms"]),
                C.fmt(100.0 * s["ms"] / total if total else None, ".1f"),
                s["calls"],
                _ms(s.get("floor_ms")),
                C.fmt(s.get("pct_of_floor"), ".0f"),
                s.get("basis", ""),
            ]
        )
    rows.append(["**sum**", _ms(total), "100", "", _ms(rec.get("flop_floor_valid_ms")), "", "6nHV FLOPs"])
    lines = [title, "", info, ""]
    lines += C.md_table(["stage", "ms", "% of sum", "events", "floor ms", "% floor", "floor basis"], rows)
    op_rows = [
        [r["op"], r["shapes"], r["calls"], _ms(r["ms"]), C.fmt(100.0 * r["ms"] / total, ".1f"), r["stage"]]
        for r in rec["ops"][:top]
    ]
    lines += ["", f"Top {len(op_rows)} of {len(rec['ops'])} ops by {rec['time_kind']}:", ""]
    lines += C.md_table(["op", "input shapes", "calls", "ms", "%", "stage"], op_rows)
    if with_kernels and rec.get("kernels"):
        k_rows = [
            [r["kernel"][:90], r["calls"], _ms(r["ms"]), C.fmt(100.0 * r["ms"] / total, ".1f"), r["stage"]]
            for r in rec["kernels"][:top]
        ]
        lines += ["", f"Top {len(k_rows)} of {len(rec['kernels'])} kernels:", ""]
        lines += C.md_table(["kernel", "calls", "ms", "%", "stage"], k_rows)
    return lines + [""]


def summary_lines(records: List[Dict[str, Any]]) -> List[str]:
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["shape"], r["dtype"], r["variant"], "ERR"] + [""] * (len(CATEGORIES) + 3))
            continue
        rows.append(
            [r["shape"], r["dtype"], r["variant"], _ms(r["wall_ms"]), _ms(r["total_ms"])]
            + [_ms(r["stages"][c]["ms"]) for c in CATEGORIES]
            + [_ms(r.get("flop_floor_ms")), C.fmt(r.get("pct_of_flop_floor"), ".0f")]
        )
    headers = ["shape", "dtype", "variant", "wall ms", "profiled ms"] + CATEGORIES + ["6NHV floor", "% floor"]
    return ["## Summary (ms)", ""] + C.md_table(headers, rows) + [""]


def markdown(records: List[Dict[str, Any]], env: Dict[str, Any], meta: Dict[str, Any]) -> List[str]:
    rates = ", ".join(f"{k} {v:.4g} TFLOP/s" for k, v in meta["rates_tflops"].items()) or "-"
    lines = [
        "# lightning_flce: per-kernel profile of one fwd+bwd",
        "",
        *C.header_lines(env),
        f"- matmul rates ({MM_N}^3 torch.mm, median of 10): {rates}; "
        f"copy bandwidth (1 GiB D2D, read+write): {C.fmt(meta['copy_gbps'], '.0f')} GB/s",
        f"- {meta['warmup']} warm-up calls, wall = median of {meta['timed']} unprofiled calls (CUDA events; perf_counter on CPU), "
        f"then one profiled call; ignored targets ~{meta['ignore_frac']:.0%}; wall time {meta['elapsed_s']:.0f}s",
        f"- times: {meta['time_kind']}; n = tokens reaching the GEMMs (ignored rows are dropped); "
        "dW bytes = (2 per call, 1 for the first) x V x H x accumulator itemsize; events = profiled ops "
        "(GPU: ops that launched kernels of that stage)",
        "",
        *summary_lines(records),
    ]
    for r in records:
        lines += config_lines(r, meta["top"], with_kernels=True)
    return lines


# ------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test: tiny shapes)")
    p.add_argument(
        "--shape",
        action="append",
        default=None,
        metavar="N,H,V",
        help="repeatable; N,H,V or a comma list of NxHxV. Default on cuda: "
        + ", ".join(f"{n}x{h}x{v}" for n, h, v in GPU_SHAPES)
        + "; on cpu: "
        + ", ".join(f"{n}x{h}x{v}" for n, h, v in CPU_SHAPES),
    )
    p.add_argument("--dtype", default="bf16", choices=sorted(C.DTYPES))
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="NAME=JSON",
        help="repeatable; kwargs of fused_linear_cross_entropy, e.g. "
        'minmem=\'{"chunk_size":512,"accum_dtype":"param"}\' ("param" = the weight\'s dtype; dtype names '
        "such as float32 become torch dtypes). Default: "
        + " ".join(f"{k}={json.dumps(v)}" for k, v in DEFAULT_VARIANTS.items()),
    )
    p.add_argument("--ignore-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=2, help="unprofiled warm-up calls per config")
    p.add_argument("--timed", type=int, default=5, help="unprofiled timed calls per config (median)")
    p.add_argument("--top", type=int, default=12, help="rows of the op/kernel tables in the output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="suffix for the output files (profile<tag>.json/.md)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu for the smoke test", file=sys.stderr)
        return 2
    try:
        shapes = parse_shapes(args.shape, device)
        variants = parse_variants(args.variant)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cpu":
        torch.set_num_threads(1)  # smoke test on a shared machine

    t0 = time.time()
    out = C.out_dir()
    stem = "profile" + args.tag
    env = C.environment(device)
    rates = Rates(device)
    rates.matmul(C.DTYPES[args.dtype])
    records: List[Dict[str, Any]] = []
    meta: Dict[str, Any] = {
        "rates_tflops": rates.tflops,
        "copy_gbps": rates.copy_gbps,
        "warmup": args.warmup,
        "timed": args.timed,
        "top": args.top,
        "ignore_frac": args.ignore_frac,
        "time_kind": "self device (kernel) time" if device.type == "cuda" else "self CPU time (no kernels)",
        "variants": variants,
        "args": {k: str(v) for k, v in vars(args).items()},
        "elapsed_s": 0.0,
    }
    print(
        f"[profile_flce] {device} {env.get('gpu') or env.get('cpu')}; torch {env['torch']}, triton {env['triton']}; "
        + (
            f"{args.dtype} matmul {rates.tflops} TFLOP/s, copy {rates.copy_gbps:.0f} GB/s"
            if device.type == "cuda"
            else "no floors on cpu"
        ),
        flush=True,
    )

    def flush() -> None:
        meta["elapsed_s"] = time.time() - t0
        C.write_json(out / f"{stem}.json", {"env": env, "meta": meta, "records": records})
        (out / f"{stem}.md").write_text("\n".join(markdown(records, env, meta)) + "\n")

    for si, shape in enumerate(shapes):
        for name, kwargs in variants.items():
            c0 = time.time()
            try:
                rec = profile_config(shape, args.dtype, name, kwargs, args, device, rates, args.seed + si)
            except Exception as exc:  # noqa: BLE001 - OOM or an op error: record it, go on
                N, H, V = shape
                rec = {
                    "shape": f"{N}x{H}x{V}",
                    "N": N,
                    "H": H,
                    "V": V,
                    "dtype": args.dtype,
                    "variant": name,
                    "kwargs": json.dumps(kwargs, sort_keys=True),
                    "error": ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc),
                }
            C.free_memory(device)
            rec["config_s"] = time.time() - c0
            records.append(rec)
            print("\n".join(config_lines(rec, args.top, with_kernels=False)), flush=True)
            flush()
    print("\n".join(summary_lines(records)))
    print(f"[profile_flce] {len(records)} configs in {time.time() - t0:.1f}s -> {out}/{stem}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
