"""FLCEMixin's RL calls: ``flce_logprobs`` and ``flce_policy_loss`` on the module's head, and the step
normalization of each loss type over micro-batches (the DDP case: ``tests/test_policy_ddp_cpu.py``).

The reference of a Trainer step is one call of :func:`fused_linear_policy_loss` on the step's concatenated
sequences (float64, ``lr=0`` so every step sees the same parameters); a wrong normalizer differs by >= 1e-2
here (the micro-batches have 2 and 3 sequences and 3 and 13 masked tokens).
"""

import copy
import logging

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_flce import FLCEMixin, fused_linear_logprobs, fused_linear_policy_loss
from lightning_flce.normalization import StepNormalizer
from lightning_flce.rl import policy_normalizer

VOCAB, SEQ, HIDDEN = 40, 6, 12
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    yield
    lightning_logger.setLevel(level)


class PolicyLM(FLCEMixin, L.LightningModule):
    """A tiny causal-free LM (embedding, one layer) trained with ``flce_policy_loss``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.body = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)

    def hidden_states(self, input_ids):
        return torch.tanh(self.body(self.embed(input_ids)))

    def training_step(self, batch, batch_idx):
        out = self.flce_policy_loss(
            self.hidden_states(batch["input_ids"]),
            batch["target"],
            advantages=batch["advantages"],
            old_logprobs=batch["old_logprobs"],
            mask=batch["mask"],
        )
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def make_batch(seed, batch_size, n_masked):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch_size * SEQ, dtype=torch.bool)
    mask[torch.randperm(batch_size * SEQ, generator=gen)[:n_masked]] = True
    return {
        "input_ids": torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen),
        "target": torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen),
        "advantages": torch.randn(batch_size, generator=gen, dtype=torch.float64),
        "old_logprobs": -3.7 + 0.3 * torch.randn(batch_size, SEQ, generator=gen, dtype=torch.float64),
        "mask": mask.view(batch_size, SEQ),
    }


MICRO_BATCHES = [make_batch(1, batch_size=2, n_masked=3), make_batch(2, batch_size=3, n_masked=13)]


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def fit(model, batches, **trainer_kwargs):
    capture = GradCapture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[capture],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        max_epochs=1,
        precision="64-true",
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(batches, batch_size=None, shuffle=False))
    return trainer, capture


def one_call_grads(model, batches, **options):
    """The gradients of one fused_linear_policy_loss call on the concatenated sequences."""
    model = copy.deepcopy(model)
    batch = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    out = fused_linear_policy_loss(
        model.hidden_states(batch["input_ids"]),
        model.lm_head.weight,
        batch["target"],
        model.lm_head.bias,
        advantages=batch["advantages"],
        old_logprobs=batch["old_logprobs"],
        mask=batch["mask"],
        **options,
    )
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
def test_accumulated_step_equals_one_call_on_the_step_batch(loss_type):
    options = dict(loss_type=loss_type, epsilon_low=0.1, epsilon_high=0.15 if loss_type != "cispo" else 1.05)
    if loss_type == "dr_grpo":
        options["max_completion_length"] = 9
    model = PolicyLM(**{f"flce_{name}": value for name, value in options.items()})
    loss, expected = one_call_grads(model, MICRO_BATCHES, **options)
    trainer, capture = fit(model, MICRO_BATCHES, accumulate_grad_batches=2)
    (grads,) = capture.grads
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **TOL, msg=name)
    # the logged step loss is the step's normalized loss; the metrics under train/policy/
    torch.testing.assert_close(trainer.logged_metrics["train/loss_step"].double(), loss, rtol=1e-6, atol=1e-9)
    assert {"train/policy/ratio_mean", "train/policy/clip_fraction_low"} <= set(trainer.logged_metrics)


def test_micro_batch_normalization_averages_the_micro_batch_losses():
    model = PolicyLM(flce_loss_type="dapo", flce_normalize="micro_batch")
    means = []
    for batch in MICRO_BATCHES:
        m = copy.deepcopy(model)
        loss, grads = one_call_grads(m, [batch], loss_type="dapo")
        means.append(grads)
    _, capture = fit(model, MICRO_BATCHES, accumulate_grad_batches=2)
    for name, grad in capture.grads[0].items():
        torch.testing.assert_close(grad, (means[0][name] + means[1][name]) / 2, **TOL, msg=name)


def test_logprobs_and_policy_loss_use_the_head_with_its_softcap_and_shift():
    model = PolicyLM(flce_softcap=3.0, flce_temperature=0.7)
    batch = MICRO_BATCHES[1]
    hidden = model.hidden_states(batch["input_ids"])
    head = model.lm_head
    out = model.flce_logprobs(hidden, batch["target"], return_entropy=True)
    ref = fused_linear_logprobs(
        hidden, head.weight, batch["target"], head.bias, softcap=3.0, temperature=0.7, return_entropy=True
    )
    torch.testing.assert_close(out.logprobs, ref.logprobs, **TOL)
    torch.testing.assert_close(out.entropy, ref.entropy, **TOL)
    # shift: the target holds the input ids; position t predicts t + 1
    shifted = model.flce_logprobs(hidden, batch["input_ids"], shift=True)
    expected = fused_linear_logprobs(
        hidden[:, :-1], head.weight, batch["input_ids"][:, 1:], head.bias, softcap=3.0, temperature=0.7
    )
    torch.testing.assert_close(shifted.logprobs[:, :-1], expected.logprobs, **TOL)
    assert (shifted.logprobs[:, -1] == 0).all()
    # the policy loss outside fit: the function's, with the mixin's options and the per-token tensors shifted
    ids, mask, old = batch["input_ids"], batch["mask"], batch["old_logprobs"]
    loss = model.flce_policy_loss(
        hidden, ids, advantages=batch["advantages"], old_logprobs=old, mask=mask, shift=True
    )
    ref_loss = fused_linear_policy_loss(
        hidden[:, :-1],
        head.weight,
        ids[:, 1:],
        head.bias,
        advantages=batch["advantages"],
        old_logprobs=old[:, 1:],
        mask=mask[:, 1:],
        softcap=3.0,
        temperature=0.7,
    )
    torch.testing.assert_close(loss.loss, ref_loss.loss, **TOL)


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("flce_loss_type", "gspo", "flce_loss_type must be one of"),
        ("flce_epsilon_low", -0.1, "flce_epsilon_low and flce_epsilon_high must be >= 0"),
        ("flce_temperature", 0.0, "flce_temperature must be positive"),
        ("flce_max_completion_length", 0, "flce_max_completion_length must be a positive int"),
    ],
)
def test_bad_policy_options_raise_at_construction(option, value, match):
    with pytest.raises(ValueError, match=match):
        PolicyLM(**{option: value})


def test_policy_normalizer_counts_each_loss_types_divisor():
    counted = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert policy_normalizer("grpo", counted) == (2.0, "sequences")
    assert policy_normalizer("dr_grpo", counted) == (6.0, "sequences x length")
    assert policy_normalizer("dr_grpo", counted, 10) == (20.0, "sequences x length")
    for loss_type in ("dapo", "bnpo", "cispo", "ppo"):
        assert policy_normalizer(loss_type, counted) == (3.0, "completion tokens")


def test_a_step_cannot_mix_normalizers():
    normalizer = StepNormalizer("step")
    normalizer.count(torch.tensor(1.0), torch.tensor(4.0), "tokens")
    with pytest.raises(ValueError, match="must share one normalizer"):  # in one micro-batch
        normalizer.count(torch.tensor(1.0), torch.tensor(2.0), "sequences")
    normalizer.commit(0)
    normalizer.count(torch.tensor(1.0), torch.tensor(2.0), "sequences")
    with pytest.raises(ValueError, match="must share one normalizer"):  # in the next micro-batch of the step
        normalizer.commit(0)
    normalizer.finish()
    normalizer.count(torch.tensor(1.0), torch.tensor(2.0), "sequences")  # a new step may count otherwise
    normalizer.commit(1)
    assert normalizer.finish().num_tokens == 2.0


def test_a_hooked_head_computes_inside_its_own_call():
    """A forward pre-hook on the head (as a sharding wrapper's that gathers the weight) runs around the loss."""
    model = PolicyLM()
    batch = MICRO_BATCHES[0]
    hidden = model.hidden_states(batch["input_ids"])
    expected = model.flce_logprobs(hidden, batch["target"]).logprobs
    calls = []
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    torch.testing.assert_close(model.flce_logprobs(hidden, batch["target"]).logprobs, expected, **TOL)
    model.flce_policy_loss(hidden, batch["target"], advantages=batch["advantages"])
    assert calls == [hidden.shape, hidden.shape]


def test_a_peft_lora_head_gives_the_logits_of_the_peft_module():
    peft = pytest.importorskip("peft")
    model = PolicyLM()
    torch.manual_seed(1)
    holder = nn.Module()
    holder.lm_head = model.lm_head
    config = peft.LoraConfig(target_modules=["lm_head"], r=4, lora_alpha=8, init_lora_weights=False)
    model.lm_head = peft.inject_adapter_in_model(config, holder).lm_head.to(torch.float64)
    assert type(model.lm_head).__module__.startswith("peft.")
    batch = MICRO_BATCHES[0]
    hidden = model.hidden_states(batch["input_ids"])
    out = model.flce_logprobs(hidden, batch["target"], temperature=1.0)
    logits = model.lm_head(hidden)
    expected = torch.log_softmax(logits, -1).gather(-1, batch["target"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.logprobs, expected, **TOL)


@pytest.mark.parametrize(("loss_type", "divisor"), [("grpo", 2.0), ("dapo", 16.0)])
def test_fp16_gradients_divide_by_the_loss_types_count(loss_type, divisor):
    """``16-mixed`` (fp16 autocast on the CPU, Lightning's GradScaler): the first micro-batch's divisor ``D`` is a
    power of two at least what it could count (2 sequences; 2 x 6 = 12 tokens), and the step's gradients are
    those of one float64 call within fp16 rounding (6e-4 relative measured)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    model = PolicyLM(flce_loss_type=loss_type)
    _, expected = one_call_grads(model, MICRO_BATCHES, loss_type=loss_type)
    batches = [{k: v.float() if v.is_floating_point() else v for k, v in b.items()} for b in MICRO_BATCHES]
    capture = GradCapture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[capture],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))],
        accumulate_grad_batches=2,
    )
    # the divisor of the first micro-batch, before the step raises it to the step's count per micro-batch
    divisors = []
    model.on_before_backward = lambda loss: (
        divisors.append(model.flce_step_normalizer.grad_divisor),
        FLCEMixin.on_before_backward(model, loss),
    )
    trainer.fit(model.float(), DataLoader(batches, batch_size=None))
    assert divisors[0] == divisor
    for name, grad in capture.grads[0].items():
        error = ((grad.double() - expected[name]).norm() / expected[name].norm()).item()
        assert error < 1e-2, f"{name}: relative error {error:.1e}"


def test_a_vocab_parallel_head_is_refused_clearly():
    from lightning_flce.parallel import VocabParallelHead

    model = PolicyLM()
    head = VocabParallelHead.__new__(
        VocabParallelHead
    )  # the type is all the refusal reads (no process group)
    nn.Module.__init__(head)
    model.lm_head = head
    batch = MICRO_BATCHES[0]
    hidden = model.hidden_states(batch["input_ids"])
    with pytest.raises(NotImplementedError, match="do not support a VocabParallelHead"):
        model.flce_logprobs(hidden, batch["target"])
    with pytest.raises(NotImplementedError, match="do not support a VocabParallelHead"):
        model.flce_policy_loss(hidden, batch["target"], advantages=batch["advantages"])


def test_naive_has_no_rl_path():
    model = PolicyLM(flce_naive=True)
    batch = MICRO_BATCHES[0]
    with pytest.raises(NotImplementedError, match="flce_naive=True has no RL path"):
        model.flce_logprobs(model.hidden_states(batch["input_ids"]), batch["target"])


def test_a_compiled_module_trains_with_the_policy_loss():
    """``torch.compile(model)`` (Dynamo; the eager backend keeps it fast): the same step, and the metrics logged
    outside the compiled step (``self.log`` inside it would break it)."""
    model = PolicyLM(flce_loss_type="grpo")
    _, expected = one_call_grads(model, MICRO_BATCHES, loss_type="grpo")
    torch._dynamo.reset()
    trainer, capture = fit(torch.compile(model, backend="eager"), MICRO_BATCHES, accumulate_grad_batches=2)
    for name, grad in capture.grads[0].items():
        torch.testing.assert_close(grad, expected[name], **TOL, msg=name)
    assert "train/policy/ratio_mean" in trainer.logged_metrics
