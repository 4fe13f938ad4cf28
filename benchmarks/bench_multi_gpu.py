"""Two-GPU throughput and per-GPU peak memory: DDP vs FSDP2 vs a vocab-parallel LM head, one run.

A ~1.5B-parameter Llama-style decoder (Llama 3.2 1B shapes: hidden 2048, 16 layers, 32 query / 8 key-value
heads, SwiGLU 8192, vocabulary 128256, RoPE, RMSNorm) with an *untied* LM head (128256 x 2048 = 263M
parameters, 17.5% of the model; untied because the vocab-parallel head has no vocab-parallel input embedding),
trained with AdamW under bf16 autocast (fp32 parameters, gradients and optimizer states: what Lightning's
``bf16-mixed`` does), seq 4096, 2 sequences per GPU per step. The loss is always the fused linear
cross-entropy of ``lightning_flce``; no step builds the [tokens, V] logits. Plain PyTorch training loops (no
Lightning), so the table shows the strategies and not the trainer.

Variants (all in the same 2 processes, one after the other, same initial weights and data):

- ``ddp``: ``DistributedDataParallel`` of the whole model; every GPU holds the full model, its gradients and
  AdamW states (16 bytes per parameter). The head is called through
  :class:`~lightning_flce.head.FLCEHeadLoss` (what ``FLCEMixin`` uses).
- ``fsdp2``: ``fully_shard`` on each block, the head (its own unit) and the root
  (:func:`lightning_flce.parallel.fully_shard_lm`): parameters, gradients and optimizer states sharded over
  the 2 GPUs; the head's full [V, H] weight is all-gathered around its call.
- ``vp_ddp``: the body (embedding, blocks, final norm) replicated with DDP; the head is a
  :class:`~lightning_flce.parallel.VocabParallelHead` holding 64128 of the 128256 rows on each GPU (not in
  DDP). Each rank's final hidden states [N, H] (and labels) are all-gathered into [2N, H], the
  vocab-parallel loss runs on all 2N tokens with the local rows (same FLOPs per GPU as DDP's N x V), the
  op all-reduces dX, and each rank backpropagates its own N rows into the body (times the world size,
  because DDP averages the body's gradients over the ranks while the loss is already the global mean).
  Expected: per-GPU peak memory about half the head's states (16 B x 263M / 2 = 2.0 GiB) below ``ddp``,
  plus the smaller per-chunk logits; costs: one all-gather of the hidden states and the fp32 all-reduce of
  the [2N, H] dX per step.
- ``vp_fsdp2``: the same vocab-parallel head, FSDP2 on the body.

Output under ``$OUT`` (default ``./bench_out``): ``multi_gpu<TAG>.json`` and ``multi_gpu<TAG>.md``.

    python benchmarks/bench_multi_gpu.py                       # 2 GPUs, NCCL
    python benchmarks/bench_multi_gpu.py --device cpu --tiny   # 2 CPU processes (gloo): plumbing check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.ensure_repo_on_path()

from lightning_flce.head import FLCEHeadLoss  # noqa: E402
from lightning_flce.parallel import VocabParallelHead, fully_shard_lm  # noqa: E402

WORLD = 2
GIB = 2**30
VARIANTS = ("ddp", "fsdp2", "vp_ddp", "vp_fsdp2")
CONFIGS = {
    # Llama 3.2 1B shapes, untied head
    "1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256},
    # CPU plumbing check (odd vocabulary: uneven vocab shards)
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 1001},
}
SETUPS = {
    "ddp": "DDP of the whole model (head replicated)",
    "fsdp2": "FSDP2: each block, the head and the root sharded",
    "vp_ddp": "body DDP + VocabParallelHead (V/2 rows per GPU), hidden states all-gathered",
    "vp_fsdp2": "body FSDP2 + VocabParallelHead (V/2 rows per GPU), hidden states all-gathered",
}


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rope(x: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """Rotary embedding of [B, heads, T, D] (the rotate-half form), computed on the fly."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(x.dtype), torch.cat([angles.sin()] * 2, -1).to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attn_norm = RMSNorm(hidden)
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q), rope(k)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Body(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.ModuleList(
            Block(cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["ffn"]) for _ in range(cfg["layers"])
        )
        self.norm = RMSNorm(cfg["hidden"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaLM(nn.Module):
    """Body + untied head; ``forward(input_ids, labels)`` is the mean fused loss of this rank's tokens."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.body = Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)
        self.head_loss = FLCEHeadLoss()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head_loss(self.lm_head, self.body(input_ids), labels, reduction="mean")


class _GatherTokens(torch.autograd.Function):
    """[N, ...] per rank -> [W * N, ...] on every rank; backward: this rank's rows of the (replicated)
    gradient, times W (DDP/FSDP average the body's gradients over the W ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rows, ctx.rank, ctx.world = x.shape[0], rank, world
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows] * ctx.world


def gather_labels(labels: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, labels.contiguous())
    return torch.cat(parts)


# ----------------------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------------------


def build(variant: str, cfg: dict, device: torch.device):
    """(modules to train, step function(input_ids, labels) -> global mean loss, parameters of this rank)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with device:
        model = LlamaLM(cfg)
    ddp_kwargs = {"gradient_as_bucket_view": True}  # (the model has no buffers)
    if device.type == "cuda":
        ddp_kwargs["device_ids"] = [device.index]

    def mesh():
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (WORLD,))

    if variant == "ddp":
        wrapped = DDP(model, **ddp_kwargs)

        def step(input_ids, labels):
            return wrapped(input_ids, labels)

        return wrapped, step, list(wrapped.parameters())
    if variant == "fsdp2":
        fully_shard_lm(model, mesh(), blocks=model.body.layers, head=model.lm_head, register_steps=False)
        return model, model, list(model.parameters())

    # vocab-parallel head: this rank's rows of the same initial head, then the full head is dropped
    head = VocabParallelHead.from_linear(model.lm_head)
    del model.lm_head
    body = model.body
    if variant == "vp_ddp":
        body = DDP(body, **ddp_kwargs)
    elif variant == "vp_fsdp2":
        fully_shard_lm(body, mesh(), blocks=body.layers, register_steps=False)
    else:
        raise ValueError(variant)

    def vp_step(input_ids, labels):
        hidden = body(input_ids)
        hidden = _GatherTokens.apply(hidden.reshape(-1, hidden.shape[-1]))
        return head.loss(hidden, gather_labels(labels.reshape(-1)))

    return nn.ModuleList([body, head]), vp_step, list(body.parameters()) + list(head.parameters())


def batch(cfg: dict, args, step: int, rank: int, device: torch.device):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, cfg["vocab"], (args.micro_batch, args.seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def run_variant(variant: str, cfg: dict, args, device: torch.device) -> dict:
    rank = dist.get_rank()
    cuda = device.type == "cuda"
    baseline = torch.cuda.memory_allocated(device) / GIB if cuda else None  # leftovers of earlier variants
    modules, step_fn, params = build(variant, cfg, device)
    # One AdamW per parameter kind: the foreach kernels refuse a list mixing DTensors (FSDP2 body) and plain
    # tensors (the vocab-parallel head's local shard).
    kinds = {}
    for p in params:
        kinds.setdefault(hasattr(p, "to_local"), []).append(p)
    optimizers = [
        torch.optim.AdamW(group, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0) for group in kinds.values()
    ]
    numel_local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    times, losses = [], []
    for index in range(args.warmup + args.steps):
        if index == args.warmup and cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        input_ids, labels = batch(cfg, args, index, rank, device)
        _common.synchronize(device)
        start = time.perf_counter()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_fn(input_ids, labels)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        _common.synchronize(device)
        elapsed = time.perf_counter() - start
        if index >= args.warmup:
            times.append(elapsed)
        loss = loss.detach().float()
        if not variant.startswith("vp_"):  # a per-rank mean (equal token counts): average over the ranks
            dist.all_reduce(loss)
            loss /= WORLD
        losses.append(float(loss))
    result = {
        "variant": variant,
        "setup": SETUPS[variant],
        "step_s": sorted(times),
        "median_step_s": _common.percentile(times, 50),
        "tokens_per_step": WORLD * args.micro_batch * args.seq,
        "losses": losses,
        "params_local": numel_local,
    }
    result["tokens_per_s"] = result["tokens_per_step"] / result["median_step_s"]
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        result["allocated_after_gib"] = torch.cuda.memory_allocated(device) / GIB
        result["allocated_before_build_gib"] = baseline
    else:
        import resource

        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    del modules, step_fn, params, optimizers
    return result


def worker(args) -> None:
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    cfg = CONFIGS["tiny" if args.tiny else args.config]
    results = []
    for variant in args.variants.split(","):
        try:
            result = run_variant(variant, cfg, args, device)
        except Exception as exc:  # e.g. an OOM: recorded, the next variant still runs
            traceback.print_exc()
            result = {
                "variant": variant,
                "setup": SETUPS.get(variant, "?"),
                "error": _common.short_error(exc),
            }
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        per_rank = [None] * WORLD
        dist.all_gather_object(per_rank, result)
        results.append(per_rank)
        if rank == 0:
            print(f"[bench_multi_gpu] {variant}: {json.dumps(summarize(per_rank))}", flush=True)
            # after every variant, so that a timeout still leaves the finished rows
            write_outputs(args, cfg, device, results, final=False)
    if rank == 0:
        write_outputs(args, cfg, device, results)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def model_numbers(cfg: dict) -> dict:
    h, f, v, layers = cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"]
    kv = cfg["kv_heads"] * (h // cfg["heads"])
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    body = v * h + layers * block + h
    head = v * h
    total = body + head
    state = 16  # bytes per parameter: fp32 parameter, gradient, AdamW exp_avg and exp_avg_sq
    return {
        "params_total": total,
        "params_head": head,
        "head_share": head / total,
        "state_gib": {
            "ddp": state * total / GIB,
            "fsdp2": state * total / WORLD / GIB,
            "vp_ddp": state * (body + head / WORLD) / GIB,
            "vp_fsdp2": state * total / WORLD / GIB,
        },
    }


def summarize(per_rank: list) -> dict:
    first = per_rank[0]
    if any("error" in r for r in per_rank):
        return {"variant": first["variant"], "error": [r.get("error") for r in per_rank]}
    out = {
        "variant": first["variant"],
        "setup": first["setup"],
        "tokens_per_s": min(r["tokens_per_s"] for r in per_rank),
        "median_step_ms": 1e3 * max(r["median_step_s"] for r in per_rank),
        "first_loss": first["losses"][0],
        "last_loss": first["losses"][-1],
        "params_local_max": max(r["params_local"] for r in per_rank),
    }
    keys = ("peak_allocated_gib", "peak_reserved_gib", "allocated_after_gib", "allocated_before_build_gib")
    for key in (*keys, "peak_rss_gib"):
        if key in first:
            out[key] = max(r[key] for r in per_rank)
            out[key + "_per_rank"] = [r[key] for r in per_rank]
    return out


def nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def write_outputs(args, cfg: dict, device: torch.device, results: list, final: bool = True) -> None:
    env = _common.environment(device)
    env["world_size"] = WORLD
    env["nccl"] = nccl_version() if device.type == "cuda" else None
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    numbers = model_numbers(cfg)
    rows = [summarize(r) for r in results]
    payload = {
        "env": env,
        "config": cfg,
        "args": vars(args),
        "model": numbers,
        "rows": rows,
        "raw": results,
    }
    out = _common.out_dir()
    tag = args.tag or ""
    _common.write_json(out / f"multi_gpu{tag}.json", payload)

    cuda = device.type == "cuda"
    mem_key = "peak_allocated_gib" if cuda else "peak_rss_gib"
    base = next((r for r in rows if r["variant"] == "ddp" and "error" not in r), None)
    lines = [
        f"# Multi-GPU: DDP vs FSDP2 vs vocab-parallel head ({WORLD} x {env['gpus'][0] if env['gpus'] else 'CPU'})",
        "",
        *_common.header_lines(env),
        "",
        f"Model: Llama-style, hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']}/{cfg['kv_heads']} heads,"
        f" FFN {cfg['ffn']}, V={cfg['vocab']} untied: {numbers['params_total'] / 1e6:.1f}M parameters, head"
        f" {numbers['params_head'] / 1e6:.1f}M ({100 * numbers['head_share']:.1f}%). bf16 autocast, fp32 AdamW;"
        f" seq {args.seq} x {args.micro_batch} per GPU ({WORLD * args.seq * args.micro_batch} tokens per step);"
        f" median of {args.steps} steps after {args.warmup} warm-up steps; memory: max over the ranks"
        f" ({'torch.cuda.max_memory_allocated over the measured steps' if cuda else 'peak RSS of the process, cumulative over the variants run so far'}).",
        "",
        "```",
        f"| variant | tokens/s | step ms | {'peak alloc GiB/GPU' if cuda else 'peak RSS GiB'} | vs ddp |"
        " reserved GiB | alloc after step GiB | alloc before build GiB | model states GiB (16 B/param, analytic) |"
        " params/GPU (M) |"
        " loss step 0 | loss last step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['variant']} | error: {str(row['error'][0])[:120]} |")
            continue
        delta = "-"
        if base is not None and row is not base:
            delta = f"{row[mem_key] - base[mem_key]:+.2f}"
        lines.append(
            f"| {row['variant']} | {row['tokens_per_s']:.0f} | {row['median_step_ms']:.1f} | {row[mem_key]:.2f} |"
            f" {delta} | {_common.fmt(row.get('peak_reserved_gib'), '.2f')} |"
            f" {_common.fmt(row.get('allocated_after_gib'), '.2f')} |"
            f" {_common.fmt(row.get('allocated_before_build_gib'), '.2f')} |"
            f" {numbers['state_gib'][row['variant']]:.2f} | {row['params_local_max'] / 1e6:.1f} |"
            f" {row['first_loss']:.4f} | {row['last_loss']:.4f} |"
        )
    lines += ["```", ""]
    lines += [f"- `{v}`: {SETUPS[v]}" for v in args.variants.split(",") if v in SETUPS]
    head_state = 16 * numbers["params_head"] / GIB
    lines += [
        "",
        f"Expected: `vp_ddp` about {head_state / WORLD:.2f} GiB per GPU below `ddp` (half of the head's"
        f" {head_state:.2f} GiB of fp32 parameter, gradient and AdamW states), plus the smaller per-chunk logits"
        " [C, V/2]; all variants start from the same weights and data, so the step-0 losses must agree (and the last-step losses up to bf16 noise).",
        "",
    ]
    (out / f"multi_gpu{tag}.md").write_text("\n".join(lines))
    if final:
        print("\n".join(lines), flush=True)


# ----------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args, argv: list[str]) -> int:
    port = str(_free_port())
    procs = []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE=str(WORLD),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1" if args.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "8"),
            PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
            **NO_MULTICAST,
        )
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--worker"], env=env))
    deadline = time.monotonic() + args.timeout_s
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        print(f"[bench_multi_gpu] timed out after {args.timeout_s} s", file=sys.stderr)
        return 124
    return max(codes, key=abs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--config", default="1b", choices=sorted(CONFIGS))
    parser.add_argument("--tiny", action="store_true", help="the tiny config, seq 64, 2 measured steps")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 4096; tiny 64)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 6; tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; tiny 1)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--lr", type=float, default=1e-5, help="AdamW learning rate (the last-step losses compare)"
    )
    parser.add_argument("--tag", default="")
    parser.add_argument("--timeout-s", type=float, default=480.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seq is None:
        args.seq = 64 if args.tiny else 4096
    if args.steps is None:
        args.steps = 2 if args.tiny else 6
    if args.warmup is None:
        args.warmup = 1 if args.tiny else 3
    if args.worker:
        worker(args)
        return
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
    argv = [a for a in sys.argv[1:] if a != "--worker"]
    sys.exit(launch(args, argv))


if __name__ == "__main__":
    main()
