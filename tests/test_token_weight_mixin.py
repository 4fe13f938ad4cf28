"""Per-token loss weights through the Lightning front ends: FLCEHeadLoss (fused and naive paths), FLCEMixin
with gradient accumulation under flce_normalize="step", and the mixin's flce_logits_precision option.

The reference is the definition in float64: every per-token summand (cross-entropy with label smoothing,
z-loss) times the token's weight, "mean" divided by the unweighted number of non-ignored tokens. fp32
inputs differ from it by rounding (~1e-6 relative).
"""

import copy
import logging
import pickle

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_flce.head import FLCEHeadLoss
from lightning_flce.models.gpt import TinyGPT
from lightning_flce.options import FLCEOptions

VOCAB, HIDDEN, SEQ = 41, 16, 8
FP32 = {"rtol": 2e-5, "atol": 2e-6}


@pytest.fixture(autouse=True)
def _quiet_lightning():
    lightning_logger = logging.getLogger("lightning.pytorch")
    level = lightning_logger.level
    lightning_logger.setLevel(logging.ERROR)
    yield  # restored: a later test file may read the INFO lines
    lightning_logger.setLevel(level)


def weighted_reference(
    logits, labels, token_weight, *, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0, softcap=None
):
    logits = logits.reshape(-1, logits.shape[-1]).double()
    labels, token_weight = labels.reshape(-1), token_weight.reshape(-1).double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = labels != -100
    per_token = F.cross_entropy(logits, labels, reduction="none", label_smoothing=label_smoothing)
    per_token = (per_token + lse_square_scale * torch.logsumexp(logits, -1).square() * valid) * token_weight
    if reduction == "none":
        return per_token
    return per_token.sum() / valid.sum() if reduction == "mean" else per_token.sum()


def weights_and_labels(shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, shape, generator=generator)
    labels.view(-1)[:3] = -100
    # negative, zero and positive weights (advantages, soft masks)
    token_weight = torch.randn(shape, generator=generator)
    token_weight.view(-1)[3:5] = 0.0
    return labels, token_weight


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("naive", [False, True], ids=["fused", "naive"])
@pytest.mark.parametrize("logit_scale", [None, 0.5])
def test_head_loss_weights_every_summand(reduction, naive, logit_scale):
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB)
    hidden = torch.randn(3, SEQ, HIDDEN, requires_grad=True)
    labels, token_weight = weights_and_labels((3, SEQ))
    options = {"label_smoothing": 0.1, "lse_square_scale": 1e-2}
    head_loss = FLCEHeadLoss(**options, chunk_size=5, naive=naive, softcap=4.0)
    loss = head_loss(
        head, hidden, labels, reduction=reduction, logit_scale=logit_scale, token_weight=token_weight
    )

    reference_head = copy.deepcopy(head).double()
    reference_hidden = hidden.detach().double().requires_grad_()
    scale = 1.0 if logit_scale is None else logit_scale
    expected = weighted_reference(
        reference_head(reference_hidden) * scale,
        labels,
        token_weight,
        reduction=reduction,
        label_smoothing=0.1,
        lse_square_scale=1e-2,
        softcap=4.0,
    )
    torch.testing.assert_close(loss.double().reshape(expected.shape), expected, **FP32)
    probe = torch.randn(expected.shape, dtype=torch.float64)  # a cotangent that is not all ones
    (loss.double().reshape(expected.shape) * probe).sum().backward()
    (expected * probe).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), reference_hidden.grad, **FP32)
    for name, param in head.named_parameters():
        torch.testing.assert_close(param.grad.double(), getattr(reference_head, name).grad, **FP32, msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_loss_weights_every_summand_on_cuda(reduction, dtype):
    """The Triton path against float64 of the same operands, with the op's CUDA tolerances
    (``test_op_cuda.py``): fp32 1e-5 relative; bf16 1e-3 (loss) and 2e-2 (gradients), its logits being rounded
    to bf16. Non-negative weights here, so that the relative error of the weighted sum is meaningful."""
    loss_tol, grad_tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-3, 2e-2)
    torch.manual_seed(0)
    head = nn.Linear(64, 1000, device="cuda", dtype=dtype)
    hidden = torch.randn(4, 256, 64, device="cuda", dtype=dtype, requires_grad=True)
    labels, token_weight = weights_and_labels((4, 256))
    labels, token_weight = (labels % 1000).cuda(), token_weight.abs().cuda()
    labels[0, :5] = -100
    head_loss = FLCEHeadLoss(
        label_smoothing=0.1, lse_square_scale=1e-2, chunk_size=300, impl="triton", softcap=30.0
    )
    loss = head_loss(head, hidden, labels, reduction=reduction, token_weight=token_weight)
    loss.backward()
    reference_head = copy.deepcopy(head).double()
    reference_hidden = hidden.detach().double().requires_grad_()
    expected = weighted_reference(
        reference_head(reference_hidden),
        labels,
        token_weight,
        reduction=reduction,
        label_smoothing=0.1,
        lse_square_scale=1e-2,
        softcap=30.0,
    )
    expected.backward()

    def relative_error(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    assert relative_error(loss, expected) < loss_tol
    assert relative_error(hidden.grad, reference_hidden.grad) < grad_tol
    assert relative_error(head.weight.grad, reference_head.weight.grad) < grad_tol


def test_head_loss_refuses_bad_token_weights_before_any_kernel():
    head = nn.Linear(HIDDEN, VOCAB)
    hidden = torch.randn(2, SEQ, HIDDEN)
    labels, token_weight = weights_and_labels((2, SEQ))
    for naive in (False, True):
        head_loss = FLCEHeadLoss(naive=naive)
        with pytest.raises(
            ValueError, match=r"token_weight must have the target's shape \(2, 8\), got \(2, 7\)"
        ):
            head_loss(head, hidden, labels, token_weight=token_weight[:, 1:])
        with pytest.raises(TypeError, match="token_weight must be floating point"):
            head_loss(head, hidden, labels, token_weight=labels)
        with pytest.raises(ValueError, match="token_weight is on meta but input is on cpu"):
            head_loss(head, hidden, labels, token_weight=token_weight.to("meta"))
        with pytest.raises(ValueError, match="token_weight.detach()"):
            head_loss(head, hidden, labels, token_weight=token_weight.requires_grad_())
        token_weight = token_weight.detach()


def tiny_gpt(**kwargs):
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, d_model=HIDDEN, n_layers=1, n_heads=2, max_seq_len=SEQ, lr=0.0, **kwargs)


def weighted_batches():
    batches = []
    for seed, batch_size in ((1, 2), (2, 3), (3, 1)):
        generator = torch.Generator().manual_seed(seed)
        labels, token_weight = weights_and_labels((batch_size, SEQ), seed=seed)
        input_ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)
        batches.append({"input_ids": input_ids, "labels": labels, "token_weight": token_weight})
    return batches


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("naive", [False, True], ids=["fused", "naive"])
def test_mixin_step_mean_with_token_weights_over_accumulated_micro_batches(naive):
    """One optimizer step over three micro-batches of different sizes (TinyGPT reads the batch key
    ``token_weight``): the gradient is that of the weighted token sum over the step's unweighted token count,
    and the logged train/loss its value."""
    options = {"flce_label_smoothing": 0.1, "flce_lse_square_scale": 1e-2, "flce_chunk_size": 7}
    model = tiny_gpt(tie_embeddings=False, flce_naive=naive, **options)
    batches = weighted_batches()
    reference = copy.deepcopy(model).double()
    capture = GradCapture()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
        limit_val_batches=0,
        accumulate_grad_batches=len(batches),
        callbacks=[capture],
    )
    trainer.fit(model, DataLoader(batches, batch_size=None))

    logits = torch.cat([reference.lm_head(reference.hidden_states(b["input_ids"])) for b in batches], 0)
    labels = torch.cat([b["labels"] for b in batches])
    token_weight = torch.cat([b["token_weight"] for b in batches])
    expected = weighted_reference(logits, labels, token_weight, label_smoothing=0.1, lse_square_scale=1e-2)
    expected.backward()
    assert trainer.callback_metrics["train/loss_step"].item() == pytest.approx(expected.item(), rel=1e-5)
    (grads,) = capture.grads
    for name, param in reference.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name].double(), param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_flce_loss_shifts_the_weights_with_the_labels():
    model = tiny_gpt()
    hidden = torch.randn(2, SEQ, HIDDEN)
    input_ids, token_weight = weights_and_labels((2, SEQ), seed=4)
    input_ids = input_ids.clamp(min=0)
    shifted = model.flce_loss(hidden, input_ids, shift=True, token_weight=token_weight)
    labels = F.pad(input_ids[:, 1:], (0, 1), value=-100)
    expected = model.flce_loss(hidden, labels, token_weight=F.pad(token_weight[:, 1:], (0, 1)))
    torch.testing.assert_close(shifted, expected)
    # the weights count: a different weight of a real token changes the loss
    assert not torch.allclose(shifted, model.flce_loss(hidden, input_ids, shift=True))


@pytest.mark.parametrize("shift", [False, True])
def test_flce_loss_names_a_wrong_token_weight_against_the_target(shift):
    model = tiny_gpt()
    hidden = torch.randn(2, SEQ, HIDDEN)
    labels, token_weight = weights_and_labels((2, SEQ))
    labels = labels.clamp(min=0)
    with pytest.raises(ValueError, match=r"token_weight must have the target's shape \(2, 8\), got \(16,\)"):
        model.flce_loss(hidden, labels, shift=shift, token_weight=token_weight.flatten())
    with pytest.raises(TypeError, match="token_weight must be a tensor"):
        model.flce_loss(hidden, labels, shift=shift, token_weight=token_weight.tolist())
    with pytest.raises(TypeError, match="token_weight must be floating point"):
        model.flce_loss(hidden, labels, shift=shift, token_weight=labels)


def test_logits_precision_option_reaches_the_op():
    """bf16 operands: "input" rounds each logit to bf16 (here 1.5e-4 relative in the loss), "fp32_head" computes
    them in fp32 from the same bf16 operands (1e-8 from the float64 reference of those operands)."""
    with pytest.raises(ValueError, match="^flce_logits_precision must be one of"):
        tiny_gpt(flce_logits_precision="fp64")
    hidden = (torch.randn(4, SEQ, HIDDEN) * 3).bfloat16()
    labels, _ = weights_and_labels((4, SEQ))
    errors = {}
    for precision in ("input", "fp32_head"):
        model = tiny_gpt(tie_embeddings=False, flce_logits_precision=precision, flce_impl="torch").bfloat16()
        assert model.flce_options.logits_precision == precision
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)
            loss = model.flce_loss(hidden, labels)
            logits = F.linear(hidden.double(), model.lm_head.weight.double())
            expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        errors[precision] = abs(loss.double().item() - expected.item()) / expected.item()
    assert errors["fp32_head"] < 1e-6 and errors["input"] > 100 * errors["fp32_head"]


def test_the_loss_options_are_one_record():
    """FLCEHeadLoss and FLCEMixin carry one FLCEOptions record (copied and pickled with the module); the
    attributes of the option names read it, and the mixin's options fill its fields."""
    head_loss = FLCEHeadLoss(
        ignore_index=-1, label_smoothing=0.1, lse_square_scale=1e-3, accum_dtype="float32", chunk_size=64
    )
    assert head_loss.options == FLCEOptions(
        ignore_index=-1, label_smoothing=0.1, lse_square_scale=1e-3, accum_dtype=torch.float32, chunk_size=64
    )
    assert (head_loss.ignore_index, head_loss.label_smoothing, head_loss.lse_square_scale) == (-1, 0.1, 1e-3)
    assert head_loss.accum_dtype is torch.float32 and head_loss.chunk_size == 64 and head_loss.impl == "auto"
    with pytest.raises(AttributeError):
        head_loss.lse_square_scale = 0.5  # read-only: the record is the one copy
    assert FLCEHeadLoss.from_options(head_loss.options).options is head_loss.options
    with pytest.raises(TypeError, match="FLCEOptions record"):
        FLCEHeadLoss.from_options({"ignore_index": -1})

    model = tiny_gpt(
        flce_lse_square_scale=1e-3, flce_softcap=30.0, flce_logits_precision="fp32", flce_ignore_index=-1
    )
    assert model.flce_options is model.flce_head_loss.options
    assert model.flce_options._replace(lse_square_scale=0.0, softcap=None, logits_precision="input") == (
        FLCEOptions(ignore_index=-1)
    )
    assert (model.flce_ignore_index, model.flce_softcap, model.flce_normalize) == (-1, 30.0, "step")
    assert pickle.loads(pickle.dumps(model)).flce_options == model.flce_options
    assert copy.deepcopy(model).flce_options == model.flce_options
