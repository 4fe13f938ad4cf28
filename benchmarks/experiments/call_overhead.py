"""How long does a call take where the GPU has almost nothing to do (the host's share: checks, set-up, dispatch)?

Forward + backward of ``fused_linear_distillation`` (JSD and forward KL), ``fused_linear_cross_entropy``, the RL
calls (``fused_linear_logprobs`` with entropy, ``fused_linear_policy_loss``) and, for scale, the unfused losses
(``bench_distill.py``'s unfused JSD; logits and ``cross_entropy``), at tiny shapes (N tokens, H, V small: the GEMMs
and kernels take microseconds), timed on the host (``time.perf_counter`` around call + backward + synchronize,
median of ``--repeats`` after a warm-up) and with CUDA events. At the issue's shapes the same host work sits before
the first GEMM (``distill_gaps.py``'s prelude): this is its unprofiled size.

    python3 benchmarks/experiments/call_overhead.py          # $OUT/call_overhead.json
    python3 benchmarks/experiments/call_overhead.py --device cpu --tokens 16 --hidden 32 --vocab 64   # host only
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common

import _common  # noqa: E402
import bench_distill  # noqa: E402
import torch  # noqa: E402

_common.ensure_repo_on_path()
from lightning_flce import (  # noqa: E402
    fused_linear_cross_entropy,
    fused_linear_distillation,
    fused_linear_logprobs,
    fused_linear_policy_loss,
)


def providers(xs, ws, xt, wt, target):
    unfused_jsd = bench_distill.PROVIDERS["unfused"][1](xs.device, "jsd", 0.5, 1.0)
    advantages = torch.ones(1, device=xs.device)

    calls = {
        "flce_distill_jsd": lambda: fused_linear_distillation(xs, ws, xt, wt, target, divergence="jsd"),
        "flce_distill_forward_kl": lambda: fused_linear_distillation(
            xs, ws, xt, wt, target, divergence="forward_kl"
        ),
        "flce_cross_entropy": lambda: fused_linear_cross_entropy(xs, ws, target),
        "flce_logprobs": lambda: fused_linear_logprobs(xs, ws, target, return_entropy=True).logprobs.sum(),
        "flce_policy_loss": lambda: (
            fused_linear_policy_loss(xs.unsqueeze(0), ws, target.unsqueeze(0), advantages=advantages).loss
        ),
        "unfused_jsd": lambda: unfused_jsd(xs, ws, xt, wt, target),
        "unfused_cross_entropy": lambda: torch.nn.functional.cross_entropy((xs @ ws.T).float(), target),
    }
    if importlib.util.find_spec("lightning_flce.op_autograd") is not None:  # an A/B in one process
        for name in [name for name in calls if name.startswith("flce_")]:
            calls[f"{name}_registered_autograd"] = registered_autograd(calls[name])
    return calls


def registered_autograd(fn):
    """``fn`` with every op on ``torch.library``'s registered autograd, as before ``op_autograd.py`` (its eager
    ``autograd.Function`` turned off for the call; backward follows the node the call recorded)."""
    from lightning_flce.op_autograd import OpWithAutograd

    def call():
        eager = OpWithAutograd.takes_eager_function
        OpWithAutograd.takes_eager_function = lambda self, args: False
        try:
            return fn()
        finally:
            OpWithAutograd.takes_eager_function = eager

    return call


def median_host_ms(fn, repeats: int, before=None) -> float:
    """The median host time of ``fn()`` to its synchronized end, after a warm-up of five calls (``before`` runs
    ahead of each call, untimed)."""
    for _ in range(5):
        fn()
    host = []
    for _ in range(repeats):
        if before is not None:
            before()
        _synchronize()
        t0 = time.perf_counter()
        fn()
        _synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(host)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def dispatch_overhead(xs, ws, xt, wt, target, repeats: int):
    """The distillation op's forward (JSD, "mean": its gradients computed in forward) three ways, with the same
    arguments: through ``torch.library``'s registered autograd (``torch.library``'s argument handling, its
    ``fill_defaults`` before ``setup_context``, its aliasing check, the ``_disable_dynamo`` wrapper of the
    implementation), as the package calls it in eager mode (:class:`~lightning_flce.op_autograd.OpWithAutograd`'s
    ``autograd.Function`` around the op), and its Python implementation called directly (below autograd)."""
    from lightning_flce.distill import functional, op

    recorded = []
    registered = functional.flce_distill

    def record(*values):
        recorded.append(values)
        return registered(*values)

    functional.flce_distill = record
    try:
        fused_linear_distillation(xs, ws, xt, wt, target, divergence="jsd")
    finally:
        functional.flce_distill = registered
    values = recorded[0]

    def direct():
        with torch.no_grad():  # as the custom op runs its implementation: below autograd
            return op._forward(*values)

    out = []
    custom_op = getattr(registered, "op", registered)  # a tree before OpWithAutograd called the op itself
    for name, fn in (
        ("custom_op_forward", lambda: custom_op(*values)),
        ("package_forward", lambda: registered(*values)),
        ("direct_forward", direct),
    ):
        out.append({"provider": name, "host_ms": median_host_ms(fn, repeats)})
        print(f"{name:28s} host {out[-1]['host_ms']:.3f} ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="the providers one after another this many times (drift shows as rounds)",
    )
    parser.add_argument(
        "--cprofile",
        default="flce_distill_jsd",
        help="a provider whose host time cProfile breaks down ('' none)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu: host time only (the torch backend's kernels; no CUDA events)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    timed_events = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    n, h, v = args.tokens, args.hidden, args.vocab
    xs = (torch.randn(n, h, device=device, generator=gen) / h**0.5).bfloat16().requires_grad_()
    ws = torch.randn(v, h, device=device, generator=gen).bfloat16().requires_grad_()
    xt = (torch.randn(n, h, device=device, generator=gen) / h**0.5).bfloat16()
    wt = torch.randn(v, h, device=device, generator=gen).bfloat16()
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    env = _common.environment(device)
    records = []

    def clear_grads():
        xs.grad = ws.grad = None

    calls = providers(xs, ws, xt, wt, target)
    for round_index, (name, fn) in itertools.product(range(args.rounds), calls.items()):
        event_pairs = []

        def step(fn=fn, event_pairs=event_pairs):
            if not timed_events:
                fn().backward()
                return
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn().backward()
            end.record()
            event_pairs.append((start, end))

        host_ms = median_host_ms(step, args.repeats, before=clear_grads)
        # the timed calls' events (median_host_ms warms up with five calls first)
        events = [start.elapsed_time(end) for start, end in event_pairs[5:]]
        record = {
            "provider": name,
            "round": round_index,
            "shape": [n, h, v],
            "host_ms": host_ms,
            "events_ms": statistics.median(events) if events else None,
        }
        records.append(record)
        print(f"{name:28s} host {record['host_ms']:.3f} ms  events {record['events_ms']} ms")
    records += dispatch_overhead(xs, ws, xt, wt, target, args.repeats)
    _common.write_json(_common.out_dir() / "call_overhead.json", {"environment": env, "records": records})
    if args.cprofile:
        import cProfile
        import io
        import pstats

        fn = providers(xs, ws, xt, wt, target)[args.cprofile]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.repeats):
            clear_grads()
            fn().backward()
            _synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        (_common.out_dir() / f"cprofile_{args.cprofile}.txt").write_text(text.getvalue())
        print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
