"""Run the compensated GEMM's CUDA accuracy tests at another chain length (argv[1]); prints the errors."""

import sys

import pytest

import lightning_flce.kernels.compensated_gemm as gemm

blocks = int(sys.argv[1])
measured = gemm.launch_config
gemm.launch_config = lambda device: measured(device)._replace(chain_blocks=blocks)
sys.exit(
    pytest.main(
        [
            "-q",
            "-s",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            "tests/test_logits_precision.py",
            "-k",
            "compensated",
            "-W",
            "ignore",
        ]
    )
)
