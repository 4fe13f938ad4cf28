"""examples/grpo_tinygpt.py: GRPO on the fused head raises the toy reward (a short run on the CPU)."""

import csv
import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tinygpt.py"


def test_reward_rises(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("grpo_tinygpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer = module.main(["--max_steps", "30"])
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    rewards = [float(row["train/reward"]) for row in rows if row.get("train/reward")]
    assert len(rewards) >= 5
    assert rewards[-1] > max(0.3, 3 * rewards[0]), rewards
    assert all(f"train/{name}" in rows[0] for name in ("ratio_mean", "entropy_mean", "clip_fraction_low"))
