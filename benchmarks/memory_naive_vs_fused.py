"""FLCEMemoryCallback's saving figure against a real naive run: configs/cuda_bf16.yaml, fused and naive.

    python benchmarks/memory_naive_vs_fused.py --steps 30                      # bf16-mixed and 32-true
    python benchmarks/memory_naive_vs_fused.py --steps 30 --precisions bf16-mixed,32-true,16-mixed

For each precision the config is trained twice through ``lightning_flce.cli.main`` (``lightning-flce fit``),
each in its own process so that neither inherits the other's allocations: once with the fused head and once
with ``--model.init_args.flce_naive true``. The peak of a run is the highest ``memory/peak_allocated_mib`` of
its ``metrics.csv`` (``torch.cuda.max_memory_allocated`` per logged window, from the start of training); the
callback's figure is the fused run's ``memory/saved_by_fused_head_mib``. ``ratio`` = figure / (naive peak -
fused peak): the figure holds when it is within 10% of 1.

Files under $OUT (default ./bench_out): memory_naive_vs_fused.json (per precision: both peaks, the measured
and the estimated saving, the ratio, the callback's head figures and peak breakdown), memory_naive_vs_fused.md,
<precision>_<fused|naive>_memory.png (the callback's plot), <precision>_<fused|naive>.log (the run's output, the
callback's end-of-fit summary at its end). Extra arguments after ``--`` go to every ``lightning-flce fit``; a
plumbing check without a GPU (tiny, slow on CPU):

    python benchmarks/memory_naive_vs_fused.py --steps 4 --precisions 32-true -- --trainer.accelerator cpu \\
        --model.init_args.d_model 64 --model.init_args.n_layers 1 --data.init_args.batch_size 2 \\
        --data.init_args.max_chars 300000 --data.init_args.vocab_size 2048
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

_common.ensure_repo_on_path()

NAME = "memory_naive_vs_fused"
CALLBACK_KEYS = ("memory/saved_by_fused_head_mib", "memory/unfused_head_mib", "memory/logits_avoided_mib")


def _cli_args(
    config: str, precision: str, naive: bool, steps: int, run_dir: Path, extra: list[str]
) -> list[str]:
    # validation twice (halfway and at the end) so that the plot shows where it ran
    val_every = max(steps // 2, 1)
    return [
        "fit",
        "--config", config,
        "--trainer.max_steps", str(steps),
        "--trainer.precision", precision,
        "--trainer.val_check_interval", str(val_every),
        "--trainer.limit_val_batches", "10",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.logger.init_args.save_dir", str(run_dir),
        "--model.init_args.flce_naive", "true" if naive else "false",
        "--data.init_args.cache_dir", os.path.join(tempfile.gettempdir(), "lightning_flce_cache"),
        *extra,
    ]  # fmt: skip


def _child(args: argparse.Namespace, extra: list[str]) -> None:
    from lightning_flce.cli import main

    main(_cli_args(args.config, args.precision, args.naive, args.steps, Path(args.run_dir), extra))


def _read_run(run_dir: Path) -> dict:
    (metrics_path,) = glob.glob(str(run_dir / "**" / "metrics.csv"), recursive=True)
    with open(metrics_path) as file:
        rows = list(csv.DictReader(file))
    peaks = [float(row["memory/peak_allocated_mib"]) for row in rows if row.get("memory/peak_allocated_mib")]
    if not peaks:  # a CPU plumbing run
        peaks = [float(row["memory/peak_rss_mib"]) for row in rows if row.get("memory/peak_rss_mib")]
    result = {"peak_mib": max(peaks), "logged_steps": len(peaks), "metrics_csv": metrics_path}
    for key in CALLBACK_KEYS:
        values = [float(row[key]) for row in rows if row.get(key)]
        result[key] = values[-1] if values else None
    breakdown = {
        key: float(value) for row in rows for key, value in row.items() if "peak_breakdown" in key and value
    }
    result["peak_breakdown_mib"] = breakdown
    val = [float(row["val/loss"]) for row in rows if row.get("val/loss")]
    result["val_loss"] = val[-1] if val else None
    plots = glob.glob(str(run_dir / "**" / "memory.png"), recursive=True)
    result["plot"] = plots[0] if plots else None
    return result


def _run(args: argparse.Namespace, extra: list[str], precision: str, naive: bool, out: Path) -> dict:
    tag = f"{precision}_{'naive' if naive else 'fused'}"
    run_dir = Path(tempfile.mkdtemp(prefix=f"{tag}_"))
    command = [
        sys.executable, __file__, "--child", "--config", args.config, "--steps", str(args.steps),
        "--precision", precision, "--run-dir", str(run_dir), *(["--naive"] if naive else []), "--", *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    with open(out / f"{tag}.log", "w") as log:
        completed = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
        )
    seconds = time.perf_counter() - start
    if completed.returncode != 0:
        tail = (out / f"{tag}.log").read_text()[-3000:]
        return {"error": f"exit code {completed.returncode}", "seconds": seconds, "log_tail": tail}
    result = _read_run(run_dir)
    result["seconds"] = round(seconds, 1)
    if result["plot"]:
        shutil.copy(result["plot"], out / f"{tag}_memory.png")
        result["plot"] = f"{tag}_memory.png"
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=str(_common.REPO_ROOT / "lightning_flce" / "configs" / "cuda_bf16.yaml")
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precisions", default="bf16-mixed,32-true")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args, extra)
        return

    import torch

    out = _common.out_dir()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    payload = {"env": _common.environment(device), "config": args.config, "steps": args.steps, "extra": extra}
    payload["results"] = results = {}
    rows = []
    for precision in args.precisions.split(","):
        runs = {mode: _run(args, extra, precision, mode == "naive", out) for mode in ("fused", "naive")}
        entry = results[precision] = dict(runs)
        fused, naive = runs["fused"], runs["naive"]
        if "error" in fused or "error" in naive:
            rows.append([precision, "ERR", "ERR", "-", "-", "-"])
            _common.write_json(out / f"{NAME}.json", payload)
            continue
        measured = naive["peak_mib"] - fused["peak_mib"]
        figure = fused["memory/saved_by_fused_head_mib"]
        entry["measured_saving_mib"] = measured
        entry["callback_saving_mib"] = figure
        entry["ratio"] = figure / measured if measured and figure is not None else None
        entry["within_10_percent"] = entry["ratio"] is not None and abs(entry["ratio"] - 1) <= 0.10
        rows.append(
            [precision, _common.fmt(fused["peak_mib"], ".0f"), _common.fmt(naive["peak_mib"], ".0f"),
             _common.fmt(measured, ".0f"), _common.fmt(figure, ".0f"), _common.fmt(entry["ratio"], ".3f")]
        )  # fmt: skip
        _common.write_json(out / f"{NAME}.json", payload)
    headers = [
        "precision",
        "fused peak MiB",
        "naive peak MiB",
        "measured saving",
        "callback's figure",
        "ratio",
    ]
    lines = [f"# {NAME}", "", *_common.header_lines(payload["env"]), "", *_common.md_table(headers, rows)]
    (out / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    _common.write_json(out / f"{NAME}.json", payload)
    print("\n".join(_common.text_table(headers, rows)))


if __name__ == "__main__":
    main()
