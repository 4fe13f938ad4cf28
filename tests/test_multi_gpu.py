"""Two GPUs with NCCL: the vocab-parallel op, and Lightning's DDP, FSDP1 and FSDP2 with FLCEMixin.

Everything here is marked ``cuda`` and skips without 2 CUDA devices, except one CPU (gloo) run of the harness
itself (:func:`test_harness_smoke_on_cpu`: the ``fsdp1`` suite, ~10 s on 2 cores). Each suite starts this file twice as a script
(``--worker SUITE OUT_DIR [--device cpu]``) with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` set for a
free port (Lightning then uses the processes as they are and does not launch its own), and with NVLink
multicast switched off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``). The workers save their results; the tests compare them here.

Suites:

- ``op``: :func:`~lightning_flce.parallel.vocab_parallel_fused_linear_cross_entropy` over the 2 GPUs (V=50257:
  uneven 25129 + 25128 rows, N=4096, H=1024, 10% ignored targets) against ``fused_linear_cross_entropy`` on the
  full weight on one GPU and a float64 reference: loss, dX on both ranks, the dW (and d bias) shards at their
  rows. fp32 and bf16 inputs (mean, sum, none; label smoothing + z-loss + softcap + bias), bf16 autocast of fp32
  weights, :class:`~lightning_flce.parallel.VocabParallelHead` (loss and ``gather_logits`` over NCCL), and a
  ``DTensor`` weight on a CUDA mesh. The workers compute the errors on the GPU (the tensors are large) and save
  squared norms, combined here over the shards.
- ``deepspeed3``: Lightning ``DeepSpeedStrategy(stage=3)`` (skipped where ``deepspeed`` is not installed): the
  head weight is partitioned (``numel 0``) outside its module's forward; FLCEMixin computes the loss inside the
  head's own call, where ZeRO-3 has gathered it, so the op must see the whole ``[V, H]`` weight. DeepSpeed keeps
  gradients in its own buffers, so the mixin runs with ``flce_normalize="micro_batch"`` (the plain mean of each
  micro-batch) and one micro-batch per optimizer step (Lightning divides the loss by ``accumulate_grad_batches``
  and DeepSpeed's engine divides it again, so accumulation under DeepSpeed is not what this suite checks); the
  float64 reference averages the micro-batch means over the ranks, and rank 1's second micro-batch has no label
  at all (loss 0, zero gradient, the ZeRO-3 collectives still run). Gradients are read with
  ``deepspeed.utils.safe_get_full_grad``.
- ``ddp``, ``fsdp1``, ``fsdp2``: Lightning ``strategy="ddp"``, ``FSDPStrategy`` (FSDP1, FULL_SHARD, one unit per
  block: the embedding and the head, tied or not, stay in the root unit) and ``ModelParallelStrategy`` (FSDP2
  through ``TinyGPT.configure_model``) train a TinyGPT (V=83, odd, so the shards are uneven) with SGD for 2
  optimizer steps of 2 micro-batches per rank (``accumulate_grad_batches=2``); ranks and micro-batches hold very
  different numbers of labels (one micro-batch per step has none). Scenarios: tied fp32, untied fp32, tied
  ``bf16-mixed``. At each optimizer step every rank saves the logged ``train/loss`` and the full gradients (DDP:
  the replicas; FSDP1: ``summon_full_params(with_grads=True)``; FSDP2: ``DTensor.full_tensor()``) and what the
  fused op received as the head weight (it must be the whole ``[V, H]`` tensor).

The reference is one float64 process on the CPU, on the same global batch (the 8 samples of the step, i.e. both
ranks' micro-batches) with the same SGD update in between, so step 2 also checks step 1's update of the
sharded parameters. Tolerances, as relative L2 errors per tensor: fp32 ``1e-4`` (fp32 rounding through this
2-layer model and one all-reduce/reduce-scatter is ~1e-6; TF32 is switched off in the workers; a wrong token
normalization or a wrong shard is off by > 1e-2); ``bf16-mixed`` ``5e-2`` for gradients and ``1e-2`` for the
loss (bf16 logits and, under FSDP1, bf16 parameters and gradient reduction: ~1e-2; a normalization error here
is > 1e-1). The op suite uses the tolerances of ``test_vocab_parallel.py`` (fp32: 1e-5 against float64 and the
single-GPU op; bf16: no worse than 1.5x the single-GPU op's own error plus 1e-3).

Every suite also runs on 2 CPU processes (gloo), which is how this file was checked without GPUs (FSDP1 through
a ``FSDPStrategy`` subclass that wraps with ``device_id="cpu"``; the op suite at a small size)::

    cd tests && FLCE_MULTI_GPU_SMALL=1 python -c "import pathlib, tempfile, test_multi_gpu as t; \
        r = t.launch('op', pathlib.Path(tempfile.mkdtemp()), device='cpu'); \
        [t.check_op_case(n, [x[n] for x in r]) for n in t.OP_CASES]"
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ranks import cpu_fsdp_strategy, error_in_step, free_port, run_ranks, torchrun_env

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _key, _value in NO_MULTICAST.items():  # also for anything this process starts
    os.environ[_key] = _value

WORLD = 2
TIMEOUT_S = 170  # per suite (one launch of 2 processes); the cases of a suite take < 60 s each on H200s

# ---- Lightning suites -------------------------------------------------------------------------------------
VOCAB = 83
SEQ = 16
D_MODEL = 32
STEPS = 2
ACCUMULATE = 2
MICRO_BATCH = 2
NUM_SAMPLES = STEPS * ACCUMULATE * WORLD * MICRO_BATCH  # 16
LR = 0.5
ALL_IGNORED = (5, 7, 12)  # step 1: rank 1's 2nd micro-batch ([5, 7]); step 2: half of rank 0's 2nd ([12, 14])
SCENARIOS = {
    "tied-fp32": {"tie_embeddings": True, "precision": "32-true"},
    "untied-fp32": {"tie_embeddings": False, "precision": "32-true"},
    "tied-bf16": {"tie_embeddings": True, "precision": "bf16-mixed"},
}
FP32_REL = 1e-4
BF16_REL = 5e-2
BF16_LOSS_REL = 1e-2

# ---- op suite ---------------------------------------------------------------------------------------------
# FLCE_MULTI_GPU_SMALL=1 (set by the CPU smoke run of the op worker): the same cases at a size a CPU runs quickly
_SMALL = os.environ.get("FLCE_MULTI_GPU_SMALL") == "1"
OP_TOKENS = 256 if _SMALL else 4096
OP_HIDDEN = 32 if _SMALL else 1024
OP_VOCAB = 1001 if _SMALL else 50257  # uneven: 25129 + 25128 rows (501 + 500)
OP_CHUNK = 64 if _SMALL else 1024
OP_FEATURES = {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0}
OP_CASES = {
    "fp32-mean": {"dtype": "fp32", "reduction": "mean"},
    "fp32-sum": {"dtype": "fp32", "reduction": "sum"},
    "fp32-none": {"dtype": "fp32", "reduction": "none"},
    "fp32-all-bias-mean": {"dtype": "fp32", "reduction": "mean", "features": True, "bias": True},
    "fp32-default-chunk": {"dtype": "fp32", "reduction": "mean", "chunk_size": None},
    # fp64: the softmax runs in fp64 (the PyTorch shard twins, also on CUDA)
    "fp64-all-bias-none": {"dtype": "fp64", "reduction": "none", "features": True, "bias": True},
    "bf16-mean": {"dtype": "bf16", "reduction": "mean"},
    "bf16-none": {"dtype": "bf16", "reduction": "none"},
    "bf16-all-bias-mean": {"dtype": "bf16", "reduction": "mean", "features": True, "bias": True},
    "autocast-bf16-mean": {"dtype": "fp32", "reduction": "mean", "autocast": True},
    "module": {"dtype": "fp32", "reduction": "mean", "kind": "module", "bias": True},
    "dtensor": {"dtype": "fp32", "reduction": "sum", "kind": "dtensor"},
    # each rank passes its half of the tokens; its dX half is gathered for the comparison
    "sequence-parallel-all-bias-none": {
        "dtype": "fp32",
        "reduction": "none",
        "kind": "sequence_parallel",
        "features": True,
        "bias": True,
    },
}
OP_FP32_REL = 1e-5
# fp64 rounding (1.1e-16) grown over V = 50257 and H = 1024 stays near 1e-14; any fp32 step shows as >= 1e-8
OP_FP64_REL = 1e-11

HERE = Path(__file__).resolve()
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def rel(err_sq: float, ref_sq: float) -> float:
    return math.sqrt(err_sq / ref_sq) if ref_sq > 0 else math.sqrt(err_sq)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double().to(actual.device)
    return rel(float((actual - expected).square().sum()), float(expected.square().sum()))


# ===========================================================================================================
# Lightning workers
# ===========================================================================================================


def samples() -> list[dict[str, torch.Tensor]]:
    """Sample i ignores its first 3*i % SEQ labels; the samples in ALL_IGNORED have no label at all.

    The DistributedSampler (no shuffling) gives rank r the samples r, r+2, ...: micro-batch k of rank r holds samples
    4k + r and 4k + r + 2, and optimizer step s uses samples 8s .. 8s + 7."""
    generator = torch.Generator().manual_seed(3)
    data = []
    for index in range(NUM_SAMPLES):
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[: SEQ if index in ALL_IGNORED else (3 * index) % SEQ] = -100
        data.append({"input_ids": tokens[:-1], "labels": labels})
    return data


def _model_class():
    from lightning_flce.models.gpt import TinyGPT

    class SGDTinyGPT(TinyGPT):
        """TinyGPT with plain SGD (the reference replays the same update in float64)."""

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return SGDTinyGPT


def tiny_gpt(tie_embeddings: bool, **mixin_kwargs):
    torch.manual_seed(0)
    return _model_class()(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        n_layers=2,
        n_heads=2,
        max_seq_len=SEQ,
        tie_embeddings=tie_embeddings,
        **mixin_kwargs,
    )


def suite_accumulation(suite: str) -> int:
    """Micro-batches per optimizer step (see the module docstring for DeepSpeed's 1)."""
    return 1 if suite == "deepspeed3" else ACCUMULATE


def suite_normalize(suite: str) -> str:
    return "micro_batch" if suite == "deepspeed3" else "step"


def micro_batch_samples(rank: int, index: int) -> list[int]:
    """The samples of micro-batch ``index`` of ``rank`` (DistributedSampler without shuffling, batch 2)."""
    return [rank + 2 * WORLD * index, rank + 2 * WORLD * index + WORLD]


def _clean(name: str) -> str:
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def _full_grads(trainer, pl_module) -> dict[str, torch.Tensor]:
    """Every gradient as the full tensor on the CPU (a collective under FSDP: all ranks run this in order)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy):
        from deepspeed.utils import safe_get_full_grad

        # a collective under ZeRO-3 (all ranks, same order); the fp32 gradient of the whole parameter
        full = {_clean(n): safe_get_full_grad(p) for n, p in pl_module.named_parameters() if p.requires_grad}
        return {n: g.detach().float().cpu().clone() for n, g in full.items() if g is not None}
    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.strategy.model, with_grads=True, writeback=False):
            return {
                _clean(n): p.grad.detach().float().cpu().clone()
                for n, p in pl_module.named_parameters()
                if p.grad is not None
            }
    grads = {}
    for name, param in pl_module.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[_clean(name)] = grad.detach().float().cpu().clone()
    return grads


def _make_callback():
    from lightning.pytorch.callbacks import Callback

    class SaveSteps(Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.batches: list[list[int]] = []  # the first token of each sample of each micro-batch

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batches.append(batch["input_ids"][:, 0].tolist())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.steps.append({"grads": _full_grads(trainer, pl_module), "global_step": trainer.global_step})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.steps and "loss" not in self.steps[-1] and trainer.global_step == len(self.steps):
                self.steps[-1]["loss"] = float(trainer.callback_metrics["train/loss_step"])

    return SaveSteps()


def _strategy(suite: str, device: str):
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    backend = "gloo" if device == "cpu" else None
    if suite == "ddp":
        return DDPStrategy(process_group_backend=backend)
    if suite == "fsdp1":
        from lightning_flce.models.gpt import _Block

        options = dict(sharding_strategy="FULL_SHARD", auto_wrap_policy={_Block})
        # on the CPU: FSDP1 through a subclass that wraps with device_id="cpu" (ranks.cpu_fsdp_strategy)
        return cpu_fsdp_strategy(**options) if device == "cpu" else FSDPStrategy(**options)
    if suite == "fsdp2":
        return ModelParallelStrategy(
            data_parallel_size=WORLD, tensor_parallel_size=1, process_group_backend=backend
        )
    if suite == "deepspeed3":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(
            stage=3, logging_batch_size_per_gpu=MICRO_BATCH, process_group_backend=backend
        )
    raise ValueError(suite)


def run_lightning_scenario(suite: str, name: str, device: str) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    import lightning_flce.head

    options = SCENARIOS[name]
    seen = []
    original = lightning_flce.head.fused_linear_cross_entropy

    def recording_op(input, weight, *args, **kwargs):
        seen.append((type(weight).__name__, tuple(weight.shape), str(weight.dtype)))
        return original(input, weight, *args, **kwargs)

    lightning_flce.head.fused_linear_cross_entropy = recording_op
    save = _make_callback()
    trainer = pl.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=WORLD,
        strategy=_strategy(suite, device),
        precision=options["precision"],
        max_steps=STEPS,
        accumulate_grad_batches=suite_accumulation(suite),
        use_distributed_sampler=False,  # Lightning's would shuffle the training samples
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[save],
    )
    model = tiny_gpt(options["tie_embeddings"], flce_normalize=suite_normalize(suite))
    try:
        sampler = DistributedSampler(
            samples(), num_replicas=WORLD, rank=int(os.environ["RANK"]), shuffle=False
        )
        trainer.fit(model, DataLoader(samples(), batch_size=MICRO_BATCH, sampler=sampler))
    except Exception as exc:  # recorded: the test reports it
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    finally:
        lightning_flce.head.fused_linear_cross_entropy = original
    inner = trainer.lightning_module
    return {
        "error": None,
        "steps": save.steps,
        "batches": save.batches,
        "op_weights": seen,
        "world_size": trainer.world_size,
        "tied": inner.lm_head.weight is inner.tok_emb.weight,
        "head_type": type(inner.lm_head).__name__,
        "block_type": type(inner.blocks[0]).__name__,
        "root_type": type(trainer.strategy.model).__name__,
    }


def lightning_worker(suite: str, out_dir: str, device: str, scenarios: list[str]) -> None:
    if device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    results = {}
    for name in scenarios:
        start = time.perf_counter()
        results[name] = run_lightning_scenario(suite, name, device)
        results[name]["seconds"] = time.perf_counter() - start
        print(f"[rank {os.environ['RANK']}] {suite}/{name}: {results[name]['seconds']:.1f} s", flush=True)
    torch.save(results, os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))


def reference_steps(
    tie_embeddings: bool, normalize: str = "step", accumulate: int = ACCUMULATE
) -> list[dict]:
    """Loss and gradients of the 2 optimizer steps in one float64 process on the CPU (SGD in between).

    The loss is the mean over the step's labels (what FLCEMixin logs); the gradient is that of the loss
    (``normalize="step"``) or the mean over ranks and micro-batches of each micro-batch's mean (``"micro_batch"``,
    0 for a micro-batch without labels)."""
    model = tiny_gpt(tie_embeddings).double()
    data = samples()
    out = []

    def token_loss_sum(indices: list[int]) -> tuple[torch.Tensor, int]:
        input_ids = torch.stack([data[i]["input_ids"] for i in indices])
        labels = torch.stack([data[i]["labels"] for i in indices]).reshape(-1)
        logits = model(input_ids).reshape(-1, VOCAB)
        return F.cross_entropy(logits, labels, reduction="sum"), int((labels != -100).sum())

    for step in range(STEPS):
        parts = [
            token_loss_sum(micro_batch_samples(rank, index))
            for index in range(step * accumulate, (step + 1) * accumulate)
            for rank in range(WORLD)
        ]
        model.zero_grad(set_to_none=True)
        total_tokens = sum(n for _, n in parts)
        loss = sum(s for s, _ in parts) / total_tokens
        if normalize == "step":
            loss.backward()
        else:
            (sum(s / max(n, 1) for s, n in parts) / len(parts)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append({"loss": loss.item(), "grads": grads})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
    return out


def check_lightning_scenario(suite: str, name: str, ranks: list[dict]) -> dict:
    """Asserts one scenario's results on every rank against the float64 reference; returns the errors."""
    options = SCENARIOS[name]
    fp32 = options["precision"] == "32-true"
    grad_tol, loss_tol = (FP32_REL, FP32_REL) if fp32 else (BF16_REL, BF16_LOSS_REL)
    accumulate = suite_accumulation(suite)
    reference = reference_steps(options["tie_embeddings"], suite_normalize(suite), accumulate)
    worst = {"loss": 0.0, "grad": 0.0, "grad_name": None}
    for rank, saved in enumerate(ranks):
        assert saved["error"] is None, f"rank {rank}: {saved['error']}"
        assert saved["world_size"] == WORLD
        if suite != "fsdp1":  # (FSDP1 swaps the parameters; the gradient keys below show the tie anyway)
            assert saved["tied"] is options["tie_embeddings"]
        # the op ran once per micro-batch on the whole [V, H] weight, never on a shard or a DTensor
        assert len(saved["op_weights"]) == STEPS * accumulate, saved["op_weights"]
        for type_name, shape, _dtype in saved["op_weights"]:
            assert type_name in ("Parameter", "Tensor") and shape == (VOCAB, D_MODEL), saved["op_weights"]
        if suite == "fsdp1":
            # the head (tied or not) is in the root FSDP unit: not wrapped by itself
            assert saved["head_type"] == "Linear", saved["head_type"]
            assert saved["block_type"] == "FullyShardedDataParallel", saved["block_type"]
            assert saved["root_type"] == "FullyShardedDataParallel", saved["root_type"]
        assert len(saved["steps"]) == STEPS, [s.get("global_step") for s in saved["steps"]]
        for step, (got, want) in enumerate(zip(saved["steps"], reference)):
            loss_err = abs(got["loss"] - want["loss"]) / abs(want["loss"])
            worst["loss"] = max(worst["loss"], loss_err)
            assert loss_err < loss_tol, f"rank {rank} step {step}: loss {got['loss']} vs {want['loss']}"
            assert got["grads"].keys() == want["grads"].keys(), (got["grads"].keys(), want["grads"].keys())
            for key, ref_grad in want["grads"].items():
                err = relative_error(got["grads"][key], ref_grad)
                if err > worst["grad"]:
                    worst.update(grad=err, grad_name=f"step {step} {key}")
                assert err < grad_tol, (
                    f"rank {rank} step {step} {key}: relative error {err:.3g} >= {grad_tol}"
                )
    return worst


# ===========================================================================================================
# op worker (vocab-parallel op over NCCL)
# ===========================================================================================================


def _op_problem(spec: dict, device: torch.device):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[spec["dtype"]]
    gen = torch.Generator(device="cpu").manual_seed(11)
    x = torch.randn(OP_TOKENS, OP_HIDDEN, generator=gen)
    weight = torch.randn(OP_VOCAB, OP_HIDDEN, generator=gen) * (2.0 / OP_HIDDEN**0.5)
    bias = torch.randn(OP_VOCAB, generator=gen) * 0.5
    target = torch.randint(0, OP_VOCAB, (OP_TOKENS,), generator=gen)
    target[torch.rand(OP_TOKENS, generator=gen) < 0.1] = -100
    grad_output = {"mean": torch.tensor(1.0), "sum": torch.tensor(0.75)}.get(spec["reduction"])
    if grad_output is None:
        grad_output = torch.randn(OP_TOKENS, generator=gen)
    to = {"device": device}
    return (
        x.to(dtype=dtype, **to),
        weight.to(dtype=dtype, **to),
        target.to(**to),
        bias.to(dtype=dtype, **to) if spec.get("bias") else None,
        grad_output.to(**to),
    )


def _op_kwargs(spec: dict) -> dict:
    kwargs = dict(OP_FEATURES) if spec.get("features") else {}
    kwargs["reduction"] = spec["reduction"]
    return kwargs


def _backward(loss: torch.Tensor, grad_output: torch.Tensor) -> None:
    (loss * grad_output.to(loss.dtype)).sum().backward()


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _sq(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).square().sum())


def _norm_sq(a: torch.Tensor) -> float:
    return float(a.double().square().sum())


def run_op_case(spec: dict, rank: int, device: torch.device) -> dict:
    import torch.distributed as dist

    from lightning_flce import fused_linear_cross_entropy
    from lightning_flce.parallel import (
        VocabParallelHead,
        vocab_parallel_fused_linear_cross_entropy,
        vocab_shard_range,
    )

    sys.path.insert(0, str(HERE.parent))
    from reference import reference_loss

    kind = spec.get("kind", "loss")
    x, weight, target, bias, grad_output = _op_problem(spec, device)
    start, end = vocab_shard_range(OP_VOCAB, WORLD, rank)
    kwargs = _op_kwargs(spec)
    chunk = spec.get("chunk_size", OP_CHUNK)
    autocast = spec.get("autocast", False)

    # the vocab-parallel op on this rank's rows
    xv = _leaf(x)
    extra = {}
    if kind == "module":
        linear = torch.nn.Linear(OP_HIDDEN, OP_VOCAB, bias=True, device=device)
        with torch.no_grad():
            linear.weight.copy_(weight)
            linear.bias.copy_(bias)
        head = VocabParallelHead.from_linear(linear)
        assert (head.vocab_start, head.vocab_start + head.weight.shape[0]) == (start, end)
        loss = head.loss(xv, target, chunk_size=chunk, **kwargs)
        _backward(loss, grad_output)
        dw, db = head.weight.grad, head.bias.grad
        logits = head.gather_logits(x[:256])
        extra["gather_logits_rel"] = relative_error(logits, F.linear(x[:256], weight, bias))
        del linear
    elif kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_flce._compat import dtensor_api

        Shard, distribute_tensor = dtensor_api().Shard, dtensor_api().distribute_tensor

        mesh = init_device_mesh("cuda" if device.type == "cuda" else "cpu", (WORLD,))
        w_dt = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        loss = vocab_parallel_fused_linear_cross_entropy(xv, w_dt, target, chunk_size=chunk, **kwargs)
        _backward(loss, grad_output)
        extra["grad_type"] = type(w_dt.grad).__name__
        extra["placements"] = str(w_dt.grad.placements)
        dw, db = w_dt.grad.to_local(), None
    elif kind == "sequence_parallel":
        rows = slice(rank * OP_TOKENS // WORLD, (rank + 1) * OP_TOKENS // WORLD)
        xl = _leaf(x[rows])
        wv, bv = _leaf(weight[start:end]), _leaf(None if bias is None else bias[start:end])
        local_loss = vocab_parallel_fused_linear_cross_entropy(
            xl, wv, target[rows], bv, chunk_size=chunk, sequence_parallel=True, **kwargs
        )
        _backward(local_loss, grad_output[rows])
        # every rank's token rows, in rank order: the full per-token loss and dX
        parts = (
            [torch.empty_like(local_loss) for _ in range(WORLD)],
            [torch.empty_like(xl.grad) for _ in range(WORLD)],
        )
        dist.all_gather(parts[0], local_loss.detach())
        dist.all_gather(parts[1], xl.grad)
        loss, xv.grad = torch.cat(parts[0]), torch.cat(parts[1])
        dw, db = wv.grad, bv.grad
    else:
        wv, bv = _leaf(weight[start:end]), _leaf(None if bias is None else bias[start:end])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = vocab_parallel_fused_linear_cross_entropy(xv, wv, target, bv, chunk_size=chunk, **kwargs)
        _backward(loss, grad_output)
        dw, db = wv.grad, None if bv is None else bv.grad
    dist.barrier()
    vp = {"loss": loss.detach(), "dx": xv.grad, "dw": dw, "db": db}

    # the single-device op on the full weight (this GPU), and float64
    xs, ws, bs = _leaf(x), _leaf(weight), _leaf(bias)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        single_loss = fused_linear_cross_entropy(xs, ws, target, bs, chunk_size=OP_CHUNK, **kwargs)
    _backward(single_loss, grad_output)
    single = {"loss": single_loss.detach(), "dx": xs.grad, "dw": ws.grad[start:end], "db": None}
    if bs is not None:
        single["db"] = bs.grad[start:end]
    del ws
    xr, wr, br = _leaf(x.double()), _leaf(weight.double()), _leaf(None if bias is None else bias.double())
    ref_loss = reference_loss(xr, wr, target, br, **kwargs)
    _backward(ref_loss, grad_output.double())
    ref = {"loss": ref_loss.detach(), "dx": xr.grad, "dw": wr.grad[start:end], "db": None}
    if br is not None:
        ref["db"] = br.grad[start:end]
    del wr

    out = {
        "rows": (start, end),
        "dtypes": {k: None if v is None else str(v.dtype) for k, v in vp.items()},
        "single_dtypes": {k: None if v is None else str(v.dtype) for k, v in single.items()},
        **extra,
    }
    # squared norms: the dW/d bias shards are combined over the ranks by the test
    for key in ("loss", "dx", "dw", "db"):
        if vp[key] is None:
            out[key] = None
            continue
        out[key] = {
            "vp_vs_ref": _sq(vp[key], ref[key]),
            "vp_vs_single": _sq(vp[key], single[key]),
            "single_vs_ref": _sq(single[key], ref[key]),
            "ref": _norm_sq(ref[key]),
            "single": _norm_sq(single[key]),
        }
    return out


def _join_op_group(device_name: str) -> tuple[int, torch.device]:
    """An op worker's process group (gloo on the CPU, NCCL bound to this rank's GPU): its rank and device."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if device_name == "cpu":
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=device)  # bound: barriers and DTensor use this GPU
    return rank, device


def op_worker(out_dir: str, device_name: str, cases: list[str]) -> None:
    import torch.distributed as dist

    rank, device = _join_op_group(device_name)
    results = {}
    for name in cases:
        start = time.perf_counter()
        try:
            results[name] = run_op_case(OP_CASES[name], rank, device)
        except Exception as exc:
            import traceback

            results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
        results[name]["seconds"] = time.perf_counter() - start
        print(f"[rank {rank}] op/{name}: {results[name]['seconds']:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


# A bad argument on one rank only, over NCCL: every rank raises (the bad rank its own error, the other one of the
# same type naming it), nobody hangs in a collective, and the group stays usable (a good call after them).
# "input_on_cpu" also needs the agreement table on the GPU for the rank whose input is not on it (NCCL).
# name: (bad rank, error type, message on the bad rank; the same message on both ranks when shared)
OP_ERROR_CASES = {
    "float_target": (1, "TypeError", "target must hold integer class indices", False),
    "weight_dtype": (1, "TypeError", "weight dtype torch.float64 differs from input dtype", False),
    "input_on_cpu": (1, "ValueError", "weight is on cuda:1 but input is on cpu", False),
    "sequence_parallel_rank0_only": (0, "ValueError", "disagree on sequence_parallel", True),
}


def run_op_error_case(name: str, rank: int, device: torch.device) -> dict:
    """One :data:`OP_ERROR_CASES` call (no backward); returns this rank's error, or None."""
    from lightning_flce.parallel import vocab_parallel_fused_linear_cross_entropy, vocab_shard_range

    x, weight, target, _, _ = _op_problem({"dtype": "fp32", "reduction": "mean"}, device)
    start, end = vocab_shard_range(OP_VOCAB, WORLD, rank)
    w_shard = weight[start:end]
    bad = rank == OP_ERROR_CASES[name][0]
    kwargs = {}
    if bad and name == "float_target":
        target = target.float()
    elif bad and name == "weight_dtype":
        w_shard = w_shard.double()
    elif bad and name == "input_on_cpu":
        x = x.cpu()
    elif bad and name == "sequence_parallel_rank0_only":
        rows = slice(rank * OP_TOKENS // WORLD, (rank + 1) * OP_TOKENS // WORLD)
        x, target, kwargs = x[rows], target[rows], {"sequence_parallel": True}
    return {
        "error": error_in_step(
            lambda: vocab_parallel_fused_linear_cross_entropy(x, w_shard, target, **kwargs)
        )
    }


def run_head_state(rank: int, device: torch.device) -> dict:
    """A CUDA ``VocabParallelHead``'s states over NCCL: its rows, ``full_state_dict`` (an all-gather of uneven
    shards), rank 0's ``state_dict`` loaded on every rank, and ``load_full_state_dict`` of a whole head."""
    import torch.distributed as dist

    from lightning_flce.parallel import VocabParallelHead

    torch.manual_seed(0)
    head = VocabParallelHead(OP_HIDDEN, OP_VOCAB, bias=True, device=device)
    result = {
        "rows": (head.vocab_start, head.vocab_start + head.weight.shape[0]),
        "device": str(head.weight.device),
        "weight": head.weight.detach().cpu().clone(),
        "bias": head.bias.detach().cpu().clone(),
    }
    full = head.full_state_dict()
    result["full_device"] = str(full["weight"].device)
    result["full_state"] = {name: value.cpu() for name, value in full.items()}
    # as saved to a file: tensors on the CPU, and the rows it holds (a dict, its extra state)
    state = [
        {k: v.cpu() if torch.is_tensor(v) else v for k, v in head.state_dict().items()} if rank == 0 else None
    ]
    dist.broadcast_object_list(state, src=0)
    result["load_error"] = error_in_step(lambda: head.load_state_dict(state[0]))
    result["unchanged"] = torch.equal(head.weight.cpu(), result["weight"])
    numbered = {
        "weight": torch.arange(OP_VOCAB * OP_HIDDEN * 1.0).view(OP_VOCAB, OP_HIDDEN),
        "bias": torch.arange(OP_VOCAB * 1.0),
    }
    head.load_full_state_dict(numbered)  # CPU tensors into the CUDA shards
    result["numbered_full"] = {name: value.cpu() for name, value in head.full_state_dict().items()}
    return result


def op_errors_worker(out_dir: str, device_name: str) -> None:
    import torch.distributed as dist

    from lightning_flce.parallel import vocab_parallel_fused_linear_cross_entropy, vocab_shard_range

    rank, device = _join_op_group(device_name)
    results = {name: run_op_error_case(name, rank, device) for name in OP_ERROR_CASES}
    results["head_state"] = run_head_state(rank, device)
    x, weight, target, _, _ = _op_problem({"dtype": "fp32", "reduction": "mean"}, device)
    start, end = vocab_shard_range(OP_VOCAB, WORLD, rank)
    loss = vocab_parallel_fused_linear_cross_entropy(x, weight[start:end], target)
    results["after"] = {"loss": float(loss), "single": float(F.cross_entropy(F.linear(x, weight), target))}
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def check_op_case(name: str, ranks: list[dict]) -> dict:
    spec = OP_CASES[name]
    for rank, r in enumerate(ranks):
        assert r.get("error") is None, f"rank {rank}: {r.get('error')}"
    half = (OP_VOCAB + 1) // 2
    assert [r["rows"] for r in ranks] == [(0, half), (half, OP_VOCAB)]
    errors = {}
    for key in ("loss", "dx", "dw", "db"):
        if ranks[0][key] is None:
            assert all(r[key] is None for r in ranks), key
            continue
        if key in ("dw", "db"):  # shards: sum the squared norms over the ranks
            parts = [{k: sum(r[key][k] for r in ranks) for k in ranks[0][key]}]
        else:  # replicated: every rank on its own
            parts = [r[key] for r in ranks]
        for part in parts:
            e = {
                "vp_vs_ref": rel(part["vp_vs_ref"], part["ref"]),
                "vp_vs_single": rel(part["vp_vs_single"], part["single"]),
                "single_vs_ref": rel(part["single_vs_ref"], part["ref"]),
            }
            errors[key] = {k: max(v, errors.get(key, {}).get(k, 0.0)) for k, v in e.items()}
    for r in ranks:
        assert r["loss"] is not None and r["dx"] is not None and r["dw"] is not None
        assert r["dtypes"]["loss"] == ("torch.float64" if spec["dtype"] == "fp64" else "torch.float32")
        assert r["dtypes"]["dx"] == r["single_dtypes"]["dx"], (r["dtypes"], r["single_dtypes"])
        assert r["dtypes"]["dw"] == r["single_dtypes"]["dw"], (r["dtypes"], r["single_dtypes"])
    low_precision = spec["dtype"] == "bf16" or spec.get("autocast")
    for key, e in errors.items():
        if not low_precision:
            tol = OP_FP64_REL if spec["dtype"] == "fp64" else OP_FP32_REL
            assert e["vp_vs_ref"] < tol, (key, e)
            assert e["vp_vs_single"] < 2 * tol, (key, e)
        else:
            # bf16: both are a bf16 rounding away from float64; the vocab-parallel op must be no worse
            assert e["vp_vs_ref"] <= 1.5 * e["single_vs_ref"] + 1e-3, (key, e)
            assert e["vp_vs_ref"] < 2e-2, (key, e)
    if spec.get("kind") == "module":
        for r in ranks:
            assert r["gather_logits_rel"] < 1e-6, r["gather_logits_rel"]
    if spec.get("kind") == "dtensor":
        for r in ranks:
            assert r["grad_type"] == "DTensor" and r["placements"] == "(Shard(dim=0),)", r
    return errors


# ===========================================================================================================
# Launch
# ===========================================================================================================


def launch(suite: str, out_dir: Path, device: str = "cuda", only: list[str] | None = None) -> list[dict]:
    """Runs ``suite`` on 2 processes (this file with ``--worker``); returns each rank's saved results."""
    port = free_port()
    command = [HERE, "--worker", suite, out_dir, "--device", device]
    if only:
        command += ["--only", ",".join(only)]

    def env(rank: int) -> dict:
        threads = "1" if device == "cpu" else os.environ.get("OMP_NUM_THREADS", "4")
        return torchrun_env(
            rank,
            WORLD,
            port,
            OMP_NUM_THREADS=threads,
            TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
            **NO_MULTICAST,
        )

    return run_ranks(
        WORLD,
        lambda rank: command,
        out_dir,
        TIMEOUT_S,
        env=env,
        cwd=out_dir,
        label=f"suite {suite}",
        echo=True,
    )


@pytest.fixture(scope="module")
def suite_results(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(suite: str) -> list[dict]:
        if suite not in cache:
            cache[suite] = launch(suite, tmp_path_factory.mktemp(suite))
        return cache[suite]

    return get


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.parametrize("name", list(OP_CASES))
def test_vocab_parallel_op_nccl(suite_results, name):
    errors = check_op_case(name, [r[name] for r in suite_results("op")])
    print(
        f"[multi_gpu] op {name}:", {k: {kk: f"{vv:.1e}" for kk, vv in v.items()} for k, v in errors.items()}
    )


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.parametrize("name", list(OP_ERROR_CASES))
def test_vocab_parallel_op_one_rank_errors_nccl(suite_results, name):
    bad, kind, message, shared = OP_ERROR_CASES[name]
    ranks = suite_results("op_errors")
    for rank, r in enumerate(ranks):
        error = r[name]["error"]
        assert error is not None, f"rank {rank} did not raise"
        if shared or rank == bad:
            assert error.startswith(f"{kind}:") and message in error, (rank, error)
        else:
            assert error.startswith(f"{kind}: rank(s) [{bad}] of the vocab-parallel group failed"), (
                rank,
                error,
            )
    for r in ranks:  # the group still works
        assert abs(r["after"]["loss"] - r["after"]["single"]) < 1e-4 * abs(r["after"]["single"]), r["after"]


@pytest.mark.cuda
@needs_two_gpus
def test_vocab_parallel_head_state_nccl(suite_results):
    """full_state_dict gathers the uneven shards in row order on every rank's GPU; a rank's state_dict
    loads only on its own rank (the rows it records); load_full_state_dict copies each rank's rows."""
    ranks = [r["head_state"] for r in suite_results("op_errors")]
    half = (OP_VOCAB + 1) // 2
    assert [r["rows"] for r in ranks] == [(0, half), (half, OP_VOCAB)]
    weight = torch.cat([r["weight"] for r in ranks])
    bias = torch.cat([r["bias"] for r in ranks])
    for rank, r in enumerate(ranks):
        assert r["device"] == r["full_device"] == f"cuda:{rank}"
        assert torch.equal(r["full_state"]["weight"], weight) and torch.equal(r["full_state"]["bias"], bias)
        assert torch.equal(
            r["numbered_full"]["weight"], torch.arange(OP_VOCAB * OP_HIDDEN * 1.0).view(OP_VOCAB, -1)
        )
        assert torch.equal(r["numbered_full"]["bias"], torch.arange(OP_VOCAB * 1.0))
        assert r["unchanged"]
    assert ranks[0]["load_error"] is None
    assert ranks[1]["load_error"].startswith("ValueError") and "state is per rank" in ranks[1]["load_error"]


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("suite", ["ddp", "fsdp1", "fsdp2", "deepspeed3"])
def test_lightning_two_steps_equal_one_process(suite_results, suite, scenario):
    if suite == "deepspeed3":
        pytest.importorskip("deepspeed")
    ranks = [r[scenario] for r in suite_results(suite)]
    worst = check_lightning_scenario(suite, scenario, ranks)
    print(f"[multi_gpu] {suite} {scenario}: {ranks[0]['seconds']:.1f} s, worst relative errors {worst}")


@pytest.mark.slow
def test_harness_smoke_on_cpu(tmp_path):
    """The worker/launcher/check path on 2 CPU processes (gloo), with the suite nothing else runs on the CPU:
    Lightning's FSDPStrategy (FSDP1, through a subclass that wraps on the CPU, see :func:`_strategy`), all three
    scenarios, 2 steps each vs float64. (The op, ddp and fsdp2 suites ran on the CPU too, by hand.)"""
    ranks = launch("fsdp1", tmp_path, device="cpu")
    for name in SCENARIOS:
        check_lightning_scenario("fsdp1", name, [r[name] for r in ranks])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("SUITE", "OUT_DIR"), required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--only", default=None, help="comma-separated scenarios/cases")
    args = parser.parse_args()
    suite, out_dir = args.worker
    if suite == "op":
        cases = args.only.split(",") if args.only else list(OP_CASES)
        op_worker(out_dir, args.device, cases)
    elif suite == "op_errors":
        op_errors_worker(out_dir, args.device)
    else:
        scenarios = args.only.split(",") if args.only else list(SCENARIOS)
        lightning_worker(suite, out_dir, args.device, scenarios)


if __name__ == "__main__":
    main()
