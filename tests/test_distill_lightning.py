"""DistillationModule (``lightning_flce/models/distill.py``): the fused distillation loss through Lightning.

Against the unfused float64 formula (``unfused_distillation``, the contract's semantics written with PyTorch
ops): the module's loss and the student's gradients; the teacher frozen, unchanged and in eval mode; gradient
accumulation; DDP on two gloo ranks (run as a script, as ``tests/test_policy_ddp_cpu.py``); the checkpoint
without the teacher and resuming; the ``distill`` config; the memory callback's teacher figures.
float64 everywhere the values are compared, so the tolerances are rounding only.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_flce.models import DistillationModule, TinyGPT

VOCAB = 48
SEQ = 12
TOL = {"rtol": 1e-9, "atol": 1e-11}  # float64 on both sides: rounding of differently ordered sums


def unfused_distillation(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    target=None,
    *,
    student_bias=None,
    teacher_bias=None,
    divergence="jsd",
    beta=0.5,
    temperature=1.0,
    hard_weight=0.0,
    top_k=None,
    ignore_index=-100,
    reduction="mean",
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
    **_,
):
    """The distillation loss with both [N, V] logits and their softmaxes (the formula the fused op avoids)."""

    def transformed(hidden, weight, bias, scale, softcap):
        logits = F.linear(hidden, weight, bias).reshape(-1, weight.shape[0])
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) * scale
        return logits if not softcap else softcap * torch.tanh(logits / softcap)

    student = transformed(student_input, student_weight, student_bias, student_logit_scale, student_softcap)
    teacher = transformed(teacher_input, teacher_weight, teacher_bias, teacher_logit_scale, teacher_softcap)
    z_s, z_t = student / temperature, teacher.to(student.dtype) / temperature
    if top_k is not None:
        kept = z_t.topk(top_k, dim=-1).indices
        z_s, z_t = z_s.gather(-1, kept), z_t.gather(-1, kept)
    log_p, log_q = F.log_softmax(z_s, -1), F.log_softmax(z_t, -1)
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    if divergence == "forward_kl":
        rows = (log_q.exp() * (log_q - log_p)).sum(-1)
    elif divergence == "reverse_kl":
        rows = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        log_m = torch.logsumexp(torch.stack([log_q + math.log(beta), log_p + math.log(1 - beta)]), dim=0)
        rows = beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - beta) * (
            log_p.exp() * (log_p - log_m)
        ).sum(-1)
    counted = torch.ones_like(rows, dtype=torch.bool)
    if target is not None:
        target = target.reshape(-1)
        counted = target != ignore_index
        if hard_weight:
            ce = F.cross_entropy(student, target, ignore_index=ignore_index, reduction="none")
            rows = (1 - hard_weight) * rows + hard_weight * ce
    rows = torch.where(counted, rows, torch.zeros_like(rows))
    if reduction == "none":
        return rows.reshape(student_input.shape[:-1])
    total = rows.sum()
    return total if reduction == "sum" else total / counted.sum()


def _fused_available() -> bool:
    import lightning_flce

    return hasattr(lightning_flce, "fused_linear_distillation") or "fused_linear_distillation" in dir(
        lightning_flce
    )


def tiny_teacher(seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    options = {"vocab_size": VOCAB, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": SEQ}
    return TinyGPT(**{**options, **kwargs})


def tiny_student(seed: int = 1, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    options = {"vocab_size": VOCAB, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": SEQ}
    return TinyGPT(**{**options, **kwargs})


def make_batch(seed: int, batch_size: int = 2, n_ignored: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    if n_ignored:
        labels.view(-1)[torch.randperm(labels.numel(), generator=generator)[:n_ignored]] = -100
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}


def trainer(**kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**options, **kwargs})


def reference_loss(module: DistillationModule, batch: dict, **options) -> torch.Tensor:
    """The unfused formula on the module's models (the student's graph, so its gradients can be taken)."""
    student, teacher = module.student, module.teacher
    with torch.no_grad():
        teacher_hidden = teacher.hidden_states(batch["input_ids"])
    hp = {**module.hparams, **options}
    return unfused_distillation(
        student.hidden_states(batch["input_ids"]),
        student.lm_head.weight,
        teacher_hidden,
        teacher.lm_head.weight,
        batch["labels"],
        divergence=hp["divergence"],
        beta=hp["beta"],
        temperature=hp["temperature"],
        hard_weight=hp["hard_weight"],
        top_k=hp["top_k"],
        student_softcap=student.flce_softcap,
        teacher_softcap=teacher.flce_softcap,
    )


def student_grads(module) -> dict:
    return {name: p.grad.clone() for name, p in module.student.named_parameters() if p.grad is not None}


def fused_loss_and_grads(module, batch: dict) -> tuple[torch.Tensor, dict]:
    """The module's training-step loss on ``batch`` (without a Trainer) and the student gradients its backward
    gave, the gradients zeroed again for the unfused formula's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        loss = module.training_step(batch, 0)
    loss.backward()
    fused = student_grads(module)
    module.zero_grad()
    return loss, fused


def assert_matches_unfused(module, loss, fused: dict, expected: torch.Tensor) -> None:
    """The fused loss and the student gradients it gave (``fused``) equal the unfused formula's ``expected`` loss
    and the gradients its backward leaves in the student (zeroed before)."""
    expected.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    unfused = student_grads(module)
    assert fused.keys() == unfused.keys() and fused
    for name, grad in fused.items():
        torch.testing.assert_close(grad, unfused[name], **TOL, msg=name)


requires_op = pytest.mark.skipif(not _fused_available(), reason="fused_linear_distillation not merged yet")

CASES = [
    {"divergence": "forward_kl"},
    {"divergence": "reverse_kl", "temperature": 2.0},
    {"divergence": "jsd", "beta": 0.3, "hard_weight": 0.25},
    {"divergence": "jsd", "beta": 0.5, "top_k": 5, "hard_weight": 0.5, "temperature": 0.7},
]


@requires_op
@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_loss_and_student_grads_equal_the_unfused_formula_in_float64(options, softcap):
    module = DistillationModule(
        student=tiny_student(flce_softcap=softcap), teacher=tiny_teacher(flce_softcap=softcap), **options
    ).double()
    batch = make_batch(3, n_ignored=5)
    loss, fused = fused_loss_and_grads(module, batch)
    expected = reference_loss(module, batch)
    assert_matches_unfused(module, loss, fused, expected)
    assert all(p.grad is None for p in module.teacher.parameters())


@requires_op
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hugging_face_student_and_teacher_with_padding_in_float64():
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_flce.models import HFCausalLM

    config = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
    }
    torch.manual_seed(0)
    student = HFCausalLM(config={"model_type": "llama", **config})
    teacher_config = AutoConfig.for_model("llama", **{**config, "hidden_size": 32, "intermediate_size": 64})
    teacher = AutoModelForCausalLM.from_config(teacher_config)  # a plain Hugging Face model as the teacher
    module = DistillationModule(student=student, teacher=teacher, divergence="jsd", hard_weight=0.3).double()
    assert module.label_format == "hf"
    input_ids = make_batch(7)["input_ids"]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -4:] = 0  # right padding: those positions carry no loss
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.clone()}
    loss, fused = fused_loss_and_grads(module, batch)
    # the Hugging Face convention: position t predicts token t + 1; padded and last positions are ignored
    target = torch.nn.functional.pad(
        input_ids.masked_fill(attention_mask == 0, -100)[:, 1:], (0, 1), value=-100
    )
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    expected = unfused_distillation(
        student.model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state,
        student.model.lm_head.weight,
        teacher_hidden,
        teacher.lm_head.weight,
        target,
        divergence="jsd",
        hard_weight=0.3,
    )
    assert_matches_unfused(module, loss, fused, expected)


class GatheredOnlyInCalls:
    """Hooks on a head that keep its weight out of the module except during its own call, as a sharding hook
    (FSDP2, ZeRO-3) leaves only a shard there; they record whether the call's output needed a gradient."""

    def __init__(self, head: torch.nn.Linear) -> None:
        self.weight = head.weight
        self.outputs_need_grad: list[bool] = []
        head.register_forward_pre_hook(self.gather)
        head.register_forward_hook(self.release)
        self.release(head, (), None)

    def gather(self, head, args):
        head.weight = self.weight

    def release(self, head, args, output):
        if output is not None:
            self.outputs_need_grad.append(output.requires_grad)
        head.weight = torch.nn.Parameter(self.weight.new_empty(0), requires_grad=self.weight.requires_grad)


@requires_op
def test_both_heads_are_read_inside_their_own_calls_with_their_logit_scales_in_float64():
    """The loss reads each head's weight inside the head's call (where a sharding hook has gathered it), the
    teacher's call nested in the student's; the teacher's hooks see an output without gradient (FSDP2 would
    otherwise gather the frozen head again in backward). Each model's declared logit scale applies."""
    student, teacher = tiny_student(), tiny_teacher()
    student.logit_scale, teacher.logit_scale = 0.5, 2.0  # declared as Cohere declares it
    module = DistillationModule(student=student, teacher=teacher, divergence="jsd", hard_weight=0.25).double()
    hooks = [GatheredOnlyInCalls(model.lm_head) for model in (student, teacher)]
    batch = make_batch(3, n_ignored=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        loss = module.training_step(batch, 0)
    loss.backward()
    assert [hook.outputs_need_grad for hook in hooks] == [[True], [False]]
    assert student.lm_head.weight.numel() == 0  # released again after the call
    fused = student_grads(module)
    student.lm_head.weight, teacher.lm_head.weight = (hook.weight for hook in hooks)
    module.zero_grad()
    with torch.no_grad():
        teacher_hidden = teacher.hidden_states(batch["input_ids"])
    expected = unfused_distillation(
        student.hidden_states(batch["input_ids"]),
        student.lm_head.weight,
        teacher_hidden,
        teacher.lm_head.weight,
        batch["labels"],
        divergence="jsd",
        hard_weight=0.25,
        student_logit_scale=0.5,
        teacher_logit_scale=2.0,
    )
    assert_matches_unfused(module, loss, fused, expected)


@requires_op
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
def test_a_peft_lora_student_head_in_float64():
    """LoRA on the student's head: the loss is that of the head's logits (base + scaled B A), and the adapters get
    the unfused formula's gradients."""
    import peft

    student = tiny_student()
    peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False), student
    )
    student.requires_grad_(False)
    for name, param in student.named_parameters():
        param.requires_grad_("lora_" in name)
    module = DistillationModule(student=student, teacher=tiny_teacher(), divergence="forward_kl").double()
    batch = make_batch(4, n_ignored=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        loss = module.training_step(batch, 0)
    loss.backward()
    fused = student_grads(module)
    assert sorted(fused) == ["lm_head.lora_A.default.weight", "lm_head.lora_B.default.weight"]
    module.zero_grad()
    logits = student(batch["input_ids"])  # through the LoRA layer: the logits as an identity head's input
    with torch.no_grad():
        teacher_hidden = module.teacher.hidden_states(batch["input_ids"])
    expected = unfused_distillation(
        logits,
        torch.eye(VOCAB, dtype=torch.float64),
        teacher_hidden,
        module.teacher.lm_head.weight,
        batch["labels"],
        divergence="forward_kl",
    )
    expected.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    for name, grad in fused.items():
        torch.testing.assert_close(grad, student_grads(module)[name], **TOL, msg=name)


@requires_op
@pytest.mark.parametrize("hard_weight", [0.0, 0.25, 1.0])
def test_temperature_squared_scales_the_divergence_term_only(hard_weight):
    temperature = 2.5
    module = DistillationModule(
        student=tiny_student(),
        teacher=tiny_teacher(),
        divergence="forward_kl",
        temperature=temperature,
        temperature_squared=True,
        hard_weight=hard_weight,
    ).double()
    batch = make_batch(4, n_ignored=3)
    loss, fused = fused_loss_and_grads(module, batch)
    divergence = reference_loss(module, batch, hard_weight=0.0)
    ce = reference_loss(module, batch, hard_weight=1.0)
    expected = temperature**2 * (1 - hard_weight) * divergence + hard_weight * ce
    expected.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    for name, grad in student_grads(module).items():
        torch.testing.assert_close(fused[name], grad, **TOL, msg=name)


@requires_op
def test_trains_and_keeps_the_teacher_frozen_in_eval_mode():
    teacher = tiny_teacher()
    before = copy.deepcopy(teacher.state_dict())
    module = DistillationModule(student=tiny_student(), teacher=teacher, divergence="forward_kl", lr=1e-2)
    batches = [make_batch(seed) for seed in range(4)]
    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            assert pl_module.training and not pl_module.teacher.training
            assert not any(m.training for m in pl_module.teacher.modules())

    trainer(max_steps=40, callbacks=[Record()]).fit(module, DataLoader(batches, batch_size=None))
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses
    assert all(not p.requires_grad and p.grad is None for p in module.teacher.parameters())
    for name, value in module.teacher.state_dict().items():
        assert torch.equal(value, before[name]), name
    optimized = {id(p) for group in module.optimizers().optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.student.parameters()}


def test_the_teacher_stays_in_eval_mode_and_frozen():
    module = DistillationModule(student=tiny_student(dropout=0.1), teacher=tiny_teacher(dropout=0.1))
    module.train()
    assert module.student.training and not module.teacher.training
    assert not any(p.requires_grad for p in module.teacher.parameters())
    assert all(p.requires_grad for p in module.student.parameters())


def test_teacher_dtype_casts_the_teacher_only():
    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher(), teacher_dtype="bfloat16")
    assert {p.dtype for p in module.teacher.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.student.parameters()} == {torch.float32}
    module.double()  # a "64-true" Trainer converts the whole module; fit start casts the teacher back
    module.on_fit_start()
    assert {p.dtype for p in module.teacher.parameters()} == {torch.bfloat16}
    hidden = module.teacher_hidden_states(make_batch(0)["input_ids"])
    assert hidden.dtype == torch.bfloat16 and not hidden.requires_grad


@requires_op
def test_a_bfloat16_teacher_beside_a_float32_student():
    module = DistillationModule(
        student=tiny_student(), teacher=tiny_teacher(), teacher_dtype="bfloat16", divergence="forward_kl"
    )
    batch = make_batch(2, n_ignored=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        loss = module.training_step(batch, 0)
    student, teacher = module.student, module.teacher
    teacher_hidden = module.teacher_hidden_states(batch["input_ids"])
    expected = unfused_distillation(
        student.hidden_states(batch["input_ids"]).double(),
        student.lm_head.weight.double(),
        teacher_hidden.double(),
        teacher.lm_head.weight.double(),
        batch["labels"],
        divergence="forward_kl",
    )
    # the teacher's logits come from a bf16 GEMM (8 significant bits): the divergence to about 1%
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=2e-2, atol=1e-4)


@requires_op
def test_a_teacher_dtype_the_strategy_did_not_keep_is_refused():
    """As under FSDP1 with "32-true" (tests/test_distill_fsdp1_zero3.py): the wrapper converted the teacher and
    manages its parameters, so the cast back does not reach the head; the loss would silently run in float32."""
    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher(), teacher_dtype="bfloat16")
    module.teacher.float()
    with pytest.raises(RuntimeError, match="teacher_dtype=bfloat16 was not kept: .* in float32"):
        module.training_step(make_batch(1), 0)


ACCUMULATION_OPTIONS = {"divergence": "jsd", "hard_weight": 0.3}


def fit_one_step(batches: list, accumulate: int, **options) -> tuple[dict, float]:
    """The student's gradients at the optimizer step (float64, before AdamW) of one step over ``batches``, and
    the ``train/loss`` logged for it."""
    saved = {}

    class Save(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            saved["grads"] = student_grads(pl_module)

    module = DistillationModule(
        student=tiny_student(), teacher=tiny_teacher(), **ACCUMULATION_OPTIONS, **options
    )
    fit = trainer(precision="64-true", max_steps=1, accumulate_grad_batches=accumulate, callbacks=[Save()])
    fit.fit(module, DataLoader(batches, batch_size=None))
    return saved["grads"], float(fit.callback_metrics["train/loss_step"])


@requires_op
@pytest.mark.parametrize("normalize", ["step", "micro_batch"])
def test_gradient_accumulation_equals_one_batch_of_both_in_float64(normalize):
    # equal token counts per micro-batch: the mean of the micro-batch means is the mean over both
    first, second = make_batch(5), make_batch(6)
    both = {key: torch.cat([first[key], second[key]]) for key in first}
    accumulated, _ = fit_one_step([first, second], 2, normalize=normalize)
    one, _ = fit_one_step([both], 1, normalize=normalize)
    assert accumulated.keys() == one.keys()
    for name, grad in one.items():
        torch.testing.assert_close(accumulated[name], grad, **TOL, msg=name)


@requires_op
@pytest.mark.parametrize("normalize", ["step", "micro_batch"])
def test_accumulated_micro_batches_with_different_ignored_counts_in_float64(normalize):
    # 22 and 15 of 24 tokens carry a loss: "step" weighs each token alike (the token mean over both), while
    # "micro_batch" weighs each micro-batch alike (the mean of the two means)
    first, second = make_batch(7, n_ignored=2), make_batch(8, n_ignored=9)
    both = {key: torch.cat([first[key], second[key]]) for key in first}
    grads, logged = fit_one_step([first, second], 2, normalize=normalize)

    module = DistillationModule(
        student=tiny_student(), teacher=tiny_teacher(), **ACCUMULATION_OPTIONS
    ).double()
    step_mean = reference_loss(module, both)
    mean_of_means = (reference_loss(module, first) + reference_loss(module, second)) / 2
    params = dict(module.student.named_parameters())
    references = {}
    for mode, loss in (("step", step_mean), ("micro_batch", mean_of_means)):
        values = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
        references[mode] = {name: grad for name, grad in zip(params, values) if grad is not None}
    expected = references[normalize]
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, **TOL, msg=name)
    # the two modes' gradients differ far beyond the tolerance on these batches (the test can tell them apart)
    other = references["micro_batch" if normalize == "step" else "step"]
    differences = [(grads[name] - grad).abs().max() / grad.abs().max() for name, grad in other.items()]
    assert max(differences) > 1e-4
    # the logged loss is the step's token mean in both modes (Lightning keeps a logged float as float32)
    assert logged == pytest.approx(float(step_mean.detach()), rel=1e-6)
    assert logged != pytest.approx(float(mean_of_means.detach()), rel=1e-6)


@requires_op
def test_checkpoint_leaves_the_teacher_out_and_resumes(tmp_path):
    teacher = tiny_teacher()
    module = DistillationModule(student=tiny_student(), teacher=teacher)
    batches = [make_batch(seed) for seed in range(2)]
    trainer(max_steps=2, default_root_dir=tmp_path).fit(module, DataLoader(batches, batch_size=None))
    path = tmp_path / "distill.ckpt"
    module.trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert state and not any(name.startswith("teacher.") for name in state)
    assert any(name.startswith("student.") for name in state)
    # resuming: the module rebuilt with its teacher loads the student and continues the steps
    resumed = DistillationModule(student=tiny_student(seed=9), teacher=tiny_teacher())
    fit = trainer(max_steps=3, default_root_dir=tmp_path)
    fit.fit(resumed, DataLoader(batches, batch_size=None), ckpt_path=path)
    assert fit.global_step == 3
    loaded = DistillationModule.load_from_checkpoint(
        path, student=tiny_student(seed=9), teacher=tiny_teacher()
    )
    for name, value in module.student.state_dict().items():
        torch.testing.assert_close(loaded.student.state_dict()[name], value)
    for name, value in teacher.state_dict().items():
        torch.testing.assert_close(loaded.teacher.state_dict()[name], value)


@pytest.mark.parametrize(
    "strategy, keeps_teacher",
    [
        ("SingleDeviceStrategy", False),
        ("DDPStrategy", False),
        ("FSDPStrategy", True),
        ("ModelParallelStrategy", True),
    ],
)
def test_the_teacher_stays_in_checkpoints_a_strategy_loads_itself(strategy, keeps_teacher):
    """FSDP1 and FSDP2 load a checkpoint into the module in their own ``load_checkpoint``, strictly, before
    ``on_load_checkpoint`` could put a dropped teacher back (tests/test_distill_fsdp1_zero3.py resumes through both):
    their checkpoints keep it; the others drop it."""
    from types import SimpleNamespace

    import lightning.pytorch.strategies as strategies

    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher())
    instance = (
        strategies.SingleDeviceStrategy("cpu")
        if strategy == "SingleDeviceStrategy"
        else getattr(strategies, strategy)()
    )
    module._trainer = SimpleNamespace(strategy=instance)
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert any(name.startswith("teacher.") for name in checkpoint["state_dict"]) is keeps_teacher
    assert any(name.startswith("student.") for name in checkpoint["state_dict"])


def test_teacher_checkpoint_is_loaded_and_a_missing_one_explained(tmp_path):
    teacher = tiny_teacher()
    path = save_module_checkpoint(teacher, tmp_path / "teacher.ckpt")
    module = DistillationModule(student=tiny_student(), teacher_checkpoint=str(path))
    assert isinstance(module.teacher, TinyGPT)
    for name, value in teacher.state_dict().items():
        torch.testing.assert_close(module.teacher.state_dict()[name], value)
    assert "teacher_checkpoint" in module.hparams and "student" not in module.hparams
    with pytest.raises(FileNotFoundError, match="lightning-flce fit --config default"):
        DistillationModule(student=tiny_student(), teacher_checkpoint=str(tmp_path / "missing.ckpt"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"divergence": "kl"}, "divergence must be one of"),
        ({"beta": 1.5}, "beta"),
        ({"temperature": 0.0}, "temperature"),
        ({"hard_weight": -0.1}, "hard_weight"),
        ({"top_k": 0}, "top_k"),
        ({"normalize": "token"}, "normalize must be one of"),
        ({"teacher_dtype": "int8"}, "teacher_dtype"),
        ({"accum_dtype": "int8"}, "accum_dtype must be"),
        ({"vocab_size": VOCAB + 1}, "vocabulary"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistillationModule(student=tiny_student(), teacher=tiny_teacher(), **kwargs)


@requires_op
def test_accum_dtype_reaches_the_loss(monkeypatch):
    """``accum_dtype`` is the op's: the module passes it (as a dtype's name, from YAML) to every loss call."""
    import lightning_flce.models.distill as distill_module

    calls = []
    fused = distill_module._fused_distillation

    def spy(*args, **kwargs):
        calls.append(kwargs.get("accum_dtype"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(distill_module, "_fused_distillation", spy)
    module = DistillationModule(
        student=tiny_student(), teacher=tiny_teacher(), accum_dtype="float64"
    ).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        module.training_step(make_batch(3), 0).backward()
    assert calls == ["float64"]


def test_vocabularies_must_match_and_exactly_one_teacher():
    with pytest.raises(ValueError, match="rows"):
        DistillationModule(student=tiny_student(vocab_size=VOCAB + 2), teacher=tiny_teacher())
    with pytest.raises(ValueError, match="exactly one"):
        DistillationModule(student=tiny_student())


@requires_op
def test_validation_logs_loss_divergence_and_student_ce(tmp_path):
    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher(), hard_weight=0.25)
    batches = [make_batch(seed, n_ignored=3) for seed in range(3)]
    fit = trainer(max_steps=1, limit_val_batches=3, default_root_dir=tmp_path)
    fit.fit(module, DataLoader(batches[:1], batch_size=None), DataLoader(batches, batch_size=None))
    metrics = fit.callback_metrics
    with torch.no_grad():
        labels = torch.cat([b["labels"] for b in batches])
        inputs = torch.cat([b["input_ids"] for b in batches])
        student, teacher = module.student.eval(), module.teacher
        divergence = reference_loss(module, {"input_ids": inputs, "labels": labels}, hard_weight=0.0)
        ce = F.cross_entropy(student(inputs).reshape(-1, VOCAB), labels.reshape(-1))
    for name, value in {
        "val/divergence": divergence,
        "val/student_ce": ce,
        "val/loss": 0.75 * divergence + 0.25 * ce,
        "val/perplexity": ce.exp(),
    }.items():
        assert float(metrics[name]) == pytest.approx(float(value), rel=1e-4), name
    assert set(module.last_val_metrics) >= {"val/loss", "val/divergence", "val/student_ce", "val/perplexity"}
    assert module.flce_last_teacher_logits_shape == (2 * SEQ, VOCAB)
    assert teacher.training is False


@requires_op
def test_several_validation_dataloaders_and_the_test_stage_get_their_own_metrics(tmp_path, caplog):
    """Two validation dataloaders: each its token means (against the unfused float64 formula on its batches) under
    Lightning's ``/dataloader_idx_N`` names, in ``last_val_metrics`` and on the console line; ``trainer.test``
    logs the same means as ``test/*``."""
    module = DistillationModule(
        student=tiny_student(), teacher=tiny_teacher(), hard_weight=0.25, temperature=1.5
    ).double()
    loaders = [[make_batch(seed, n_ignored=2) for seed in seeds] for seeds in ((3, 4), (5,))]
    fit = trainer(max_steps=1, limit_val_batches=2, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        fit.fit(
            module,
            DataLoader([make_batch(0)], batch_size=None),
            [DataLoader(batches, batch_size=None) for batches in loaders],
        )
    expected = {}
    with torch.no_grad():
        for index, batches in enumerate(loaders):
            every = {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}
            divergence = reference_loss(module, every, hard_weight=0.0)
            ce = reference_loss(module, every, hard_weight=1.0)
            student_logits = module.student(every["input_ids"])
            counted = every["labels"] != -100
            accuracy = (student_logits.argmax(-1) == every["labels"])[counted].double().mean()
            expected.update(
                {
                    f"val/divergence/dataloader_idx_{index}": divergence,
                    f"val/student_ce/dataloader_idx_{index}": ce,
                    f"val/loss/dataloader_idx_{index}": 0.75 * divergence + 0.25 * ce,
                    f"val/perplexity/dataloader_idx_{index}": ce.exp(),
                    f"val/token_accuracy/dataloader_idx_{index}": accuracy,
                }
            )
    assert set(module.last_val_metrics) == set(expected)
    for name, value in expected.items():
        assert module.last_val_metrics[name] == pytest.approx(float(value), rel=1e-9), name
        # Lightning keeps logged floats as float32 tensors
        assert float(fit.callback_metrics[name]) == pytest.approx(float(value), rel=1e-6), name
    assert "val/divergence" not in fit.callback_metrics
    line = next(record.getMessage() for record in caplog.records if "Distillation val" in record.getMessage())
    assert "; [dataloader 1] loss" in line and line.index("[dataloader 0]") < line.index("[dataloader 1]")

    tested = fit.test(module, DataLoader(loaders[1], batch_size=None), verbose=False)[0]
    for name in ("loss", "divergence", "student_ce", "perplexity", "token_accuracy"):
        expected_value = module.last_val_metrics[f"val/{name}/dataloader_idx_1"]
        assert tested[f"test/{name}"] == pytest.approx(expected_value, rel=1e-6), name  # float32, as logged


@requires_op
def test_a_validation_dataloader_without_batches_logs_nothing():
    """Of two validation dataloaders the empty one gets no metrics (no zeros logged as its means)."""
    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher()).double()
    batch = make_batch(1)
    loaders = [DataLoader([], batch_size=None), DataLoader([batch], batch_size=None)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's "Total length of `DataLoader` ... is zero"
        trainer(limit_val_batches=1.0).validate(module, loaders, verbose=False)
    assert set(module.last_val_metrics) == {
        f"val/{name}/dataloader_idx_1"
        for name in ("loss", "divergence", "student_ce", "perplexity", "token_accuracy")
    }
    with torch.no_grad():
        divergence = reference_loss(module, batch, hard_weight=0.0)
    assert module.last_val_metrics["val/divergence/dataloader_idx_1"] == pytest.approx(
        float(divergence), rel=1e-9
    )


@requires_op
def test_vocab_size_distills_heads_padded_to_different_rows_in_float64(tmp_path):
    """A student head of VOCAB + 4 rows and a teacher's of VOCAB + 8 for one tokenizer of VOCAB tokens (as Qwen2.5's
    0.5B and 7B heads, 151936 and 152064 rows for 151665 tokens): the loss and the validation's student CE over the
    first VOCAB rows of both heads, the student's padding rows without a gradient."""
    options = {"divergence": "jsd", "beta": 0.3, "hard_weight": 0.25, "temperature": 1.5}
    student, teacher = tiny_student(vocab_size=VOCAB + 4), tiny_teacher(vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match="pass vocab_size"):
        DistillationModule(student=student, teacher=teacher)
    with pytest.raises(ValueError, match="the data's vocabulary has 53 tokens"):
        DistillationModule(student=student, teacher=teacher, vocab_size=VOCAB + 5)
    module = DistillationModule(student=student, teacher=teacher, vocab_size=VOCAB, **options).double()
    batch = make_batch(3, n_ignored=5)
    loss, fused = fused_loss_and_grads(module, batch)
    # (TinyGPT ties the head to the embeddings by default)
    head = "lm_head.weight" if "lm_head.weight" in fused else "tok_emb.weight"
    assert not fused[head][VOCAB:].any()
    with torch.no_grad():
        teacher_hidden = teacher.hidden_states(batch["input_ids"])
    expected = unfused_distillation(
        student.hidden_states(batch["input_ids"]),
        student.lm_head.weight[:VOCAB],
        teacher_hidden,
        teacher.lm_head.weight[:VOCAB],
        batch["labels"],
        **options,
    )
    assert_matches_unfused(module, loss, fused, expected)
    assert module.flce_last_logits_shape == module.flce_last_teacher_logits_shape == (2 * SEQ, VOCAB)
    ce, correct = module._student_cross_entropy(student.hidden_states(batch["input_ids"]), batch["labels"])
    logits = student(batch["input_ids"])[..., :VOCAB].reshape(-1, VOCAB)
    labels = batch["labels"].reshape(-1)
    torch.testing.assert_close(ce, F.cross_entropy(logits, labels, reduction="sum"), **TOL)
    assert int(correct) == int(((logits.argmax(-1) == labels) & (labels != -100)).sum())


def test_memory_callback_counts_the_teacher(tmp_path):
    from types import SimpleNamespace

    from lightning_flce.callbacks import FLCEMemoryCallback
    from lightning_flce.callbacks.memory_model import teacher_logits_bytes

    tokens, vocab, mib = 64, 1000, 2**20
    callback = FLCEMemoryCallback()
    fake_trainer = SimpleNamespace(precision="32-true")
    student_only = SimpleNamespace(flce_last_logits_shape=(tokens, vocab), parameters=lambda: [])
    distilling = SimpleNamespace(
        flce_last_logits_shape=(tokens, vocab),
        flce_last_teacher_logits_shape=(tokens, vocab),
        flce_teacher_compute_dtype=torch.bfloat16,
        parameters=lambda: [],
    )
    _, unfused, saved = callback._head_figures(fake_trainer, student_only)
    estimate, unfused_both, saved_both = callback._head_figures(fake_trainer, distilling)
    # the teacher's bf16 logits (2 bytes) and their fp32 log-softmax (4 bytes)
    assert teacher_logits_bytes(tokens, vocab, torch.bfloat16) == tokens * vocab * 6
    assert estimate.teacher_bytes == tokens * vocab * 6
    assert unfused_both == pytest.approx(unfused + tokens * vocab * 6 / mib)
    assert saved_both == pytest.approx(saved + tokens * vocab * 6 / mib)  # no hidden size: no fused buffers
    assert teacher_logits_bytes(tokens, vocab, torch.float32) == tokens * vocab * 8
    assert teacher_logits_bytes(tokens, vocab, torch.float64) == tokens * vocab * 16


def test_memory_estimate_with_teacher_adds_a_chunk_buffer():
    from lightning_flce.callbacks.memory_model import HeadMemoryModel
    from lightning_flce.engine import AUXILIARY_BLOCK_ROWS

    estimate = HeadMemoryModel("32-true", torch.float32, hidden_size=16, chunk_size=8).estimate(64, 100)
    both = estimate.with_teacher(64, 100, torch.float32)
    assert both.unfused_bytes == estimate.unfused_bytes + 64 * 100 * 8
    assert both.chunk_bytes == estimate.chunk_bytes + estimate.chunk_rows * 100 * 4
    assert both.fused_bytes == estimate.fused_bytes + estimate.chunk_rows * 100 * 4
    assert both.saved_bytes == both.unfused_bytes - both.fused_bytes
    # on the GPU the teacher runs in blocks: its buffer is one block of the chunk
    blocked = estimate.with_teacher(64, 100, torch.float32, block_rows=3)
    assert blocked.fused_bytes == estimate.fused_bytes + 3 * 100 * 4
    triton = HeadMemoryModel("bf16-mixed", torch.float32, hidden_size=16, impl="triton")
    torch_path = HeadMemoryModel("bf16-mixed", torch.float32, hidden_size=16, impl="torch")
    assert (triton.auxiliary_block_rows(), torch_path.auxiliary_block_rows()) == (AUXILIARY_BLOCK_ROWS, None)


def test_memory_callback_reads_the_modules_loss_options():
    """The estimate follows DistillationModule's own ``accum_dtype`` / ``chunk_size`` / ``logits_precision`` (not
    the student's ``flce_*`` options, which the distillation loss does not use)."""
    from lightning_flce.callbacks import FLCEMemoryCallback

    module = DistillationModule(
        student=tiny_student(),
        teacher=tiny_teacher(),
        accum_dtype="float64",
        chunk_size=7,
        logits_precision="fp32",
    )
    model = FLCEMemoryCallback(verbose=False)._head_model(trainer(), module, VOCAB)
    assert (model.accum_dtype, model.chunk_size, model.logits_precision) == (torch.float64, 7, "fp32")


@requires_op
def test_memory_callback_reports_the_teacher_during_fit(tmp_path):
    from lightning_flce.callbacks import FLCEMemoryCallback

    callback = FLCEMemoryCallback(verbose=False)
    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher())
    trainer(max_steps=2, log_every_n_steps=1, callbacks=[callback], default_root_dir=tmp_path).fit(
        module, DataLoader([make_batch(0), make_batch(1)], batch_size=None)
    )
    assert callback.head_estimate.teacher_bytes == 2 * SEQ * VOCAB * 8  # 32-true: fp32 logits and softmax
    student_only = callback.head_estimate.unfused_bytes - callback.head_estimate.teacher_bytes
    assert student_only == 2 * SEQ * VOCAB * 12
    from lightning_flce.callbacks.memory_report import head_lines

    lines = head_lines(callback.head_estimate)
    assert "(12 + 8 bytes a logit)" in lines[1] and "of which the teacher's" in lines[2]


def save_module_checkpoint(module: pl.LightningModule, path: Path) -> Path:
    """A Lightning checkpoint of ``module`` as it is (no training)."""
    fit = trainer(max_steps=0)
    fit.strategy.connect(module)
    fit.save_checkpoint(path)
    return path


# ------------------------------------------------------------------ DDP (2 gloo ranks)

# rank 0 takes micro-batches 0 and 1, rank 1 takes 2 and 3, with different numbers of ignored labels (rank 0
# 3 of 48, rank 1 18): under normalize="step" the gradient is the mean over all their tokens
DDP_BATCHES = [make_batch(20 + index, n_ignored=(0, 3, 7, 11)[index]) for index in range(4)]
DDP_OPTIONS = {"divergence": "jsd", "beta": 0.4, "hard_weight": 0.2, "temperature": 1.5}
# validation: rank r takes batches 2r and 2r + 1, with different numbers of ignored tokens (a token-weighted mean)
DDP_VAL_BATCHES = [make_batch(30 + index, n_ignored=3 * index) for index in range(4)]


class SaveValidation(pl.Callback):
    """A DDP worker's callback: the validation metrics and the student they were computed with."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_validation_end(self, trainer, pl_module) -> None:
        saved = {"metrics": dict(pl_module.last_val_metrics), "student": pl_module.student.state_dict()}
        torch.save(saved, Path(self.out_dir) / f"val{trainer.global_rank}.pt")


class RankMicroBatches(torch.utils.data.Sampler):
    def __iter__(self):
        rank = torch.distributed.get_rank()
        return iter([2 * rank, 2 * rank + 1])

    def __len__(self) -> int:
        return 2


def run_ddp(out_dir: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy
    from ranks import SaveStep

    torch.set_num_threads(1)
    fit = trainer(
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        precision="64-true",
        max_steps=1,
        accumulate_grad_batches=2,
        callbacks=[SaveStep(out_dir), SaveValidation(out_dir)],
        use_distributed_sampler=False,
        limit_val_batches=2,
    )
    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher(), **DDP_OPTIONS)
    fit.fit(
        module,
        DataLoader(DDP_BATCHES, batch_size=None, sampler=RankMicroBatches()),
        DataLoader(DDP_VAL_BATCHES, batch_size=None, sampler=RankMicroBatches()),
    )


@pytest.mark.slow
@requires_op
def test_ddp_two_ranks_with_accumulation_and_different_ignored_counts_equals_one_batch_of_all(tmp_path):
    from ranks import clean_env

    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    module = DistillationModule(student=tiny_student(), teacher=tiny_teacher(), **DDP_OPTIONS).double()
    both = {key: torch.cat([batch[key] for batch in DDP_BATCHES]) for key in DDP_BATCHES[0]}
    reference_loss(module, both).backward()
    expected = {f"student.{name}": grad for name, grad in student_grads(module).items()}
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert saved["world_size"] == 2
        grads = {name: grad for name, grad in saved["grads"].items()}
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], **TOL, msg=f"rank {rank}: {name}")
    # validation after the step: the token means over both ranks' batches, equal on both ranks
    validated = [torch.load(tmp_path / f"val{rank}.pt", weights_only=False) for rank in range(2)]
    assert validated[0]["metrics"] == validated[1]["metrics"]
    module.student.load_state_dict(validated[0]["student"])
    every = {key: torch.cat([batch[key] for batch in DDP_VAL_BATCHES]) for key in DDP_VAL_BATCHES[0]}
    with torch.no_grad():
        divergence = reference_loss(module, every, hard_weight=0.0)
        ce = reference_loss(module, every, hard_weight=1.0)
    metrics = validated[0]["metrics"]
    assert metrics["val/divergence"] == pytest.approx(float(divergence), rel=1e-9)
    assert metrics["val/student_ce"] == pytest.approx(float(ce), rel=1e-9)
    assert metrics["val/loss"] == pytest.approx(float(0.8 * divergence + 0.2 * ce), rel=1e-9)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ranks import end_worker

    run_ddp(sys.argv[1])
    end_worker()


# ------------------------------------------------------------------ the `distill` config


def test_distill_config_runs_a_few_steps_on_a_tiny_teacher(tmp_path, monkeypatch, caplog):
    from lightning_flce.cli import CONFIG_DIR, main
    from lightning_flce.data import PythonStdlibDataModule

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-flce"])
    data_args = {"cache_dir": str(tmp_path / "cache"), "vocab_size": 512, "max_chars": 300000, "seq_len": 32}
    vocab_size = PythonStdlibDataModule(**data_args).vocab_size  # the tokenizer's real size
    teacher = tiny_teacher(vocab_size=vocab_size, max_seq_len=32)
    teacher_path = save_module_checkpoint(teacher, tmp_path / "teacher.ckpt")
    args = [
        "fit",
        "--config",
        str(CONFIG_DIR / "distill.yaml"),
        *(f"--data.init_args.{name}={value}" for name, value in data_args.items()),
        "--data.init_args.batch_size=4",
        f"--model.init_args.student.init_args.vocab_size={vocab_size}",
        "--model.init_args.student.init_args.d_model=16",
        f"--model.init_args.teacher_checkpoint={teacher_path}",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
    ]
    if not _fused_available():
        pytest.skip("fused_linear_distillation not merged yet")
    main(args)
    rows = (tmp_path / "lightning_logs/distill/distill/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    for name in (
        "train/loss_step",
        "val/loss",
        "val/divergence",
        "val/student_ce",
        "memory/unfused_head_mib",
    ):
        assert name in header, header
    assert "Distillation val (epoch 0, step 3): loss" in caplog.text
    checkpoint = torch.load(
        tmp_path / "lightning_logs/distill/distillationmodule/checkpoints/last.ckpt", weights_only=False
    )
    assert checkpoint["global_step"] == 3
    assert not any(name.startswith("teacher.") for name in checkpoint["state_dict"])
    # resuming from it rebuilds the teacher from teacher_checkpoint and continues
    main([*args[:-5], "--trainer.max_steps=4", "--trainer.enable_progress_bar=false", "--ckpt_path=last"])


def test_distill_config_without_the_teacher_checkpoint_says_what_to_run(tmp_path, monkeypatch, capsys):
    from lightning_flce.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-flce"])
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                "distill",
                f"--data.init_args.cache_dir={tmp_path}",
                "--data.init_args.vocab_size=512",
                "--data.init_args.max_chars=300000",
            ]
        )
    assert exit_info.value.code == 2
    assert "lightning-flce fit --config default" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- a cached teacher
CACHED_K = 6


def with_cached_top_k(batch: dict, teacher: TinyGPT, k: int = CACHED_K) -> dict:
    """``batch`` with the teacher's top k per position as a cache would store it: its log-probabilities and
    columns, [B, T, k] (the renormalization over k makes logits and log-probabilities the same)."""
    with torch.no_grad():
        logits = teacher.lm_head(teacher.hidden_states(batch["input_ids"]))
    values, indices = logits.log_softmax(-1).topk(k, dim=-1)
    return {**batch, "teacher_top_k_indices": indices, "teacher_top_k_logits": values}


CACHED_CASES = [
    {"divergence": "forward_kl"},
    {"divergence": "reverse_kl", "temperature": 2.0},
    {"divergence": "jsd", "beta": 0.3, "hard_weight": 0.25, "temperature": 0.7},
]


@requires_op
@pytest.mark.parametrize("options", CACHED_CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_cached_teacher_equals_the_teacher_models_top_k_in_float64(options):
    """A batch carrying the teacher's top k gives the loss and student gradients of the live teacher with
    ``top_k=k``, which equal the unfused formula's (float64 on both sides)."""
    teacher = tiny_teacher().double()
    live = DistillationModule(student=tiny_student(), teacher=teacher, top_k=CACHED_K, **options).double()
    cached = DistillationModule(student=tiny_student(), cached_teacher=True, **options).double()
    assert cached.teacher is None and cached.hparams.cached_teacher
    batch = with_cached_top_k(make_batch(3, n_ignored=5), teacher)
    results = []
    for module in (live, cached):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer
            loss = module.training_step(batch, 0)
        loss.backward()
        results.append((loss.detach(), student_grads(module)))
    expected = reference_loss(live, batch)
    torch.testing.assert_close(results[1][0], expected.detach(), **TOL)
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    (_, live_grads), (_, cached_grads) = results
    assert cached_grads.keys() == live_grads.keys() and cached_grads
    for name, grad in live_grads.items():
        torch.testing.assert_close(cached_grads[name], grad, **TOL, msg=name)
    assert cached.flce_last_teacher_logits_shape is None  # no teacher head: no teacher logits avoided


@requires_op
def test_cached_teacher_trains_with_accumulation_validates_and_checkpoints(tmp_path):
    """Through the Trainer: one optimizer step over two accumulated micro-batches of cached batches equals the
    live teacher's (top_k = k) in float64; validation logs the divergence; the checkpoint holds the student
    alone and loads back."""
    teacher = tiny_teacher().double()  # the cache in float64, as the live teacher runs under 64-true
    batches = [with_cached_top_k(make_batch(7 + seed, n_ignored=2 + 5 * seed), teacher) for seed in range(2)]
    grads = {}

    class Save(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads[pl_module.hparams.cached_teacher] = student_grads(pl_module)

    for module in (
        DistillationModule(student=tiny_student(), teacher=teacher, top_k=CACHED_K, **ACCUMULATION_OPTIONS),
        DistillationModule(student=tiny_student(), cached_teacher=True, **ACCUMULATION_OPTIONS),
    ):
        fit = trainer(precision="64-true", max_steps=1, accumulate_grad_batches=2, callbacks=[Save()])
        fit.fit(module, DataLoader(batches, batch_size=None))
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, **TOL, msg=name)

    module = DistillationModule(student=tiny_student(), cached_teacher=True, hard_weight=0.25)
    fit = trainer(max_steps=1, limit_val_batches=2, default_root_dir=tmp_path)
    fit.fit(module, DataLoader(batches[:1], batch_size=None), DataLoader(batches, batch_size=None))
    assert {"val/loss", "val/divergence", "val/student_ce"} <= set(fit.callback_metrics)
    assert float(fit.callback_metrics["val/divergence"]) > 0
    path = tmp_path / "cached.ckpt"
    fit.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert state and all(name.startswith("student.") for name in state)
    loaded = DistillationModule.load_from_checkpoint(path, student=tiny_student(seed=9))
    assert loaded.teacher is None and loaded.hparams.cached_teacher
    for name, value in module.student.state_dict().items():
        torch.testing.assert_close(loaded.student.state_dict()[name], value)


def test_cached_teacher_options_and_batches_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        DistillationModule(student=tiny_student(), teacher=tiny_teacher(), cached_teacher=True)
    with pytest.raises(ValueError, match="top_k None"):
        DistillationModule(student=tiny_student(), cached_teacher=True, top_k=4)
    with pytest.raises(ValueError, match="teacher_dtype must be None"):
        DistillationModule(student=tiny_student(), cached_teacher=True, teacher_dtype="bfloat16")
    module = DistillationModule(student=tiny_student(), cached_teacher=True)
    batch = make_batch(0)
    with pytest.raises(KeyError, match="teacher_top_k_indices"):
        module.training_step(batch, 0)
    cached = with_cached_top_k(batch, tiny_teacher())
    bad = {**cached, "teacher_top_k_logits": cached["teacher_top_k_logits"][:, :-1]}
    with pytest.raises(ValueError, match="teacher_top_k_logits must be"):
        module.training_step(bad, 0)
    out_of_range = {**cached, "teacher_top_k_indices": cached["teacher_top_k_indices"] + VOCAB}
    with pytest.raises(ValueError, match=rf"indices outside \[0, {VOCAB}\)"):
        module.training_step(out_of_range, 0)
    with pytest.raises(RuntimeError, match="cached teacher"):
        module.teacher_hidden_states(batch["input_ids"])
