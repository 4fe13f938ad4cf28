"""Recording the CUDA caching allocator's history and dumping it as a snapshot for
https://pytorch.org/memory_viz (``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``, the
documented way to get one), for :class:`~lightning_flce.callbacks.FLCEMemoryCallback`."""

from __future__ import annotations

import os

import torch


class AllocatorHistory:
    """Starts and stops the allocator's recording (at most ``max_entries`` events kept) and dumps it.
    ``stacks``: "all" (Python and C++ frames) or "python" (cheaper per allocation)."""

    def __init__(self, max_entries: int, stacks: str = "all") -> None:
        self.max_entries = max_entries
        self.stacks = stacks
        self.recording = False
        self._legacy = False

    def start(self) -> None:
        record = torch.cuda.memory._record_memory_history
        try:
            # torch's default stacks are "all": name them only when asked for fewer
            stacks = {} if self.stacks == "all" else {"stacks": self.stacks}
            record(enabled="all", max_entries=self.max_entries, **stacks)
            self._legacy = False
        except TypeError:
            # torch < 2.1 only had the boolean form
            record(True, trace_alloc_max_entries=self.max_entries, trace_alloc_record_context=True)
            self._legacy = True
        self.recording = True

    def stop(self) -> None:
        if not self.recording:
            return
        record = torch.cuda.memory._record_memory_history
        if self._legacy:
            record(False)
        else:
            record(enabled=None)
        self.recording = False

    @staticmethod
    def dump(path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        return path
