"""
FLCE Memory Callback
====================

Logs the memory a training step used, and the logits memory the fused loss avoided.

"""

from __future__ import annotations

import operator
import os
import statistics
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

try:
    import resource
except ImportError:  # Windows has no `resource`
    resource = None  # type: ignore[assignment]

_MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")
_PSUTIL_AVAILABLE = RequirementCache("psutil")

_MIB = 2**20

PEAK_ALLOCATED = "memory/peak_allocated_mib"
PEAK_RESERVED = "memory/peak_reserved_mib"
ALLOCATED = "memory/allocated_mib"
PEAK_RSS = "memory/peak_rss_mib"
RSS = "memory/rss_mib"
LOGITS_AVOIDED = "memory/logits_avoided_mib"


class FLCEMemoryCallback(Callback):
    r"""Logs peak and current memory per logged training step, and the logits memory the fused loss avoided.

    A step is logged when an optimizer step happened in the batch and ``trainer.global_step`` is a multiple of
    ``Trainer(log_every_n_steps=...)`` (every step under ``fast_dev_run``), the same steps at which Lightning
    writes ``self.log`` values to the loggers. Values go through :meth:`~lightning.pytorch.core.LightningModule.log_dict`, so they reach every logger
    of the Trainer (and the progress bar with ``prog_bar=True``). With several processes every rank measures its
    own memory and the logged value is the maximum over ranks.

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

    - ``memory/logits_avoided_mib`` — the logits the naive loss would have held, logged when the LightningModule
      reports them (``FLCEMixin`` does) through two attributes set after each loss call:
      ``flce_last_logits_shape = (N, V)`` and ``flce_last_logits_bytes``. The naive bytes are those of one fp32
      ``[N, V]`` logits tensor, ``N * V * 4``, with ``N`` the tokens of the last loss call (ignored ones
      included) and ``V`` the vocabulary size; ``flce_last_logits_bytes`` when set, else computed from the shape.
      This is a lower bound of the saving: it does not count the logits gradient of the same size that the naive
      backward also holds, the half-precision logits before the fp32 upcast under autocast, or the
      softmax/log-softmax saved for backward; nor does it subtract the fused loss's own ``[chunk_size, V]``
      buffers. With gradient accumulation it is the last micro-batch's.

    At the end of training it prints a table with the maximum and median of each metric over the logged steps;
    the per-step values stay in :attr:`history`, which is saved in checkpoints so a resumed run continues it.

    **Debugging CUDA memory**

    ``snapshot_steps`` records the allocator's history during the chosen steps and dumps it with
    ``torch.cuda.memory._dump_snapshot`` to ``<snapshot_dir>/memory_snapshot_step<step>_rank<rank>.pickle``;
    ``record_on_oom`` records from the start of fit and dumps ``memory_snapshot_oom_rank<rank>.pickle`` when a
    :class:`torch.cuda.OutOfMemoryError` stops training. Open the files at https://pytorch.org/memory_viz.
    Recording slows every allocation a little and keeps ``snapshot_max_entries`` events in host memory.

    Args:
        prog_bar: Also show the peak memory metric (``peak_allocated`` on CUDA, ``peak_rss`` on CPU) in the
            progress bar.
        plot: At the end of training write ``memory.png``, the metrics per logged step, to the Trainer's log
            directory (``trainer.log_dir``). Needs ``matplotlib``.
        snapshot_steps: An optimizer step or a list of them (0-based, as in ``trainer.global_step`` when the step
            starts, the logger's ``step`` column) for which to dump a CUDA memory snapshot. Ignored off CUDA.
        snapshot_dir: Where snapshots go; ``None`` means the Trainer's log directory.
        record_on_oom: Record allocator history from the start of fit and dump it on a CUDA out-of-memory error.
            Ignored off CUDA.
        snapshot_max_entries: How many allocation events a snapshot keeps (most recent ones).
        verbose: Print the summary table at the end of training.

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
        self.snapshot_paths: list[str] = []

        self._log_dir: Optional[str] = None
        self._cuda_device: Optional[torch.device] = None
        self._recording = False
        self._legacy_recording = False
        self._snapshot_step: Optional[int] = None
        self._step_at_batch_start: Optional[int] = None

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
        if self._cuda_device is None:
            if self.snapshot_steps or self.record_on_oom:
                rank_zero_warn(
                    "`FLCEMemoryCallback`: `snapshot_steps` and `record_on_oom` need a CUDA device; they are"
                    f" ignored on {pl_module.device.type!r}."
                )
            return
        if self.record_on_oom:
            self._start_recording()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
            if not self._recording:
                self._start_recording()

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
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._snapshot_step is not None:
            # training stopped inside the requested step
            self._finish_step_snapshot(trainer)
        self._stop_recording()
        if not trainer.is_global_zero:
            return
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
        if self._recording and isinstance(exception, torch.cuda.OutOfMemoryError):
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
        self._stop_recording()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_recording()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(row) for row in self.history]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(row) for row in state_dict.get("history", [])]

    def summary(self) -> str:
        """The maximum and median of each metric over the logged steps, as a text table."""
        # in order of first appearance: a resumed run may add metrics (another device, a module that reports logits)
        names = list(dict.fromkeys(name for row in self.history for name in row if name != "step"))
        width = max([len(name) for name in names] + [len("metric")])
        lines = [
            f"FLCEMemoryCallback: memory over {len(self.history)} logged steps (MiB)",
            f"{'metric':<{width}}  {'max':>12}  {'median':>12}",
        ]
        for name in names:
            values = [row[name] for row in self.history if name in row]
            lines.append(f"{name:<{width}}  {max(values):>12.1f}  {statistics.median(values):>12.1f}")
        return "\n".join(lines)

    def save_plot(self, path: str) -> None:
        """Write the logged metrics per step as a PNG image to ``path``."""
        if not _MATPLOTLIB_AVAILABLE:
            raise ModuleNotFoundError(
                f"Plotting memory needs matplotlib: `pip install matplotlib`. {_MATPLOTLIB_AVAILABLE}"
            )
        # Figure + Agg canvas instead of pyplot: no GUI backend, no global figure state
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        names = sorted({name for row in self.history for name in row if name != "step"})
        for name in names:
            rows = [row for row in self.history if name in row]
            style = "--" if name == LOGITS_AVOIDED else "-"
            axes.plot(
                [row["step"] for row in rows], [row[name] for row in rows], style, marker=".", label=name
            )
        axes.set_xlabel("step")
        axes.set_ylabel("MiB")
        axes.set_title("Memory per logged step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
        figure.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        figure.savefig(path, format="png")

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
        logits_bytes = _logits_bytes(pl_module)
        measured[LOGITS_AVOIDED] = None if logits_bytes is None else logits_bytes / _MIB

        metrics = self._max_across_ranks(trainer, pl_module, measured)
        if metrics:
            logger = bool(trainer.loggers)
            if headline in metrics:
                pl_module.log(
                    headline,
                    metrics[headline],
                    prog_bar=self.prog_bar,
                    logger=logger,
                    on_step=True,
                    on_epoch=False,
                )
            others = {name: value for name, value in metrics.items() if name != headline}
            if others:
                pl_module.log_dict(others, logger=logger, on_step=True, on_epoch=False)
        # 0-based like the loggers' `step` column: the index of the optimizer step just taken
        self.history.append({"step": trainer.global_step - 1, **metrics})
        if self._cuda_device is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda_device)

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

    def _start_recording(self) -> None:
        history = torch.cuda.memory._record_memory_history
        try:
            history(enabled="all", max_entries=self.snapshot_max_entries)
            self._legacy_recording = False
        except TypeError:
            # torch < 2.1 only had the boolean form
            history(True, trace_alloc_max_entries=self.snapshot_max_entries, trace_alloc_record_context=True)
            self._legacy_recording = True
        self._recording = True

    def _stop_recording(self) -> None:
        if not self._recording:
            return
        history = torch.cuda.memory._record_memory_history
        if self._legacy_recording:
            history(False)
        else:
            history(enabled=None)
        self._recording = False

    def _finish_step_snapshot(self, trainer: pl.Trainer) -> None:
        path = self._dump_snapshot(trainer, f"step{self._snapshot_step}")
        rank_zero_info(
            f"`FLCEMemoryCallback`: CUDA memory snapshot of step {self._snapshot_step} written to {path}"
        )
        self._snapshot_step = None
        if not self.record_on_oom:
            self._stop_recording()

    def _dump_snapshot(self, trainer: pl.Trainer, tag: str) -> str:
        directory = self.snapshot_dir or self._log_dir or trainer.default_root_dir
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"memory_snapshot_{tag}_rank{trainer.global_rank}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        self.snapshot_paths.append(path)
        return path


def _logits_bytes(pl_module: pl.LightningModule) -> Optional[int]:
    """The bytes of the fp32 ``[N, V]`` logits the module's last loss call avoided, if it reports them."""
    logits_bytes = getattr(pl_module, "flce_last_logits_bytes", None)
    if logits_bytes is not None:
        return int(logits_bytes)
    shape = getattr(pl_module, "flce_last_logits_shape", None)
    if shape is None:
        return None
    try:
        num_tokens, vocab_size = (operator.index(size) for size in shape)
    except (TypeError, ValueError):
        num_tokens = vocab_size = -1
    if num_tokens < 0 or vocab_size < 0:
        raise ValueError(
            f"`flce_last_logits_shape` must be a pair of non-negative ints (N, V), got {shape!r}."
        )
    return num_tokens * vocab_size * 4


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
