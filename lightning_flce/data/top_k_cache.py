"""A teacher's top-k cache as a dataset: the files :class:`~lightning_flce.callbacks.TopKCacheWriter` wrote, one
sequence an item, for ``DistillationModule(cached_teacher=True)``."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_flce.distill.top_k import TEACHER_TOP_K_KEYS

__all__ = ["TopKCacheDataset"]


class TopKCacheDataset(Dataset):
    """The sequences of a top-k cache directory (``part-*.pt`` files of [B, ...] tensors by key, in the order of
    their names), each item a dict of one sequence's tensors: ``input_ids``, ``labels`` and ``attention_mask``
    where the cache has them, ``teacher_top_k_indices`` and ``teacher_top_k_logits`` ([T, K]). The default
    collate function stacks them into the batches ``DistillationModule(cached_teacher=True)`` reads.

    The files are memory-mapped (``torch.load(mmap=True)``): opening a cache reads no tensor data, and an item
    reads only its own rows. Raises ``FileNotFoundError`` for a directory without cache files and ``ValueError``
    for a file without the teacher's keys or whose tensors disagree on the number of sequences."""

    def __init__(self, dirpath: str) -> None:
        names = sorted(n for n in os.listdir(dirpath) if n.startswith("part-") and n.endswith(".pt"))
        if not names:
            raise FileNotFoundError(f"no top-k cache files (part-*.pt) in {dirpath}")
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
