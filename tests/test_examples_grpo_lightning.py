"""examples/grpo_lightning.py: GRPO through FLCEMixin (gradient accumulation) raises the toy reward (a short
CPU run)."""

import csv
import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_lightning.py"


@pytest.mark.slow
def test_reward_rises_through_the_mixin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("grpo_lightning", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer = module.main(["--max_steps", "20"])
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    rewards = [float(row["train/reward"]) for row in rows if row.get("train/reward")]
    assert len(rewards) >= 4
    assert rewards[-1] > max(0.2, 3 * rewards[0]), rewards
    names = ("ratio_mean", "entropy_mean", "clip_fraction_low", "clip_fraction_high")
    assert all(f"train/policy/{name}" in rows[0] for name in names)
