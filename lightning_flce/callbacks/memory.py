"""
FLCE Memory Callback
====================

Logs the memory a training step used, what the fused LM head saved against the unfused one, and where the
peak goes; draws it per step and sums it up at the end of fit. This module wires the hooks; the arithmetic
is in :mod:`~lightning_flce.callbacks.memory_model`, the picture in :mod:`~lightning_flce.callbacks.memory_plot`,
the end-of-fit text in :mod:`~lightning_flce.callbacks.memory_report` and the allocator's recording in
:mod:`~lightning_flce.callbacks.memory_snapshot`.

"""

from __future__ import annotations

import operator
import os
import sys
import warnings
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

from lightning_flce.callbacks.memory_model import (
    HeadMemoryEstimate,
    HeadMemoryModel,
    MemoryBreakdown,
    precision_weight_dtype,
)
from lightning_flce.callbacks.memory_plot import plot_series, save_memory_plot
from lightning_flce.callbacks.memory_report import summary_text
from lightning_flce.callbacks.memory_snapshot import AllocatorHistory

try:
    import resource
except ImportError:  # Windows has no `resource`
    resource = None  # type: ignore[assignment]

_MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")
_PSUTIL_AVAILABLE = RequirementCache("psutil")
_TRITON_AVAILABLE = RequirementCache("triton")

_MIB = 2**20

PEAK_ALLOCATED = "memory/peak_allocated_mib"
PEAK_RESERVED = "memory/peak_reserved_mib"
ALLOCATED = "memory/allocated_mib"
PEAK_RSS = "memory/peak_rss_mib"
RSS = "memory/rss_mib"
UNFUSED_HEAD = "memory/unfused_head_mib"
SAVED_BY_FUSED_HEAD = "memory/saved_by_fused_head_mib"
# The deprecated alias of SAVED_BY_FUSED_HEAD (logged with the same value by earlier versions): no longer
# logged, and dropped from the history of checkpoints that hold it
_LEGACY_LOGITS_AVOIDED = "memory/logits_avoided_mib"
# the progress bar's short figures, in GiB (the bar shows `peak_GiB=2.56`, not a truncated MiB key)
PROG_BAR_PEAK = "peak_GiB"
PROG_BAR_PEAK_RSS = "peak_rss_GiB"


class FLCEMemoryCallback(Callback):
    r"""Logs peak and current memory per logged training step, what the fused LM head saved, and where the
    peak goes.

    A step is logged when an optimizer step happened in the batch and ``trainer.global_step`` is a multiple of
    ``Trainer(log_every_n_steps=...)`` (every step under ``fast_dev_run``), the same steps at which Lightning
    writes ``self.log`` values to the loggers. Values go through
    :meth:`~lightning.pytorch.core.LightningModule.log_dict`, so they reach every logger of the Trainer. With
    several processes every rank measures its own memory and the logged value is the maximum over ranks.

    **Logged metrics** (MiB, :math:`2^{20}` bytes)

    - On CUDA, through the caching allocator:

        - ``memory/peak_allocated_mib`` — peak memory held by tensors since the previous logged step
          (:func:`torch.cuda.max_memory_allocated`; the peak is reset after each log, so it also covers any
          validation that ran in between)
        - ``memory/peak_reserved_mib`` — peak memory reserved by the allocator over the same window
        - ``memory/allocated_mib`` — memory held by tensors at the end of the step

    - On CPU, for the whole process:

        - ``memory/peak_rss_mib`` — peak resident set size since the process started
          (``resource.getrusage``; the OS offers no reset)
        - ``memory/rss_mib`` — resident set size at the end of the step (``psutil`` if installed, else
          ``/proc/self/statm``; not logged where neither exists)

    - When the LightningModule reports its loss call's logits shape (``FLCEMixin`` does:
      ``flce_last_logits_shape = (N, V)`` after each ``flce_loss``, tokens of the call and vocabulary size):

        - ``memory/unfused_head_mib`` — what the unfused head (``F.linear``, the upcast, ``F.cross_entropy``;
          ``flce_naive=True``) adds, or would add, to the step's peak: three ``[N, V]`` tensors in the softmax
          dtype, 12 bytes a logit in ``16-mixed``, ``bf16-mixed``, ``bf16-true`` and ``32-true`` (24 in
          ``64-true``; a softcap adds 4, a z-loss 8). See :mod:`lightning_flce.callbacks.memory_model` for
          which tensors, and ``docs/lightning.md`` for the check against real GPU runs.
        - ``memory/saved_by_fused_head_mib`` — that minus the fused head's own buffers at its peak (one chunk
          of logits, the hidden states' and the weight's gradients): the expected difference between the
          peaks of a naive and a fused run. 0 with ``flce_naive=True``. The buffers need the head's hidden
          size, read from the module's ``[V, H]`` parameter; without one the saving is the whole unfused
          figure (an upper bound). Its deprecated alias ``memory/logits_avoided_mib`` is no longer logged.

      The precision is ``trainer.precision``; a module that reports only ``flce_last_logits_bytes`` gets
      that number for both. With gradient accumulation the figures are the last micro-batch's.
      A distillation module (:class:`~lightning_flce.models.DistillationModule`) also reports its teacher's
      ``flce_last_teacher_logits_shape = (N, V)`` and ``flce_teacher_compute_dtype``: both figures then count the
      teacher's logits and their softmax (8 bytes a logit in fp32, 6 in bf16), and the fused side one more chunk
      of logits (:meth:`~lightning_flce.callbacks.memory_model.HeadMemoryEstimate.with_teacher`).

    **Where the memory goes** (CUDA): at each logged step the callback counts the parameters, the gradients
    and the optimizer state held on the device; at the end of fit it logs them once for the step of the
    highest peak (after the first logged window, whose first forward ran before any gradient existed, once
    there is another): ``memory/peak_breakdown/{parameters,gradients,optimizer_state,
    activations_and_temporaries}_mib``, the last being the rest of that peak. The summary shows them beside
    the fused head's chunk buffer and saving. :meth:`memory_breakdown` gives the same split at any time.

    **The console**: with ``prog_bar=True`` the progress bar shows the peak in GiB under a short name
    (``peak_GiB=2.56``; ``peak_rss_GiB`` on CPU), the MiB metrics go to the loggers.

    **The plot**: ``plot=True`` writes ``memory.png`` to the Trainer's log directory at the end of training:
    the peak per logged step from 0, what the unfused head would have added stacked above it, the peak
    reserved, the device's capacity (GPU memory, or the machine's RAM on CPU; written in the corner when it
    is far above the data) and the validation runs. Long runs are drawn per bucket of steps, each the
    bucket's maximum.

    At the end of training it prints a table with the maximum and median of each metric over the logged steps,
    then the breakdown and the head's figures; the per-step values stay in :attr:`history`, the validation
    steps in :attr:`validation_steps`, and both are saved in checkpoints so a resumed run continues them.

    **Debugging CUDA memory**

    ``snapshot_steps`` records the allocator's history during the chosen steps and dumps it with
    ``torch.cuda.memory._dump_snapshot`` to ``<snapshot_dir>/memory_snapshot_step<step>_rank<rank>.pickle``;
    ``record_on_oom`` records from the start of fit and dumps ``memory_snapshot_oom_rank<rank>.pickle`` when a
    :class:`torch.cuda.OutOfMemoryError` stops training. Open the files at https://pytorch.org/memory_viz.
    Recording slows every allocation a little and keeps ``snapshot_max_entries`` events in host memory.

    Args:
        prog_bar: Show the peak memory in GiB in the progress bar (``peak_GiB`` on CUDA, ``peak_rss_GiB``
            on CPU).
        plot: At the end of training write ``memory.png`` to the Trainer's log directory
            (``trainer.log_dir``). Needs ``matplotlib``.
        snapshot_steps: An optimizer step or a list of them (0-based, as in ``trainer.global_step`` when the step
            starts, the logger's ``step`` column) for which to dump a CUDA memory snapshot. Ignored off CUDA.
        snapshot_dir: Where snapshots go; ``None`` means the Trainer's log directory.
        record_on_oom: Record allocator history from the start of fit and dump it on a CUDA out-of-memory error.
            Ignored off CUDA.
        snapshot_max_entries: How many allocation events a snapshot keeps (most recent ones).
        verbose: Print the summary at the end of training.

    Raises:
        ModuleNotFoundError:
            If ``plot=True`` and ``matplotlib`` is not installed.
        ValueError:
            If a snapshot step is negative, ``snapshot_max_entries`` is not positive, or the module's
            ``flce_last_logits_shape`` is not a pair of integers.

    Example::

        from lightning import Trainer
        from lightning_flce import FLCEMemoryCallback

        trainer = Trainer(callbacks=[FLCEMemoryCallback(prog_bar=True, plot=True)], log_every_n_steps=10)

    The same from a LightningCLI YAML config:

    .. code-block:: yaml

        trainer:
          log_every_n_steps: 10
          callbacks:
            - class_path: lightning_flce.FLCEMemoryCallback
              init_args:
                prog_bar: true
                plot: true
                snapshot_steps: [5]
                record_on_oom: true

    """

    def __init__(
        self,
        prog_bar: bool = False,
        plot: bool = False,
        snapshot_steps: Optional[Union[int, list[int]]] = None,
        snapshot_dir: Optional[str] = None,
        record_on_oom: bool = False,
        snapshot_max_entries: int = 100_000,
        verbose: bool = True,
    ) -> None:
        if plot and not _MATPLOTLIB_AVAILABLE:
            raise ModuleNotFoundError(
                f"`FLCEMemoryCallback(plot=True)` needs matplotlib: `pip install matplotlib`. {_MATPLOTLIB_AVAILABLE}"
            )
        for name, value in {
            "prog_bar": prog_bar,
            "plot": plot,
            "record_on_oom": record_on_oom,
            "verbose": verbose,
        }.items():
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {value!r}.")
        if _is_int(snapshot_steps):
            snapshot_steps = [snapshot_steps]
        snapshot_steps = list(snapshot_steps or [])
        if not all(_is_int(step) and step >= 0 for step in snapshot_steps):
            raise ValueError(
                f"`snapshot_steps` must be a step or a list of steps (ints >= 0), got {snapshot_steps}."
            )
        snapshot_steps = sorted(set(snapshot_steps))
        if not _is_int(snapshot_max_entries) or snapshot_max_entries <= 0:
            raise ValueError(f"`snapshot_max_entries` must be a positive int, got {snapshot_max_entries!r}.")
        self.prog_bar = prog_bar
        self.plot = plot
        self.snapshot_steps = snapshot_steps
        self.snapshot_dir = snapshot_dir
        self.record_on_oom = record_on_oom
        self.snapshot_max_entries = snapshot_max_entries
        self.verbose = verbose

        self.history: list[dict[str, float]] = []
        #: 0-based optimizer steps after which validation ran (sanity checks excluded)
        self.validation_steps: list[int] = []
        self.snapshot_paths: list[str] = []
        #: the split of the highest CUDA peak so far (this rank's), and the head's figures of that step
        self.peak_breakdown: Optional[MemoryBreakdown] = None
        self.head_estimate: Optional[HeadMemoryEstimate] = None
        #: the device's memory (GPU's, or the machine's RAM on CPU) in bytes, for the plot; None if unknown
        self.capacity_bytes: Optional[int] = None

        self._log_dir: Optional[str] = None
        self._cuda_device: Optional[torch.device] = None
        self._allocator_history = AllocatorHistory(snapshot_max_entries)
        self._snapshot_step: Optional[int] = None
        self._step_at_batch_start: Optional[int] = None
        self._fitting = False
        self._device_name: Optional[str] = None
        # (vocab size, the module's [V, H] parameter or None), found once per fit
        self._head_weight: Optional[tuple[int, Optional[torch.Tensor]]] = None
        # whether this fit logged a step yet, and whether the kept breakdown is of the fit's first window: its
        # first forward ran before any gradient existed, so counting them at the window's end misplaces them
        self._logged_in_fit = False
        self._breakdown_cold = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # `trainer.log_dir` broadcasts from rank 0, so it is read here, on every rank, and never in hooks that
        # only some ranks run (`on_exception`)
        self._log_dir = trainer.log_dir or trainer.default_root_dir

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # kept because the strategy moves the module back to CPU at teardown
        self._cuda_device = pl_module.device if pl_module.device.type == "cuda" else None
        self._fitting = True
        self._head_weight = None
        self.capacity_bytes = _capacity_bytes(self._cuda_device)
        self._device_name = (
            None if self._cuda_device is None else torch.cuda.get_device_name(self._cuda_device)
        )
        if self._cuda_device is None:
            if self.snapshot_steps or self.record_on_oom:
                rank_zero_warn(
                    "`FLCEMemoryCallback`: `snapshot_steps` and `record_on_oom` need a CUDA device; they are"
                    f" ignored on {pl_module.device.type!r}."
                )
            return
        if self.record_on_oom:
            self._allocator_history.start()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._logged_in_fit = False
        self._breakdown_cold = False
        if self._cuda_device is not None:
            # the first window starts with training, not with model setup or the sanity check
            torch.cuda.reset_peak_memory_stats(self._cuda_device)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step
        if (
            self._cuda_device is not None
            and self._snapshot_step is None
            and trainer.global_step in self.snapshot_steps
        ):
            self._snapshot_step = trainer.global_step
            if not self._allocator_history.recording:
                self._allocator_history.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # with gradient accumulation only the batch that stepped the optimizer closes a step
        stepped = trainer.global_step != self._step_at_batch_start
        if stepped and self._should_log(trainer):
            self._log_step(trainer, pl_module)
        if self._snapshot_step is not None and trainer.global_step > self._snapshot_step:
            self._finish_step_snapshot(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._fitting or trainer.sanity_checking:
            return
        step = max(trainer.global_step - 1, 0)  # after the optimizer step of this index, as in `history`
        if step not in self.validation_steps:
            self.validation_steps.append(step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._snapshot_step is not None:
            # training stopped inside the requested step
            self._finish_step_snapshot(trainer)
        self._allocator_history.stop()
        if not trainer.is_global_zero:
            return
        if self.peak_breakdown is not None:
            # once, at the step of the peak: only now is it known which step that was
            for logger in trainer.loggers:
                logger.log_metrics(self.peak_breakdown.metrics(), step=self.peak_breakdown.step)
        if not self.history:
            if self.plot:
                rank_zero_warn(
                    "`FLCEMemoryCallback(plot=True)`: no step was logged, so there is no memory plot."
                )
            return
        if self.verbose:
            rank_zero_info(self.summary())
        if self.plot:
            path = os.path.join(self._log_dir or trainer.default_root_dir, "memory.png")
            self.save_plot(path)
            rank_zero_info(f"`FLCEMemoryCallback`: memory plot written to {path}")

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._allocator_history.recording and isinstance(exception, torch.cuda.OutOfMemoryError):
            # only the ranks that ran out of memory get here, so every rank reports its own file
            try:
                path = self._dump_snapshot(trainer, "oom")
                message = (
                    f"CUDA ran out of memory; the allocator history up to the error is in {path}."
                    " Open it at https://pytorch.org/memory_viz to see what filled the GPU."
                )
            except Exception as dump_error:  # must not hide the out-of-memory error being handled
                message = f"CUDA ran out of memory and dumping the allocator history failed: {dump_error!r}"
            warnings.warn(rank_prefixed_message(message, trainer.global_rank), stacklevel=2)
        self._snapshot_step = None
        self._allocator_history.stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._allocator_history.stop()
        self._fitting = False

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [dict(row) for row in self.history],
            "validation_steps": list(self.validation_steps),
            "peak_breakdown": None if self.peak_breakdown is None else self.peak_breakdown.as_dict(),
            "head_estimate": None if self.head_estimate is None else self.head_estimate.as_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # checkpoints written before 0.2 hold only the history
        self.history = [_without_legacy_names(row) for row in state_dict.get("history", [])]
        self.validation_steps = list(state_dict.get("validation_steps", []))
        breakdown = state_dict.get("peak_breakdown")
        self.peak_breakdown = None if breakdown is None else MemoryBreakdown.from_dict(breakdown)
        estimate = state_dict.get("head_estimate")
        self.head_estimate = None if estimate is None else HeadMemoryEstimate(**estimate)

    def memory_breakdown(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> MemoryBreakdown:
        """The split of the CUDA peak since the last logged step (or the last reset), counted now."""
        if self._cuda_device is None:
            raise RuntimeError("`FLCEMemoryCallback.memory_breakdown` needs a fit running on a CUDA device.")
        return MemoryBreakdown.measure(
            step=trainer.global_step - 1,
            peak_bytes=torch.cuda.max_memory_allocated(self._cuda_device),
            parameters=pl_module.parameters(),
            optimizers=getattr(trainer, "optimizers", []),
            device=self._cuda_device,
        )

    def summary(self) -> str:
        """The maximum and median of each metric over the logged steps as a text table, then where the peak
        goes (CUDA) and the LM head's figures."""
        return summary_text(self.history, self.peak_breakdown, self.head_estimate)

    def save_plot(self, path: str) -> dict[str, Any]:
        """Write the memory per logged step as a PNG image to ``path``; returns what was drawn."""
        if not _MATPLOTLIB_AVAILABLE:
            raise ModuleNotFoundError(
                f"Plotting memory needs matplotlib: `pip install matplotlib`. {_MATPLOTLIB_AVAILABLE}"
            )
        on_cuda = any(PEAK_ALLOCATED in row for row in self.history)
        if on_cuda:
            series = plot_series(self.history, PEAK_ALLOCATED, SAVED_BY_FUSED_HEAD, PEAK_RESERVED)
            device = "GPU memory" + (f" ({self._device_name})" if self._device_name else "")
            labels = {"device_label": device, "peak_label": "peak allocated", "capacity_label": "GPU"}
        else:
            series = plot_series(self.history, PEAK_RSS, SAVED_BY_FUSED_HEAD)
            labels = {"device_label": "Process memory", "peak_label": "peak RSS", "capacity_label": "RAM"}
        if not series.steps:
            raise ValueError("`FLCEMemoryCallback.save_plot`: the history has no peak to draw.")
        return save_memory_plot(
            path, series, capacity_bytes=self.capacity_bytes, validation_steps=self.validation_steps, **labels
        )

    @staticmethod
    def _should_log(trainer: pl.Trainer) -> bool:
        if trainer.fast_dev_run:  # Lightning writes every step's values then
            return True
        if not trainer.log_every_n_steps:
            return False
        return trainer.global_step % trainer.log_every_n_steps == 0 or trainer.should_stop

    def _log_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cuda_device is not None:
            measured = {
                PEAK_ALLOCATED: torch.cuda.max_memory_allocated(self._cuda_device) / _MIB,
                PEAK_RESERVED: torch.cuda.max_memory_reserved(self._cuda_device) / _MIB,
                ALLOCATED: torch.cuda.memory_allocated(self._cuda_device) / _MIB,
            }
            headline = PEAK_ALLOCATED
        else:
            rss = _current_rss_bytes()
            peak_rss = _peak_rss_bytes()
            if rss is not None and peak_rss is not None:
                # the kernel's high-water mark (ru_maxrss) is updated lazily and can trail the current RSS
                peak_rss = max(peak_rss, rss)
            measured = {
                PEAK_RSS: None if peak_rss is None else peak_rss / _MIB,
                RSS: None if rss is None else rss / _MIB,
            }
            headline = PEAK_RSS
        estimate, unfused, saved = self._head_figures(trainer, pl_module)
        measured[UNFUSED_HEAD] = unfused
        measured[SAVED_BY_FUSED_HEAD] = saved

        metrics = self._max_across_ranks(trainer, pl_module, measured)
        if metrics:
            pl_module.log_dict(metrics, logger=bool(trainer.loggers), on_step=True, on_epoch=False)
            if self.prog_bar and headline in metrics:
                short = PROG_BAR_PEAK if headline == PEAK_ALLOCATED else PROG_BAR_PEAK_RSS
                pl_module.log(
                    short, metrics[headline] / 1024, prog_bar=True, logger=False, on_step=True, on_epoch=False
                )
        # 0-based like the loggers' `step` column: the index of the optimizer step just taken
        step = trainer.global_step - 1
        self.history.append({"step": step, **metrics})
        if estimate is not None and (self.head_estimate is None or self._cuda_device is None):
            self.head_estimate = estimate
        if self._cuda_device is not None:
            peak = torch.cuda.max_memory_allocated(self._cuda_device)
            cold = not self._logged_in_fit
            kept = self.peak_breakdown
            # the highest peak, from a window after the first step when there is one
            if (
                kept is None
                or (self._breakdown_cold and not cold)
                or (cold == self._breakdown_cold and peak > kept.peak_bytes)
            ):
                self.peak_breakdown = self.memory_breakdown(trainer, pl_module)
                self._breakdown_cold = cold
                if estimate is not None:
                    self.head_estimate = estimate
            torch.cuda.reset_peak_memory_stats(self._cuda_device)
        self._logged_in_fit = True

    def _head_figures(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[Optional[HeadMemoryEstimate], Optional[float], Optional[float]]:
        """The head's estimate of the last loss call, and its unfused and saved MiB (None: not reported)."""
        shape = _logits_shape(pl_module)
        reported = getattr(pl_module, "flce_last_logits_bytes", None)
        if shape is None:
            # a module of its own that states its saving in bytes: taken as it is
            return (None, None, None) if reported is None else (None, reported / _MIB, reported / _MIB)
        num_tokens, vocab_size = shape
        # the mixin reports 0 bytes on its naive path, which builds the logits
        naive = bool(getattr(pl_module, "flce_naive", False)) or reported == 0
        model = self._head_model(trainer, pl_module, vocab_size)
        estimate = model.estimate(num_tokens, vocab_size, naive=naive)
        teacher_shape = _logits_shape(pl_module, "flce_last_teacher_logits_shape")
        if teacher_shape is not None:  # distillation: the teacher's logits and softmax are avoided too
            teacher_dtype = getattr(pl_module, "flce_teacher_compute_dtype", None) or torch.float32
            estimate = estimate.with_teacher(
                *teacher_shape, teacher_dtype, block_rows=model.auxiliary_block_rows()
            )
        return estimate, estimate.unfused_bytes / _MIB, estimate.saved_bytes / _MIB

    def _head_model(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, vocab_size: int
    ) -> HeadMemoryModel:
        if self._head_weight is None or self._head_weight[0] != vocab_size:
            self._head_weight = (vocab_size, _find_head_weight(pl_module, vocab_size))
        weight = self._head_weight[1]
        # the loss's options: a module's own (DistillationModule's), else FLCEMixin's FLCEHeadLoss
        head_loss = getattr(pl_module, "flce_loss_options", None)
        if head_loss is None:
            head_loss = getattr(pl_module, "flce_head_loss", None)
        impl = getattr(head_loss, "impl", "auto")
        weight_device = weight.device if weight is not None else torch.device("cpu")
        if impl == "auto":  # the op's rule: Triton on CUDA
            impl = "triton" if weight_device.type == "cuda" and _TRITON_AVAILABLE else "torch"
        precision = getattr(trainer, "precision", "32-true")
        weight_dtype = weight.dtype if weight is not None else precision_weight_dtype(precision)
        accum_dtype = getattr(head_loss, "accum_dtype", None)
        if accum_dtype == torch.float32 and weight_dtype == torch.float64:
            accum_dtype = None  # the head loss's float32 never narrows an fp64 weight's accumulator
        return HeadMemoryModel(
            precision,
            weight_dtype,
            hidden_size=None if weight is None else weight.shape[1],
            softcap=getattr(pl_module, "flce_softcap", None),
            lse_square_scale=getattr(head_loss, "lse_square_scale", 0.0),
            chunk_size=getattr(head_loss, "chunk_size", None),
            impl=impl,
            accum_dtype=accum_dtype,
            device=weight_device,
            logits_precision=getattr(head_loss, "logits_precision", "input"),
            label_smoothing=getattr(head_loss, "label_smoothing", 0.0),
        )

    @staticmethod
    def _max_across_ranks(
        trainer: pl.Trainer, pl_module: pl.LightningModule, measured: dict[str, Optional[float]]
    ) -> dict[str, float]:
        """The maximum of each metric over ranks; a metric no rank has (``None``) is dropped.

        A collective that every rank runs: the metric names depend only on the device type and platform, which all
        ranks share, so every rank sends a tensor of the same length.

        """
        names = sorted(measured)
        if trainer.world_size > 1:
            # memory is never negative, so -1 marks a missing value and loses every max against a real one
            values = torch.tensor(
                [-1.0 if measured[name] is None else measured[name] for name in names],
                dtype=torch.float64,
                device=pl_module.device,
            )
            reduced = trainer.strategy.reduce(values, reduce_op="max").tolist()
            return {name: value for name, value in zip(names, reduced) if value >= 0}
        return {name: measured[name] for name in names if measured[name] is not None}

    def _finish_step_snapshot(self, trainer: pl.Trainer) -> None:
        path = self._dump_snapshot(trainer, f"step{self._snapshot_step}")
        rank_zero_info(
            f"`FLCEMemoryCallback`: CUDA memory snapshot of step {self._snapshot_step} written to {path}"
        )
        self._snapshot_step = None
        if not self.record_on_oom:
            self._allocator_history.stop()

    def _dump_snapshot(self, trainer: pl.Trainer, tag: str) -> str:
        directory = self.snapshot_dir or self._log_dir or trainer.default_root_dir
        path = os.path.join(directory, f"memory_snapshot_{tag}_rank{trainer.global_rank}.pickle")
        self._allocator_history.dump(path)
        self.snapshot_paths.append(path)
        return path


def _without_legacy_names(row: dict[str, float]) -> dict[str, float]:
    """A history row of an older checkpoint without the deprecated alias (its value under the current name)."""
    row = dict(row)
    legacy = row.pop(_LEGACY_LOGITS_AVOIDED, None)
    if legacy is not None:
        row.setdefault(SAVED_BY_FUSED_HEAD, legacy)
    return row


def _logits_shape(
    pl_module: pl.LightningModule, attribute: str = "flce_last_logits_shape"
) -> Optional[tuple[int, int]]:
    """The module's ``flce_last_logits_shape`` ``(N, V)`` (or another such ``attribute``), checked; None if it
    does not report one."""
    shape = getattr(pl_module, attribute, None)
    if shape is None:
        return None
    try:
        num_tokens, vocab_size = (operator.index(size) for size in shape)
    except (TypeError, ValueError):
        num_tokens = vocab_size = -1
    if num_tokens < 0 or vocab_size < 0:
        raise ValueError(f"`{attribute}` must be a pair of non-negative ints (N, V), got {shape!r}.")
    return num_tokens, vocab_size


def _find_head_weight(pl_module: pl.LightningModule, vocab_size: int) -> Optional[torch.Tensor]:
    """The module's ``[V, H]`` parameter (the LM head's, or the embedding tied to it), if it has one."""
    parameters = getattr(pl_module, "parameters", None)
    if parameters is None:
        return None
    for parameter in parameters():
        if parameter.dim() == 2 and parameter.shape[0] == vocab_size:
            return parameter
    return None


def _capacity_bytes(cuda_device: Optional[torch.device]) -> Optional[int]:
    if cuda_device is not None:
        return torch.cuda.get_device_properties(cuda_device).total_memory
    if _PSUTIL_AVAILABLE:
        import psutil

        return psutil.virtual_memory().total
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def _peak_rss_bytes() -> Optional[int]:
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # macOS reports bytes, Linux KiB
    return peak if sys.platform == "darwin" else peak * 1024


def _current_rss_bytes() -> Optional[int]:
    if _PSUTIL_AVAILABLE:
        import psutil

        return psutil.Process().memory_info().rss
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is an int subclass
