"""HFCausalLM and FLCEMixin on tiny Hugging Face models built from configs (no download).

The reference is the model's own logits path in float64 (``model(input_ids, attention_mask).logits``,
which applies Gemma 2 softcapping, Cohere ``logit_scale`` and Granite ``logits_scaling`` itself),
shifted, with padding ignored, into ``F.cross_entropy``. The fp32 FLCE path differs by rounding only
(~1e-6 relative): 1e-5 leaves margin and still catches a missing transform (checked to move the loss by
more than 1e-2).
"""

import copy
import logging
import sys

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

pytest.importorskip("transformers")

from lightning_flce.models.hf import HFCausalLM, compile_decoder_layers  # noqa: E402

VOCAB, SEQ = 300, 10
FP32_TOL = 1e-5
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
VARIANTS = {
    "llama": {"model_type": "llama"},
    "llama_tied": {"model_type": "llama", "tie_word_embeddings": True},
    "gemma2_softcap": {"model_type": "gemma2", "head_dim": 8, "final_logit_softcapping": 3.0},
    "cohere_logit_scale": {"model_type": "cohere", "logit_scale": 0.25, "eos_token_id": 2},
    "granite_logits_scaling": {"model_type": "granite", "logits_scaling": 4.0},
}


@pytest.fixture(autouse=True)
def _quiet_lightning():
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    yield  # restored: a later test file may read the INFO lines
    lightning_logger.setLevel(level)


def tiny_hf(variant="llama", **kwargs):
    torch.manual_seed(0)
    model = HFCausalLM(config={**TINY, **VARIANTS[variant]}, lr=0.0, **kwargs)
    with torch.no_grad():
        # large logits, so that softcapping and logit scaling change the loss a lot
        model.model.get_output_embeddings().weight.mul_(60.0)
    return model


def make_batch(seed=0, batch_size=3):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # right padding
    attention_mask[2, 3:] = 0
    labels = input_ids.clone()
    labels[0, 4] = -100  # an explicitly ignored label as well
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def hf_logits_loss(model, batch):
    """The model's own logits path: shift, ignore padding and -100, mean over the rest."""
    logits = model(batch["input_ids"], batch["attention_mask"])
    labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels[:, 1:].flatten())


def reference(model, batch):
    ref = copy.deepcopy(model).double()
    loss = hf_logits_loss(ref, batch)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def assert_grads_close(actual, expected, tol=FP32_TOL):
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        err = ((actual[name].double() - grad).norm() / grad.norm()).item()
        assert err < tol, f"{name}: relative error {err:.2e}"


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("variant", ["llama", "llama_tied"])
def test_fast_dev_run_matches_the_model_logits_path(variant):
    model = tiny_hf(variant)
    batch = make_batch()
    ref_loss, ref_grads = reference(model, batch)
    capture = GradCapture()
    trainer = L.Trainer(fast_dev_run=1, accelerator="cpu", callbacks=[capture], enable_progress_bar=False)
    trainer.fit(model, DataLoader([batch], batch_size=None), DataLoader([batch], batch_size=None))
    assert_grads_close(capture.grads[0], ref_grads)
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(ref_loss, rel=FP32_TOL)
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(
        hf_logits_loss(model, batch).item(),
        rel=1e-4,  # after one step with lr=0: same parameters
    )


def test_tied_embeddings_are_one_parameter():
    model = tiny_hf("llama_tied")
    hf = model.model
    assert hf.get_input_embeddings().weight is hf.get_output_embeddings().weight
    names = [name for name, _ in model.named_parameters()]
    assert sum("embed_tokens" in n or "lm_head" in n for n in names) == 1


@pytest.mark.parametrize("variant", ["gemma2_softcap", "cohere_logit_scale", "granite_logits_scaling"])
def test_logit_transforms_of_the_model_are_applied(variant):
    model = tiny_hf(variant)
    batch = make_batch(1)
    ref_loss, ref_grads = reference(model, batch)
    loss = model._loss(batch)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=FP32_TOL)
    assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ref_grads)
    # the transform matters on this data: the same loss without it is far off
    with torch.no_grad():
        hidden = model.hidden_states(batch["input_ids"], batch["attention_mask"])
        raw_logits = model.model.get_output_embeddings()(hidden)
    labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
    untransformed = F.cross_entropy(raw_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    assert abs(untransformed.item() - ref_loss) > 1e-2


def test_naive_path_equals_the_fused_path():
    batch = make_batch(2)
    fused, naive = tiny_hf("gemma2_softcap"), tiny_hf("gemma2_softcap", flce_naive=True)
    fused_loss, naive_loss = fused._loss(batch), naive._loss(batch)
    fused_loss.backward()
    naive_loss.backward()
    assert fused_loss.item() == pytest.approx(naive_loss.item(), rel=FP32_TOL)
    assert_grads_close(
        {n: p.grad for n, p in fused.named_parameters()},
        {n: p.grad.double() for n, p in naive.named_parameters()},
    )


def test_labels_default_to_input_ids_and_padding_is_ignored():
    model = tiny_hf()
    batch = make_batch(3)
    without_labels = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    expected = hf_logits_loss(model, {**without_labels, "labels": batch["input_ids"]})
    assert model._loss(without_labels).item() == pytest.approx(expected.item(), rel=FP32_TOL)
    # garbage after the padding boundary changes nothing
    changed = {k: v.clone() for k, v in without_labels.items()}
    changed["input_ids"][2, 5:] = 0
    assert model._loss(changed).item() == pytest.approx(model._loss(without_labels).item(), rel=FP32_TOL)
    # narrow integer labels: the padding's -100 must not wrap (uint8 would make it class 156)
    byte_labels = batch["input_ids"].clamp(max=255)
    expected = hf_logits_loss(model, {**without_labels, "labels": byte_labels})
    narrow = {**without_labels, "labels": byte_labels.to(torch.uint8)}
    assert model._loss(narrow).item() == pytest.approx(expected.item(), rel=FP32_TOL)


def test_softcap_option_must_agree_with_the_model_config():
    batch = make_batch(4)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        tiny_hf("gemma2_softcap", flce_softcap=5.0)._loss(batch)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        tiny_hf("llama", flce_softcap=5.0)._loss(batch)
    assert tiny_hf("gemma2_softcap", flce_softcap=3.0)._loss(batch).isfinite()


def test_forward_returns_the_model_logits():
    model = tiny_hf("cohere_logit_scale")
    batch = make_batch(5)
    expected = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(model(batch["input_ids"], batch["attention_mask"]), expected)


def test_pretrained_local_directory_and_vocab_size(tmp_path):
    model = tiny_hf()
    model.model.save_pretrained(tmp_path)
    loaded = HFCausalLM(pretrained=str(tmp_path), vocab_size=VOCAB - 10)
    batch = make_batch(6)
    assert loaded._loss(batch).item() == pytest.approx(model._loss(batch).item(), rel=FP32_TOL)
    with pytest.raises(ValueError, match="exceeds"):
        HFCausalLM(pretrained=str(tmp_path), vocab_size=VOCAB + 1)
    resized = HFCausalLM(config={**TINY, "model_type": "llama"}, vocab_size=128)
    assert resized.model.get_output_embeddings().weight.shape[0] == 128


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="exactly one"):
        HFCausalLM()
    with pytest.raises(ValueError, match="exactly one"):
        HFCausalLM(config={**TINY, "model_type": "llama"}, pretrained="somewhere")
    with pytest.raises(ValueError, match="model_type"):
        HFCausalLM(config=TINY)


def test_a_model_without_an_lm_head_and_a_missing_path_are_named_plainly(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModel

    decoder = AutoModel.from_config(AutoConfig.for_model(**{**TINY, "model_type": "llama"}))  # LlamaModel
    with pytest.raises(ValueError, match="LlamaModel has no output embeddings .*e.g. LlamaForCausalLM"):
        HFCausalLM(model=decoder)
    with pytest.raises(
        TypeError, match=r"a Hugging Face causal LM \(an \*ForCausalLM instance\), got Linear"
    ):
        HFCausalLM(model=torch.nn.Linear(2, 2))
    monkeypatch.chdir(tmp_path)
    for path in ("/nonexistent", str(tmp_path / "missing"), "./missing", "~/surely-missing-flce-model"):
        with pytest.raises(FileNotFoundError, match=f"pretrained='{path}'.*no such file or directory"):
            HFCausalLM(pretrained=path)


def test_a_mistyped_flce_head_fails_when_built_with_a_suggestion():
    config = {**TINY, "model_type": "llama"}
    with pytest.raises(
        AttributeError, match=r"flce_head='model.lm_haed'.*did you mean flce_head='model.lm_head'"
    ):
        HFCausalLM(config=config, flce_head="model.lm_haed")
    with pytest.raises(
        AttributeError, match=r"flce_head='modle.lm_head'.*did you mean flce_head='model.lm_head'"
    ):
        HFCausalLM(config=config, flce_head="modle.lm_head")
    assert HFCausalLM(config=config, flce_head="model.lm_head").flce_head == "model.lm_head"


def test_padded_vocabulary_matches_the_full_head():
    # resize_token_embeddings pads the head to 320 rows for a 300-token vocabulary: the extra rows take part
    # in the model's softmax, so they must take part in the fused loss too
    model = tiny_hf()
    model.model.resize_token_embeddings(VOCAB, pad_to_multiple_of=64)
    weight = model.model.get_output_embeddings().weight
    assert weight.shape[0] == 320
    with torch.no_grad():
        weight[VOCAB:] = weight[:20]  # padding rows as large as real ones, so that they matter
    batch = make_batch(7)
    ref_loss, ref_grads = reference(model, batch)
    loss = model._loss(batch)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=FP32_TOL)
    assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ref_grads)
    assert model.flce_last_logits_shape == (3 * SEQ, 320)
    with torch.no_grad():
        hidden = model.hidden_states(batch["input_ids"], batch["attention_mask"])
        labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
        truncated = F.cross_entropy(
            F.linear(hidden, weight[:VOCAB])[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
        )
    assert abs(truncated.item() - ref_loss) > 1e-2  # a loss over the real rows only would fail above


def test_missing_transformers_raises_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"lightning-flce\[hf\]"):
        HFCausalLM(config={**TINY, "model_type": "llama"})


def test_predict_returns_the_models_logits():
    model = tiny_hf()
    batch = make_batch()
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (logits,) = trainer.predict(model, DataLoader([batch], batch_size=None))
    expected = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, expected)


def test_compiled_decoder_layers_match_the_model_logits_path():
    """compile_decoder_layers compiles the classes _no_split_modules names (both Llama layers here), the
    compiled layers run (a counting backend sees their graphs) and the loss and gradients stay the float64
    reference's."""
    model = tiny_hf("llama_tied")
    batch = make_batch(3)
    ref_loss, ref_grads = reference(model, batch)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    assert compile_decoder_layers(model.model, backend=counting_backend) == 2
    loss = model._loss(batch)
    loss.backward()
    assert graphs, "the compiled layers did not run"
    assert loss.item() == pytest.approx(ref_loss, rel=FP32_TOL)
    assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ref_grads)


def test_compile_layers_option_and_a_model_without_named_layers():
    model = tiny_hf(compile_layers=True)
    layers = list(model.model.model.layers)
    assert len(layers) == 2 and all(layer._compiled_call_impl is not None for layer in layers)
    assert (
        tiny_hf()._compiled_call_impl is None and tiny_hf().model.model.layers[0]._compiled_call_impl is None
    )
    with pytest.raises(ValueError, match="_no_split_modules"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_compiled_layers_stay_compiled_after_inference_and_copies():
    """forward (and predict) runs without a KV cache, whose per-layer guards would recompile each layer up
    to Dynamo's limit and leave them eager for training too; a deep copy (as ddp_spawn's pickling) loses
    torch.compile's wrapper and configure_model restores it."""
    torch.manual_seed(0)
    model = HFCausalLM(config={**TINY, "model_type": "llama", "num_hidden_layers": 10}, lr=0.0)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compile_decoder_layers(model.model, backend=counting_backend)
    batch = make_batch(4)
    with torch.no_grad():
        model.eval()
        model(batch["input_ids"], batch["attention_mask"])
    from lightning_flce._compat import TORCH_VERSION

    if TORCH_VERSION >= (2, 5):
        # Dynamo inlines the layers' module calls (torch._dynamo.config.inline_inbuilt_nn_modules, on by
        # default since 2.5, always on and deprecated since 2.13): layers of one class share their graph (a
        # graph break may split it in two). Per-layer guards (a KV cache) would give one per layer.
        assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for one inference call of 10 layers"
    else:
        # torch 2.4 guards on each layer instance: a graph per layer whatever the cache, up to Dynamo's
        # recompile limit and with the graph breaks of that version; only that the layers ran compiled
        assert graphs, "the compiled layers did not run"
    model.train()
    before = len(graphs)
    model._loss(batch).backward()
    assert len(graphs) > before, "the training step ran eager"

    compiled = HFCausalLM(config={**TINY, "model_type": "llama"}, lr=0.0, compile_layers=True)
    copied = copy.deepcopy(compiled)
    assert all(layer._compiled_call_impl is None for layer in copied.model.model.layers)
    copied.configure_model()
    assert all(layer._compiled_call_impl is not None for layer in copied.model.model.layers)


def test_other_batch_keys_reach_the_decoder():
    """Packed sequences: position_ids restart per document. The loss must be the model's own on the same inputs
    without a KV cache, as HFCausalLM runs it (before, the key was dropped: one long sequence's loss). Recent
    transformers versions also keep the documents apart in attention then (no cache, no attention mask)."""
    model = tiny_hf()
    batch = make_batch(7)
    del batch["attention_mask"]
    batch["position_ids"] = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).expand_as(batch["input_ids"])
    ref = copy.deepcopy(model.model).double()

    inputs = {key: value for key, value in batch.items() if key != "labels"}

    def shifted_loss(logits):  # float64 (the model's own loss upcasts to fp32 only)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()).item()

    expected = shifted_loss(ref(**inputs, use_cache=False).logits)
    without = shifted_loss(ref(input_ids=batch["input_ids"], use_cache=False).logits)
    assert abs(expected - without) > 10 * FP32_TOL * abs(without)  # the key matters here
    assert model._loss(batch).item() == pytest.approx(expected, rel=FP32_TOL)
    predicted = model.predict_step(batch, 0)
    assert torch.allclose(predicted.double(), ref(**inputs, use_cache=False).logits, rtol=1e-4, atol=1e-3)


def test_a_model_instance_and_model_kwargs():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**TINY, "model_type": "llama"})
    instance = AutoModelForCausalLM.from_config(config)
    wrapped = HFCausalLM(model=instance, flce_chunk_size=8)
    assert wrapped.model is instance and "model" not in wrapped.hparams
    with pytest.raises(ValueError, match="exceeds"):
        HFCausalLM(model=instance, vocab_size=VOCAB + 1)
    eager = HFCausalLM(config={**TINY, "model_type": "llama"}, model_kwargs={"attn_implementation": "eager"})
    assert eager.model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="exactly one"):
        HFCausalLM(config={**TINY, "model_type": "llama"}, model=instance)
    with pytest.raises(ValueError, match="model_kwargs"):
        HFCausalLM(model=instance, model_kwargs={"attn_implementation": "eager"})
    with pytest.raises(TypeError, match="model_kwargs"):
        HFCausalLM(config={**TINY, "model_type": "llama"}, torch_dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", ["llama", "gemma2_softcap"])
def test_a_token_weight_batch_key_is_shifted_with_the_labels(variant):
    """``token_weight`` aligned with ``input_ids`` like ``labels``: position t's loss (against token t + 1)
    gets weight t + 1; the mean stays over the unweighted count of the non-ignored tokens."""
    model = tiny_hf(variant)
    batch = make_batch(5)
    token_weight = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(model).double()
    logits = ref(batch["input_ids"], batch["attention_mask"])
    labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)[:, 1:].flatten()
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels, reduction="none")
    expected = (per_token * token_weight[:, 1:].flatten().double()).sum() / (labels != -100).sum()
    expected.backward()
    loss = model._loss({**batch, "token_weight": token_weight})
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=FP32_TOL)
    expected_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, expected_grads)
    with pytest.raises(ValueError, match="token_weight must have the target's shape"):
        model._loss({**batch, "token_weight": token_weight[:, 1:]})


def test_several_validation_dataloaders():
    """Each loader's metrics under Lightning's /dataloader_idx_N keys, equal to validating it alone."""
    model = tiny_hf()
    loaders = [DataLoader([make_batch(6)], batch_size=None), DataLoader([make_batch(7)], batch_size=None)]
    options = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    alone = [
        L.Trainer(**options).validate(copy.deepcopy(model), loader, verbose=False)[0] for loader in loaders
    ]
    results = L.Trainer(**options).validate(model, loaders, verbose=False)
    for index, single in enumerate(alone):
        for name in ("loss", "perplexity", "token_accuracy"):
            got = results[index][f"val/{name}/dataloader_idx_{index}"]
            assert got == pytest.approx(single[f"val/{name}"], rel=1e-6)
    assert alone[0]["val/loss"] != pytest.approx(alone[1]["val/loss"], rel=1e-3)
