"""The bounded search of benchmarks/bench_max_tokens.py against a synthetic linear memory model (no training:
the search's bookkeeping alone, in milliseconds)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
bench = pytest.importorskip("bench_max_tokens")


def _search(limit_tokens, start, step, cap=2**21, resolution=1 / 16, min_res=4096, noise=0.0):
    """Run the search against peak = base + slope * tokens with capacity reached at ``limit_tokens``."""
    base, capacity = 20_000.0, 140_000.0
    slope = (capacity - base) / limit_tokens
    tries = []
    for _ in range(60):
        nxt = bench.next_tokens(tries, start, step, resolution, min_res, cap, 0.97)
        if nxt is None:
            return tries
        assert nxt % step == 0 and nxt not in {t["tokens"] for t in tries}
        peak = base + slope * nxt * (1 + noise)
        fit = peak <= capacity
        tries.append(
            {
                "tokens": nxt,
                "status": "fit" if fit else "OOM",
                "peak_mib": peak if fit else None,
                "capacity_mib": capacity,
            }  # fmt: skip
        )
    raise AssertionError(f"search did not end: {[(t['tokens'], t['status']) for t in tries]}")


@pytest.mark.parametrize("limit", [79_000, 445_000, 12_288, 1_000_000])
@pytest.mark.parametrize("axis_step,start", [(4096, 4096), (1024, 16384)])
def test_search_brackets_the_limit_to_the_resolution(limit, axis_step, start):
    tries = _search(limit, start, axis_step)
    lo, hi, stop = bench.search_state(tries)
    assert stop is None and lo is not None and hi is not None
    assert lo <= limit < hi
    assert hi - lo <= max(4096, lo / 16 + axis_step)
    # Doubling, then at most a few tries near the edge (the linear prediction lands next to the limit).
    assert len(tries) <= 12


def test_search_with_a_superlinear_peak_still_converges():
    tries = _search(200_000, 4096, 4096, noise=0.1)  # the prediction overshoots: bisection takes over
    lo, hi, _ = bench.search_state(tries)
    assert lo is not None and hi is not None and hi - lo <= max(4096, lo / 16 + 4096)


def test_search_stops_at_the_cap_and_after_an_error():
    tries = _search(10**9, 4096, 4096, cap=65536)
    lo, hi, _ = bench.search_state(tries)
    assert lo == 65536 and hi is None
    err = [{"tokens": 4096, "status": "error", "peak_mib": None, "capacity_mib": None}]
    assert bench.next_tokens(err, 4096, 4096, 1 / 16, 4096, 2**21, 0.97) is None


def test_nothing_fits_halves_down_to_one_granule():
    tries = _search(3000, 16384, 1024)
    lo, hi, _ = bench.search_state(tries)
    assert lo is not None and lo <= 3000 < hi


def test_probes_ask_for_the_other_providers_maxima():
    hf = [{"provider": "hf", "axis": "seq", "checkpointing": True, "tokens": t, "status": s}
          for t, s in ((16384, "fit"), (32768, "fit"), (65536, "fit"), (81920, "OOM"), (73728, "fit"))]  # fmt: skip
    fl = [{"provider": "flce", "axis": "seq", "checkpointing": True, "tokens": t, "status": s}
          for t, s in ((16384, "fit"), (65536, "fit"), (131072, "fit"), (262144, "OOM"))]  # fmt: skip
    done = {("hf", "seq", True): True, ("flce", "seq", True): True}
    assert bench.probe_tokens(("flce", "seq", True), hf + fl, done) == [73728]
    assert bench.probe_tokens(("hf", "seq", True), hf + fl, done) == []


def test_live_memory_summary_groups_live_blocks_by_their_package_frame():
    """The OOM summary: only allocated blocks count, each under the innermost frame of a known package (the
    model's line inside the module's call, not the call every forward allocation shares)."""
    mib = 2**20

    def frames(*names):
        return [{"filename": f, "line": 7, "name": "fn"} for f in names]

    llama = "/x/site-packages/transformers/models/llama/modeling_llama.py"
    engine = "/repo/lightning_flce/engine.py"
    snapshot = {
        "segments": [
            {
                "blocks": [
                    {
                        "state": "active_allocated",
                        "size": 512 * mib,
                        "frames": frames("/t/torch/nn/f.py", llama),
                    },
                    {"state": "active_allocated", "size": 256 * mib, "frames": frames(llama)},
                    {"state": "inactive", "size": 4096 * mib, "frames": frames(engine)},
                ]
            },
            {"blocks": [{"state": "active_allocated", "size": 1024 * mib, "frames": frames(engine, llama)}]},
            {"blocks": [{"state": "active_allocated", "size": 128 * mib, "frames": frames(llama, engine)}]},
        ]
    }
    live = bench.live_memory_summary(snapshot)
    assert live["live_mib"] == 1920
    (first, second) = live["by_owner"]
    assert first["where"] == "lightning_flce/engine.py:7 fn" and first["mib"] == 1024
    assert second["where"].startswith("transformers/models/llama/modeling_llama.py")
    assert (second["mib"], second["count"], second["largest_mib"]) == (896, 3, 512)
    assert [b["mib"] for b in live["largest"]] == [1024, 512, 256, 128]


def test_sizes_must_be_multiples_of_each_axis_granularity():
    args = bench.parse_args(["--tiny", "--axes", "seq", "--sizes", "64,128"])
    assert args.size_list == [64, 128]
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--axes", "seq,batch", "--sizes", "80"])  # seq 16s, batch 64s


def test_compiled_layers_get_an_untimed_step_at_the_try_size():
    """Eager: one small warm-up step. Compiled decoder layers: the first step at the try's size recompiles for
    its shapes, so it is untimed too (else a median over two timed steps holds the compilation)."""
    assert bench.warmup_shapes(9, 4096, 4096, compile_layers=False) == [(1, 4096)]
    assert bench.warmup_shapes(9, 4096, 4096, compile_layers=True) == [(1, 4096), (9, 4096)]
    assert bench.warmup_shapes(1, 1024, 4096, compile_layers=False) == [(1, 1024)]


def _try(provider, tokens, status, tok_s=None):
    return {"provider": provider, "axis": "seq", "checkpointing": True, "tokens": tokens, "status": status,
            "tokens_per_s": tok_s, "batch": 1, "seq": tokens, "peak_mib": 1.0}  # fmt: skip


def test_sizes_plan_interleaves_rounds_and_skips_what_ran():
    """--sizes with --repeats: round r runs every size for every series (the series order reversed on odd
    rounds), a (series, size) with r + 1 fits already (a search's or a resumed call's) is not run again in
    that round, and one that ran out of memory (or failed) is not run at all."""
    hf, liger, fl = ("hf", "seq", True), ("liger", "seq", True), ("flce", "seq", True)
    keys = [hf, liger, fl]
    tries = [_try("hf", 16384, "fit", 25_000.0), _try("hf", 57344, "OOM"), _try("liger", 57344, "error")]
    plan = bench.sizes_plan(keys, [16384, 57344], 2, tries)
    assert plan == [
        (liger, 16384, 0), (fl, 16384, 0), (fl, 57344, 0),  # hf's 16384 fit counts for round 0
        (fl, 16384, 1), (liger, 16384, 1), (hf, 16384, 1), (fl, 57344, 1),  # reversed order
    ]  # fmt: skip
    assert bench.sizes_plan(keys, [16384], 1, tries) == [(liger, 16384, 0), (fl, 16384, 0)]
    done = tries + [_try(k[0], n, "fit", 1.0) for k, n, _ in plan]
    assert bench.sizes_plan(keys, [16384, 57344], 2, done) == []


def test_goal_three_compares_the_median_of_repeated_runs():
    """Several fits at a length: the goal compares medians (one slow run does not decide it) and says how many
    runs each length had."""
    tries = [_try("flce", 16384, "fit", r) for r in (25_700.0, 25_900.0, 24_000.0)]
    tries += [_try("hf", 16384, "fit", r) for r in (25_800.0, 25_750.0, 25_850.0)]
    assert bench._fit_rate(tries, ("flce", "seq", True)) == {16384: 25_700.0}
    (line,) = [g for g in bench.goals(tries) if "flce / hf" in g]
    assert (
        "lowest 0.996x at 16384" in line
    )  # 25700 / 25800; the last runs: 0.928x and "at least 3 runs per length" in line


def test_the_rate_leaves_out_the_first_step_at_the_tries_size():
    """Two or more timed steps: tokens/s is the median of those after the first (which pays for the new shape);
    one: that step; none: no rate. The table says how many steps the rate is of, and nothing for older records."""
    assert bench.settled_rate([2.0, 1.0, 1.25, 1.5], 1000) == (800.0, 3)  # the median of 1.0, 1.25, 1.5
    assert bench.settled_rate([3.0, 1.0], 1000) == (1000.0, 1)
    assert bench.settled_rate([4.0], 1000) == (250.0, 1)
    assert bench.settled_rate([], 1000) == (None, 0)
    assert bench.timed_cell({"timed_steps": 3, "rate_steps": 2}) == "3 (2)"
    assert bench.timed_cell({"timed_steps": 2}) == "2"
