"""A pytest plugin for the GPU: the distillation kernel's blocks capped at ``DISTILL_MAX_BLOCK_V`` columns (e.g.
``4096``: the library's launch rule otherwise, a warp per 512 columns, so 4096 x 8 warps) for the whole test
session, so that the CUDA tests check a candidate launch before it becomes the default.

    PYTHONPATH=benchmarks/experiments DISTILL_MAX_BLOCK_V=4096 python3 -m pytest -p distill_launch_override -k cuda tests/test_distill*.py

(Run 2026-12-05 as ``DISTILL_LAUNCH=4096x8`` at commit 8568a3f, the same launch.)
"""

from __future__ import annotations

import functools
import os


def pytest_configure(config) -> None:
    max_block_v = os.environ.get("DISTILL_MAX_BLOCK_V")
    if not max_block_v:
        return
    from lightning_flce.kernels import distill

    distill.default_distill_launch_config = functools.partial(
        distill.default_distill_launch_config, max_block_v=int(max_block_v)
    )
    print(f"distill_launch_override: the distillation kernel's blocks capped at {max_block_v} columns")
