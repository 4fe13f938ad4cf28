"""Issue 37: the distillation kernel's launches as the op runs them (one teacher block of 256 rows, the default
launch), for Nsight Compute: ``ncu -k regex:_distill_kernel ... python3 ncu_distill_kernel.py``.

Runs ``--calls`` calls of ``distill_chunk`` per vocabulary (the first one compiles); with ``--sass DIR`` it
writes the SASS of every compiled ``_distill_kernel`` found in Triton's cache (``cuobjdump --dump-sass``)
so that the instructions of each step's loop can be counted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402
import torch

_common.ensure_repo_on_path()
from lightning_flce.kernels.distill import distill_chunk  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[128256, 256000])
    parser.add_argument("--divergence", default="jsd")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument(
        "--teacher-scratch",
        action="store_true",
        help="let JSD keep log p - log M in the teacher row (the op's way)",
    )
    parser.add_argument("--sass", default=None, help="write the compiled kernels' SASS into this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    one = torch.ones(1, device=device)
    for vocab in args.vocabs:
        student = torch.randn(args.rows, vocab, device=device, generator=gen) * 3
        teacher = (student + torch.randn(args.rows, vocab, device=device, generator=gen) * 2).bfloat16()
        student = student.bfloat16()
        for _ in range(args.calls):
            distill_chunk(
                student.clone(),
                teacher.clone() if args.teacher_scratch else teacher,
                None,
                divergence=args.divergence,
                beta=0.5,
                student_inv_temperature=one,
                teacher_inv_temperature=one,
                ce_inv_temperature=one,
                student_softcap=0.0,
                teacher_softcap=0.0,
                hard_weight=0.0,
                token_scale=one,
                compute_grad=True,
                teacher_scratch=args.teacher_scratch,
            )
        torch.cuda.synchronize()
    if args.sass:
        cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
        with open(args.sass, "w") as out:
            for cubin in sorted(cache.rglob("_distill_kernel*.cubin")):
                out.write(f"==== {cubin}\n")
                out.write(
                    subprocess.run(
                        ["cuobjdump", "--dump-sass", str(cubin)], capture_output=True, text=True
                    ).stdout
                )


if __name__ == "__main__":
    main()
