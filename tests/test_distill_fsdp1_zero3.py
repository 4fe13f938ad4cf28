"""DistillationModule under FSDP1 (Lightning's ``FSDPStrategy``) and DeepSpeed ZeRO-3, against one float64 process.

The scenarios of ``test_fsdp2_cpu.py`` (a tied student with an untied, wider teacher; the reverse; a tied student
with a Hugging Face Llama teacher), the same loss (JSD, temperature 2, hard_weight 0.25) and the same 8 samples
(one optimizer step; one micro-batch without labels), each through one optimizer step and a validation, a
checkpoint, and a module whose student was altered resumed from it. Checked for each: the logged loss and the
validation loss against the float64 loss of both models' logits, every student gradient (the whole tensor:
``summon_full_params(with_grads=True)``, DeepSpeed's ``safe_get_full_grad``) against the float64 one, that the op
saw both whole ``[V, H]`` weights (not a flat shard), that the teacher got no gradient, and that resuming restored
the saved student and left the teacher as built.

- **FSDP1 on 2 CPU processes** (gloo; ``test_fsdp1_distillation_on_two_cpu_ranks``): one unit per block (TinyGPT's
  and Llama's decoder layers), both heads in the root unit, whose flat parameter then holds frozen (teacher) and
  trainable (student) parameters (``use_orig_params``, Lightning's default); through ``ranks.cpu_fsdp_strategy``,
  as ``test_multi_gpu.py``'s CPU run (Lightning refuses ``FSDPStrategy`` itself on the CPU). The checkpoint is
  ``state_dict_type="sharded"`` here: torch's FSDP1 crashes (a segmentation fault in its state-dict hook's clone)
  saving a full state dict of CPU tensors, a plain TinyGPT's too.
- **One GPU** (``cuda``: FSDP1 with the default full state dict, and DeepSpeed ZeRO-3 where ``deepspeed`` is
  installed), a process group of one: the parameters are still flat (FSDP1) or partitioned to ``numel() == 0``
  outside their modules' calls (ZeRO-3), so the heads must be read inside their own calls. DeepSpeed runs
  ``normalize="micro_batch"`` on one micro-batch of all 8 samples (DeepSpeed divides accumulated losses again:
  ``DistillationModule``'s docstring), the same token mean as the reference.

Each suite also checks that a ``teacher_dtype`` the strategy overrode (bf16 under "32-true": FSDP1 and DeepSpeed
convert the wrapped module and manage its parameters) is refused with a clear error, not run in fp32.

Tolerances: fp32 as in ``test_fsdp2_cpu.py`` (``FP32``; the float64 reference differs by fp32 rounding through a
one-layer model and one reduction).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from ranks import cpu_fsdp_strategy, end_worker, free_port, run_ranks, torchrun_env
from test_fsdp2_cpu import (
    DISTILL,
    DISTILL_SCENARIOS,
    FP32,
    TEACHER_D_MODEL,
    VOCAB,
    _distill_reference,
    distill_models,
    samples,
)

TIMEOUT_S = 240
WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")  # FSDP1's names of wrapped modules
SUITES = {
    # suite: (device, processes, checkpoint state dict)
    "fsdp1_cpu": ("cpu", 2, "sharded"),
    "fsdp1_cuda": ("cuda", 1, "full"),
    "deepspeed3_cuda": ("cuda", 1, None),
}


def _clean(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _strategy(suite: str, scenario):
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    from lightning_flce.models.gpt import _Block

    device, _, state_dict_type = SUITES[suite]
    if suite.startswith("deepspeed3"):
        return DeepSpeedStrategy(stage=3)
    policy = {_Block}
    if scenario.teacher == "hf":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy.add(LlamaDecoderLayer)
    options = dict(sharding_strategy="FULL_SHARD", auto_wrap_policy=policy, state_dict_type=state_dict_type)
    return cpu_fsdp_strategy(**options) if device == "cpu" else FSDPStrategy(**options)


def _trainer(suite: str, scenario, callbacks=()):
    import lightning.pytorch as pl

    device, processes, _ = SUITES[suite]
    return pl.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=processes,
        strategy=_strategy(suite, scenario),
        precision="32-true",
        max_steps=1,
        accumulate_grad_batches=1 if suite.startswith("deepspeed3") else 4 // processes,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def _full_parameters(trainer, module) -> dict[str, torch.Tensor]:
    """``module``'s parameters as whole tensors on the CPU (a collective: every rank calls it)."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.strategy.model, writeback=False):
            return {_clean(n): p.detach().float().cpu().clone() for n, p in module.named_parameters()}
    import deepspeed

    params = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {_clean(n): p.detach().float().cpu().clone() for n, p in params}


class SaveStep(Callback):
    """At the optimizer step: every gradient as the whole tensor and the names of the parameters that have one; the
    logged step loss."""

    def __init__(self) -> None:
        self.result: dict = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning.pytorch.strategies import FSDPStrategy

        params = list(pl_module.named_parameters())
        if isinstance(trainer.strategy, FSDPStrategy):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(trainer.strategy.model, with_grads=True, writeback=False):
                grads = {_clean(n): p.grad.float().cpu().clone() for n, p in params if p.grad is not None}
        else:
            from deepspeed.utils import safe_get_full_grad

            # a collective under ZeRO-3 (the trainable parameters: DeepSpeed keeps no gradient for frozen ones)
            full = {_clean(n): safe_get_full_grad(p) for n, p in params if p.requires_grad}
            grads = {n: g.float().cpu().clone() for n, g in full.items() if g is not None}
        self.result["grads"] = grads

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "grads" in self.result and "loss" not in self.result:
            self.result["loss"] = trainer.callback_metrics["train/loss_step"].item()


def run_scenario(suite: str, name: str, out_dir: str) -> dict:
    from torch.utils.data import DataLoader

    import lightning_flce
    from lightning_flce.models import DistillationModule

    scenario = DISTILL_SCENARIOS[name]
    deepspeed = suite.startswith("deepspeed3")
    options = dict(DISTILL, normalize="micro_batch") if deepspeed else DISTILL
    seen = []
    original = lightning_flce.fused_linear_distillation

    def recording_op(student_input, student_weight, teacher_input, teacher_weight, *args, **kwargs):
        seen.append([(type(w).__name__, tuple(w.shape)) for w in (student_weight, teacher_weight)])
        return original(student_input, student_weight, teacher_input, teacher_weight, *args, **kwargs)

    def module() -> DistillationModule:
        return DistillationModule(*distill_models(scenario), lr=0.0, **options)

    batch_size = 8 if deepspeed else 2
    data = (DataLoader(samples(), batch_size=batch_size), DataLoader(samples(), batch_size=batch_size))
    checkpoint = os.path.join(out_dir, f"{suite}_{name}.ckpt")
    lightning_flce.fused_linear_distillation = recording_op
    save = SaveStep()
    try:
        trainer = _trainer(suite, scenario, [save])
        trained = module()
        trainer.fit(trained, *data)
        trainer.save_checkpoint(checkpoint)
        result = {
            "error": None,
            "op_weights": list(seen),
            "val_loss": trainer.callback_metrics["val/loss"].item(),
            **save.result,
        }
        resumed = module()
        with torch.no_grad():  # the checkpoint's student must replace these
            for param in resumed.student.parameters():
                param.add_(1.0)
        calls_before = len(seen)
        trainer = _trainer(suite, scenario)  # at the checkpoint's step: nothing left to train
        trainer.fit(resumed, *data, ckpt_path=checkpoint)
        result["resumed_step"] = trainer.global_step
        result["resumed_loss_calls"] = len(seen) - calls_before
        result["resumed_student"] = _full_parameters(trainer, resumed.student)
        result["resumed_teacher"] = _full_parameters(trainer, resumed.teacher)
    except Exception:  # recorded with its traceback: the parent reports it
        return {"error": traceback.format_exc()[-3000:], "op_weights": seen}
    finally:
        lightning_flce.fused_linear_distillation = original
    return result


def run_teacher_dtype_case(suite: str) -> str:
    """A bf16 ``teacher_dtype`` under "32-true": the strategy converts the module when it wraps it (FSDP1 and
    DeepSpeed) and manages its parameters then, so the teacher would silently run in fp32. The error raised."""
    from torch.utils.data import DataLoader

    from lightning_flce.models import DistillationModule

    scenario = DISTILL_SCENARIOS["distill_tied_student"]
    options = dict(DISTILL, normalize="micro_batch") if suite.startswith("deepspeed3") else DISTILL
    module = DistillationModule(*distill_models(scenario), lr=0.0, teacher_dtype="bfloat16", **options)
    try:
        _trainer(suite, scenario).fit(module, DataLoader(samples(), batch_size=2))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def worker(suite: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    rank = int(os.environ["RANK"])
    results = {"teacher_dtype_error": run_teacher_dtype_case(suite)}
    for name, scenario in DISTILL_SCENARIOS.items():
        if scenario.teacher == "hf" and not _has("transformers"):
            continue
        start = time.perf_counter()
        results[name] = run_scenario(suite, name, out_dir)
        results[name]["seconds"] = time.perf_counter() - start
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def launch(suite: str, out_dir) -> list[dict]:
    _, processes, _ = SUITES[suite]
    port = free_port()
    return run_ranks(
        processes,
        lambda rank: [__file__, "--worker", suite, str(out_dir)],
        out_dir,
        TIMEOUT_S,
        env=lambda rank: torchrun_env(rank, processes, port, OMP_NUM_THREADS="1"),
        cwd=out_dir,
        label=suite,
    )


def check_teacher_dtype_refused(ranks: list[dict]) -> None:
    for saved in ranks:
        error = saved["teacher_dtype_error"]
        assert "teacher_dtype=bfloat16 was not kept" in error, error


def check_scenario(suite: str, name: str, ranks: list[dict]) -> None:
    scenario = DISTILL_SCENARIOS[name]
    ref_loss, ref_grads = _distill_reference(scenario)
    # per rank: its training micro-batches and as many validation batches
    calls = 2 if suite.startswith("deepspeed3") else 2 * 4 // len(ranks)
    for rank, saved in enumerate(ranks):
        assert saved["error"] is None, (saved["error"], saved["op_weights"])
        # each micro-batch's loss and each validation batch's on both whole heads, never a flat shard
        # (FSDP1's unsharded views are plain tensors, ZeRO-3's gathered parameters parameters)
        shapes = [[shape for _, shape in weights] for weights in saved["op_weights"]]
        assert shapes == [[(VOCAB, 16), (VOCAB, TEACHER_D_MODEL)]] * calls, saved["op_weights"]
        assert saved["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert saved["val_loss"] == pytest.approx(ref_loss, rel=1e-5)  # lr 0: the same parameters
        grads = saved["grads"]
        # no gradient reaches the teacher: none, or (FSDP1: a frozen parameter in a flat parameter that also holds
        # trainable ones) zeros, the flat gradient's view
        teacher_grads = {n: g for n, g in grads.items() if n.startswith("teacher.")}
        assert all(not g.any() for g in teacher_grads.values()), teacher_grads
        grads = {n: g for n, g in grads.items() if n not in teacher_grads}
        assert grads.keys() == ref_grads.keys()
        for param_name, want in ref_grads.items():
            torch.testing.assert_close(grads[param_name], want, **FP32, msg=f"rank {rank}: {param_name}")
        # resumed from the checkpoint: the saved student (not the altered one), the teacher as built
        assert saved["resumed_step"] == 1 and saved["resumed_loss_calls"] == 0
        student, teacher = distill_models(scenario)
        for key, model in (("resumed_student", student), ("resumed_teacher", teacher)):
            want = {n: p.detach().float() for n, p in model.named_parameters()}
            assert saved[key].keys() == want.keys(), key
            for param_name, value in want.items():
                torch.testing.assert_close(
                    saved[key][param_name], value, rtol=0, atol=0, msg=f"{key}: {param_name}"
                )


@pytest.fixture(scope="module")
def fsdp1_cpu_results(tmp_path_factory) -> list[dict]:
    return launch("fsdp1_cpu", tmp_path_factory.mktemp("fsdp1_cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTILL_SCENARIOS))
def test_fsdp1_distillation_on_two_cpu_ranks(fsdp1_cpu_results, name):
    if DISTILL_SCENARIOS[name].teacher == "hf":
        pytest.importorskip("transformers")
    check_scenario("fsdp1_cpu", name, [r[name] for r in fsdp1_cpu_results])


@pytest.mark.slow
def test_fsdp1_refuses_a_teacher_dtype_it_overrode(fsdp1_cpu_results):
    check_teacher_dtype_refused(fsdp1_cpu_results)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("suite", ["fsdp1_cuda", "deepspeed3_cuda"])
def test_distillation_sharded_on_one_gpu(suite, tmp_path):
    if suite.startswith("deepspeed3"):
        pytest.importorskip("deepspeed")
    ranks = launch(suite, tmp_path)
    check_teacher_dtype_refused(ranks)
    for name in DISTILL_SCENARIOS:
        if name in ranks[0]:
            check_scenario(suite, name, [r[name] for r in ranks])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("SUITE", "OUT_DIR"), required=True)
    args = parser.parse_args()
    worker(*args.worker)
    end_worker()
