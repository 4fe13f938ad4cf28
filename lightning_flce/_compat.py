"""Version and capability probes, computed once at import."""

from __future__ import annotations

import importlib.util
import os
import typing

import torch
import torch.distributed as dist
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


def resolved_annotations(fn):
    """``fn`` with its annotations evaluated. ``torch.library.custom_op`` before torch 2.5 reads them as
    written, and under ``from __future__ import annotations`` they are strings it rejects (``'Tensor'``)."""
    hints = typing.get_type_hints(fn)
    if hints.get("return") is type(None):  # get_type_hints turns "-> None" into NoneType
        hints["return"] = None
    fn.__annotations__ = hints
    return fn


def dtensor_api():
    """The DTensor module: public as ``torch.distributed.tensor`` from torch 2.5, ``torch.distributed._tensor``
    in 2.4. None where torch.distributed is not built."""
    try:
        import torch.distributed.tensor as api

        _ = api.DTensor, api.Shard  # 2.4 has the module but not these names
    except (ImportError, AttributeError):
        try:
            import torch.distributed._tensor as api
        except ImportError:
            return None
    return api


# torch 2.13 renamed the tensor-in, tensor-out collectives (the old names warn); same signatures.
all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)
