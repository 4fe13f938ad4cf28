"""Version and capability probes, computed once at import."""

from __future__ import annotations

import importlib.util
import os

import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__).release[:2]

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Triton's CPU interpreter: kernels run on CPU tensors (tests only; slow).
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``."""
    if not HAS_TRITON:
        return False
    if TRITON_INTERPRET:
        return device.type == "cpu"
    return device.type == "cuda"
