"""LightningDataModule over the Python standard library's source, tokenized with a locally trained BPE."""

import hashlib
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from lightning_flce.data.corpus import EOS_TOKEN, find_source_files, read_texts, train_bpe_tokenizer
from lightning_flce.data.dataset import LABEL_FORMATS, TokenBlockDataset

# Bump when the cached files change meaning, so stale caches are rebuilt instead of misread.
_CACHE_FORMAT = 1
# Byte alphabet (256) + the end-of-text token: a smaller vocabulary could not merge anything.
_MIN_VOCAB_SIZE = 258


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_flce"


def _atomic_write(path: Path, write) -> None:
    # Write-then-rename: concurrent processes (DDP ranks) never see a half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


class PythonStdlibDataModule(pl.LightningDataModule):
    """Language-modelling data that exists on every machine with Python: the standard library's ``*.py`` files.

    Files are read in sorted order up to ``max_chars`` characters; every ``val_every``-th file is held out for
    validation (and test). A byte-level BPE tokenizer is trained on the training files; the tokenizer and the
    token ids are cached under ``cache_dir`` keyed by Python version, vocabulary size, ``max_chars`` and the
    split, so later runs skip both steps. Files are joined with an end-of-text token and cut into blocks of
    ``seq_len`` tokens.

    :attr:`vocab_size` is the trained tokenizer's real size (it can be below the requested one on a tiny
    corpus); link it to the model's vocabulary size. Reading it trains or loads the tokenizer, and
    ``hparams.vocab_size`` then records the real size too.

    Args:
        vocab_size: Requested BPE vocabulary size, including the end-of-text token.
        seq_len: Tokens per training sample.
        batch_size: Samples per batch (train, validation and test).
        max_chars: Characters of source read in total; caps tokenizer training and tokenization time.
        val_every: Every ``val_every``-th file (in sorted order) goes to the validation split.
        include_tests: Also read the standard library's test suites (``test``/``tests`` directories).
        label_format: ``"shifted"``: batches ``{"input_ids", "labels"}`` with ``labels[t]`` the next token;
            ``"hf"``: ``{"input_ids", "attention_mask", "labels"}`` with ``labels = input_ids``, for Hugging
            Face causal LMs that shift internally.
        num_workers: DataLoader worker processes.
        cache_dir: Cache directory; default ``$XDG_CACHE_HOME/lightning_flce`` (``~/.cache/lightning_flce``).
        root: Read ``*.py`` files under this directory instead of the standard library.

    Example (Python)::

        dm = PythonStdlibDataModule(vocab_size=8192, seq_len=128, batch_size=16)
        model = TinyGPT(vocab_size=dm.vocab_size)
        L.Trainer(max_steps=500).fit(model, datamodule=dm)

    Example (YAML, with ``lightning-flce fit --config``; ``lightning_flce.cli`` links ``vocab_size``)::

        data:
          class_path: lightning_flce.data.PythonStdlibDataModule
          init_args:
            vocab_size: 8192
            seq_len: 128
            batch_size: 16

    """

    def __init__(
        self,
        vocab_size: int = 8192,
        seq_len: int = 128,
        batch_size: int = 16,
        max_chars: int = 4_000_000,
        val_every: int = 10,
        include_tests: bool = False,
        label_format: str = "shifted",
        num_workers: int = 0,
        cache_dir: Optional[str] = None,
        root: Optional[str] = None,
    ) -> None:
        super().__init__()
        if vocab_size < _MIN_VOCAB_SIZE:
            raise ValueError(f"`vocab_size` must be >= {_MIN_VOCAB_SIZE}, got {vocab_size}")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_chars", max_chars)):
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")
        if val_every < 2:
            raise ValueError(
                f"`val_every` must be >= 2 (some files must be left for training), got {val_every}"
            )
        if label_format not in LABEL_FORMATS:
            raise ValueError(f"`label_format` must be one of {LABEL_FORMATS}, got {label_format!r}")
        if num_workers < 0:
            raise ValueError(f"`num_workers` must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        self.requested_vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_chars = max_chars
        self.val_every = val_every
        self.include_tests = include_tests
        self.label_format = label_format
        self.num_workers = num_workers
        self.root = root
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
        self._tokenizer: Optional[Tokenizer] = None
        self.train_dataset: Optional[TokenBlockDataset] = None
        self.val_dataset: Optional[TokenBlockDataset] = None

    @property
    def cache_path(self) -> Path:
        """Directory of this configuration's cached tokenizer and token ids."""
        py = ".".join(map(str, sys.version_info[:3]))
        key = (
            f"stdlib-py{py}-vocab{self.requested_vocab_size}-chars{self.max_chars}"
            f"-val{self.val_every}-tests{int(self.include_tests)}-fmt{_CACHE_FORMAT}"
        )
        if self.root is not None:
            root = str(Path(self.root).expanduser().resolve())
            key += "-root" + hashlib.sha256(root.encode()).hexdigest()[:12]
        return self.cache_dir / key

    @property
    def tokenizer(self) -> Tokenizer:
        """The BPE tokenizer, loaded from the cache or trained (and cached) on first use."""
        if self._tokenizer is None:
            self._set_tokenizer(self._load_or_train_tokenizer())
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The tokenizer's real vocabulary size; link this to the model."""
        return self.tokenizer.get_vocab_size()

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.token_to_id(EOS_TOKEN)

    def prepare_data(self) -> None:
        """Train the tokenizer and tokenize the corpus once (rank 0 of each node); later runs hit the cache."""
        if not (self.cache_path / "tokens.pt").is_file():
            self._build_token_cache()

    def setup(self, stage: str) -> None:
        path = self.cache_path / "tokens.pt"
        if not path.is_file():
            # setup() without prepare_data(), e.g. when used outside a Trainer.
            self._build_token_cache()
        tokens = torch.load(path, weights_only=True)
        self.train_dataset = TokenBlockDataset(tokens["train"], self.seq_len, self.label_format)
        self.val_dataset = TokenBlockDataset(tokens["val"], self.seq_len, self.label_format)
        for split, dataset in (("train", self.train_dataset), ("validation", self.val_dataset)):
            if len(dataset) < 1:
                raise ValueError(
                    f"The {split} split has {dataset.tokens.numel()} tokens, fewer than one block of"
                    f" `seq_len + 1 = {self.seq_len + 1}`. Increase `max_chars` or lower `seq_len`/`val_every`."
                )
        if len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"The train split has {len(self.train_dataset)} blocks, fewer than `batch_size={self.batch_size}`"
                " (the last partial batch is dropped). Increase `max_chars` or lower `batch_size`/`seq_len`."
            )

    def train_dataloader(self) -> DataLoader:
        return self._dataloader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._dataloader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        # There is no separate test split: testing reruns the held-out validation files.
        return self._dataloader(self.val_dataset, shuffle=False)

    def predict_dataloader(self) -> list[DataLoader]:
        """Every block of the training split, in order (dataloader 0), then the validation split's (1): what a
        teacher's top-k cache covers (``lightning-flce predict --config teacher_cache``)."""
        if self.train_dataset is None:
            raise RuntimeError("Call `setup()` (the Trainer does) before asking for a dataloader")
        return [
            self._dataloader(self.train_dataset, shuffle=False),
            self._dataloader(self.val_dataset, shuffle=False),
        ]

    def _dataloader(self, dataset: Optional[TokenBlockDataset], shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("Call `setup()` (the Trainer does) before asking for a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            # Fixed shapes every training step; evaluation keeps every block.
            drop_last=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def split_files(self) -> tuple[list[Path], list[Path]]:
        """The corpus files (before the ``max_chars`` cap) as ``(train_files, val_files)``."""
        files = find_source_files(self.root, include_tests=self.include_tests)
        train_files = [f for i, f in enumerate(files) if i % self.val_every != self.val_every - 1]
        val_files = [f for i, f in enumerate(files) if i % self.val_every == self.val_every - 1]
        return train_files, val_files

    def _read_split(self) -> tuple[list[str], list[str]]:
        train_files, val_files = self.split_files()
        # One character budget for both splits, shared in proportion to their file counts.
        val_chars = max(1, self.max_chars // self.val_every)
        return read_texts(train_files, self.max_chars - val_chars), read_texts(val_files, val_chars)

    def _set_tokenizer(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # Record the size in use: the model gets the real size through the CLI link, and the Trainer refuses
        # to log a model and a data module whose shared hyperparameters differ.
        if self.hparams["vocab_size"] != tokenizer.get_vocab_size():
            rank_zero_info(
                f"PythonStdlibDataModule: the BPE tokenizer has {tokenizer.get_vocab_size()} tokens, fewer than the"
                f" {self.requested_vocab_size} requested (too little text: raise max_chars for more)"
            )
            self.save_hyperparameters({**self.hparams, "vocab_size": tokenizer.get_vocab_size()})

    def _load_or_train_tokenizer(self, train_texts: Optional[list[str]] = None) -> Tokenizer:
        path = self.cache_path / "tokenizer.json"
        if path.is_file():
            return Tokenizer.from_file(str(path))
        if train_texts is None:
            train_texts, _ = self._read_split()
        tokenizer = train_bpe_tokenizer(train_texts, self.requested_vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda tmp: tokenizer.save(str(tmp)))
        return tokenizer

    def _build_token_cache(self) -> None:
        train_texts, val_texts = self._read_split()
        if self._tokenizer is None:
            self._set_tokenizer(self._load_or_train_tokenizer(train_texts))
        tokenizer = self._tokenizer
        eos = [tokenizer.token_to_id(EOS_TOKEN)]

        def encode(texts: list[str]) -> torch.Tensor:
            ids = itertools.chain.from_iterable(e.ids + eos for e in tokenizer.encode_batch(texts))
            return torch.tensor(list(ids), dtype=torch.int32)

        tokens = {"train": encode(train_texts), "val": encode(val_texts)}
        meta = {
            "python": sys.version,
            "requested_vocab_size": self.requested_vocab_size,
            "vocab_size": tokenizer.get_vocab_size(),
            "max_chars": self.max_chars,
            "train_files": len(train_texts),
            "val_files": len(val_texts),
            "train_tokens": tokens["train"].numel(),
            "val_tokens": tokens["val"].numel(),
        }
        path = self.cache_path
        path.mkdir(parents=True, exist_ok=True)
        _atomic_write(path / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))
        _atomic_write(path / "tokens.pt", lambda tmp: torch.save(tokens, tmp))
