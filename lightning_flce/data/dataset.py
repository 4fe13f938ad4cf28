"""Fixed-length language-modelling blocks cut from one long stream of token ids."""

from typing import Any

import torch
from torch.utils.data import Dataset

LABEL_FORMATS = ("shifted", "hf")


def check_label_format(model: Any, expected: str) -> None:
    """Raises when the data module of ``model``'s trainer makes batches in another ``label_format`` than the
    model reads (a mismatch would train silently on the wrong targets: copying the input, or shifting twice).
    Data modules without a ``label_format`` attribute, and dataloaders passed directly, are not checked."""
    trainer = getattr(model, "_trainer", None)
    datamodule = getattr(trainer, "datamodule", None)
    actual = getattr(datamodule, "label_format", None)
    if actual is not None and actual != expected:
        raise ValueError(
            f"{type(model).__name__} reads labels in the {expected!r} format, but the data module"
            f" {type(datamodule).__name__} makes label_format={actual!r} batches: set the data module's"
            f" label_format={expected!r} (YAML: data.init_args.label_format: {expected})"
        )


class TokenBlockDataset(Dataset):
    """Non-overlapping blocks of ``seq_len`` tokens from a 1-D tensor of token ids.

    Args:
        tokens: 1-D integer tensor, the concatenated corpus.
        seq_len: Tokens per sample.
        label_format: ``"shifted"`` gives ``{"input_ids", "labels"}`` with ``labels[t] = input_ids[t + 1]``
            (the model does not shift); ``"hf"`` gives ``{"input_ids", "attention_mask", "labels"}`` with
            ``labels = input_ids`` (Hugging Face causal LMs shift internally).

    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, label_format: str = "shifted") -> None:
        if tokens.ndim != 1:
            raise ValueError(f"`tokens` must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"`seq_len` must be >= 1, got {seq_len}")
        if label_format not in LABEL_FORMATS:
            raise ValueError(f"`label_format` must be one of {LABEL_FORMATS}, got {label_format!r}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.label_format = label_format

    def __len__(self) -> int:
        # Each block needs one extra token: the target of its last position.
        return max(0, (self.tokens.numel() - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"block index {index} out of range for {len(self)} blocks")
        start = index * self.seq_len
        block = self.tokens[start : start + self.seq_len + 1].long()
        input_ids = block[:-1]
        if self.label_format == "shifted":
            return {"input_ids": input_ids, "labels": block[1:]}
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": input_ids.clone(),
        }
