"""The robust ``profiled`` fit (``workbench.sim.fit``, issue 33): a token curve that rises within each kernel's
range, bootstrap intervals, and the fit-quality warnings; on engine steps recorded on an AMD EPYC."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from workbench.sim.fit import POSITIVE_FEATURES, _segments, fit_profile, fit_quality, token_knots
from workbench.sim.stats import StepStats

DATA = Path(__file__).parent / "data" / "fit_steps_smollm2_amd_epyc_avx2.json"


def _recorded() -> tuple[list[StepStats], list[float], list[float], list[bool], list[float]]:
    data = json.loads(DATA.read_text())
    stats, durations, gaps, idle, wakes = [], [], [], [], []
    for run in data["policies"].values():
        stats += [StepStats(*x) for x in run["stats"]]
        durations += run["durations_s"]
        gaps += run["gaps_s"]
        idle += run["after_idle"]
        wakes += run["wakes_s"]
    return stats, durations, gaps, idle, wakes


def test_segments_start_at_each_kernel_break() -> None:
    knots = [1, 2, 3, 4, 5, 8, 12]
    assert _segments(knots, ()) == [(0, 7)]
    assert _segments(knots, (4,)) == [(0, 3), (3, 7)]
    assert _segments(knots, (4, 10)) == [(0, 3), (3, 6), (6, 7)]  # 10 falls between knots 8 and 12
    assert _segments(knots, (4, 257)) == [(0, 3), (3, 7)]  # a break past the last knot changes nothing


def test_the_curve_rises_within_a_segment_even_when_the_steps_dip() -> None:
    # decode steps of 1..6 tokens at 10, 20, 30, 12, 14, 16 ms: with a break at 4 the fit (curve and per-decode
    # terms) follows the dip exactly; without one the curve may not fall
    stats = [StepStats(0, 0, 0, 0, d, d, 1) for d in range(1, 7) for _ in range(5)]
    times = [{1: 0.010, 2: 0.020, 3: 0.030, 4: 0.012, 5: 0.014, 6: 0.016}[s.decode_seqs] for s in stats]
    knots = [1, 2, 3, 4, 5, 6]
    broken = fit_profile(stats, times, knots=knots, kernel_breaks=(4,), bootstrap=0)
    assert [broken.step_time(s) for s in stats] == pytest.approx(times, rel=1e-6)
    rising = fit_profile(stats, times, knots=knots, bootstrap=0)
    values = rising.token_curve[1]
    assert all(b >= a - 1e-12 for a, b in zip(values, values[1:]))


def test_fit_quality_warns_of_a_biased_kind_of_step_and_of_a_coefficient_at_its_bound() -> None:
    steps = [StepStats(0, 0, 0, 0, 4, 40, 10)] * 6 + [StepStats(20, 1, 210, 20, 4, 40, 10)] * 6
    measured = [0.10] * 12
    fitted = [0.10] * 6 + [0.08] * 6  # the mixed steps priced 20% low
    warnings = fit_quality(steps, measured, fitted, {"decode_context": 1e-6, "prefill_pairs": 0.0}, None,
                           steps, [True] * 12)  # fmt: skip
    assert any(w.startswith("mixed steps (6) fitted -20.0% off") for w in warnings)
    assert any(w.startswith("prefill_pairs fitted at its bound 0") for w in warnings)
    assert not any("decode_context" in w or w.startswith("decode steps") for w in warnings)


def test_refit_on_the_amd_epycs_recorded_steps_is_physical() -> None:
    """The acceptance test of issue 33: the engine's own steps (``tests/data``, its provenance inside), re-fitted
    with the CPU engine's kernel breaks (packed linears from 4 rows on, ``workbench.model.packed``)."""
    from workbench.model.packed import PACKED_MAX_ROWS, PACKED_MIN_ROWS
    from workbench.sim.measure import engine_batched_decode

    stats, durations, gaps, idle, wakes = _recorded()
    knots = token_knots([s.num_tokens for s in stats])
    breaks = (PACKED_MIN_ROWS, PACKED_MAX_ROWS + 1)
    model = fit_profile(stats, durations, gaps, knots=knots, batched_decode=engine_batched_decode("cpu"),
                        after_idle=idle, wakes_s=wakes, kernel_breaks=breaks, bootstrap=30)  # fmt: skip
    c, fit = model.coefficients, model.meta["fit"]
    # attention work costs time: the fit puts it above 0, and so does every bootstrap resample's 5th percentile
    for name in ("prefill_pairs", "decode_context"):
        assert c[name] > 0 and fit["coefficient_ci"][name][0] >= 0
    assert fit["coefficient_ci"]["decode_context"][0] > 0
    assert c["prefill_seqs"] > 0
    # every physically positive coefficient is above 0, or the fit says it is not identified
    for name in POSITIVE_FEATURES:
        assert c[name] > 0 or any(w.startswith(f"{name} fitted at its bound 0") for w in fit["warnings"])
    # the token curve rises within each kernel's range (its only fall is at the break to the packed kernel)
    tokens, seconds = model.token_curve
    for (t0, s0), (t1, s1) in zip(zip(tokens, seconds), zip(tokens[1:], seconds[1:])):
        if not t0 < PACKED_MIN_ROWS <= t1:
            assert s1 >= s0 - 1e-12, (t0, t1)
    # the intervals are ordered
    for lo, mid, hi in [*fit["coefficient_ci"].values(), *fit["token_curve_ci"]]:
        assert lo <= mid <= hi
    # the fit prices its own steps: median relative error under 15% (each step's own noise on a shared machine)
    assert fit["median_rel_error"] < 0.15


def test_bootstrap_intervals_cover_a_noisy_generator() -> None:
    rng = random.Random(3)
    stats = [StepStats(p, 1, p * (p + 1) // 2, p, 0, 0, 0) for p in (8, 16, 32, 64, 96) for _ in range(30)]
    truth = {8: 0.01, 16: 0.015, 32: 0.025, 64: 0.045, 96: 0.065}
    times = [(truth[s.prefill_tokens] + 1e-7 * s.prefill_pairs) * (1 + rng.gauss(0, 0.03)) for s in stats]
    model = fit_profile(stats, times, knots=[8, 16, 32, 64, 96], bootstrap=40, seed=1)
    for (lo, _, hi), k in zip(model.meta["fit"]["token_curve_ci"], (8, 16, 32, 64, 96)):
        assert lo < hi and lo <= truth[k] + 1e-7 * k * (k + 1) / 2 * 1.5


def test_due_items_spread_a_profiles_workloads_over_the_measured_runs() -> None:
    from workbench.errors import ConfigError
    from workbench.sim.measure import due_items

    # 8 workloads over 15 runs: floor(8 j / 15 + 1/2) after run j, by hand: a new one after runs 1, 3, ..., 15
    assert [due_items(8, j / 15) for j in range(16)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8]
    assert due_items(3, 1.0) == 3 and due_items(3, 0.0) == 0
    with pytest.raises(ConfigError, match="fraction"):
        due_items(3, 1.5)
