"""A pytest plugin for the GPU: a candidate launch of the distillation kernel for the whole test session, so that
the CUDA tests check it before it becomes the default. ``DISTILL_MAX_BLOCK_V`` caps the blocks (e.g. ``4096``: the
library's launch rule otherwise, a warp per 512 columns, so 4096 x 8 warps); ``DISTILL_PROGRAMS_PER_SM`` sets
``kernels.distill.PROGRAMS_PER_SM`` (e.g. ``8``: the split launch, rows cut into slices for 8 programs an SM).

    PYTHONPATH=benchmarks/experiments DISTILL_MAX_BLOCK_V=4096 python3 -m pytest -p distill_launch_override -k cuda tests/test_distill*.py
    PYTHONPATH=benchmarks/experiments DISTILL_MAX_BLOCK_V=4096 DISTILL_PROGRAMS_PER_SM=8 python3 -m pytest -p distill_launch_override -k cuda tests/test_distill*.py

(Run 2026-12-05 as ``DISTILL_LAUNCH=4096x8`` at commit 8568a3f, the same launch as the first line's.)
"""

from __future__ import annotations

import functools
import os


def pytest_configure(config) -> None:
    from lightning_flce.kernels import distill

    max_block_v = os.environ.get("DISTILL_MAX_BLOCK_V")
    if max_block_v:
        distill.default_distill_launch_config = functools.partial(
            distill.default_distill_launch_config, max_block_v=int(max_block_v)
        )
        print(f"distill_launch_override: the distillation kernel's blocks capped at {max_block_v} columns")
    programs_per_sm = os.environ.get("DISTILL_PROGRAMS_PER_SM")
    if programs_per_sm:
        distill.PROGRAMS_PER_SM = int(programs_per_sm)
        # every divergence's kernel split (the library splits JSD's only)
        distill.SPLIT_DIVERGENCES = frozenset(distill.DIVERGENCES)
        print(f"distill_launch_override: rows split for {programs_per_sm} programs an SM")
