"""The autograd-derived chunk loss (:mod:`lightning_flce.losses.autograd`) as the test oracle of the hand-written
ones: the cross-entropy and the policy losses run on the chunk engine both ways, in float64, with ignored rows,
several chunks, a bias, per-token side inputs and a softcap; and as a prototyping path, against the unfused loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_flce.engine import run_chunks, valid_rows
from lightning_flce.kernels import BACKENDS, LossOptions
from lightning_flce.losses.autograd import AutogradChunkLoss
from lightning_flce.losses.cross_entropy import CrossEntropyChunkLoss
from lightning_flce.losses.policy import PolicyChunkLoss, per_token_policy_loss

N, H, V = 37, 16, 53
IGNORE = -100


def _problem(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64) / H**0.5
    bias = torch.randn(V, generator=generator, dtype=torch.float64)
    target = torch.randint(0, V, (N,), generator=generator)
    target[::5] = IGNORE
    return x, weight, bias, target


def _run(loss, x, weight, bias, target, chunk_size=8):
    valid = target != IGNORE
    n_valid = int(valid.sum())
    *outputs, gx, gw, gb, _ = run_chunks(
        x,
        weight,
        torch.where(valid, target, 0),
        bias,
        loss,
        rows=valid_rows(valid, n_valid),
        n_valid=n_valid,
        chunk_size=chunk_size,
        compute_dtype=torch.float64,
        need_grad_input=True,
        need_grad_weight=True,
        need_grad_bias=True,
        accum_dtype=None,
        grad_input_dtype=x.dtype,
    )
    return outputs, (gx, gw, gb)


def _capped(logits, softcap):
    return softcap * torch.tanh(logits / softcap) if softcap else logits


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_cross_entropy_kernel_matches_autograd_of_its_formula(softcap):
    x, weight, bias, target = _problem()
    token_weight = torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    kernel = CrossEntropyChunkLoss(
        BACKENDS["torch"].kernels().cross_entropy_chunk,
        LossOptions(ignore_index=IGNORE, softcap=softcap, lse_square_scale=1e-2),
        ce_scale=token_weight,
        z_scale=token_weight,
        compute_stats=False,
    )

    def row_loss(logits, t, side):
        z = _capped(logits, softcap)
        lse = torch.logsumexp(z, dim=-1)
        ce = lse - z.gather(1, t[:, None]).squeeze(1)
        return side["w"] * (ce + 1e-2 * lse.square())

    oracle = AutogradChunkLoss(row_loss, side_inputs={"w": token_weight}, linear_inputs=("w",))
    (loss_k, *_), grads_k = _run(kernel, x, weight, bias, target)
    (loss_o,), grads_o = _run(oracle, x, weight, bias, target)
    torch.testing.assert_close(loss_k, loss_o, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads_k, grads_o):
        torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-12)
    assert loss_o[target == IGNORE].eq(0).all() and grads_o[0][target == IGNORE].eq(0).all()


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_policy_loss_kernel_matches_autograd_of_its_formula(loss_type, softcap):
    x, weight, bias, target = _problem(seed=2)
    generator = torch.Generator().manual_seed(3)
    advantages = torch.randn(N, dtype=torch.float64, generator=generator)
    old = -3.0 - torch.rand(N, dtype=torch.float64, generator=generator)
    ref = -3.0 - torch.rand(N, dtype=torch.float64, generator=generator)
    inv_temperature = 1.0 / (0.5 + torch.rand(N, dtype=torch.float64, generator=generator))
    token_scale = torch.rand(N, dtype=torch.float64, generator=generator)
    terms = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=0.04, entropy_coef=0.01)
    kernel = PolicyChunkLoss(
        BACKENDS["torch"].kernels(),
        inv_temperature=inv_temperature,
        softcap=softcap,
        with_entropy=True,
        vocab=V,
        advantages=advantages,
        token_scale=token_scale,
        old_logprobs=old,
        ref_logprobs=ref,
        **terms,
    )

    def row_loss(logits, t, side):
        log_probs = torch.log_softmax(_capped(logits, softcap) * side["inv_t"][:, None], dim=-1)
        logprobs = log_probs.gather(1, t[:, None]).squeeze(1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        per_token = per_token_policy_loss(logprobs, entropy, side["a"], side["old"], side["ref"], **terms)
        return side["scale"] * per_token, logprobs, entropy

    side = {"inv_t": inv_temperature, "a": advantages, "old": old, "ref": ref, "scale": token_scale}
    oracle = AutogradChunkLoss(row_loss, side_inputs=side, extra_outputs=("logprobs", "entropy"))
    (logprobs_k, entropy_k, loss_k), grads_k = _run(kernel, x, weight, bias, target, chunk_size=16)
    (loss_o, logprobs_o, entropy_o), grads_o = _run(oracle, x, weight, bias, target, chunk_size=16)
    for got, expected in [(loss_k, loss_o), (logprobs_k, logprobs_o), (entropy_k, entropy_o)]:
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads_k, grads_o):
        torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-12)


def test_prototype_loss_matches_the_unfused_loss():
    """A loss with no kernel (a focal loss) on the engine equals autograd through the unfused logits."""
    x, weight, bias, target = _problem(seed=4)
    gamma = 2.0

    def focal(logits, t, side):
        log_p = torch.log_softmax(logits, dim=-1).gather(1, t[:, None]).squeeze(1)
        return -((1 - log_p.exp()) ** gamma) * log_p

    (loss,), (gx, gw, gb) = _run(AutogradChunkLoss(focal), x, weight, bias, target, chunk_size=5)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    valid = target != IGNORE
    unfused = focal(F.linear(leaves[0], leaves[1], leaves[2])[valid], target[valid], {})
    unfused.sum().backward()
    torch.testing.assert_close(loss[valid], unfused.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip((gx, gw, gb), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-11, atol=1e-12)


def test_bad_row_loss_and_fp16_are_refused():
    x, weight, bias, target = _problem()
    with pytest.raises(ValueError, match="one value per row"):
        _run(AutogradChunkLoss(lambda logits, t, side: logits.sum(-1, keepdim=True)), x, weight, bias, target)
    with pytest.raises(ValueError, match="extra output"):
        _run(
            AutogradChunkLoss(lambda logits, t, side: logits.sum(-1), extra_outputs=("a",)),
            x,
            weight,
            bias,
            target,
        )
    with pytest.raises(NotImplementedError, match="fp16"):
        AutogradChunkLoss(lambda logits, t, side: logits.sum(-1)).fp16_logit_grad_bound()
