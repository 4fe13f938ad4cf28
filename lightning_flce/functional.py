"""Public API: :func:`fused_linear_cross_entropy` and :func:`fused_linear_cross_entropy_with_stats`.

Thin front ends: the options become one :class:`~lightning_flce.options.FLCEOptions` record (validated
once), the inputs are checked (clear exceptions before any kernel runs), autocast and the backend are
resolved, and the custom op of :mod:`lightning_flce.op` runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_flce.kernels import Backend, backend_for, resolve_backend
from lightning_flce.op import flce_forward, forward_args
from lightning_flce.options import (
    AccumDtype,
    FLCEOptions,
    ImplName,
    LogitsPrecision,
    Reduction,
    resolve_logits_precision,
    takes_options_of,
)
from lightning_flce.outputs import FLCEOutput, shaped_like_target
from lightning_flce.validation import check_inputs, class_indices

__all__ = ["FLCEOutput", "fused_linear_cross_entropy", "fused_linear_cross_entropy_with_stats"]


def fused_linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[Tensor] = None,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    token_weight: Optional[Tensor] = None,
    logits_precision: LogitsPrecision = "input",
    accum_dtype: AccumDtype = None,
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> Tensor:
    """Cross-entropy of ``input @ weight.T + bias`` against ``target``, without materializing the logits.

    Equal to ``F.cross_entropy(softcap(F.linear(input, weight, bias).float()), target,
    weight=class_weight, ignore_index=ignore_index, reduction=reduction,
    label_smoothing=label_smoothing)`` (``.double()`` for fp64 inputs) plus the z-loss
    ``lse_square_scale * logsumexp(logits) ** 2`` of every non-ignored token, computed in chunks of
    tokens: peak extra memory is one chunk's logits, not [N, V].

    Args:
        input: [..., H] hidden states; leading dimensions are flattened to N tokens.
        weight: [V, H] head weight.
        target: [...] integer class indices with the leading shape of ``input``.
        bias: optional [V] head bias.
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored tokens, weighted by ``class_weight`` as in
            ``F.cross_entropy``; the z-loss is averaged over non-ignored tokens), ``"sum"``, or
            ``"none"`` (per-token losses in the target's shape, 0 for ignored tokens).
        label_smoothing: in [0, 1], as in ``F.cross_entropy``.
        class_weight: optional [V] weight per class, as ``F.cross_entropy``'s ``weight``.
        lse_square_scale: z-loss coefficient (PaLM uses 1e-4).
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
        token_weight: optional float weights in the target's shape (no gradient): every per-token summand
            of the loss (the cross-entropy with its smoothing and class weight, and the token's z-loss) is
            multiplied by the token's weight; ``"mean"`` keeps its unweighted denominator. Weights may be
            zero or negative (policy-gradient advantages, soft masks). It runs the fast path (gradients in
            forward) for "mean"/"sum", at the cost of a per-token scale.
        logits_precision: ``"input"`` (default): each chunk's logits come out of the GEMM in the GEMM's
            dtype, rounded as ``F.linear`` would. ``"fp32"``: 16-bit GEMMs accumulate and write fp32 logits
            (bias and softcap in fp32, log-probabilities as exact as an fp32 head's; the logit gradient goes
            to the dX/dW GEMMs in their operand dtype): one more chunk buffer, a little slower.
            ``"fp32_head"``: the head's GEMMs themselves run in fp32 (operands widened; TF32 only if enabled
            globally), dW accumulated in fp32: an fp32 head for RL log-probabilities, at the fp32 GEMM rate.
            ``"fp32_compensated"``: as ``"fp32"``, but the logits GEMM compensates its sum over H (a Triton
            GEMM on CUDA; elsewhere the float64 GEMM rounded once to fp32), so the logits are within ~1 fp32
            ulp of exact and the per-token loss within ~3e-6 of float64 (RL log-probabilities, KL terms
            where 1e-5 matters); its logits GEMM costs about 1.8x the fp32-output one.
            See ``docs/op.md``.
        accum_dtype: dtype of the dW accumulator across chunks, a ``torch.dtype`` or its name
            (``"float32"``, ``"float64"``, ``"bfloat16"``, ``"float16"``); the gradient is returned in the
            weight's dtype either way. ``torch.float32``: always fp32. The weight's own dtype:
            accumulate in place in it (least memory; an fp16/bf16 dW then rounds once per chunk).
            None (default): one step wider than the GEMM operands where there is more than one chunk,
            so dW is as accurate as one unchunked GEMM: fp32 for fp16/bf16 GEMMs (an fp32 weight under
            autocast included), fp64 for fp32 GEMMs on GPUs with full-rate fp64 (A100, H100, ...); the
            weight's dtype otherwise.
            ``torch.float64``: fp64, for fp32 and fp64 GEMMs (fp16/bf16 GEMMs raise ValueError: their
            products would be rounded to 16 bits before the fp64 sum). (d bias is accumulated in fp32, fp64
            for fp64 inputs.)
        chunk_size: tokens per chunk; None picks it from a memory budget: a quarter of dX + dW, and on
            the GPU (not for fp64) at least 4096 tokens while their logits fit in dX + dW (fewer chunks:
            each one reads and writes the whole dW accumulator), then evens the chunks out over the
            non-ignored tokens. Smaller chunks save memory at some speed.
        impl: ``"triton"`` (CUDA; the CPU only under ``TRITON_INTERPRET=1``), ``"torch"``, or
            ``"auto"`` (Triton on CUDA, PyTorch elsewhere). The Triton kernels compute in fp32: fp64
            inputs run the PyTorch softmax (in fp64) under any ``impl``.

    Returns:
        The loss in fp32 (fp64 for fp64 inputs, as ``F.cross_entropy`` of fp64 logits): a scalar, or one per
        token (the target's shape) for ``reduction="none"``.

    Edge cases (documented and tested): an all-ignored batch gives 0 (also for "mean") with zero
    gradients and the graph connected; N = 0 gives 0 ("none": an empty tensor); NaN/Inf in the
    input propagate to the loss as they would in the reference. Under ``torch.autocast`` the GEMMs
    run in the autocast dtype like ``nn.Linear``'s, and an fp32 weight gets an fp32 gradient.

    fp16 (inputs or ``precision="16-mixed"``) works with torch's ``GradScaler``: the gradients are
    computed in forward, before the loss scale exists, so fp16 logit gradients are scaled by a bounded
    power of two and unscaled in fp32 or in backward; dX/dW are as accurate as the unfused fp16 loss's.
    """
    options = FLCEOptions.of(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        class_weight=class_weight,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        token_weight=token_weight,
        logits_precision=logits_precision,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        impl=impl,
    )
    return _call(input, weight, target, bias, options, compute_stats=False).loss


@takes_options_of(fused_linear_cross_entropy)
def fused_linear_cross_entropy_with_stats(
    input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, **kwargs: Any
) -> FLCEOutput:
    """:func:`fused_linear_cross_entropy` plus per-token LSE, correctness and entropy (:class:`FLCEOutput`).

    Takes the same arguments. The statistics come from the same pass over each chunk's logits, so
    token accuracy or entropy monitoring costs no logits either.
    """
    return _call(input, weight, target, bias, FLCEOptions.of(**kwargs), compute_stats=True)


def checked_call(
    input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], options: FLCEOptions
) -> tuple[FLCEOptions, torch.dtype, Backend]:
    """What a single-device call runs, its inputs checked first (clear errors before any kernel): the options with
    ``logits_precision`` resolved, the GEMMs' compute dtype and the chunk kernels' backend. The cross-entropy's and
    the RL calls' front ends share it."""
    compute_dtype = check_inputs(input, weight, target, bias, options)
    # Here, not in check_inputs: the vocab-parallel op reports a zero-row shard with every rank's shard sizes.
    if 0 in weight.shape:
        raise ValueError(f"hidden size and vocabulary must be non-empty, got weight {tuple(weight.shape)}")
    options, compute_dtype = resolve_logits_precision(options, compute_dtype)
    return options, compute_dtype, backend_for(resolve_backend(options.impl, input.device), compute_dtype)


def _call(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    options: FLCEOptions,
    compute_stats: bool,
) -> FLCEOutput:
    options, compute_dtype, backend = checked_call(input, weight, target, bias, options)
    args = forward_args(
        options,
        input,
        weight,
        class_indices(target),
        bias,
        compute_dtype=compute_dtype,
        backend=backend.name,
        compute_stats=compute_stats,
    )
    loss, lse, correct, entropy, *_ = flce_forward(*args)
    output = FLCEOutput(loss, lse, correct, entropy)
    return shaped_like_target(output, target.shape, options.reduction, compute_stats)
