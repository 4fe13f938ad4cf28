"""The memory plot of :class:`~lightning_flce.callbacks.FLCEMemoryCallback`: series from its history, then a PNG.

:func:`plot_series` turns the per-step history into what is drawn (long runs cut into buckets that keep each
bucket's maximum, so no spike is lost); :func:`save_memory_plot` draws it with matplotlib's object API (no
pyplot: no GUI backend, no global figure state).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

_MIB = 2**20
# most bars/points drawn; longer histories are bucketed
MAX_POINTS = 600
# up to this many steps each gets its own bar; beyond, the series are drawn as areas
MAX_BARS = 60
# a capacity more than this many times the top of the data would squash the data to the floor: it is
# written in the corner instead of drawn
MAX_CAPACITY_RATIO = 4.0
# up to this many validation runs are vertical lines; beyond, ticks under the axis
MAX_VALIDATION_LINES = 40

PEAK_COLOR = "#3b75af"
SAVED_COLOR = "#f2a93b"
RESERVED_COLOR = "#555555"
CAPACITY_COLOR = "#c0392b"
VALIDATION_COLOR = "#2e8b57"


@dataclass
class PlotSeries:
    """What the plot draws, in MiB per (bucket of) logged step(s)."""

    steps: list[int]
    peak: list[float]
    saved: list[float]
    reserved: list[float] = field(default_factory=list)
    bucket_size: int = 1


def plot_series(
    history: Sequence[dict[str, float]],
    peak_key: str,
    saved_key: str,
    reserved_key: Optional[str] = None,
    max_points: int = MAX_POINTS,
) -> PlotSeries:
    """The series of ``history`` (rows with ``"step"`` and metric keys) that have ``peak_key``.

    Beyond ``max_points`` rows, consecutive rows are grouped into equal buckets drawn at their first step,
    each series taking the bucket's maximum. A missing saving counts as 0, a missing reserved value drops
    the reserved line.
    """
    rows = [row for row in history if peak_key in row]
    bucket = max(1, math.ceil(len(rows) / max_points))
    series = PlotSeries([], [], [], [], bucket)
    with_reserved = reserved_key is not None and all(reserved_key in row for row in rows)
    for start in range(0, len(rows), bucket):
        group = rows[start : start + bucket]
        series.steps.append(int(group[0]["step"]))
        series.peak.append(max(row[peak_key] for row in group))
        series.saved.append(max(row.get(saved_key, 0.0) for row in group))
        if with_reserved:
            series.reserved.append(max(row[reserved_key] for row in group))
    return series


def _unit(top_mib: float) -> tuple[str, float]:
    return ("GiB", 1024.0) if top_mib >= 1024 else ("MiB", 1.0)


def save_memory_plot(
    path: str,
    series: PlotSeries,
    *,
    device_label: str,
    peak_label: str,
    capacity_bytes: Optional[int] = None,
    capacity_label: str = "device capacity",
    validation_steps: Sequence[int] = (),
) -> dict[str, object]:
    """Draw ``series`` to a PNG at ``path``; returns what was drawn (y limits, unit, whether the capacity is
    a line or a note in the title, whether the steps are bars, the title).

    The measured peak is the lower part of each bar (area for long runs) from 0, what the unfused head would
    have added stacked above it; the capacity is a line when it fits the chart (else said in the title), validation
    runs are dotted lines (ticks under the axis when there are many).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    top_data = max([p + s for p, s in zip(series.peak, series.saved)] + series.reserved + [1e-9])
    capacity_mib = capacity_bytes / _MIB if capacity_bytes else None
    capacity_drawn = capacity_mib is not None and capacity_mib <= MAX_CAPACITY_RATIO * top_data
    top = max(top_data, capacity_mib if capacity_drawn else 0.0)
    unit, scale = _unit(top)
    steps = series.steps
    peak = [v / scale for v in series.peak]
    saved = [v / scale for v in series.saved]
    any_saved = any(saved)
    as_bars = len(steps) <= MAX_BARS

    figure = Figure(figsize=(9, 4.8), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    # legend entries bottom up, the order the eye reads the chart
    legend: list[tuple[Any, str]] = []
    saved_style = {"color": SAVED_COLOR, "alpha": 0.55, "hatch": "//", "edgecolor": SAVED_COLOR, "zorder": 2}
    saved_label = "+ what the unfused head would add (estimate)"
    if as_bars:
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        width = 0.8 * (min(gaps) if gaps else 1)
        legend.append((axes.bar(steps, peak, width=width, color=PEAK_COLOR, zorder=2), peak_label))
        if any_saved:
            legend.append((axes.bar(steps, saved, width=width, bottom=peak, **saved_style), saved_label))
        axes.set_xlim(steps[0] - width, steps[-1] + width)
    else:
        tops = [p + s for p, s in zip(peak, saved)]
        legend.append(
            (axes.fill_between(steps, 0, peak, step="post", color=PEAK_COLOR, zorder=2), peak_label)
        )
        if any_saved:
            area = axes.fill_between(steps, peak, tops, step="post", linewidth=0, **saved_style)
            legend.append((area, saved_label))
        axes.set_xlim(steps[0], steps[-1])
    if series.reserved:
        reserved = [v / scale for v in series.reserved]
        (line,) = axes.step(
            steps, reserved, where="mid" if as_bars else "post", color=RESERVED_COLOR, linewidth=1.0,
            linestyle="--", zorder=3,
        )  # fmt: skip
        legend.append((line, "peak reserved by the allocator"))
    if capacity_drawn:
        line = axes.axhline(capacity_mib / scale, color=CAPACITY_COLOR, linewidth=1.6, zorder=4)
        legend.append((line, f"{capacity_label} {capacity_mib / 1024:.1f} GiB"))
    # a capacity far above the data: said in the title, not drawn
    capacity_note = None
    if capacity_mib is not None and not capacity_drawn:
        used = 100 * max(series.peak) / capacity_mib
        capacity_note = (
            f"{capacity_label} {capacity_mib / 1024:.1f} GiB, far above (the peak uses {used:.1f}%)"
        )

    validation = sorted(set(validation_steps))
    if len(validation) > MAX_VALIDATION_LINES:
        (marks,) = axes.plot(
            validation, [0] * len(validation), linestyle="none", marker="|", markersize=9,
            color=VALIDATION_COLOR, clip_on=False, zorder=5,
        )  # fmt: skip
        legend.append((marks, "validation"))
    elif validation:
        for step in validation:
            line = axes.axvline(step, color=VALIDATION_COLOR, linestyle=":", linewidth=1.2, zorder=3)
        legend.append((line, "validation"))

    axes.set_ylim(0, top / scale * 1.12)
    axes.set_ylabel(unit)
    bucketed = f" (max of each {series.bucket_size} logged steps)" if series.bucket_size > 1 else ""
    axes.set_xlabel("optimizer step" + bucketed)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steps[-1] >= 10_000:
        axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k"))

    def amount(mib: float) -> str:
        return f"{mib / 1024:.2f} GiB" if unit == "GiB" else f"{mib:.0f} MiB"

    headline = f"peak {amount(max(series.peak))}"
    if any_saved:
        headline += (
            f"; without the fused head ~{amount(max(p + s for p, s in zip(series.peak, series.saved)))}"
        )
    title = f"{device_label}: {headline}" + (f"\n{capacity_note}" if capacity_note else "")
    axes.set_title(title, fontsize="medium")
    axes.grid(axis="y", alpha=0.3, zorder=0)
    # under the chart, where it never hides a bar
    axes.legend(
        *zip(*legend), loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize="small",
        frameon=False,
    )  # fmt: skip
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, format="png")
    return {
        "ylim": tuple(axes.get_ylim()),
        "unit": unit,
        "capacity_drawn": capacity_drawn,
        "capacity_note": capacity_note,
        "bars": as_bars,
        "title": title,
    }
