"""Issue 37: how much does a bf16 dW accumulator (``accum_dtype=torch.bfloat16``) cost the distillation loss's dW,
against the default fp32 accumulator and the unfused bf16 loss? On the CPU (the PyTorch twin; its bf16 ``addmm_``
rounds each chunk's running sum once, as cuBLAS's ``beta=1`` GEMM does), against float64.

For each seed and chunk count it prints dX's and dW's relative L2 error against float64, divided by the unfused
bf16 loss's (both heads' logits from bf16 GEMMs, the softmaxes in float64): the default's dW ratio stays about 1,
the bf16 accumulator's grows with the number of roundings of the running sum.

    python3 benchmarks/experiments/distill_accum_error.py [--tokens 64] [--vocab 300] [--seeds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402

_common.ensure_repo_on_path()
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the float64 reference of the tests

from reference import relative_error  # noqa: E402
from test_distill import grads, make_problem, reference_loss, resolve  # noqa: E402

from lightning_flce import fused_linear_distillation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--chunks", default="2,4,8,16", help="chunk counts, comma-separated")
    parser.add_argument(
        "--divergence", default="jsd_0.5", help="a key of tests/test_distill.py's DIVERGENCES"
    )
    args = parser.parse_args()
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    print("seed  chunks  accum_dtype  dX/unfused  dW/unfused")
    for seed in range(args.seeds):
        student, teacher, target, extras = make_problem(
            shape=(args.tokens,), dtype=torch.bfloat16, hs=64, ht=48, v=args.vocab, seed=seed
        )
        call, kwargs = resolve(student, teacher, target, extras, "all", args.divergence)
        tensors = (student[0], student[1])
        exact = grads(reference_loss(*call, **kwargs), tensors)
        logits = dict(
            student_logits=F.linear(student[0], student[1], student[2]),
            teacher_logits=F.linear(teacher[0], teacher[1], teacher[2]),
        )
        unfused = grads(reference_loss(*call, **kwargs, **logits), tensors)
        plain = [relative_error(g, r) for g, r in zip(unfused, exact)]
        for chunks in chunk_counts:
            for accum_dtype in (None, torch.bfloat16):
                loss = fused_linear_distillation(
                    *call,
                    chunk_size=-(-args.tokens // chunks),
                    accum_dtype=accum_dtype,
                    impl="torch",
                    **kwargs,
                )
                ratios = [relative_error(g, r) / p for g, r, p in zip(grads(loss, tensors), exact, plain)]
                name = "fp32 (None)" if accum_dtype is None else "bfloat16"
                print(f"{seed:4d}  {chunks:6d}  {name:11s}  {ratios[0]:10.2f}  {ratios[1]:10.2f}")


if __name__ == "__main__":
    main()
