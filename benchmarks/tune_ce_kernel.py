"""Launch-parameter sweep of the cross-entropy chunk kernel (``lightning_flce/kernels/cross_entropy.py``).

The kernel reads each row of a [C, V] chunk twice and writes it once; its floor is one read + one write
(2 C V itemsize bytes) at the bandwidth of a 1 GiB device-to-device copy, measured in the same run. For
every chunk shape and launch config (``LaunchConfig``: elements per loop iteration, warps, pipeline
stages): a correctness check against the PyTorch twin (loss and LSE within 1e-5 relative, the gradient
within 1e-2 relative L2 of the twin's, which rounds to the same dtype), then the median of ``--reps``
launches timed with CUDA events, each on a freshly restored chunk (the kernel works in place; restoring
happens outside the timed region, so every launch sees the same random logits, never its own output).

The default chunk shapes are those of the op's default chunk rule at the four shapes of ``bench_flce.py``
(about 10% of the rows ignored): 3840 x 32000, 3840 x 128256, 2048 x 256000, 2560 x 151936.

GPU:            python3 benchmarks/tune_ce_kernel.py [--shapes 2048x256000] [--dtype bf16]
CPU smoke test: TRITON_INTERPRET=1 python benchmarks/tune_ce_kernel.py --device cpu
Writes ``$OUT/ce_kernel.json`` and ``$OUT/ce_kernel.md`` ($OUT defaults to ./bench_out).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _common as C
import torch

C.ensure_repo_on_path()

from lightning_flce.kernels import LossOptions  # noqa: E402
from lightning_flce.kernels.cross_entropy import (  # noqa: E402
    LaunchConfig,
    cross_entropy_chunk_triton,
    default_launch_config,
)
from lightning_flce.kernels.cross_entropy_torch import cross_entropy_chunk_torch  # noqa: E402

GPU_SHAPES = [(3840, 32000), (3840, 128256), (2048, 256000), (2560, 151936)]
CPU_SHAPES = [(16, 1000)]


def candidate_configs(quick: bool) -> List[LaunchConfig]:
    """The current default first, then elements per iteration x warps, then pipeline depths."""
    if quick:
        return [LaunchConfig(1024, 4), LaunchConfig(512, 4)]
    configs = [LaunchConfig(b, w) for b in (4096, 8192, 16384) for w in (8, 16, 32)]
    configs += [LaunchConfig(8192, 32, 1), LaunchConfig(8192, 32, 4), LaunchConfig(8192, 16, 4)]
    return configs


def make_chunk(rows: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(rows, vocab, device=device, generator=gen) * 2).to(dtype)
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    target[torch.rand(rows, device=device, generator=gen) < 0.1] = -100
    return logits, target


def run_shape(
    shape: Tuple[int, int],
    dtype: torch.dtype,
    configs: Sequence[LaunchConfig],
    device: torch.device,
    reps: int,
    gbps: Optional[float],
) -> List[Dict[str, Any]]:
    rows, vocab = shape
    original, target = make_chunk(rows, vocab, dtype, device, seed=rows + vocab)
    scale = torch.full((1,), 1.0 / rows, device=device)
    kwargs = {"ce_scale": scale, "z_scale": scale, "compute_grad": True, "compute_stats": False}
    options = LossOptions()
    want_grad = original.clone()
    want = cross_entropy_chunk_torch(want_grad, target, options, **kwargs)
    floor_ms = 2 * rows * vocab * original.element_size() / (gbps * 1e9) * 1e3 if gbps else None
    work = torch.empty_like(original)
    records = []
    for config in configs:
        rec: Dict[str, Any] = {
            "shape": f"{rows}x{vocab}",
            "dtype": str(dtype).replace("torch.", ""),
            "config": config._asdict(),
            "default": config == default_launch_config(vocab),
            "floor_ms": floor_ms,
        }
        try:
            work.copy_(original)
            got = cross_entropy_chunk_triton(work, target, options, config=config, **kwargs)
            rec["loss_err"] = C.rel_l2(got.loss, want.loss)
            rec["lse_err"] = C.rel_l2(got.lse, want.lse)
            rec["grad_err"] = C.rel_l2(work, want_grad)
            rec["ok"] = rec["loss_err"] < 1e-5 and rec["lse_err"] < 1e-5 and rec["grad_err"] < 1e-2
            timers = []
            for i in range(reps + 2):
                work.copy_(original)
                tm = C.Timer(device)
                tm.start()
                cross_entropy_chunk_triton(work, target, options, config=config, **kwargs)
                tm.stop()
                if i >= 2:  # two warm-up launches
                    timers.append(tm)
            C.synchronize(device)
            rec["ms"] = C.percentile([t.ms() for t in timers], 50)
            rec["p20_ms"] = C.percentile([t.ms() for t in timers], 20)
            rec["p80_ms"] = C.percentile([t.ms() for t in timers], 80)
            rec["pct_floor"] = 100 * floor_ms / rec["ms"] if floor_ms else None
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects: record, go on
            rec["error"] = C.short_error(exc)
        records.append(rec)
        status = "ERR" if "error" in rec else f"{rec['ms']:.3f} ms" + ("" if rec["ok"] else " WRONG")
        print(f"[tune_ce_kernel] {rec['shape']} {tuple(config)}: {status}", flush=True)
    return records


def config_label(config: Dict[str, Any]) -> str:
    stages = config["num_stages"]
    return f"{config['block_v']}/{config['num_warps']}w" + ("" if stages is None else f"/{stages}s")


def markdown(records: List[Dict[str, Any]], env: Dict[str, Any], meta: Dict[str, Any]) -> List[str]:
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    labels = list(dict.fromkeys(config_label(r["config"]) for r in records))
    cell = {(r["shape"], config_label(r["config"])): r for r in records}
    lines = [
        "# Cross-entropy chunk kernel: launch-parameter sweep",
        "",
        *C.header_lines(env),
        f"- dtype {meta['dtype']}; copy bandwidth (1 GiB D2D, read+write): {C.fmt(meta['copy_gbps'], '.0f')} GB/s; "
        f"median of {meta['reps']} launches per cell; floor = one read + one write of the chunk",
        "",
        "ms (% of floor); * = the current default; WRONG = failed the check against the PyTorch twin",
        "",
    ]
    rows = []
    for label in labels:
        row = [label]
        for shape in shapes:
            r = cell.get((shape, label))
            if r is None:
                row.append("-")
            elif "error" in r:
                row.append("ERR")
            else:
                text = f"{r['ms']:.3f}" + (f" ({r['pct_floor']:.0f}%)" if r.get("pct_floor") else "")
                row.append(text + ("*" if r["default"] else "") + ("" if r["ok"] else " WRONG"))
        rows.append(row)
    lines += C.md_table(["block_v/warps/stages", *shapes], rows)
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default=None, help="comma list of CxV (rows x vocabulary)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = C.dtype_from_name(args.dtype)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    configs = candidate_configs(quick=device.type != "cuda")
    start = time.time()
    gbps = C.copy_bandwidth_gbps(device) if device.type == "cuda" else None
    records = []
    for shape in shapes:
        records += run_shape(shape, dtype, configs, device, args.reps, gbps)
        C.free_memory(device)
    env = C.environment(device)
    meta = {"dtype": args.dtype, "copy_gbps": gbps, "reps": args.reps, "elapsed_s": time.time() - start}
    out = C.out_dir()
    C.write_json(out / "ce_kernel.json", {"env": env, "meta": meta, "records": records})
    lines = markdown(records, env, meta)
    (out / "ce_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(configs) + 2) :]))
    print(f"[tune_ce_kernel] {len(records)} cells in {meta['elapsed_s']:.0f}s -> {out}/ce_kernel.{{json,md}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
