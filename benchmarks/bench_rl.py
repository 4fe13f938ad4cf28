"""The RL calls on a GPU (issue 36's shapes): forward + backward time and peak memory of the policy loss against
this op's own cross-entropy, the unfused GRPO loss and the GRPO formula on ``reduction="none"``; forward-only
log-probabilities against the unfused ones.

    python3 benchmarks/bench_rl.py [--shapes 8192x4096x128256 ...] [--rounds 5] [--reps 3]
    python3 benchmarks/bench_rl.py --device cpu --shapes 256x64x1000 --rounds 1 --reps 1   # smoke test

Writes ``$OUT/bench_rl.json`` (or ``./bench_out``) and prints a table (ms, peak MiB). Liger's
``LigerFusedLinearGRPOLoss`` (0.8.5's call: ``liger_kernel.chunked_loss``, compiled, ``chunk_size=1``, the same
GRPO loss with the k3 KL to the reference log-probs; it has no entropy term) is a row when Liger is importable
(``benchmarks/fetch_peers.sh`` carries it to the GPU machine).
"""

from __future__ import annotations

import argparse

import _common
import torch
import torch.nn.functional as F

_common.ensure_repo_on_path()

from lightning_flce import fused_linear_cross_entropy, fused_linear_logprobs, fused_linear_policy_loss  # noqa: E402
from lightning_flce.losses.policy import per_token_policy_loss  # noqa: E402

SHAPES = ["8192x4096x128256", "8192x3584x151936", "8192x2304x256000"]
BATCH = 8  # sequences per call; T = N / BATCH
GRPO = dict(loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.04)


def grpo_of_logprobs(logp, entropy, batch, entropy_coef):
    """The GRPO loss of per-token log-probs in PyTorch (masked per-sequence mean, then the mean)."""
    per_token = per_token_policy_loss(
        logp,
        entropy,
        batch["advantages"][:, None],
        batch["old"],
        batch["ref"],
        entropy_coef=entropy_coef,
        **GRPO,
    )
    mask = batch["mask"].to(per_token.dtype)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def make_calls(x, w, target, batch):
    def unfused(entropy_coef):
        def call():
            logits = F.linear(x, w).float()
            log_probs = torch.log_softmax(logits, -1)
            logp = log_probs.gather(-1, target[..., None]).squeeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1) if entropy_coef else None
            grpo_of_logprobs(logp, entropy, batch, entropy_coef).backward()

        return call

    def via_none():
        logp = -fused_linear_cross_entropy(x, w, target, reduction="none")
        grpo_of_logprobs(logp, None, batch, 0.0).backward()

    def policy(entropy_coef, precision="input"):
        def call():
            fused_linear_policy_loss(
                x,
                w,
                target,
                advantages=batch["advantages"],
                old_logprobs=batch["old"],
                ref_logprobs=batch["ref"],
                mask=batch["mask"],
                entropy_coef=entropy_coef,
                logits_precision=precision,
                **GRPO,
            ).loss.backward()

        return call

    def logprobs_bwd():
        out = fused_linear_logprobs(x, w, target)
        (out.logprobs * batch["advantages"][:, None]).sum().backward()

    @torch.no_grad()
    def logprobs_fwd():
        fused_linear_logprobs(x, w, target)

    @torch.no_grad()
    def unfused_logprobs_fwd():
        torch.log_softmax(F.linear(x, w).float(), -1).gather(-1, target[..., None])

    calls = {
        "ce_mean": lambda: fused_linear_cross_entropy(x, w, target).backward(),
        "unfused_grpo": unfused(0.0),
        "unfused_grpo_entropy": unfused(0.01),
        "grpo_via_none": via_none,
        "policy_grpo": policy(0.0),
        "policy_grpo_entropy": policy(0.01),
        "policy_grpo_fp32comp": policy(0.0, "fp32_compensated"),
        "logprobs_fwd_bwd": logprobs_bwd,
        "logprobs_fwd": logprobs_fwd,
        "unfused_logprobs_fwd": unfused_logprobs_fwd,
    }
    liger = liger_grpo(x, w, target, batch)
    if liger is not None:
        calls["liger_grpo"] = liger
    return calls


def liger_grpo(x, w, target, batch):
    """Liger-Kernel's fused GRPO loss on the same batch, or None without Liger."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=GRPO["beta"],
        use_ref_model=True,
        loss_type=GRPO["loss_type"],
        epsilon_low=GRPO["epsilon_low"],
        epsilon_high=GRPO["epsilon_high"],
        compiled=x.is_cuda,
        chunk_size=1,
    )
    mask = batch["mask"].to(torch.int64)

    def call():
        loss, _metrics = loss_fn(
            x,
            w,
            target,
            mask,
            batch["advantages"],
            ref_per_token_logps=batch["ref"],
            old_per_token_logps=batch["old"],
        )
        loss.backward()

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script at a small shape")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = _common.environment(device)
    print("\n".join(_common.header_lines(env)))
    records = []
    for shape in args.shapes:
        n, h, v = map(int, shape.split("x"))
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(BATCH, n // BATCH, h, device=device, generator=gen).bfloat16().requires_grad_()
        w = (torch.randn(v, h, device=device, generator=gen) / h**0.5 * 2).bfloat16().requires_grad_()
        target = torch.randint(0, v, (BATCH, n // BATCH), device=device, generator=gen)
        with torch.no_grad():
            logp = -fused_linear_cross_entropy(x, w, target, reduction="none")
        noise = torch.randn(logp.shape, device=device, generator=gen)
        batch = {
            "advantages": torch.randn(BATCH, device=device, generator=gen),
            "old": logp + 0.1 * noise,
            "ref": logp - 0.1 * noise,
            "mask": torch.rand(logp.shape, device=device, generator=gen) > 0.1,
        }
        calls = make_calls(x, w, target, batch)

        def setup(call, leaves=(x, w)):
            def prepared():
                for leaf in leaves:
                    leaf.grad = None
                return call

            return prepared

        times, peaks = {}, {}
        for name, call in calls.items():
            try:
                peaks[name] = _common.measure_peak_mib(setup(call)(), device)
            except Exception as exc:  # an OOM or a failing row is recorded, the run carries on
                peaks[name] = _common.short_error(exc)
        runnable = {name: setup(call) for name, call in calls.items() if not isinstance(peaks[name], str)}
        times = _common.interleaved_medians(runnable, device, rounds=args.rounds, reps=args.reps)
        for name in calls:
            records.append({"shape": shape, "name": name, "ms": times.get(name), "peak_mib": peaks[name]})
        x.grad = w.grad = None
        _common.free_memory(device)
    rows = [
        [r["shape"], r["name"], _common.fmt(r["ms"], ".1f"), _common.fmt(r["peak_mib"], ".0f")]
        for r in records
    ]
    print("\n".join(_common.text_table(["shape", "call", "ms", "peak MiB"], rows)))
    _common.write_json(_common.out_dir() / "bench_rl.json", {"environment": env, "records": records})


if __name__ == "__main__":
    main()
