"""The CLI's errors point at the fix: short messages naming the key, the value and what is accepted, with close
matches; no usage dump, no traceback; a missing extra's install command; --version and configs without torch."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import yaml

from lightning_flce._version import __version__
from lightning_flce.cli import bundled_configs, main, resolve_config
from lightning_flce.cli_errors import did_you_mean, install_command

ROOT = Path(__file__).resolve().parents[1]
# A short error is the message and a hint or two; jsonargparse's usage dump alone is some 45 lines.
MAX_ERROR_LINES = 5


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-flce"])
    monkeypatch.delenv("LIGHTNING_FLCE_DEBUG", raising=False)


def _error_lines(capsys) -> list[str]:
    # Lightning logs "Seed set to 42" on stderr before the classes are built.
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.strip() and not line.startswith("Seed set")]


def _fails_shortly(args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    lines = _error_lines(capsys)
    assert 1 <= len(lines) <= MAX_ERROR_LINES, lines
    text = "\n".join(lines)
    assert "usage:" not in text and "Traceback" not in text and "Namespace(" not in text
    return text


def _logits_precision_choices() -> tuple[str, ...]:
    from lightning_flce.options import LogitsPrecision

    return typing.get_args(LogitsPrecision)


def _run_module(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=str(ROOT), **kwargs
    )


def _imported_modules(importtime_stderr: str) -> set[str]:
    return {
        m.group(1) for m in re.finditer(r"^import time:.*\|\s+(\S+)\s*$", importtime_stderr, re.MULTILINE)
    }


@pytest.mark.parametrize("command", [["--version"], ["-V"], ["configs"]])
def test_version_and_configs_answer_without_torch_or_lightning(command):
    result = _run_module("-X", "importtime", "-m", "lightning_flce", *command)
    assert result.returncode == 0, result.stderr
    modules = _imported_modules(result.stderr)
    assert "lightning_flce.cli" in modules  # the importtime report is read right
    heavy = {m for m in modules if m.split(".")[0] in ("torch", "lightning", "jsonargparse", "numpy")}
    assert not heavy, sorted(heavy)[:10]
    if command == ["configs"]:
        assert [line.split()[0] for line in result.stdout.splitlines()[: len(bundled_configs())]] == list(
            bundled_configs()
        )
    else:
        assert result.stdout.strip() == f"lightning-flce {__version__}"


def test_version_is_the_one_of_the_installed_distribution():
    # pyproject.toml reads it from _version.py (hatch's dynamic version): one place to change
    from importlib.metadata import version

    import lightning_flce

    assert re.search(r'^dynamic = \["version"\]', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert version("lightning-flce") == lightning_flce.__version__ == __version__


def test_help_lists_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--version" in capsys.readouterr().out


def test_did_you_mean_keeps_the_close_matches_only():
    assert did_you_mean("flce_chunksize", ["flce_chunk_size", "flce_naive", "flce_normalize"]) == (
        "; did you mean flce_chunk_size?"
    )
    assert did_you_mean("fp33", ["input", "fp32", "fp32_head"], quote=True) == "; did you mean 'fp32'?"
    assert did_you_mean("zzz", ["flce_chunk_size"]) == ""


def test_unknown_config_name_suggests_the_close_one():
    with pytest.raises(SystemExit, match=r"did you mean default\?(.|\n)*bundled: .*hf_llama"):
        resolve_config("defualt")


@pytest.mark.parametrize(
    ("where", "key", "suggestion"),
    [
        ("model", "flce_chunksize", "flce_chunk_size"),  # the mixin's option, reached through **kwargs
        ("model", "d_modle", "d_model"),
        ("data", "vocab_sise", "vocab_size"),
    ],
)
@pytest.mark.parametrize("source", ["command line", "yaml"])
def test_unknown_init_arg_names_the_key_and_its_close_match(where, key, suggestion, source, tmp_path, capsys):
    if source == "yaml":
        (tmp_path / "typo.yaml").write_text(yaml.safe_dump({where: {"init_args": {key: 3}}}))
        extra = ["--config", str(tmp_path / "typo.yaml")]
    else:
        extra = [f"--{where}.init_args.{key}", "3"]
    text = _fails_shortly(["fit", "--config", "default", *extra, "--print_config"], capsys)
    assert f"{where}.init_args.{key}" in text
    assert f"did you mean {suggestion}?" in text


@pytest.mark.parametrize(
    ("old", "new"), [("flce_z_loss", "flce_lse_square_scale"), ("flce_accum_fp32", "flce_accum_dtype")]
)
def test_a_renamed_option_names_its_new_name(old, new, tmp_path, capsys):
    # an old run's config.yaml: Python callers get the old names with a warning, the CLI points at the new one
    (tmp_path / "old.yaml").write_text(yaml.safe_dump({"model": {"init_args": {old: True}}}))
    text = _fails_shortly(["fit", "--config", "default", "--config", "old.yaml", "--print_config"], capsys)
    assert f"model.init_args.{old}" in text and f"it was renamed to {new}" in text


def test_unknown_trainer_key_in_yaml_gets_a_suggestion(tmp_path, capsys):
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_step: 3\n")
    text = _fails_shortly(["fit", "--config", "default", "--config", "typo.yaml", "--print_config"], capsys)
    assert "trainer.max_step" in text and "did you mean max_steps?" in text


def test_unrecognized_flag_gets_a_suggestion(capsys):
    text = _fails_shortly(["fit", "--config", "default", "--max_step", "3", "--print_config"], capsys)
    assert "--max_step" in text and "did you mean --trainer.max_steps?" in text


@pytest.mark.parametrize(
    ("args", "group", "suggestion"),
    [
        (["--model", "TinyGTP"], "model", "TinyGPT"),
        (
            ["--data.class_path", "lightning_flce.data.PythonStdlibDataModul"],
            "data",
            "PythonStdlibDataModule",
        ),
    ],
)
def test_unknown_class_gets_a_suggestion(args, group, suggestion, capsys):
    text = _fails_shortly(["fit", "--config", "default", *args, "--print_config"], capsys)
    assert text.splitlines()[0].endswith(f"{group}: no class {args[1]!r}; did you mean {suggestion}?")


def test_value_outside_a_literal_lists_the_choices(capsys):
    choices = _logits_precision_choices()
    assert "fp32" in choices
    text = _fails_shortly(
        ["fit", "--config", "default", "--model.init_args.flce_logits_precision", "fp33", "--print_config"],
        capsys,
    )
    assert "model.init_args.flce_logits_precision" in text and "'fp33'" in text
    assert "one of " + ", ".join(repr(c) for c in choices) in text
    assert "did you mean 'fp32'?" in text


def test_value_of_the_wrong_type_names_the_type(capsys):
    text = _fails_shortly(
        ["fit", "--config", "default", "--model.init_args.flce_chunk_size", "abc", "--print_config"], capsys
    )
    assert "model.init_args.flce_chunk_size: got 'abc', expected int or None" in text


def test_exception_of_a_models_init_is_a_short_message(capsys, monkeypatch):
    from lightning_flce.models import TinyGPT

    with pytest.raises(ValueError) as raised:
        TinyGPT(flce_chunk_size=-3)
    # no seeding: Lightning's log handler may hold the stderr of an earlier test's capture
    args = ["fit", "--config", "default", "--model.init_args.flce_chunk_size=-3", "--seed_everything=false"]
    text = _fails_shortly(args, capsys)
    assert "model (lightning_flce.models.TinyGPT)" in text
    assert str(raised.value) in text
    assert "LIGHTNING_FLCE_DEBUG=1" in text

    monkeypatch.setenv("LIGHTNING_FLCE_DEBUG", "1")  # the traceback instead, for a bug report
    with pytest.raises(ValueError, match=re.escape(str(raised.value))):
        main(args)


def test_install_command_of_a_missing_extra():
    def chained(outer: ImportError, inner: BaseException) -> ImportError:
        outer.__cause__ = inner
        return outer

    missing = ModuleNotFoundError("No module named 'transformers'", name="transformers")
    assert install_command(missing) == 'pip install "lightning-flce[hf]"'
    # what a model raises, worded its own way, from the failed import
    assert install_command(chained(ImportError("HFCausalLM needs transformers"), missing)) == (
        'pip install "lightning-flce[hf]"'
    )
    assert install_command(ModuleNotFoundError("No module named 'peft'", name="peft")) == (
        'pip install "lightning-flce[peft]"'
    )
    assert "--no-deps litgpt" in install_command(ModuleNotFoundError("x", name="litgpt"))
    assert install_command(ValueError("not an import")) is None
    assert install_command(ModuleNotFoundError("No module named 'mylab'", name="mylab")) is None


# Hides transformers from a fresh interpreter: its import fails and its distribution is not found (torchmetrics
# decides by the distribution whether to import it).
_HIDE_TRANSFORMERS = textwrap.dedent(
    """
    import importlib.metadata as _metadata
    import sys

    class _HideTransformers:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "transformers":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _HideTransformers())
    _version = _metadata.version

    def _hidden_version(name):
        if name == "transformers":
            raise _metadata.PackageNotFoundError(name)
        return _version(name)

    _metadata.version = _hidden_version
    """
)


def test_missing_transformers_prints_the_install_command(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_HIDE_TRANSFORMERS)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    env.pop("LIGHTNING_FLCE_DEBUG", None)
    result = _run_module(
        "-m", "lightning_flce", "fit", "--config", "hf_llama", "--trainer.logger=false", env=env
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert len(lines) <= MAX_ERROR_LINES, lines
    assert "transformers" in lines[0] and "HFCausalLM" in lines[0]
    assert '  pip install "lightning-flce[hf]"' in lines
    assert "Traceback" not in result.stderr


def _small_run_args(tmp_path, *extra):
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    for i in range(12):  # a tiny corpus: its tokenizer is smaller than requested
        (source / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    return [
        "--config",
        "default",
        f"--data.init_args.root={source}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        "--data.init_args.vocab_size=600",
        "--data.init_args.max_chars=300000",
        "--trainer.logger=false",
        *extra,
    ]


def test_a_replaced_model_vocab_size_is_warned_about(tmp_path, caplog):
    from lightning_flce.cli import FLCELightningCLI

    with caplog.at_level(logging.WARNING, logger="lightning_flce"):
        cli = FLCELightningCLI(args=_small_run_args(tmp_path, "--model.init_args.vocab_size=4000"), run=False)
    linked = cli.datamodule.vocab_size
    assert linked < 600 and cli.model.hparams.vocab_size == linked
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_flce")]
    assert len(warnings) == 1
    assert (
        f"model.init_args.vocab_size=4000 is replaced by the data module's vocab_size={linked}" in warnings[0]
    )
    assert "data.init_args.vocab_size" in warnings[0]

    caplog.clear()  # not set by the user: linked without a word
    with caplog.at_level(logging.WARNING, logger="lightning_flce"):
        FLCELightningCLI(args=_small_run_args(tmp_path), run=False)
    assert not [r for r in caplog.records if "vocab_size" in r.getMessage()]
