"""What a pip user gets: the wheel carries the configs, LICENSE and py.typed; bundled configs are found by name."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from lightning_flce.cli import (
    CONFIG_DIR,
    FLCELightningCLI,
    bundled_configs,
    main,
    resolve_config,
    resolve_config_args,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty folder: no configs/ beside it
    monkeypatch.setattr(sys, "argv", ["lightning-flce"])


def test_bundled_names_resolve_and_paths_stay(tmp_path):
    assert {"default", "hf_llama", "cuda_bf16", "ddp", "naive"} <= set(bundled_configs())
    assert resolve_config("default") == str(CONFIG_DIR / "default.yaml")
    assert resolve_config("default.yaml") == str(CONFIG_DIR / "default.yaml")
    # a file of that name in the working directory wins; paths and inline YAML are left to jsonargparse
    (tmp_path / "default.yaml").write_text("trainer:\n  max_steps: 1\n")
    assert resolve_config("default.yaml") == "default.yaml"
    for value in ("configs/default.yaml", "/abs/default.yaml", "trainer: {max_steps: 1}", '{"trainer": {}}'):
        assert resolve_config(value) == value
    args = ["fit", "-c", "default", "--config=hf_llama", "--trainer.max_steps", "3"]
    assert resolve_config_args(args) == [
        "fit",
        "-c",
        str(CONFIG_DIR / "default.yaml"),
        f"--config={CONFIG_DIR / 'hf_llama.yaml'}",
        "--trainer.max_steps",
        "3",
    ]


def test_unknown_name_lists_the_bundled_ones():
    with pytest.raises(SystemExit, match="bundled: .*default"):
        main(["fit", "--config", "defualt"])


def test_config_by_name_parses_like_its_file(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "default", "--print_config"])
    by_name = yaml.safe_load(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(CONFIG_DIR / "default.yaml"), "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out) == by_name
    assert by_name["trainer"]["max_steps"] == 500


def test_configs_command_and_help_name_the_configs(capsys):
    main(["configs"])
    listing = capsys.readouterr().out
    for name in bundled_configs():
        assert f"\n{name} " in "\n" + listing
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert "lightning-flce configs" in capsys.readouterr().out


def test_shipped_configs_show_a_positive_epoch_total(tmp_path):
    # max_epochs unset becomes -1 once max_steps is set, which Lightning 2.6's RichProgressBar prints as
    # "Epoch 1/-2"; the configs bound it instead, far above what max_steps reaches
    for name, path in bundled_configs().items():
        trainer = yaml.safe_load(path.read_text()).get("trainer", {})
        if name not in ("naive", "teacher_cache"):  # an overlay; a `predict` config (one pass, no steps)
            assert trainer["max_epochs"] >= 1000 and trainer["max_steps"] > 0, name
    pytest.importorskip("rich")  # RichProgressBar's dependency (CI has it; a bare venv may not)
    from lightning.pytorch.callbacks import RichProgressBar

    cli = FLCELightningCLI(
        args=[
            "fit",
            "--config",
            "default",
            f"--data.init_args.cache_dir={tmp_path / 'cache'}",
            "--data.init_args.vocab_size=512",
            "--data.init_args.max_chars=300000",
            "--data.init_args.seq_len=32",
            "--data.init_args.batch_size=4",
            "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks=[]",
        ]
    )
    trainer = cli.trainer
    assert trainer.global_step == 1 and trainer.max_epochs == 1000  # as fit left it (-1 without the bound)
    bar = RichProgressBar()
    bar._trainer = trainer
    assert bar._get_train_description(1).strip() == "Epoch 1/999"


@pytest.mark.slow
def test_the_wheel_carries_configs_license_and_py_typed(tmp_path):
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("lightning_flce-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for config in CONFIG_DIR.glob("*.yaml"):
        assert f"lightning_flce/configs/{config.name}" in names
    assert "lightning_flce/py.typed" in names
    licenses = [name for name in names if name.endswith("/LICENSE") and ".dist-info/" in name]
    assert licenses, sorted(names)
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert "Apache License" in text and "Version 2.0" in text and "END OF TERMS AND CONDITIONS" in text
    assert not any(name.startswith(("tests/", "benchmarks/", "configs/")) for name in names)
