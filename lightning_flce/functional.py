"""Public API: :func:`fused_linear_cross_entropy` and :func:`fused_linear_cross_entropy_with_stats`.

Thin wrappers: check the arguments (clear exceptions before any kernel runs), resolve autocast and
the implementation, and call the custom op of :mod:`lightning_flce.op`.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from lightning_flce._compat import triton_usable
from lightning_flce.op import flce_forward, flce_op_available_on

_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class FLCEOutput(NamedTuple):
    """Result of :func:`fused_linear_cross_entropy_with_stats`.

    Attributes:
        loss: as :func:`fused_linear_cross_entropy` returns it (differentiable).
        lse: log-sum-exp of each token's (softcapped) logits, in the target's shape and the loss's dtype; 0 for
            ignored tokens.
        correct: bool ``argmax(logits) == target`` per token (first maximum on ties); False for ignored tokens.
        entropy: entropy of each token's softmax, in the loss's dtype; 0 for ignored tokens.

    The statistics carry no gradient.
    """

    loss: Tensor
    lse: Tensor
    correct: Tensor
    entropy: Tensor


def fused_linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[Tensor] = None,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    accum_dtype: Optional[torch.dtype] = None,
    chunk_size: Optional[int] = None,
    impl: str = "auto",
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
        accum_dtype: dtype of the dW accumulator across chunks; the gradient is returned in the
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
    return _call(
        input,
        weight,
        target,
        bias,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        class_weight=class_weight,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        impl=impl,
        compute_stats=False,
    ).loss


def takes_options_of(loss_function: Callable) -> Callable[[Callable], Callable]:
    """Decorator of a ``*_with_stats`` function that forwards ``**kwargs`` to the op: it takes the keyword
    options of ``loss_function``, which ``help()`` and ``inspect.signature`` then show, and a misspelled one
    raises a ``TypeError`` that names the public function (not the internal one it forwards to)."""
    signature = inspect.signature(loss_function)
    options = {name for name, param in signature.parameters.items() if param.kind is param.KEYWORD_ONLY}

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def checked(*args, **kwargs):
            unknown = kwargs.keys() - options
            if unknown:
                raise TypeError(
                    f"{function.__name__}() got unexpected keyword arguments {sorted(unknown)};"
                    f" options: {sorted(options)}"
                )
            return function(*args, **kwargs)

        checked.__signature__ = signature.replace(return_annotation="FLCEOutput")
        return checked

    return decorate


@takes_options_of(fused_linear_cross_entropy)
def fused_linear_cross_entropy_with_stats(
    input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, **kwargs
) -> FLCEOutput:
    """:func:`fused_linear_cross_entropy` plus per-token LSE, correctness and entropy (:class:`FLCEOutput`).

    Takes the same arguments. The statistics come from the same pass over each chunk's logits, so
    token accuracy or entropy monitoring costs no logits either.
    """
    return _call(input, weight, target, bias, compute_stats=True, **kwargs)


def _call(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[Tensor] = None,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    accum_dtype: Optional[torch.dtype] = None,
    chunk_size: Optional[int] = None,
    impl: str = "auto",
    compute_stats: bool,
) -> FLCEOutput:
    compute_dtype = _check_inputs(input, weight, target, bias, class_weight)
    # Here, not in _check_inputs: the vocab-parallel op reports a zero-row shard with every rank's shard sizes.
    if 0 in weight.shape:
        raise ValueError(f"hidden size and vocabulary must be non-empty, got weight {tuple(weight.shape)}")
    _check_options(reduction, label_smoothing, lse_square_scale, softcap, accum_dtype, chunk_size, impl)
    target, ignore_index = _class_indices(target, ignore_index)
    impl = _resolve_impl(impl, input.device)
    grad_enabled = torch.is_grad_enabled()
    loss, lse, correct, entropy, *_ = flce_forward(
        input,
        weight,
        target,
        bias,
        class_weight,
        ignore_index,
        reduction,
        float(label_smoothing),
        float(lse_square_scale),
        float(softcap) if softcap is not None else 0.0,
        compute_dtype,
        _accum_mode(accum_dtype, weight, compute_dtype),
        int(chunk_size) if chunk_size is not None else 0,
        impl,
        grad_enabled and input.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
        compute_stats,
    )
    return _shaped_like_target(
        FLCEOutput(loss, lse, correct, entropy), target.shape, reduction, compute_stats
    )


def _shaped_like_target(
    output: FLCEOutput, shape: torch.Size, reduction: str, compute_stats: bool
) -> FLCEOutput:
    """The per-token outputs ([N] from the op) in the target's shape, as ``F.cross_entropy``'s "none" is."""
    loss, lse, correct, entropy = output
    if reduction == "none":
        loss = loss.view(shape)
    if compute_stats:
        lse, correct, entropy = lse.view(shape), correct.view(shape), entropy.view(shape)
    return FLCEOutput(loss, lse, correct, entropy)


def _check_inputs(
    input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor]
) -> torch.dtype:
    """Validate shapes, dtypes and devices; return the dtype the GEMMs run in."""
    if weight.numel() == 0 and weight.dim() != 2:
        raise ValueError(
            f"the head weight is empty (shape {tuple(weight.shape)}): a parameter partitioned by DeepSpeed ZeRO-3 "
            "(or another sharding scheme) must be gathered first - call the loss inside the head module's forward "
            "(FLCEMixin does) or within deepspeed.zero.GatheredParameters(head.weight)"
        )
    if input.dim() < 1 or weight.dim() != 2:
        raise ValueError(
            f"expected input [..., H] and weight [V, H], got {tuple(input.shape)} and {tuple(weight.shape)}"
        )
    hidden = input.shape[-1]
    for name, tensor in (("input", input), ("weight", weight), ("target", target)):
        if tensor.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    if weight.shape[1] != hidden:
        raise ValueError(
            f"hidden size mismatch: input has H={hidden}, weight is {tuple(weight.shape)} (expected [V, {hidden}])"
        )
    if target.shape != input.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match input's leading shape {tuple(input.shape[:-1])}"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    vocab = weight.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must be [V]=[{vocab}], got {tuple(bias.shape)}")
    if class_weight is not None:
        if class_weight.shape != (vocab,):
            raise ValueError(f"class_weight must be [V]=[{vocab}], got {tuple(class_weight.shape)}")
        if not class_weight.dtype.is_floating_point:
            raise TypeError(f"class_weight must be floating point, got {class_weight.dtype}")
        if class_weight.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "class_weight requires grad, but the loss is not differentiable with respect to it (nor is"
                " F.cross_entropy's weight): pass class_weight.detach()"
            )
    for name, tensor in (
        ("weight", weight),
        ("target", target),
        ("bias", bias),
        ("class_weight", class_weight),
    ):
        if tensor is not None and tensor.device != input.device:
            raise ValueError(f"{name} is on {tensor.device} but input is on {input.device}")
    for name, tensor in (("input", input), ("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} dtype {tensor.dtype} is not supported (fp16, bf16, fp32, fp64)")

    autocast_dtype = _autocast_dtype(input.device.type)
    # Autocast leaves fp64 tensors alone (as F.linear does under it): fp64 in, fp64 GEMMs.
    if autocast_dtype is not None and torch.float64 not in (input.dtype, weight.dtype):
        # Like nn.Linear under autocast: GEMM operands in the autocast dtype, grads in the param dtypes.
        return autocast_dtype
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype != input.dtype:
            raise TypeError(
                f"{name} dtype {tensor.dtype} differs from input dtype {input.dtype} outside autocast "
                "(cast one of them, or run under torch.autocast as mixed precision does)"
            )
    return input.dtype


def _class_indices(target: Tensor, ignore_index) -> Tuple[Tensor, int]:
    """The target as int64 and ``ignore_index`` as an int64 value. Narrower integer targets are widened first:
    compared in their own dtype, -100 would wrap around in uint8 (to 156, a class) and range checks would
    wrap too."""
    if isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    try:
        ignore_index = operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}") from None
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    return (target if target.dtype == torch.int64 else target.long()), ignore_index


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. "meta")
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def _check_options(
    reduction, label_smoothing, lse_square_scale, softcap, accum_dtype, chunk_size, impl
) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not 0.0 <= lse_square_scale < math.inf:
        raise ValueError(f"lse_square_scale must be finite and >= 0, got {lse_square_scale}")
    if softcap is not None and not 0.0 < softcap < math.inf:
        raise ValueError(f"softcap must be finite and > 0 (or None), got {softcap}")
    if accum_dtype is not None and not isinstance(accum_dtype, torch.dtype):
        raise TypeError(f"accum_dtype must be a torch.dtype or None, got {accum_dtype!r}")
    check_chunk_size(chunk_size)
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")


def check_chunk_size(chunk_size) -> None:
    """``chunk_size`` is None or a positive integer (of any integer type, as ``operator.index`` takes it)."""
    if chunk_size is None:
        return
    try:
        positive = not isinstance(chunk_size, bool) and operator.index(chunk_size) > 0
    except TypeError:
        positive = False
    if not positive:
        raise ValueError(f"chunk_size must be a positive int (or None), got {chunk_size!r}")


def _accum_mode(accum_dtype: Optional[torch.dtype], weight: Tensor, compute_dtype: torch.dtype) -> str:
    if accum_dtype is None:
        return "auto"
    if accum_dtype == torch.float64 and compute_dtype in (torch.float16, torch.bfloat16):
        # No GEMM widens fp16/bf16 operands to fp64: each chunk's product would be rounded to 16 bits first,
        # a less accurate dW than an fp32 accumulator's (and fp64 dX GEMMs).
        raise ValueError(
            f"accum_dtype=torch.float64 needs fp32 or fp64 GEMMs, but they run in {compute_dtype} (autocast or"
            " half-precision inputs); use accum_dtype=torch.float32, the most accurate accumulator for them"
        )
    if accum_dtype in (torch.float32, torch.float64):
        return "fp32" if accum_dtype == torch.float32 else "fp64"
    if accum_dtype == weight.dtype:
        return "param"
    raise ValueError(
        f"accum_dtype must be None, torch.float32, torch.float64 or the weight's dtype {weight.dtype}, got {accum_dtype}"
    )


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl == "auto":
        return flce_op_available_on(device)
    if impl == "triton" and not triton_usable(device):
        raise RuntimeError(
            f"impl='triton' needs Triton and a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors); got {device}"
        )
    return impl
