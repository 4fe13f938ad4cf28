"""The Triton kernels on the CPU through Triton's interpreter.

Run as a separate invocation, since the variable must be set before triton is imported:

    TRITON_INTERPRET=1 pytest -m interpret

Shapes stay near 128 tokens x 64 hidden x 1000 vocab (about a second per call in the interpreter).
Tolerances as in test_op.py: fp32 within 1e-5 relative of float64, fp64 within 1e-12.
"""

from __future__ import annotations

import pytest
import torch
from reference import assert_matches_reference, grads_of, reference_loss, relative_error
from test_op import FEATURES, FP64_TOL, make_problem

from lightning_flce import fused_linear_cross_entropy, fused_linear_cross_entropy_with_stats
from lightning_flce.kernels import LossOptions

pytestmark = pytest.mark.interpret

FP32_TOL = 1e-5


# test_op.FEATURES' names that are no option of the chunk kernel (it starts from the logits): the bias is
# added by the logits' GEMM. Every other feature must name a LossOptions field (checked by _options).
NOT_CHUNK_KERNEL_OPTIONS = {"bias"}
# LossOptions fields that no feature needs to set: every problem here has ignored (-100) targets, and
# class_weight_sum is derived from class_weight.
ALWAYS_EXERCISED_OR_DERIVED = {"ignore_index", "class_weight_sum"}


def _options(feature, vocab, gen):
    """The chunk kernel's LossOptions of a test_op feature, field by field (a feature that is no field fails:
    a new option must reach the interpreter's tests, or be listed in NOT_CHUNK_KERNEL_OPTIONS)."""
    unmapped = set(feature) - set(LossOptions._fields) - NOT_CHUNK_KERNEL_OPTIONS
    assert not unmapped, f"test_op.FEATURES option(s) {sorted(unmapped)} have no LossOptions field"
    values = {name: value for name, value in feature.items() if name in LossOptions._fields}
    if values.pop("class_weight", False):  # FEATURES flags it; the values are drawn here
        class_weight = torch.rand(vocab, generator=gen) + 0.5
        values.update(class_weight=class_weight, class_weight_sum=class_weight.sum().reshape(1))
    if values.get("softcap", 0.0) is None:  # the op's "off"; the kernel's is 0.0
        values["softcap"] = 0.0
    return LossOptions(**values)


def test_features_cover_the_chunk_kernel_options():
    """Every LossOptions field is set (away from its default) by some test_op feature, or always exercised;
    with _options' check that every feature maps to a field, an option added on either side cannot go
    untested in the interpreter."""
    gen = torch.Generator().manual_seed(0)
    covered = set()
    for feature in FEATURES.values():
        options = _options(feature, 10, gen)
        for name, default in LossOptions._field_defaults.items():
            value = getattr(options, name)
            is_default = value is default if isinstance(value, torch.Tensor) else value == default
            if not is_default:
                covered.add(name)
    missing = set(LossOptions._fields) - covered - ALWAYS_EXERCISED_OR_DERIVED
    assert not missing, f"LossOptions field(s) {sorted(missing)} set by no feature of test_op.FEATURES"


@pytest.mark.parametrize("feature_name", list(FEATURES))
@pytest.mark.parametrize("per_row_scale", [False, True])
def test_kernel_matches_torch_twin(feature_name, per_row_scale):
    """The Triton chunk kernel and its PyTorch twin agree on loss, LSE, stats and gradient."""
    from lightning_flce.kernels.cross_entropy import cross_entropy_chunk_triton
    from lightning_flce.kernels.cross_entropy_torch import cross_entropy_chunk_torch

    gen = torch.Generator().manual_seed(0)
    n_rows, vocab = 48, 1000
    options = _options(FEATURES[feature_name], vocab, gen)
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    target[::7] = -100
    if per_row_scale:
        ce_scale, z_scale = torch.randn(n_rows, generator=gen), torch.randn(n_rows, generator=gen)
    else:
        ce_scale, z_scale = torch.tensor([0.3]), torch.tensor([0.6])
    kwargs = {"ce_scale": ce_scale, "z_scale": z_scale, "compute_grad": True, "compute_stats": True}
    grad_triton, grad_torch = logits.clone(), logits.clone()
    out_triton = cross_entropy_chunk_triton(grad_triton, target, options, **kwargs)
    out_torch = cross_entropy_chunk_torch(grad_torch, target, options, **kwargs)
    torch.testing.assert_close(out_triton.loss, out_torch.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_triton.lse, out_torch.lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_triton.entropy, out_torch.entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(out_triton.correct, out_torch.correct)
    assert relative_error(grad_triton, grad_torch) < 1e-5
    assert torch.all(grad_triton[target == -100] == 0)


@pytest.mark.parametrize("feature_name", ["plain", "all", "smoothing+class_weight"])
def test_kernel_multi_block_rows(feature_name):
    """Rows spanning several loop iterations (4 blocks of 256, the last partial; the default launch puts
    these small rows in one block): same results as the twin, targets in the first and the last block,
    argmax ties resolved to the first maximum across blocks (a maximum repeated in a later block)."""
    from lightning_flce.kernels.cross_entropy import LaunchConfig, cross_entropy_chunk_triton
    from lightning_flce.kernels.cross_entropy_torch import cross_entropy_chunk_torch

    gen = torch.Generator().manual_seed(1)
    n_rows, vocab = 24, 1000
    options = _options(FEATURES[feature_name], vocab, gen)
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    logits[:, 900] = logits[:, 100] = 20.0  # tie across the first and last block
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    target[::5] = -100
    target[1], target[2] = 100, 900
    kwargs = {"ce_scale": torch.tensor([0.3]), "z_scale": torch.tensor([0.6])}
    kwargs.update(compute_grad=True, compute_stats=True)
    grad_triton, grad_torch = logits.clone(), logits.clone()
    config = LaunchConfig(256, 4)
    out_triton = cross_entropy_chunk_triton(grad_triton, target, options, config=config, **kwargs)
    out_torch = cross_entropy_chunk_torch(grad_torch, target, options, **kwargs)
    torch.testing.assert_close(out_triton.loss, out_torch.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_triton.lse, out_torch.lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_triton.entropy, out_torch.entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(out_triton.correct, out_torch.correct)
    assert out_triton.correct[1] and not out_triton.correct[2]
    assert relative_error(grad_triton, grad_torch) < 1e-5
    assert torch.all(grad_triton[target == -100] == 0)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_v", [256, None], ids=["4-blocks", "1-block"])
@pytest.mark.parametrize("feature_name", ["plain", "all", "smoothing+class_weight"])
def test_kernel_gradient_in_logits_rows(feature_name, block_v, grad_dtype):
    """The 16-bit gradient of fp32 logits written into each row's second half (gradient_in_logits_rows: the
    wide-logits path's one buffer): the same loss, LSE and statistics, and bit for bit the same gradient, as
    with a separate 16-bit buffer. Rows of 4 blocks (the last partial, targets in the first and the last)
    and of one: the pass that writes must read every block before its bytes are overwritten, which a
    layout in the rows' first halves, or a forward pass, would not (values overwritten before they are
    read change the result here)."""
    from lightning_flce.kernels import gradient_in_logits_rows
    from lightning_flce.kernels.cross_entropy import LaunchConfig, cross_entropy_chunk_triton

    gen = torch.Generator().manual_seed(4)
    n_rows, vocab = 24, 1000
    options = _options(FEATURES[feature_name], vocab, gen)
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    target = torch.randint(0, vocab, (n_rows,), generator=gen)
    target[::5] = -100
    target[1], target[2] = 3, 990
    kwargs = {"ce_scale": torch.tensor([0.3]), "z_scale": torch.tensor([0.6])}
    kwargs.update(compute_grad=True, compute_stats=True)
    if block_v is not None:
        kwargs["config"] = LaunchConfig(block_v, 4)
    separate = torch.full((n_rows, vocab), float("nan"), dtype=grad_dtype)
    want = cross_entropy_chunk_triton(logits.clone(), target, options, grad_out=separate, **kwargs)
    in_rows = logits.clone()
    grad = gradient_in_logits_rows(in_rows, grad_dtype)
    got = cross_entropy_chunk_triton(in_rows, target, options, grad_out=grad, **kwargs)
    for name in ("loss", "lse", "entropy", "correct"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(grad, separate)


@pytest.mark.parametrize("softcap", [3.0, 1e3, 1e5, 1e7])
def test_kernel_softcap_accuracy_at_any_cap(softcap):
    """c tanh(z / c) for caps far above the logits (z / c near 0, where an exp-based tanh cancels) and near
    them: loss, LSE and gradient as the PyTorch twin's (torch.tanh)."""
    from lightning_flce.kernels.cross_entropy import cross_entropy_chunk_triton
    from lightning_flce.kernels.cross_entropy_torch import cross_entropy_chunk_torch

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(16, 1000, generator=gen) * 4
    target = torch.randint(0, 1000, (16,), generator=gen)
    options = LossOptions(softcap=softcap)
    kwargs = {"ce_scale": torch.tensor([0.3]), "z_scale": torch.tensor([0.6])}
    kwargs.update(compute_grad=True, compute_stats=False)
    grad_triton, grad_torch = logits.clone(), logits.clone()
    got = cross_entropy_chunk_triton(grad_triton, target, options, **kwargs)
    want = cross_entropy_chunk_torch(grad_torch, target, options, **kwargs)
    assert relative_error(got.loss, want.loss) < 1e-6
    assert relative_error(got.lse, want.lse) < 1e-6
    assert relative_error(grad_triton, grad_torch) < 1e-5


def test_kernels_with_leading_blocks_masked_to_minus_inf():
    """Rows whose first blocks are all -inf (a bias mask, a padded vocabulary): the online softmax must not
    compute exp(-inf - -inf) = NaN. The chunk kernel over 4 blocks of 256 with columns [0, 600) masked, and
    the shard statistics kernel on a shard whose columns are all masked for some rows."""
    from lightning_flce.kernels.cross_entropy import LaunchConfig, cross_entropy_chunk_triton
    from lightning_flce.kernels.cross_entropy_shard import shard_row_stats_triton
    from lightning_flce.kernels.cross_entropy_shard_torch import shard_row_stats_torch
    from lightning_flce.kernels.cross_entropy_torch import cross_entropy_chunk_torch

    gen = torch.Generator().manual_seed(4)
    n_rows, vocab = 12, 1000
    logits = torch.randn(n_rows, vocab, generator=gen) * 3
    logits[:, :600] = float("-inf")
    target = torch.randint(600, vocab, (n_rows,), generator=gen)
    kwargs = {"ce_scale": torch.tensor([0.3]), "z_scale": torch.tensor([0.6])}
    kwargs.update(compute_grad=True, compute_stats=True)
    grad_triton, grad_torch = logits.clone(), logits.clone()
    got = cross_entropy_chunk_triton(
        grad_triton, target, LossOptions(), config=LaunchConfig(256, 4), **kwargs
    )
    want = cross_entropy_chunk_torch(grad_torch, target, LossOptions(), **kwargs)
    assert torch.isfinite(got.loss).all() and torch.isfinite(grad_triton).all()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
    assert relative_error(grad_triton, grad_torch) < 1e-5

    shard = torch.randn(n_rows, 300, generator=gen)
    shard[:4] = float("-inf")  # these rows' logits all live on other shards
    local_target = torch.randint(0, 300, (n_rows,), generator=gen)
    for impl in (shard_row_stats_triton, shard_row_stats_torch):
        stats = impl(shard, local_target, softcap=0.0, with_z_sum=False, with_stats=True)
        assert torch.all(stats.sum_exp[:4] == 0) and torch.all(stats.max[:4] == float("-inf")), impl
        assert torch.all(stats.exp_z_sum[:4] == 0), impl
        assert torch.isfinite(stats.sum_exp).all() and torch.isfinite(stats.exp_z_sum).all(), impl
    twin = shard_row_stats_torch(shard, local_target, softcap=0.0, with_z_sum=False, with_stats=True)
    torch.testing.assert_close(stats.sum_exp, twin.sum_exp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.exp_z_sum, twin.exp_z_sum, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("feature_name", ["plain", "all", "smoothing+class_weight"])
def test_op_triton_path_matches_float64(reduction, feature_name):
    x, weight, target, bias, class_weight = make_problem(128, 64, 1000, seed=11)
    feature = FEATURES[feature_name]
    kwargs = {k: v for k, v in feature.items() if k not in ("bias", "class_weight")}
    b = bias if feature.get("bias") else None
    cw = class_weight if feature.get("class_weight") else None
    grad_output = torch.randn(128) if reduction == "none" else torch.tensor(1.3)
    x.requires_grad_()
    weight.requires_grad_()
    if b is not None:
        b.requires_grad_()

    def op(x_, w_, b_):
        return fused_linear_cross_entropy(
            x_, w_, target, b_, reduction=reduction, class_weight=cw, impl="triton", chunk_size=48, **kwargs
        )

    def ref(x_, w_, b_):
        return reference_loss(x_, w_, target, b_, reduction=reduction, class_weight=cw, **kwargs)

    loss, grads = grads_of(op, x, weight, b, grad_output=grad_output)
    ref_loss, ref_grads = grads_of(
        ref, x.double(), weight.double(), b.double() if b is not None else None, grad_output=grad_output
    )
    assert relative_error(loss, ref_loss) < FP32_TOL
    for got, want in zip(grads, ref_grads):
        if want is not None:
            assert relative_error(got, want) < FP32_TOL


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("logits_precision", ["input", "fp32"])
def test_op_triton_path_token_weight_matches_float64(reduction, logits_precision):
    """Per-token weights (negative and zero ones too) through the Triton kernel's per-row scales, and the
    fp32-logits option (an fp32 logits buffer; the gradient handed to the GEMMs in their dtype)."""
    x, weight, target, bias, class_weight = make_problem(128, 64, 1000, seed=12)
    gen = torch.Generator().manual_seed(3)
    token_weight = torch.rand(128, generator=gen) * 3 - 1
    token_weight[5] = 0.0
    kwargs = {"label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 20.0, "class_weight": class_weight}
    grad_output = torch.randn(128) if reduction == "none" else torch.tensor(1.3)
    x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()

    def op(x_, w_, b_):
        return fused_linear_cross_entropy(
            x_,
            w_,
            target,
            b_,
            reduction=reduction,
            token_weight=token_weight,
            logits_precision=logits_precision,
            impl="triton",
            chunk_size=48,
            **kwargs,
        )

    def ref(x_, w_, b_):
        return reference_loss(
            x_, w_, target, b_, reduction=reduction, token_weight=token_weight.double(), **kwargs
        )

    loss, grads = grads_of(op, x, weight, bias, grad_output=grad_output)
    ref_loss, ref_grads = grads_of(ref, x.double(), weight.double(), bias.double(), grad_output=grad_output)
    assert relative_error(loss, ref_loss) < FP32_TOL
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < FP32_TOL


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_op_triton_impl_runs_fp64_in_fp64(monkeypatch, reduction):
    """fp64 with impl="triton": the fp32-only chunk kernel never runs (the PyTorch twin computes in fp64), and
    backward's grad_output scaling stays fp64 (the scale kernel multiplies fp64 tensors in fp64)."""
    import lightning_flce.kernels.cross_entropy as chunk_kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the fp32 Triton chunk kernel ran on fp64 logits")

    monkeypatch.setattr(chunk_kernel, "cross_entropy_chunk_triton", refuse)
    x, weight, target, bias, class_weight = make_problem(64, 32, 500, dtype=torch.float64, seed=14)
    kwargs = {"reduction": reduction, "class_weight": class_weight.double(), "label_smoothing": 0.1}
    grad_output = torch.randn(64, dtype=torch.float64) if reduction == "none" else torch.tensor(1.3)
    args = (x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_())
    got = grads_of(
        lambda x_, w_, b_: fused_linear_cross_entropy(
            x_, w_, target, b_, impl="triton", chunk_size=24, **kwargs
        ),
        *args,
        grad_output=grad_output,
    )
    want = grads_of(
        lambda x_, w_, b_: reference_loss(x_, w_, target, b_, **kwargs), *args, grad_output=grad_output
    )
    assert_matches_reference(got, want, torch.float64, FP64_TOL)


def test_op_triton_path_bf16_matches_torch_path():
    """bf16 logits in the kernel: loads, fp32 math, bf16 stores of the gradient."""
    x, weight, target, *_ = make_problem(128, 64, 1000, dtype=torch.bfloat16, seed=12)
    results = {}
    for impl in ("triton", "torch"):
        results[impl] = grads_of(
            lambda a, b, impl=impl: fused_linear_cross_entropy(a, b, target, impl=impl, chunk_size=64),
            x.requires_grad_(),
            weight.requires_grad_(),
        )
    (loss_tr, grads_tr), (loss_pt, grads_pt) = results["triton"], results["torch"]
    torch.testing.assert_close(loss_tr, loss_pt, rtol=1e-6, atol=0)
    for got, want in zip(grads_tr, grads_pt):
        assert got.dtype == torch.bfloat16
        # Same fp32 math on the same bf16 logits: at most one bf16 rounding step apart.
        assert relative_error(got, want) < 4e-3


def test_op_triton_stats_and_all_ignored():
    x, weight, target, bias, _ = make_problem(64, 32, 1000, seed=13)
    out = fused_linear_cross_entropy_with_stats(x, weight, target, bias, impl="triton", softcap=8.0)
    ref = fused_linear_cross_entropy_with_stats(x, weight, target, bias, impl="torch", softcap=8.0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.lse, ref.lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.correct, ref.correct)

    target.fill_(-100)
    x.requires_grad_()
    loss = fused_linear_cross_entropy(x, weight, target, impl="triton")
    loss.backward()
    assert loss.item() == 0.0 and torch.all(x.grad == 0)


@pytest.mark.parametrize("scale", [1.0, 0.25, -3.0])
def test_scale_kernel(scale):
    from lightning_flce.kernels.scale import scale_

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        tensor = torch.randn(5000, generator=gen).to(dtype)
        expected = (tensor.float() * scale).to(dtype)
        scale_(tensor, torch.tensor([scale]))
        if dtype == torch.float32 or scale == 1.0:
            assert torch.equal(tensor, expected)
        else:
            # The interpreter truncates fp32 -> bf16 where torch rounds to nearest: within 1 ulp (2^-7).
            torch.testing.assert_close(tensor, expected, rtol=2**-7, atol=0)


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.float64], ids=str)
def test_scale_into_kernel(source_dtype):
    """dW's accumulator cast with the scale folded in: ``out = src * scale`` rounded once."""
    from lightning_flce.kernels.scale import scale_into

    gen = torch.Generator().manual_seed(2)
    src = torch.randn(3, 5000, generator=gen, dtype=source_dtype)
    for dtype in (torch.float16, torch.bfloat16):
        out = scale_into(torch.empty(3, 5000, dtype=dtype), src, torch.tensor([0.7]))
        expected = (src.double() * 0.7).to(dtype)
        # The interpreter truncates to bf16/fp16 where torch rounds to nearest: within 1 ulp.
        torch.testing.assert_close(out, expected, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=0)


@pytest.mark.parametrize(
    ("accum", "final"), [(torch.float32, torch.bfloat16), (torch.float64, torch.float16)]
)
def test_round_into_head_with_the_kernel(monkeypatch, accum, final):
    """dW's rounding into its accumulator's first block through the Triton kernel: each launch reads and writes
    disjoint bytes of the same memory; an overlapping launch would read values already overwritten (O(1) errors),
    where the interpreter's truncation is within one ulp of torch's rounding."""
    import lightning_flce.accumulate as accumulation

    monkeypatch.setattr(accumulation, "_FIRST_SLICE", 1000)  # several launches of 4096-element blocks
    vocab, hidden = 301, 64
    gen = torch.Generator().manual_seed(4)
    full = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64).to(accum)
    accumulator = accumulation.GradWeightAccumulator.empty(
        vocab, hidden, accum, torch.device("cpu"), final_dtype=final
    )
    rows = accumulator.head.shape[0]
    accumulator.head.copy_(full[:rows])
    accumulator.tail.copy_(full[rows:])
    result = accumulation.round_into_head_(accumulator.head, accumulator.tail, final, torch.tensor([0.7]))
    assert result.untyped_storage().data_ptr() == accumulator.head.untyped_storage().data_ptr()
    ulp = torch.finfo(final).eps
    torch.testing.assert_close(result, (full.double() * 0.7).to(final), rtol=ulp, atol=0)


@pytest.mark.parametrize("source_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_scale_into_kernel_widens(source_dtype):
    """dX kept in the GEMM's dtype (fp32 hidden states under autocast), widened with the scale folded in:
    the product of a half-precision value and an fp32 scale, rounded once to fp32, as torch computes it."""
    from lightning_flce.kernels.scale import scale_into

    gen = torch.Generator().manual_seed(3)
    src = torch.randn(3, 5000, generator=gen).to(source_dtype)
    scale = torch.tensor([0.7])
    out = scale_into(torch.empty(3, 5000), src, scale)
    torch.testing.assert_close(out, src.float() * scale, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("feature_name", ["plain", "all"])
def test_fp16_grads_under_a_loss_scale(feature_name, reduction):
    """The Triton kernel's fp16 logit gradients get the op's power-of-two scale (test_fp16_grads.py):
    under a GradScaler-style 2^16 loss scale, dX/dW/db are no worse than the unfused fp16 loss's."""
    from test_fp16_grads import GRAD_SCALER_INIT_SCALE, assert_no_worse, compare

    op_errors, unfused_errors, _ = compare(
        feature_name,
        reduction,
        GRAD_SCALER_INIT_SCALE,
        autocast=False,
        n_rows=512,
        hidden=32,
        vocab=1000,
        impl="triton",
        chunk_size=128,
    )
    assert_no_worse(op_errors, unfused_errors)


def test_fp16_autocast_grads_under_a_loss_scale():
    """fp32 hidden states under fp16 autocast: dX is kept in fp16 carrying its power-of-two scale, and
    backward's widening kernel takes the scale and the loss scale out in fp32."""
    from test_fp16_grads import GRAD_SCALER_INIT_SCALE, assert_no_worse, compare

    op_errors, unfused_errors, grads = compare(
        "all", "mean", GRAD_SCALER_INIT_SCALE, autocast=True, n_rows=512, hidden=32, vocab=1000, impl="triton"
    )
    assert grads[0].dtype == torch.float32
    assert_no_worse(op_errors, unfused_errors)


@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shard_kernels_match_torch_twin(softcap, dtype):
    """The vocab-parallel shard kernels (row statistics, then the gradient from a global LSE) and their
    PyTorch twin agree, with targets on this shard, before it and after it (the shard is columns
    [300, 300 + 700) of a 1200-column vocabulary), and with ties for the row maximum (first index wins)."""
    from lightning_flce.kernels.cross_entropy_shard import shard_row_stats_triton, shard_softmax_grad_triton
    from lightning_flce.kernels.cross_entropy_shard_torch import (
        shard_row_stats_torch,
        shard_softmax_grad_torch,
    )

    gen = torch.Generator().manual_seed(3)
    n_rows, local_vocab, vocab_start = 40, 700, 300
    logits = (torch.randn(n_rows, local_vocab, generator=gen) * 3).to(dtype)
    logits[0, 5] = logits[0, 600] = logits[0].max() + 1  # a tie: index 5 is the first maximum
    target = torch.randint(0, 1200, (n_rows,), generator=gen)
    target[:3] = torch.tensor([vocab_start, vocab_start + local_vocab - 1, vocab_start + local_vocab])
    local_target = target - vocab_start
    kwargs = {"softcap": softcap, "with_z_sum": True, "with_stats": True}
    got = shard_row_stats_triton(logits, local_target, **kwargs)
    want = shard_row_stats_torch(logits, local_target, **kwargs)
    for name in ("max", "sum_exp", "z_target", "z_sum", "exp_z_sum"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-4, msg=name)
    assert torch.equal(got.argmax, want.argmax) and got.argmax[0] == 5
    held = (local_target >= 0) & (local_target < local_vocab)
    assert torch.all(got.z_target[~held] == 0) and held[:3].tolist() == [True, True, False]

    lse = want.max + want.sum_exp.log() + torch.rand(n_rows, generator=gen)  # as if other shards added mass
    p_coef, smoothing, target_coef = (torch.rand(n_rows, generator=gen) + 0.5 for _ in range(3))
    grad_triton, grad_torch = logits.clone(), logits.clone()
    shard_softmax_grad_triton(grad_triton, local_target, lse, p_coef, smoothing, target_coef, softcap=softcap)
    shard_softmax_grad_torch(grad_torch, local_target, lse, p_coef, smoothing, target_coef, softcap=softcap)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # both round the same fp32 gradient to 16 bits
    assert relative_error(grad_triton.float(), grad_torch.float()) < tol
    # -target_coef lands at the target column of the rows whose target this shard holds, nowhere else
    no_target = logits.clone()
    shard_softmax_grad_triton(
        no_target, local_target, lse, p_coef, smoothing, 0 * target_coef, softcap=softcap
    )
    changed = (grad_triton != no_target).nonzero().tolist()
    assert changed == [[row, int(local_target[row])] for row in range(n_rows) if held[row]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("feature_name", ["plain", "all"])
def test_vocab_parallel_triton_path(tmp_path, feature_name, reduction, dtype):
    """The vocab-parallel op with impl="triton" on a group of one process (gloo) equals the single-device op:
    loss, dX, dW, d bias and the statistics, over several chunks (fp64: both run the PyTorch twins in fp64)."""
    import torch.distributed as dist

    from lightning_flce.parallel import (
        vocab_parallel_fused_linear_cross_entropy,
        vocab_parallel_fused_linear_cross_entropy_with_stats,
    )

    x, weight, target, bias, _ = make_problem(96, 32, 500, seed=7, dtype=dtype)
    x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    feature = dict(FEATURES[feature_name])
    b = bias if feature.pop("bias", False) else None
    feature.pop("class_weight", None)
    kwargs = {"reduction": reduction, **feature}
    if feature_name == "all":  # per-token weights ride on the same per-row scales
        kwargs["token_weight"] = torch.linspace(-1.0, 2.0, 96, dtype=dtype)
    grad_output = torch.rand(96, dtype=dtype) if reduction == "none" else None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = grads_of(
            lambda x_, w_, b_: vocab_parallel_fused_linear_cross_entropy(
                x_, w_, target, b_, chunk_size=40, impl="triton", **kwargs
            ),
            x,
            weight,
            b,
            grad_output=grad_output,
        )
        stats = vocab_parallel_fused_linear_cross_entropy_with_stats(
            x, weight, target, b, chunk_size=40, impl="triton", **kwargs
        )
    finally:
        dist.destroy_process_group()
    want = grads_of(
        lambda x_, w_, b_: fused_linear_cross_entropy(x_, w_, target, b_, impl="torch", **kwargs),
        x,
        weight,
        b,
        grad_output=grad_output,
    )
    want_stats = fused_linear_cross_entropy_with_stats(x, weight, target, b, impl="torch", **kwargs)
    assert got[0].dtype == stats.lse.dtype == torch.promote_types(dtype, torch.float32)
    assert relative_error(got[0], want[0]) < tol
    for g, w in zip(got[1], want[1]):
        if w is not None:
            assert relative_error(g, w) < tol
    assert relative_error(stats.lse, want_stats.lse) < tol
    assert relative_error(stats.entropy, want_stats.entropy) < tol
    assert torch.equal(stats.correct, want_stats.correct)
