"""The package's public surface: what `import lightning_flce` loads and what it exports."""

from __future__ import annotations

import subprocess
import sys

import lightning_flce


def test_the_op_alone_does_not_import_lightning():
    code = "import sys, lightning_flce; lightning_flce.fused_linear_cross_entropy; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_head_loss_and_options_are_top_level_exports():
    from lightning_flce.head import FLCEHeadLoss
    from lightning_flce.options import FLCEOptions

    assert lightning_flce.FLCEHeadLoss is FLCEHeadLoss
    assert lightning_flce.FLCEOptions is FLCEOptions
    assert {"FLCEHeadLoss", "FLCEOptions"} <= set(lightning_flce.__all__)


def test_lightning_exports_resolve_lazily_and_by_class_path():
    from lightning_flce.callbacks.memory import FLCEMemoryCallback
    from lightning_flce.mixin import FLCEMixin

    assert lightning_flce.FLCEMixin is FLCEMixin
    # The class path of the README's YAML callback example, through jsonargparse as LightningCLI uses it.
    from jsonargparse import ArgumentParser
    from lightning.pytorch.callbacks import Callback

    parser = ArgumentParser()
    parser.add_argument("--callback", type=Callback)
    config = parser.parse_args(
        ['--callback={"class_path": "lightning_flce.FLCEMemoryCallback", "init_args": {"plot": true}}']
    )
    callback = parser.instantiate_classes(config).callback
    assert type(callback) is FLCEMemoryCallback
    # and the README's whole YAML example, every option of it
    import json
    import pathlib

    import yaml

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = readme.split("## FLCEMemoryCallback", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    (entry,) = yaml.safe_load(example)["trainer"]["callbacks"]
    callback = parser.instantiate_classes(parser.parse_args([f"--callback={json.dumps(entry)}"])).callback
    assert type(callback) is FLCEMemoryCallback
    assert {name: getattr(callback, name) for name in entry["init_args"]} == entry["init_args"]
    assert set(lightning_flce.__all__) <= set(dir(lightning_flce))
    try:
        lightning_flce.not_a_name  # noqa: B018
    except AttributeError as err:
        assert "not_a_name" in str(err)
    else:
        raise AssertionError("unknown attributes must raise AttributeError")


def test_paths_named_in_the_docs_exist():
    # The README and docs/ name files by path in backticks; a moved or renamed file must not leave a dangling
    # reference. Globs (results folders) and paths inside other trees (site-packages) are skipped.
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    prefixes = ("lightning_flce/", "tests/", "examples/", "configs/", "benchmarks/", "docs/", ".ci/")
    missing = []
    for doc in docs:
        for path in re.findall(r"`([\w./-]+)`", doc.read_text()):
            if path.startswith(prefixes) and "*" not in path and not (root / path).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing
