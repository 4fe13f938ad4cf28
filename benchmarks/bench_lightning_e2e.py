"""End-to-end Lightning training benchmark: a Llama-style model trained for a few optimizer steps with
three ways of computing the LM-head loss, one fresh process per provider.

Providers (``--providers``, comma-separated; default ``hf,liger,flce``):

- ``hf``: the baseline users have: a plain LightningModule returning the HF model's own loss,
  ``model(input_ids, labels=labels).loss`` (transformers' ``ForCausalLMLoss``: [N, V] logits, upcast to
  fp32, ``F.cross_entropy``);
- ``flce``: ``lightning_flce.models.HFCausalLM`` (FLCEMixin): fused linear cross-entropy, no [N, V] logits;
- ``naive`` (only when named): ``HFCausalLM(flce_naive=True)``: this package's unfused path, logits [N, V] +
  ``F.cross_entropy``;
- ``liger``: Liger-Kernel's HF patch ``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True,
  rope=False, rms_norm=False, swiglu=False)`` applied before the model is built, trained through a plain
  LightningModule that calls the HF model's forward with ``labels`` (the patched forward computes the fused
  loss, logits are not built in training mode): the ``hf`` module with Liger's loss;
- ``liger_all`` (only when named): the same with Liger's RoPE, RMSNorm and SwiGLU kernels patched in too
  (Liger's default), so more than the loss differs.

Every provider gets the same model (random init from one seed; default: Llama-3.2-1B shapes, 1.236 B
parameters with the tied embedding), the same batches, the same AdamW + schedule
(``lightning_flce.models.gpt.adamw_with_warmup_cosine``) and the same Trainer settings. Each provider runs in
its own subprocess (``--isolation subprocess``, the default), so GPU memory is returned to the driver
between providers and Liger's monkey-patching of ``transformers.models.llama`` cannot leak into the others.

Measured per provider: wall time of every optimizer step (``on_train_batch_start`` to
``on_train_batch_end`` of a callback, with ``torch.cuda.synchronize()`` at both ends: forward, loss,
backward, optimizer step and Lightning's own work); tokens/s = batch tokens / median step time over the
steps after ``--warmup``; peak memory = ``torch.cuda.max_memory_allocated`` over the timed steps
(weights, AdamW states and the step's activations, gradients and temporaries), also per phase of the step
(forward up to ``on_before_backward``, backward, optimizer step and the rest); the loss of every step. An OOM (or any exception) is recorded for
its provider and the others still run.

Usage (GPU, see benchmarks/gpu_e2e.sh):  python3 benchmarks/bench_lightning_e2e.py [--batch-size 4] ...
CPU smoke test (tiny Llama, seq 64, 3 steps): python3 benchmarks/bench_lightning_e2e.py --device cpu --tiny
Writes $OUT/e2e.json and $OUT/e2e.md ($OUT defaults to ./bench_out); the summary table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import _common as C
import lightning.pytorch as pl
import torch

C.ensure_repo_on_path()

from lightning_flce.models.gpt import adamw_with_warmup_cosine  # noqa: E402 - after the path setup
from lightning_flce.models.hf import compile_decoder_layers  # noqa: E402

PROVIDERS: Dict[str, str] = {
    "hf": "the HF model's own loss: model(input_ids, labels=labels).loss (transformers ForCausalLMLoss) in a"
    " plain LightningModule",
    "flce": "lightning_flce.models.HFCausalLM (FLCEMixin, fused linear cross-entropy)",
    "naive": "HFCausalLM(flce_naive=True): logits [N, V] + F.cross_entropy; only when named",
    "liger": "Liger-Kernel apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, rope=False, "
    "rms_norm=False, swiglu=False); HF forward(input_ids, labels)",
    "liger_all": "Liger-Kernel apply_liger_kernel_to_llama(fused_linear_cross_entropy=True) with its RoPE, "
    "RMSNorm and SwiGLU kernels (Liger's defaults); only when named",
}
DEFAULT_PROVIDERS = ["hf", "liger", "flce"]
# The baseline of the "x HF" columns.
BASELINE = "hf"

# Llama-3.2-1B shapes (random init, no download): 1,235,814,400 parameters with the tied embedding
# (262,668,288 of them in the embedding / LM head).
LLAMA_1B: Dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
# Llama-3.2-3B shapes (--model 3b): 3,212,749,824 parameters with the tied embedding.
LLAMA_3B: Dict[str, Any] = {
    **LLAMA_1B,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
}
# --tiny: the plumbing only (numbers mean nothing).
TINY: Dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------------ config
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny Llama, seq 64, 3 steps: a smoke test")
    ap.add_argument(
        "--model", choices=["1b", "3b"], default="1b", help="Llama-3.2-1B (default) or -3B shapes"
    )
    ap.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS), help=f"from {list(PROVIDERS)}")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 10; tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; tiny 1)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; tiny 64)")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 4; tiny 2)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 16; tiny 2)")
    ap.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="hidden size (default 2048; tiny 64); when set: intermediate 4x, head dim 64, kv heads = heads/4",
    )
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 128256; tiny 1024)")
    ap.add_argument("--untied", action="store_true", help="separate LM head (default: tied, as Llama-3.2-1B)")
    ap.add_argument(
        "--precision", default=None, help="Lightning precision (default bf16-mixed; 32-true on the CPU)"
    )
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--flce-chunk-size", type=int, default=None, help="flce_chunk_size (default: the op's)")
    ap.add_argument(
        "--data", choices=["counting", "random"], default="counting", help="counting: (s + t) mod V; random"
    )
    ap.add_argument(
        "--compile-layers",
        action="store_true",
        help="torch.compile each decoder layer (compile_decoder_layers; every provider alike, the head and its"
        " loss eager)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isolation", choices=["subprocess", "inprocess"], default="subprocess")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget for all providers")
    ap.add_argument("--tag", default="", help="suffix of the output files: e2e<TAG>.{json,md}")
    # internal: run one provider in this process and write its record to --result-file
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    tiny = args.tiny
    defaults = {"steps": (3, 10), "warmup": (1, 3), "seq_len": (64, 4096), "batch_size": (2, 4)}
    for key, (small, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device.startswith("cuda") else "32-true"
    names = [p.strip() for p in args.providers.split(",") if p.strip()]
    if names == ["all"]:
        names = list(PROVIDERS)
    unknown = [p for p in names if p not in PROVIDERS]
    if unknown:
        ap.error(f"unknown providers {unknown}; choose from {list(PROVIDERS)}")
    args.provider_list = names
    if args.steps < 1 or args.warmup < 0 or args.seq_len < 2 or args.batch_size < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --seq-len >= 2, --batch-size >= 1")
    return args


def model_config(args: argparse.Namespace) -> Dict[str, Any]:
    """LlamaConfig keyword arguments for this run."""
    cfg = dict(TINY if args.tiny else (LLAMA_3B if args.model == "3b" else LLAMA_1B))
    if args.hidden is not None:
        heads = max(1, args.hidden // 64)
        if args.hidden % heads:
            raise ValueError(f"--hidden {args.hidden} is not a multiple of {heads} heads")
        cfg.update(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
        )
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    if args.vocab is not None:
        cfg["vocab_size"] = args.vocab
    if args.untied:
        cfg["tie_word_embeddings"] = False
    cfg["max_position_embeddings"] = max(args.seq_len, 2048)
    return cfg


def param_count(cfg: Dict[str, Any]) -> int:
    """Parameters of LlamaForCausalLM(cfg) (no bias, tied head counted once)."""
    h, f, n_layers, v = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        cfg["vocab_size"],
    )
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return v * h * (1 if cfg["tie_word_embeddings"] else 2) + n_layers * per_layer + h


# ------------------------------------------------------------------------------------------------ worker
def make_batches(args: argparse.Namespace, vocab: int, count: int) -> torch.Tensor:
    """[count, B, T] token ids, the same for every provider."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    shape = (count, args.batch_size, args.seq_len)
    if args.data == "random":
        return torch.randint(0, vocab, shape, generator=gen)
    starts = torch.randint(0, vocab, (count, args.batch_size, 1), generator=gen)
    return (starts + torch.arange(args.seq_len)) % vocab


def run_worker(args: argparse.Namespace, name: str) -> Dict[str, Any]:
    """Train ``name`` for warmup + steps optimizer steps in this process; return its record."""
    from torch.utils.data import DataLoader

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = model_config(args)
    tokens_per_step = args.batch_size * args.seq_len
    rec: Dict[str, Any] = {
        "provider": name,
        "description": PROVIDERS[name],
        "env": None,
        "params": None,
        "param_dtype": None,
        "tokens_per_step": tokens_per_step,
        "timed_steps": 0,
        "step_s": [],
        "losses": [],
        "median_step_s": None,
        "p20_step_s": None,
        "p80_step_s": None,
        "tokens_per_s": None,
        "tokens_per_s_mean": None,
        "peak_alloc_mib": None,
        "peak_reserved_mib": None,
        "base_alloc_mib": None,
        "phase_peak_mib": None,
        "loss_first": None,
        "loss_last": None,
        "optimizer": None,
        "build_s": None,
        "fit_s": None,
        "note": None,
        "error": None,
    }
    rec["env"] = C.environment(device)
    rec["env"]["lightning"] = pl.__version__
    try:
        import transformers

        rec["env"]["transformers"] = transformers.__version__
    except Exception as exc:  # noqa: BLE001
        rec["error"] = "unavailable: " + C.short_error(exc)
        return rec

    timer = StepTimer(args.warmup, device, args.deadline)
    try:
        t0 = time.time()
        pl.seed_everything(args.seed, verbose=False)
        module, note = _build_module(name, cfg, args, device)
        rec["note"] = note
        if args.compile_layers:
            compile_decoder_layers(module.model)
        rec["build_s"] = time.time() - t0
        params = list(module.parameters())  # a tied head is listed once
        rec["params"] = sum(p.numel() for p in params)
        rec["param_dtype"] = str(params[0].dtype).replace("torch.", "")

        steps = args.warmup + args.steps
        batches = make_batches(args, cfg["vocab_size"], steps)
        loader = DataLoader(
            [{"input_ids": b, "labels": b} for b in batches], batch_size=None, shuffle=False, num_workers=0
        )
        trainer = pl.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            precision=args.precision,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[timer],
        )
        t1 = time.time()
        try:
            trainer.fit(module, loader)
        finally:
            rec["fit_s"] = time.time() - t1
        if trainer.optimizers:
            fused = trainer.optimizers[0].defaults.get("fused")
            rec["optimizer"] = f"{type(trainer.optimizers[0]).__name__} ({'fused' if fused else 'default'})"
        if (name.startswith("liger") or name == "hf") and timer.liger_output is not None:
            rec["note"] = (rec["note"] or "") + f"; forward returned {timer.liger_output}"
        if timer.stopped_early:
            rec["note"] = (rec["note"] or "") + "; stopped early at the deadline"
    except Exception as exc:  # noqa: BLE001 - OOM or a provider bug: record it, the other providers run
        rec["error"] = ("OOM: " if C.is_oom(exc) else "") + C.short_error(exc)
    timer.fill(rec)
    return rec


def _build_module(
    name: str, cfg: Dict[str, Any], args: argparse.Namespace, device: torch.device
) -> Tuple[pl.LightningModule, Optional[str]]:
    """(LightningModule, note) with its model built directly on ``device`` from ``cfg``."""
    common = {"lr": args.lr, "weight_decay": 0.1, "warmup_steps": 0}
    if name in ("flce", "naive"):
        from lightning_flce.models import HFCausalLM

        with torch.device(device):
            module = HFCausalLM(
                config={"model_type": "llama", **cfg},
                flce_naive=name == "naive",
                flce_chunk_size=args.flce_chunk_size,
                **common,
            )
        return module, None
    if name == "hf":
        with torch.device(device):
            module = HFForwardLoss(cfg, **common)
        return module, None
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    extra = {} if name == "liger_all" else {"rope": False, "rms_norm": False, "swiglu": False}
    # Patch the classes before the model exists (0.8.5: replaces LlamaForCausalLM.forward with its lce_forward).
    apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, cross_entropy=False, **extra)
    with torch.device(device):
        module = HFForwardLoss(cfg, **common)
    try:
        from importlib import metadata

        version = metadata.version("liger_kernel")
    except Exception:  # noqa: BLE001
        version = "?"
    return module, f"liger_kernel {version}, patch kwargs {extra or 'defaults'}"


class HFForwardLoss(pl.LightningModule):
    """A plain LightningModule: the loss is whatever the HF model's ``forward(labels=...)`` returns (its own
    ``ForCausalLMLoss``, or Liger's fused loss once Liger has patched the class)."""

    def __init__(self, cfg: Dict[str, Any], lr: float, weight_decay: float, warmup_steps: int) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **cfg))
        self.last_output_kind: Optional[str] = None

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
        logits = getattr(out, "logits", None)
        self.last_output_kind = (
            f"{type(out).__name__} (logits {'None' if logits is None else tuple(logits.shape)})"
        )
        self.log("train/loss", out.loss.detach(), prog_bar=False)
        return out.loss

    def configure_optimizers(self) -> Dict[str, Any]:
        hp = self.hparams
        return adamw_with_warmup_cosine(
            self, lr=hp.lr, weight_decay=hp.weight_decay, warmup_steps=hp.warmup_steps
        )


class StepTimer(pl.Callback):
    """Synchronized wall time per optimizer step; peak memory of the timed steps, per phase: forward (to
    ``on_before_backward``), backward, and the rest (optimizer step, zero_grad), so a peak can be placed."""

    def __init__(self, warmup: int, device: torch.device, deadline: Optional[float]) -> None:
        self.warmup = warmup
        self.device = device
        self.deadline = deadline
        self.index = 0
        self.t0 = 0.0
        self.records: List[Dict[str, Any]] = []
        self.base_alloc: Optional[int] = None
        self.stopped_early = False
        self.liger_output: Optional[str] = None
        self.phase_peaks: Dict[str, int] = {}

    def _phase_done(self, phase: str) -> None:
        """Fold the peak since the last reset into ``phase``'s (timed steps only), and reset it."""
        if self.index >= self.warmup and self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), peak)
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        C.synchronize(self.device)
        if self.index == self.warmup and self.device.type == "cuda":
            self.base_alloc = torch.cuda.memory_allocated(self.device)
        if self.index >= self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        self._phase_done("forward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._phase_done("backward")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        C.synchronize(self.device)
        dt = time.perf_counter() - self.t0
        self._phase_done("optimizer")
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else math.nan
        self.records.append({"step": self.index, "s": dt, "loss": value, "timed": self.index >= self.warmup})
        self.index += 1
        kind = getattr(pl_module, "last_output_kind", None)
        if kind is not None:
            self.liger_output = kind
        if self.deadline is not None and time.time() > self.deadline and self.index > self.warmup:
            trainer.should_stop = True
            self.stopped_early = self.index < trainer.max_steps

    def fill(self, rec: Dict[str, Any]) -> None:
        rec["losses"] = [r["loss"] for r in self.records]
        rec["step_s"] = [r["s"] for r in self.records]
        if self.records:
            rec["loss_first"] = self.records[0]["loss"]
            rec["loss_last"] = self.records[-1]["loss"]
        timed = [r["s"] for r in self.records if r["timed"]]
        rec["timed_steps"] = len(timed)
        if timed:
            rec["median_step_s"] = C.percentile(timed, 50)
            rec["p20_step_s"] = C.percentile(timed, 20)
            rec["p80_step_s"] = C.percentile(timed, 80)
            rec["tokens_per_s"] = rec["tokens_per_step"] / rec["median_step_s"]
            rec["tokens_per_s_mean"] = rec["tokens_per_step"] * len(timed) / sum(timed)
        if self.device.type == "cuda":
            # Before the first timed step (an OOM in the warm-up) this is the peak since the process started.
            peak = max([torch.cuda.max_memory_allocated(self.device), *self.phase_peaks.values()])
            rec["peak_alloc_mib"] = peak / C.MIB
            rec["phase_peak_mib"] = {phase: value / C.MIB for phase, value in self.phase_peaks.items()}
            rec["peak_reserved_mib"] = torch.cuda.max_memory_reserved(self.device) / C.MIB
            if self.base_alloc is not None:
                rec["base_alloc_mib"] = self.base_alloc / C.MIB
            else:
                rec["note"] = (rec.get("note") or "") + "; no timed step: peak since the process started"


# ------------------------------------------------------------------------------------------------ parent
def run_subprocess(name: str, argv: List[str], timeout_s: Optional[float]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flce_e2e_") as tmp:
        result = Path(tmp) / "result.json"
        deadline = [] if timeout_s is None else ["--deadline", str(time.time() + 0.7 * timeout_s)]
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
        cmd += ["--worker", name, "--result-file", str(result), *deadline]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, timeout=timeout_s, check=False)
            rc: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
        if result.is_file():
            return json.loads(result.read_text())
        why = f"timed out after {time.time() - t0:.0f}s" if rc is None else f"worker exited with rc {rc}"
        return {"provider": name, "description": PROVIDERS[name], "error": why, "env": None}


def markdown(records: List[Dict[str, Any]], env: Dict[str, Any], meta: Dict[str, Any]) -> List[str]:
    cfg = meta["model_config"]
    lines = [
        "# End-to-end Lightning training: LM-head loss providers",
        "",
        *C.header_lines(env),
        f"- lightning {env.get('lightning')}, transformers {env.get('transformers')}",
        f"- model: LlamaForCausalLM, random init (seed {meta['seed']}), {meta['params']:,} parameters: "
        + ", ".join(f"{k}={v}" for k, v in cfg.items()),
        f"- batch {meta['batch_size']} x seq {meta['seq_len']} = {meta['tokens_per_step']} tokens per optimizer step,"
        f" precision {meta['precision']}, data {meta['data']}, AdamW lr {meta['lr']} (cosine, no warmup),"
        f" {meta['warmup']} warm-up + {meta['steps']} timed steps, isolation {meta['isolation']}",
        "- body: "
        + ("every decoder layer torch.compile'd" if meta["compile_layers"] else "eager")
        + "; the head and its loss eager; optimizer: "
        + ", ".join(sorted({str(r.get("optimizer")) for r in records if r.get("optimizer")}) or ["-"]),
        "- step time: torch.cuda.synchronize() at on_train_batch_start and on_train_batch_end (fwd, loss, bwd,"
        " optimizer step, Lightning); tokens/s = tokens per step / median timed step; peak = max_memory_allocated"
        " over the timed steps (includes weights and AdamW states = `base`); fwd / bwd / opt: the peak within"
        " forward (to on_before_backward), backward, and the optimizer step with the rest of the step",
        "",
        "```",
        *summary_lines(records),
        "```",
        "",
        "## Per provider",
        "",
    ]
    headers = ["provider", "tok/s", "x HF", "median s", "p20 / p80 s", "tok/s (mean)", "peak MiB",
               "fwd / bwd / opt MiB", "base MiB", "reserved MiB", "loss first", "loss last", "steps", "params", "error / note"]  # fmt: skip
    base = _by_name(records).get(BASELINE, {})
    rows = []
    for r in records:
        ratio = _ratio(r.get("tokens_per_s"), base.get("tokens_per_s"))
        p20, p80 = r.get("p20_step_s"), r.get("p80_step_s")
        phases = r.get("phase_peak_mib") or {}
        rows.append(
            [
                r["provider"],
                C.fmt(r.get("tokens_per_s"), ".0f"),
                C.fmt(ratio, ".3f"),
                C.fmt(r.get("median_step_s"), ".4f"),
                "-" if p20 is None else f"{p20:.4f} / {p80:.4f}",
                C.fmt(r.get("tokens_per_s_mean"), ".0f"),
                C.fmt(r.get("peak_alloc_mib"), ".0f"),
                " / ".join(C.fmt(phases.get(k), ".0f") for k in ("forward", "backward", "optimizer")),
                C.fmt(r.get("base_alloc_mib"), ".0f"),
                C.fmt(r.get("peak_reserved_mib"), ".0f"),
                C.fmt(r.get("loss_first"), ".4f"),
                C.fmt(r.get("loss_last"), ".4f"),
                r.get("timed_steps", 0),
                C.fmt(r.get("params")),
                "; ".join(x for x in (r.get("error"), r.get("note")) if x)[:400],
            ]
        )
    lines += C.md_table(headers, rows)
    lines += ["", "Providers:", ""] + [f"- `{r['provider']}`: {r.get('description')}" for r in records]
    lines += ["", "Losses per step (warm-up included):", ""]
    lines += [
        f"- `{r['provider']}`: " + ", ".join(f"{x:.4f}" for x in r.get("losses") or []) for r in records
    ]
    return lines


def _by_name(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    return {r["provider"]: r for r in records}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def summary_lines(records: List[Dict[str, Any]]) -> List[str]:
    """The compact table printed last (the device call returns only its output's tail)."""
    by = _by_name(records)
    base = by.get(BASELINE, {})
    rows = []
    for r in records:
        err = r.get("error")
        status = ("OOM" if "OOM" in err else "ERR") if err else "ok"
        rows.append(
            [
                r["provider"],
                C.fmt(r.get("tokens_per_s"), ".0f"),
                C.fmt(_ratio(r.get("tokens_per_s"), base.get("tokens_per_s")), ".3f"),
                C.fmt(r.get("median_step_s"), ".4f"),
                C.fmt(r.get("peak_alloc_mib"), ".0f"),
                C.fmt(_ratio(r.get("peak_alloc_mib"), base.get("peak_alloc_mib")), ".3f"),
                C.fmt(r.get("loss_first"), ".4f"),
                C.fmt(r.get("loss_last"), ".4f"),
                f"{r.get('timed_steps', 0)}",
                status,
            ]
        )
    headers = ["provider", "tok/s", "x HF", "step s", "peak MiB", "peak x HF", "loss 1st", "loss last",
               "timed", "status"]  # fmt: skip
    lines = C.text_table(headers, rows)
    f, lg = by.get("flce", {}), by.get("liger", {})
    checks = []
    if f.get("tokens_per_s") and base.get("tokens_per_s"):
        ratio = f["tokens_per_s"] / base["tokens_per_s"]
        checks.append(f"flce >= 1.05x HF tok/s: {'yes' if ratio >= 1.05 else 'NO'} ({ratio:.3f}x)")
    naive = by.get("naive", {})
    if f.get("tokens_per_s") and naive.get("tokens_per_s"):
        ratio = f["tokens_per_s"] / naive["tokens_per_s"]
        checks.append(f"flce / naive tok/s: {ratio:.3f}x")
    if f.get("tokens_per_s") and lg.get("tokens_per_s"):
        ratio = f["tokens_per_s"] / lg["tokens_per_s"]
        checks.append(f"flce >= liger tok/s: {'yes' if ratio >= 1.0 else 'NO'} ({ratio:.3f}x)")
    peaks = {r["provider"]: r["peak_alloc_mib"] for r in records if r.get("peak_alloc_mib") is not None}
    if f.get("peak_alloc_mib") is not None and len(peaks) > 1:
        lowest = min(peaks, key=peaks.get)
        checks.append(f"flce lowest peak: {'yes' if lowest == 'flce' else 'NO (' + lowest + ')'}")
    if checks:
        lines.append("goals: " + "; ".join(checks))
    for r in records:
        if r.get("error"):
            lines.append(f"error {r['provider']}: {r['error'][:300]}")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.worker:
        rec = run_worker(args, args.worker)
        if args.result_file:
            C.write_json(Path(args.result_file), rec)
        else:
            print(json.dumps(rec, indent=1, default=str))
        return 0

    t0 = time.time()
    out = C.out_dir()
    cfg = model_config(args)
    stem = "e2e" + args.tag
    meta: Dict[str, Any] = {
        "model_config": cfg,
        "params": param_count(cfg),
        "seed": args.seed,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_per_step": args.batch_size * args.seq_len,
        "precision": args.precision,
        "data": args.data,
        "lr": args.lr,
        "warmup": args.warmup,
        "steps": args.steps,
        "isolation": args.isolation,
        "compile_layers": args.compile_layers,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "args": {k: str(v) for k, v in vars(args).items()},
        "elapsed_s": 0.0,
    }
    print(
        f"[e2e] {meta['params']:,} params, batch {args.batch_size} x {args.seq_len}, {args.precision},"
        f" {args.warmup}+{args.steps} steps, providers {args.provider_list}, -> {out}/{stem}.{{json,md}}",
        flush=True,
    )
    order = list(args.provider_list)
    if args.isolation == "inprocess":
        # Liger patches transformers' Llama classes for the rest of the process: run it last.
        order.sort(key=lambda n: n.startswith("liger"))
    records: List[Dict[str, Any]] = []
    env: Dict[str, Any] = {}

    def flush() -> None:
        meta["elapsed_s"] = time.time() - t0
        header_env = env or {**C.environment(torch.device("cpu")), "device": args.device}
        C.write_json(out / f"{stem}.json", {"env": header_env, "meta": meta, "records": records})
        (out / f"{stem}.md").write_text("\n".join(markdown(records, header_env, meta)) + "\n")

    for i, name in enumerate(order):
        timeout = None
        if args.budget_s is not None:
            left = args.budget_s - (time.time() - t0)
            timeout = max(left / (len(order) - i), 20.0)
        print(f"\n[e2e] --- {name} (timeout {C.fmt(timeout, '.0f')} s)", flush=True)
        c0 = time.time()
        if args.isolation == "subprocess":
            rec = run_subprocess(name, raw, timeout)
        else:
            args.deadline = None if timeout is None else time.time() + 0.7 * timeout
            rec = run_worker(args, name)
            C.free_memory(torch.device(args.device))
        if rec.get("env") and not env:
            env = rec["env"]
        rec.pop("env", None)
        records.append(rec)
        print(
            f"[e2e] {name}: {C.fmt(rec.get('tokens_per_s'), '.0f')} tok/s, peak {C.fmt(rec.get('peak_alloc_mib'), '.0f')}"
            f" MiB, loss {C.fmt(rec.get('loss_first'), '.4f')} -> {C.fmt(rec.get('loss_last'), '.4f')}"
            f" ({time.time() - c0:.1f}s){' ERROR ' + rec['error'] if rec.get('error') else ''}",
            flush=True,
        )
        flush()
    flush()
    print(f"\n[e2e] {len(order)} providers in {time.time() - t0:.1f}s -> {out}/{stem}.{{json,md}}")
    print("\n".join(summary_lines(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
