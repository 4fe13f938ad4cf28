"""The PyTorch pair of the logit transform (lightning_flce.kernels.transform_torch) against float64 autograd:
``z = c tanh(r / c) / T`` and its backward. The Triton pair is exercised through every kernel's tests
(test_triton_interpret.py, test_logprobs.py, test_compensated_gemm.py), which compare the kernels with these twins."""

from __future__ import annotations

import pytest
import torch

from lightning_flce.kernels.transform_torch import transform_backward, transform_slope, transformed_logits

# float64 throughout: the pair's few operations against autograd's, a few ulps apart
TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 0.0, 5.0])
@pytest.mark.parametrize("per_row_temperature", [None, False, True])
def test_pair_matches_autograd(softcap, per_row_temperature):
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 4, 33
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 10
    grad_z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    if per_row_temperature is None:
        inv_temperature = None
    else:
        shape = (rows,) if per_row_temperature else (1,)
        inv_temperature = 0.5 + torch.rand(shape, generator=gen, dtype=torch.float64)

    leaf = logits.clone().requires_grad_(True)
    want = leaf if not softcap else softcap * torch.tanh(leaf / softcap)
    if inv_temperature is not None:
        want = want * inv_temperature.reshape(-1, 1)
    (want_grad,) = torch.autograd.grad(want, leaf, grad_z)

    z, capped = transformed_logits(logits, softcap, inv_temperature)
    torch.testing.assert_close(z, want.detach(), **TOL)
    grad = transform_backward(grad_z.clone(), transform_slope(capped, softcap), inv_temperature)
    torch.testing.assert_close(grad, want_grad, **TOL)
    if not softcap and inv_temperature is None:
        assert z is logits and capped is logits  # off: no operation, the input itself


def test_autograd_through_the_softcap():
    """The head's reference path differentiates through transformed_logits: its in-place multiply must not touch
    the tanh output that autograd saved."""
    logits = torch.randn(3, 17, dtype=torch.float64, requires_grad=True)
    z, _ = transformed_logits(logits, 4.0)
    (grad,) = torch.autograd.grad(z.sum(), logits)
    torch.testing.assert_close(grad, 1.0 - torch.tanh(logits.detach() / 4.0).square(), **TOL)
