"""Lightning callbacks of lightning_flce."""

from lightning_flce.callbacks.checkpoint import LastStepCheckpoint
from lightning_flce.callbacks.memory import FLCEMemoryCallback

__all__ = ["FLCEMemoryCallback", "LastStepCheckpoint"]
