"""The shipped configs parse, link the tokenizer's vocabulary size into the model, and the default one runs."""

import csv
import importlib.util
import math
import subprocess
import sys

import pytest
import torch
import yaml

from lightning_flce.cli import CONFIG_DIR, FLCELightningCLI, main

# Overlays only change another config (see their header comments); they are parsed on top of their base.
OVERLAYS = {"naive.yaml": "compare_naive.yaml"}
CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
_HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _small_data_args(cache_dir, vocab_size=512):
    # A 512-token BPE on 300k characters trains and tokenizes in well under a second.
    return [
        f"--data.init_args.cache_dir={cache_dir}",
        f"--data.init_args.vocab_size={vocab_size}",
        "--data.init_args.max_chars=300000",
        "--data.init_args.seq_len=32",
        "--data.init_args.batch_size=4",
        "--data.init_args.num_workers=0",
    ]


def _config_args(name):
    if name in OVERLAYS:
        return ["--config", str(CONFIG_DIR / OVERLAYS[name]), "--config", str(CONFIG_DIR / name)]
    return ["--config", str(CONFIG_DIR / name)]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    # Relative log paths of the configs land in tmp_path; pytest's own argv must not reach the CLI.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-flce"])


def test_configs_present():
    assert {
        "default.yaml",
        "distill.yaml",
        "hf_llama.yaml",
        "cuda_bf16.yaml",
        "compare_naive.yaml",
        "naive.yaml",
        "teacher_cache.yaml",
        "distill_cached.yaml",
    } <= set(CONFIGS)


# A teacher's top-k cache: made by `predict` (no training, so no logger or memory callback), then read by a fit on
# the cache's data module; tests/test_teacher_cache.py runs the two.
CACHE_CONFIGS = {"teacher_cache.yaml": "predict", "distill_cached.yaml": "fit"}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_parses(name, capsys):
    # --print_config parses and type-checks every value against the classes' signatures, then exits.
    with pytest.raises(SystemExit) as exit_info:
        main([CACHE_CONFIGS.get(name, "fit"), *_config_args(name), "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["class_path"].startswith("lightning_flce.models.")
    if name in CACHE_CONFIGS:
        callbacks = [c["class_path"] for c in config["trainer"]["callbacks"]]
        if name == "teacher_cache.yaml":
            assert config["model"]["class_path"] == "lightning_flce.models.TeacherTopKModule"
            assert config["data"]["class_path"] == "lightning_flce.data.PythonStdlibDataModule"
            assert callbacks == ["lightning_flce.callbacks.TopKCacheWriter"]
            assert config["return_predictions"] is False
        else:
            assert config["model"]["init_args"]["cached_teacher"] is True
            assert config["data"]["class_path"] == "lightning_flce.data.TopKCacheDataModule"
            assert config["data"]["init_args"]["dirpath"] == "lightning_logs/teacher_cache/top_32"
        return
    assert config["data"]["class_path"] == "lightning_flce.data.PythonStdlibDataModule"
    callbacks = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert "lightning_flce.callbacks.FLCEMemoryCallback" in callbacks
    assert config["trainer"]["logger"]["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    if name == "naive.yaml":
        assert config["model"]["init_args"]["flce_naive"] is True
        assert config["trainer"]["logger"]["init_args"]["name"] == "naive"
    if config["model"]["class_path"].endswith("HFCausalLM"):
        assert config["data"]["init_args"]["label_format"] == "hf"
    else:
        assert config["data"]["init_args"]["label_format"] == "shifted"
        model_args = config["model"]["init_args"]
        if config["model"]["class_path"].endswith("DistillationModule"):  # the student reads the batches
            model_args = model_args["student"]["init_args"]
        assert model_args["max_seq_len"] >= config["data"]["init_args"]["seq_len"]


def test_vocab_size_linked_from_tokenizer(tmp_path):
    # A tiny corpus gives a tokenizer smaller than requested: the model must get the real size.
    source = tmp_path / "src"
    source.mkdir()
    for i in range(12):
        (source / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    cli = FLCELightningCLI(
        args=[
            "fit",
            *_config_args("default.yaml"),
            *_small_data_args(tmp_path / "cache", vocab_size=8192),
            f"--data.init_args.root={source}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
            "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
        ],
    )
    vocab_size = cli.datamodule.vocab_size
    assert vocab_size < 8192
    assert cli.model.hparams.vocab_size == vocab_size
    assert cli.model.lm_head.weight.shape[0] == vocab_size
    # The logger got both hyperparameter sets: they agree on vocab_size, else Trainer.fit raises.
    assert cli.datamodule.hparams.vocab_size == vocab_size
    assert cli.trainer.global_step == 1


@pytest.mark.skipif(not _HAS_TRANSFORMERS, reason="hf_llama.yaml needs transformers")
def test_hf_llama_gets_linked_vocab_and_hf_batches(tmp_path):
    cli = FLCELightningCLI(
        args=[
            *_config_args("hf_llama.yaml"),
            *_small_data_args(tmp_path / "cache"),
            "--trainer.logger=false",
        ],
        run=False,
    )
    assert cli.model.model.config.vocab_size == cli.datamodule.vocab_size == 512
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    loss = cli.model.training_step(batch, 0)
    # A freshly initialized model predicts close to uniformly over the vocabulary.
    assert abs(loss.item() - math.log(512)) < 0.5


def _metrics(log_dir):
    with open(log_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_default_config_trains_and_logs(tmp_path):
    run_args = [
        *_config_args("default.yaml"),
        *_small_data_args(tmp_path / "cache"),
        f"--trainer.default_root_dir={tmp_path / 'logs'}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
    ]
    main(["fit", *run_args])
    log_dir = tmp_path / "logs" / "tinygpt" / "version_0"
    rows = _metrics(log_dir)
    train_losses = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    val_losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(train_losses) == 3
    assert len(val_losses) == 1
    # Untrained on 512 tokens, the loss starts near log(512) and stays finite.
    assert all(math.isfinite(v) for v in train_losses + val_losses)
    assert abs(train_losses[0] - math.log(512)) < 0.5
    assert any(r.get("memory/peak_rss_mib") for r in rows)
    assert (log_dir / "config.yaml").is_file()
    assert (log_dir / "memory.png").is_file()

    # A second run in the same directory with the config saved in the same place must not abort.
    no_logger = ["--trainer.logger=false", "--trainer.max_steps=1", "--trainer.limit_val_batches=0"]
    for _ in range(2):
        main(["fit", *run_args, *no_logger])
    assert (tmp_path / "logs" / "config.yaml").is_file()


def test_validate_and_test_subcommands(tmp_path):
    common = [
        *_config_args("default.yaml"),
        *_small_data_args(tmp_path / "cache"),
        "--trainer.logger=false",
        "--trainer.limit_val_batches=2",
        "--trainer.limit_test_batches=2",
        "--trainer.enable_progress_bar=false",
    ]
    for subcommand in ("validate", "test"):
        cli = FLCELightningCLI(args=[subcommand, *common])
        metric = "val/loss" if subcommand == "validate" else "test/loss"
        assert abs(cli.trainer.callback_metrics[metric].item() - math.log(512)) < 0.5
    # a training model has no predict step: `predict` names the config that has one (teacher_cache)
    with pytest.raises(SystemExit):
        main(["predict", *common])


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_flce", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "lightning-flce" in result.stdout
    assert "{fit,validate,test,predict}" in result.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_config_trains(tmp_path):
    main(
        [
            "fit",
            *_config_args("cuda_bf16.yaml"),
            *_small_data_args(tmp_path / "cache", vocab_size=2048),
            "--data.init_args.include_tests=false",
            "--data.init_args.max_chars=2000000",
            "--data.init_args.seq_len=512",
            "--data.init_args.batch_size=8",
            f"--trainer.default_root_dir={tmp_path / 'logs'}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
            "--trainer.max_steps=20",
            "--trainer.val_check_interval=20",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
        ]
    )
    rows = _metrics(tmp_path / "logs" / "tinygpt" / "version_0")
    train_losses = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert len(train_losses) == 20
    assert train_losses[-1] < train_losses[0] - 0.5
    assert any(float(r["memory/peak_allocated_mib"]) > 0 for r in rows if r.get("memory/peak_allocated_mib"))
