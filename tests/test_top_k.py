"""fused_linear_top_k: each token's top k of a head (what a cached teacher stores) against the float64 formula
``log_softmax(softcap(x @ W.T + b)).topk(k)``, on the CPU (the PyTorch twin), in Triton's interpreter (the Triton
backend's row statistics, ``-m interpret``) and on CUDA (``-m cuda``); its checks, its custom op (fake tensors,
``torch.compile``, the FLOP counter).

What is compared: the values in descending order against the reference's k largest; each value against the
reference at its own column (so a tie between equal 16-bit logits may go to either column); the columns distinct.
In float64 the columns themselves equal the reference's (random logits have no ties).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_flce import TopKOutput, fused_linear_top_k

DEVICE_IMPLS = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cpu", "triton", id="interpret-triton", marks=pytest.mark.interpret),
    pytest.param("cuda", "auto", id="cuda", marks=pytest.mark.cuda),
]


def make_problem(n=(3, 7), h=24, v=90, dtype=torch.float64, device="cpu", bias=True, n_ignored=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*n, h, generator=generator, dtype=torch.float64)
    w = torch.randn(v, h, generator=generator, dtype=torch.float64) / h**0.25
    b = torch.randn(v, generator=generator, dtype=torch.float64) if bias else None
    target = torch.randint(0, v, n, generator=generator)
    target.view(-1)[torch.randperm(target.numel(), generator=generator)[:n_ignored]] = -100
    cast = {"dtype": dtype, "device": device}
    return x.to(**cast), w.to(**cast), None if b is None else b.to(**cast), target.to(device)


def reference(x, w, b, softcap=None, log_probs=True) -> torch.Tensor:
    """The float64 [..., V] values the top k is taken of (of the inputs as given, upcast)."""
    z = F.linear(x.double(), w.double(), None if b is None else b.double())
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z.log_softmax(-1) if log_probs else z


def check(
    out: TopKOutput, z: torch.Tensor, k: int, valid: torch.Tensor, atol: float, exact_columns=False
) -> None:
    values, indices = out
    assert values.shape == indices.shape == (*z.shape[:-1], k)
    assert indices.dtype == torch.int64 and values.dtype in (torch.float32, torch.float64)
    z, values, indices, valid = z.cpu(), values.cpu().double(), indices.cpu(), valid.cpu()
    assert torch.isneginf(values[~valid]).all() and (indices[~valid] == 0).all()
    values, indices, z = values[valid], indices[valid], z[valid]
    want = z.topk(k, dim=-1)
    torch.testing.assert_close(values, want.values, rtol=0, atol=atol)
    torch.testing.assert_close(values, z.gather(-1, indices), rtol=0, atol=atol)
    assert (values[:, :-1] >= values[:, 1:]).all()
    assert (indices.sort(-1).values.diff(dim=-1) > 0).all()  # distinct columns
    if exact_columns:
        assert torch.equal(indices, want.indices)


@pytest.mark.parametrize("device,impl", DEVICE_IMPLS)
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("log_probs", [True, False])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_float64_equals_the_formula(device, impl, softcap, log_probs, chunk_size):
    """float64: values within rounding of the formula's, and its columns; ignored tokens -inf / 0."""
    x, w, b, target = make_problem(device=device)
    out = fused_linear_top_k(
        x, w, 5, b, target=target, softcap=softcap, log_probs=log_probs, chunk_size=chunk_size, impl=impl
    )
    check(out, reference(x, w, b, softcap, log_probs), 5, target != -100, atol=1e-12, exact_columns=True)
    assert out.values.dtype == torch.float64


@pytest.mark.parametrize("device,impl", DEVICE_IMPLS)
@pytest.mark.parametrize(
    "dtype,precision", [(torch.float32, "input"), (torch.bfloat16, "input"), (torch.bfloat16, "fp32")]
)
def test_lower_precision_within_its_rounding(device, impl, dtype, precision):
    """fp32 GEMMs: within 1e-5 of the formula on the same (upcast) inputs. bf16 logits (``"input"``): each logit
    rounded to bf16 (half an ulp, 2^-9 of its size) in the value and again in the row's log-sum-exp, so within
    2^-7 of the largest logit; ``"fp32"`` writes fp32 logits: fp32's tolerance. Values are fp32."""
    x, w, b, target = make_problem(n=(5, 9), h=32, v=300, dtype=dtype, device=device)
    out = fused_linear_top_k(x, w, 8, b, target=target, logits_precision=precision, impl=impl)
    z = reference(x, w, b)
    scale = reference(x, w, b, log_probs=False).abs().max().item()
    atol = 2.0**-7 * scale if (dtype, precision) == (torch.bfloat16, "input") else 1e-5 * max(scale, 1.0)
    check(out, z, 8, target != -100, atol=atol)
    assert out.values.dtype == torch.float32


@pytest.mark.parametrize("device,impl", DEVICE_IMPLS)
def test_no_target_all_tokens_and_k_equal_to_v(device, impl):
    """Without ``target`` every token counts; k = V gives the whole sorted distribution (its exps sum to 1)."""
    x, w, b, _ = make_problem(n=(6,), v=40, device=device)
    out = fused_linear_top_k(x, w, 40, b, impl=impl)
    check(out, reference(x, w, b), 40, torch.ones(6, dtype=torch.bool), atol=1e-12, exact_columns=True)
    torch.testing.assert_close(out.values.exp().sum(-1), torch.ones(6, dtype=torch.float64, device=device))


def test_empty_and_all_ignored_batches():
    x, w, b, target = make_problem(n=(0, 5))
    out = fused_linear_top_k(x, w, 3, b, target=target)
    assert out.values.shape == out.indices.shape == (0, 5, 3)
    x, w, b, target = make_problem(n=(2, 3))
    out = fused_linear_top_k(x, w, 3, b, target=torch.full_like(target, -100))
    assert torch.isneginf(out.values).all() and (out.indices == 0).all()


def test_no_gradient_flows():
    """Inputs that require grad are read as constants: the outputs carry no graph."""
    x, w, b, target = make_problem()
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = fused_linear_top_k(x, w, 3, b, target=target)
    assert not out.values.requires_grad and out.values.grad_fn is None


def test_bad_input_is_refused_before_any_kernel():
    x, w, b, target = make_problem(v=10)
    for k in (0, 11, 2.0, True, None):
        with pytest.raises(ValueError, match="k must be an int in \\[1, V=10\\]"):
            fused_linear_top_k(x, w, k, b, target=target)
    bad = target.clone()
    bad[0, 0] = 10
    with pytest.raises(ValueError, match="outside \\[0, 10\\)"):
        fused_linear_top_k(x, w, 3, b, target=bad)
    with pytest.raises(ValueError):
        fused_linear_top_k(x, w[:, :-1], 3, b, target=target)  # hidden sizes differ
    with pytest.raises(ValueError):
        fused_linear_top_k(x, w, 3, b, target=target[:, :-1])  # target's shape is not the tokens'
    with pytest.raises(ValueError, match="softcap"):
        fused_linear_top_k(x, w, 3, b, softcap=-1.0)


def test_custom_op_fake_compile_and_flops():
    """The op's fake tensors (torch.library.opcheck), a compiled call equal to the eager one, and 2 N H V FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w, b, target = make_problem(dtype=torch.float32)
    args = (
        x.reshape(-1, x.shape[-1]),
        w,
        target.reshape(-1),
        b,
        4,
        True,
        -100,
        0.0,
        "input",
        torch.float32,
        0,
        "torch",
    )
    torch.library.opcheck(torch.ops.lightning_flce.flce_top_k.default, args)

    eager = fused_linear_top_k(x, w, 4, b, target=target)
    compiled = torch.compile(
        lambda *a: fused_linear_top_k(*a, target=target), backend="eager", fullgraph=True
    )
    got = compiled(x, w, 4, b)
    torch.testing.assert_close(got.values, eager.values, rtol=0, atol=0)
    assert torch.equal(got.indices, eager.indices)

    with FlopCounterMode(display=False) as counter:
        fused_linear_top_k(x, w, 4, b, target=target)
    assert counter.get_total_flops() == 2 * target.numel() * x.shape[-1] * w.shape[0]


def test_autocast_runs_the_gemm_in_the_autocast_dtype():
    """Under CPU autocast (bf16) the logits GEMM runs in bf16, as the cross-entropy op's: within bf16's
    tolerance of the bf16-rounded inputs' formula, not fp32's."""
    x, w, b, target = make_problem(dtype=torch.float32, v=200)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_top_k(x, w, 6, b, target=target)
    z = reference(x.bfloat16(), w.bfloat16(), b.bfloat16())
    scale = reference(x.bfloat16(), w.bfloat16(), b.bfloat16(), log_probs=False).abs().max().item()
    check(out, z, 6, target != -100, atol=2.0**-7 * scale)
    fp32 = fused_linear_top_k(x, w, 6, b, target=target)
    # bf16's rounding shows: not fp32 GEMMs
    assert (out.values - fp32.values)[target != -100].abs().max() > 1e-4
