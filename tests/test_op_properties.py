"""Property-based tests: the op equals its float64 definition on any small valid problem."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import grads_of, reference_loss

from lightning_flce import fused_linear_cross_entropy


@st.composite
def problems(draw):
    n_rows = draw(st.integers(0, 40))
    hidden = draw(st.integers(1, 24))
    vocab = draw(st.integers(2, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    ignore_frac = draw(st.sampled_from([0.0, 0.3, 1.0]))
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    target[torch.rand(n_rows, generator=gen) < ignore_frac] = -100
    options = {
        "reduction": draw(st.sampled_from(["mean", "sum", "none"])),
        "label_smoothing": draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
        "lse_square_scale": draw(st.sampled_from([0.0, 1e-3])),
        "softcap": draw(st.sampled_from([None, 1.0, 15.0])),
        "class_weight": (torch.rand(vocab, generator=gen) + 0.1) if draw(st.booleans()) else None,
    }
    chunk_size = draw(st.one_of(st.none(), st.integers(1, 50)))
    x = torch.randn(n_rows, hidden, generator=gen) * draw(st.sampled_from([0.1, 1.0, 4.0]))
    weight = torch.randn(vocab, hidden, generator=gen)
    bias = torch.randn(vocab, generator=gen) if draw(st.booleans()) else None
    return x, weight, target, bias, options, chunk_size


# The op's error on each value against the float64 definition, in units of fp32's epsilon times the size of
# what that value is computed from (error_scales): the forward rounds sums over H <= 24 (the logits) and
# V <= 300 (the LSE), the backward over V (dX) and N <= 40 (dW, d bias), whose worst-case bounds grow like
# the number of terms, in practice like its square root. Measured over 1500 examples: at most 3.5. A wrong
# term moves a value by a fraction of these sizes (a z-loss of lambda = 1e-3 missed: ~1e-3 of them), far
# above 16 epsilons (checked: a dropped z-loss, smoothing scaled by 0.9, a softcap 1% off all fail).
ERROR_TOL = 16 * torch.finfo(torch.float32).eps


def error_scales(x, weight, bias, target, options, grad_output):
    """Float64 sizes that fp32's rounding errors on the loss and on dX, dW, d bias scale with, elementwise
    (the loss's shape; each gradient's): not the values themselves, which may cancel to ~0 (a target
    predicted with certainty, a gradient p - onehot), but the terms they are differences of. Then the
    gradients' absolute floors, for fp32's underflow.

    Per token: the logits' GEMM sums |x| |w| + |b|, and the LSE, bound what its loss subtracts (m); its CE
    term's weight is bounded by the largest class weight (over the reduction's normalizer for "mean"), the
    z-loss term's by lambda |lse|. Per logit, the gradient p - q (plus the z-loss term 2 lambda lse p) is
    rounded where p, moved by the logits' rounding (p m), and q (the one-hot and the smoothing's eps / V)
    are summed; dX, dW and d bias sum those sizes through |W|, |X| and the rows, as the GEMMs do."""
    x, weight = x.detach().double(), weight.detach().double()
    bias = bias.detach().double() if bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
    logits = x @ weight.T + bias
    if options["softcap"]:  # tanh's slope is at most 1: the GEMM's rounding passes through, not grown
        logits = options["softcap"] * torch.tanh(logits / options["softcap"])
    lse = torch.logsumexp(logits, dim=-1)
    m = (x.abs() @ weight.abs().T + bias.abs()).amax(dim=-1) + lse.abs()
    valid = (target != -100).double()
    class_weight = options["class_weight"]
    ce_weight = float(class_weight.max()) if class_weight is not None else 1.0
    z_weight = 1.0
    if options["reduction"] == "mean":  # some target is valid: the all-ignored case is checked apart
        count = valid.sum()
        safe_target = torch.where(valid.bool(), target, 0)
        norm = (class_weight.double()[safe_target] * valid).sum() if class_weight is not None else count
        ce_weight, z_weight = ce_weight / norm, 1.0 / count
    lam = options["lse_square_scale"]
    per_token = (ce_weight + z_weight * lam * lse.abs()) * m * valid
    loss_scale = per_token if options["reduction"] == "none" else per_token.sum()

    p = torch.softmax(logits, dim=-1)
    onehot = torch.nn.functional.one_hot(torch.where(valid.bool(), target, 0), p.shape[-1]).double()
    row = (ce_weight + 2 * z_weight * lam * (1 + lse.abs())) * valid * grad_output.double().abs()
    logit_scale = row[:, None] * (p * (1 + m[:, None]) + onehot + options["label_smoothing"] / p.shape[-1])
    # fp32 has no normal number below `tiny` (1.2e-38): a probability under it may come out as 0 (the CPU's
    # vectorized exp flushes it; seen: p = 4e-43 at a logit 97 under the row's log-sum-exp), an absolute error of
    # up to `tiny` times the row's factor per logit that no relative tolerance covers; the GEMMs carry it on as
    # they carry the logits' gradient
    underflow = row[:, None] * torch.finfo(torch.float32).tiny * torch.ones_like(p)
    return (
        loss_scale,
        [logit_scale @ weight.abs(), logit_scale.T @ x.abs(), logit_scale.sum(dim=0)],
        [underflow @ weight.abs(), underflow.T @ x.abs(), underflow.sum(dim=0)],
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_op_equals_definition(problem):
    x, weight, target, bias, options, chunk_size = problem
    grad_output = torch.randn(target.shape) if options["reduction"] == "none" else torch.tensor(0.9)
    loss, grads = grads_of(
        lambda a, b, c: fused_linear_cross_entropy(a, b, target, c, chunk_size=chunk_size, **options),
        x.requires_grad_(),
        weight.requires_grad_(),
        bias.requires_grad_() if bias is not None else None,
        grad_output=grad_output,
    )
    ref_loss, ref_grads = grads_of(
        lambda a, b, c: reference_loss(a, b, target, c, **options),
        x.double().requires_grad_(),
        weight.double().requires_grad_(),
        bias.double().requires_grad_() if bias is not None else None,
        grad_output=grad_output,
    )
    # The definition's "mean" over zero valid tokens is NaN; the op documents 0.
    if options["reduction"] == "mean" and not (target != -100).any():
        assert loss.item() == 0.0
        assert all(g is None or torch.all(g == 0) for g in grads)
        return
    loss_scale, grad_scales, floors = error_scales(x, weight, bias, target, options, grad_output)
    # elementwise; where a scale is 0 (an ignored token) the op must be exactly the definition's 0
    loss_error = (loss.double() - ref_loss).abs()
    assert torch.all(loss_error <= ERROR_TOL * loss_scale), float(
        (loss_error / loss_scale).nan_to_num().max()
    )
    for name, got, want, scale, floor in zip(["dX", "dW", "d bias"], grads, ref_grads, grad_scales, floors):
        if want is not None:
            error = (got.double() - want).abs()
            bound = ERROR_TOL * scale + floor
            assert torch.all(error <= bound), (name, float((error / bound).nan_to_num().max()))
