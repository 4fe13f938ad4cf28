"""NOTES lead 2: does the fp16 (or bf16) dX GEMM's accuracy depend on its row count through cuBLAS's
reduced-precision split-K reductions?

The op's dX for one chunk is ``G @ W`` with G the [M, V] logit gradient (fp16, scaled as the op scales it) and
K = V long. At 4096x512x32003, 576-row chunks gave 1.34x naive's dX error, 512 and 768 rows <= 1.1x. This
script computes ``G @ W`` for several M with ``torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_precision_reduction``
on (torch's default) and off, and prints the relative L2 error of each against float64.

    python3 benchmarks/experiments/split_k_precision.py --dtype fp16    # writes $OUT/split_k_fp16_512x32003.{json,md}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common and the benchmarks

import _common  # noqa: E402
import torch

# fp16: the op scales the logit gradient to at most 2^10 and takes 2^-6 of it back out in the dX GEMM's epilogue
GRAD_SCALE = {"fp16": (2.0**10, 2.0**-6), "bf16": (1.0, 1.0)}
FLAG = {"fp16": "allow_fp16_reduced_precision_reduction", "bf16": "allow_bf16_reduced_precision_reduction"}


def logit_gradient(
    rows: int, vocab: int, dtype: torch.dtype, scale: float, gen: torch.Generator
) -> torch.Tensor:
    """A softmax-minus-one-hot row block like the op's (random logits of std 2), times ``scale``."""
    logits = torch.randn(rows, vocab, generator=gen, device="cuda") * 2.0
    grad = logits.softmax(-1)
    target = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    grad[torch.arange(rows, device="cuda"), target] -= 1.0
    return (grad * scale).to(dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32003)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", default="256,512,576,640,768,1024,2048,4096")
    parser.add_argument("--dtype", choices=sorted(FLAG), default="fp16")
    args = parser.parse_args()
    dtype, (scale, alpha), flag_name = _common.DTYPES[args.dtype], GRAD_SCALE[args.dtype], FLAG[args.dtype]
    matmul = torch.backends.cuda.matmul
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device="cuda") * args.hidden**-0.5).to(
        dtype
    )
    flag = getattr(matmul, flag_name)
    records = []
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            grad = logit_gradient(rows, args.vocab, dtype, scale, gen)
            exact = grad.double() @ weight.double()
            errors = {}
            for allowed in (True, False):
                setattr(matmul, flag_name, allowed)
                # as the op's dX: alpha (fp16: the gradient scale taken back out) in the GEMM's epilogue
                out = torch.empty(rows, args.hidden, dtype=dtype, device="cuda")
                product = torch.addmm(out, grad, weight, beta=0, alpha=alpha)
                errors[allowed] = _common.rel_l2(product, exact, ref_scale=alpha)
            records.append({"rows": rows, "reduced_on": errors[True], "reduced_off": errors[False]})
            print(
                f"rows {rows:5d}: rel. L2 error {errors[True]:.3e} (reduced-precision on), {errors[False]:.3e} (off)"
            )
    finally:
        setattr(matmul, flag_name, flag)
    out = _common.out_dir()
    name = f"split_k_{args.dtype}_{args.hidden}x{args.vocab}"
    env = _common.environment(torch.device("cuda"))
    _common.write_json(out / f"{name}.json", {"env": env, "args": vars(args), "records": records})
    title = f"{args.dtype} `G @ W`, K = V = {args.vocab}, N = H = {args.hidden}; `{flag_name}` on / off"
    lines = [*_common.header_lines(env), "", title, ""]
    lines += _common.md_table(
        ["rows", "error, reduced-precision on", "error, off"],
        [[r["rows"], _common.fmt(r["reduced_on"]), _common.fmt(r["reduced_off"])] for r in records],
    )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
