"""FSDP2 on the CPU: Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
process_group_backend="gloo")`` with ``accelerator="cpu", devices=2``, a TinyGPT whose ``configure_model`` calls
``fully_shard``, against one float64 process on the same global batch.

The test starts this file twice as a script with the ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*``
variables set (so Lightning does not launch processes itself and one process group serves several
``Trainer.fit`` calls). Each rank runs the scenarios of :data:`SCENARIOS` in order and saves, for the one
optimizer step of each (2 micro-batches of 2 samples per rank; rank 1's second micro-batch has no label), the
``train/loss`` it logged, every gradient as its local ``DTensor`` shard and as the full tensor, and what the
fused op received as the head weight (type and shape) — the weight must be complete (unsharded, a plain
tensor) when the op runs.

Scenarios:

- ``tied``: embeddings tied to the head (one parameter, in the root FSDP unit); blocks and the root sharded.
- ``untied``: a separate head, sharded as its own unit (its own forward call unshards it).
- ``mp_bf16``: untied, every unit with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the
  op gets the unsharded head weight in bf16 and its bf16 gradient is reduce-scattered in fp32 into the fp32
  shards (bf16 tolerances: relative L2 error < 3e-2 per gradient, 1e-2 for the loss).
- ``mixin_only``: tied, without the model registering its step methods with FSDP — what a user of
  ``FLCEMixin`` writes. ``training_step`` is not ``forward``, so FSDP2 would not unshard the root's parameters
  (the embeddings) before it; FLCEMixin registers its step methods at the start of fit
  (``test_mixin_registers_fsdp2_step_methods``).
- ``distill_tied_student``, ``distill_tied_teacher``: a :class:`~lightning_flce.models.DistillationModule` (JSD,
  temperature 2, hard_weight 0.25) whose ``configure_model`` shards the student and a wider teacher (TinyGPTs: each
  block, an untied head, then the model) and itself as the root. One model's head is tied to its embeddings (in
  the model's root unit), the other's is a unit of its own: both reach the fused distillation op unsharded, against
  one float64 process computing the loss from both models' logits; then a sharded checkpoint, and a second run
  resumed from it.

Tolerances as in ``test_ddp_cpu.py``.
"""

import math
import os
import sys
import time
from typing import NamedTuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from ranks import end_worker, free_port, run_ranks, torchrun_env
from torch.utils.data import DataLoader

import lightning_flce
import lightning_flce.head
from lightning_flce._compat import TORCH_VERSION
from lightning_flce.models import DistillationModule
from lightning_flce.models.gpt import TinyGPT
from lightning_flce.parallel import fully_shard_lm, register_fsdp_step_methods

VOCAB = 83  # odd: FSDP2's Shard(0) splits it 42 + 41
SEQ = 8
NUM_SAMPLES = 8  # 2 ranks x 2 micro-batches x 2 samples: one optimizer step
FP32 = {"rtol": 1e-4, "atol": 1e-6}
SCENARIOS = {
    "tied": {"tie_embeddings": True, "register_steps": True},
    "untied": {"tie_embeddings": False, "register_steps": True},
    "mp_bf16": {"tie_embeddings": False, "register_steps": True, "mp_bf16": True},
    "mixin_only": {"tie_embeddings": True, "register_steps": False},
}
TIMEOUT_S = 150
# FSDP2 on CPU tensors: torch 2.4's fully_shard creates CUDA streams and fails without a GPU; 2.13 runs it.
needs_cpu_fsdp2 = pytest.mark.skipif(TORCH_VERSION < (2, 6), reason="FSDP2 on the CPU needs a newer torch")


class ShardedTinyGPT(TinyGPT):
    """TinyGPT with FSDP2 applied in ``configure_model``: each block, the untied head, then the root."""

    def __init__(self, *args, register_steps: bool = True, mp_bf16: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_steps = register_steps
        self.mp_bf16 = mp_bf16

    def configure_model(self) -> None:
        head = None if self.hparams.tie_embeddings else self.lm_head
        extra = {}
        if self.mp_bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            extra["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def shard() -> None:
            fully_shard_lm(
                self,
                self.device_mesh["data_parallel"],
                blocks=self.blocks,
                head=head,
                register_steps=self.register_steps,
                **extra,
            )

        shard()
        self.registered = [name for name in ("training_step", "validation_step") if name in self.__dict__]
        # a second call (configure_model runs again for trainer.validate after fit) changes nothing
        methods = {name: self.__dict__.get(name) for name in self.registered}
        shard()
        assert all(self.__dict__[name] is method for name, method in methods.items())


def tiny_gpt(cls=TinyGPT, **kwargs) -> TinyGPT:
    torch.manual_seed(0)
    return cls(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0, **kwargs)


def samples() -> list[dict[str, torch.Tensor]]:
    """Sample i ignores i labels, samples 5 and 7 all of theirs: rank 1's second micro-batch ([5, 7]) has none."""
    generator = torch.Generator().manual_seed(2)
    data = []
    for index in range(NUM_SAMPLES):
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[: SEQ if index in (5, 7) else index] = -100
        data.append({"input_ids": tokens[:-1], "labels": labels})
    return data


class SaveStep(Callback):
    """Local shard, full tensor and placement of every gradient at the optimizer step, and the logged loss."""

    def __init__(self) -> None:
        self.result = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from torch.distributed.tensor import DTensor

        grads = {}
        for name, param in pl_module.named_parameters():
            if param.grad is None:
                continue
            grad = param.grad
            assert isinstance(param, DTensor) and isinstance(grad, DTensor), name
            grads[name] = {
                "local": grad.to_local().clone(),
                "full": grad.full_tensor().clone(),  # a collective: every rank runs this hook in the same order
                "placements": str(grad.placements),
                "param_placements": str(param.placements),
            }
        self.result = {"grads": grads, "world_size": trainer.world_size}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.result is not None and "loss" not in self.result:
            self.result["loss"] = trainer.callback_metrics["train/loss_step"].item()
            self.result["tied"] = pl_module.lm_head.weight is pl_module.tok_emb.weight
            self.result["registered"] = list(pl_module.registered)


def fsdp2_trainer(max_steps: int, callbacks=()) -> pl.Trainer:
    """Two CPU ranks of FSDP2 (gloo), 2 micro-batches a step, no sanity check, checkpoints or logging."""
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
        ),
        max_steps=max_steps,
        accumulate_grad_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def run_scenario(name: str) -> dict:
    seen = []
    original = lightning_flce.head.fused_linear_cross_entropy

    def recording_op(input, weight, *args, **kwargs):
        seen.append((type(weight).__name__, tuple(weight.shape), weight.dtype))
        return original(input, weight, *args, **kwargs)

    lightning_flce.head.fused_linear_cross_entropy = recording_op
    save = SaveStep()
    options = SCENARIOS[name]
    trainer = fsdp2_trainer(1, [save])
    model = tiny_gpt(ShardedTinyGPT, **options)
    try:
        trainer.fit(model, DataLoader(samples(), batch_size=2), DataLoader(samples(), batch_size=2))
    except Exception as exc:  # recorded: the parent decides whether it was expected
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        lightning_flce.head.fused_linear_cross_entropy = original
    val_loss = trainer.callback_metrics.get("val/loss")
    return {
        "error": None,
        "op_weights": seen,
        "val_loss": None if val_loss is None else val_loss.item(),
        **save.result,
    }


DISTILL = {"divergence": "jsd", "beta": 0.5, "temperature": 2.0, "hard_weight": 0.25}
TEACHER_D_MODEL = 24  # the teacher's hidden size differs from the student's 16


class DistillScenario(NamedTuple):
    student_tied: bool  # the student's head tied to its embeddings (in the student's own unit)
    teacher: str  # "tied" / "untied": a TinyGPT sharded by its configure_model; "hf": a Hugging Face Llama
    # the user shards (each decoder layer, then the model: the untied head in the model's own unit)


DISTILL_SCENARIOS = {
    "distill_tied_student": DistillScenario(student_tied=True, teacher="untied"),
    "distill_tied_teacher": DistillScenario(student_tied=False, teacher="tied"),
    "distill_hf_teacher": DistillScenario(student_tied=True, teacher="hf"),
}


def distill_models(scenario: DistillScenario) -> tuple[TinyGPT, torch.nn.Module]:
    student = tiny_gpt(tie_embeddings=scenario.student_tied)
    torch.manual_seed(1)
    if scenario.teacher == "hf":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(
            "llama",
            vocab_size=VOCAB,
            hidden_size=TEACHER_D_MODEL,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
        return student, AutoModelForCausalLM.from_config(config)
    teacher = TinyGPT(
        vocab_size=VOCAB,
        d_model=TEACHER_D_MODEL,
        n_layers=1,
        n_heads=2,
        max_seq_len=SEQ,
        tie_embeddings=scenario.teacher == "tied",
    )
    return student, teacher


class UserShardedTeacher(DistillationModule):
    """Shards a Hugging Face teacher as users do (each decoder layer, then the model), then the module's own."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.device_mesh is not None and not isinstance(self.teacher, FSDPModule):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.teacher.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.teacher, mesh=mesh)
        super().configure_model()


def distill_module(scenario: DistillScenario) -> DistillationModule:
    cls = UserShardedTeacher if scenario.teacher == "hf" else DistillationModule
    return cls(*distill_models(scenario), lr=0.0, **DISTILL)


class SaveDistillStep(SaveStep):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        # after the step's backward: what the loss kept unsharded (a student's unit holding its head, resharded by
        # its backward; a teacher's, resharded once the loss has run) must hold shards again
        self.result["after_backward"] = {type(p).__name__ for p in pl_module.parameters()}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # the teacher's parameters are shards again as soon as the loss has run, not only after the backward
        self.teacher_before_backward = {type(p).__name__ for p in pl_module.teacher.parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.result is not None and "loss" not in self.result:
            self.result["loss"] = trainer.callback_metrics["train/loss_step"].item()
            self.result["teacher_before_backward"] = self.teacher_before_backward


def run_distill_scenario(scenario: DistillScenario, checkpoint: str) -> dict:
    """One optimizer step (and a validation), a sharded checkpoint, then a module whose student was changed resumed
    from it (at its last step: nothing to train)."""
    seen = []
    original = lightning_flce.fused_linear_distillation

    def recording_op(student_input, student_weight, teacher_input, teacher_weight, *args, **kwargs):
        seen.append([(type(w).__name__, tuple(w.shape)) for w in (student_weight, teacher_weight)])
        return original(student_input, student_weight, teacher_input, teacher_weight, *args, **kwargs)

    lightning_flce.fused_linear_distillation = recording_op
    save = SaveDistillStep()
    trainer = fsdp2_trainer(1, [save])
    module = distill_module(scenario)
    data = (DataLoader(samples(), batch_size=2), DataLoader(samples(), batch_size=2))
    try:
        trainer.fit(module, *data)
        trainer.save_checkpoint(checkpoint)
        result = {
            "error": None,
            "op_weights": list(seen),
            "val_loss": trainer.callback_metrics["val/loss"].item(),
            "units": [type(m).__name__ for m in (module, module.student.lm_head, module.teacher.lm_head)],
            # and after the validation that followed (the student's unit resharded at the end of each step)
            "after_fit": {type(p).__name__ for p in module.parameters()},
            **save.result,
        }
        resumed = distill_module(scenario)
        with torch.no_grad():  # the checkpoint's student must replace these
            for param in resumed.student.parameters():
                param.add_(1.0)
        calls_before = len(seen)
        trainer = fsdp2_trainer(1)  # the checkpoint's step: nothing left to train
        trainer.fit(resumed, *data, ckpt_path=checkpoint)
        result["resumed_step"] = trainer.global_step
        result["resumed_loss_calls"] = len(seen) - calls_before
        result["resumed_student"] = {k: v.full_tensor() for k, v in resumed.student.state_dict().items()}
        result["resumed_teacher"] = {k: v.full_tensor() for k, v in resumed.teacher.state_dict().items()}
    except Exception as exc:  # recorded: the parent decides whether it was expected
        return {"error": f"{type(exc).__name__}: {exc}", "op_weights": seen}
    finally:
        lightning_flce.fused_linear_distillation = original
    return result


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    for name in SCENARIOS:
        start = time.perf_counter()
        results[name] = run_scenario(name)
        results[name]["seconds"] = time.perf_counter() - start
    for name, scenario in DISTILL_SCENARIOS.items():
        results[name] = run_distill_scenario(scenario, os.path.join(out_dir, f"{name}.ckpt"))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("fsdp2")
    port = free_port()
    return run_ranks(
        2,
        lambda rank: [__file__, out_dir],
        out_dir,
        TIMEOUT_S,
        env=lambda rank: torchrun_env(rank, 2, port, OMP_NUM_THREADS="1"),
        cwd=out_dir,
        label="fsdp2",
    )


def _reference(tie_embeddings: bool):
    """Loss and gradients of one float64 process on all 8 samples (the token mean of the global batch)."""
    model = tiny_gpt(tie_embeddings=tie_embeddings).double()
    data = samples()
    input_ids = torch.stack([s["input_ids"] for s in data])
    labels = torch.stack([s["labels"] for s in data])
    loss = F.cross_entropy(model(input_ids).reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    return loss.item(), {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


def _check_against_reference(ranks: list[dict], tie_embeddings: bool, bf16: bool = False) -> None:
    ref_loss, ref_grads = _reference(tie_embeddings)
    weight_dtype = torch.bfloat16 if bf16 else torch.float32
    for rank, saved in enumerate(ranks):
        assert saved["error"] is None, saved["error"]
        assert saved["world_size"] == 2
        assert saved["tied"] is tie_embeddings
        # the op ran twice (2 micro-batches) on the complete [V, H] weight, never a DTensor shard
        assert len(saved["op_weights"]) == 2, saved["op_weights"]
        for type_name, shape, dtype in saved["op_weights"]:
            assert type_name in ("Parameter", "Tensor") and shape == (VOCAB, 16) and dtype == weight_dtype
        assert saved["loss"] == pytest.approx(ref_loss, rel=1e-2 if bf16 else 1e-5)
        grads = saved["grads"]
        assert grads.keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            grad = grads[name]
            assert grad["placements"] == grad["param_placements"] == "(Shard(dim=0),)", name
            assert grad["full"].dtype == torch.float32, name  # fp32 shards, reduced in fp32
            if bf16:
                err = float((grad["full"] - want).norm() / want.norm())
                assert err < 3e-2, (rank, name, err)
            else:
                torch.testing.assert_close(grad["full"], want, **FP32, msg=f"rank {rank}: {name}")
            # this rank's rows of the gradient (torch.chunk's split of dim 0), nothing else
            rows = torch.chunk(torch.arange(want.shape[0]), 2)[rank]
            torch.testing.assert_close(grad["local"], grad["full"][rows], rtol=0, atol=0, msg=name)


@pytest.mark.slow
@needs_cpu_fsdp2
@pytest.mark.parametrize("scenario", ["tied", "untied"])
def test_fsdp2_step_equals_one_process_on_the_global_batch(results, scenario):
    _check_against_reference([r[scenario] for r in results], SCENARIOS[scenario]["tie_embeddings"])
    # the head gradient is sharded over the ranks: 42 + 41 rows
    assert all(r[scenario]["registered"] == ["training_step", "validation_step"] for r in results)
    name = "tok_emb.weight" if scenario == "tied" else "lm_head.weight"
    assert [r[scenario]["grads"][name]["local"].shape[0] for r in results] == [42, 41]


@pytest.mark.slow
@needs_cpu_fsdp2
def test_fsdp2_bf16_mixed_precision_policy(results):
    _check_against_reference([r["mp_bf16"] for r in results], tie_embeddings=False, bf16=True)
    assert [r["mp_bf16"]["grads"]["lm_head.weight"]["local"].shape[0] for r in results] == [42, 41]


@pytest.mark.slow
@needs_cpu_fsdp2
def test_mixin_registers_fsdp2_step_methods(results):
    """A plain FLCEMixin model sharded by the user's own fully_shard: the mixin registers its step methods."""
    _check_against_reference([r["mixin_only"] for r in results], tie_embeddings=True)


def _distill_reference(scenario: DistillScenario) -> tuple[float, dict[str, torch.Tensor]]:
    """The distillation loss (the token mean over all 8 samples) and the student's gradients in one float64
    process, from both models' logits."""
    student, teacher = (model.double() for model in distill_models(scenario))
    data = samples()
    input_ids = torch.stack([s["input_ids"] for s in data])
    labels = torch.stack([s["labels"] for s in data]).reshape(-1)
    logits = student(input_ids).reshape(-1, VOCAB)
    with torch.no_grad():
        output = teacher(input_ids)
        teacher_logits = getattr(output, "logits", output).reshape(-1, VOCAB)
    beta, temperature, hard_weight = DISTILL["beta"], DISTILL["temperature"], DISTILL["hard_weight"]
    log_p = torch.log_softmax(logits / temperature, dim=-1)  # the student
    log_q = torch.log_softmax(teacher_logits / temperature, dim=-1)
    log_m = torch.logsumexp(torch.stack([log_q + math.log(beta), log_p + math.log(1 - beta)]), dim=0)
    q_term = (log_q.exp() * (log_q - log_m)).sum(-1)
    p_term = (log_p.exp() * (log_p - log_m)).sum(-1)
    jsd = beta * q_term + (1 - beta) * p_term
    ce = F.cross_entropy(logits, labels, reduction="none")  # 0 where ignored
    valid = labels != -100
    loss = (((1 - hard_weight) * jsd + hard_weight * ce) * valid).sum() / valid.sum()
    loss.backward()
    grads = {f"student.{name}": p.grad.float() for name, p in student.named_parameters()}
    return loss.item(), grads


@pytest.mark.slow
@needs_cpu_fsdp2
@pytest.mark.parametrize("name", list(DISTILL_SCENARIOS))
def test_fsdp2_distillation_step_equals_one_process_on_the_global_batch(results, name):
    """Both models sharded (by DistillationModule.configure_model, or the HF teacher by the user's recipe); a head
    in a unit that is not its own stays unsharded for the loss."""
    if DISTILL_SCENARIOS[name].teacher == "hf":
        pytest.importorskip("transformers")
    scenario = DISTILL_SCENARIOS[name]
    ref_loss, ref_grads = _distill_reference(scenario)
    units = [
        "FSDPUserShardedTeacher" if scenario.teacher == "hf" else "FSDPDistillationModule",
        "Linear" if scenario.student_tied else "FSDPLinear",
        "FSDPLinear" if scenario.teacher == "untied" else "Linear",
    ]
    for rank, saved in enumerate(r[name] for r in results):
        assert saved["error"] is None, (saved["error"], saved["op_weights"])
        assert saved["units"] == units
        assert (
            saved["teacher_before_backward"] == saved["after_backward"] == saved["after_fit"] == {"DTensor"}
        )
        # 2 micro-batches and 2 validation batches, each on both complete heads, never a DTensor shard
        assert (
            saved["op_weights"] == [[("Parameter", (VOCAB, 16)), ("Parameter", (VOCAB, TEACHER_D_MODEL))]] * 4
        )
        assert saved["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert saved["val_loss"] == pytest.approx(ref_loss, rel=1e-5)  # lr 0: the same parameters
        grads = saved["grads"]
        assert grads.keys() == ref_grads.keys()  # the teacher gets none
        for param_name, want in ref_grads.items():
            torch.testing.assert_close(
                grads[param_name]["full"], want, **FP32, msg=f"rank {rank}: {param_name}"
            )
            assert grads[param_name]["placements"] == "(Shard(dim=0),)", param_name
    # the student head's gradient is sharded over the ranks: 42 + 41 rows
    head = "student.tok_emb.weight" if scenario.student_tied else "student.lm_head.weight"
    assert [r[name]["grads"][head]["local"].shape[0] for r in results] == [42, 41]
    # resumed from the sharded checkpoint (which keeps the teacher's shards): both models as they were (lr 0)
    student, teacher = distill_models(scenario)
    for saved in (r[name] for r in results):
        assert saved["resumed_step"] == 1 and saved["resumed_loss_calls"] == 0
        for key, model in (("resumed_student", student), ("resumed_teacher", teacher)):
            state = model.state_dict()
            assert saved[key].keys() == state.keys()
            for param_name, value in state.items():
                torch.testing.assert_close(
                    saved[key][param_name], value, rtol=0, atol=0, msg=f"{key}: {param_name}"
                )


def test_fully_shard_lm_refuses_a_tied_head_as_its_own_unit():
    model = tiny_gpt(tie_embeddings=True)
    with pytest.raises(ValueError, match="tied embeddings"):
        fully_shard_lm(model, blocks=model.blocks, head=model.lm_head)
    # not sharded: nothing to register
    assert register_fsdp_step_methods(model) == []
    assert "training_step" not in model.__dict__


if __name__ == "__main__":
    worker(sys.argv[1])
    end_worker()
