"""Rank-zero console lines that keep off a TQDM progress bar's line.

A TQDM bar redraws its line with a carriage return and leaves it unterminated, so a logging handler that
writes between two redraws lands on the bar's line: in a terminal the next redraw overwrites it, in a captured
log (``lightning-flce fit ... > log 2>&1``) it is glued to the bar's last frame. :func:`rank_zero_info_line`
logs like Lightning's ``rank_zero_info`` (the ``lightning.pytorch`` logger, level INFO, rank zero) and first
gets the open bars out of the way, as ``tqdm.write`` does: in a terminal it clears them and redraws them below
the line; elsewhere a carriage return cannot erase them, so it ends their line with a newline.

    from lightning_flce.console import rank_zero_info_line

    rank_zero_info_line("FLCEMixin val (epoch 0, step 100): loss 6.3786", trainer)

Rich's progress bar needs nothing of this: off a terminal it draws only when it stops.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    import lightning.pytorch as pl

_BAR_NAMES = ("train_progress_bar", "val_progress_bar", "test_progress_bar", "predict_progress_bar")


def rank_zero_info_line(message: str, trainer: Optional[pl.Trainer] = None) -> None:
    """``rank_zero_info(message)`` on a line of its own, beside the trainer's TQDM progress bar if one is open."""
    bars = open_tqdm_bars(trainer)
    if not bars:
        rank_zero_info(message)
        return
    with _off_the_bars(bars):
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


def _is_terminal(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
