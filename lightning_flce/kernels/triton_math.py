"""Triton device functions shared by the kernels (the cross-entropy chunk and vocab-parallel shard kernels, the
log-probability kernels, the compensated GEMM's epilogue): exp and log (precise for fp32 logits), one step of the
online log-sum-exp, and the logit transform ``z = softcap(r) / T`` with its derivative, written once here
(:func:`transform_logits`, :func:`load_transformed`, :func:`transform_backward`; the PyTorch twins' pair is
:mod:`~lightning_flce.kernels.transform_torch`)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def tanh(x):
    # exp-based tanh (portable, interpreter included; exact at both tails: exp -> inf gives 1), and an odd
    # Taylor polynomial near 0, where 1 - 2 / (exp(2x) + 1) cancels: a large softcap c puts z / c there,
    # and c * tanh(z / c) would inherit an absolute error of ~1e-7 c. Terms to x^11: < 1e-9 relative at 0.3.
    x2 = x * x
    poly = x * (
        1.0
        + x2
        * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315 + x2 * (62.0 / 2835 + x2 * (-1382.0 / 155925)))))
    )
    return tl.where(tl.abs(x) < 0.3, poly, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


_LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp(x, PRECISE: tl.constexpr, FAST: tl.constexpr = False):
    # tl.exp is ex2.approx on an argument scaled by log2(e): fine for 16-bit logits, but for fp32 it
    # makes the gradient measurably less accurate than torch's. libdevice is not in the interpreter.
    # FAST (a GPU kernel's per-element exps of 16-bit logits): ex2.approx.ftz, one MUFU.EX2 where tl.exp adds
    # three instructions that keep results under 2^-126 (1e-38) from flushing to 0; no inline PTX in the
    # interpreter, so a CUDA-only flag.
    if PRECISE:
        return libdevice.exp(x)
    elif FAST:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * _LOG2_E], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp(x)


@triton.jit
def online_lse_step(z, m, d, PRECISE: tl.constexpr, FAST: tl.constexpr = False):
    """One block ``z`` of a row's online log-sum-exp: from the running max ``m`` and ``d = sum(exp(z - m))``,
    returns the new ``(m, d)``, the block's ``exp(z - m_new)``, the factor ``exp(m - m_new)`` that carries
    earlier sums over, and the block's max."""
    block_max = tl.max(z, 0)
    m_new = tl.maximum(m, block_max)
    # Exponents relative to 0 until a finite logit shows up (exp(-inf - -inf) is NaN): a row may start with a
    # block masked to -inf (a bias mask, a padded vocabulary).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = exp(m - m_ref, PRECISE, FAST)
    e = exp(z - m_ref, PRECISE, FAST)
    return m_new, d * rescale + tl.sum(e, 0), e, rescale, block_max


@triton.jit
def log(x, PRECISE: tl.constexpr):
    # tl.log, a polynomial of about 25 instructions, even in a kernel's per-element loop: lg2.approx (one
    # MUFU.LG2) on an arbitrary x was measured to raise the JSD loss's error at V = 256000 from 1.02x to 1.13x
    # the unfused bf16 loss's (its error is relative, about 2 ulp of |log2 x|, where this log's is about an ulp
    # of the result); docs/distill.md. A per-element log of a sum of two exps is :func:`log_add_exp`.
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


_LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def log_add_exp(a, b, PRECISE: tl.constexpr, FAST: tl.constexpr = False):
    """``log(exp(a) + exp(b))`` as ``max(a, b) + log(1 + exp(-|a - b|))``, for a or b finite (the other may be
    -inf). The log's argument lies in [1, 2], where ``lg2.approx`` has an absolute error of at most 2^-22 (CUDA's
    ``__log2f``): so with FAST (a GPU kernel's per-element math on 16-bit logits) it takes one MUFU.EX2 and one
    MUFU.LG2 and is as accurate as ``tl.log`` of the sum, whose polynomial it replaces."""
    hi = tl.maximum(a, b)
    e = exp(tl.minimum(a, b) - hi, PRECISE, FAST)
    if PRECISE:
        return hi + libdevice.log1p(e)
    elif FAST:
        log2_sum = tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
        )
        return hi + log2_sum * _LN_2
    else:
        return hi + tl.log(1.0 + e)


@triton.jit
def transform_logits(
    r, mask, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr, HAS_TEMPERATURE: tl.constexpr
):
    """The logit transform of every kernel, on fp32 logits ``r``: ``(z, capped)`` with ``capped = c tanh(r / c)``
    (``r`` itself without HAS_SOFTCAP), -inf where ``mask`` is False (tanh(-inf) is -1, not -inf; True for a value
    that needs no re-mask), and ``z = capped / T`` (``capped`` itself without HAS_TEMPERATURE; ``inv_temperature``
    is 1 / T). The flags are constexpr: a kernel without a softcap or a temperature compiles none of it."""
    capped = r
    if HAS_SOFTCAP:
        capped = tl.where(mask, softcap * tanh(r / softcap), float("-inf"))
    z = capped
    if HAS_TEMPERATURE:
        z = capped * inv_temperature
    return z, capped


@triton.jit
def load_transformed(
    row_ptr,
    cols,
    mask,
    softcap,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr = True,
):
    """A block of a row's logits through :func:`transform_logits`: ``(z, capped)``, -inf at masked lanes (the
    capped values are what :func:`transform_backward` needs). Kernels without a temperature (the cross-entropy's)
    pass ``HAS_TEMPERATURE=False``."""
    r = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    return transform_logits(r, mask, softcap, inv_temperature, HAS_SOFTCAP, HAS_TEMPERATURE)


@triton.jit
def transform_backward(
    grad_z,
    capped,
    mask,
    softcap,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr = True,
):
    """``d/dr`` from ``d/dz`` of :func:`transform_logits`: times ``1 / T``, then times the softcap's
    ``1 - (softcap(r) / c)^2`` (0 at masked lanes, whose capped value is -inf)."""
    grad = grad_z
    if HAS_TEMPERATURE:
        grad = grad * inv_temperature
    if HAS_SOFTCAP:
        ratio = tl.where(mask, capped, 0.0) / softcap
        grad = grad * (1.0 - ratio * ratio)
    return grad
