"""LitGPTCausalLM on tiny LitGPT models built from configs (no download).

The reference is LitGPT's own loss: ``litgpt.utils.chunked_cross_entropy`` of ``GPT.forward``'s logits (which
applies ``final_logit_softcapping``) on a float64 copy of the model. The fp32 fused path differs by rounding
only (~1e-6 relative): 1e-5 leaves margin and catches a missing softcap (the head weights are scaled so that it
moves the loss by more than 1e-2).
"""

import copy
import logging
import math
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader

litgpt = pytest.importorskip("litgpt")
from litgpt.utils import chunked_cross_entropy  # noqa: E402

from lightning_flce.mixin import FLCEMixin  # noqa: E402
from lightning_flce.models import LitGPTCausalLM, litgpt_hidden_states  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "lightning_flce" / "configs"
VOCAB, SEQ = 300, 12
FP32_TOL = 1e-5
TINY = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 32,
    "block_size": 16,
    "vocab_size": VOCAB,
    "padding_multiple": 64,
}
VARIANTS = {
    "untied": {},
    "tied": {"tie_embeddings": True},
    "softcap": {"config": {"final_logit_softcapping": 3.0}},
    "head_bias": {"config": {"lm_head_bias": True}},
}


@pytest.fixture(autouse=True)
def _quiet_lightning():
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    yield  # restored: a later test file may read the INFO lines
    lightning_logger.setLevel(level)


def tiny_litgpt(variant="untied", **kwargs):
    options = copy.deepcopy(VARIANTS[variant])
    config = {**TINY, **options.pop("config", {})}
    torch.manual_seed(0)
    model = LitGPTCausalLM(config=config, lr=0.0, **options, **kwargs)
    with torch.no_grad():
        model.model.lm_head.weight.mul_(40.0)  # large logits: the softcap changes the loss a lot
        if model.model.lm_head.bias is not None:
            model.model.lm_head.bias.normal_()
    return model


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[1, 5:] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}


def litgpt_loss(gpt, batch):
    return chunked_cross_entropy(gpt(batch["input_ids"]), batch["labels"], chunk_size=0)


def reference(model, batch):
    ref = copy.deepcopy(model.model).double()
    loss = litgpt_loss(ref, batch)
    loss.backward()
    return loss.item(), {f"model.{n}": p.grad for n, p in ref.named_parameters() if p.grad is not None}


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_dev_run_matches_litgpts_own_loss(variant):
    model = tiny_litgpt(variant)
    assert model.model.lm_head.weight.shape[0] == 320  # padded vocabulary: LitGPT's softmax spans it too
    batch = make_batch()
    ref_loss, ref_grads = reference(model, batch)
    capture = GradCapture()
    trainer = L.Trainer(fast_dev_run=1, accelerator="cpu", callbacks=[capture], enable_progress_bar=False)
    trainer.fit(model, DataLoader([batch], batch_size=None), DataLoader([batch], batch_size=None))
    grads = capture.grads[0]
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        err = ((grads[name].double() - grad).norm() / grad.norm()).item()
        assert err < FP32_TOL, f"{name}: relative error {err:.2e}"
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(ref_loss, rel=FP32_TOL)
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(ref_loss, rel=1e-4)  # lr=0


def test_tied_embeddings_are_one_parameter():
    model = tiny_litgpt("tied")
    assert model.model.transformer.wte.weight is model.model.lm_head.weight


def test_softcap_of_the_config_is_applied_and_a_different_one_refused():
    model = tiny_litgpt("softcap")
    assert model.flce_softcap == 3.0
    batch = make_batch()
    with torch.no_grad():
        loss = model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])
        uncapped = torch.nn.functional.cross_entropy(
            model.model.lm_head(model.hidden_states(batch["input_ids"])).flatten(0, 1),
            batch["labels"].flatten(),
        )
        assert loss.item() == pytest.approx(litgpt_loss(model.model, batch).item(), rel=FP32_TOL)
        assert abs(loss.item() - uncapped.item()) > 1e-2
        torch.testing.assert_close(
            model.flce_logits(model.hidden_states(batch["input_ids"])), model(batch["input_ids"])
        )
        model.model.config.final_logit_softcapping = 5.0  # edited after __init__: followed
        assert model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"]).item() != loss.item()
        assert model.flce_softcap == 5.0
        with pytest.raises(ValueError, match="flce_softcap=3.0 differs"):
            model.flce_softcap = 3.0
    with pytest.raises(
        ValueError, match="flce_softcap=30.0 differs from the LitGPT config's final_logit_softcapping=3.0"
    ):
        tiny_litgpt("softcap", flce_softcap=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping=None"):
        tiny_litgpt("untied", flce_softcap=30.0)


class PlainMixinLM(FLCEMixin, L.LightningModule):
    """A user's module around LitGPT's ``GPT``: the plain mixin, the hidden states computed by the user."""

    def __init__(self, gpt, **kwargs):
        super().__init__(flce_head="model.lm_head", **kwargs)
        self.model = gpt

    def training_step(self, batch, batch_idx):
        return self.flce_loss(litgpt_hidden_states(self.model, batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def float64_gpt(**config):
    torch.manual_seed(0)
    gpt = litgpt.GPT(litgpt.Config(**{**TINY, **config}))
    gpt.apply(gpt._init_weights)
    with torch.no_grad():
        gpt.lm_head.weight.mul_(40.0)  # large logits: the softcap changes the loss a lot
    return gpt.double()


def test_the_plain_mixin_applies_a_litgpt_configs_softcap():
    """The config's final_logit_softcapping is an owner's declaration like any other: applied through the plain
    FLCEMixin as GPT.forward applies it (float64: LitGPT's own loss and gradients on its logits)."""
    module = PlainMixinLM(float64_gpt(final_logit_softcapping=3.0))
    batch = make_batch()
    loss = module.training_step(batch, 0)
    ref = copy.deepcopy(module.model)
    ref_loss = litgpt_loss(ref, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    with torch.no_grad():
        hidden = litgpt_hidden_states(module.model, batch["input_ids"])
        uncapped = torch.nn.functional.cross_entropy(
            module.model.lm_head(hidden).flatten(0, 1), batch["labels"].flatten()
        )
        assert abs(loss.item() - uncapped.item()) > 1e-2  # what was silently lost before
        torch.testing.assert_close(module.flce_logits(hidden), module.model(batch["input_ids"]))
    loss.backward()
    ref_loss.backward()
    for (name, param), ref_param in zip(module.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-10, atol=1e-13, msg=name)
    # and through a Trainer in float64
    module = PlainMixinLM(float64_gpt(final_logit_softcapping=3.0))
    trainer = L.Trainer(
        fast_dev_run=1, accelerator="cpu", precision="64-true", logger=False, enable_progress_bar=False
    )
    trainer.fit(module, DataLoader([batch], batch_size=None))
    logged = trainer.callback_metrics["train/loss"]
    assert logged.dtype == torch.float32  # Lightning keeps logged values in float32: its rounding only
    assert logged.item() == pytest.approx(ref_loss.item(), rel=1e-7)


def test_the_plain_mixin_refuses_a_softcap_option_the_litgpt_config_does_not_apply():
    message = r"flce_softcap=5.0 differs from the model's config.final_logit_softcapping={} \(GPT.config"
    with pytest.raises(ValueError, match=message.format("3.0")):
        PlainMixinLM(float64_gpt(final_logit_softcapping=3.0), flce_softcap=5.0)
    with pytest.raises(ValueError, match=message.format("None")):
        PlainMixinLM(float64_gpt(), flce_softcap=5.0)
    assert PlainMixinLM(float64_gpt(final_logit_softcapping=3.0), flce_softcap=3.0).flce_softcap == 3.0


def test_hidden_states_are_the_head_input_and_the_head_is_restored():
    model = tiny_litgpt("softcap")
    gpt = model.model
    head = gpt.lm_head
    calls = []
    head.register_forward_pre_hook(lambda module, args: calls.append(1))
    idx = make_batch()["input_ids"]
    with torch.no_grad():
        hidden = litgpt_hidden_states(gpt, idx)
        assert calls == []  # the real head is not called for the hidden states
        assert gpt.lm_head is head
        expected = gpt(idx)
        softcap = gpt.config.final_logit_softcapping
        torch.testing.assert_close(softcap * torch.tanh(head(hidden) / softcap), expected)
    with pytest.raises(RuntimeError, match="called lm_head 2 times"):
        litgpt_hidden_states(gpt, idx, lm_head_chunk_size=SEQ // 2)
    assert gpt.lm_head is head


def test_hf_label_format_and_a_model_instance():
    torch.manual_seed(0)
    gpt = litgpt.GPT(litgpt.Config(**TINY))
    model = LitGPTCausalLM(model=gpt, label_format="hf", lr=0.0)
    assert model.model is gpt
    tokens = make_batch()["input_ids"]
    with torch.no_grad():
        loss = model.flce_loss(model.hidden_states(tokens), tokens, shift=True)
        expected = chunked_cross_entropy(gpt(tokens)[:, :-1], tokens[:, 1:], chunk_size=0)
        assert loss.item() == pytest.approx(expected.item(), rel=FP32_TOL)
        assert model._loss({"input_ids": tokens, "labels": tokens}).item() == pytest.approx(
            expected.item(), rel=FP32_TOL
        )


def test_vocab_size_overrides_the_config_and_the_cli_links_it(tmp_path, monkeypatch):
    model = LitGPTCausalLM(config=TINY, vocab_size=130)
    assert model.model.config.vocab_size == 130 and model.model.lm_head.weight.shape[0] == 192
    with pytest.raises(ValueError, match="exceeds the 320 rows"):
        LitGPTCausalLM(model=litgpt.GPT(litgpt.Config(**TINY)), vocab_size=400)

    from lightning_flce.cli import FLCELightningCLI

    monkeypatch.chdir(tmp_path)
    config = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 32, "final_logit_softcapping": 30.0}
    (tmp_path / "litgpt.yaml").write_text(
        yaml.safe_dump(
            {"model": {"class_path": "lightning_flce.models.LitGPTCausalLM", "init_args": {"config": config}}}
        )
    )
    data = ["--data.init_args.cache_dir", str(tmp_path / "cache"), "--data.init_args.max_chars=300000"]
    data += [
        "--data.init_args.vocab_size=512",
        "--data.init_args.seq_len=32",
        "--data.init_args.batch_size=4",
    ]
    cli = FLCELightningCLI(
        args=["--config", str(CONFIGS / "default.yaml"), "--config", str(tmp_path / "litgpt.yaml"), *data],
        run=False,
    )
    assert isinstance(cli.model, LitGPTCausalLM)
    assert cli.model.model.config.vocab_size == cli.datamodule.vocab_size == 512
    assert cli.model.flce_softcap == 30.0
    cli.datamodule.setup("fit")
    loss = cli.model.training_step(next(iter(cli.datamodule.train_dataloader())), 0)
    assert abs(loss.item() - math.log(512)) < 0.5  # a fresh model predicts about uniformly


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="Pass `config`"):
        LitGPTCausalLM()
    with pytest.raises(ValueError, match="not both"):
        LitGPTCausalLM(config=TINY, model=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="must be a litgpt GPT"):
        LitGPTCausalLM(model=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        LitGPTCausalLM(config=TINY, n_layer=2)
    with pytest.raises(ValueError, match="label_format"):
        LitGPTCausalLM(config=TINY, label_format="bad")


def test_torch_compile_traces_the_hidden_states_and_the_loss():
    model = tiny_litgpt("softcap")
    batch = make_batch()
    expected = model.flce_loss(model.hidden_states(batch["input_ids"]), batch["labels"])
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(
        lambda i, t: model.flce_loss(model.hidden_states(i), t), backend=counting_backend
    )
    assert compiled(batch["input_ids"], batch["labels"]).item() == pytest.approx(expected.item(), rel=1e-6)
    assert len(graphs) == 1  # swapping lm_head for the capture does not break the graph
    assert model.model.lm_head.__class__ is torch.nn.Linear
