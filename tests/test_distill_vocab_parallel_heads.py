"""DistillationModule with both LM heads sharded over the vocabulary (``VocabParallelHead``): 2 CPU processes
(gloo), each running its own single-device ``Trainer`` on the same data, against one float64 process with the full
heads.

Layout as ``test_vocab_parallel_mixin.py`` (head tensor parallelism, data replicated): each rank builds the same
untied student and teacher TinyGPTs of ``test_fsdp2_cpu.py``'s distillation scenario (student width 16, teacher 24,
83-row vocabulary), replaces both ``lm_head``s by ``VocabParallelHead.from_linear`` (rows 0..41 and 42..82 of the
same weights), and trains one optimizer step on all 8 samples (lr 0) with the scenario's loss (JSD, temperature 2,
hard_weight 0.25), then validates. The module runs ``vocab_parallel_fused_linear_distillation`` on the heads' rows
(and the vocab-parallel cross-entropy for the validation's student CE).

Checked: the logged loss and the validation loss against the float64 loss of both models' full logits; every
student gradient against float64 (the body's whole on each rank, since dX is all-reduced by the op; the head's put
together from the two ranks' rows); no gradient reaching the teacher; the op seeing each rank's rows of both heads;
and clear errors on both ranks, without a hang, for a teacher head left replicated and a strategy that reduces every
gradient over the world (DDP would average head shards of different rows). With ``top_k=5`` (the teacher's top 5
chosen across both ranks' rows), and with a teacher cached as its top 5 per position (``cached_teacher=True``, the
student's head sharded, no teacher model), the step equals one process's single-device module with the full heads.

Tolerances: fp32 as in ``test_fsdp2_cpu.py`` (``FP32``; fp32 rounding through a one-layer model).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from ranks import end_worker, error_in_step, run_ranks
from test_fsdp2_cpu import (
    DISTILL,
    FP32,
    TEACHER_D_MODEL,
    VOCAB,
    DistillScenario,
    _distill_reference,
    distill_models,
    samples,
)

SCENARIO = DistillScenario(student_tied=False, teacher="untied")
WORLD = 2
TIMEOUT_S = 180


def _trainer(callbacks=(), **kwargs):
    import lightning.pytorch as pl

    options = dict(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    options.update(kwargs)
    return pl.Trainer(**options)


class SaveStep(Callback):
    """The first step's logged loss and the gradients before the optimizer step."""

    def __init__(self) -> None:
        self.result: dict = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.result["grads"] = {
            n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.result.setdefault("loss", trainer.callback_metrics["train/loss_step"].item())


def cached_samples() -> list[dict[str, torch.Tensor]]:
    """:func:`samples` with the teacher's top TOP_K logits at every position (what ``cached_teacher=True`` reads)."""
    _, teacher = distill_models(SCENARIO)
    out = []
    with torch.no_grad():
        for sample in samples():
            logits = teacher(sample["input_ids"][None])[0]
            values, indices = logits.topk(TOP_K, dim=-1)
            out.append({**sample, "teacher_top_k_indices": indices, "teacher_top_k_logits": values})
    return out


def cached_module(sharded: bool):
    """A student alone (its head sharded or not), on a cached teacher."""
    from lightning_flce.models import DistillationModule
    from lightning_flce.parallel import VocabParallelHead

    student, _ = distill_models(SCENARIO)
    if sharded:
        student.lm_head = VocabParallelHead.from_linear(student.lm_head)
    return DistillationModule(student, cached_teacher=True, lr=0.0, **DISTILL)


def fit_one_step(module, data_samples=None) -> dict:
    """One optimizer step (lr 0) and a validation on all 8 samples: the step's loss and gradients, val loss."""
    from torch.utils.data import DataLoader

    data = DataLoader(samples() if data_samples is None else data_samples, batch_size=8)
    save = SaveStep()
    trainer = _trainer([save])
    trainer.fit(module, data, data)
    return {**save.result, "val_loss": trainer.callback_metrics["val/loss"].item()}


TOP_K = 5


def sharded_module(**options):
    from lightning_flce.models import DistillationModule
    from lightning_flce.parallel import VocabParallelHead

    student, teacher = distill_models(SCENARIO)
    student.lm_head = VocabParallelHead.from_linear(student.lm_head)
    if options.pop("teacher_head_sharded", True):
        teacher.lm_head = VocabParallelHead.from_linear(teacher.lm_head)
    return DistillationModule(student, teacher, lr=0.0, **{**DISTILL, **options})


def run(rank: int) -> dict:
    from torch.utils.data import DataLoader

    import lightning_flce.models.distill as distill_module

    seen = []
    original = distill_module.vocab_parallel_fused_linear_distillation

    def recording_op(student_input, student_weight, teacher_input, teacher_weight, *args, **kwargs):
        seen.append([tuple(w.shape) for w in (student_weight, teacher_weight)] + [kwargs["vocab_start"]])
        return original(student_input, student_weight, teacher_input, teacher_weight, *args, **kwargs)

    data = DataLoader(samples(), batch_size=8)
    distill_module.vocab_parallel_fused_linear_distillation = recording_op
    result: dict = {"error": None}
    try:
        module = sharded_module()
        result.update(fit_one_step(module))
        head = module.student.lm_head
        result.update(rows=(head.vocab_start, head.vocab_start + head.weight.shape[0]), op_calls=list(seen))
        result["top_k"] = fit_one_step(sharded_module(top_k=TOP_K))
        result["cached"] = fit_one_step(cached_module(sharded=True), cached_samples())
    except Exception:  # recorded with its traceback: the parent reports it
        result["error"] = traceback.format_exc()[-3000:]
    finally:
        distill_module.vocab_parallel_fused_linear_distillation = original
    batch = next(iter(data))

    def step_of(module) -> None:
        module.training_step(batch, 0)

    result["error_teacher_replicated"] = error_in_step(
        lambda: step_of(sharded_module(teacher_head_sharded=False))
    )
    result["error_ddp"] = error_in_step(lambda: _check_ddp(sharded_module()))
    return result


def _check_ddp(module) -> None:
    """The strategy check of fit start under a world-reducing strategy (DDP), without starting one."""
    import types

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_flce.mixin_checks import check_vocab_parallel_strategy
    from lightning_flce.models.distill import model_lm_head

    trainer = types.SimpleNamespace(strategy=DDPStrategy.__new__(DDPStrategy), world_size=2)
    check_vocab_parallel_strategy(model_lm_head(module.student).module, trainer, "DistillationModule")


def worker(out_dir: str, rank: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank, world_size=WORLD
    )
    result = run(rank)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    end_worker()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("distill_vp_heads")
    return run_ranks(
        WORLD,
        lambda rank: [__file__, out_dir, rank],
        Path(out_dir),
        TIMEOUT_S,
        label="DistillationModule with VocabParallelHeads",
    )


def test_one_step_equals_one_float64_process_with_the_full_heads(ranks):
    ref_loss, ref_grads = _distill_reference(SCENARIO)
    assert [r["rows"] for r in ranks] == [(0, 42), (42, 83)]
    head_key = "student.lm_head.weight"
    for rank, saved in enumerate(ranks):
        assert saved["error"] is None, saved["error"]
        start, end = saved["rows"]
        # one training micro-batch and one validation batch, each on this rank's rows of both heads
        assert saved["op_calls"] == [[(end - start, 16), (end - start, TEACHER_D_MODEL), start]] * 2
        assert saved["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert saved["val_loss"] == pytest.approx(ref_loss, rel=1e-5)  # lr 0: the same parameters
        grads = saved["grads"]
        assert grads.keys() == ref_grads.keys()  # the teacher gets none
        for name, want in ref_grads.items():
            if name != head_key:
                torch.testing.assert_close(grads[name], want, **FP32, msg=f"rank {rank}: {name}")
    head_grad = torch.cat([saved["grads"][head_key] for saved in ranks])
    assert head_grad.shape == (VOCAB, 16)
    torch.testing.assert_close(head_grad, ref_grads[head_key], **FP32)


def test_unsupported_layouts_and_strategies_raise_on_every_rank(ranks):
    for saved in ranks:
        assert saved["error_teacher_replicated"].startswith("ValueError: only the student's LM head")
        assert saved["error_ddp"].startswith(
            "ValueError: DistillationModule: the head is a VocabParallelHead"
        )


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))


@pytest.mark.parametrize("case", ["top_k", "cached"])
def test_top_k_and_cached_teacher_equal_the_single_device_module_with_the_full_heads(ranks, case):
    """``top_k`` over both ranks' rows, or a teacher cached as its top k: the step's loss, validation loss and
    gradients equal one process's module with the full heads (the single-device op, in fp32 as the ranks)."""
    from lightning_flce.models import DistillationModule

    if case == "top_k":
        student, teacher = distill_models(SCENARIO)
        want = fit_one_step(DistillationModule(student, teacher, lr=0.0, **{**DISTILL, "top_k": TOP_K}))
    else:
        want = fit_one_step(cached_module(sharded=False), cached_samples())
    head_key = "student.lm_head.weight"
    for rank, saved in enumerate(ranks):
        assert saved["error"] is None, saved["error"]
        got = saved[case]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            if name != head_key:
                torch.testing.assert_close(got["grads"][name], grad, **FP32, msg=f"rank {rank}: {name}")
    head_grad = torch.cat([saved[case]["grads"][head_key] for saved in ranks])
    torch.testing.assert_close(head_grad, want["grads"][head_key], **FP32)
    # not the full-vocabulary loss: the top 5 of 83 columns move it (by about 2e-4 with top_k, 20x the tolerance)
    assert ranks[0][case]["loss"] != pytest.approx(ranks[0]["loss"], rel=1e-5)
