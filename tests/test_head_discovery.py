"""Head discovery, the logit transforms the head's owners declare and the build-time check of ``flce_head``,
without transformers (a Trainer only for the heads built in ``configure_model``)."""

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_flce.head_discovery import ResolvedHead, find_hf_model, head_logits, resolve_head
from lightning_flce.mixin import FLCEMixin


class FakeHFModel(nn.Module):
    """What the discovery reads of a Hugging Face causal LM: ``config`` and ``get_output_embeddings()``."""

    def __init__(self, logit_scale=None, **config):
        super().__init__()
        self.config = SimpleNamespace(**config)
        self.lm_head = nn.Linear(4, 6, bias=False)
        if logit_scale is not None:
            self.logit_scale = logit_scale

    def get_output_embeddings(self):
        return self.lm_head


class Wrapper(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model


def test_the_only_hf_child_and_its_transforms():
    model = FakeHFModel(logit_scale=0.5, logits_scaling=4.0, final_logit_softcapping=30.0)
    root = Wrapper(model)
    assert find_hf_model(root) is model
    # Cohere's scale times Granite's 1 / logits_scaling; the config's softcap
    assert resolve_head(root, None, None) == ResolvedHead(model.lm_head, 0.125, 30.0)
    assert resolve_head(root, None, 30.0).softcap == 30.0
    with pytest.raises(ValueError, match="differs from the model's config.final_logit_softcapping=30.0"):
        resolve_head(root, None, 5.0)
    with pytest.raises(NotImplementedError, match="tensor logit_scale"):
        resolve_head(Wrapper(FakeHFModel(logit_scale=torch.ones(6))), None, None)


def test_a_head_path_and_the_lm_head_default():
    root = Wrapper(nn.Linear(4, 6))
    root.other = nn.Linear(4, 6)
    assert resolve_head(root, "other", 2.0) == ResolvedHead(root.other, None, 2.0)
    with pytest.raises(AttributeError, match="flce_head='model.missing': Linear has no attribute 'missing'"):
        resolve_head(root, "model.missing", None)
    with pytest.raises(AttributeError, match="has no `lm_head`"):
        resolve_head(root, None, None)
    root.lm_head = nn.Linear(4, 6)
    assert resolve_head(root, None, None).module is root.lm_head
    # a head that is not the HF model's output embedding gets no config transform
    hf_root = Wrapper(FakeHFModel(logit_scale=0.5))
    hf_root.extra = nn.Linear(4, 6)
    assert resolve_head(hf_root, "extra", None) == ResolvedHead(hf_root.extra, None, None)


def test_head_logits_apply_the_scale_then_the_softcap():
    head = nn.Linear(4, 6)
    embedding = nn.Embedding(6, 4)
    hidden = torch.randn(3, 4)
    with torch.no_grad():
        expected = 2.0 * torch.tanh(head(hidden) * 0.5 / 2.0)
        torch.testing.assert_close(head_logits(ResolvedHead(head, 0.5, 2.0), hidden), expected)
        # a tied embedding is used as the output matrix
        torch.testing.assert_close(
            head_logits(ResolvedHead(embedding, None, None), hidden), hidden @ embedding.weight.T
        )


# ---------------------------------------------------------------- the transforms the head's owners declare


class CappedModel(nn.Module):
    """A custom model (not Hugging Face) whose config declares logit transforms and whose forward applies
    them: Granite's ``logits / logits_scaling``, then Gemma's softcap."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8)
        self.lm_head = nn.Linear(8, 11, bias=False)
        with torch.no_grad():
            self.lm_head.weight.mul_(30.0)  # large logits: the transforms move the loss a lot

    def hidden_states(self, x):
        return torch.tanh(self.body(x))

    def forward(self, x):
        config = self.config
        get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
        logits = self.lm_head(self.hidden_states(x))
        if get("logits_scaling") is not None:
            logits = logits / get("logits_scaling")
        cap = get("final_logit_softcapping")
        return logits if cap is None else cap * torch.tanh(logits / cap)


class UserLM(FLCEMixin, pl.LightningModule):
    def __init__(self, model, **kwargs):
        super().__init__(flce_head="model.lm_head", **kwargs)
        self.model = model


@pytest.mark.parametrize("as_dict", [False, True], ids=["namespace", "dict"])
def test_a_custom_models_config_transforms_are_applied(as_dict):
    """float64 reference: the model's own forward (its logits with its transforms) into F.cross_entropy."""
    config = {"logits_scaling": 4.0, "final_logit_softcapping": 2.0}
    module = UserLM(CappedModel(config if as_dict else SimpleNamespace(**config))).double()
    x, labels = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 11, (7,))
    loss = module.flce_loss(module.model.hidden_states(x), labels)
    expected = F.cross_entropy(module.model(x), labels)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    uncapped = F.cross_entropy(module.model.lm_head(module.model.hidden_states(x)), labels)
    assert abs(loss.item() - uncapped.item()) > 1e-2  # the transforms matter here
    with torch.no_grad():
        torch.testing.assert_close(module.flce_logits(module.model.hidden_states(x)), module.model(x))
    # gradients of the body and the head, against the model's own logits path
    loss.backward()
    grads = [p.grad.clone() for p in module.model.parameters()]
    module.zero_grad()
    expected.backward()
    for got, want in zip(grads, [p.grad for p in module.model.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_a_softcap_option_that_disagrees_with_the_config_is_refused_when_built():
    with pytest.raises(
        ValueError,
        match=r"flce_softcap=5.0 differs from the model's config.final_logit_softcapping=2.0 \(CappedModel.config",
    ):
        UserLM(CappedModel(SimpleNamespace(final_logit_softcapping=2.0)), flce_softcap=5.0)
    # a config that declares the softcap off decides it too; with no declaration the option is applied
    with pytest.raises(ValueError, match="final_logit_softcapping=None"):
        UserLM(CappedModel(SimpleNamespace(final_logit_softcapping=None)), flce_softcap=5.0)
    assert (
        resolve_head(UserLM(CappedModel(SimpleNamespace()), flce_softcap=5.0), "model.lm_head", 5.0).softcap
        == 5.0
    )


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        (
            {"logit_scale": nn.Parameter(torch.ones(()))},
            NotImplementedError,
            r"CappedModel.config.logit_scale: a tensor",
        ),
        ({"final_logit_softcapping": "30"}, TypeError, r"CappedModel.config.final_logit_softcapping='30'"),
        ({"final_logit_softcapping": 0.0}, ValueError, r"final_logit_softcapping=0.0: a softcap must be > 0"),
        ({"logits_scaling": 0}, ValueError, "cannot be divided"),
        ({"final_logit_softcapping": 30.0, "output_logit_soft_cap": 20.0}, ValueError, "two softcaps"),
    ],
)
def test_a_transform_that_cannot_be_applied_is_refused(config, error, message):
    with pytest.raises(error, match=message):
        UserLM(CappedModel(SimpleNamespace(**config)))


def test_owners_on_the_path_must_agree_and_only_the_path_counts():
    inner = CappedModel(SimpleNamespace(final_logit_softcapping=2.0))
    outer = Wrapper(inner)
    outer.config = SimpleNamespace(final_logit_softcapping=3.0)
    with pytest.raises(
        ValueError, match=r"Wrapper.config.final_logit_softcapping=3.0 and CappedModel.config"
    ):
        resolve_head(outer, "model.lm_head", None)
    outer.config.final_logit_softcapping = 2.0  # a wrapper repeating its model's value
    assert resolve_head(outer, "model.lm_head", None).softcap == 2.0
    # a module beside the path (not an owner of the head) declares nothing for it
    root = Wrapper(nn.Module())
    root.model.lm_head = nn.Linear(4, 6)
    root.other = CappedModel(SimpleNamespace(final_logit_softcapping=2.0))
    assert resolve_head(root, "model.lm_head", None) == ResolvedHead(root.model.lm_head, None, None)


def test_text_config_and_the_models_whose_logits_scaling_multiplies():
    vlm = FakeHFModel(text_config=SimpleNamespace(final_logit_softcapping=30.0, logit_scale=0.5))
    assert resolve_head(vlm, None, None) == ResolvedHead(vlm.lm_head, 0.5, 30.0)
    granite = FakeHFModel(model_type="granite", logits_scaling=4.0)
    assert resolve_head(granite, None, None).logit_scale == 0.25  # logits / logits_scaling
    clova = FakeHFModel(model_type="hyperclovax", logits_scaling=4.0)
    assert resolve_head(clova, None, None).logit_scale == 4.0  # logits * logits_scaling
    falcon = FakeHFModel(lm_head_multiplier=0.5, output_multiplier=3.0)
    assert resolve_head(falcon, None, None).logit_scale == 1.5
    # a Hugging Face model decides its softcap: none in its config refuses the option
    with pytest.raises(ValueError, match="final_logit_softcapping=None"):
        resolve_head(FakeHFModel(), None, 5.0)


# ------------------------------------------------------------ flce_head checked when the module is built


class TypoLM(FLCEMixin, pl.LightningModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model = Wrapper(nn.Linear(4, 4))
        self.model.lm_head = nn.Linear(4, 6)


class LazyLM(FLCEMixin, pl.LightningModule):
    """Builds its model in ``configure_model`` (as FSDP's meta-device initialization does)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model = None

    def configure_model(self):
        if self.model is None:
            self.model = Wrapper(nn.Linear(4, 4))
            self.model.lm_head = nn.Linear(4, 6)

    def training_step(self, batch, batch_idx):
        return self.flce_loss(self.model.model(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LazyRootHeadLM(LazyLM):
    """Builds its head at the root in ``configure_model``: nothing to check it against when built."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model = Wrapper(nn.Linear(4, 4))

    def configure_model(self):
        self.head = nn.Linear(4, 6)


def fit(module):
    data = [(torch.randn(3, 4), torch.randint(0, 6, (3,)))]
    trainer = pl.Trainer(
        fast_dev_run=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(module, DataLoader(data, batch_size=None))
    return trainer


def test_a_mistyped_head_fails_when_built_with_a_suggestion():
    with pytest.raises(
        AttributeError,
        match=r"flce_head='model.lm_haed': Wrapper has no attribute 'lm_haed'; did you mean flce_head='model.lm_head'\?",
    ):
        TypoLM(flce_head="model.lm_haed")
    with pytest.raises(
        AttributeError, match=r"TypoLM has no attribute 'modle'; did you mean flce_head='model.lm_head'\?"
    ):
        TypoLM(flce_head="modle.lm_head")
    with pytest.raises(TypeError, match="nn.Module"):
        TypoLM(flce_head="model.lm_head.weight")
    assert TypoLM(flce_head="model.lm_head").flce_head == "model.lm_head"
    # no flce_head and no lm_head: a default is no typo; it is checked at fit start and at each call
    assert TypoLM().flce_head is None


def test_a_module_may_also_derive_from_an_abc_base():
    # the build-time check's metaclass derives from ABCMeta: an abstract LightningModule base still mixes in
    import abc

    class AbstractLM(pl.LightningModule, abc.ABC):
        @abc.abstractmethod
        def body(self): ...

    class ConcreteLM(FLCEMixin, AbstractLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lm_head = nn.Linear(4, 6)

        def body(self):
            return None

    class StillAbstractLM(FLCEMixin, AbstractLM):
        pass

    assert ConcreteLM(flce_head="lm_head").flce_head == "lm_head"
    with pytest.raises(AttributeError, match="did you mean flce_head='lm_head'"):
        ConcreteLM(flce_head="lm_haed")
    with pytest.raises(TypeError, match="abstract"):
        StillAbstractLM()


def test_a_head_built_in_configure_model_is_checked_at_fit_start():
    assert fit(LazyLM(flce_head="model.lm_head")).state.finished
    # the owner is None when built: not checked then; at fit start, after configure_model, it is
    module = LazyLM(flce_head="model.lm_haed")
    with pytest.raises(AttributeError, match=r"did you mean flce_head='model.lm_head'\?"):
        fit(module)
    assert fit(LazyRootHeadLM(flce_head="head")).state.finished
    with pytest.raises(AttributeError, match=r"flce_head='haed'.*did you mean flce_head='head'\?"):
        fit(LazyRootHeadLM(flce_head="haed"))
