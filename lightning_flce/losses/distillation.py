"""Logit distillation as a chunk loss: the divergence between a frozen teacher's and the student's distributions
over the vocabulary, plus an optional hard-label cross-entropy, with the student's logit gradient written in the
same pass (:func:`~lightning_flce.kernels.distill_torch.distill_chunk`, a backend's ``distill_chunk``).

The teacher is the chunk loss's :class:`~lightning_flce.chunk_loss.AuxiliaryHead`: the engine computes its logits
for the chunk's rows into a second reused buffer (no gradient), so neither side's [N, V] logits exist. Per token
(``divergence`` as in TRL's ``generalized_jsd_loss`` and Liger's fused JSD; beta 0 and 1 are mapped to the KLs by
the front end)::

    loss = token_scale * ((1 - hard_weight) * divergence(teacher, student) + hard_weight * CE(student, target))

``top_k``: the divergence over the teacher's k largest logits of each row, both distributions renormalized over
them (a sparse teacher); written in PyTorch on [C, k] on every backend: the student's logits at those
columns are gathered before the kernel writes the cross-entropy's gradient over the chunk, and the top-k
divergence's gradient is added at them afterwards.

``teacher_top_k``: a teacher given by its k largest logits per token instead of a head (cached teacher outputs:
``indices`` [N, k] and ``logits`` [N, k], side inputs gathered per chunk like the other per-token ones); the same
top-k divergence over those columns. An entry whose teacher logit is -inf is padding (a token with fewer than k
entries): it is left out of both distributions, whatever its index.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Literal, Optional, Tuple, get_args

import torch
from torch import Tensor

from lightning_flce.chunk_loss import AuxiliaryHead, ChunkLoss, OutputSpec
from lightning_flce.kernels import distill_torch, softmax_dtype

#: ``divergence`` of the distillation front end: KL(teacher || student), KL(student || teacher), generalized JSD.
Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
DIVERGENCES: tuple[str, ...] = get_args(Divergence)

#: The side-input key of the teacher's chunk logits.
TEACHER_LOGITS = "teacher_logits"
#: The side-input keys of a cached teacher's top-k columns and logits ([N, k] each).
TEACHER_TOP_K_INDICES = "teacher_top_k_indices"
TEACHER_TOP_K_LOGITS = "teacher_top_k_logits"


def divergence_grad_bound(divergence: str, beta: float, vocab: int) -> float:
    """A bound on any element of a row's ``d divergence / d z_s`` whose row sums to at most twice it
    (:meth:`~lightning_flce.chunk_loss.ChunkLoss.fp16_logit_grad_bound`'s contract), over ``vocab`` columns.

    - ``"forward_kl"``: ``|p_j - q_j| <= 1``, summing to at most 2: exact.
    - ``"jsd"``: ``(1 - beta) p_j (a_j - KL(p || M))`` with ``a_j = log(p_j / M_j)``. As ``M_j >= (1 - beta) p_j``,
      ``a_j <= L = -log(1 - beta)`` and ``KL(p || M) <= L``; as ``M_j <= 1``, ``p_j a_j >= p_j log p_j >= -1/e``
      and ``sum_j p_j |a_j| <= H(p) + L <= log V + L``. So an element is at most ``(1 - beta) (1/e + 2 L)`` and a
      row sums to at most ``(1 - beta) (log V + 2 L)``: the bound ``(1 - beta) (1/e + log V + 2 L)`` is exact.
    - ``"reverse_kl"``: ``p_j (log p_j - log q_j - KL(p || q))`` has no bound without the teacher's logits
      (``-log q_j`` grows with the teacher's logit range where the student puts mass). The bound taken,
      ``1/e + log V``, covers ``p_j |log(p_j / q_j)|`` up to about ``log V``; the fp16 factor's 64x headroom
      (:data:`lightning_flce.engine._FP16_LOGIT_GRAD_MAX`) covers up to about ``64 (1/e + log V)`` (~780 nats at
      V = 128K), far beyond the logit ranges of trained models.
    """
    log_vocab = math.log(max(vocab, 2))
    if divergence == "forward_kl":
        return 1.0
    if divergence == "jsd":
        mixture_log_bound = -math.log1p(-beta)
        return (1.0 - beta) * (1.0 / math.e + log_vocab + 2.0 * mixture_log_bound)
    return 1.0 / math.e + log_vocab


class TopKColumns:
    """Where the top-k divergence's columns are found in a chunk's logits, and how they are read and written: the
    whole vocabulary in one tensor. The vocab-parallel op's subclass
    (:class:`lightning_flce.parallel.distill.ShardTopKColumns`) finds them across the ranks' shards."""

    def select(self, teacher: Tensor, k: int) -> Tuple[Tensor, Tensor]:
        """The teacher's ``k`` largest logits of each row: (their columns [C, k] int64, the logits there)."""
        index = teacher.topk(k, dim=1, sorted=False).indices
        return index, teacher.gather(1, index)

    def gather(self, logits: Tensor, index: Tensor) -> Tensor:
        """``logits`` at the columns ``index`` [C, k], in the softmax dtype (the top-k gradient is written over
        them and added at the columns unrounded)."""
        return logits.gather(1, index).to(softmax_dtype(logits.dtype))

    def scatter_add_(self, grad: Tensor, index: Tensor, values: Tensor) -> None:
        """``grad[:, index] += values``."""
        grad.scatter_add_(1, index, values.to(grad.dtype))


class DistillationChunkLoss(ChunkLoss):
    """Outputs (loss, divergence, ce): the rows' ``token_scale``-scaled loss (scaled by the fp16 factor with it),
    their unscaled divergence, and their cross-entropy on the target (``hard_weight > 0`` only).

    Side inputs ([1] or [N]): ``token_scale`` (the gradient is linear in it: "mean"'s 1 / count times the token
    weights, or "none"'s per-token grad_output), ``student_inv_temperature`` and ``teacher_inv_temperature``
    (``logit_scale / T`` of each side), ``ce_inv_temperature`` (the student's logit scale, [1]).

    ``kernels``: what runs the per-chunk math, its ``distill_chunk``: a backend's module, or the vocab-parallel op's
    twin on a shard (:class:`lightning_flce.parallel.distill.ShardKernels`); ``teacher``: the teacher head (its logits arrive in
    ``side[teacher.name]``, :data:`TEACHER_LOGITS` by convention), or None with ``teacher_top_k`` (a cached
    teacher's ``(indices, logits)``, [N, k] each: int64 columns, logits in the softmax dtype); ``student_softcap``
    and ``teacher_softcap``: ``softcap / logit_scale`` of each side (0.0: none); ``top_k_columns``: how the top-k
    divergence finds, reads and writes its columns (:class:`TopKColumns`, or across shards).
    """

    linear_inputs = ("token_scale",)
    workspace_copies = distill_torch.WORKSPACE_COPIES

    def __init__(
        self,
        kernels: Any,
        *,
        teacher: Optional[AuxiliaryHead],
        teacher_top_k: Optional[Tuple[Tensor, Tensor]] = None,
        divergence: str,
        beta: float,
        hard_weight: float,
        top_k: Optional[int],
        student_softcap: float,
        teacher_softcap: float,
        vocab: int,
        token_scale: Tensor,
        student_inv_temperature: Tensor,
        teacher_inv_temperature: Tensor,
        ce_inv_temperature: Tensor,
        top_k_columns: Optional[TopKColumns] = None,
    ) -> None:
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
        if (teacher is None) == (teacher_top_k is None):
            raise ValueError(
                "a distillation chunk loss takes exactly one of a teacher head and a cached top-k"
            )
        self.kernels = kernels
        self.teacher = teacher
        self.divergence = divergence
        self.beta = beta
        self.hard_weight = hard_weight
        self.top_k = top_k if teacher_top_k is None else teacher_top_k[0].shape[-1]
        self.student_softcap = student_softcap
        self.teacher_softcap = teacher_softcap
        self.vocab = vocab
        self.top_k_columns = top_k_columns or TopKColumns()
        self.inputs: Dict[str, Tensor] = {
            "token_scale": token_scale,
            "student_inv_temperature": student_inv_temperature,
            "teacher_inv_temperature": teacher_inv_temperature,
            "ce_inv_temperature": ce_inv_temperature,
        }
        if teacher_top_k is not None:
            self.inputs[TEACHER_TOP_K_INDICES], self.inputs[TEACHER_TOP_K_LOGITS] = teacher_top_k

    def outputs(self) -> Tuple[OutputSpec, ...]:
        return (
            OutputSpec("loss", gradient_scaled=True),
            OutputSpec("divergence"),
            OutputSpec("ce", active=self.hard_weight != 0.0),
        )

    def side_inputs(self) -> Dict[str, Tensor]:
        return self.inputs

    def set_side_inputs(self, values: Dict[str, Tensor]) -> None:
        self.inputs = {**self.inputs, **values}

    def auxiliary_head(self) -> Optional[AuxiliaryHead]:
        return self.teacher

    def fp16_logit_grad_bound(self) -> Tensor:
        """``|token_scale| ((1 - w) inv_t_s D + w ce_inv_t)`` per token, ``D`` from :func:`divergence_grad_bound`
        (over the k columns with ``top_k``) and 1 for the cross-entropy (``|softmax - onehot|``); the softcap's
        factor is at most 1."""
        inputs = self.inputs
        columns = self.top_k if self.top_k is not None else self.vocab
        div_bound = divergence_grad_bound(self.divergence, self.beta, columns)
        w = self.hard_weight
        bound = (1.0 - w) * div_bound * inputs["student_inv_temperature"] + w * inputs["ce_inv_temperature"]
        bound = inputs["token_scale"].abs() * bound
        return torch.where(torch.isfinite(bound), bound, 0.0)  # rows that carry no loss: any temperature

    def _kernel_options(self, side: Dict[str, Tensor]) -> dict:
        return dict(
            beta=self.beta,
            student_inv_temperature=side["student_inv_temperature"],
            teacher_inv_temperature=side["teacher_inv_temperature"],
            ce_inv_temperature=side["ce_inv_temperature"],
            student_softcap=self.student_softcap,
            teacher_softcap=self.teacher_softcap,
        )

    def __call__(
        self,
        logits: Tensor,
        target: Tensor,
        rows,
        side: Dict[str, Tensor],
        *,
        compute_grad: bool,
        grad_out: Optional[Tensor],
        tile_lse=None,
    ) -> Tuple[Optional[Tensor], ...]:
        options = self._kernel_options(side)
        token_scale = side["token_scale"]
        if self.teacher is None:  # a cached teacher's top k
            teacher_k = side[TEACHER_TOP_K_LOGITS]
            padding = teacher_k == float("-inf")
            # a padding entry's index may be anything: column 0 in its place (its gradient is 0)
            index = side[TEACHER_TOP_K_INDICES].masked_fill(padding, 0)
            return self._top_k_chunk(
                logits, index, teacher_k, target, options, token_scale, compute_grad, grad_out, padding
            )
        teacher = side[self.teacher.name]
        if self.top_k is None:
            return self.kernels.distill_chunk(
                logits,
                teacher,
                target,
                divergence=self.divergence,
                hard_weight=self.hard_weight,
                token_scale=token_scale,
                compute_grad=compute_grad,
                grad_out=grad_out,
                teacher_scratch=True,  # the engine's block buffer, recomputed for the next block
                **options,
            )
        # softcap and temperature are increasing: the raw logits' top k are the transformed ones'
        index, teacher_k = self.top_k_columns.select(teacher, self.top_k)  # [C, k] each
        return self._top_k_chunk(
            logits, index, teacher_k, target, options, token_scale, compute_grad, grad_out
        )

    def _top_k_chunk(
        self,
        logits: Tensor,
        index: Tensor,
        teacher_k: Tensor,
        target: Tensor,
        options: dict,
        token_scale: Tensor,
        compute_grad: bool,
        grad_out: Optional[Tensor],
        padding: Optional[Tensor] = None,
    ) -> Tuple[Optional[Tensor], ...]:
        """The divergence over the teacher's k columns ``index`` (its logits there ``teacher_k``; PyTorch, [C, k]),
        the cross-entropy term over the whole vocabulary by the backend's kernel (skipped for ``hard_weight`` 0).
        ``padding`` ([C, k] bool, a cached teacher's -inf entries): left out of the student's distribution too."""
        w = self.hard_weight
        # gathered before the kernel writes the gradient over the logits; in the softmax dtype, so the top-k
        # gradient is not rounded before it is added
        student_k = self.top_k_columns.gather(logits, index)
        top_k_loss, div_rows, _ = distill_torch.distill_chunk(
            student_k,
            teacher_k,
            target,
            divergence=self.divergence,
            hard_weight=0.0,
            token_scale=token_scale * (1.0 - w),
            compute_grad=compute_grad and w != 1.0,
            student_excluded=padding,
            **options,
        )
        ce_rows = None
        if w != 0.0:
            ce_loss, _, ce_rows = self.kernels.distill_chunk(
                logits,
                logits,  # the teacher's place: the cross-entropy alone reads only the student's logits
                target,
                divergence=None,
                hard_weight=w,
                token_scale=token_scale,
                compute_grad=compute_grad,
                grad_out=grad_out,
                **options,
            )
            top_k_loss = top_k_loss + ce_loss
        if compute_grad:
            grad = logits if grad_out is None else grad_out
            if w == 0.0:
                grad.zero_()
            if w != 1.0:
                self.top_k_columns.scatter_add_(grad, index, student_k)
        return top_k_loss, div_rows, ce_rows
