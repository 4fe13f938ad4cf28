"""Every ```python block of the README, and of the docs in ``DOCS``, runs as written on the CPU (each in a fresh
namespace, in order). A fragment that is not meant to run alone is fenced ```py instead."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [ROOT / "docs" / "fabric.md", ROOT / "docs" / "rl.md", ROOT / "docs" / "distill.md"]


def python_blocks(path: Path) -> list:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


BLOCKS = python_blocks(README)
DOC_BLOCKS = [(path, index, code) for path in DOCS for index, code in enumerate(python_blocks(path))]


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes (lightning_logs) lands here
    code = compile(BLOCKS[index], f"README.md python block {index}", "exec")
    exec(code, {"__name__": "__main__"})


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_the_docs_have_python_blocks(path):
    assert python_blocks(path)


@pytest.mark.parametrize(
    "path, index, code", DOC_BLOCKS, ids=[f"{path.stem}-{index}" for path, index, _ in DOC_BLOCKS]
)
def test_docs_python_block_runs(path, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{path.relative_to(ROOT)} python block {index}", "exec"), {"__name__": "__main__"})
