"""Shared helpers for the benchmark scripts: output folder, environment header, timing, tables.

Nothing here is specific to one benchmark. The scripts run as ``python3 benchmarks/<script>.py`` from the
repo root, so this module is imported as a top-level module (``import _common``).
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """ "bf16"/"fp16"/"fp32"/"fp64" or a torch attribute name ("bfloat16", "torch.float32")."""
    short = {**DTYPES, "fp64": torch.float64}
    if name in short:
        return short[name]
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def resolve_flce_kwargs(kwargs: Dict[str, Any], weight_dtype: torch.dtype) -> Dict[str, Any]:
    """JSON kwargs of a lightning_flce variant -> op kwargs: "param" is the weight's dtype, dtype names of
    ``*dtype`` keys become torch dtypes."""
    out = {}
    for key, value in kwargs.items():
        if value == "param":
            value = weight_dtype
        elif isinstance(value, str) and key.endswith("dtype"):
            value = dtype_from_name(value)
        out[key] = value
    return out


def parse_flce_variants(items: Iterable[str], flag: str) -> Dict[str, Dict[str, Any]]:
    """``NAME=JSON`` command-line items -> {name: JSON kwargs} (checked; resolved per call by
    :func:`resolve_flce_kwargs`)."""
    import argparse

    variants: Dict[str, Dict[str, Any]] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"{flag} wants NAME=JSON, got {item!r}")
        kwargs = json.loads(spec or "{}")
        if not isinstance(kwargs, dict):
            raise argparse.ArgumentTypeError(f"{flag} {name}: JSON must be an object, got {spec!r}")
        try:
            resolve_flce_kwargs(kwargs, torch.float32)  # fail early on a bad dtype name
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{flag} {name}: {exc}") from None
        variants[name.strip()] = kwargs
    return variants


def ensure_repo_on_path() -> None:
    """Make ``import lightning_flce`` work from a plain checkout (the GPU machine does not install it)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def out_dir() -> Path:
    """``$OUT`` when set (the device machine's output folder), else ``./bench_out``."""
    path = Path(os.environ.get("OUT") or "bench_out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def short_error(exc: BaseException, limit: int = 600) -> str:
    """One-line-ish error text for a JSON record: type, message and the innermost frame."""
    msg = f"{type(exc).__name__}: {exc}".strip()
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        last = tb[-1]
        msg += f" [at {Path(last.filename).name}:{last.lineno} in {last.name}]"
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(exc, oom_type)) or "out of memory" in str(exc).lower()


def _pkg_version(name: str) -> Optional[str]:
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed or broken metadata
        return None


def _git_commit() -> Optional[str]:
    try:
        res = subprocess.run(
            # --dirty: the device machine's copy of .git can lag behind the working tree that was sent.
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        return res.stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git / no .git on the device machine
        return None


def environment(device: torch.device) -> Dict[str, Any]:
    """The header every result file carries."""
    env: Dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": _pkg_version("triton"),
        "liger_kernel": _pkg_version("liger-kernel") or _pkg_version("liger_kernel"),
        "cut_cross_entropy": _pkg_version("cut-cross-entropy") or _pkg_version("cut_cross_entropy"),
        "lightning_flce_commit": _git_commit(),
        "device": str(device),
        "gpu": None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["gpu_sms"] = props.multi_processor_count
        try:
            drv = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            env["driver"] = drv.stdout.strip().splitlines()[0] if drv.stdout.strip() else None
        except Exception:  # noqa: BLE001
            env["driver"] = None
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["torch_threads"] = torch.get_num_threads()
    return env


def header_lines(env: Dict[str, Any]) -> List[str]:
    dev = env.get("gpu") or env.get("cpu") or env["device"]
    return [
        f"- date (UTC): {env['date_utc']}",
        f"- device: {dev} ({env['device']}; capability {env.get('gpu_capability', '-')}, "
        f"driver {env.get('driver', '-')})",
        f"- torch {env['torch']}, CUDA runtime {env['cuda_runtime']}, triton {env['triton']}, "
        f"python {env['python']}",
        f"- liger-kernel {env['liger_kernel']}, cut-cross-entropy {env['cut_cross_entropy']}, "
        f"lightning_flce commit {env['lightning_flce_commit']}",
        f"- TF32 matmul allowed: {env['tf32_matmul']}",
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class Timer:
    """Times one region: CUDA events on a GPU (no sync inside the region), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start: Any = None
        self._end: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            self._end.record()
        else:
            self._end = time.perf_counter()

    def ms(self) -> float:
        """Elapsed ms; on a GPU, call after a synchronize (or it waits for the end event)."""
        if self.device.type == "cuda":
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end))
        return (self._end - self._start) * 1e3


def interleaved_medians(
    setups: Dict[Any, Callable[[], Callable[[], Any]]],
    device: torch.device,
    rounds: int,
    reps: int,
    warmup: int = 2,
) -> Dict[Any, float]:
    """Median ms of each entry: ``setup()`` prepares its inputs outside the timed region (a restore, say) and
    returns the call to time. ``warmup`` untimed calls each (compiling every specialization), then ``rounds``
    rounds over all entries in turn, ``reps`` timed calls each per round."""
    timer = Timer(device)
    for setup in setups.values():
        for _ in range(warmup):
            setup()()
    times: Dict[Any, List[float]] = {key: [] for key in setups}
    for _ in range(rounds):
        for key, setup in setups.items():
            for _ in range(reps):
                fn = setup()
                timer.start()
                fn()
                timer.stop()
                times[key].append(timer.ms())
    return {key: percentile(values, 50) for key, values in times.items()}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def measure_peak_mib(fn: Callable[[], Any], device: torch.device) -> Optional[float]:
    """Increase of ``max_memory_allocated`` over one call of ``fn`` (None off CUDA)."""
    if device.type != "cuda":
        fn()
        return None
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / MIB


def matmul_tflops(dtype: torch.dtype, device: torch.device, n: int, reps: int = 10, warmup: int = 3) -> float:
    """Median TFLOP/s of an n x n x n ``torch.mm`` in ``dtype`` (random operands, not zeros)."""
    gen = torch.Generator(device=device).manual_seed(1234)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(reps):
        t = Timer(device)
        t.start()
        torch.mm(a, b, out=c)
        t.stop()
        times.append(t)
    synchronize(device)
    ms = percentile([t.ms() for t in times], 50)
    del a, b, c
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Read + write GB/s of one large device-to-device ``copy_`` (median of ``reps``): the bandwidth floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    timers = []
    for _ in range(reps):
        tm = Timer(device)
        tm.start()
        dst.copy_(src)
        tm.stop()
        timers.append(tm)
    synchronize(device)
    ms = percentile([tm.ms() for tm in timers], 50)
    del src, dst
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


def rel_l2(
    a: torch.Tensor, ref: torch.Tensor, rows_per_chunk: Optional[int] = None, ref_scale: float = 1.0
) -> float:
    """||a - s ref|| / ||s ref|| (s = ``ref_scale``) in float64, in row chunks so no full-size float64 copy
    of ``a`` exists."""
    if a.shape != ref.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(ref.shape)}")
    a2 = a.reshape(a.shape[0], -1) if a.dim() > 1 else a.reshape(-1, 1)
    r2 = ref.reshape(ref.shape[0], -1) if ref.dim() > 1 else ref.reshape(-1, 1)
    if rows_per_chunk is None:
        rows_per_chunk = max(1, (1 << 26) // max(1, a2.shape[1]))
    num = 0.0
    den = 0.0
    for s in range(0, a2.shape[0], rows_per_chunk):
        ac = a2[s : s + rows_per_chunk].to(torch.float64)
        rc = r2[s : s + rows_per_chunk].to(torch.float64) * ref_scale
        num += float((ac - rc).square().sum())
        den += float(rc.square().sum())
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def write_json(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str, allow_nan=True))
    tmp.replace(path)


def fmt(value: Any, spec: str = ".3g", none: str = "-") -> str:
    if value is None:
        return none
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return format(value, spec)
    return str(value)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> List[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    return lines


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    """Fixed-width table for the terminal (the device call's output tail)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for k, r in enumerate(cells):
        out.append(
            "  ".join(
                c.ljust(w) if (k == 0 or i == 0) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out
