"""Data for the default runs: the Python standard library's source, tokenized with a local byte-level BPE."""

from lightning_flce.data.dataset import TokenBlockDataset
from lightning_flce.data.stdlib import PythonStdlibDataModule
from lightning_flce.data.top_k_cache import TopKCacheDataModule, TopKCacheDataset, collate_top_k

__all__ = [
    "PythonStdlibDataModule",
    "TokenBlockDataset",
    "TopKCacheDataModule",
    "TopKCacheDataset",
    "collate_top_k",
]
