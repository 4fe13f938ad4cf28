"""Where the op's peak memory goes: forward vs backward, and whether autograd kept our gradient buffers.

    python benchmarks/memory_breakdown.py --shape 16384,4096,32000 --dtype bf16

Prints, per setting, MiB above the inputs: peak during forward, held after forward (the saved
gradients), peak during backward, held after backward (x.grad + W.grad), and whether x.grad / W.grad
are the very buffers computed in forward (autograd "steals" them) or copies.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import lightning_flce.op as op
from lightning_flce import fused_linear_cross_entropy

MIB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def breakdown(n_rows, hidden, vocab, dtype, **kwargs):
    device = torch.device("cuda")
    x = torch.randn(n_rows, hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device=device)
    target[::10] = -100
    fused_linear_cross_entropy(x, weight, target, **kwargs).backward()  # warm-up
    x.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    buffers = {}
    chunk_loop = op._chunk_loop

    def spy(*args, **kw):
        out = chunk_loop(*args, **kw)
        buffers["dx"], buffers["dw"] = out[4].data_ptr(), out[5].data_ptr()
        return out

    op._chunk_loop = spy
    try:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fused_linear_cross_entropy(x, weight, target, **kwargs)
        torch.cuda.synchronize()
        fwd_peak = torch.cuda.max_memory_allocated() - base
        after_fwd = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated() - base
        after_bwd = torch.cuda.memory_allocated() - base
    finally:
        op._chunk_loop = chunk_loop
    floor = (n_rows + vocab) * hidden * x.element_size()
    return {
        "shape": f"{n_rows}x{hidden}x{vocab}",
        "dtype": str(dtype),
        "kwargs": {k: str(v) for k, v in kwargs.items()},
        "floor_mib": floor / MIB,
        "fwd_peak_mib": fwd_peak / MIB,
        "after_fwd_mib": after_fwd / MIB,
        "bwd_peak_mib": bwd_peak / MIB,
        "after_bwd_mib": after_bwd / MIB,
        "dx_stolen": x.grad.data_ptr() == buffers["dx"],
        "dw_stolen": weight.grad.data_ptr() == buffers["dw"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="16384,4096,32000")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    args = parser.parse_args()
    n_rows, hidden, vocab = (int(v) for v in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    rows = [
        breakdown(n_rows, hidden, vocab, dtype),
        breakdown(n_rows, hidden, vocab, dtype, accum_dtype=dtype),
        breakdown(n_rows, hidden, vocab, dtype, accum_dtype=dtype, chunk_size=512),
    ]
    for row in rows:
        print(json.dumps(row))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"memory_breakdown_{args.dtype}.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
