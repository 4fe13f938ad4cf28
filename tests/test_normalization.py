"""StepNormalizer and UnweightedTermWatch without a Trainer: the arithmetic of flce_normalize="step"."""

import pytest
import torch

from lightning_flce.normalization import (
    StepNormalizer,
    UnweightedTermWatch,
    power_of_two_at_least,
    scale_gradients,
)

IGNORE = -100


def token_losses(weight, features, labels):
    """Per-token cross-entropy of a linear model, 0 for ignored labels (float64)."""
    return torch.nn.functional.cross_entropy(
        features @ weight.T, labels, ignore_index=IGNORE, reduction="none"
    )


def micro_batches(seed=0):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for size, ignored in ((3, 2), (7, 0), (5, 5)):  # the last one has no token at all
        features = torch.randn(size, 4, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, 6, (size,), generator=generator)
        labels[:ignored] = IGNORE
        batches.append((features, labels))
    return batches


@pytest.mark.parametrize("fp16_gradients", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_rescaled_gradient_is_the_token_mean_of_the_step(fp16_gradients, world_size):
    """Lightning divides each micro-batch loss by the accumulation and DDP averages over the ranks; after the
    rescaling the gradient is that of the token mean over every micro-batch of every rank. Two ranks are
    simulated as identical copies (their sum is twice the totals, their average the same gradient)."""
    batches = micro_batches()
    weight = torch.randn(
        6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True
    )
    normalizer = StepNormalizer("step")
    normalizer.start_fit(fp16_gradients=fp16_gradients)
    assert normalizer.needs_divisor == fp16_gradients
    if fp16_gradients:
        normalizer.agree_first_divisor(batches[0][1].numel(), lambda size: size)  # the ranks' mean: 3 -> 4
        assert normalizer.grad_divisor == 4.0
    accumulation = len(batches)
    for features, labels in batches:
        losses = token_losses(weight, features, labels)
        num_tokens = (labels != IGNORE).sum()
        normalizer.count(losses.sum(), num_tokens)
        loss, loss_weight = normalizer.loss_to_backward(losses.sum(), num_tokens)
        torch.testing.assert_close(
            loss, losses.sum() / num_tokens.clamp(min=1)
        )  # value: the micro-batch mean
        torch.testing.assert_close(loss_weight, num_tokens.float() / normalizer.grad_divisor)
        (loss / accumulation).backward()  # what Lightning back-propagates (the ranks' average: the same)
        normalizer.commit(step=0)
    finished = normalizer.finish(
        world_size=world_size,
        accumulation=accumulation,
        fp16_gradients=fp16_gradients,
        sum_over_ranks=lambda totals: totals * world_size,
    )
    scale_gradients([weight], finished.grad_scale)

    features = torch.cat([f for f, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    expected_weight = weight.detach().clone().requires_grad_()
    mean = token_losses(expected_weight, features, labels).sum() / (labels != IGNORE).sum()
    mean.backward()
    torch.testing.assert_close(weight.grad, expected_weight.grad, rtol=1e-12, atol=1e-14)
    assert finished.mean_loss == pytest.approx(mean.item(), rel=1e-12)
    assert finished.num_tokens == 8 * world_size
    assert normalizer.finish() is None  # done once
    if fp16_gradients:
        # the step's tokens per micro-batch (8 over 3: 2.7 -> 4) do not lower D
        assert normalizer.grad_divisor == 4.0


def test_fp16_divisor_grows_with_the_micro_batches_and_never_falls():
    normalizer = StepNormalizer("step")
    normalizer.start_fit(fp16_gradients=True)
    normalizer.agree_first_divisor(100)
    assert normalizer.grad_divisor == 128.0
    one = torch.ones(())
    for tokens, expected in ((300, 512.0), (10, 512.0)):
        normalizer.count(one, torch.tensor(tokens))
        normalizer.commit(step=0)
        normalizer.finish(fp16_gradients=True)
        assert normalizer.grad_divisor == expected
    assert power_of_two_at_least(0.3) == 1.0 and power_of_two_at_least(64) == 64.0


def test_a_skipped_micro_batch_adds_nothing():
    normalizer = StepNormalizer("step")
    normalizer.count(torch.tensor(5.0), torch.tensor(4))
    normalizer.discard_pending()  # training_step returned None: no backward
    assert normalizer.finish() is None
    normalizer.count(torch.tensor(6.0), torch.tensor(3))
    normalizer.commit(step=0)
    finished = normalizer.finish(accumulation=2)
    assert (
        finished.mean_loss == 2.0 and finished.num_tokens == 3 and finished.grad_scale == pytest.approx(2 / 3)
    )


def test_a_step_that_was_never_finished_raises_under_step_and_is_dropped_under_micro_batch():
    for mode in ("step", "micro_batch"):
        normalizer = StepNormalizer(mode)
        normalizer.add(torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64), step=0)
        if mode == "step":
            with pytest.raises(RuntimeError, match="must call super"):
                normalizer.add(torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64), step=1)
        else:
            normalizer.add(torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64), step=1)
            finished = normalizer.finish()
            assert finished == (3.0, 1.0, None)  # only the new step; no rescaling under micro_batch


def test_micro_batch_mode_returns_the_plain_mean():
    normalizer = StepNormalizer("micro_batch")
    normalizer.start_fit(fp16_gradients=True)
    assert not normalizer.needs_divisor  # nothing to divide: the loss is a mean already
    loss, loss_weight = normalizer.loss_to_backward(torch.tensor(6.0, requires_grad=True), torch.tensor(3))
    assert loss.item() == 2.0 and loss_weight.item() == 1.0
    with pytest.raises(ValueError, match="mode must be one of"):
        StepNormalizer("batch")


def test_unweighted_term_watch():
    def lm_loss():
        return StepNormalizer("step").loss_to_backward(
            (torch.ones(3, requires_grad=True) * 2).sum(), torch.tensor(3)
        )[0]

    watch = UnweightedTermWatch()
    loss = lm_loss()
    watch.record(loss)
    assert not watch.should_warn(loss / 4)  # Lightning's division by the accumulation: arithmetic only
    loss = lm_loss()
    watch.record(loss)
    watch.mark_weight_read()
    assert not watch.should_warn(loss + torch.ones((), requires_grad=True).exp())  # weighted as documented
    loss = lm_loss()
    watch.record(loss)
    assert watch.should_warn(loss + torch.ones((), requires_grad=True).exp())
    loss = lm_loss()
    watch.record(loss)
    assert not watch.should_warn(loss + torch.ones((), requires_grad=True).exp())  # once
