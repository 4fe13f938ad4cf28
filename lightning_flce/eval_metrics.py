"""Token-weighted evaluation metrics of the LM loss (loss, perplexity, token accuracy), per dataloader."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric


class _Float64Mean(MeanMetric):
    """A ``MeanMetric`` whose states stay float64. Lightning's "16-true"/"bf16-true" plugins call
    ``module.to(dtype)``, which torchmetrics (unlike ``.half()``) lets convert metric states: an fp16 sum of
    token losses overflows after a few thousand tokens, a bf16 one rounds."""

    def __init__(self) -> None:
        super().__init__()
        self.set_dtype(torch.float64)

    def _apply(self, fn, *args, **kwargs):
        this = super()._apply(fn, *args, **kwargs)
        if not self._dtype_convert and this.dtype != torch.float64:
            this.set_dtype(torch.float64)
        return this


class _LoaderMeans(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loss = _Float64Mean()
        self.accuracy = _Float64Mean()


class TokenMetrics(nn.Module):
    """Mean loss and token accuracy over the non-ignored tokens of an evaluation, one pair per dataloader.

    The steps :meth:`add` to plain float64 sums, in place (no torchmetrics call inside a step, and buffers made
    by :meth:`start` at the start of the epoch, so a compiled validation step neither breaks its graph nor
    recompiles for the metrics); :meth:`compute` folds each dataloader's sums into its torchmetrics means
    (float64 states; synced over the ranks like any torchmetrics metric), computes and resets them. Their
    states are not persistent: checkpoints do not change.
    """

    def __init__(self) -> None:
        super().__init__()
        self.loaders = nn.ModuleDict({"0": _LoaderMeans()})
        # dataloader_idx (None: the only dataloader) -> float64 [loss sum, correct tokens, tokens, batches]
        self._sums: dict[Optional[int], Tensor] = {}

    def start(self, dataloader_indices, device: torch.device) -> None:
        """Makes the sums of these dataloaders (those of an evaluation never computed are kept)."""
        for dataloader_idx in dataloader_indices:
            if dataloader_idx not in self._sums:
                self._sums[dataloader_idx] = torch.zeros(4, dtype=torch.float64, device=device)

    @property
    def pending(self) -> bool:
        """Whether batches were added since the last :meth:`compute`."""
        return any(bool(sums[3] > 0) for sums in self._sums.values())

    def add(
        self, dataloader_idx: Optional[int], loss_sum: Tensor, correct: Tensor, num_tokens: Tensor
    ) -> None:
        """Adds a batch's loss sum, correct tokens and non-ignored tokens to its dataloader's sums."""
        batch = torch.stack(
            [
                loss_sum.detach().double(),
                correct.double(),
                num_tokens.double(),
                num_tokens.new_ones((), dtype=torch.float64),
            ]
        )
        sums = self._sums.get(dataloader_idx)
        if sums is None:  # no start() (an overridden epoch-start hook without super())
            self._sums[dataloader_idx] = batch
        else:
            sums.add_(batch)

    def compute(self) -> dict[Optional[int], dict[str, Tensor]]:
        """``{dataloader_idx: {"loss", "perplexity", "token_accuracy"}}`` of the dataloaders with batches since
        the last call (every rank must call it: the means sync over the ranks)."""
        sums, self._sums = self._sums, {}
        results = {}
        for dataloader_idx in sorted(sums, key=lambda index: -1 if index is None else index):
            loss_sum, correct, num_tokens, batches = sums[dataloader_idx]
            if not batches > 0:
                continue
            key = str(dataloader_idx or 0)
            if key not in self.loaders:
                self.loaders[key] = _LoaderMeans().to(num_tokens.device)
            means = self.loaders[key]
            tokens = num_tokens.clamp(min=1)
            means.loss.update(loss_sum / tokens, num_tokens)
            means.accuracy.update(correct / tokens, num_tokens)
            loss = means.loss.compute()
            results[dataloader_idx] = {
                "loss": loss,
                "perplexity": torch.exp(loss),
                "token_accuracy": means.accuracy.compute(),
            }
            means.loss.reset()
            means.accuracy.reset()
        return results
