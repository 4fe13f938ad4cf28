"""Plain-PyTorch twin of the distillation chunk kernel (:mod:`lightning_flce.kernels.distill`; same contract, same
formulas), for the CPU, devices without Triton, fp64, and the top-k teacher path on every backend.

Per row of a chunk (each side's transform ``z = inv_t * softcap'(r)``, ``softcap'(r) = c' tanh(r / c')``):
``p = softmax(z_s)`` (the student), ``q = softmax(z_t)`` (the teacher), in the softmax dtype (fp32; fp64 for fp64
student logits), every divergence written in log space so that a probability that underflows to 0 adds 0:

- ``"forward_kl"``: ``KL(q || p) = sum q (log q - log p)``, ``d/dz_s = p - q``;
- ``"reverse_kl"``: ``KL(p || q) = sum p (log p - log q)``, ``d/dz_s = p (log p - log q - KL(p || q))``;
- ``"jsd"``: ``M = beta q + (1 - beta) p``; ``beta KL(q || M) + (1 - beta) KL(p || M)``,
  ``d/dz_s = (1 - beta) p (log p - log M - KL(p || M))``;

plus, with ``hard_weight`` w > 0, the student's cross-entropy on ``target`` of ``z_c = ce_inv_t * softcap'(r_s)``
(the logit scale, no temperature). Row loss ``token_scale ((1 - w) div + w ce)``; the logit gradient
``token_scale ((1 - w) inv_t_s d/dz_s + w ce_inv_t (softmax(z_c) - onehot)) (1 - (softcap'(r_s) / c')^2)``.

Workspace (the chunk-size rule, :data:`WORKSPACE_COPIES`): [C, V] copies in the softmax dtype held at once, at most
four (``"jsd"``: log p, log(beta q), log M and their difference; the KLs three), and 1-byte masks. The teacher's
logits and the student's are read only until the gradient is written at the end.

Every reduction over a row's columns (the log-sum-exps, the divergence's row sums, the target's column) goes
through a :class:`RowReductions`: the local one here, and the vocab-parallel op's
(:class:`lightning_flce.parallel.distill.ShardRowReductions`), whose rows are one rank's columns of the vocabulary
and whose sums are all-reduced over the group: one formula for both.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from lightning_flce.kernels import copy_gradient, softmax_dtype
from lightning_flce.kernels.transform_torch import transform_backward, transform_slope, transformed_logits

#: [C, V] softmax-dtype copies held at once ("jsd"'s four; see the module docstring).
WORKSPACE_COPIES = 4

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(1)`` without a [C, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class RowReductions:
    """The reductions over a chunk's columns that the twin's formulas need, on a chunk that holds whole rows.
    A subclass whose chunks hold a slice of each row's columns makes them global (the vocab-parallel op's, one
    collective per call: each method takes every row statistic it can at once)."""

    def logsumexp(self, *z: Tensor) -> Tuple[Tensor, ...]:
        """[C, 1] for each [C, V] of ``z``: each row's log-sum-exp over the vocabulary."""
        return tuple(torch.logsumexp(values, dim=1, keepdim=True) for values in z)

    def row_sums(self, partial: Tensor) -> Tensor:
        """[k, C]: the sums over the vocabulary of the [k, C] sums over the chunk's columns (``partial``)."""
        return partial

    def at_target(self, values: Tensor, target: Tensor) -> Tensor:
        """[C]: each row's ``values`` at its ``target`` column (a vocabulary index)."""
        return values.gather(1, target.unsqueeze(1)).squeeze(1)

    def add_at_target_(self, values: Tensor, target: Tensor, value: float) -> None:
        """``values[row, target[row]] += value``, in place."""
        values.scatter_add_(1, target.unsqueeze(1), values.new_full((values.shape[0], 1), value))


#: the reductions of a chunk of whole rows (every backend's single-device op)
WHOLE_ROWS = RowReductions()


def _transformed(
    logits: Tensor,
    softcap: float,
    inv_temperature: Tensor,
    dtype: torch.dtype,
    excluded: Optional[Tensor] = None,
) -> Tensor:
    """``inv_t * softcap'(logits)`` as a new ``dtype`` tensor; columns where ``excluded`` is True get -inf
    (probability 0; the transform would map a -inf logit to -c)."""
    z, _ = transformed_logits(logits.to(dtype), softcap, inv_temperature)
    if excluded is not None:
        z.masked_fill_(excluded, float("-inf"))
    return z


def _log_softmax_(reductions: RowReductions, *z: Tensor) -> Tuple[Tensor, ...]:
    """Each of ``z`` turned into its log-softmax, in place."""
    return tuple(values.sub_(lse) for values, lse in zip(z, reductions.logsumexp(*z)))


def _divergence(
    logp: Tensor,
    logq: Tensor,
    divergence: str,
    beta: float,
    compute_grad: bool,
    reductions: RowReductions = WHOLE_ROWS,
) -> Tuple[Tensor, Optional[Tensor]]:
    """(the divergence per row, ``d/dz_s`` or None). Consumes ``logp`` and ``logq`` (overwritten; the gradient is
    written over one of them)."""
    if divergence == "forward_kl":
        q = logq.exp()
        diff = logq.sub_(logp).masked_fill_(q == 0, 0.0)  # q = 0 adds 0 (also for a -inf teacher logit)
        div = reductions.row_sums(_row_dot(q, diff).unsqueeze(0))[0]
        del diff
        return div, logp.exp_().sub_(q) if compute_grad else None
    if divergence == "reverse_kl":
        p = logp.exp()
        diff = logq.neg_().add_(logp).masked_fill_(p == 0, 0.0)  # log p - log q
        div = reductions.row_sums(_row_dot(p, diff).unsqueeze(0))[0]
        return div, diff.sub_(div.unsqueeze(1)).mul_(p) if compute_grad else None
    if divergence == "jsd":
        log_beta_q = logq.add_(math.log(beta))
        log_m = torch.logaddexp(log_beta_q, logp + math.log1p(-beta))  # log M
        # beta KL(q || M) = sum beta q (log(beta q) - log M) - beta log beta
        diff = log_beta_q - log_m
        beta_q = log_beta_q.exp_()
        teacher_sum = _row_dot(beta_q, diff.masked_fill_(beta_q == 0, 0.0))
        del beta_q, log_beta_q
        diff = torch.sub(logp, log_m, out=diff)  # log p - log M (logq's memory is free again)
        del log_m
        p = logp.exp_()
        sums = reductions.row_sums(torch.stack((teacher_sum, _row_dot(p, diff.masked_fill_(p == 0, 0.0)))))
        teacher_term, kl_pm = sums[0] - beta * math.log(beta), sums[1]
        div = teacher_term + (1.0 - beta) * kl_pm
        return div, diff.sub_(kl_pm.unsqueeze(1)).mul_(p).mul_(1.0 - beta) if compute_grad else None
    raise ValueError(f"divergence must be one of {DIVERGENCES} or None, got {divergence!r}")


def distill_chunk(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target: Tensor,
    *,
    divergence: Optional[str],
    beta: float,
    student_inv_temperature: Tensor,
    teacher_inv_temperature: Tensor,
    ce_inv_temperature: Tensor,
    student_softcap: float,
    teacher_softcap: float,
    hard_weight: float,
    token_scale: Tensor,
    compute_grad: bool,
    grad_out: Optional[Tensor] = None,
    student_excluded: Optional[Tensor] = None,
    teacher_scratch: bool = False,
    reductions: RowReductions = WHOLE_ROWS,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """One chunk of the distillation loss (see the module docstring).

    Args:
        student_logits: [C, V] the student's raw logits (compute dtype, or fp32 wide logits); with
            ``compute_grad`` and no ``grad_out``, overwritten by ``d loss / d student_logits``.
        teacher_logits: [C, V] the teacher's raw logits, any float dtype (any row stride), read only.
        target: [C] int64 in [0, V); read only when ``hard_weight != 0``.
        divergence: ``"forward_kl"``, ``"reverse_kl"``, ``"jsd"``, or None (the cross-entropy term only: the
            divergence rows are 0).
        beta: the teacher's weight in JSD's mixture (0 < beta < 1 for ``"jsd"``).
        student_inv_temperature, teacher_inv_temperature, ce_inv_temperature: fp32 [1] or [C].
        student_softcap, teacher_softcap: ``c'`` (already divided by the logit scale); 0.0: none.
        hard_weight: w in [0, 1].
        token_scale: fp32 [1] or [C], multiplies each row's loss and its gradient.
        compute_grad: write the gradient.
        grad_out: [C, V] tensor the gradient goes to (may be
            :func:`~lightning_flce.kernels.gradient_in_logits_rows` of ``student_logits``).
        student_excluded: [C, V] bool, columns left out of the student's distribution (probability 0, gradient
            0; a cached teacher's padding, whose teacher logits are -inf); the divergence's only.
        teacher_scratch: the caller allows ``teacher_logits`` to be overwritten (the Triton kernel's JSD keeps
            ``log p - log M`` there); this twin reads it only.
        reductions: the row reductions (:class:`RowReductions`); the vocab-parallel op's make a shard's sums
            global (``target`` is then a global index, ``V`` the shard's columns).

    Returns:
        ``(loss_rows, divergence_rows, ce_rows)``: [C] each in the softmax dtype; ``ce_rows`` None when
        ``hard_weight == 0``.
    """
    dtype = softmax_dtype(student_logits.dtype)
    n_rows = student_logits.shape[0]
    scale = token_scale.to(dtype).reshape(-1)
    grad = None
    if divergence is not None:
        logp, logq = _log_softmax_(
            reductions,
            _transformed(student_logits, student_softcap, student_inv_temperature, dtype, student_excluded),
            _transformed(teacher_logits, teacher_softcap, teacher_inv_temperature, dtype),
        )
        div_rows, grad = _divergence(
            logp, logq, divergence, beta, compute_grad and hard_weight != 1.0, reductions
        )
        del logp, logq
        if grad is not None:
            factor = student_inv_temperature.to(dtype).reshape(-1, 1) * (1.0 - hard_weight)
            grad.mul_(factor)
    else:
        div_rows = torch.zeros(n_rows, dtype=dtype, device=student_logits.device)

    ce_rows = None
    if hard_weight != 0.0:
        ce_inv_t = ce_inv_temperature.to(dtype).reshape(-1, 1)
        (log_pc,) = _log_softmax_(
            reductions, _transformed(student_logits, student_softcap, ce_inv_temperature, dtype)
        )
        ce_rows = -reductions.at_target(log_pc, target)
        if compute_grad:
            grad_ce = log_pc.exp_()
            reductions.add_at_target_(grad_ce, target, -1.0)
            grad_ce.mul_(ce_inv_t * hard_weight)
            grad = grad_ce if grad is None else grad.add_(grad_ce)
        del log_pc

    loss_rows = div_rows * (1.0 - hard_weight)
    if ce_rows is not None:
        loss_rows = loss_rows + hard_weight * ce_rows
    loss_rows = loss_rows * scale
    if compute_grad:
        if grad is None:  # divergence None and hard_weight 0: no loss, a zero gradient
            grad = torch.zeros(student_logits.shape, dtype=dtype, device=student_logits.device)
        grad.mul_(scale.reshape(-1, 1))
        if student_softcap > 0.0:
            _, capped = transformed_logits(student_logits.to(dtype), student_softcap)
            transform_backward(grad, transform_slope(capped, student_softcap))
            del capped
        copy_gradient(grad, student_logits if grad_out is None else grad_out)
    return loss_rows, div_rows, ce_rows
