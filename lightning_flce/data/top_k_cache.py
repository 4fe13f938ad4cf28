"""A teacher's top-k cache as a dataset and a data module: the files :class:`~lightning_flce.callbacks.TopKCacheWriter`
wrote, one sequence an item, for ``DistillationModule(cached_teacher=True)``."""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_flce.distill.top_k import TEACHER_TOP_K_KEYS

__all__ = ["TopKCacheDataModule", "TopKCacheDataset", "cache_file_name", "cache_files", "collate_top_k"]

# a cache file's name: the writing rank, the prediction dataloader, the batch (cache_file_name)
_FILE = re.compile(r"^part-r(\d+)-d(\d+)-b(\d+)\.pt$")


def cache_file_name(rank: int, dataloader_idx: int, batch_idx: int) -> str:
    """The file of one batch's record: sorted by name, a rank's files come in its batches' order."""
    return f"part-r{rank:05d}-d{dataloader_idx:03d}-b{batch_idx:09d}.pt"


def cache_files(dirpath: str, dataloader_idx: Optional[int] = None) -> List[str]:
    """The names of the cache files in ``dirpath`` (none where it does not exist), sorted; only those of
    prediction dataloader ``dataloader_idx`` unless it is None."""
    if not os.path.isdir(dirpath):
        return []
    return sorted(
        name
        for name in os.listdir(dirpath)
        if (match := _FILE.match(name)) and dataloader_idx in (None, int(match.group(2)))
    )


#: the value each key of a cache record is padded with (``collate_top_k``); other keys with 0
_PADDING = {
    "attention_mask": 0,
    "labels": -100,
    TEACHER_TOP_K_KEYS[0]: 0,
    TEACHER_TOP_K_KEYS[1]: float("-inf"),
}


def collate_top_k(items: Sequence[Dict[str, Tensor]], pad_token_id: int = 0) -> Dict[str, Tensor]:
    """A batch of cache items (:class:`TopKCacheDataset`'s) of any lengths: each key's tensors right-padded along
    their first dimension to the longest and stacked. ``input_ids`` with ``pad_token_id``, ``labels`` with -100,
    ``attention_mask`` with 0 (one of ones is made where the items have none and their lengths differ), the
    teacher's columns with 0 and its values with -inf: the padding the loss never reads."""
    keys = list(items[0])
    lengths = [item["input_ids"].shape[0] for item in items]
    longest = max(lengths)
    if "attention_mask" not in keys and min(lengths) != longest:
        items = [{**item, "attention_mask": torch.ones_like(item["input_ids"])} for item in items]
        keys.append("attention_mask")
    batch = {}
    for key in keys:
        fill = pad_token_id if key == "input_ids" else _PADDING.get(key, 0)
        values = [item[key] for item in items]
        out = values[0].new_full((len(values), longest, *values[0].shape[1:]), fill)
        for row, value in enumerate(values):
            out[row, : value.shape[0]] = value
        batch[key] = out
    return batch


class TopKCacheDataset(Dataset):
    """The sequences of a top-k cache directory (``part-*.pt`` files of [B, ...] tensors by key, in the order of
    their names), each item a dict of one sequence's tensors: ``input_ids``, ``labels`` and ``attention_mask``
    where the cache has them, ``teacher_top_k_indices`` and ``teacher_top_k_logits`` ([T, K]). The default
    collate function stacks them into the batches ``DistillationModule(cached_teacher=True)`` reads when the
    sequences have one length (fixed-length blocks, as the main job's data); :func:`collate_top_k` pads items of
    different lengths (a cache of batches padded to their own longest sequence).

    ``dataloader_idx``: only the files written for that prediction dataloader (``lightning-flce predict --config
    teacher_cache`` writes the training split as 0 and the validation split as 1); None: every file.

    The files are memory-mapped (``torch.load(mmap=True)``): opening a cache reads no tensor data, and an item
    reads only its own rows. Raises ``FileNotFoundError`` for a directory without such files and ``ValueError``
    for a file without the teacher's keys or whose tensors disagree on the number of sequences."""

    def __init__(self, dirpath: str, dataloader_idx: Optional[int] = None) -> None:
        names = cache_files(dirpath, dataloader_idx)
        if not names:
            which = "" if dataloader_idx is None else f" of prediction dataloader {dataloader_idx}"
            raise FileNotFoundError(f"no top-k cache files{which} (part-r*-d*-b*.pt) in {dirpath}")
        self.parts: List[Dict[str, Tensor]] = []
        self.index: List[Tuple[int, int]] = []
        for name in names:
            path = os.path.join(dirpath, name)
            part = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            missing = [key for key in ("input_ids", *TEACHER_TOP_K_KEYS) if key not in part]
            if missing:
                raise ValueError(f"{path} is not a top-k cache file: no {missing}")
            rows = {key: value.shape[0] for key, value in part.items()}
            if len(set(rows.values())) != 1:
                raise ValueError(f"{path}: its tensors hold different numbers of sequences {rows}")
            self.index.extend((len(self.parts), row) for row in range(part["input_ids"].shape[0]))
            self.parts.append(part)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Dict[str, Tensor]:
        part, row = self.index[i]
        return {key: value[row] for key, value in self.parts[part].items()}


class TopKCacheDataModule(pl.LightningDataModule):
    """Training batches from a top-k cache's prediction dataloader ``train_dataloader_idx`` (shuffled, the last
    partial batch dropped; items of different lengths padded by :func:`collate_top_k`) and validation batches from
    ``val_dataloader_idx`` (None: no validation), for ``DistillationModule(cached_teacher=True)``: the cache
    ``lightning-flce predict --config teacher_cache`` writes (0: the training split, 1: the validation split)."""

    def __init__(
        self,
        dirpath: str,
        batch_size: int = 16,
        train_dataloader_idx: int = 0,
        val_dataloader_idx: Optional[int] = 1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1 or num_workers < 0:
            raise ValueError(
                f"batch_size must be >= 1 and num_workers >= 0, got {batch_size} and {num_workers}"
            )
        self.save_hyperparameters()
        self.train_dataset: Optional[TopKCacheDataset] = None
        self.val_dataset: Optional[TopKCacheDataset] = None

    def setup(self, stage: str) -> None:
        hp = self.hparams
        if self.train_dataset is None:
            self.train_dataset = TopKCacheDataset(hp.dirpath, hp.train_dataloader_idx)
        if self.val_dataset is None and hp.val_dataloader_idx is not None:
            self.val_dataset = TopKCacheDataset(hp.dirpath, hp.val_dataloader_idx)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> Union[DataLoader, List[DataLoader]]:
        if self.hparams.val_dataloader_idx is None:
            return []  # no validation split
        return self._loader(self.val_dataset, shuffle=False)

    def _loader(self, dataset: Optional[TopKCacheDataset], shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("Call `setup()` (the Trainer does) before asking for a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            collate_fn=collate_top_k,
            drop_last=shuffle,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )
