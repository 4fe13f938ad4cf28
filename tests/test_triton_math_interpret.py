"""Device functions of :mod:`lightning_flce.kernels.triton_math` in Triton's interpreter, against float64.

    TRITON_INTERPRET=1 pytest -m interpret tests/test_triton_math_interpret.py

``log_add_exp`` is JSD's log M in the distillation kernel (``log q + log beta`` and ``log p + log(1 - beta)``):
its inputs there are clamped log-probabilities (>= -10000) plus a log-weight (possibly -inf for a weight of 0
in a direct call). The interpreter takes its portable branch (``tl.exp``, ``tl.log``); the GPU's FAST branch
(``ex2.approx`` / ``lg2.approx`` by inline PTX) is the same formula, compiled for sm_90 by test_gpu_compile.py
and timed and checked against float64 on CUDA (tests/test_distill_cuda.py).

Tolerance: the result is ``max(a, b) + log1p(exp(-|a - b|))`` in fp32: the log term is in [0, log 2] with an
error of a few units of 2^-24, and the final addition rounds to half an ulp of the result; 4 ulp of the
result plus 1e-7 absolute bounds both.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lightning_flce.kernels.triton_math import log_add_exp

pytestmark = pytest.mark.interpret


@triton.jit
def _log_add_exp_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0)
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, log_add_exp(a, b, False), mask=mask)


def _log_add_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(a)
    block = 64
    _log_add_exp_kernel[(triton.cdiv(a.numel(), block),)](a, b, out, a.numel(), BLOCK=block)
    return out


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    got = _log_add_exp(a, b).double()
    want = torch.logaddexp(a.double(), b.double())
    ulp = torch.finfo(torch.float32).eps * want.abs()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    error = (got - want)[finite].abs()
    bound = (4 * ulp + 1e-7)[finite]
    assert (error <= bound).all(), (
        f"max error {error.max():.3g}, worst over bound {(error / bound).max():.3g}"
    )


def test_log_add_exp_against_float64_over_log_probability_ranges():
    gen = torch.Generator().manual_seed(0)
    # log-probabilities of 128K-256K vocabularies (down to about -40) plus log-weights, and gaps up to 120
    a = -40.0 * torch.rand(4096, generator=gen) + torch.log(torch.tensor(0.5))
    b = a + 120.0 * (torch.rand(4096, generator=gen) - 0.5)
    _check(a, b)
    _check(b, a)  # symmetric


def test_log_add_exp_at_ties_clamps_and_a_zero_weight():
    # ties (log 2 exactly added), the kernel's clamp at -10000 on one or both sides, gaps where exp underflows,
    # and -inf (a weight of 0: log beta with beta = 0) on one side, where the result is the other side exactly
    a = torch.tensor(
        [0.0, -3.5, -10000.0, -10000.0, -5.0, -20.0, float("-inf"), -7.25, -200.0], dtype=torch.float32
    )
    b = torch.tensor([0.0, -3.5, -2.0, -10000.0, -105.0, -20.0 - 1e-6, -1.5, float("-inf"), -0.001])
    _check(a, b)
    got = _log_add_exp(a, b)
    assert got[6] == -1.5 and got[7] == -7.25  # a -inf side adds exactly nothing
