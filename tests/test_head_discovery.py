"""Head discovery and the logit transforms a model declares, without a Trainer or transformers."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_flce.head_discovery import ResolvedHead, find_hf_model, head_logits, resolve_head


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
