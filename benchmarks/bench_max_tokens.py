"""The largest micro-batch a GPU can train, per LM-head loss: tokens per micro-batch that train without an
out-of-memory error, for the HF model's own loss, Liger's patch and FLCEMixin.

What trains is what ``bench_lightning_e2e.py`` trains (its modules, Trainer settings and step timer are
reused): a Llama with random weights built on the device from a config (``--model 1b``: Llama-3.2-1B shapes;
``3b``: Llama-3.2-3B shapes, hidden 3072, 28 layers, 24 heads, 8 KV heads, intermediate 8192; V=128256,
tied), fp32 master weights, ``precision="bf16-mixed"``, torch's fused AdamW
(``adamw_with_warmup_cosine``), through Lightning's Trainer. Providers:

- ``hf``: a plain LightningModule returning ``model(input_ids, labels=labels).loss`` (transformers'
  ``ForCausalLMLoss``);
- ``liger``: the same module after Liger-Kernel's ``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True,
  rope=False, rms_norm=False, swiglu=False)`` (only the loss changes);
- ``flce``: ``lightning_flce.models.HFCausalLM`` (FLCEMixin, the fused loss through the mixin's
  ``flce_loss``, step normalization included).

Each series is one provider on one axis with activation checkpointing off or on (the HF model's
``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` with its defaults):

- ``batch``: growing batch at sequence ``--seq-len`` (4096);
- ``seq``: growing sequence at batch 1.

Search, per series: tokens double from the axis's start on a grid shared by all providers (so tokens/s can
be compared at equal lengths) until a try runs out of memory, then the bracket between the last fit and the
first OOM is narrowed until it is at most ``--resolution`` of the last fit (at least
``--min-resolution-tokens``). Peak memory grows about linearly with the tokens, so once two tries fit, the
next try is the maximum predicted from their peaks (x ``--safety``) wherever that is smaller than the
doubling or bisection step; the prediction only picks a try, the result is what ran. ``flce`` also
runs at HF's maximum of each axis, so goal 1 compares equal micro-batches (the doubling grid gives the other
equal sizes).

Every try is ONE SUBPROCESS (its memory goes back to the driver before the next) with a time limit: one
warm-up optimizer step on a small batch (1 x ``--warmup-seq``: compiles the kernels and allocates AdamW's
states) and, with ``--compile-layers``, a second one at the try's size (it recompiles the layers for that
shape), then up to ``--steps`` timed steps at the try's size, stopping after the first timed one once a try
has run ``--try-soft-s``. A try fits when at least one timed step completed. Recorded per try (JSON): tokens,
batch x seq, fit / OOM / error / timeout, peak ``max_memory_allocated`` over the timed steps (at an OOM: the
peak before the failed allocation) and per phase, tokens/s (tokens / the median of the timed steps after the
first one, which pays for the new shape; the one step where only one ran: ``rate_steps`` says how many), wall
time. On the
CPU peak memory is the process's peak RSS increase over the try (numbers mean nothing there).

``--sizes`` runs given lengths instead of the search (equal-size comparisons), ``--repeats`` times each: in
rounds, every series once per size and round, the series order reversed on odd rounds; tokens/s per length is
then the median of a series' fits there (goal 3's ties are within one run's spread).

``--budget-s`` ends the whole search in time (a try is started only if its predicted time fits); a series cut
by the budget is resumed by a later call with ``--resume PREVIOUS.json`` (and ``--providers`` / ``--axes`` /
``--checkpointing`` split the work over calls). Writes ``$OUT/max_tokens<TAG>.{json,md,png}``; the summary
and the goals of issue 21 are printed last:

1. without checkpointing, at HF's largest batch (batch axis), flce >= 1.05x HF's tokens/s;
2. with checkpointing, flce's longest sequence at batch 1 >= 5x HF's;
3. with checkpointing (seq axis), at every length both fit, flce's tokens/s >= HF's and >= Liger's.

Usage (GPU; see benchmarks/gpu_max_tokens.sh):
    python3 benchmarks/bench_max_tokens.py --checkpointing off --budget-s 520
    python3 benchmarks/bench_max_tokens.py --checkpointing on --axes seq --resume prev/max_tokens.json
    python3 benchmarks/bench_max_tokens.py --checkpointing on --axes seq --sizes 16384,57344 --repeats 3  # goal 3
CPU smoke test (tiny Llama; liger is ERR there):
    OMP_NUM_THREADS=1 python3 benchmarks/bench_max_tokens.py --device cpu --tiny --providers hf,flce
Plot again from a JSON:  python3 benchmarks/bench_max_tokens.py --plot-only max_tokens.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _common as C
import torch

C.ensure_repo_on_path()

PROVIDERS = ["hf", "liger", "flce"]
AXES = {"batch": "growing batch at a fixed sequence", "seq": "growing sequence at batch 1"}


# ------------------------------------------------------------------------------------------------ config
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny Llama and sizes: a smoke test of the plumbing")
    ap.add_argument("--model", choices=["1b", "3b"], default="1b", help="Llama-3.2-1B or -3B shapes")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma list from {PROVIDERS}")
    ap.add_argument("--axes", default="batch,seq", help="comma list from " + ", ".join(AXES))
    ap.add_argument("--checkpointing", default="off,on", help="activation checkpointing: off, on or off,on")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence of the batch axis (4096; tiny 64)")
    ap.add_argument("--start-batch", type=int, default=1, help="first batch of the batch axis")
    ap.add_argument(
        "--start-seq", type=int, default=None, help="first sequence of the seq axis (16384; tiny 64)"
    )
    ap.add_argument(
        "--seq-granularity",
        type=int,
        default=None,
        help="sequences of the seq axis are multiples (1024; tiny 16)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per micro-batch never tried above (2^21; tiny 1024)",
    )
    ap.add_argument(
        "--resolution", type=float, default=1 / 16, help="stop when first OOM - last fit <= this x last fit"
    )
    ap.add_argument(
        "--min-resolution-tokens", type=int, default=None, help="... or <= this many tokens (4096; tiny 16)"
    )
    ap.add_argument(
        "--safety", type=float, default=0.97, help="a predicted maximum is tried at this fraction of it"
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=3,
        help="timed steps per try (after the small warm-up step); tokens/s is the median of all but the first",
    )
    ap.add_argument(
        "--warmup-seq", type=int, default=None, help="the warm-up step's batch is 1 x this (4096)"
    )
    ap.add_argument("--try-timeout-s", type=float, default=300.0, help="a try is killed after this long")
    ap.add_argument(
        "--try-soft-s", type=float, default=60.0, help="no more timed steps once a try has run this long"
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma list of tokens per micro-batch to run in every series instead of the search (e.g. the"
        " lengths another provider fit, for equal-size tok/s comparisons; multiples of the axis's granularity)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --sizes: runs of each size per series, in rounds (every series and size once per round, the"
        " series order reversed on odd rounds); tokens/s per length is the median of a series' runs",
    )
    ap.add_argument("--budget-s", type=float, default=None, help="the whole search ends within this many s")
    ap.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="CUDA: torch.cuda.set_per_process_memory_fraction to emulate a smaller GPU; CPU: a try whose peak RSS"
        " increase exceeds it counts as OOM (to exercise the search)",
    )
    ap.add_argument(
        "--snapshot-on-oom",
        default="flce",
        help="comma list of providers whose tries record the allocator's history (Python stacks) so that an OOM"
        " names the live tensors (what limits the maximum); 'none' for no recording",
    )
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--flce-chunk-size", type=int, default=None, help="flce_chunk_size (default: the op's)")
    ap.add_argument(
        "--compile-layers", action="store_true", help="torch.compile each decoder layer (all alike)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", type=Path, default=None, help="a previous max_tokens*.json to continue")
    ap.add_argument("--tag", default="", help="suffix of the output files: max_tokens<TAG>.{json,md,png}")
    ap.add_argument("--plot-only", type=Path, default=None, help="redraw the PNG and markdown from a JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tiny = args.tiny
    for key, small, full in (
        ("seq_len", 64, 4096),
        ("start_seq", 64, 16384),
        ("seq_granularity", 16, 1024),
        ("max_tokens", 1024, 2**21),
        ("min_resolution_tokens", 16, 4096),
        ("warmup_seq", 32, 4096),
    ):
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    args.provider_list = _names(ap, args.providers, PROVIDERS, "--providers")
    args.axis_list = _names(ap, args.axes, list(AXES), "--axes")
    args.ckpt_list = [c == "on" for c in _names(ap, args.checkpointing, ["off", "on"], "--checkpointing")]
    try:
        args.size_list = [int(x) for x in args.sizes.split(",")] if args.sizes else []
    except ValueError:
        ap.error(f"--sizes: comma list of ints, got {args.sizes!r}")
    for axis in args.axis_list:
        bad = [n for n in args.size_list if n <= 0 or n % granularity(args, axis)]
        if bad:
            ap.error(
                f"--sizes {bad}: not positive multiples of the {axis} axis's {granularity(args, axis)} tokens"
            )
    return args


def _names(ap: argparse.ArgumentParser, spec: str, known: List[str], flag: str) -> List[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        ap.error(f"{flag}: unknown or empty {unknown}; choose from {known}")
    return names


def model_config(args: argparse.Namespace, seq: int) -> Dict[str, Any]:
    from bench_lightning_e2e import LLAMA_1B, LLAMA_3B, TINY

    cfg = dict(TINY if args.tiny else (LLAMA_3B if args.model == "3b" else LLAMA_1B))
    cfg["max_position_embeddings"] = max(seq, 2048)
    return cfg


# ------------------------------------------------------------------------------------------------ search
Key = Tuple[str, str, bool]  # (provider, axis, checkpointing)


def series_key(t: Dict[str, Any]) -> Key:
    return (t["provider"], t["axis"], bool(t["checkpointing"]))


def granularity(args: argparse.Namespace, axis: str) -> int:
    """Tokens between neighbouring sizes of an axis: one sequence (batch axis) or --seq-granularity."""
    return args.seq_len if axis == "batch" else args.seq_granularity


def start_tokens(args: argparse.Namespace, axis: str) -> int:
    return args.start_batch * args.seq_len if axis == "batch" else args.start_seq


def shape_of(args: argparse.Namespace, axis: str, tokens: int) -> Tuple[int, int]:
    """(batch, seq) of a try."""
    return (tokens // args.seq_len, args.seq_len) if axis == "batch" else (1, tokens)


def _round_down(tokens: float, step: int) -> int:
    return max(step, int(tokens // step) * step)


def predicted_max(tries: Sequence[Dict[str, Any]]) -> Optional[float]:
    """Tokens at which the peak reaches the capacity, linear through the two largest fits' peaks."""
    fits = sorted(
        (t for t in tries if t["status"] == "fit" and t.get("peak_mib") and t.get("capacity_mib")),
        key=lambda t: t["tokens"],
    )
    if len(fits) < 2:
        return None
    a, b = fits[-2], fits[-1]
    slope = (b["peak_mib"] - a["peak_mib"]) / (b["tokens"] - a["tokens"])
    if slope <= 0:
        return None
    return b["tokens"] + (b["capacity_mib"] - b["peak_mib"]) / slope


def search_state(tries: Sequence[Dict[str, Any]]) -> Tuple[Optional[int], Optional[int], Optional[str]]:
    """(largest fit, smallest OOM above it, why the series stopped: an error or timeout, else None)."""
    fits = [t["tokens"] for t in tries if t["status"] == "fit"]
    lo = max(fits) if fits else None
    ooms = [t["tokens"] for t in tries if t["status"] == "OOM" and (lo is None or t["tokens"] > lo)]
    hi = min(ooms) if ooms else None
    stop = next((t["status"] for t in tries if t["status"] in ("error", "timeout")), None)
    return lo, hi, stop


def next_tokens(
    tries: Sequence[Dict[str, Any]],
    start: int,
    step: int,
    resolution: float,
    min_resolution: int,
    cap: int,
    safety: float,
) -> Optional[int]:
    """The next size of a series, or None when it is done. ``step``: the axis's granularity."""
    lo, hi, stop = search_state(tries)
    if stop is not None:
        return None
    tried = {t["tokens"] for t in tries}
    if lo is None:
        if hi is None:
            return start
        smaller = _round_down(hi / 2, step)  # nothing fits yet: halve down to one granule
        return None if hi <= step or smaller in tried else smaller
    res = max(min_resolution, math.ceil(resolution * lo / step) * step, step)
    pred = predicted_max(tries)
    if hi is None:
        if lo >= cap:
            return None
        nxt = min(2 * lo, cap)
        if pred is not None and pred * safety < nxt:
            nxt = max(lo + res, _round_down(pred * safety, step))
        return min(nxt, cap)
    if hi - lo <= res:
        return None
    nxt = _round_down((lo + hi) / 2, step)
    if pred is not None and lo + res <= pred * safety < nxt:
        nxt = _round_down(pred * safety, step)
    nxt = min(max(nxt, lo + step), hi - step)
    return None if nxt in tried else nxt


def probe_tokens(key: Key, all_tries: Sequence[Dict[str, Any]], done: Dict[Key, bool]) -> List[int]:
    """Other providers' maxima that this (finished) series should also run, so equal sizes compare."""
    provider, axis, ckpt = key
    others = ["hf"] if provider == "flce" else []  # goal 1 compares at HF's maximum; the grid covers the rest
    mine = [t for t in all_tries if series_key(t) == key]
    lo, hi, _ = search_state(mine)
    tried = {t["tokens"] for t in mine}
    out = []
    for other in others:
        okey = (other, axis, ckpt)
        if not done.get(okey):
            continue
        olo, _, _ = search_state([t for t in all_tries if series_key(t) == okey])
        if olo is None or olo in tried or lo is None:
            continue
        if olo < lo or (hi is not None and olo < hi):
            out.append(olo)
    return sorted(out)


# ------------------------------------------------------------------------------------------------ worker
def run_try(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One try in this process: build, warm up on a small batch, time ``steps`` steps at the try's size."""
    import lightning.pytorch as pl
    from bench_lightning_e2e import StepTimer, _build_module
    from torch.utils.data import DataLoader

    from lightning_flce.callbacks.memory_snapshot import AllocatorHistory

    args = argparse.Namespace(**spec["args"])
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch, seq = spec["batch"], spec["seq"]
    rec: Dict[str, Any] = {"status": None, "error": None, "note": None}
    if cuda and args.memory_limit_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_limit_gib * 2**30 / total), device)
    # What the allocator can get: the limit, or the device's free memory before this process allocates.
    rec["capacity_mib"] = (args.memory_limit_gib * 1024 if args.memory_limit_gib else None) or (
        torch.cuda.mem_get_info(device)[0] / C.MIB if cuda else None
    )
    rss0 = _rss_mib()
    t0 = time.time()
    deadline = t0 + args.try_soft_s
    warmup = warmup_shapes(batch, seq, args.warmup_seq, args.compile_layers)
    timer = StepTimer(len(warmup), device, deadline)
    # The allocator's history with Python stacks only (cheaper per allocation than C++ ones).
    history = AllocatorHistory(200_000, stacks="python")
    recording = cuda and spec["provider"] in args.snapshot_on_oom.split(",")
    if recording:
        history.start()
    try:
        pl.seed_everything(args.seed, verbose=False)
        cfg = model_config(args, seq)
        e2e_args = argparse.Namespace(lr=args.lr, flce_chunk_size=args.flce_chunk_size)
        module, note = _build_module(spec["provider"], cfg, e2e_args, device)
        rec["note"] = note
        if spec["checkpointing"]:
            rec["checkpointing_call"] = _enable_checkpointing(module.model)
        if args.compile_layers:
            from lightning_flce.models.hf import compile_decoder_layers

            compile_decoder_layers(module.model)
        rec["build_s"] = time.time() - t0
        gen = torch.Generator().manual_seed(args.seed + 1)
        vocab = cfg["vocab_size"]
        shapes = warmup + [(batch, seq)] * args.steps
        batches = []
        for b, s in shapes:  # counting sequences, as bench_lightning_e2e's default data
            ids = (torch.randint(0, vocab, (b, 1), generator=gen) + torch.arange(s)) % vocab
            batches.append({"input_ids": ids, "labels": ids})
        trainer = pl.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            precision="bf16-mixed" if cuda else "32-true",
            max_steps=len(batches),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[timer],
        )
        trainer.fit(module, DataLoader(batches, batch_size=None, shuffle=False, num_workers=0))
        if trainer.optimizers:
            fused = trainer.optimizers[0].defaults.get("fused")
            rec["optimizer"] = f"{type(trainer.optimizers[0]).__name__} ({'fused' if fused else 'default'})"
    except Exception as exc:  # noqa: BLE001 - OOM is a result here; anything else stops the series
        rec["error"] = ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc)
        if recording and C.is_oom(exc):
            # Still inside the handler: the traceback keeps the failing frames' tensors alive, so the snapshot
            # holds what was live when the allocation failed.
            try:
                rec["oom_live"] = live_memory_summary(torch.cuda.memory._snapshot())
            except Exception as snap_exc:  # noqa: BLE001 - the summary is extra information
                rec["oom_live"] = {"error": C.short_error(snap_exc)}
    finally:
        history.stop()
    filled: Dict[str, Any] = {"tokens_per_step": batch * seq}
    timer.fill(filled)
    rec["step_s"] = filled.get("step_s")
    rec["timed_steps"] = filled.get("timed_steps", 0)
    rec["tokens_per_s_all"] = filled.get("tokens_per_s")  # the median over every timed step, the first too
    timed = (rec["step_s"] or [])[len(warmup) :][: rec["timed_steps"]]
    rec["tokens_per_s"], rec["rate_steps"] = settled_rate(timed, batch * seq)
    rec["median_step_s"] = batch * seq / rec["tokens_per_s"] if rec["tokens_per_s"] else None
    rec["loss_last"] = filled.get("loss_last")
    if cuda:
        rec["peak_mib"] = filled.get("peak_alloc_mib")
        rec["phase_peak_mib"] = filled.get("phase_peak_mib")
        rec["peak_reserved_mib"] = filled.get("peak_reserved_mib")
        rec["base_mib"] = filled.get("base_alloc_mib")
    else:
        rec["peak_mib"] = _rss_mib(peak=True) - rss0  # the process's peak RSS increase over the try
        rec["peak_kind"] = "peak RSS increase (CPU)"
    if not cuda and not rec["error"] and rec["capacity_mib"] and rec["peak_mib"] > rec["capacity_mib"]:
        rec["error"] = "OOM (simulated on the CPU: peak RSS increase over --memory-limit-gib)"
    if rec["error"]:
        rec["status"] = "OOM" if rec["error"].startswith("OOM") else "error"
    elif rec["timed_steps"] >= 1:
        rec["status"] = "fit"
    else:
        rec["status"] = "error"
        rec["error"] = "no timed step completed"
    return rec


# Frames that say whose tensor a block is; torch's own frames are skipped. The innermost such frame names the
# allocation (a decoder layer's line, not the module call above it that every forward allocation shares).
_OWNER_MARKERS = ("lightning_flce/", "transformers/", "liger_kernel/", "benchmarks/", "lightning/")


def _owner(frames: Sequence[Dict[str, Any]]) -> str:
    for frame in frames:  # innermost first, as torch.cuda.memory._snapshot() lists them
        name = str(frame.get("filename", ""))
        for marker in _OWNER_MARKERS:
            if marker in name:
                return f"{name[name.rfind(marker) :]}:{frame.get('line')} {frame.get('name')}"
    return "unknown (no Python frame outside torch)" if frames else "unknown (no history)"


def live_memory_summary(snapshot: Dict[str, Any], top: int = 12) -> Dict[str, Any]:
    """What was allocated when a try ran out of memory, from ``torch.cuda.memory._snapshot()``: the live
    blocks grouped by the first frame of a known package that allocated them (sum, count, largest), and the
    largest blocks alone. Sizes in MiB."""
    groups: Dict[str, Dict[str, Any]] = {}
    blocks = []
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            where = _owner(block.get("frames") or [])
            size = block.get("requested_size") or block.get("size", 0)
            g = groups.setdefault(where, {"where": where, "mib": 0.0, "count": 0, "largest_mib": 0.0})
            g["mib"] += size / C.MIB
            g["count"] += 1
            g["largest_mib"] = max(g["largest_mib"], size / C.MIB)
            blocks.append({"mib": size / C.MIB, "where": where})
    total = sum(g["mib"] for g in groups.values())
    return {
        "live_mib": total,
        "by_owner": sorted(groups.values(), key=lambda g: -g["mib"])[:top],
        "largest": sorted(blocks, key=lambda b: -b["mib"])[:top],
    }


def _enable_checkpointing(model: Any) -> str:
    """The HF model's activation checkpointing with its defaults; the name of the call used."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(model, name, None)
        if fn is not None:
            fn()
            return f"{name}()"
    raise RuntimeError(f"{type(model).__name__} has no activation/gradient checkpointing")


def timed_cell(t: Dict[str, Any]) -> str:
    """ "3 (2)": timed steps and, in brackets, how many of them tok/s is the median of (absent in older records,
    whose tok/s is the median of every timed step)."""
    timed = t.get("timed_steps", 0)
    return f"{timed} ({t['rate_steps']})" if t.get("rate_steps") is not None else str(timed)


def settled_rate(timed_s: List[float], tokens: int) -> Tuple[Optional[float], int]:
    """Tokens/s of a try and the number of steps it is the median of: the timed steps after the first one at
    the try's size where there are two or more (that first step pays for the new shape: allocator growth, the
    kernels' autotuning and heuristics for new sizes; run87: with 6 timed steps at 1 x 16,384 every provider
    ran 10-14% faster than the median of 2 said, the fused losses' most), the one step otherwise."""
    if not timed_s:
        return None, 0
    settled = timed_s[1:] if len(timed_s) >= 2 else timed_s
    return tokens / C.percentile(settled, 50), len(settled)


def warmup_shapes(batch: int, seq: int, warmup_seq: int, compile_layers: bool) -> List[Tuple[int, int]]:
    """The untimed steps of a try, as (batch, seq): one small step (kernels compiled, AdamW's states
    allocated) and, with compiled decoder layers, one at the try's own size too: its first step there
    recompiles the layers for the new shapes (run78: HF's first step at 9 x 4096 took 8.2 s against 0.61 s
    for the next, and a median over two steps reported a quarter of the real tokens/s)."""
    shapes = [(1, min(seq, warmup_seq))]
    if compile_layers:
        shapes.append((batch, seq))
    return shapes


def _rss_mib(peak: bool = False) -> float:
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / C.MIB


# ------------------------------------------------------------------------------------------------ parent
def run_subprocess(spec: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flce_maxtok_") as tmp:
        spec_file, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_file)]
        cmd += ["--result-file", str(result)]
        try:
            proc = subprocess.run(cmd, timeout=timeout_s, check=False, capture_output=True, text=True)
            rc: Optional[int] = proc.returncode
            tail = (proc.stderr or "")[-600:]
        except subprocess.TimeoutExpired:
            rc, tail = None, ""
        if result.is_file():
            return json.loads(result.read_text())
        if rc is None:
            return {"status": "timeout", "error": f"timed out after {timeout_s:.0f}s"}
        # A hard crash (the CUDA driver's OOM can kill the process) leaves no result file.
        status = "OOM" if "out of memory" in tail.lower() else "error"
        return {"status": status, "error": f"worker exited with rc {rc}: {' '.join(tail.split())[-400:]}"}


def estimate_s(series: Sequence[Dict[str, Any]], tokens: int, axis: str) -> Optional[float]:
    """A try's wall time, from the series' largest fit: its fixed part (process start, build, warm-up step) as
    it was, its timed steps scaled with the tokens (^1.5 on the sequence axis, where attention grows
    quadratically), plus 5 s; before any fit, the last try's wall time (None before any try)."""
    fits = [t for t in series if t["status"] == "fit" and t.get("wall_s")]
    if not fits:
        done = [t for t in series if t.get("wall_s")]
        return done[-1]["wall_s"] if done else None
    last = max(fits, key=lambda t: t["tokens"])
    timed = sum((last.get("step_s") or [])[1:])
    scale = (tokens / last["tokens"]) ** (1.5 if axis == "seq" else 1.0)
    return last["wall_s"] + timed * max(0.0, scale - 1.0) + 5.0


def main(argv: Optional[List[str]] = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        rec = run_try(spec)
        C.write_json(Path(args.result_file), rec)
        return 0
    out = C.out_dir()
    stem = "max_tokens" + args.tag
    if args.plot_only:
        payload = json.loads(args.plot_only.read_text())
        write_outputs(out, stem, payload)
        print("\n".join(summary_lines(payload)))
        return 0

    t0 = time.time()
    device = torch.device(args.device)
    env = C.environment(device)
    tries: List[Dict[str, Any]] = []
    if args.resume:
        prev = json.loads(args.resume.read_text())
        tries = list(prev.get("tries", []))
        print(f"[max_tokens] resuming {len(tries)} tries from {args.resume}", flush=True)
    worker_args = {
        k: getattr(args, k)
        for k in (
            "device",
            "tiny",
            "model",
            "seq_len",
            "warmup_seq",
            "steps",
            "try_soft_s",
            "memory_limit_gib",
            "lr",
            "flce_chunk_size",
            "compile_layers",
            "seed",
            "snapshot_on_oom",
        )  # fmt: skip
    }
    meta: Dict[str, Any] = {
        "model": "tiny" if args.tiny else args.model,
        "model_config": model_config(args, args.seq_len),
        "precision": "bf16-mixed" if device.type == "cuda" else "32-true",
        "seq_len_batch_axis": args.seq_len,
        "steps": args.steps,
        "warmup_seq": args.warmup_seq,
        "resolution": args.resolution,
        "min_resolution_tokens": args.min_resolution_tokens,
        "max_tokens": args.max_tokens,
        "memory_limit_gib": args.memory_limit_gib,
        "compile_layers": args.compile_layers,
        "args": {k: str(v) for k, v in vars(args).items()},
        "calls": [],
    }
    if args.resume:
        before = prev.get("meta", {})
        for key in ("model", "seq_len_batch_axis", "precision", "memory_limit_gib", "compile_layers"):
            if key in before and before[key] != meta[key]:
                raise SystemExit(
                    f"--resume {args.resume}: its {key} is {before[key]!r}, this call's {meta[key]!r}"
                )
        meta["calls"] = list(before.get("calls", []))
    call = {"started_utc": env["date_utc"], "argv": raw, "elapsed_s": 0.0, "pending": []}
    meta["calls"].append(call)
    payload = {"env": env, "meta": meta, "tries": tries}

    def flush() -> None:
        call["elapsed_s"] = time.time() - t0
        write_outputs(out, stem, payload, with_plot=False)

    keys: List[Key] = [(p, a, c) for c in args.ckpt_list for a in args.axis_list for p in args.provider_list]
    done: Dict[Key, bool] = {}
    print(
        f"[max_tokens] {len(keys)} series, budget {C.fmt(args.budget_s, '.0f')} s -> {out}/{stem}.*",
        flush=True,
    )

    def next_tokens_of(phase: str, key: Key) -> Optional[int]:
        """The next try of a series in the search or probe phase (None: the phase is done for it)."""
        series = [t for t in tries if series_key(t) == key]
        if phase == "search":
            nxt = next_tokens(
                series,
                start_tokens(args, key[1]),
                granularity(args, key[1]),
                args.resolution,
                args.min_resolution_tokens,
                args.max_tokens,
                args.safety,
            )
            done[key] = nxt is None
            return nxt
        probes = probe_tokens(key, tries, done) if done.get(key) else []
        return probes[0] if probes else None

    def attempt(key: Key, nxt: int, phase: str) -> bool:
        """One try (a subprocess), recorded and flushed; False when the budget stops the call first."""
        provider, axis, ckpt = key
        series = [t for t in tries if series_key(t) == key]
        left = math.inf if args.budget_s is None else args.budget_s - (time.time() - t0)
        est = estimate_s(series, nxt, axis)
        if est is not None and est > left or left < 30:
            print(
                f"[max_tokens] {key} next {nxt}: ~{C.fmt(est, '.0f')} s > {left:.0f} s left: stop", flush=True
            )
            call["pending"].append({"series": list(key), "next_tokens": nxt, "phase": phase})
            return False
        batch, seq = shape_of(args, axis, nxt)
        spec = {"provider": provider, "checkpointing": ckpt, "batch": batch, "seq": seq, "args": worker_args}
        c0 = time.time()
        rec = run_subprocess(spec, min(args.try_timeout_s, left))
        if rec["status"] == "timeout" and left < args.try_timeout_s:
            # Killed by the call's budget, not by its own limit: a later call (--resume) runs it again.
            print(f"[max_tokens] {key} {nxt}: cut by the budget after {time.time() - c0:.0f}s", flush=True)
            call["pending"].append({"series": list(key), "next_tokens": nxt, "phase": phase})
            return False
        rec.update(
            provider=provider, axis=axis, checkpointing=ckpt, tokens=nxt, batch=batch, seq=seq,
            kind=phase, wall_s=time.time() - c0,
        )  # fmt: skip
        tries.append(rec)
        print(
            f"[max_tokens] {provider:5s} {axis:5s} ckpt {'on ' if ckpt else 'off'} {batch:4d} x {seq:7d}"
            f" = {nxt:8d}: {rec['status']:7s} peak {C.fmt(rec.get('peak_mib'), '.0f')} MiB,"
            f" {C.fmt(rec.get('tokens_per_s'), '.0f')} tok/s ({rec['wall_s']:.0f}s)"
            + (f" {rec['error'][:160]}" if rec.get("status") in ("error", "timeout") else ""),
            flush=True,
        )
        flush()
        return True

    if args.size_list:  # only the sizes asked for, --repeats times each, the series interleaved
        # Planned again after every try: a size that ran out of memory (or failed) is not tried again.
        while plan := sizes_plan(keys, args.size_list, args.repeats, tries):
            key, size, _ = plan[0]
            if not attempt(key, size, "sizes"):
                break
    else:  # the searches, then the other providers' maxima (probes) for equal-size comparisons
        out_of_budget = False
        for phase in ("search", "probe"):
            for key in keys:
                while not out_of_budget:
                    nxt = next_tokens_of(phase, key)
                    if nxt is None:
                        break
                    out_of_budget = not attempt(key, nxt, phase)
    flush()
    write_outputs(out, stem, payload)
    print(
        f"\n[max_tokens] {len(tries)} tries, this call {time.time() - t0:.0f}s -> {out}/{stem}.{{json,md,png}}"
    )
    print("\n".join(summary_lines(payload)))
    return 0


# ------------------------------------------------------------------------------------------------ report
def series_summary(tries: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    keys: List[Key] = []
    for t in tries:
        if series_key(t) not in keys:
            keys.append(series_key(t))
    rows = []
    for key in keys:
        mine = [t for t in tries if series_key(t) == key]
        lo, hi, stop = search_state(mine)
        best = next((t for t in mine if t["status"] == "fit" and t["tokens"] == lo), None)
        rows.append(
            {
                "provider": key[0],
                "axis": key[1],
                "checkpointing": key[2],
                "max_tokens": lo,
                "batch": best and best["batch"],
                "seq": best and best["seq"],
                "tokens_per_s": best and best.get("tokens_per_s"),
                "peak_mib": best and best.get("peak_mib"),
                "first_oom": hi,
                "tries": len(mine),
                "stopped": stop,
            }
        )
    return rows


def sizes_plan(
    keys: Sequence[Key], sizes: Sequence[int], repeats: int, tries: Sequence[Dict[str, Any]]
) -> List[Tuple[Key, int, int]]:
    """(series, tokens, round) of the ``--sizes`` tries still to run: round r runs every size for every series
    (in reverse series order on odd rounds, so no provider always runs first or last), skipping a (series,
    size) that already has r + 1 fits (those of a resumed call or of its search count) or a try that did not
    fit (out of memory, an error: not tried again)."""
    plan = []
    for rnd in range(repeats):
        order = list(keys) if rnd % 2 == 0 else list(keys)[::-1]
        for size in sizes:
            for key in order:
                here = [t for t in tries if series_key(t) == key and t["tokens"] == size]
                if any(t["status"] != "fit" for t in here):
                    continue
                if (
                    sum(t["status"] == "fit" for t in here)
                    + sum(1 for k, n, _ in plan if (k, n) == (key, size))
                    > rnd
                ):
                    continue
                plan.append((key, size, rnd))
    return plan


def _fit_rates(tries: Sequence[Dict[str, Any]], key: Key) -> Dict[int, List[float]]:
    """Tokens/s of every fit of a series, per length (several with ``--repeats``)."""
    rates: Dict[int, List[float]] = {}
    for t in tries:
        if series_key(t) == key and t["status"] == "fit" and t.get("tokens_per_s"):
            rates.setdefault(t["tokens"], []).append(t["tokens_per_s"])
    return rates


def _fit_rate(tries: Sequence[Dict[str, Any]], key: Key) -> Dict[int, float]:
    """The median tokens/s of a series' fits per length."""
    return {n: C.percentile(values, 50) for n, values in _fit_rates(tries, key).items()}


def goals(tries: Sequence[Dict[str, Any]]) -> List[str]:
    """The three goals of issue 21, each where its series ran."""
    summary = {(r["provider"], r["axis"], r["checkpointing"]): r for r in series_summary(tries)}
    lines = []
    hf = summary.get(("hf", "batch", False))
    if hf and hf["max_tokens"]:
        t = hf["max_tokens"]
        r_hf = _fit_rate(tries, ("hf", "batch", False)).get(t)
        r_f = _fit_rate(tries, ("flce", "batch", False)).get(t)
        if r_hf and r_f:
            ratio = r_f / r_hf
            lines.append(
                f"goal 1 (no checkpointing, HF's largest batch {t} tokens): flce {r_f:.0f} / HF {r_hf:.0f} tok/s ="
                f" {ratio:.3f}x, goal >= 1.05: {'yes' if ratio >= 1.05 else 'NO'}"
            )
    hf, fl = summary.get(("hf", "seq", True)), summary.get(("flce", "seq", True))
    if hf and fl and hf["max_tokens"] and fl["max_tokens"]:
        ratio = fl["max_tokens"] / hf["max_tokens"]
        lines.append(
            f"goal 2 (checkpointing, batch 1): flce's longest sequence {fl['max_tokens']} / HF's {hf['max_tokens']}"
            f" = {ratio:.2f}x, goal >= 5: {'yes' if ratio >= 5 else 'NO'}"
            + ("" if fl["first_oom"] else " (flce's search did not reach an OOM: a lower bound)")
        )
    r_f = _fit_rate(tries, ("flce", "seq", True))
    for other in ("hf", "liger"):
        r_o = _fit_rate(tries, (other, "seq", True))
        common = sorted(set(r_f) & set(r_o))
        if common:
            ratios = [r_f[t] / r_o[t] for t in common]
            worst = min(range(len(common)), key=lambda i: ratios[i])
            runs = _fit_rates(tries, ("flce", "seq", True))
            runs_o = _fit_rates(tries, (other, "seq", True))
            fewest = min(min(len(runs[t]), len(runs_o[t])) for t in common)
            lines.append(
                f"goal 3 (checkpointing, batch 1, {len(common)} lengths both fit, {common[0]}..{common[-1]}): flce /"
                f" {other} tok/s >= 1 at {sum(r >= 1 for r in ratios)}/{len(common)}; lowest {ratios[worst]:.3f}x"
                f" at {common[worst]} (medians; at least {fewest} run{'s' if fewest > 1 else ''} per length)"
            )
    return lines


def summary_lines(payload: Dict[str, Any]) -> List[str]:
    tries = payload["tries"]
    rows = []
    for r in series_summary(tries):
        rows.append(
            [
                r["provider"],
                r["axis"],
                "on" if r["checkpointing"] else "off",
                C.fmt(r["max_tokens"]),
                "-" if r["batch"] is None else f"{r['batch']} x {r['seq']}",
                C.fmt(r["tokens_per_s"], ".0f"),
                C.fmt(None if r["peak_mib"] is None else r["peak_mib"] / 1024, ".1f"),
                C.fmt(r["first_oom"]),
                r["tries"],
                r["stopped"] or ("-" if r["first_oom"] else "no OOM"),
            ]
        )
    headers = ["provider", "axis", "ckpt", "max tokens", "batch x seq", "tok/s", "peak GiB", "first OOM", "tries",
               "stopped"]  # fmt: skip
    lines = ["== largest micro-batch that trains (tok/s and peak at it)"] + C.text_table(headers, rows)
    lines += goals(tries)
    for call in payload["meta"].get("calls", [])[-1:]:  # the latest call's: earlier ones were resumed
        for p in call.get("pending", []):
            lines.append(
                f"pending (resume with --resume): {p['series']} next {p['next_tokens']} ({p['phase']})"
            )
    errors = [t for t in tries if t["status"] in ("error", "timeout")]
    for t in errors[:8]:
        lines.append(f"{t['status']} {t['provider']} {t['axis']} ckpt {t['checkpointing']} {t['tokens']}: "
                     f"{(t.get('error') or '')[:200]}")  # fmt: skip
    return lines


def markdown(payload: Dict[str, Any]) -> List[str]:
    env, meta, tries = payload["env"], payload["meta"], payload["tries"]
    cfg = meta["model_config"]
    lines = [
        "# Largest micro-batch per GPU: tokens per micro-batch that train, per LM-head loss",
        "",
        *C.header_lines(env),
        f"- model {meta['model']}: LlamaForCausalLM, random init, "
        + ", ".join(f"{k}={v}" for k, v in cfg.items()),
        f"- precision {meta['precision']}, fused AdamW (adamw_with_warmup_cosine), Lightning Trainer; per try: one"
        f" subprocess, a warm-up step at 1 x {meta['warmup_seq']}"
        + (" and one at the try's size (compiled layers)" if meta.get("compile_layers") else "")
        + f", then up to {meta['steps']} timed steps (tok/s: the median of all but the first where two or more ran;"
        " tries recorded before run88 took every timed step, shown without a count in brackets);"
        f" batch axis at seq {meta['seq_len_batch_axis']}; resolution {meta['resolution']:.4g} x last fit"
        f" (>= {meta['min_resolution_tokens']} tokens); memory limit {meta.get('memory_limit_gib') or 'the device'}",
        "- peak = max_memory_allocated over the timed steps (weights, AdamW states, activations, gradients); at an"
        " OOM the peak before the failed allocation",
        f"- calls: {len(meta.get('calls', []))}, "
        + ", ".join(f"{c['elapsed_s']:.0f}s" for c in meta.get("calls", [])),
        "",
        "```",
        *summary_lines(payload),
        "```",
        "",
        "## Every try",
        "",
    ]
    headers = ["provider", "axis", "ckpt", "tokens", "batch x seq", "status", "peak MiB",
               "fwd / bwd / opt MiB", "tok/s", "timed (in tok/s)", "wall s", "kind", "error / note"]  # fmt: skip
    rows = []
    for t in tries:
        phases = t.get("phase_peak_mib") or {}
        rows.append(
            [
                t["provider"],
                t["axis"],
                "on" if t["checkpointing"] else "off",
                t["tokens"],
                f"{t['batch']} x {t['seq']}",
                t["status"],
                C.fmt(t.get("peak_mib"), ".0f"),
                " / ".join(C.fmt(phases.get(k), ".0f") for k in ("forward", "backward", "optimizer")),
                C.fmt(t.get("tokens_per_s"), ".0f"),
                timed_cell(t),
                C.fmt(t.get("wall_s"), ".0f"),
                t.get("kind", "-"),
                (t.get("error") or t.get("note") or "")[:200],
            ]
        )
    lines += C.md_table(headers, rows)
    snapshots = [t for t in tries if isinstance(t.get("oom_live"), dict) and "by_owner" in t["oom_live"]]
    if snapshots:
        lines += [
            "",
            "## What was live at each recorded OOM (allocator history, grouped by allocating frame)",
            "",
        ]
    for t in snapshots:
        live = t["oom_live"]
        lines += [
            f"{t['provider']} {t['axis']} ckpt {'on' if t['checkpointing'] else 'off'} {t['batch']} x {t['seq']}:"
            f" {live['live_mib']:.0f} MiB live; {(t.get('error') or '')[:140]}",
            "",
            *C.md_table(
                ["allocated at", "MiB", "blocks", "largest MiB"],
                [
                    [g["where"], f"{g['mib']:.0f}", g["count"], f"{g['largest_mib']:.0f}"]
                    for g in live["by_owner"]
                ],
            ),
            "",
        ]
    return lines


def plot_png(payload: Dict[str, Any], path: Path) -> Optional[str]:
    """Peak memory against tokens per micro-batch, one panel per (axis, checkpointing); None or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as exc:  # noqa: BLE001 - no matplotlib: the JSON and markdown still carry everything
        return C.short_error(exc)
    tries = payload["tries"]
    panels = []
    for axis in AXES:
        for ckpt in (False, True):
            if any(t["axis"] == axis and bool(t["checkpointing"]) == ckpt for t in tries):
                panels.append((axis, ckpt))
    if not panels:
        return "no tries"
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axs = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.6 * rows), squeeze=False)
    colors = {"hf": "tab:red", "liger": "tab:blue", "flce": "tab:green"}
    # Liger's and FLCEMixin's peaks often agree to the MiB: Liger's larger squares stay visible under FLCEMixin.
    markers = {"hf": ("o", 4), "liger": ("s", 7), "flce": ("o", 4)}
    cpu = any(t.get("peak_kind") for t in tries)
    seq_len = payload["meta"].get("seq_len_batch_axis")
    for ax, (axis, ckpt) in zip(axs.flat, panels):
        capacity = None
        for provider in PROVIDERS:
            mine = sorted(
                (t for t in tries if series_key(t) == (provider, axis, ckpt)), key=lambda t: t["tokens"]
            )
            if not mine:
                continue
            fits = [t for t in mine if t["status"] == "fit" and t.get("peak_mib") is not None]
            ooms = [t for t in mine if t["status"] == "OOM"]
            capacity = capacity or next((t.get("capacity_mib") for t in mine if t.get("capacity_mib")), None)
            lo, _, _ = search_state(mine)
            color = colors[provider]
            label = f"{provider}: max {lo:,}" if lo else f"{provider}: nothing fits"
            if lo and not ooms:  # a lower bound: the series never ran out
                label = f"{provider}: >= {lo:,} (no OOM tried)"
            if not fits and not ooms:
                label = f"{provider}: {mine[0]['status']}"
            marker, size = markers[provider]
            ax.plot([t["tokens"] for t in fits], [t["peak_mib"] / 1024 for t in fits], marker + "-", color=color,
                    label=label, markersize=size)  # fmt: skip
            if lo:
                best = (
                    next(t for t in fits if t["tokens"] == lo)
                    if any(t["tokens"] == lo for t in fits)
                    else None
                )
                if best is not None and ooms:  # a star only where an OOM above makes it the maximum
                    ax.plot([lo], [best["peak_mib"] / 1024], "*", color=color, markersize=13)
            for t in ooms:
                y = (t.get("capacity_mib") or t.get("peak_mib") or 0) / 1024
                ax.plot([t["tokens"]], [y], "x", color=color, markersize=9, markeredgewidth=2)
        if capacity:
            ax.axhline(
                capacity / 1024,
                color="gray",
                linestyle="--",
                linewidth=1,
                label=f"memory {capacity / 1024:.1f} GiB",
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: _tokens_label(x)))
        what = f"batch at seq {seq_len}" if axis == "batch" else "sequence at batch 1"
        ax.set_title(f"growing {what}, activation checkpointing {'on' if ckpt else 'off'}", fontsize=10)
        ax.set_xlabel("tokens per micro-batch")
        ax.set_ylabel("peak RSS increase, GiB (CPU)" if cpu else "peak memory allocated, GiB")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    for ax in list(axs.flat)[len(panels) :]:
        ax.set_visible(False)
    env = payload["env"]
    compiled = "\nevery decoder layer compiled" if payload["meta"].get("compile_layers") else ""
    fig.suptitle(
        f"largest micro-batch per loss: {payload['meta']['model']} Llama, {payload['meta']['precision']}, fused AdamW,"
        f" {env.get('gpu') or env['device']}{compiled}"
        "\no fit, * largest fit, x out of memory (drawn at the device memory)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _tokens_label(tokens: float) -> str:
    """4096 -> '4K', 2**20 -> '1M', 1536 -> '1.5K'."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if tokens >= size:
            return f"{tokens / size:.3g}{unit}"
    return f"{tokens:.0f}"


def write_outputs(out: Path, stem: str, payload: Dict[str, Any], with_plot: bool = True) -> None:
    payload["summary"] = series_summary(payload["tries"])
    payload["goals"] = goals(payload["tries"])
    C.write_json(out / f"{stem}.json", payload)
    (out / f"{stem}.md").write_text("\n".join(markdown(payload)) + "\n")
    if with_plot:
        why = plot_png(payload, out / f"{stem}.png")
        if why:
            print(f"[max_tokens] no plot: {why}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
