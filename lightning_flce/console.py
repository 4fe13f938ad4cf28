"""Rank-zero console lines that keep off the progress bar (TQDM's or Rich's).

A TQDM bar redraws its line with a carriage return and leaves it unterminated, so a logging handler that
writes between two redraws lands on the bar's line: in a terminal the next redraw overwrites it, in a captured
log (``lightning-flce fit ... > log 2>&1``) it is glued to the bar's last frame. Rich's bar, in a terminal,
sends ``print`` above its display through its proxies of ``sys.stdout``/``sys.stderr``; a logging handler made
before it holds the real stream, so its line lands inside the display and the next frame erases it.
:func:`rank_zero_info_line` logs like Lightning's ``rank_zero_info`` (the ``lightning.pytorch`` logger, level
INFO, rank zero), with the bars out of the way: TQDM's cleared and redrawn below the line in a terminal, as
``tqdm.write`` does, or their line ended with a newline elsewhere (a carriage return cannot erase in a file);
the console handlers of the line pointed at Rich's proxies while its display runs.

    from lightning_flce.console import rank_zero_info_line

    rank_zero_info_line("FLCEMixin val (epoch 0, step 100): loss 6.3786", trainer)
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_module

if TYPE_CHECKING:
    import lightning.pytorch as pl

_BAR_NAMES = ("train_progress_bar", "val_progress_bar", "test_progress_bar", "predict_progress_bar")


def rank_zero_info_line(message: str, trainer: Optional[pl.Trainer] = None) -> None:
    """``rank_zero_info(message)`` on a line of its own, beside the trainer's TQDM bar or a Rich live display."""
    with _off_the_bars(open_tqdm_bars(trainer)), _through_rich_proxies():
        rank_zero_info(message)


def open_tqdm_bars(trainer: Optional[pl.Trainer]) -> list[Any]:
    """The bars of the trainer's enabled ``TQDMProgressBar`` that are drawing now (not closed or disabled)."""
    callback = None if trainer is None else trainer.progress_bar_callback
    if not isinstance(callback, TQDMProgressBar) or not callback.is_enabled:
        return []
    bars = []
    for name in _BAR_NAMES:
        try:
            bar = getattr(callback, name)
        except TypeError:  # Lightning's "reference has not been set yet": that stage has not run
            continue
        if bar is not None and not bar.disable:  # tqdm.close() disables the bar
            bars.append(bar)
    return bars


@contextmanager
def _off_the_bars(bars: list[Any]) -> Iterator[None]:
    if not bars:
        yield
        return
    files = {id(bar.fp): bar.fp for bar in bars}.values()
    if all(_is_terminal(file) for file in files):
        # clears every open bar on stdout/stderr, and redraws them after the line
        with type(bars[0]).external_write_mode(file=next(iter(files))):
            yield
        return
    for file in files:
        file.write("\n")
        file.flush()
    yield


@contextmanager
def _through_rich_proxies() -> Iterator[None]:
    # Rich's FileProxy (rich.file_proxy) names the stream it stands for: rich_proxied_file
    proxies = {
        id(real): stream for stream in (sys.stdout, sys.stderr) if (real := _proxied(stream)) is not None
    }
    swapped = []
    if proxies:
        for handler in _handlers_of(rank_zero_module.log):  # the logger rank_zero_info writes to
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in proxies:
                swapped.append((handler, handler.setStream(proxies[id(handler.stream)])))
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)


def _proxied(stream: Any) -> Any:
    return getattr(stream, "rich_proxied_file", None)


def _handlers_of(logger: Optional[logging.Logger]) -> list[logging.Handler]:
    """The handlers a record of ``logger`` reaches (the logger's and its ancestors' up to a non-propagating one)."""
    handlers: list[logging.Handler] = []
    while logger is not None:
        handlers.extend(logger.handlers)
        logger = logger.parent if logger.propagate else None
    return handlers


def _is_terminal(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def metrics_summary(metrics: dict[str, float]) -> str:
    """``loss 5.1300, perplexity 169.0, token accuracy 0.2310`` from ``{"val/loss": 5.13, ...}``; several
    dataloaders' metrics (``val/loss/dataloader_idx_1``, as Lightning names them) grouped as ``[dataloader 1] ...``."""
    groups: dict[str, list[str]] = {}
    for name, value in metrics.items():
        stem, _, loader = name.partition("/dataloader_idx_")
        label = stem.split("/", 1)[1].replace("student_ce", "student CE").replace("_", " ")
        text = f"{label} {value:.4g}" if label == "perplexity" else f"{label} {value:.4f}"
        groups.setdefault(loader, []).append(text)
    return "; ".join(
        (f"[dataloader {loader}] " if loader else "") + ", ".join(texts) for loader, texts in groups.items()
    )
