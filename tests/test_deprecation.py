"""The deprecated option names (``lightning_flce/deprecation.py``): each still works for a release, warns with a
``FutureWarning`` that names the new one, and gives exactly the new name's result."""

from __future__ import annotations

import lightning
import pytest
import torch
from torch import nn

from lightning_flce.head import FLCEHeadLoss
from lightning_flce.models import TinyGPT

VOCAB, HIDDEN = 24, 8


def tiny_gpt(**kwargs) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, d_model=HIDDEN, n_layers=1, n_heads=2, max_seq_len=8, lr=0.0, **kwargs)


def problem(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
    hidden = torch.randn(2, 7, HIDDEN, generator=generator, dtype=dtype)
    target = torch.randint(0, VOCAB, (2, 7), generator=generator)
    target[0, :2] = -100
    return head, hidden, target


def loss_and_grad(head_loss: FLCEHeadLoss, *args, **kwargs):
    head = args[0]
    head.weight.grad = None
    loss = head_loss(*args, **kwargs)
    loss.sum().backward()
    return loss.detach(), head.weight.grad


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ({"z_loss": 1e-2}, {"lse_square_scale": 1e-2}, "'z_loss' is deprecated.*use 'lse_square_scale'"),
        ({"accum_fp32": True}, {"accum_dtype": "float32"}, "'accum_fp32' is deprecated.*use 'accum_dtype'"),
        ({"accum_fp32": False}, {"accum_dtype": None}, "'accum_fp32' is deprecated.*use 'accum_dtype'"),
    ],
    ids=["z_loss", "accum_fp32", "accum_fp32_false"],
)
def test_head_loss_old_constructor_names(old, new, message):
    with pytest.warns(FutureWarning, match=message):
        old_loss = FLCEHeadLoss(chunk_size=4, **old)
    new_loss = FLCEHeadLoss(chunk_size=4, **new)
    assert old_loss.options == new_loss.options
    head, hidden, target = problem(torch.bfloat16)  # 16-bit: the accumulator's dtype changes dW
    got, want = loss_and_grad(old_loss, head, hidden, target), loss_and_grad(new_loss, head, hidden, target)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_head_loss_old_attributes_warn_and_read_the_new_ones():
    head_loss = FLCEHeadLoss(lse_square_scale=1e-3, accum_dtype=torch.float32)
    with pytest.warns(FutureWarning, match="use 'lse_square_scale'"):
        assert head_loss.z_loss == head_loss.lse_square_scale == 1e-3
    with pytest.warns(FutureWarning, match="use 'accum_dtype'"):
        assert head_loss.accum_fp32 is True
    with pytest.warns(FutureWarning, match="use 'accum_dtype'"):
        assert FLCEHeadLoss(accum_dtype="float64").accum_fp32 is False
    with pytest.raises(AttributeError):
        head_loss.z_loss = 0.5  # read-only, as before: the record is the one copy


def test_head_loss_labels_keyword():
    head, hidden, target = problem()
    head_loss = FLCEHeadLoss(label_smoothing=0.1)
    want = loss_and_grad(head_loss, head, hidden, target, reduction="none")
    with pytest.warns(FutureWarning, match="'labels' is deprecated.*use 'target'"):
        got = loss_and_grad(head_loss, head, hidden, labels=target, reduction="none")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(head_loss(head, hidden, target=target), head_loss(head, hidden, target))


def test_both_names_raise():
    with pytest.raises(TypeError, match="got both 'z_loss' \\(deprecated\\) and 'lse_square_scale'"):
        FLCEHeadLoss(z_loss=1e-3, lse_square_scale=1e-3)
    head, hidden, target = problem()
    with pytest.raises(TypeError, match="got both 'labels' \\(deprecated\\) and 'target'"):
        FLCEHeadLoss()(head, hidden, target=target, labels=target)
    with pytest.raises(TypeError, match="got both 'flce_accum_fp32' \\(deprecated\\) and 'flce_accum_dtype'"):
        tiny_gpt(flce_accum_fp32=True, flce_accum_dtype="float32")


def test_mixin_old_option_names():
    with pytest.warns(FutureWarning) as warned:
        old = tiny_gpt(flce_z_loss=1e-2, flce_accum_fp32=True)
    messages = sorted(str(warning.message) for warning in warned if warning.category is FutureWarning)
    assert len(messages) == 2
    assert "'flce_accum_fp32' is deprecated" in messages[0] and "use 'flce_accum_dtype'" in messages[0]
    assert "'flce_z_loss' is deprecated" in messages[1] and "use 'flce_lse_square_scale'" in messages[1]
    new = tiny_gpt(flce_lse_square_scale=1e-2, flce_accum_dtype="float32")
    assert old.flce_options == new.flce_options
    assert new.flce_options.accum_dtype is torch.float32

    hidden = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with pytest.warns(FutureWarning, match="FLCEMixin.flce_loss: 'labels' is deprecated.*use 'target'"):
        got = new.flce_loss(hidden, labels=target)
    assert torch.equal(got, new.flce_loss(hidden, target))


def test_a_misspelled_old_name_suggests_the_new_one():
    with pytest.raises(TypeError, match="unknown option 'flce_z_los'; did you mean 'flce_lse_square_scale'"):
        tiny_gpt(flce_z_los=1e-3)


def test_checkpoint_with_old_option_names_loads(tmp_path):
    """A checkpoint saved before the rename carries the old names in its hyperparameters (as the module's
    ``save_hyperparameters`` recorded the keywords): it still loads, with the warning, into the same options."""
    with pytest.warns(FutureWarning):
        old = tiny_gpt(flce_z_loss=1e-3, flce_accum_fp32=True)
    assert old.hparams["flce_z_loss"] == 1e-3 and "flce_lse_square_scale" not in old.hparams
    path = tmp_path / "old.ckpt"
    torch.save(
        {
            "state_dict": old.state_dict(),
            "hyper_parameters": dict(old.hparams),
            "pytorch-lightning_version": lightning.__version__,
        },
        path,
    )
    with pytest.warns(FutureWarning) as warned:
        loaded = TinyGPT.load_from_checkpoint(path, weights_only=False)
    messages = " ".join(str(warning.message) for warning in warned)
    assert "use 'flce_lse_square_scale'" in messages and "use 'flce_accum_dtype'" in messages
    assert loaded.flce_options == old.flce_options
    assert loaded.flce_options.lse_square_scale == 1e-3 and loaded.flce_options.accum_dtype is torch.float32
