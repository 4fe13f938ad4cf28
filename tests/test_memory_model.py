"""The head memory model against real allocations on CPU, and the peak breakdown's counting.

The CPU allocator reports every allocation and free to the profiler (``profile_memory=True``), internal
temporaries of ATen ops included, so the high-water mark of a loss's forward and backward is measured, not
inferred. The same ATen ops run on CUDA; the GPU check of the whole step is tests/test_memory_callback_cuda.py.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_flce.callbacks.memory_model import (
    HeadMemoryModel,
    MemoryBreakdown,
    head_compute_dtype,
    precision_weight_dtype,
    tensor_bytes,
)
from lightning_flce.head import FLCEHeadLoss

N, V, H = 512, 4096, 32

# Lightning precision -> (the weights' dtype, the autocast dtype or None)
PRECISIONS = {
    "16-mixed": (torch.float32, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16-true": (torch.bfloat16, None),
    "32-true": (torch.float32, None),
    "64-true": (torch.float64, None),
}


def _measured_peak_bytes(precision, naive, **loss_options):
    """High-water mark of the CPU allocations of one training loss call, forward and backward, above what
    existed before it (the hidden states and the head)."""
    weight_dtype, autocast_dtype = PRECISIONS[precision]
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).to(weight_dtype)
    hidden = torch.randn(N, H, dtype=weight_dtype, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    softcap = loss_options.pop("softcap", None)  # an argument of the call, the others of the loss
    loss_fn = FLCEHeadLoss(naive=naive, impl="torch", **loss_options)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast(
            "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
        ):
            loss = loss_fn(head, hidden, labels, reduction="sum", softcap=softcap)
        loss.backward()
    events = [event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"]
    if events and not hasattr(events[0], "nbytes"):
        pytest.skip("this torch's profiler events carry no allocation sizes")
    changes = sorted((event.start_ns(), event.nbytes()) for event in events)
    current = peak = 0
    for _, change in changes:
        current += change
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize(
    "options",
    [{}, {"softcap": 30.0}, {"lse_square_scale": 1e-4}, {"label_smoothing": 0.1}],
    ids=lambda o: str(o),
)
def test_unfused_head_peak_matches_allocations(precision, options):
    weight_dtype = PRECISIONS[precision][0]
    model = HeadMemoryModel(
        precision,
        weight_dtype,
        H,
        softcap=options.get("softcap"),
        lse_square_scale=options.get("lse_square_scale", 0.0),
    )
    expected = model.estimate(N, V).unfused_bytes
    measured = _measured_peak_bytes(precision, naive=True, **options)
    # what the model leaves out: the [N] per-token vectors and, under autocast, the weight's copy in the
    # compute dtype (V H 2 bytes, which the fused head makes too): 2.5% of the [N, V] tensors here
    assert measured == pytest.approx(expected, rel=0.025)
    assert measured >= expected


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true", "64-true"])
def test_fused_head_peak_matches_allocations(precision):
    """The fused head's own buffers on the PyTorch path (CPU): chunk, its upcast and softmax, dX, dW."""
    weight_dtype = PRECISIONS[precision][0]
    # 4 chunks, so the accumulator follows the chunked rule
    model = HeadMemoryModel(precision, weight_dtype, H, impl="torch", chunk_size=N // 4)
    estimate = model.estimate(N, V)
    measured = _measured_peak_bytes(precision, naive=False, chunk_size=N // 4)
    # left out: the per-token vectors and the weight's copy in the compute dtype
    assert measured == pytest.approx(estimate.fused_bytes, rel=0.05)
    assert measured < estimate.unfused_bytes / 2


@pytest.mark.parametrize("logits_precision", ["fp32", "fp32_compensated", "fp32_head"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fused_head_peak_with_wide_logits_matches_allocations(precision, logits_precision):
    """The wide logits on the PyTorch path (CPU): fp32 chunk logits holding their bf16 gradient in their own
    rows and the fallbacks' weight copies (fp32 for "fp32", fp64 and an fp64 chunk product for
    "fp32_compensated"), or fp32 GEMMs ("fp32_head": under bf16-true the weight widened). On this path the
    fp32 chunk needs no fp32 upcast, so "fp32" and "fp32_head" take less than the default's buffers (the
    default's bf16 chunk, its fp32 copy and the softmax's temporary), "fp32_compensated" more (the fp64
    weight copy and product)."""
    weight_dtype, autocast_dtype = PRECISIONS[precision]
    options = {"chunk_size": N // 4, "logits_precision": logits_precision}
    model = HeadMemoryModel(precision, weight_dtype, H, impl="torch", **options)
    estimate = model.estimate(N, V)
    measured = _measured_peak_bytes(precision, naive=False, **options)
    default = HeadMemoryModel(precision, weight_dtype, H, impl="torch", chunk_size=N // 4).estimate(N, V)
    # left out by the model: under autocast the weight's copy in the compute dtype (V H 2 bytes, made by the
    # unfused head too), 5% of this smaller total
    autocast_copy = V * H * 2 if autocast_dtype is not None and logits_precision != "fp32_head" else 0
    assert measured - autocast_copy == pytest.approx(estimate.fused_bytes, rel=0.05)
    if logits_precision == "fp32_compensated":
        assert estimate.fused_bytes > default.fused_bytes
    else:
        assert estimate.fused_bytes < default.fused_bytes


@pytest.mark.parametrize(
    ("precision", "per_logit"),
    [
        ("16-mixed", 12),
        ("bf16-mixed", 12),
        ("bf16-true", 12),
        ("16-true", 12),
        ("32-true", 12),
        ("64-true", 24),
    ],
)
def test_bytes_per_logit(precision, per_logit):
    weight_dtype = precision_weight_dtype(precision)
    copy = per_logit // 3  # one [N, V] tensor in the softmax dtype, per logit
    assert HeadMemoryModel(precision, weight_dtype).bytes_per_logit() == 3 * copy
    assert HeadMemoryModel(precision, weight_dtype, softcap=30.0).bytes_per_logit() == 4 * copy
    assert HeadMemoryModel(precision, weight_dtype, lse_square_scale=1e-4).bytes_per_logit() == 5 * copy
    assert (
        HeadMemoryModel(precision, weight_dtype, softcap=30.0, lse_square_scale=1e-4).bytes_per_logit()
        == 6 * copy
    )


def test_compute_dtype_follows_precision():
    assert head_compute_dtype("bf16-mixed", torch.float32) == torch.bfloat16
    assert head_compute_dtype("16-mixed", torch.float32) == torch.float16
    assert head_compute_dtype("32-true", torch.float32) == torch.float32
    assert head_compute_dtype("bf16-true", torch.bfloat16) == torch.bfloat16
    assert head_compute_dtype("transformer-engine", torch.bfloat16) == torch.bfloat16
    assert precision_weight_dtype("bf16-mixed") == torch.float32
    assert precision_weight_dtype("64-true") == torch.float64


def test_cuda_bf16_config_estimate():
    """configs/cuda_bf16.yaml's head (16384 tokens, V = 32768, H = 512, bf16-mixed, Triton path): the figures
    written out by hand, the GPU run to compare them with is benchmarks/memory_naive_vs_fused.py."""
    num_tokens, vocab, hidden = 16384, 32768, 512
    estimate = HeadMemoryModel("bf16-mixed", torch.float32, hidden, impl="triton").estimate(num_tokens, vocab)
    assert estimate.unfused_bytes == num_tokens * vocab * 12  # 6 GiB
    # the op's rule: chunks of at most the floor (dX + dW = 48 MiB in bf16), 768 rows of 64 KiB, balanced
    # over the 22 chunks that takes (745 rows) and rounded up to the op's 256-row alignment: 768 (the model
    # said 745 while it balanced without the op's alignment; engine.chunk_rows is what the op runs)
    assert estimate.chunk_rows == 768
    chunk = estimate.chunk_rows * vocab * 2
    grad_weight = vocab * hidden * 4  # fp32 accumulator under autocast
    grad_input = num_tokens * hidden * 2
    assert estimate.fused_bytes == chunk + grad_weight + grad_input
    assert estimate.saved_bytes == estimate.unfused_bytes - estimate.fused_bytes
    assert estimate.saved_bytes / 2**20 == pytest.approx(6144 - 128, abs=2)


def test_naive_saves_nothing_and_small_heads_clamp_at_zero():
    model = HeadMemoryModel("32-true", torch.float32, 64)
    assert model.estimate(1000, 5000, naive=True).saved_bytes == 0
    # a vocabulary smaller than the hidden size: the fused head's dW outweighs the logits
    assert model.estimate(10, 8).saved_bytes == 0
    # no hidden size: nothing to subtract
    assert HeadMemoryModel("32-true", torch.float32).estimate(10, 8).saved_bytes == 10 * 8 * 12


def test_user_chunk_size():
    estimate = HeadMemoryModel("bf16-mixed", torch.float32, 64, chunk_size=128, impl="triton").estimate(
        4096, 1000
    )
    assert (estimate.chunk_rows, estimate.chunk_bytes) == (128, 128 * 1000 * 2)


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10, 10)
    assert tensor_bytes([a, a, a[2:], a.t(), None, 3]) == 400
    assert tensor_bytes([a, torch.zeros(5, dtype=torch.float64)]) == 440
    assert tensor_bytes([a], device=torch.device("meta")) == 0


def test_breakdown_with_adam():
    layer = torch.nn.Linear(100, 50)
    optimizer = torch.optim.Adam(layer.parameters())
    param_bytes = (100 * 50 + 50) * 4
    empty = MemoryBreakdown.measure(0, 10 * param_bytes, layer.parameters(), [optimizer])
    assert (empty.parameter_bytes, empty.gradient_bytes, empty.optimizer_state_bytes) == (param_bytes, 0, 0)
    layer(torch.randn(3, 100)).sum().backward()
    optimizer.step()
    breakdown = MemoryBreakdown.measure(1, 10 * param_bytes, layer.parameters(), [optimizer])
    assert breakdown.gradient_bytes == param_bytes
    assert breakdown.optimizer_state_bytes == 2 * param_bytes + 2 * 4  # exp_avg, exp_avg_sq, two 0-d steps
    assert breakdown.rest_bytes == 10 * param_bytes - 4 * param_bytes - 8
    assert MemoryBreakdown.from_dict(breakdown.as_dict()) == breakdown
    # a peak below the counted parts (counted on another rank's device, say) leaves no negative rest
    assert MemoryBreakdown(0, 10, 20, 0, 0).rest_bytes == 0
