"""Writes a teacher's top-k cache during ``trainer.predict``: each batch's record of
:class:`~lightning_flce.models.teacher_cache.TeacherTopKModule` (or any ``predict_step`` that returns a dict of
tensors) as one file, read back by :class:`~lightning_flce.data.TopKCacheDataset`."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from lightning_flce.data.top_k_cache import cache_file_name, cache_files

__all__ = ["TopKCacheWriter"]


class TopKCacheWriter(BasePredictionWriter):
    """Saves every prediction batch's dict of tensors to ``dirpath`` (``torch.save``, one file a batch and rank,
    :func:`~lightning_flce.data.top_k_cache.cache_file_name`), as the batch ends: a cache larger than memory is
    never held (pass ``return_predictions=False`` to ``trainer.predict`` so that Lightning does not hold it
    either).

    Under DDP each rank writes the batches of its share of the dataset; Lightning's distributed sampler pads the
    last share with repeated samples, so a cache of a dataset whose size the ranks do not divide holds a few
    sequences twice. Files of an earlier run in ``dirpath`` are refused unless ``overwrite``.

    A module whose ``writes_predictions`` is False on this rank (a tensor-parallel teacher's ranks other than its
    head group's first: :class:`~lightning_flce.models.teacher_cache.TeacherTopKModule`, whose predictions there
    repeat the first rank's) leaves the directory to the rank that writes; a ``None`` prediction is not written."""

    def __init__(self, dirpath: str, *, overwrite: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.dirpath = dirpath
        self.overwrite = overwrite

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict" or not getattr(pl_module, "writes_predictions", True):
            return
        # every rank reads the directory before any rank writes to it
        existing = cache_files(self.dirpath)
        trainer.strategy.barrier("top_k_cache_check")
        if existing and not self.overwrite:
            raise FileExistsError(
                f"{self.dirpath} already holds a cache (part-*.pt files): pass overwrite=True to replace it, or"
                " another dirpath"
            )
        if trainer.is_global_zero:
            os.makedirs(self.dirpath, exist_ok=True)
            for name in existing:
                os.remove(os.path.join(self.dirpath, name))
        trainer.strategy.barrier("top_k_cache_ready")

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Optional[Sequence[int]],
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if prediction is None:
            return
        if not isinstance(prediction, dict) or not all(isinstance(v, Tensor) for v in prediction.values()):
            raise TypeError(
                "TopKCacheWriter writes a predict_step's dict of tensors (TeacherTopKModule's), got"
                f" {type(prediction).__name__}"
            )
        path = os.path.join(self.dirpath, cache_file_name(trainer.global_rank, dataloader_idx, batch_idx))
        torch.save({key: value.detach().cpu().contiguous() for key, value in prediction.items()}, path)
