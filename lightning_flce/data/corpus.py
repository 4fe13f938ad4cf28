"""Find, read and tokenize the Python standard library's source: text present on every machine with Python."""

import os
import sysconfig
from pathlib import Path
from typing import Union

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# Directory names that are never part of the corpus: third-party packages, and generated data that is not
# code (codec tables in ``encodings``, documentation strings in ``pydoc_data``). Test suites are optional.
_ALWAYS_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def find_source_files(root: Union[str, Path, None] = None, include_tests: bool = False) -> list[Path]:
    """All ``*.py`` files under ``root`` (default: the standard library), sorted by relative path.

    Third-party packages (``site-packages``) and generated data modules (``encodings``, ``pydoc_data``) are
    skipped, and test suites too unless ``include_tests``.

    """
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"Source root {str(root)!r} is not a directory")
    skipped = _ALWAYS_SKIPPED_DIRS if include_tests else _ALWAYS_SKIPPED_DIRS | _TEST_DIRS
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending; sorting is not needed here as the result is sorted.
        dirnames[:] = [d for d in dirnames if d not in skipped]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(f"No *.py files found under {str(root)!r}")
    return files


def read_texts(files: list[Path], max_chars: int) -> list[str]:
    """Read ``files`` in order until ``max_chars`` characters; the last file read is cut to fit.

    Undecodable bytes are replaced, so the result is the same on every run.

    """
    if max_chars < 1:
        raise ValueError(f"`max_chars` must be >= 1, got {max_chars}")
    texts = []
    remaining = max_chars
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text:
            continue
        texts.append(text[:remaining])
        remaining -= len(texts[-1])
        if remaining == 0:
            break
    return texts


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization) with ``EOS_TOKEN`` as id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # The full byte alphabet keeps every input encodable, even bytes the corpus never shows.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer
