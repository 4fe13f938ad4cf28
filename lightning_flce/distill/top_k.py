"""A head's top k per token without its [N, V] logits: :func:`fused_linear_top_k`, what a cached teacher stores for
:func:`~lightning_flce.fused_linear_distillation_from_top_k` (the teacher run once, offline, instead of in every
step of every epoch).

The chunk plug-in is :class:`~lightning_flce.losses.top_k.TopKChunkLoss` on the one chunk engine (the logits GEMM
into a reused buffer, with the call's ``logits_precision``; rows whose ``target`` is ``ignore_index`` dropped
before it), registered as the ``torch.library`` custom op ``lightning_flce::flce_top_k`` (one opaque node under
``torch.compile``; its FLOPs, one GEMM of the head, for ``torch.utils.flop_counter``). No gradient.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.engine import run_valid_rows, token_rows
from lightning_flce.functional import checked_call
from lightning_flce.kernels import BACKENDS, softmax_dtype
from lightning_flce.losses.top_k import TopKChunkLoss
from lightning_flce.options import FLCEOptions, ImplName, LogitsPrecision
from lightning_flce.rl.logprobs_op import gemm_flops, register_flops
from lightning_flce.validation import class_indices

__all__ = ["TEACHER_TOP_K_KEYS", "TopKOutput", "fused_linear_top_k", "top_k_rows"]

#: the batch keys of a cached teacher (``DistillationModule(cached_teacher=True)``, the cache's files): its top-k
#: columns and its logits (or log-probabilities) there, [B, T, K] each
TEACHER_TOP_K_KEYS = ("teacher_top_k_indices", "teacher_top_k_logits")


class TopKOutput(NamedTuple):
    """A head's top k per token: ``values`` [..., k] (log-probabilities, or transformed logits; fp32, fp64 for
    fp64 GEMMs) in descending order and their columns ``indices`` [..., k] (int64)."""

    values: Tensor
    indices: Tensor


_ARGS = (
    "Tensor x, Tensor weight, Tensor target, Tensor? bias, int k, bool log_probs, int ignore_index,"
    " float softcap, str logits_precision, ScalarType compute_dtype, int chunk_size, str backend"
)


def top_k_rows(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    *,
    k: int,
    with_lse: bool,
    ignore_index: int,
    softcap: float,
    logits_precision: str,
    compute_dtype: torch.dtype,
    chunk_size: int,
    backend: str,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The chunks of :class:`~lightning_flce.losses.top_k.TopKChunkLoss` on the head ``weight``: each token's k
    largest transformed logits [N, k] (-inf where ``target`` is ``ignore_index``), their columns [N, k] (0 there)
    and, ``with_lse``, each row's log-sum-exp [N] (0 there; else None); the targets checked in the engine's one
    host sync. The single-device op's body, and each rank's share of the vocab-parallel one's."""
    entry = BACKENDS[backend]
    unit_scale = torch.ones(1, dtype=softmax_dtype(compute_dtype), device=x.device)
    loss = TopKChunkLoss(entry.kernels(), k=k, softcap=softcap, with_lse=with_lse, unit_scale=unit_scale)
    target = target.reshape(-1)
    with torch.autocast(x.device.type, enabled=False):
        values, indices, lse, *_ = run_valid_rows(
            x,
            weight,
            target,
            bias,
            loss,
            valid=target != ignore_index,
            ignore_index=ignore_index,
            large_chunks=entry.large_chunks,
            chunk_size=chunk_size,
            compute_dtype=compute_dtype,
            logits_precision=logits_precision,
            triton_logits_gemm=backend == "triton",
            needs=(False, False, False),
            accum_dtype=None,
            grad_input_dtype=x.dtype,
        )
    return values, indices, lse if with_lse else None


def _forward(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor],
    k: int,
    log_probs: bool,
    ignore_index: int,
    softcap: float,
    logits_precision: str,
    compute_dtype: torch.dtype,
    chunk_size: int,
    backend: str,
) -> Tuple[Tensor, Tensor]:
    """(values [N, k], indices [N, k])."""
    values, indices, lse = top_k_rows(
        x,
        weight,
        target,
        bias,
        k=k,
        with_lse=log_probs,
        ignore_index=ignore_index,
        softcap=softcap,
        logits_precision=logits_precision,
        compute_dtype=compute_dtype,
        chunk_size=chunk_size,
        backend=backend,
    )
    return (values if lse is None else values - lse.unsqueeze(1)), indices


def _forward_fake(
    x, weight, target, bias, k, log_probs, ignore_index, softcap, logits_precision, compute_dtype, *_
):
    n_rows = token_rows(x)
    return (
        x.new_empty(n_rows, k, dtype=softmax_dtype(compute_dtype)),
        x.new_empty(n_rows, k, dtype=torch.int64),
    )


flce_top_k = torch.library.custom_op(
    "lightning_flce::flce_top_k", _forward, mutates_args=(), schema=f"({_ARGS}) -> (Tensor, Tensor)"
)
flce_top_k.register_fake(_forward_fake)
register_flops(torch.ops.lightning_flce.flce_top_k, lambda x, weight, *rest: gemm_flops(x, weight))


def fused_linear_top_k(
    input: Tensor,
    weight: Tensor,
    k: int,
    bias: Optional[Tensor] = None,
    *,
    target: Optional[Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    log_probs: bool = True,
    logits_precision: LogitsPrecision = "input",
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> TopKOutput:
    """Each token's ``k`` most likely columns under the head ``softcap(input @ weight.T + bias)`` and their
    log-probabilities (or logits), computed in chunks of tokens: no [N, V] logits. What a teacher's cache for
    :func:`~lightning_flce.fused_linear_distillation_from_top_k` stores.

    Equal to ``torch.log_softmax(softcap(F.linear(input, weight, bias).float()), -1).topk(k)`` (``log_probs``;
    else the top k of the transformed logits themselves), in descending order. Ties between equal logits (frequent
    among 16-bit logits) go to either column; ``logits_precision="fp32"`` computes the logits in fp32.

    Args:
        input: [..., H] hidden states.
        weight: [V, H] head weight.
        k: columns a token, an int in [1, V].
        bias: optional [V] head bias.
        target: optional [...] integer tensor with the leading shape of ``input``: tokens whose target is
            ``ignore_index`` (padding) are skipped (values -inf, indices 0: the padding of a cached top k); other
            values only need to be in [0, V) (the labels of a batch serve).
        ignore_index: see ``target``.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (a model's logit scale multiplies
            ``input`` and ``bias`` first: :func:`~lightning_flce.models.teacher_cache.teacher_top_k` does both).
        log_probs: values are log-probabilities over the whole vocabulary (the row's log-sum-exp in fp32, one more
            read of each chunk); False: the transformed logits. The distillation renormalizes over the k columns,
            so both give the same loss; log-probabilities also tell how much of the distribution the k cover.
        logits_precision, chunk_size, impl: as :func:`~lightning_flce.fused_linear_cross_entropy`'s.

    Returns:
        :class:`TopKOutput` ``(values, indices)``, [..., k] each. No gradient flows to any input.

    Raises:
        ValueError / TypeError: before any kernel, for a ``k`` outside [1, V], targets outside [0, V) other than
        ``ignore_index``, and shapes, dtypes or devices that do not match (as the cross-entropy's checks).
    """
    if target is None:
        target = torch.zeros(input.shape[:-1], dtype=torch.int64, device=input.device)
    options = FLCEOptions.of(
        ignore_index=ignore_index,
        reduction="none",
        softcap=softcap,
        logits_precision=logits_precision,
        chunk_size=chunk_size,
        impl=impl,
    )
    options, compute_dtype, backend = checked_call(input, weight, target, bias, options)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= weight.shape[0]:
        raise ValueError(f"k must be an int in [1, V={weight.shape[0]}], got {k!r}")
    # read as constants: the outputs carry no graph, whatever requires grad
    input, weight = input.detach(), weight.detach()
    bias = None if bias is None else bias.detach()
    values, indices = flce_top_k(
        input,
        weight,
        class_indices(target),
        bias,
        k,
        log_probs,
        options.ignore_index,
        options.softcap if options.softcap is not None else 0.0,
        options.logits_precision,
        compute_dtype,
        options.chunk_size or 0,
        backend.name,
    )
    shape = (*target.shape, k)
    return TopKOutput(values.view(shape), indices.view(shape))
