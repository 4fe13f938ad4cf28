"""Logit distillation on the fused heads: :func:`fused_linear_distillation` and its module
:class:`FusedLinearDistillationLoss`.

The teacher's and the student's distributions over the vocabulary exist one chunk of tokens at a time (both heads'
logits GEMMs into reused buffers, :mod:`lightning_flce.distill.op`); the student's gradients come out of the
forward pass ("mean"/"sum"); the teacher gets none.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from lightning_flce.distill.op import OP_ARG_NAMES, flce_distill, flce_distill_per_token
from lightning_flce.functional import checked_call
from lightning_flce.kernels import LOW_PRECISION, softmax_dtype
from lightning_flce.losses.distillation import DIVERGENCES, Divergence
from lightning_flce.options import AccumDtype, FLCEOptions, ImplName, LogitsPrecision, Reduction
from lightning_flce.rl.logprobs import inverse_temperature
from lightning_flce.validation import check_inputs, class_indices

__all__ = [
    "Divergence",
    "FusedLinearDistillationLoss",
    "fused_linear_distillation",
    "fused_linear_distillation_from_top_k",
]


def fused_linear_distillation(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    target: Optional[Tensor] = None,
    *,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    divergence: Divergence = "jsd",
    beta: float = 0.5,
    temperature: Union[float, Tensor] = 1.0,
    hard_weight: float = 0.0,
    top_k: Optional[int] = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    token_weight: Optional[Tensor] = None,
    vocab_size: Optional[int] = None,
    student_softcap: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logits_precision: LogitsPrecision = "input",
    accum_dtype: AccumDtype = None,
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> Tensor:
    """The divergence between a frozen teacher's and the student's distributions over the vocabulary (plus an
    optional hard-label cross-entropy), computed in chunks of tokens: neither head's [N, V] logits exist.

    Each side's logits ``z = softcap(logit_scale * (input @ weight.T + bias)) / temperature``; ``p = softmax(z_s)``
    (the student), ``q = softmax(z_t)`` (the teacher), in fp32 (fp64 for fp64 inputs). Per token
    ``(1 - hard_weight) * D + hard_weight * CE`` times ``token_weight``, where ``D`` is

    - ``"forward_kl"``: ``KL(q || p)``;
    - ``"reverse_kl"``: ``KL(p || q)``;
    - ``"jsd"``: ``beta KL(q || M) + (1 - beta) KL(p || M)``, ``M = beta q + (1 - beta) p`` (the generalized JSD of
      TRL's ``GKDTrainer`` and Liger's fused JSD; ``beta=0`` is ``"forward_kl"``, ``beta=1`` ``"reverse_kl"``);

    and ``CE`` the student's cross-entropy on ``target`` without the temperature (with its softcap and logit
    scale). No ``T**2`` factor is applied: multiply the loss by ``temperature**2`` for Hinton's scaling.

    Args:
        student_input: [..., H_s] the student's hidden states.
        student_weight: [V, H_s] the student's head weight.
        teacher_input: [..., H_t] the teacher's hidden states, with the student's leading shape (no gradient: run
            the teacher under ``torch.no_grad()``, or pass ``.detach()``).
        teacher_weight: [V, H_t] the teacher's head weight, with the student's vocabulary V (no gradient: freeze
            it with ``requires_grad_(False)`` or pass ``.detach()``).
        target: [...] token ids (the leading shape): tokens whose target is ``ignore_index`` carry no loss, and
            ``hard_weight`` needs it. None: every token carries a loss.
        student_bias, teacher_bias: optional [V] head biases (the teacher's gets no gradient).
        divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: JSD's teacher weight in [0, 1] (only ``"jsd"`` reads it).
        temperature: a positive float, or a positive tensor in the leading shape (one per token); divides both
            sides' logits before their softmaxes (not the cross-entropy's).
        hard_weight: the cross-entropy's weight in [0, 1] (> 0 needs ``target``).
        top_k: the divergence over the teacher's ``top_k`` largest logits of each token, both distributions
            renormalized over them (in [1, V]; None: the whole vocabulary). The cross-entropy stays over V.
        ignore_index: targets equal to it carry no loss and no gradient.
        reduction: ``"mean"`` (over the tokens that carry a loss; ``token_weight`` does not change the count),
            ``"sum"``, or ``"none"`` (per token in the leading shape, 0 where ignored).
        token_weight: optional float weights in the leading shape multiplying each token's loss (no gradient).
        vocab_size: the vocabulary the two heads share, for heads padded to different row counts for one tokenizer
            (Qwen2.5-7B's head has 152064 rows, Qwen2.5-0.5B's 151936, for 151665 tokens): the loss (divergence and
            cross-entropy) runs over the first ``vocab_size`` rows of each head (a view: no copy), both
            distributions over those tokens; rows past it take no part and get no gradient. At most either head's
            rows; targets must lie below it. None: the heads must have the same rows.
        student_softcap, teacher_softcap: if set, that side's logits become ``c tanh(logits / c)`` (after the
            logit scale, before the temperature).
        student_logit_scale, teacher_logit_scale: positive factors of each side's logits (before the softcap).
        logits_precision: both heads' logits GEMMs, as :func:`~lightning_flce.fused_linear_cross_entropy`'s
            (``"input"``, ``"fp32"``, ``"fp32_head"``, ``"fp32_compensated"``).
        accum_dtype: the student's dW accumulator over chunks, as :func:`~lightning_flce.fused_linear_cross_entropy`'s
            (a ``torch.dtype`` or its name). None: fp32 for 16-bit GEMMs over several chunks (dW rounded once);
            the weight's own dtype (``torch.bfloat16``) drops the [V, H] fp32 accumulator and its cast in
            backward (V H 4 bytes less at the peak, 2 GiB at V = 128256, H = 4096; Liger's accumulation), and
            rounds dW once per chunk.
        chunk_size: tokens per chunk (None: from a memory budget that counts both heads' chunk buffers).
        impl: ``"triton"``, ``"torch"`` or ``"auto"`` (the top-k divergence runs in PyTorch on either).

    Returns:
        The loss in fp32 (fp64 for fp64 student inputs): 0-d, or per token for ``reduction="none"``.

    Under ``torch.autocast`` both heads' GEMMs run in the autocast dtype (as ``nn.Linear``'s; fp64 tensors are left
    alone), and the student's fp32 parameters get fp32 gradients. Outside autocast each head runs in its own
    inputs' dtype (a bf16 teacher beside an fp32 student is fine). "mean"/"sum" compute the student's gradients in
    forward (backward scales them once); "none" recomputes the chunks in backward (about twice the GEMMs).
    """
    check_teacher(student_input, student_weight, teacher_input, teacher_weight, teacher_bias, vocab_size)
    student_weight, student_bias = vocab_rows(student_weight, student_bias, vocab_size)
    teacher_weight, teacher_bias = vocab_rows(teacher_weight, teacher_bias, vocab_size)
    return _distillation(
        student_input,
        student_weight,
        target,
        student_bias=student_bias,
        teacher_head=(teacher_input, teacher_weight, teacher_bias),
        teacher_top_k=None,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        hard_weight=hard_weight,
        top_k=top_k,
        ignore_index=ignore_index,
        reduction=reduction,
        token_weight=token_weight,
        student_softcap=student_softcap,
        teacher_softcap=teacher_softcap,
        student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        logits_precision=logits_precision,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        impl=impl,
    )


def fused_linear_distillation_from_top_k(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_indices: Tensor,
    teacher_logits: Tensor,
    target: Optional[Tensor] = None,
    *,
    student_bias: Optional[Tensor] = None,
    divergence: Divergence = "jsd",
    beta: float = 0.5,
    temperature: Union[float, Tensor] = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    token_weight: Optional[Tensor] = None,
    vocab_size: Optional[int] = None,
    student_softcap: Optional[float] = None,
    student_logit_scale: float = 1.0,
    logits_precision: LogitsPrecision = "input",
    accum_dtype: AccumDtype = None,
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> Tensor:
    """:func:`fused_linear_distillation` with ``top_k`` for a teacher given by its cached top k instead of a head:
    each token's k columns ``teacher_indices`` and the teacher's logits there ``teacher_logits`` (stored offline,
    e.g. a large teacher's top-20 log-probabilities). The divergence is over those k columns, both distributions
    renormalized over them (the student's logits gathered there, after its softcap and logit scale); the
    cross-entropy (``hard_weight``) stays over the whole vocabulary. The student's head runs as in
    :func:`fused_linear_distillation` (its logits per chunk, no [N, V] tensor); no teacher GEMM runs.

    Args:
        teacher_indices: [..., k] integer columns in [0, V), the student's leading shape; no column twice in a
            token's entries.
        teacher_logits: [..., k] float, the teacher's logits at those columns, or its log-probabilities (the
            renormalization over k makes the two the same); divided by ``temperature``, no other transform (apply
            the teacher's softcap and logit scale before storing them). An entry of -inf is padding (a token with
            fewer than k entries): left out of both distributions, its index ignored. No gradient.

    The other arguments are :func:`fused_linear_distillation`'s. Tokens that carry a loss need at least one entry
    that is not padding; bad entries there (an index outside [0, V), a NaN or +inf logit, a column twice) raise a
    ``ValueError`` before any kernel runs (one host sync, with the targets' check).
    """
    check_top_k_teacher(student_input, student_weight, teacher_indices, teacher_logits)
    _check_vocab_size(vocab_size, student_weight)
    student_weight, student_bias = vocab_rows(student_weight, student_bias, vocab_size)
    return _distillation(
        student_input,
        student_weight,
        target,
        student_bias=student_bias,
        teacher_head=None,
        teacher_top_k=(teacher_indices, teacher_logits),
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        hard_weight=hard_weight,
        top_k=None,
        ignore_index=ignore_index,
        reduction=reduction,
        token_weight=token_weight,
        student_softcap=student_softcap,
        teacher_softcap=None,
        student_logit_scale=student_logit_scale,
        teacher_logit_scale=1.0,
        logits_precision=logits_precision,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        impl=impl,
    )


def _distillation(*args: Any, **kwargs: Any) -> Tensor:
    """The two front ends' shared body: the options checked, the per-token scale built (:func:`distillation_op_args`),
    the op called."""
    op_args = distillation_op_args(*args, **kwargs)
    if kwargs["reduction"] == "none":
        return flce_distill_per_token(*op_args)[0].view(op_args[OP_ARG_NAMES.index("target")].shape)
    return flce_distill(*op_args)[0]


def distillation_op_args(
    student_input: Tensor,
    student_weight: Tensor,
    target: Optional[Tensor],
    *,
    student_bias: Optional[Tensor],
    teacher_head: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]],
    teacher_top_k: Optional[Tuple[Tensor, Tensor]],
    divergence: str,
    beta: float,
    temperature: Union[float, Tensor],
    hard_weight: float,
    top_k: Optional[int],
    ignore_index: int,
    reduction: str,
    token_weight: Optional[Tensor],
    student_softcap: Optional[float],
    teacher_softcap: Optional[float],
    student_logit_scale: float,
    teacher_logit_scale: float,
    logits_precision: str,
    accum_dtype: AccumDtype,
    chunk_size: Optional[int],
    impl: str,
    vocab_sharded: bool = False,
) -> Tensor:
    """The distillation op's arguments (by :data:`~lightning_flce.distill.op.OP_ARG_NAMES`) of a call: the options
    checked and resolved, the per-token scale built (the vocab-parallel op builds its own call from them too). The
    teacher is ``teacher_head`` (input, weight, bias) or ``teacher_top_k`` (indices, logits), checked by the
    caller. ``vocab_sharded``: the weights are one rank's rows, so ``top_k`` is checked against the whole
    vocabulary by the caller (after the ranks' agreement), not against them."""
    _check_options(divergence, beta, hard_weight, target, top_k, None if vocab_sharded else student_weight)
    if divergence == "jsd" and beta == 0.0:  # the limits of the generalized JSD, as TRL and Liger map them
        divergence = "forward_kl"
    elif divergence == "jsd" and beta == 1.0:
        divergence = "reverse_kl"
    scales = {}
    for name, value in (
        ("student_logit_scale", student_logit_scale),
        ("teacher_logit_scale", teacher_logit_scale),
    ):
        scales[name] = _positive_float(name, value)
    softcaps = {}
    for name, value in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        softcaps[name] = 0.0 if value is None else _positive_float(name, value)

    if target is None:
        target = torch.zeros(student_input.shape[:-1], dtype=torch.int64, device=student_input.device)
        ignore_index = -1  # no token is ignored
    options = FLCEOptions.of(
        ignore_index=ignore_index,
        reduction=reduction,
        token_weight=token_weight,
        logits_precision=logits_precision,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        impl=impl,
    )
    teacher_input, teacher_weight, teacher_bias = teacher_head or (None, None, None)
    options, compute_dtype, backend = checked_call(
        student_input, student_weight, target, student_bias, options
    )
    teacher_dtype = (
        compute_dtype
        if teacher_input is None or teacher_weight is None
        else _teacher_compute_dtype(teacher_input, teacher_weight, target, teacher_bias, logits_precision)
    )
    dtype = softmax_dtype(compute_dtype)
    target = class_indices(target)
    inv_temperature = inverse_temperature(temperature, target, dtype)

    token_scale = loss_token_scale(target, ignore_index, reduction, token_weight, dtype)

    top_k_indices, top_k_logits = teacher_top_k or (None, None)
    grad_enabled = torch.is_grad_enabled()
    args = (
        student_input,
        student_weight,
        student_bias,
        teacher_input,
        teacher_weight,
        teacher_bias,
        None if top_k_indices is None else top_k_indices.to(torch.int64),  # any integer dtype, checked
        None if top_k_logits is None else top_k_logits.detach(),
        target,
        token_scale,
        inv_temperature,
        divergence,
        float(beta),
        float(hard_weight),
        top_k or 0,
        ignore_index,
        softcaps["student_softcap"],
        softcaps["teacher_softcap"],
        scales["student_logit_scale"],
        scales["teacher_logit_scale"],
        options.logits_precision,
        compute_dtype,
        teacher_dtype,
        options.accum_dtype,
        options.chunk_size or 0,
        backend.name,
        grad_enabled and student_input.requires_grad,
        grad_enabled and student_weight.requires_grad,
        grad_enabled and student_bias is not None and student_bias.requires_grad,
    )
    return args


def loss_token_scale(
    target: Tensor, ignore_index: int, reduction: str, token_weight: Optional[Tensor], dtype: torch.dtype
) -> Tensor:
    """Each token's factor on its loss, [1] or [N] (with ``token_weight``) in ``dtype``: for "mean" 1 / the tokens
    that carry a loss (counted on the device: no host sync; without a target ``ignore_index`` is -1 and every token
    counts), times ``token_weight``. The vocab-parallel op calls it again on the sequence-parallel group's tokens."""
    if reduction == "mean":
        counted = (target != ignore_index).sum().to(dtype)
        token_scale = (1.0 / counted.clamp(min=1.0)).reshape(1)
    else:
        token_scale = torch.ones(1, dtype=dtype, device=target.device)
    if token_weight is not None:
        token_scale = token_scale * token_weight.detach().reshape(-1).to(dtype)
    return token_scale


def _positive_float(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


def _check_options(
    divergence: str,
    beta: float,
    hard_weight: float,
    target: Optional[Tensor],
    top_k: Optional[int],
    student_weight: Optional[Tensor],
) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    for name, value in (("beta", beta), ("hard_weight", hard_weight)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a float in [0, 1], got {value!r}")
    if hard_weight > 0 and target is None:
        raise ValueError(f"hard_weight={hard_weight} mixes in the cross-entropy on target: pass target")
    if top_k is not None:
        check_top_k(
            top_k,
            student_weight.shape[0] if student_weight is not None and student_weight.dim() == 2 else None,
        )


def check_top_k(top_k: Any, vocab: Optional[int]) -> None:
    """``top_k`` an int in ``[1, vocab]`` (None: the vocabulary is not known yet, a shard's rows)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1 or (vocab and top_k > vocab):
        bounds = f"[1, V={vocab}]" if vocab else "[1, V]"
        raise ValueError(f"top_k must be None or an int in {bounds}, got {top_k!r}")


def check_top_k_columns(indices: Tensor, vocab: int) -> None:
    """A cached teacher's k columns a token fit in the vocabulary."""
    if indices.shape[-1] > vocab:
        raise ValueError(f"teacher_indices has k={indices.shape[-1]} columns per token, more than V={vocab}")


def vocab_rows(
    weight: Tensor, bias: Optional[Tensor], vocab_size: Optional[int]
) -> Tuple[Tensor, Optional[Tensor]]:
    """A head's ``weight`` and ``bias`` over its first ``vocab_size`` rows (views; as given for None or all rows)."""
    if vocab_size is None or weight.shape[0] == vocab_size:
        return weight, bias
    return weight[:vocab_size], None if bias is None else bias[:vocab_size]


def _check_vocab_size(vocab_size: Optional[int], *weights: Tensor) -> None:
    if vocab_size is None:
        return
    rows = [weight.shape[0] for weight in weights if weight.dim() == 2]
    if not rows:  # (the weights' own checks raise)
        return
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= min(rows):
        raise ValueError(
            f"vocab_size must be None or an int in [1, {min(rows)}] (at most each head's rows: {rows}), got"
            f" {vocab_size!r}"
        )


def check_teacher(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Optional[Tensor],
    vocab_size: Optional[int],
) -> None:
    """The teacher's shapes and devices against the student's, the shared vocabulary, and no gradient to it."""
    if torch.is_grad_enabled():
        for name, tensor in (
            ("teacher_input", teacher_input),
            ("teacher_weight", teacher_weight),
            ("teacher_bias", teacher_bias),
        ):
            if tensor is not None and tensor.requires_grad:
                raise ValueError(
                    f"{name} requires grad, but the teacher gets no gradient from the distillation loss: run the"
                    " teacher under torch.no_grad() (and freeze its head with requires_grad_(False)), or pass"
                    f" {name}.detach()"
                )
    if teacher_weight.dim() != 2 or student_weight.dim() != 2:
        raise ValueError(
            f"expected head weights [V, H], got student {tuple(student_weight.shape)} and teacher"
            f" {tuple(teacher_weight.shape)}"
        )
    _check_vocab_size(vocab_size, student_weight, teacher_weight)
    if vocab_size is None and teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"vocabulary mismatch: the student's head has V={student_weight.shape[0]}, the teacher's"
            f" V={teacher_weight.shape[0]} (distillation needs the same vocabulary on both sides). Heads padded to"
            " different row counts for one tokenizer (Qwen2.5-7B's 152064 rows, 0.5B's 151936): pass vocab_size="
            "the tokenizer's size (or the smaller head's rows) to distill over the rows they share"
        )
    if teacher_input.dim() < 1 or teacher_input.shape[:-1] != student_input.shape[:-1]:
        raise ValueError(
            f"teacher_input's leading shape {tuple(teacher_input.shape[:-1])} does not match student_input's"
            f" {tuple(student_input.shape[:-1])} (one teacher hidden state per student token)"
        )
    if teacher_input.shape[-1] != teacher_weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: teacher_input has H={teacher_input.shape[-1]}, teacher_weight is"
            f" {tuple(teacher_weight.shape)}"
        )
    for name, tensor in (
        ("teacher_input", teacher_input),
        ("teacher_weight", teacher_weight),
        ("teacher_bias", teacher_bias),
    ):
        if tensor is not None and tensor.device != student_input.device:
            raise ValueError(f"{name} is on {tensor.device} but student_input is on {student_input.device}")


def check_top_k_teacher(
    student_input: Tensor, student_weight: Optional[Tensor], indices: Tensor, logits: Tensor
) -> None:
    """A cached teacher's top k against the student: shapes, dtypes, devices, no gradient (its values are checked
    in the op's host sync); k against the head's rows unless ``student_weight`` is None (a shard's: the
    vocab-parallel op checks k against the whole vocabulary)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        raise ValueError(
            "teacher_logits requires grad, but the teacher gets no gradient from the distillation loss: pass"
            " teacher_logits.detach()"
        )
    lead = tuple(student_input.shape[:-1])
    if indices.dim() != len(lead) + 1 or tuple(indices.shape[:-1]) != lead or indices.shape[-1] < 1:
        raise ValueError(
            f"teacher_indices must be [..., k] with the student's leading shape {lead} and k >= 1, got"
            f" {tuple(indices.shape)}"
        )
    if logits.shape != indices.shape:
        raise ValueError(
            f"teacher_logits must have teacher_indices' shape {tuple(indices.shape)}, got {tuple(logits.shape)}"
        )
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise TypeError(f"teacher_indices must be an integer tensor, got {indices.dtype}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"teacher_logits must be a floating-point tensor, got {logits.dtype}")
    if student_weight is not None and student_weight.dim() == 2:
        check_top_k_columns(indices, student_weight.shape[0])
    for name, tensor in (("teacher_indices", indices), ("teacher_logits", logits)):
        if tensor.device != student_input.device:
            raise ValueError(f"{name} is on {tensor.device} but student_input is on {student_input.device}")


def _teacher_compute_dtype(
    teacher_input: Tensor,
    teacher_weight: Tensor,
    target: Tensor,
    teacher_bias: Optional[Tensor],
    logits_precision: str,
) -> torch.dtype:
    """The teacher GEMM's dtype: the autocast dtype under autocast, else its inputs' (checked as the student's);
    fp32 for ``logits_precision="fp32_head"`` with 16-bit operands."""
    try:
        dtype = check_inputs(teacher_input, teacher_weight, target, teacher_bias, FLCEOptions())
    except (TypeError, ValueError) as error:
        raise type(error)(f"teacher head: {error}") from None
    if logits_precision == "fp32_head" and dtype in LOW_PRECISION:
        return torch.float32
    return dtype


class FusedLinearDistillationLoss(torch.nn.Module):
    """:func:`fused_linear_distillation` as a module: the loss's options (``divergence``, ``beta``, ``temperature``,
    ``hard_weight``, ``top_k``, each side's softcap and logit scale, ``logits_precision``, ...) set once;
    ``forward(student_input, student_weight, teacher_input, teacher_weight, target=None, *, student_bias=None,
    teacher_bias=None, token_weight=None)`` returns the loss."""

    #: the arguments of :func:`fused_linear_distillation` given per call (``forward``), not to the constructor
    PER_CALL = ("student_bias", "teacher_bias", "token_weight")

    def __init__(
        self,
        *,
        divergence: Divergence = "jsd",
        beta: float = 0.5,
        temperature: Union[float, Tensor] = 1.0,
        hard_weight: float = 0.0,
        top_k: Optional[int] = None,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        vocab_size: Optional[int] = None,
        student_softcap: Optional[float] = None,
        teacher_softcap: Optional[float] = None,
        student_logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logits_precision: LogitsPrecision = "input",
        accum_dtype: AccumDtype = None,
        chunk_size: Optional[int] = None,
        impl: ImplName = "auto",
    ) -> None:
        # the function's keyword options less PER_CALL, under the same names and defaults
        # (tests/test_distill.py checks the two signatures agree)
        super().__init__()
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
        self.options: Dict[str, Any] = dict(
            divergence=divergence,
            beta=beta,
            temperature=temperature,
            hard_weight=hard_weight,
            top_k=top_k,
            ignore_index=ignore_index,
            reduction=reduction,
            vocab_size=vocab_size,
            student_softcap=student_softcap,
            teacher_softcap=teacher_softcap,
            student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale,
            logits_precision=logits_precision,
            accum_dtype=accum_dtype,
            chunk_size=chunk_size,
            impl=impl,
        )

    def forward(
        self,
        student_input: Tensor,
        student_weight: Tensor,
        teacher_input: Tensor,
        teacher_weight: Tensor,
        target: Optional[Tensor] = None,
        *,
        student_bias: Optional[Tensor] = None,
        teacher_bias: Optional[Tensor] = None,
        token_weight: Optional[Tensor] = None,
    ) -> Tensor:
        return fused_linear_distillation(
            student_input,
            student_weight,
            teacher_input,
            teacher_weight,
            target,
            student_bias=student_bias,
            teacher_bias=teacher_bias,
            token_weight=token_weight,
            **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())
