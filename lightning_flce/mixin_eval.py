"""The Lightning wiring of the mixin's validation and test metrics: the part of
:class:`~lightning_flce.mixin.FLCEMixin` that adds each evaluation call's sums to
:class:`~lightning_flce.eval_metrics.TokenMetrics` (the arithmetic: token-weighted means per dataloader), and at
the end of each evaluation epoch logs ``val/*`` / ``test/*`` and a rank-zero summary line.
"""

from __future__ import annotations

from typing import Optional, cast

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_flce.console import metrics_summary, rank_zero_info_line
from lightning_flce.eval_metrics import TokenMetrics
from lightning_flce.mixin_step import MixinBase

__all__ = ["EvalMetricsLogging"]


class EvalMetricsLogging(MixinBase):
    """The evaluation metrics' part of the mixin: :meth:`_flce_add_eval` for the loss calls, the evaluation-epoch
    hooks that log and reset the metrics. ``FLCEMixin.__init__`` makes the state declared here."""

    #: token-weighted val/test metrics, one set per dataloader
    flce_eval_metrics: TokenMetrics
    #: the metrics logged at the end of the last validation (``{"val/loss": ..., ...}``)
    flce_last_eval_metrics: dict[str, float]
    _flce_eval_stage: Optional[str]  # the stage whose metrics are not logged yet

    @property
    def flce_eval_loss(self) -> MeanMetric:
        """The token-weighted mean loss of the (first) evaluation dataloader."""
        return cast(MeanMetric, self.flce_eval_metrics.loaders["0"].loss)

    @property
    def flce_eval_accuracy(self) -> MeanMetric:
        return cast(MeanMetric, self.flce_eval_metrics.loaders["0"].accuracy)

    def _flce_add_eval(
        self, stage: Optional[str], loss_sum: Tensor, correct: Tensor, num_tokens: Tensor
    ) -> None:
        """An evaluation call's loss sum, correct and counted tokens, into the metrics of its dataloader."""
        self.flce_eval_metrics.add(self._flce_dataloader_idx(), loss_sum, correct.sum(), num_tokens)
        self._flce_eval_stage = stage

    def _flce_dataloader_idx(self) -> Optional[int]:
        """The evaluation dataloader of the batch in progress; None when there is only one."""
        results = getattr(self._trainer, "_results", None)
        return getattr(results, "dataloader_idx", None)

    # ----------------------------------------------------------------- hooks

    def on_validation_epoch_start(self) -> None:
        self._flce_start_eval_epoch(len(self.trainer.num_val_batches))
        super().on_validation_epoch_start()

    def on_test_epoch_start(self) -> None:
        self._flce_start_eval_epoch(len(self.trainer.num_test_batches))
        super().on_test_epoch_start()

    def on_validation_epoch_end(self) -> None:
        self._flce_log_eval("val")
        super().on_validation_epoch_end()

    def on_test_epoch_end(self) -> None:
        self._flce_log_eval("test")
        super().on_test_epoch_end()

    def on_fit_end(self) -> None:
        if self.flce_last_eval_metrics:
            rank_zero_info_line(
                f"FLCEMixin: last validation: {metrics_summary(self.flce_last_eval_metrics)}", self._trainer
            )
        super().on_fit_end()

    # --------------------------------------------------------------- helpers

    def _flce_start_eval_epoch(self, num_dataloaders: int) -> None:
        stage, self._flce_eval_stage = self._flce_eval_stage, None
        metrics = self.flce_eval_metrics
        if stage is not None and metrics.pending:
            rank_zero_warn(
                f"FLCEMixin: the {stage} metrics of an earlier evaluation were never logged; an overridden"
                " on_validation_epoch_end / on_test_epoch_end must call super() (it logs and resets them). They"
                " now mix evaluations."
            )
        # the sums the steps add to (made here, so that a compiled step finds them and does not recompile)
        metrics.start([None] if num_dataloaders <= 1 else range(num_dataloaders), self.device)

    def _flce_log_eval(self, prefix: str) -> None:
        """Logs ``{prefix}/loss``, ``/perplexity`` and ``/token_accuracy`` (``.../dataloader_idx_N`` for each of
        several dataloaders, as Lightning names metrics logged in their steps), and a one-line summary."""
        self._flce_eval_stage = None
        metrics: dict[str, Tensor] = {}
        for dataloader_idx, means in self.flce_eval_metrics.compute().items():
            suffix = "" if dataloader_idx is None else f"/dataloader_idx_{dataloader_idx}"
            metrics.update({f"{prefix}/{name}{suffix}": value for name, value in means.items()})
        if not metrics:
            return
        trainer = self._trainer
        for name, value in metrics.items():
            self.log(
                name,
                value,
                prog_bar=name.startswith(f"{prefix}/loss"),
                sync_dist=True,  # torchmetrics synced them: equal on every rank, as above
                add_dataloader_idx=False,  # named above (epoch end is outside any dataloader)
            )
        if trainer is not None and trainer.sanity_checking:
            return
        values = {name: float(value) for name, value in metrics.items()}
        if prefix == "val":
            self.flce_last_eval_metrics = values
        where = "" if trainer is None else f" (epoch {trainer.current_epoch}, step {trainer.global_step})"
        rank_zero_info_line(f"FLCEMixin {prefix}{where}: {metrics_summary(values)}", trainer)
