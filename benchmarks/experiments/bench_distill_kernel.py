"""Issue 37: how fast are the distillation kernel's row passes, and at which launch configuration?

The two numbers first. Each pass streams rows, so the floor is bytes over the copy bandwidth (measured here,
``_common.copy_bandwidth_gbps``): pass 1 reads the student and the teacher row, JSD's pass 2 reads both again,
the gradient pass reads both and writes the gradient. 16-bit logits: 4 + (4) + 6 bytes an element; fp32
student logits with a bf16 teacher and the bf16 gradient in the rows' second halves: 6 + (6) + 8. The
arithmetic: 1-3 exponentials (and a log for JSD) an element a pass, plus the softcap's tanh, against the
H200's ~4e12 special-function results a second: the JSD passes with softcaps on both sides may be
compute-bound.

Per shape (one chunk: ``--rows`` rows of V columns) and divergence, this times ``distill_chunk`` (CUDA events,
warm-up, median over interleaved rounds; the student logits restored before each call, outside the timed
region) at the default launch and at each ``--configs`` entry, and reports the time, the bytes moved at the
reached GB/s and its fraction of the copy's. With ``--check`` it also compares the default launch's rows and
gradient on the first rows with the float64 reference of ``tests/test_distill_kernel.py``.

    python3 benchmarks/experiments/bench_distill_kernel.py                     # writes $OUT/bench_distill_kernel.json
    python3 benchmarks/experiments/bench_distill_kernel.py --configs 4096x8 8192x16 16384x32 --check
    python3 benchmarks/experiments/bench_distill_kernel.py --rows 256 --configs 8192x16 4096x8 4096x8@8 2048x4@8

A config ``BLOCKxWARPS[xSTAGES][@P]`` with ``@P`` is the split launch (``kernels/distill.py``): each row cut into
slices of whole blocks until the ``--rows`` rows make P programs per SM (the op launches the kernel on the
teacher's 256-row blocks: ``--rows 256`` times it as the op runs it).
    TRITON_INTERPRET=1 python3 benchmarks/experiments/bench_distill_kernel.py --device cpu --small  # plumbing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402
import torch

_common.ensure_repo_on_path()
from lightning_flce.kernels import gradient_in_logits_rows  # noqa: E402
from lightning_flce.kernels.distill import (  # noqa: E402
    DistillLaunchConfig,
    default_distill_launch_config,
    distill_chunk,
)

VOCABS = [32000, 128256, 151936, 256000]
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
# (student dtype, teacher dtype, gradient): the default's bf16 rows in place; the wide-logits path
LOGITS = {
    "bf16": (torch.bfloat16, torch.bfloat16, "in_place"),
    "fp32": (torch.float32, torch.bfloat16, "in_rows"),
}


def parse_config(spec: str, vocab: int, rows: int, device: torch.device) -> DistillLaunchConfig:
    """``BLOCKxWARPS[xSTAGES][@P]`` as a launch for ``rows`` rows of ``vocab`` columns (``@P``: split for P
    programs per SM)."""
    launch, _, per_sm = spec.partition("@")
    values = [int(value) for value in launch.split("x")]
    splits = 1
    if per_sm:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        programs = int(per_sm) * sms
        splits = default_distill_launch_config(vocab, values[0], rows=rows, programs=programs).row_splits
    return DistillLaunchConfig(values[0], values[1], values[2] if len(values) > 2 else None, splits)


def launch_label(launch) -> str:
    """``BLOCKxWARPS[xSTAGES]``, and `` / N slices`` for a split launch."""
    label = "x".join(str(value) for value in tuple(launch)[:3] if value is not None)
    splits = getattr(launch, "row_splits", 1)
    return label + (f" / {splits} slices" if splits > 1 else "")


def bytes_moved(n_elements: int, student_bytes: int, teacher_bytes: int, grad_bytes: int, jsd: bool) -> int:
    reads = student_bytes + teacher_bytes
    return n_elements * (reads * (3 if jsd else 2) + grad_bytes)


def make_inputs(rows, vocab, logits_name, device, gen):
    student_dtype, teacher_dtype, _ = LOGITS[logits_name]
    student = torch.randn(rows, vocab, device=device, generator=gen) * 3
    teacher = (student + torch.randn(rows, vocab, device=device, generator=gen) * 2).to(teacher_dtype)
    student = student.to(student_dtype)
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)

    def per_row():
        return torch.rand(rows, device=device, generator=gen) + 0.5

    inv_t = per_row()
    options = {
        "student_inv_temperature": inv_t,
        "teacher_inv_temperature": per_row(),
        "ce_inv_temperature": inv_t,  # a CE on the student's scale: the kernel reuses its LSE
        "token_scale": per_row(),
    }
    return student, teacher, target, options


def call(student_src, work, teacher, target, logits_name, options, config):
    """A setup for ``interleaved_medians``: restore the student rows, then return the timed call."""

    def setup():
        work.copy_(student_src)
        grad_out = (
            gradient_in_logits_rows(work, torch.bfloat16) if LOGITS[logits_name][2] == "in_rows" else None
        )
        return lambda: distill_chunk(
            work, teacher, target, compute_grad=True, grad_out=grad_out, config=config, **options
        )

    return setup


def check(student, teacher, target, logits_name, options, rows):
    """Relative errors of the default launch on the first ``rows`` rows against the float64 reference."""
    sys.path.insert(0, str(_common.REPO_ROOT / "tests"))
    from test_distill_kernel import reference_distill

    student, teacher, target = student[:rows], teacher[:rows], target[:rows]
    options = {
        key: value[:rows] if isinstance(value, torch.Tensor) and value.numel() > 1 else value
        for key, value in options.items()
    }
    work = student.clone()
    grad_out = gradient_in_logits_rows(work, torch.bfloat16) if LOGITS[logits_name][2] == "in_rows" else None
    got = distill_chunk(work, teacher, target, compute_grad=True, grad_out=grad_out, **options)
    want = reference_distill(student, teacher, target, **options)
    grad = work if grad_out is None else grad_out
    names = ("loss", "divergence", "ce")
    errors = {name: _common.rel_l2(g.double(), w) for name, g, w in zip(names, got, want) if w is not None}
    errors["grad"] = _common.rel_l2(grad.double(), want[3])
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocabs", type=int, nargs="+", default=VOCABS)
    parser.add_argument("--divergences", nargs="+", default=DIVERGENCES)
    parser.add_argument("--logits", nargs="+", default=list(LOGITS), choices=list(LOGITS))
    parser.add_argument("--hard-weight", type=float, default=0.0)
    parser.add_argument("--softcaps", type=float, nargs=2, default=(0.0, 0.0), metavar=("STUDENT", "TEACHER"))
    parser.add_argument(
        "--configs", nargs="*", default=[], help="BLOCKxWARPS[xSTAGES][@P] launch configs to time"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="errors against float64 on the first rows")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes (the interpreter's plumbing run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.small:
        args.rows, args.vocabs, args.rounds, args.reps = 4, [300], 1, 1
        args.configs = args.configs or ["64x4", "64x4@64"]
    env = _common.environment(device)
    copy_gbps = _common.copy_bandwidth_gbps(device) if device.type == "cuda" else float("nan")
    records, table = [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab in args.vocabs:
        configs = [None] + [parse_config(spec, vocab, args.rows, device) for spec in args.configs]
        for logits_name in args.logits:
            student, teacher, target, per_row = make_inputs(args.rows, vocab, logits_name, device, gen)
            work = torch.empty_like(student)
            student_dtype, teacher_dtype, grad_mode = LOGITS[logits_name]
            grad_bytes = 2 if grad_mode == "in_rows" else student.element_size()
            for divergence in args.divergences:
                options = {
                    "divergence": divergence,
                    "beta": 0.5,
                    "hard_weight": args.hard_weight,
                    "student_softcap": args.softcaps[0],
                    "teacher_softcap": args.softcaps[1],
                    **per_row,
                }
                setups = {
                    config: call(student, work, teacher, target, logits_name, options, config)
                    for config in configs
                }
                medians = _common.interleaved_medians(setups, device, args.rounds, args.reps)
                moved = bytes_moved(
                    student.numel(),
                    student.element_size(),
                    teacher.element_size(),
                    grad_bytes,
                    divergence == "jsd",
                )
                errors = None
                if args.check:
                    errors = check(student, teacher, target, logits_name, options, min(args.rows, 64))
                for config, ms in medians.items():
                    launch = config or default_distill_launch_config(vocab)
                    gbps = moved / (ms * 1e-3) / 1e9
                    record = {
                        "rows": args.rows,
                        "vocab": vocab,
                        "logits": logits_name,
                        "divergence": divergence,
                        "hard_weight": args.hard_weight,
                        "softcaps": list(args.softcaps),
                        "config": list(launch),
                        "default": config is None,
                        "ms": ms,
                        "bytes": moved,
                        "gbps": gbps,
                        "of_copy": gbps / copy_gbps,
                        "errors": errors if config is None else None,
                    }
                    records.append(record)
                    label = ("default " if config is None else "") + launch_label(launch)
                    err = "" if record["errors"] is None else _common.fmt(max(errors.values()))
                    table.append(
                        [vocab, logits_name, divergence, label, _common.fmt(ms), _common.fmt(gbps, ".4g"),
                         _common.fmt(gbps / copy_gbps, ".2f"), err]
                    )  # fmt: skip
            del student, teacher, work
            _common.free_memory(device)
    _common.write_json(
        _common.out_dir() / "bench_distill_kernel.json",
        {"environment": env, "copy_gbps": copy_gbps, "args": vars(args), "records": records},
    )
    print(*_common.header_lines(env), sep="\n")
    print(f"rows {args.rows}; copy {copy_gbps:.4g} GB/s (read + write)")
    headers = ["V", "logits", "divergence", "launch", "ms", "GB/s", "of copy", "max rel err"]
    print(*_common.text_table(headers, table), sep="\n")


if __name__ == "__main__":
    main()
