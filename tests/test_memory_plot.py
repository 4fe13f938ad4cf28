"""The memory plot: its series (bucketed for long runs) and the PNG read back."""

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from lightning_flce.callbacks import FLCEMemoryCallback, memory_plot
from lightning_flce.callbacks.memory import (
    PEAK_ALLOCATED,
    PEAK_RESERVED,
    PEAK_RSS,
    SAVED_BY_FUSED_HEAD,
)

MIB = 2**20


def _history(num_steps, every=1, spike_step=None):
    rows = []
    for step in range(every - 1, num_steps, every):
        peak = 2600.0 + (step % 7) + (400.0 if step == spike_step else 0.0)
        rows.append(
            {"step": step, PEAK_ALLOCATED: peak, PEAK_RESERVED: peak + 300, SAVED_BY_FUSED_HEAD: 6016.0}
        )
    return rows


def _pixels_of(image, color, tolerance=0.04):
    """How many pixels of ``image`` (RGB(A) floats) have ``color``."""
    return int((np.abs(image[..., :3] - np.array(to_rgb(color))).max(axis=-1) < tolerance).sum())


def test_short_history_is_not_bucketed():
    series = memory_plot.plot_series(_history(20), PEAK_ALLOCATED, SAVED_BY_FUSED_HEAD, PEAK_RESERVED)
    assert series.bucket_size == 1
    assert series.steps == list(range(20))
    assert series.saved == [6016.0] * 20
    assert series.reserved == [p + 300 for p in series.peak]


def test_long_history_keeps_each_buckets_max():
    history = _history(100_000, every=10, spike_step=73_129)
    series = memory_plot.plot_series(history, PEAK_ALLOCATED, SAVED_BY_FUSED_HEAD, PEAK_RESERVED)
    assert len(series.steps) <= memory_plot.MAX_POINTS
    assert series.bucket_size == 17  # ceil(10_000 logged steps / 600)
    assert series.steps[0] == 9 and series.steps == sorted(series.steps)
    # the one spike survives the bucketing, in the bucket that holds its step
    assert max(series.peak) == 3000.0 + 73_129 % 7
    (spike,) = [i for i, peak in enumerate(series.peak) if peak >= 3000]
    assert series.steps[spike] <= 73_129 < series.steps[spike + 1]


def test_missing_values():
    history = [{"step": 0, PEAK_RSS: 5.0}, {"step": 1, PEAK_RSS: 6.0, SAVED_BY_FUSED_HEAD: 2.0}, {"step": 2}]
    series = memory_plot.plot_series(history, PEAK_RSS, SAVED_BY_FUSED_HEAD, PEAK_RESERVED)
    assert (series.steps, series.peak, series.saved, series.reserved) == ([0, 1], [5.0, 6.0], [0.0, 2.0], [])


@pytest.mark.parametrize(("num_steps", "every", "bars"), [(20, 1, True), (100_000, 10, False)])
def test_png_from_zero_with_stack_capacity_and_validation(tmp_path, num_steps, every, bars):
    callback = FLCEMemoryCallback()
    callback.history = _history(num_steps, every)
    callback.validation_steps = list(range(num_steps // 4, num_steps, num_steps // 4))
    callback.capacity_bytes = 12 * 1024 * MIB  # within the chart: drawn as a line
    path = str(tmp_path / "memory.png")
    drawn = callback.save_plot(path)
    assert drawn["bars"] is bars
    assert drawn["ylim"][0] == 0
    assert drawn["unit"] == "GiB"
    assert drawn["capacity_drawn"]
    assert drawn["ylim"][1] > 12  # the capacity line is inside the chart

    image = imread(path)
    assert image.shape[:2] == (round(4.8 * 110), round(9 * 110))
    # the capacity line spans the chart (its legend sample alone is ~50 pixels); validation lines are dotted
    for color, least in (
        (memory_plot.PEAK_COLOR, 5000),
        (memory_plot.CAPACITY_COLOR, 500),
        (memory_plot.VALIDATION_COLOR, 50),
    ):
        assert _pixels_of(image, color) > least, color
    # the saving is drawn half transparent over white: lighter than its colour, but the same hue
    light_saved = 0.55 * np.array(to_rgb(memory_plot.SAVED_COLOR)) + 0.45
    assert _pixels_of(image, light_saved) > 1000


def test_capacity_far_above_is_a_note(tmp_path):
    callback = FLCEMemoryCallback()
    callback.history = _history(20)
    callback.capacity_bytes = 140 * 1024 * MIB
    drawn = callback.save_plot(str(tmp_path / "memory.png"))
    assert not drawn["capacity_drawn"]
    assert drawn["ylim"][1] < 12  # the data fills the chart
    assert drawn["capacity_note"] in drawn["title"]
    assert drawn["capacity_note"] == "GPU 140.0 GiB, far above (the peak uses 1.8%)"  # of 2606 MiB
    # no line drawn
    assert _pixels_of(imread(str(tmp_path / "memory.png")), memory_plot.CAPACITY_COLOR) == 0


def test_cpu_history_plots_rss(tmp_path):
    callback = FLCEMemoryCallback()
    callback.history = [{"step": s, PEAK_RSS: 700.0 + s, SAVED_BY_FUSED_HEAD: 0.0} for s in range(5)]
    drawn = callback.save_plot(str(tmp_path / "memory.png"))
    assert drawn["unit"] == "MiB"
    assert drawn["ylim"] == (0.0, pytest.approx(704 * 1.12))


def test_plot_of_empty_history_raises(tmp_path):
    with pytest.raises(ValueError, match="no peak"):
        FLCEMemoryCallback().save_plot(str(tmp_path / "memory.png"))
