"""Every Triton kernel the ops launch compiles for a GPU (sm_90, the H200), on this CPU machine.

Triton's interpreter (the CPU tests' backend) runs code that its GPU compiler refuses, e.g. a variable whose type
changes between loops; without this test such a kernel would first fail on a GPU. benchmarks/ptx_fingerprint.py
records the launches of small calls of every op under the interpreter, then compiles each specialization with
Triton's own compiler (no GPU needed) to PTX and SASS (ptxas ships with Triton's NVIDIA backend).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import INTERPRET

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ptx_fingerprint.py"
# Every kernel of lightning_flce/kernels the calls reach (the TMA GEMM and the target-logit kernel run only on
# GPUs with TMA and at vocabularies >= 65536; the CUDA tests compile them on the device).
KERNELS = {
    "_cross_entropy_chunk_kernel",
    "_shard_row_stats_kernel",
    "_shard_grad_kernel",
    "_row_stats_kernel",
    "_grad_kernel",
    "_compensated_mm_kernel",
    "_scale_kernel",
    "_distill_kernel",
}


@pytest.mark.skipif(
    INTERPRET, reason="compiles for the GPU; the script runs the interpreter in its own process"
)
def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    if not hasattr(interpreter.InterpretedFunction, "run"):  # triton 3.0 (torch 2.4's): no launch to hook
        pytest.skip(
            "ptx_fingerprint.py records launches through InterpretedFunction.run, which this Triton lacks"
        )
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(SCRIPT.parents[1])}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--sass"], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line.split("\t") for line in result.stdout.splitlines()]
    assert {fields[0] for fields in compiled} == KERNELS
    assert all(len(fields[1]) == 16 for fields in compiled)
