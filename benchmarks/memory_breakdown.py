"""Where the op's peak memory goes: forward vs backward, and whether autograd kept our gradient buffers.

    python benchmarks/memory_breakdown.py --shape 16384,4096,32000 --dtype bf16
    python benchmarks/memory_breakdown.py --shape 16384,2048,128256 --dtype bf16 --autocast  # the e2e head

Prints, per setting, MiB above the inputs: peak during forward, held after forward (the saved
gradients), peak during backward, held after backward (x.grad + W.grad), and whether x.grad / W.grad
are the very buffers computed in forward (autograd "steals" them) or copies. ``--autocast``: fp32 hidden
states and weight under ``torch.autocast(dtype)``, as a model's head under Lightning's "bf16-mixed" sees
them; Liger-Kernel's fused loss (when installed) gets a row at the same inputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

import lightning_flce.op as op
from lightning_flce import fused_linear_cross_entropy

MIB = 2**20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_inputs(n_rows, hidden, vocab, dtype):
    device = torch.device("cuda")
    x = torch.randn(n_rows, hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n_rows,), device=device)
    target[::10] = -100
    return x, weight, target


def peaks(loss_fn, x, weight, autocast_dtype):
    """MiB above the inputs: (forward peak, held after forward, backward peak, held after backward).
    Autocast without its cast cache, as Lightning's MixedPrecision runs it (the cache would hold a bf16 copy
    of the weight for every provider that lets autocast cast it)."""
    autocast = functools.partial(
        torch.autocast, "cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None, cache_enabled=False
    )
    with autocast():
        loss_fn().backward()  # warm-up
    x.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with autocast():
        loss = loss_fn()
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    after_fwd = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    after_bwd = torch.cuda.memory_allocated() - base
    return fwd_peak / MIB, after_fwd / MIB, bwd_peak / MIB, after_bwd / MIB


def breakdown(n_rows, hidden, vocab, dtype, autocast_dtype=None, **kwargs):
    x, weight, target = make_inputs(n_rows, hidden, vocab, dtype)

    buffers = {}
    chunk_loop = op._chunk_loop

    def spy(*args, **kw):
        out = chunk_loop(*args, **kw)
        buffers["dx"], buffers["dw"] = out[4].data_ptr(), out[5].data_ptr()
        return out

    op._chunk_loop = spy
    try:
        measured = peaks(
            lambda: fused_linear_cross_entropy(x, weight, target, **kwargs), x, weight, autocast_dtype
        )
    finally:
        op._chunk_loop = chunk_loop
    return {
        **_record("flce", x, weight, autocast_dtype, kwargs, measured),
        "dx_stolen": x.grad.data_ptr() == buffers["dx"],
        "dw_stolen": weight.grad.data_ptr() == buffers["dw"],
    }


def liger_breakdown(n_rows, hidden, vocab, dtype, autocast_dtype=None):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    x, weight, target = make_inputs(n_rows, hidden, vocab, dtype)

    def loss_fn():
        return LigerFusedLinearCrossEntropyFunction.apply(x, weight, target)[0]

    return _record("liger", x, weight, autocast_dtype, {}, peaks(loss_fn, x, weight, autocast_dtype))


def _record(provider, x, weight, autocast_dtype, kwargs, measured):
    n_rows, hidden = x.shape
    floor = (n_rows + weight.shape[0]) * hidden * x.element_size()
    return {
        "provider": provider,
        "shape": f"{n_rows}x{hidden}x{weight.shape[0]}",
        "dtype": str(x.dtype),
        "autocast": str(autocast_dtype),
        "kwargs": {k: str(v) for k, v in kwargs.items()},
        "floor_mib": floor / MIB,
        **dict(zip(("fwd_peak_mib", "after_fwd_mib", "bwd_peak_mib", "after_bwd_mib"), measured)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="16384,4096,32000")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--autocast", action="store_true", help="fp32 inputs under autocast to --dtype")
    args = parser.parse_args()
    n_rows, hidden, vocab = (int(v) for v in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    if args.autocast:  # the accumulator follows the weight (fp32): chunk sizes are the setting to compare
        shape = (n_rows, hidden, vocab, torch.float32, dtype)
        rows = [breakdown(*shape), breakdown(*shape, chunk_size=1024), breakdown(*shape, chunk_size=512)]
    else:
        shape = (n_rows, hidden, vocab, dtype)
        rows = [
            breakdown(*shape),
            breakdown(*shape, accum_dtype=dtype),
            breakdown(*shape, accum_dtype=dtype, chunk_size=512),
        ]
    try:
        rows.append(liger_breakdown(*shape))
    except ImportError as exc:
        print(f"liger: not installed ({exc})")
    for row in rows:
        print(json.dumps(row))
    out = os.environ.get("OUT")
    if out:
        name = f"memory_breakdown_{'autocast_' if args.autocast else ''}{args.dtype}.json"
        with open(os.path.join(out, name), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
