"""Lightning callbacks of lightning_flce."""

from lightning_flce.callbacks.checkpoint import LastStepCheckpoint
from lightning_flce.callbacks.memory import FLCEMemoryCallback
from lightning_flce.callbacks.top_k_cache import TopKCacheWriter

__all__ = ["FLCEMemoryCallback", "LastStepCheckpoint", "TopKCacheWriter"]
