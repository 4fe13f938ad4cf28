"""A pytest plugin for the GPU: a candidate launch of the distillation kernel for the whole test session, so that
the CUDA tests check it before it becomes the default: ``bench_distill.launch_override`` (the one override the
benchmarks use too) with ``DISTILL_MAX_BLOCK_V`` (the blocks' cap, e.g. ``4096``: 4096 x 8 warps by the library's
rule of a warp per 512 columns) and ``DISTILL_PROGRAMS_PER_SM`` (e.g. ``8``: every divergence's rows cut into
slices for 8 programs an SM; ``0``: whole rows), both required.

    PYTHONPATH=benchmarks/experiments DISTILL_MAX_BLOCK_V=4096 DISTILL_PROGRAMS_PER_SM=8 python3 -m pytest -p distill_launch_override -k cuda tests/test_distill*.py

(``benchmarks/gpu_distill.sh``'s ``LAUNCH_TESTS=4096:8`` runs that line. Run 2026-12-05 as ``DISTILL_LAUNCH=4096x8``
at commit 8568a3f: blocks of 4096 x 8, whole rows.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: bench_distill, _common

_override = None


def pytest_configure(config) -> None:
    global _override
    import bench_distill

    max_block_v, programs_per_sm = (
        int(os.environ[name]) for name in ("DISTILL_MAX_BLOCK_V", "DISTILL_PROGRAMS_PER_SM")
    )
    _override = bench_distill.launch_override(max_block_v, programs_per_sm)
    _override.__enter__()
    print(
        f"distill_launch_override: blocks of at most {max_block_v} columns, rows split for {programs_per_sm} "
        "programs an SM (0: whole rows), every divergence"
    )


def pytest_unconfigure(config) -> None:
    if _override is not None:
        _override.__exit__(None, None, None)
