"""FLCEMixin: the loss, gradients and metrics of a LightningModule equal the plain logits + cross-entropy path.

References run a float64 copy of the model through ``F.linear`` + ``F.cross_entropy``. The fp32 model under
test differs from it only by float32 rounding through a 1-2 layer network (about 1e-6 relative), so fp32
comparisons use ``rtol=1e-4`` plus a small ``atol`` for gradient entries that are near zero.
"""

import copy
import functools
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

from lightning_flce.head import FLCEHeadLoss
from lightning_flce.mixin import FLCEMixin
from lightning_flce.models.gpt import TinyGPT
from lightning_flce.options import FLCEOptions

VOCAB = 97
SEQ = 12
FP32 = {"rtol": 1e-4, "atol": 1e-6}


def tiny_gpt(**kwargs) -> TinyGPT:
    torch.manual_seed(0)
    options = {"vocab_size": VOCAB, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": SEQ, "lr": 0.0}
    options.update(kwargs)
    return TinyGPT(**options)


def make_batches(num_batches: int, batch_size: int = 2, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Shifted-label batches; batch i has a different number of ignored labels (i * 3 + 1)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(num_batches):
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels.view(-1)[torch.randperm(labels.numel(), generator=generator)[: index * 3 + 1]] = -100
        batches.append({"input_ids": tokens[:, :-1], "labels": labels})
    return batches


def loader(batches) -> DataLoader:
    # each element is already a batch
    return DataLoader(batches, batch_size=None)


def trainer(**kwargs) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


class GradCapture(Callback):
    """Gradients and logged loss at each optimizer step (callbacks run after FLCEMixin normalized them)."""

    def __init__(self) -> None:
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append(
            {name: p.grad.clone() for name, p in pl_module.named_parameters() if p.grad is not None}
        )


def plain_loss(logits, labels, *, label_smoothing=0.0, lse_square_scale=0.0, softcap=None, reduction="mean"):
    """The definition: cross-entropy of the (softcapped) logits plus z-loss, mean over non-ignored tokens."""
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = labels != -100
    loss = F.cross_entropy(logits, labels, reduction="sum", label_smoothing=label_smoothing)
    loss = loss + lse_square_scale * (torch.logsumexp(logits, -1).square() * valid).sum()
    return loss / valid.sum() if reduction == "mean" else loss


def reference_step(model: TinyGPT, batches, **loss_options):
    """Float64 loss and grads of the token mean over all batches, as one big batch."""
    reference = copy.deepcopy(model).double()
    logits = torch.cat([reference.lm_head(reference.hidden_states(b["input_ids"])) for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    loss = plain_loss(logits, labels, **loss_options)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}


def assert_grads_close(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name].to(actual[name].dtype), **tolerance, msg=name)


@pytest.mark.parametrize("naive", [False, True], ids=["fused", "naive"])
@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied", "untied"])
def test_trainer_step_matches_plain_path(naive, tie_embeddings):
    model = tiny_gpt(tie_embeddings=tie_embeddings, flce_naive=naive, flce_chunk_size=7)
    batches = make_batches(1, batch_size=3)
    expected_loss, expected_grads = reference_step(model, batches)
    capture = GradCapture()
    fit = trainer(max_steps=1, callbacks=[capture], limit_val_batches=0)
    fit.fit(model, loader(batches))

    torch.testing.assert_close(fit.callback_metrics["train/loss_step"], expected_loss.float(), **FP32)
    assert_grads_close(capture.grads[0], expected_grads, **FP32)
    if tie_embeddings:
        # one parameter: the tied weight receives the embedding and the head gradient together
        assert model.lm_head.weight is model.tok_emb.weight
        assert "lm_head.weight" not in capture.grads[0]


@pytest.mark.parametrize(
    "options",
    [
        {"flce_label_smoothing": 0.1},
        {"flce_lse_square_scale": 1e-3},
        {"flce_softcap": 2.0},
        {"flce_label_smoothing": 0.05, "flce_lse_square_scale": 1e-2, "flce_softcap": 3.0},
    ],
    ids=["smoothing", "lse_square_scale", "softcap", "all"],
)
def test_loss_options_match_reference(options):
    # an untied head with unit-variance weights gives logits of a few units, where the softcap matters
    model = tiny_gpt(tie_embeddings=False, **options)
    nn.init.normal_(model.lm_head.weight)
    batch = make_batches(1, batch_size=3)[0]
    reference_options = {
        "label_smoothing": options.get("flce_label_smoothing", 0.0),
        "lse_square_scale": options.get("flce_lse_square_scale", 0.0),
        "softcap": options.get("flce_softcap"),
    }
    expected_loss, expected_grads = reference_step(model, [batch], **reference_options)

    # outside a Trainer the loss is the plain (regularized) token mean
    loss = model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])
    loss.backward()
    torch.testing.assert_close(loss, expected_loss.float(), **FP32)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, expected_grads, **FP32)

    # inference: forward returns the logits the loss is defined on
    logits = model(batch["input_ids"])
    expected_logits = F.linear(model.hidden_states(batch["input_ids"]), model.lm_head.weight)
    if "flce_softcap" in options:
        expected_logits = options["flce_softcap"] * torch.tanh(expected_logits / options["flce_softcap"])
    torch.testing.assert_close(logits, expected_logits)


class HeadLM(FLCEMixin, pl.LightningModule):
    """Embedding + linear layer + an LM head with a bias, and a head path that is not the default."""

    def __init__(self, vocab: int = VOCAB, padded_vocab: int = VOCAB, hidden: int = 8, **kwargs) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.decoder = nn.Module()
        self.decoder.out = nn.Linear(hidden, padded_vocab, bias=True)
        nn.init.normal_(self.decoder.out.bias)

    def hidden_states(self, input_ids):
        return torch.tanh(self.mix(self.embed(input_ids)))


def head_reference(model: HeadLM, batch, head: nn.Linear):
    reference = copy.deepcopy(model).double()
    head_copy = copy.deepcopy(head).double()
    loss = plain_loss(head_copy(reference.hidden_states(batch["input_ids"])), batch["labels"])
    loss.backward()
    return loss.detach(), head_copy.weight.grad, head_copy.bias.grad, reference.mix.weight.grad


def test_head_bias_and_attribute_path():
    model = HeadLM(flce_head="decoder.out", flce_chunk_size=5)
    batch = make_batches(1, batch_size=2)[0]
    expected_loss, expected_weight_grad, expected_bias_grad, expected_mix_grad = head_reference(
        model, batch, model.decoder.out
    )
    loss = model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])
    loss.backward()
    torch.testing.assert_close(loss, expected_loss.float(), **FP32)
    torch.testing.assert_close(model.decoder.out.weight.grad, expected_weight_grad.float(), **FP32)
    torch.testing.assert_close(model.decoder.out.bias.grad, expected_bias_grad.float(), **FP32)
    torch.testing.assert_close(model.mix.weight.grad, expected_mix_grad.float(), **FP32)


def test_padded_vocabulary_uses_the_full_head():
    # 128 head rows for a 97-token vocabulary: the extra rows still take part in the softmax, as in the
    # plain path that applies the whole head
    model = HeadLM(padded_vocab=128, flce_head="decoder.out")
    batch = make_batches(1, batch_size=2)[0]
    expected_loss, expected_weight_grad, _, _ = head_reference(model, batch, model.decoder.out)
    loss = model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])
    loss.backward()
    torch.testing.assert_close(loss, expected_loss.float(), **FP32)
    torch.testing.assert_close(model.decoder.out.weight.grad, expected_weight_grad.float(), **FP32)
    assert model.flce_last_logits_shape == (2 * SEQ, 128)
    assert model.flce_last_logits_bytes == 2 * SEQ * 128 * 4


class FakeModulesToSaveWrapper(nn.Module):
    """The shape of PEFT's ``ModulesToSaveWrapper``: a trainable copy per adapter, dispatched in forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(module)})
        self.active_adapter = "default"
        self.disable_adapters = False
        self.original_module.requires_grad_(False)

    def forward(self, x, *args, **kwargs):
        if self.disable_adapters or self.active_adapter not in self.modules_to_save:
            return self.original_module(x, *args, **kwargs)
        return self.modules_to_save[self.active_adapter](x, *args, **kwargs)


def test_peft_modules_to_save_wrapper_uses_the_active_copy():
    model = HeadLM(flce_head="decoder.out")
    batch = make_batches(1, batch_size=2)[0]
    original = model.decoder.out
    model.decoder.out = FakeModulesToSaveWrapper(original)
    active = model.decoder.out.modules_to_save["default"]
    with torch.no_grad():
        active.weight.mul_(3.0)  # the trained copy has diverged from the original
    expected_loss, expected_weight_grad, _, _ = head_reference(model, batch, active)

    loss = model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])
    loss.backward()
    torch.testing.assert_close(loss, expected_loss.float(), **FP32)
    torch.testing.assert_close(active.weight.grad, expected_weight_grad.float(), **FP32)
    assert original.weight.grad is None

    model.decoder.out.disable_adapters = True
    expected_loss, *_ = head_reference(model, batch, original)
    loss = model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])
    torch.testing.assert_close(loss, expected_loss.float(), **FP32)


def test_head_is_called_so_its_hooks_gather_the_weight():
    """Like ZeRO-3 or FSDP, the head's pre-forward hook puts the full weight in place and its post-forward
    hook removes it again: the loss must read the weight inside the head's call and see hidden as input."""
    model = HeadLM(flce_head="decoder.out")
    head = model.decoder.out
    full_weight = head.weight
    placeholder = nn.Parameter(torch.empty(0))
    seen_inputs = []

    def gather(module, args):
        seen_inputs.append(args)
        module.weight = full_weight

    def release(module, args, output):
        module.weight = placeholder

    head.register_forward_pre_hook(gather)
    head.register_forward_hook(release)
    head.weight = placeholder
    batch = make_batches(1, batch_size=2)[0]
    hidden = model.hidden_states(batch["input_ids"])

    expected = plain_loss(
        F.linear(hidden.double(), full_weight.double(), head.bias.double()), batch["labels"]
    )
    loss = model.flce_loss(hidden, batch["labels"])
    loss.backward()
    torch.testing.assert_close(loss, expected.float(), **FP32)
    assert full_weight.grad is not None and full_weight.grad.shape == full_weight.shape
    assert len(seen_inputs) == 1 and seen_inputs[0][0] is hidden
    assert head.weight is placeholder
    assert "forward" not in head.__dict__  # the forward binding is undone


def test_all_ignored_micro_batch_gives_zero_with_graph_connected():
    model = tiny_gpt()
    batch = make_batches(1)[0]
    labels = torch.full_like(batch["labels"], -100)
    capture = GradCapture()
    fit = trainer(max_steps=1, limit_val_batches=0, callbacks=[capture])
    fit.fit(model, loader([{"input_ids": batch["input_ids"], "labels": labels}]))
    assert fit.callback_metrics["train/loss_step"] == 0.0
    assert capture.grads[0], "backward must reach the parameters"
    for name, grad in capture.grads[0].items():
        assert torch.count_nonzero(grad) == 0, name


def test_bf16_mixed_matches_autocast_reference():
    model = tiny_gpt(flce_chunk_size=8)
    batches = make_batches(1, batch_size=3)
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = reference.lm_head(reference.hidden_states(batches[0]["input_ids"]))
        expected_loss = plain_loss(logits.float(), batches[0]["labels"])
    expected_loss.backward()

    capture = GradCapture()
    fit = trainer(max_steps=1, limit_val_batches=0, precision="bf16-mixed", callbacks=[capture])
    fit.fit(model, loader(batches))
    grads = capture.grads[0]
    # bf16 keeps 8 significant bits (relative step 2**-8 = 0.4%); both paths round the same GEMMs to bf16,
    # so they agree to a few bf16 steps
    torch.testing.assert_close(
        fit.callback_metrics["train/loss_step"], expected_loss.detach(), rtol=4e-3, atol=0
    )
    for name, param in reference.named_parameters():
        assert grads[name].dtype == torch.float32  # fp32 master weights get fp32 grads
        scale = param.grad.abs().max()
        torch.testing.assert_close(grads[name], param.grad, rtol=2e-2, atol=2e-2 * scale, msg=name)


def test_validation_metrics_are_token_weighted():
    # label smoothing changes the training loss only: validation reports the plain cross-entropy
    model = tiny_gpt(tie_embeddings=False, flce_label_smoothing=0.2)
    nn.init.normal_(model.lm_head.weight, std=0.5)  # a head that gets some tokens right
    batches = make_batches(3, batch_size=2)
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = torch.cat([reference(b["input_ids"]) for b in batches]).reshape(-1, VOCAB)
    labels = torch.cat([b["labels"] for b in batches]).reshape(-1)
    valid = labels != -100
    expected_loss = F.cross_entropy(logits, labels)
    expected_accuracy = (logits.argmax(-1) == labels)[valid].double().mean()

    (metrics,) = trainer().validate(model, loader(batches), verbose=False)
    assert metrics["val/loss"] == pytest.approx(expected_loss.item(), rel=1e-5)
    assert metrics["val/perplexity"] == pytest.approx(math.exp(expected_loss.item()), rel=1e-5)
    assert metrics["val/token_accuracy"] == pytest.approx(expected_accuracy.item(), rel=1e-6)
    assert 0.0 < expected_accuracy < 1.0


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_half_true_precision_keeps_float64_metric_states(precision):
    """The "-true" plugins call module.to(half dtype), which also converts torchmetrics states: an fp16 sum of
    token losses overflowed to inf after ~7k tokens (here 16k), a bf16 one rounded. The states stay fp64."""
    model = tiny_gpt()
    batches = make_batches(4, batch_size=256)
    (want,) = trainer().validate(copy.deepcopy(model), loader(batches), verbose=False)
    (got,) = trainer(precision=precision).validate(model, loader(batches), verbose=False)
    assert model.flce_eval_loss.dtype == torch.float64
    assert math.isfinite(got["val/loss"])
    assert got["val/loss"] == pytest.approx(want["val/loss"], rel=1e-2)  # a half-precision model, fp64 sums


def test_bundled_optimizer_refuses_fp16_parameters():
    """precision="16-true" would give AdamW fp16 states whose eps is 0 (NaN after a step): a clear error."""
    with pytest.raises(ValueError, match="16-mixed"):
        trainer(precision="16-true", max_steps=1).fit(tiny_gpt(), loader(make_batches(1)))


@pytest.mark.parametrize(
    "accelerator, options, fused",
    [
        ("cpu", {}, None),
        pytest.param("cuda", {}, True, marks=pytest.mark.cuda),
        pytest.param(
            "cuda", {"precision": "bf16-mixed", "gradient_clip_val": 1.0}, None, marks=pytest.mark.cuda
        ),
        pytest.param("cuda", {"precision": "bf16-mixed"}, True, marks=pytest.mark.cuda),
        pytest.param(
            "cuda", {"precision": "16-mixed", "gradient_clip_val": 1.0}, None, marks=pytest.mark.cuda
        ),
        pytest.param("cuda", {"precision": "16-mixed"}, None, marks=pytest.mark.cuda),  # a loss scaler
    ],
)
def test_bundled_optimizer_is_fused_where_lightning_supports_it(accelerator, options, fused):
    """CUDA parameters get the fused AdamW (one pass over parameters and states) unless a loss scaler or
    clipping under mixed precision needs the gradients unscaled before the step (test_fused_adamw_gate has
    the whole rule); every case trains; the CPU keeps torch's default."""
    model = tiny_gpt(lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    fit = trainer(accelerator=accelerator, max_steps=2, **options)
    fit.fit(model, loader(make_batches(2)))
    assert fit.optimizers[0].defaults["fused"] is fused
    after = list(model.parameters())
    assert all(p.isfinite().all() for p in after)
    assert any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, after))  # the step was taken


def test_fused_adamw_gate():
    """Where the bundled AdamW is fused (the CUDA cases above run it; here the rule, with stand-ins)."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        SingleDeviceStrategy,
    )

    from lightning_flce.models.gpt import _can_fuse

    class ClipsItself(TinyGPT):
        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
        ):
            self.clip_gradients(optimizer, 1.0, "norm")

    def gate(
        strategy=SingleDeviceStrategy, clip=None, precision=Precision, scaler=None, cuda=True, module=None
    ):
        plugin = precision.__new__(precision)
        plugin.scaler = scaler
        trainer = SimpleNamespace(
            strategy=strategy.__new__(strategy), gradient_clip_val=clip, precision_plugin=plugin
        )
        if module is None:
            module = SimpleNamespace(automatic_optimization=True, trainer=trainer)
        else:
            module._trainer = trainer
        return _can_fuse(module, [SimpleNamespace(is_cuda=cuda)] * 2)

    assert gate() is True and gate(DDPStrategy) is True
    assert gate(clip=1.0) is True  # 32-true clips a fused optimizer's gradients fine
    assert (
        gate(clip=1.0, precision=MixedPrecision) is None and gate(clip=0.0, precision=MixedPrecision) is True
    )
    assert gate(precision=MixedPrecision, scaler=torch.amp.GradScaler("cpu")) is None  # 16-mixed
    assert gate(precision=MixedPrecision, module=ClipsItself(vocab_size=8)) is None
    assert gate(precision=MixedPrecision, module=TinyGPT(vocab_size=8)) is True
    manual = TinyGPT(vocab_size=8)
    manual.automatic_optimization = False  # manual optimization clips by itself
    assert gate(module=manual) is None
    assert gate(DeepSpeedStrategy) is None and gate(FSDPStrategy) is None
    assert gate(cuda=False) is None


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fp16_loss_scaler_skips_no_step(accumulation):
    """16-mixed (on the CPU here) at Lightning's first scale, 2^16: "step" back-propagates the token sums over a
    power of two at least the tokens per micro-batch, so the fp16 gradients are at most a mean loss's size and
    the GradScaler skips no step (the sums themselves, 24 tokens a micro-batch, overflowed at this scale)."""
    scaler = torch.amp.GradScaler("cpu")
    model = tiny_gpt(lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    fit = trainer(
        max_steps=2, accumulate_grad_batches=accumulation, plugins=[MixedPrecision("16-mixed", "cpu", scaler)]
    )
    fit.fit(model, loader(make_batches(2 * accumulation)))
    assert fit.global_step == 2
    assert scaler.get_scale() == 2.0**16  # a skipped step would have halved it
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


# samples per micro-batch, one micro-batch a step; "short": the divisor does not fall after the short step, so
# the next full one does not overflow; "growing": 256x the tokens, the step where they grow overflows, none after
@pytest.mark.parametrize(
    "batch_sizes, most_skipped",
    [pytest.param([32, 1, 32, 32], 0, id="short"), pytest.param([1, 256, 256, 256], 1, id="growing")],
)
def test_fp16_divisor_follows_the_batch_size(batch_sizes, most_skipped):
    scaler = torch.amp.GradScaler("cpu")
    batches = [make_batches(1, batch_size=size, seed=index)[0] for index, size in enumerate(batch_sizes)]
    fit = trainer(max_steps=len(batches), plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    fit.fit(tiny_gpt(lr=1e-3), loader(batches))
    skipped = round(math.log2(2.0**16 / scaler.get_scale()))  # each skipped step halved the scale
    assert skipped <= most_skipped


def test_overridden_epoch_end_without_super_warns():
    class NoSuper(TinyGPT):
        def on_validation_epoch_end(self):
            pass

    torch.manual_seed(0)
    model = NoSuper(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0)
    batches = loader(make_batches(2))
    trainer().validate(model, batches, verbose=False)
    with pytest.warns(UserWarning, match="must call super"):
        trainer().validate(model, batches, verbose=False)


def test_cli_rejects_an_unknown_normalize_mode_while_parsing():
    """flce_normalize / flce_impl are Literals: LightningCLI refuses a bad value before building anything."""
    with pytest.raises(SystemExit):
        LightningCLI(
            TinyGPT,
            run=False,
            args=["--model.vocab_size=64", "--model.flce_normalize=batch"],
            trainer_defaults={"logger": False},
        )


def test_hidden_states_must_be_a_tensor():
    model = tiny_gpt()
    labels = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(TypeError, match="model output tuple"):
        model.flce_loss((torch.randn(2, SEQ, 16),), labels)


def test_shifted_narrow_integer_labels():
    """uint8 token ids (a byte-level model): shift pads with ignore_index, which must not wrap."""
    model = tiny_gpt()
    hidden = torch.randn(2, SEQ, 16)
    labels = torch.randint(0, VOCAB, (2, SEQ))
    want = model.flce_loss(hidden, labels, shift=True)
    got = model.flce_loss(hidden, labels.to(torch.uint8), shift=True)
    torch.testing.assert_close(got, want)


def test_test_stage_logs_test_metrics():
    model = tiny_gpt()
    (metrics,) = trainer().test(model, loader(make_batches(2)), verbose=False)
    assert set(metrics) == {"test/loss", "test/perplexity", "test/token_accuracy"}


@pytest.mark.parametrize("naive", [False, True], ids=["fused", "naive"])
def test_records_the_logits_it_avoided(naive):
    model = tiny_gpt(flce_naive=naive)
    batches = make_batches(1, batch_size=3)
    trainer(max_steps=1, limit_val_batches=0).fit(model, loader(batches))
    assert model.flce_last_logits_shape == (3 * SEQ, VOCAB)
    # the naive path builds the logits, so it avoided none
    assert model.flce_last_logits_bytes == (0 if naive else 3 * SEQ * VOCAB * 4)


class UserLM(FLCEMixin, pl.LightningModule):
    """A user module that passes the mixin's options through ``**kwargs``."""

    def __init__(self, width: int = 8, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.lm_head = nn.Linear(width, VOCAB)


def test_cli_lists_the_options_under_model_init_args():
    cli = LightningCLI(
        UserLM,
        run=False,
        save_config_callback=None,
        args=[
            "--model.width=4",
            "--model.flce_chunk_size=64",
            "--model.flce_normalize=micro_batch",
            "--model.flce_loss_type=dapo",
        ],
    )
    # the mixin's options: every FLCEOptions field that is an __init__ option (the others are given per call or
    # decided by flce_normalize), prefixed, and the mixin's own; no deprecated name
    per_call_or_normalized = {"reduction", "token_weight", "class_weight"}
    flce_options = {
        f"flce_{field}" for field in FLCEOptions.field_names() if field not in per_call_or_normalized
    }
    flce_options |= {"flce_head", "flce_naive", "flce_normalize"}
    # the policy loss's options (flce_policy_loss), under the function's names
    policy = ("loss_type", "epsilon_low", "epsilon_high", "beta", "entropy_coef", "temperature")
    flce_options |= {f"flce_{name}" for name in (*policy, "max_completion_length")}
    assert flce_options == {name for name in list(cli.config["model"].keys()) if name.startswith("flce_")}
    assert cli.model.flce_head_loss.chunk_size == 64
    assert cli.model.flce_normalize == "micro_batch"
    assert cli.model.flce_policy.options["loss_type"] == "dapo"
    assert cli.model.hparams["flce_chunk_size"] == 64
    assert cli.model.hparams["width"] == 4

    # subclass mode, as lightning_flce.cli uses it: the options sit under model.init_args
    cli = LightningCLI(
        pl.LightningModule,
        subclass_mode_model=True,
        run=False,
        save_config_callback=None,
        args=[
            "--model=lightning_flce.models.TinyGPT",
            "--model.vocab_size=64",
            "--model.flce_lse_square_scale=0.001",
            "--model.flce_accum_dtype=float32",
        ],
    )
    init_args = cli.config["model"]["init_args"]
    assert flce_options == {name for name in list(init_args.keys()) if name.startswith("flce_")}
    assert isinstance(cli.model, TinyGPT) and cli.model.flce_head_loss.lse_square_scale == 0.001
    assert cli.model.flce_options.accum_dtype is torch.float32


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"flce_normalize": "batch"}, "flce_normalize"),
        ({"flce_softcap": 0.0}, "flce_softcap"),
        ({"flce_softcap": float("nan")}, "flce_softcap"),
        ({"flce_lse_square_scale": float("nan")}, "flce_lse_square_scale"),
        ({"flce_label_smoothing": 1.5}, "label_smoothing"),
        ({"flce_lse_square_scale": -1.0}, "flce_lse_square_scale"),
        ({"flce_accum_dtype": "fp32"}, "flce_accum_dtype"),
        ({"flce_chunk_size": 0}, "chunk_size"),
        ({"flce_chunk_size": 2.5}, "chunk_size"),
        ({"flce_impl": "cuda"}, "impl"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt(**options)


def test_misspelled_option_names_the_intended_one():
    with pytest.raises(TypeError, match="unknown option 'flce_chunksize'; did you mean 'flce_chunk_size'"):
        tiny_gpt(flce_chunksize=64)
    with pytest.raises(TypeError, match="unknown option 'flce_frobnicate'; the options are flce_head, "):
        tiny_gpt(flce_frobnicate=True)


def test_naive_and_fused_head_loss_agree_in_float64():
    """The naive path (FLCEHeadLoss(naive=True), the comparison baseline) keeps fp64 logits as the op does."""
    head = nn.Linear(8, VOCAB, dtype=torch.float64)
    hidden, labels = torch.randn(2, 5, 8, dtype=torch.float64), torch.randint(0, VOCAB, (2, 5))
    labels[0, 0] = -100
    for reduction in ("mean", "none"):
        options = {"reduction": reduction, "softcap": 3.0}
        naive = FLCEHeadLoss(naive=True, label_smoothing=0.1, lse_square_scale=1e-3)(
            head, hidden, labels, **options
        )
        fused = FLCEHeadLoss(label_smoothing=0.1, lse_square_scale=1e-3)(head, hidden, labels, **options)
        assert naive.dtype == fused.dtype == torch.float64 and naive.shape == fused.shape
        torch.testing.assert_close(naive, fused, rtol=1e-12, atol=1e-12)


class _BaseWithOwnFlceOption(pl.LightningModule):
    def __init__(self, flce_extra: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.flce_extra = flce_extra


class _MixinBeforeABaseWithAnFlceOption(FLCEMixin, _BaseWithOwnFlceOption):
    pass


def test_an_flce_option_of_a_later_base_class_passes_through():
    """The misspelling check leaves alone a ``flce_`` argument that a class after the mixin takes."""
    assert _MixinBeforeABaseWithAnFlceOption(flce_extra=3).flce_extra == 3
    with pytest.raises(TypeError, match="did you mean 'flce_chunk_size'"):
        _MixinBeforeABaseWithAnFlceOption(flce_chunksize=3)


def test_accum_dtype_float32_never_narrows_an_fp64_head():
    """The head loss's accum_dtype=float32 means "at least fp32": an fp64 head keeps its fp64 dW accumulation
    (1e-12 vs float64)."""
    head = nn.Linear(8, VOCAB, bias=False, dtype=torch.float64)
    hidden, labels = torch.randn(40, 8, dtype=torch.float64), torch.randint(0, VOCAB, (40,))
    FLCEHeadLoss(accum_dtype=torch.float32, chunk_size=8)(head, hidden, labels).backward()
    got, head.weight.grad = head.weight.grad, None
    F.cross_entropy(head(hidden), labels).backward()
    torch.testing.assert_close(got, head.weight.grad, rtol=1e-12, atol=1e-14)


def test_full_label_smoothing_is_accepted_like_the_op():
    """label_smoothing=1.0 is F.cross_entropy's and the op's upper bound; the module takes it too."""
    head = nn.Linear(8, VOCAB)
    hidden, labels = torch.randn(6, 8), torch.randint(0, VOCAB, (6,))
    loss = FLCEHeadLoss(label_smoothing=1.0)(head, hidden, labels)
    expected = F.cross_entropy(head(hidden), labels, label_smoothing=1.0)
    torch.testing.assert_close(loss, expected, **FP32)


def test_bad_head_and_labels_raise():
    batch = make_batches(1)[0]
    # flce_head is checked when the module is built (after the subclass's __init__ made the head)
    with pytest.raises(AttributeError, match="'decoder.missing'.*did you mean flce_head='decoder.out'"):
        HeadLM(flce_head="decoder.missing")
    with pytest.raises(TypeError, match="nn.Module"):
        HeadLM(flce_head="mix.weight")
    # ... and at every call, for a head changed after the build
    model = HeadLM(flce_head="decoder.out")
    hidden = model.hidden_states(batch["input_ids"])
    model.flce_head = "decoder.missing"
    with pytest.raises(AttributeError, match="decoder.missing"):
        model.flce_loss(hidden, batch["labels"])
    model.flce_head = "mix.weight"
    with pytest.raises(TypeError, match="nn.Module"):
        model.flce_loss(hidden, batch["labels"])

    model = HeadLM(flce_head="decoder")
    with pytest.raises(TypeError, match="F.linear"):
        model.flce_loss(hidden, batch["labels"])

    model = HeadLM(flce_head="decoder.out")
    with pytest.raises(ValueError, match="leading shape"):
        model.flce_loss(hidden, batch["labels"][:, :-1])
    with pytest.raises(TypeError, match="integer"):
        model.flce_loss(hidden, batch["labels"].float())

    model = HeadLM()  # no lm_head attribute and no Hugging Face model
    with pytest.raises(AttributeError, match="flce_head"):
        model.flce_loss(hidden, batch["labels"])


def test_checkpoint_wrapped_head_raises():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = HeadLM(flce_head="decoder.out")
    model.decoder.out = checkpoint_wrapper(model.decoder.out)
    batch = make_batches(1)[0]
    with pytest.raises(ValueError, match="checkpointing"):
        model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])


def test_head_loss_module_direct_use():
    head = nn.Linear(8, VOCAB)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 5))
    labels[0, :2] = -100
    per_token = FLCEHeadLoss(chunk_size=3)(head, hidden, labels, reduction="none")
    expected = F.cross_entropy(head(hidden).reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(per_token, expected.view(2, 5), **FP32)  # per token, in the labels' shape


@pytest.mark.parametrize(
    "register", ["full_backward_hook", "full_backward_pre_hook", "global_full_backward_hook"]
)
def test_head_backward_hooks_fire(register):
    """A head's backward hooks (a user's gradient-norm logging, say) are set up by the head's own call: a head
    with any of them is called, not bypassed."""
    head = nn.Linear(8, VOCAB)
    fired = []
    if register == "global_full_backward_hook":
        handle = nn.modules.module.register_module_full_backward_hook(
            lambda module, *grads: fired.append(module) if module is head else None
        )
    else:
        handle = getattr(head, f"register_{register}")(lambda module, *grads: fired.append(module))
    try:
        hidden = torch.randn(2, 5, 8, requires_grad=True)
        FLCEHeadLoss()(head, hidden, torch.randint(0, VOCAB, (2, 5))).backward()
    finally:
        handle.remove()
    assert fired == [head]


def test_head_loss_under_torch_compile():
    """A bare head (no wrapper, no hooks) gets the loss called directly: Dynamo cannot replay the forward
    binding's ``del head.forward``, and there is nothing to run around the loss."""
    head = nn.Linear(8, VOCAB)
    hidden = torch.randn(2, 5, 8)
    labels = torch.randint(0, VOCAB, (2, 5))
    head_loss = FLCEHeadLoss(chunk_size=3)
    compiled = torch.compile(lambda h: head_loss(head, h, labels), backend="aot_eager", fullgraph=True)
    loss = compiled(hidden.requires_grad_())
    loss.backward()
    expected = plain_loss(F.linear(hidden.double(), head.weight.double(), head.bias.double()), labels)
    torch.testing.assert_close(loss, expected.float(), **FP32)
    assert head.weight.grad is not None and hidden.grad is not None
    assert "forward" not in head.__dict__


def test_predict_returns_the_heads_logits():
    model = tiny_gpt()
    batches = make_batches(2)
    predictions = trainer().predict(model, loader(batches))
    for batch, logits in zip(batches, predictions):
        hidden = model.hidden_states(batch["input_ids"])
        torch.testing.assert_close(logits, F.linear(hidden, model.lm_head.weight, model.lm_head.bias))


def test_flce_logits_of_an_embedding_head():
    """An nn.Embedding head (the loss takes its weight as the output matrix) gives logits the same way."""
    model = tiny_gpt(tie_embeddings=False, flce_head="tok_emb")
    input_ids = make_batches(1)[0]["input_ids"]
    hidden = model.hidden_states(input_ids)
    torch.testing.assert_close(model(input_ids), F.linear(hidden, model.tok_emb.weight))
    assert "forward" not in model.tok_emb.__dict__


class SkipsNormalization(TinyGPT):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)

    def on_before_optimizer_step(self, optimizer):
        pass


def test_overrides_that_skip_the_normalization_raise():
    torch.manual_seed(0)
    model = SkipsNormalization(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ)
    with pytest.raises(RuntimeError, match="super"):
        trainer(max_steps=2, limit_val_batches=0).fit(model, loader(make_batches(2)))


@pytest.mark.parametrize(
    "option, value",
    [
        ("flce_lse_square_scale", -1.0),
        ("flce_label_smoothing", 2.0),
        ("flce_chunk_size", 0),
        ("flce_impl", "cuda"),
        ("flce_accum_dtype", "int8"),
    ],
)
def test_bad_options_are_named_as_the_user_wrote_them(option, value):
    with pytest.raises(ValueError, match=f"^{option} must"):
        tiny_gpt(**{option: value})


def test_a_head_forward_hook_that_could_rewrite_the_loss_warns_once():
    """A user's forward hook on the head gets the loss as the head's output (its return value replaces it):
    warned once. torch's own hooks (FSDP2's, say) are not named."""
    model = HeadLM(flce_head="decoder.out")
    head = model.decoder.out
    batch = make_batches(1, batch_size=2)[0]
    hidden = model.hidden_states(batch["input_ids"])

    def doubled(module, args, output):
        return output * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unhooked = model.flce_loss(hidden, batch["labels"])
        handle = head.register_forward_hook(functools.partial(doubled))
        hooked = model.flce_loss(hidden, batch["labels"])
        model.flce_loss(hidden, batch["labels"])
    named = [str(w.message) for w in caught if "forward hooks" in str(w.message)]
    assert len(named) == 1 and "doubled" in named[0]
    torch.testing.assert_close(hooked, 2 * unhooked)  # what the warning is about
    handle.remove()

    def post_forward(module, args, output):  # stands for FSDP2's post-forward hook (a method defined there)
        return output

    post_forward.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    model = HeadLM(flce_head="decoder.out")
    model.decoder.out.register_forward_hook(post_forward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.flce_loss(hidden, batch["labels"])
    assert not [w for w in caught if "forward hooks" in str(w.message)]
