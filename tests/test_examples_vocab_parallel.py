"""examples/vocab_parallel_head.py runs on the CPU: 2 gloo ranks, each holding half the head's rows."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vocab_parallel_head.py"
TIMEOUT_S = 300


# ~10 s on an idle 2-core machine (three processes import Lightning; 10 steps), so not marked slow
def test_vocab_parallel_example_trains_on_two_cpu_ranks():
    env = {key: value for key, value in os.environ.items() if key != "RANK"}  # RANK set: it would be a worker
    # in its own session: on a hang, killpg ends the launcher and both ranks (not only the launcher)
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--max-steps", "10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the example did not finish in {TIMEOUT_S} s:\n{proc.communicate()[0][-4000:]}")
    assert proc.returncode == 0, out[-4000:]

    assert "rank 0: head rows [0, 2050), head parameters 131200 of 262336 (50.0%)" in out, out[-4000:]
    assert "rank 1: head rows [2050, 4099), head parameters 131136 of 262336 (50.0%)" in out, out[-4000:]
    first, last = map(float, re.search(r"train/loss first (\S+) -> last (\S+)", out).groups())
    assert last < first, out[-4000:]
    val_loss, perplexity, accuracy = map(
        float, re.search(r"val/loss (\S+)  val/perplexity (\S+)  val/token_accuracy (\S+)", out).groups()
    )
    assert val_loss < math.log(4099) and 0.0 <= accuracy <= 1.0
    assert perplexity == pytest.approx(math.exp(val_loss), rel=1e-2)
    assert "inference logits (gathered from all ranks): (1, 64, 4099)" in out
