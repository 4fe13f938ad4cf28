"""PEFT LoRA on the LM head: the fused loss of a tiny Hugging Face Llama whose ``lm_head`` (and q/v projections)
carry LoRA adapters equals the loss of the PEFT model's own logits.

The reference is the PEFT head's forward (``base(x) + scale * B(A(dropout(x)))``) in float64 into
``F.cross_entropy``; the fp32 fused path differs by rounding only (~1e-6 relative), so 1e-5 leaves margin. With
dropout the reference is the same fp32 head call under the same RNG state (the same dropout mask), since the
mask drawn for a float64 tensor need not be the one drawn for fp32. LoRA's B starts at zero, which would leave
A without a gradient: the adapters are initialised at random (``init_lora_weights=False``).
"""

import copy
import logging

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_flce._compat import TORCH_VERSION  # noqa: E402
from lightning_flce.head import FLCEHeadLoss  # noqa: E402
from lightning_flce.models.hf import HFCausalLM  # noqa: E402

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


@pytest.fixture(autouse=True)
def _quiet_lightning():
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    yield  # restored: a later test file may read the INFO lines
    lightning_logger.setLevel(level)


def lora_config(**options):
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"], **options}
    return peft.LoraConfig(init_lora_weights=False, **options)


def tiny_peft_model(seed=0, **options):
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    with torch.no_grad():
        base.lm_head.weight.mul_(20.0)  # logits of a few units, so that errors in them move the loss
    return peft.get_peft_model(base, lora_config(**options))


def lm_head_of(peft_model):
    return peft_model.get_output_embeddings()


def head_inputs(peft_model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    with torch.no_grad():
        hidden = peft_model.get_decoder()(input_ids=input_ids).last_hidden_state
    labels = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    labels[0, 2] = -100
    return hidden.requires_grad_(), labels


def lora_parameters(head):
    return {name: p for name, p in head.named_parameters() if p.requires_grad}


def loss_and_grads(loss_fn, head, hidden):
    params = lora_parameters(head)
    loss = loss_fn()
    grads = torch.autograd.grad(loss, [hidden, *params.values()])
    return loss.detach(), dict(zip(["hidden", *params], grads))


def fused(head, hidden, labels, seed=None, **options):
    def loss():
        if seed is not None:
            torch.manual_seed(seed)
        return FLCEHeadLoss(**options)(head, hidden, labels)

    return loss_and_grads(loss, head, hidden)


def plain(head, hidden, labels, seed=None):
    """The PEFT head's own forward, then F.cross_entropy in the head's dtype."""

    def loss():
        if seed is not None:
            torch.manual_seed(seed)
        return F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())

    return loss_and_grads(loss, head, hidden)


def float64_reference(head, hidden, labels):
    return plain(copy.deepcopy(head).double(), hidden.detach().double().requires_grad_(), labels)


def assert_close(actual, expected, tol=FP32_TOL):
    (loss, grads), (ref_loss, ref_grads) = actual, expected
    assert loss.item() == pytest.approx(ref_loss.item(), rel=tol)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref.norm() > 0, name  # a zero reference gradient would make the comparison vacuous
        err = ((grads[name].double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < tol, f"{name}: relative error {err:.2e}"


def test_lora_head_without_dropout_matches_the_float64_peft_head():
    model = tiny_peft_model()
    head = lm_head_of(model)
    assert type(head).__name__ == "Linear" and type(head).__module__.startswith("peft.")
    hidden, labels = head_inputs(model)
    result = fused(head, hidden, labels)
    assert_close(result, float64_reference(head, hidden, labels))
    assert {"lora_A.default.weight", "lora_B.default.weight"} <= result[1].keys()
    # the adapter matters: the base head alone gives another loss
    base_loss = F.cross_entropy(head.base_layer(hidden).flatten(0, 1), labels.flatten())
    assert abs(base_loss.item() - result[0].item()) > 1e-2


@pytest.mark.parametrize("impl_options", [{}, {"naive": True}, {"chunk_size": 7}])
def test_lora_head_with_dropout_matches_the_peft_head_under_the_same_rng(impl_options):
    model = tiny_peft_model(lora_dropout=0.5)
    model.train()
    head = lm_head_of(model)
    hidden, labels = head_inputs(model)
    result = fused(head, hidden, labels, seed=123, **impl_options)
    assert_close(result, plain(head, hidden, labels, seed=123))
    # the mask matters: another seed draws another one
    assert abs(plain(head, hidden, labels, seed=124)[0].item() - result[0].item()) > 1e-3


@pytest.mark.parametrize("precision", ["bf16 base, fp32 adapters", "bf16 autocast"])
def test_low_precision_is_as_accurate_as_the_peft_head(precision):
    """A bf16 base model gets fp32 adapters from PEFT (autocast_adapter_dtype): their columns are cast to the
    base weight's dtype for the one GEMM. Under autocast the GEMM runs in bf16 as nn.Linear's would. Either
    way the fused loss is held to the plain PEFT head's own error against float64 (bf16 rounding, ~4e-3)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    with torch.no_grad():
        base.lm_head.weight.mul_(20.0)
    if precision.startswith("bf16 base"):
        base = base.to(torch.bfloat16)
    model = peft.get_peft_model(base, lora_config())
    head = lm_head_of(model)
    assert head.lora_A["default"].weight.dtype == torch.float32
    hidden, labels = head_inputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision.endswith("autocast")):
        (loss, grads), (plain_loss, plain_grads) = fused(head, hidden, labels), plain(head, hidden, labels)
    ref_loss, ref_grads = float64_reference(head, hidden, labels)
    assert abs(loss.item() - ref_loss.item()) <= max(abs(plain_loss.item() - ref_loss.item()), 1e-3)
    for name, ref in ref_grads.items():
        assert grads[name].dtype == plain_grads[name].dtype, name
        err, plain_err = (
            ((g.double() - ref).norm() / ref.norm()).item() for g in (grads[name], plain_grads[name])
        )
        assert err < 1e-2 and err <= 1.25 * plain_err, (
            f"{name}: relative error {err:.2e} (plain {plain_err:.2e})"
        )


def test_several_active_adapters_and_a_lora_bias():
    model = tiny_peft_model()
    model.add_adapter("second", lora_config(r=2, lora_alpha=6, lora_bias=True))
    model.base_model.set_adapter(["default", "second"])
    head = lm_head_of(model)
    assert head.active_adapters == ["default", "second"] and head.lora_B["second"].bias is not None
    with torch.no_grad():
        head.lora_B["second"].bias.normal_()
    hidden, labels = head_inputs(model)
    result = fused(head, hidden, labels)
    assert {"lora_A.second.weight", "lora_B.second.bias"} <= result[1].keys()
    assert_close(result, float64_reference(head, hidden, labels))


def test_disabled_and_merged_adapters_use_the_base_weight():
    model = tiny_peft_model()
    head = lm_head_of(model)
    hidden, labels = head_inputs(model)
    with model.disable_adapter():
        disabled = FLCEHeadLoss()(head, hidden, labels)
        plain_disabled = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    base = F.cross_entropy(head.base_layer(hidden).flatten(0, 1), labels.flatten())
    assert disabled.item() == pytest.approx(base.item(), rel=FP32_TOL)
    assert plain_disabled.item() == pytest.approx(base.item(), rel=FP32_TOL)
    unmerged = FLCEHeadLoss()(head, hidden, labels)
    model.merge_adapter()
    assert head.merged
    merged = FLCEHeadLoss()(head, hidden, labels)
    # the merged base weight holds the adapter: the same loss, from the base weight alone
    assert merged.item() == pytest.approx(unmerged.item(), rel=FP32_TOL)
    assert abs(merged.item() - base.item()) > 1e-2
    with model.disable_adapter():  # PEFT unmerges a disabled merged adapter
        assert FLCEHeadLoss()(head, hidden, labels).item() == pytest.approx(base.item(), rel=FP32_TOL)
    assert not head.merged


def test_weights_are_read_inside_their_modules_calls():
    """As under DeepSpeed ZeRO-3, whose hooks gather each module's weight around that module's call: here the
    frozen base weight is empty outside base_layer's call, and every module's hooks fire."""
    model = tiny_peft_model()
    head = lm_head_of(model)
    hidden, labels = head_inputs(model)
    expected = float64_reference(head, hidden, labels)
    base = head.base_layer
    full = base.weight.data
    calls = []

    def gather(module, args):
        calls.append(type(module).__name__)
        if module is base:
            base.weight.data = full

    def release(module, args, output):
        if module is base:
            base.weight.data = torch.empty(0)

    for module in (head, base, head.lora_A["default"], head.lora_B["default"]):
        module.register_forward_pre_hook(gather)
        module.register_forward_hook(release)
    base.weight.data = torch.empty(0)
    result = fused(head, hidden, labels)
    assert calls == ["Linear", "Linear", "Linear", "Linear"]  # the LoRA head, lora_A, base_layer, lora_B
    assert base.weight.numel() == 0
    assert_close(result, expected)


def test_torch_compile_traces_a_lora_head_without_hooks():
    model = tiny_peft_model()
    head = lm_head_of(model)
    hidden, labels = head_inputs(model)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    head_loss = FLCEHeadLoss()
    compiled = torch.compile(lambda h, t: head_loss(head, h, t), backend=counting_backend)
    assert_close(
        loss_and_grads(lambda: compiled(hidden, labels), head, hidden), fused(head, hidden, labels), 1e-6
    )
    if TORCH_VERSION >= (2, 6):  # older Dynamo may break the graph around the PEFT module calls
        assert len(graphs) == 1


def test_unsupported_peft_layers_on_the_head_raise_a_clear_error():
    hidden = torch.randn(2, 3, TINY["hidden_size"])
    labels = torch.zeros(2, 3, dtype=torch.long)
    dora = lm_head_of(tiny_peft_model(use_dora=True))
    with pytest.raises(TypeError, match=r"adapter 'default' is a LoRA variant \(DoraLinearVariant"):
        FLCEHeadLoss()(dora, hidden, labels)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    ia3 = peft.get_peft_model(
        base, peft.IA3Config(target_modules=["lm_head"], feedforward_modules=["lm_head"])
    ).get_output_embeddings()
    with pytest.raises(TypeError, match=r"PEFT peft\.tuners\.ia3\.layer\.Linear layer.*modules_to_save"):
        FLCEHeadLoss()(ia3, hidden, labels)


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.clone()}


def peft_model_loss(peft_model, batch):
    """The PEFT model's own logits path: shift, ignore padding, mean over the rest."""
    logits = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels[:, 1:].flatten())


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def test_hf_causal_lm_trains_a_peft_model_like_its_own_loss():
    peft_model = tiny_peft_model()
    batch = make_batch()
    ref = copy.deepcopy(peft_model).double()
    ref_loss = peft_model_loss(ref, batch)
    ref_loss.backward()
    ref_grads = {f"model.{n}": p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert any(".q_proj.lora_A." in name for name in ref_grads)
    assert any("lm_head.lora_B." in name for name in ref_grads)

    module = HFCausalLM(model=peft_model, lr=0.0)
    capture = GradCapture()
    trainer = L.Trainer(fast_dev_run=1, accelerator="cpu", callbacks=[capture], enable_progress_bar=False)
    trainer.fit(module, DataLoader([batch], batch_size=None), DataLoader([batch], batch_size=None))
    grads = capture.grads[0]
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        err = ((grads[name].double() - ref_grad).norm() / ref_grad.norm()).item()
        assert err < FP32_TOL, f"{name}: relative error {err:.2e}"
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(ref_loss.item(), rel=FP32_TOL)
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(ref_loss.item(), rel=1e-4)
