"""A teacher's top k per position, for distillation from a cache: :func:`teacher_top_k` (a model's hidden states
through :func:`~lightning_flce.fused_linear_top_k`, inside its LM head's call) and :class:`TeacherTopKModule`,
whose ``predict_step`` gives each batch with the teacher's top k under the keys
:class:`~lightning_flce.DistillationModule` reads with ``cached_teacher=True``.

The teacher then runs once over the corpus (``trainer.predict`` with
:class:`~lightning_flce.callbacks.TopKCacheWriter`, on as many GPUs as the strategy has), not in every step of
every epoch, and the student's epochs read the cache (:class:`~lightning_flce.data.TopKCacheDataset`) without the
teacher in memory.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_flce.distill.top_k import TopKOutput, fused_linear_top_k
from lightning_flce.head_calls import run_in_head
from lightning_flce.mixin_checks import whole_world_strategy
from lightning_flce.models.distill import (
    TEACHER_TOP_K_KEYS,
    dtype_named,
    final_hidden_states,
    keep_heads_unsharded,
    load_teacher_checkpoint,
    model_lm_head,
    shard_models_fsdp2,
    vocab_parallel_lm_head,
)
from lightning_flce.options import ImplName, LogitsPrecision
from lightning_flce.parallel import vocab_parallel_fused_linear_top_k

__all__ = ["TeacherTopKModule", "teacher_top_k"]

# the batch's keys a cache record keeps beside the teacher's top k
_KEPT_KEYS = ("input_ids", "labels", "attention_mask")


def teacher_top_k(
    model: nn.Module,
    input_ids: Tensor,
    k: int,
    attention_mask: Optional[Tensor] = None,
    *,
    log_probs: bool = True,
    logits_precision: LogitsPrecision = "input",
    chunk_size: Optional[int] = None,
    impl: ImplName = "auto",
) -> TopKOutput:
    """The ``k`` most likely next tokens of ``model`` at each position of ``input_ids`` [B, T], and their
    log-probabilities (``log_probs``) or logits: :class:`~lightning_flce.distill.top_k.TopKOutput`, [B, T, k] each,
    position t's entries the distribution of the token after t (how ``cached_teacher=True`` reads them).

    ``model``: a TinyGPT, HFCausalLM, LitGPTCausalLM or Hugging Face causal LM (its final hidden states and LM head
    found as :class:`~lightning_flce.DistillationModule` finds a teacher's). Its logit scale and softcap are applied,
    as the cache must hold them. Positions where ``attention_mask`` is 0 are skipped (values -inf, the cache's
    padding). Runs under ``torch.no_grad()``; the model's train/eval mode is the caller's (``trainer.predict`` sets
    eval).

    A tensor-parallel teacher whose LM head is a :class:`~lightning_flce.parallel.VocabParallelHead`: call it on
    every rank of the head's group with the same ``input_ids``; each rank computes on its rows
    (:func:`~lightning_flce.parallel.vocab_parallel_fused_linear_top_k`) and every rank gets the whole vocabulary's
    top k. The ranks check that they hold the same tokens (the input ids' fingerprint) before any kernel."""
    resolved = model_lm_head(model)
    sharded = vocab_parallel_lm_head(model)
    target = None
    if sharded is not None:
        # in [0, V), so that the ranks' agreement compares the tokens they were given (as the targets it checks)
        target = input_ids.remainder(sharded.vocab_size)
    elif attention_mask is not None:
        target = torch.zeros_like(input_ids, dtype=torch.int64)
    if attention_mask is not None:
        target = target.masked_fill(attention_mask == 0, -100)
    options: dict[str, Any] = dict(
        target=target,
        softcap=resolved.softcap,
        log_probs=log_probs,
        logits_precision=logits_precision,
        chunk_size=chunk_size,
        impl=impl,
    )

    def top_k_of(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple:
        if sharded is not None:  # this rank's rows of the head
            return tuple(
                vocab_parallel_fused_linear_top_k(
                    hidden, weight, k, bias, group=sharded.group, vocab_start=sharded.vocab_start, **options
                )
            )
        return tuple(fused_linear_top_k(hidden, weight, k, bias, **options))

    with torch.no_grad():
        hidden = final_hidden_states(model, input_ids, attention_mask)
        values, indices = run_in_head(
            resolved, hidden, top_k_of, caller="teacher_top_k's heads", vocab_parallel=True
        )
    return TopKOutput(values, indices)


class TeacherTopKModule(pl.LightningModule):
    """A frozen teacher whose ``predict_step`` returns the batch's ``input_ids`` (and ``labels`` and
    ``attention_mask`` where the batch has them) with the teacher's top k at each position under the keys
    ``teacher_top_k_indices`` (int32) and ``teacher_top_k_logits`` (``values_dtype``), on the CPU: the records
    :class:`~lightning_flce.callbacks.TopKCacheWriter` writes and :class:`~lightning_flce.data.TopKCacheDataset`
    reads back for ``DistillationModule(cached_teacher=True)``.

    Sharded: under ``ModelParallelStrategy`` (FSDP2) :meth:`configure_model` shards the teacher (each rank holds
    its share of the parameters and gathers one unit at a time). A tensor-parallel teacher (its LM head a
    :class:`~lightning_flce.parallel.VocabParallelHead`): run one single-device Trainer per rank of the head's
    group on the same data (or ``ModelParallelStrategy``); every rank computes the top k on its rows, and only the
    group's first rank returns the record (the others ``None``: :attr:`writes_predictions`), so the cache holds
    each batch once. Strategies that give each rank its own batches (DDP, FSDP, DeepSpeed) are refused for such a
    teacher.

    Args:
        teacher: the teacher model (see :func:`teacher_top_k`), or None with ``teacher_checkpoint``.
        teacher_checkpoint: a Lightning checkpoint of the teacher (its class as ``LastStepCheckpoint`` recorded
            it, else TinyGPT), e.g. the main job's ``last.ckpt``.
        k: entries per position.
        log_probs: store log-probabilities (True) or the teacher's transformed logits; the distillation
            renormalizes over the k entries, so both give the same loss.
        values_dtype: the stored values' dtype (``"float32"``; ``"float16"`` halves them at a relative error of
            at most 2^-11 a value).
        logits_precision, chunk_size: as :func:`~lightning_flce.fused_linear_top_k`'s.
    """

    def __init__(
        self,
        teacher: Optional[nn.Module] = None,
        *,
        teacher_checkpoint: Optional[str] = None,
        k: int = 20,
        log_probs: bool = True,
        values_dtype: Union[str, torch.dtype] = "float32",
        logits_precision: LogitsPrecision = "input",
        chunk_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if (teacher is None) == (teacher_checkpoint is None):
            raise ValueError("TeacherTopKModule needs one of teacher and teacher_checkpoint")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.save_hyperparameters(ignore=["teacher"])
        self.values_dtype = dtype_named(values_dtype, "values_dtype")
        self.teacher = teacher if teacher is not None else load_teacher_checkpoint(str(teacher_checkpoint))
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        # FSDP2 units that hold the teacher's head (not a unit of its own), kept unsharded after forward
        self._head_units: list[tuple[nn.Module, nn.Module]] = []

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> TopKOutput:
        hp = self.hparams
        return teacher_top_k(
            self.teacher,
            input_ids,
            hp.k,
            attention_mask,
            log_probs=hp.log_probs,
            logits_precision=hp.logits_precision,
            chunk_size=hp.chunk_size,
        )

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (FSDP2): the teacher sharded by its own ``configure_model``
        (TinyGPT's: every block, an untied head, then the model) over the data-parallel ranks, this module the
        root unit; each rank then gathers one unit's parameters at a time, and the head's for the top k. A no-op
        without a device mesh."""
        shard_models_fsdp2(self, (self.teacher,))
        self._head_units = keep_heads_unsharded(self, (self.teacher,))

    def on_predict_start(self) -> None:
        self._head_units = keep_heads_unsharded(self, (self.teacher,))

    def setup(self, stage: str) -> None:
        head = vocab_parallel_lm_head(self.teacher)
        if head is None or self._trainer is None or dist.get_world_size(head.group) == 1:
            return
        if whole_world_strategy(self.trainer) and self.trainer.world_size > 1:
            raise ValueError(
                f"TeacherTopKModule: the teacher's LM head is a VocabParallelHead sharded over"
                f" {dist.get_world_size(head.group)} ranks, which must all see the same batches, but"
                f" {type(self.trainer.strategy).__name__} gives each rank of the world its own. Run one"
                " single-device Trainer per rank of the head's group (the same data on each), or"
                " ModelParallelStrategy"
            )

    def predict_step(
        self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> Optional[dict[str, Tensor]]:
        top = self(batch["input_ids"], batch.get("attention_mask"))
        for unit, _ in self._head_units:  # the head's unit, kept unsharded for the top k: freed again
            unit.reshard()
        if not self.writes_predictions:
            return None  # the same record as the head group's first rank's: that one is kept
        record = {key: batch[key] for key in _KEPT_KEYS if key in batch}
        record[TEACHER_TOP_K_KEYS[0]] = top.indices.to(torch.int32)
        record[TEACHER_TOP_K_KEYS[1]] = top.values.to(self.values_dtype)
        return {key: value.detach().cpu() for key, value in record.items()}

    @property
    def writes_predictions(self) -> bool:
        """False on the ranks of a tensor-parallel teacher's head group other than its first: their records
        repeat that rank's (:class:`~lightning_flce.callbacks.TopKCacheWriter` writes none there)."""
        head = vocab_parallel_lm_head(self.teacher)
        return head is None or dist.get_rank(head.group) == 0

    def configure_optimizers(self) -> Any:
        return None
