"""NOTES lead 2: does the fp16 dX GEMM's accuracy depend on its row count through cuBLAS's reduced-precision
split-K reductions?

The op's dX for one chunk is ``G @ W`` with G the [M, V] logit gradient (fp16, scaled as the op scales it) and
K = V long. At 4096x512x32003, 576-row chunks gave 1.34x naive's dX error, 512 and 768 rows <= 1.1x. This
script computes ``G @ W`` for several M with ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction``
on (torch's default) and off, and prints the relative L2 error of each against float64.

    python3 benchmarks/fp16_split_k.py            # writes $OUT/fp16_split_k.{json,md}
"""

from __future__ import annotations

import argparse

import _common
import torch


def logit_gradient(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A softmax-minus-one-hot row block like the op's (random logits of std 2), scaled to max 2^10 as the op's
    fp16 path scales it."""
    logits = torch.randn(rows, vocab, generator=gen, device="cuda") * 2.0
    grad = logits.softmax(-1)
    target = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    grad[torch.arange(rows, device="cuda"), target] -= 1.0
    return (grad * 2.0**10).half()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32003)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", default="256,512,576,640,768,1024,2048,4096")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device="cuda") * args.hidden**-0.5).half()
    flag = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    records = []
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            grad = logit_gradient(rows, args.vocab, gen)
            exact = grad.double() @ weight.double()
            errors = {}
            for allowed in (True, False):
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = allowed
                # as the op's dX: alpha (the fp16 gradient scale taken back out) in the GEMM's epilogue
                out = torch.empty(rows, args.hidden, dtype=torch.float16, device="cuda")
                product = torch.addmm(out, grad, weight, beta=0, alpha=2.0**-6)
                errors[allowed] = _common.rel_l2(product, exact, ref_scale=2.0**-6)
            records.append({"rows": rows, "reduced_on": errors[True], "reduced_off": errors[False]})
            print(
                f"rows {rows:5d}: rel. L2 error {errors[True]:.3e} (reduced-precision on), {errors[False]:.3e} (off)"
            )
    finally:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = flag
    out = _common.out_dir()
    env = _common.environment(torch.device("cuda"))
    _common.write_json(out / "fp16_split_k.json", {"env": env, "args": vars(args), "records": records})
    lines = [*_common.header_lines(env), "", f"fp16 `G @ W`, K = V = {args.vocab}, N = H = {args.hidden}", ""]
    lines += _common.md_table(
        ["rows", "error, reduced-precision on", "error, off"],
        [[r["rows"], _common.fmt(r["reduced_on"]), _common.fmt(r["reduced_off"])] for r in records],
    )
    (out / "fp16_split_k.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
