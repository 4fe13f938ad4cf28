"""A pytest plugin for the GPU: the distillation kernel's default launch replaced by ``DISTILL_LAUNCH`` (e.g.
``4096x8``: block columns x warps, the warps capped at block / 512 as the default's rule does) for the whole test
session, so that the CUDA tests check a candidate launch before it becomes the default.

    PYTHONPATH=benchmarks/experiments DISTILL_LAUNCH=4096x8 python3 -m pytest -p distill_launch_override -k cuda tests/test_distill*.py
"""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    spec = os.environ.get("DISTILL_LAUNCH")
    if not spec:
        return
    import triton

    from lightning_flce.kernels import distill
    from lightning_flce.kernels.cross_entropy import LaunchConfig

    block_v, num_warps = (int(part) for part in spec.split("x"))

    def launch(vocab: int) -> LaunchConfig:
        block = min(block_v, triton.next_power_of_2(vocab))
        return LaunchConfig(block, max(4, min(num_warps, block // 512)))

    distill.default_distill_launch_config = launch
    print(f"distill_launch_override: the distillation kernel launched as {spec} (block x warps)")
