"""examples/distill_on_policy.py: on-policy distillation (GKD) through DistillationModule: the student's samples
replace the completions, the loss is the float64 divergence over the completion positions, and a short CPU run
teaches the student the teacher's chain."""

import copy
import csv
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from lightning_flce.models import TinyGPT

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distill_on_policy.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("distill_on_policy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _models(vocab: int, length: int, dtype=torch.float64):
    torch.manual_seed(0)
    teacher = TinyGPT(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, max_seq_len=length).to(dtype)
    student = TinyGPT(vocab_size=vocab, d_model=16, n_layers=1, n_heads=4, max_seq_len=length).to(dtype)
    return teacher, student


def _module(example, lmbda: float, **options):
    teacher, student = _models(vocab=24, length=10)
    return example.OnPolicyDistillation(
        student=student, teacher=teacher, prompt_length=3, lmbda=lmbda, seed=1, **options
    )


def test_the_on_policy_batch_keeps_the_prompt_and_the_loss_on_the_completion(example):
    module = _module(example, lmbda=1.0)
    sequences = torch.randint(0, 24, (5, 10))
    batch = example.completion_batch(sequences, 3)
    assert (batch["labels"][:, :2] == example.IGNORE_INDEX).all()
    assert torch.equal(batch["labels"][:, 2:], sequences[:, 3:])

    torch.manual_seed(7)
    on_policy = module.on_policy_batch(batch)
    torch.manual_seed(7)
    completions = module.sample_completions(sequences[:, :3], 7)
    assert module.student.training  # sampling in eval mode put the student back in train mode
    assert torch.equal(on_policy["input_ids"], torch.cat([sequences[:, :3], completions], 1)[:, :-1])
    assert (on_policy["labels"][:, :2] == example.IGNORE_INDEX).all()
    assert torch.equal(on_policy["labels"][:, 2:], completions)


@pytest.mark.parametrize("divergence", ["jsd", "reverse_kl"])
def test_the_training_step_is_the_completion_divergence_against_float64(example, divergence):
    """lmbda 1: the step samples, then its loss and the student's gradients are those of the divergence between
    both models' softmaxes over the sampled completion positions, computed from plain float64 logits."""
    module = _module(example, lmbda=1.0, divergence=divergence, beta=0.3)
    sequences = torch.randint(0, 24, (4, 10))
    batch = example.completion_batch(sequences, 3)
    reference_student = copy.deepcopy(module.student)

    torch.manual_seed(11)
    loss = module.training_step(batch, 0)
    loss.backward()
    torch.manual_seed(11)
    sampled = module.on_policy_batch(batch)

    with torch.no_grad():
        log_q = module.teacher(sampled["input_ids"]).log_softmax(-1)
    log_p = reference_student(sampled["input_ids"]).log_softmax(-1)
    if divergence == "jsd":  # beta KL(teacher || M) + (1 - beta) KL(student || M), M = beta q + (1 - beta) p
        beta = 0.3
        log_m = torch.logaddexp(log_q + math.log(beta), log_p + math.log(1 - beta))
        per_token = beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - beta) * (
            log_p.exp() * (log_p - log_m)
        ).sum(-1)
    else:  # KL(student || teacher)
        per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    counted = sampled["labels"] != example.IGNORE_INDEX
    expected = per_token[counted].mean()
    expected.backward()

    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-10, atol=1e-12)
    for (name, got), want in zip(module.student.named_parameters(), reference_student.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert all(p.grad is None for p in module.teacher.parameters())


def test_a_hugging_face_student_gets_its_label_format(example):
    """An HFCausalLM student (labels in the Hugging Face convention, shifted by the module) and a plain Hugging Face
    teacher: the sampled batch keeps the prompt, and the step's loss is the JSD over the completion positions from
    both models' float64 logits."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_flce.models import HFCausalLM

    config = {
        "vocab_size": 24,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 16,
    }
    torch.manual_seed(0)
    student = HFCausalLM(config={"model_type": "llama", **config})
    teacher = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**config, "hidden_size": 32}))
    module = example.OnPolicyDistillation(
        student=student, teacher=teacher, prompt_length=3, lmbda=1.0, divergence="jsd"
    ).double()
    assert module.label_format == "hf"
    sequences = torch.randint(0, 24, (3, 9))
    batch = example.completion_batch(sequences, 3, "hf")

    torch.manual_seed(5)
    loss = module.training_step(batch, 0)
    torch.manual_seed(5)
    sampled = module.on_policy_batch(batch)
    input_ids = sampled["input_ids"]
    assert input_ids.shape == sequences.shape and torch.equal(input_ids[:, :3], sequences[:, :3])
    assert (sampled["labels"][:, :3] == example.IGNORE_INDEX).all()
    assert torch.equal(sampled["labels"][:, 3:], input_ids[:, 3:])

    with torch.no_grad():
        log_q = teacher(input_ids).logits.log_softmax(-1)[:, 2:-1]  # positions 2..7 predict tokens 3..8
        log_p = student(input_ids).log_softmax(-1)[:, 2:-1]
    log_m = torch.logaddexp(log_q + math.log(0.5), log_p + math.log(0.5))
    expected = (
        0.5 * (log_q.exp() * (log_q - log_m)).sum(-1) + 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1)
    ).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-10, atol=1e-12)


def test_lmbda_zero_keeps_the_dataset_completions(example, monkeypatch):
    module = _module(example, lmbda=0.0)
    monkeypatch.setattr(module, "on_policy_batch", lambda batch: pytest.fail("sampled with lmbda 0"))
    batch = example.completion_batch(torch.randint(0, 24, (2, 10)), 3)
    assert torch.isfinite(module.training_step(batch, 0))


@pytest.mark.parametrize(("option", "value"), [("lmbda", 1.5), ("prompt_length", 0)])
def test_bad_options_are_refused(example, option, value):
    options = {"prompt_length": 3, "lmbda": 0.5, option: value}
    teacher, student = _models(vocab=24, length=10)
    with pytest.raises(ValueError, match=option):
        example.OnPolicyDistillation(student=student, teacher=teacher, **options)


@pytest.mark.slow
def test_the_student_learns_the_teachers_chain(example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = example.main([])
    # a chain of 3 successors among 64 tokens: an untrained student samples an allowed transition ~5% of the time
    assert results["student_before"] < 0.15, results
    assert results["teacher"] > 0.85, results
    assert results["student_after"] > 0.7, results
    assert results["val"]["val/divergence"] < 0.1, results
    with open(Path(results["log_dir"]) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    on_policy = [float(row["train/on_policy"]) for row in rows if row.get("train/on_policy")]
    # lmbda 0.5: about half of each epoch's micro-batches sampled by the student (128 and 22 of them here)
    assert on_policy and all(0.3 < share < 0.7 for share in on_policy), on_policy
