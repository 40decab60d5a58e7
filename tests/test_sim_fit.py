"""The robust ``profiled`` fit (``workbench.sim.fit``, issue 33): a token curve that rises within each kernel's
range, bootstrap intervals, and the fit-quality warnings; on engine steps recorded on an AMD EPYC (Zen 3, AVX2,
``tests/data/fit_steps_*``) and on what the shared measurement of a Zen 4 EPYC holds
(``tests/data/amd_epyc_zen4_2026-12-02``, verbatim copies).

What that Zen 4 measurement holds, and what not: its ``sim_fidelity.json`` (``--measure-profiles`` at d06804d) keeps
the *fitted* profiles (coefficients, the token curve), the measured per-policy statistics and the load averages,
but not the engine steps the profile was fitted on, so the engine fit itself cannot be repeated from it. Its report
metrics hold model-level step times at known shapes: notebook 01 timed ``Transformer.prefill`` of one prompt and
``Transformer.decode`` of a batch on a contiguous cache (``workbench.experiments.phases``, 5 repeats, medians),
without the engine's scheduler, paged gather or sampler. Those steps are re-fitted here; the fitted curve of the
fidelity file is checked against the kernel break it shows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from workbench.sim.fit import POSITIVE_FEATURES, _segments, fit_profile, fit_quality, token_knots
from workbench.sim.stats import StepStats

DATA = Path(__file__).parent / "data" / "fit_steps_smollm2_amd_epyc_avx2.json"
ZEN4 = Path(__file__).parent / "data" / "amd_epyc_zen4_2026-12-02"

# the recorded steps' engines packed their linears from 4 rows on, on every CPU (before packed_min_rows)
RECORDED_MIN_ROWS = 4
# ... and ran oneDNN's packed products (before the blocked op), at most this many rows a call: a kernel break above it
RECORDED_MAX_ROWS = 256


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
    with the kernel breaks of the CPU engine that recorded them (packed linears from 4 rows on, every CPU then)."""
    from workbench.sim.measure import engine_batched_decode

    stats, durations, gaps, idle, wakes = _recorded()
    knots = token_knots([s.num_tokens for s in stats])
    breaks = (RECORDED_MIN_ROWS, RECORDED_MAX_ROWS + 1)
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
        if not t0 < RECORDED_MIN_ROWS <= t1:
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


def _zen4_notebook01_steps() -> dict[tuple[str, int, int], float]:
    """Notebook 01's medians on the Zen 4 (``report_prefill_vs_decode_metrics.json``), keyed (phase, rows, context):
    a prefill of one prompt of ``rows`` tokens, a decode of ``rows`` sequences each reading ``context`` keys. The
    shapes not in the file are d06804d's pipeline.yaml cpu parameters (prompt_lens 16..1024, batch_sizes 1..32,
    kv_lens [128, 1024]): ``decode_step_ms_batch1`` is batch 1 at the shortest context,
    ``decode_tokens_per_s_max_batch`` the largest batch at the shortest context, the batching claim's evidence batches
    1 and 32 at the longest. The
    shape the report's own ``batching_slower_per_token`` anomaly flags as disturbed (batch 32 at context 1024: slower
    per token than batch 16) is left out."""
    m = json.loads((ZEN4 / "report_prefill_vs_decode_metrics.json").read_text())
    claims = {c["claim"]: c["evidence"] for c in m["claims"]}
    prefill, batching = claims["Prefill is compute-bound and sets TTFT"], claims["Batching raises decode throughput"]
    long_ctx, big = batching["context_len"], batching["batch_large"]
    steps = {
        ("prefill", 16, 16): prefill["ttft_ms_shortest"] / 1e3,
        ("prefill", prefill["prompt_len"], prefill["prompt_len"]): prefill["ttft_ms_longest"] / 1e3,
        ("decode", 1, 128): m["decode_step_ms_batch1"] / 1e3,
        ("decode", big, 128): big / m["decode_tokens_per_s_max_batch"],
        ("decode", 1, long_ctx): 1 / batching["tokens_per_s_small"],
        ("decode", big, long_ctx): big / batching["tokens_per_s_large"],
    }
    for a in m["anomalies"]:
        if a["check"] == "batching_slower_per_token":
            for b in a["batches"]:
                steps.pop(("decode", b, a["context_len"]), None)
    assert ("decode", big, long_ctx) not in steps  # the flagged shape
    return steps


def _as_stats(phase: str, rows: int, context: int) -> StepStats:
    from workbench.roofline import attended_pairs

    if phase == "prefill":
        return StepStats(rows, 1, attended_pairs(rows, 0), rows)
    return StepStats(0, 0, 0, 0, rows, rows * context, context)


def test_refit_on_the_zen4_notebook_steps_is_physical() -> None:
    """Issue 33's acceptance on the shared Zen 4 data: ``profiled`` re-fitted (``fit_profile``) to the step times
    at known shapes that data holds (``_zen4_notebook01_steps``: two prompt lengths, batch 1 and 32 at context 128,
    batch 1 at 1024). Four token counts, each from one kind of step, cannot identify a token curve beside the
    per-sequence terms (a curve knot per count absorbs them), so the linear form is fitted; the decode terms are
    then determined exactly by the three decode shapes and are checked against their solution by hand."""
    steps = _zen4_notebook01_steps()
    keys = list(steps)
    model = fit_profile([_as_stats(*k) for k in keys], [steps[k] for k in keys], bootstrap=0)
    c = model.coefficients
    assert all(v >= 0 for v in c.values()), c
    # the decode terms by hand: context from batch 1 at two contexts, sequences from batch 32 against 1 at 128
    t1_128, t1_1024, t32_128 = steps["decode", 1, 128], steps["decode", 1, 1024], steps["decode", 32, 128]
    per_key = (t1_1024 - t1_128) / (1024 - 128)
    per_seq = (t32_128 - t1_128 - (32 * 128 - 128) * per_key) / 31
    const = t1_128 - per_seq - 128 * per_key
    assert c["decode_context"] == pytest.approx(per_key, rel=1e-6) and per_key > 0  # 27.5 us a key read
    assert c["decode_seqs"] == pytest.approx(per_seq, rel=1e-6) and per_seq > 0  # 3.7 ms a sequence
    assert c["const"] == pytest.approx(const, rel=1e-6) and const > 0  # 53 ms: the weights read every step
    # prefill: both prompts priced as measured, and the cost grows with the tokens over the notebook's lengths
    for k in keys:
        assert model.step_time(_as_stats(*k)) == pytest.approx(steps[k], rel=1e-6)
    prefill_s = [model.step_time(_as_stats("prefill", n, n)) for n in (16, 64, 256, 1024)]
    assert all(b > a for a, b in zip(prefill_s, prefill_s[1:]))
    # two prompt lengths cannot tell a token's cost from an attention pair's: prefill_pairs is above 0 or the fit
    # says it is not identified
    warnings = model.meta["fit"]["warnings"]
    assert c["prefill_pairs"] > 0 or any(w.startswith("prefill_pairs fitted at its bound 0") for w in warnings)
    # physics across the phases, from the shared numbers alone: a decode sequence and a prefill token each cost one
    # row through the dense layers (2 x parameters FLOPs); the measured per-token prefill slope and the per-sequence
    # decode cost above agree within 10% (3.81 and 3.75 ms)
    slope = (steps["prefill", 1024, 1024] - steps["prefill", 16, 16]) / (1024 - 16)
    assert per_seq == pytest.approx(slope, rel=0.10)
    # decode grows with the sequences at every context, and with the context at every batch
    for ctx in (128, 256, 1024):
        times = [model.step_time(_as_stats("decode", b, ctx)) for b in (1, 4, 16, 32)]
        assert all(b > a for a, b in zip(times, times[1:]))
    for b in (1, 4, 16, 32):
        times = [model.step_time(_as_stats("decode", b, ctx)) for ctx in (128, 256, 1024)]
        assert all(y > x for x, y in zip(times, times[1:]))


def test_the_zen4_fits_falling_curve_falls_at_the_packed_kernel_break() -> None:
    """The Zen 4 fidelity file's fitted token curve (d06804d: no monotonicity then) falls from 121 ms at 3 tokens to
    47 ms at 4: that is the break to the packed linears (``RECORDED_MIN_ROWS``; the file's engines ran them), and its
    other falls are noise-sized. Projected on today's form (steps that carry their token count alone, one per knot,
    timed as the file's curve) with the kernel breaks, the curve keeps that fall, rises within each segment and stays
    within 10% of the file's; without the breaks it cannot follow the plain kernel's 2-3 rows."""
    profiled = json.loads((ZEN4 / "sim_fidelity.json").read_text())["cost_models"]["profiled"]
    assert all(c["packed_linears"] for c in profiled["meta"]["engine_configs"])
    tokens, seconds = profiled["token_curve"]["tokens"], profiled["token_curve"]["seconds"]
    falls = [(t0, t1, s1 / s0 - 1) for t0, t1, s0, s1 in zip(tokens, tokens[1:], seconds, seconds[1:]) if s1 < s0]
    worst = min(falls, key=lambda f: f[2])
    assert worst[:2] == (RECORDED_MIN_ROWS - 1, RECORDED_MIN_ROWS) and worst[2] < -0.5  # 120.6 -> 47.0 ms: -61%
    assert all(f[2] > -0.10 for f in falls if f is not worst)  # 5 -> 6: -9.4%, the next largest

    stats = [StepStats(t) for t in tokens]
    breaks = (RECORDED_MIN_ROWS, RECORDED_MAX_ROWS + 1)
    projected = fit_profile(stats, seconds, knots=tokens, kernel_breaks=breaks, bootstrap=0).token_curve[1]
    i = tokens.index(RECORDED_MIN_ROWS)
    assert projected[:i] == pytest.approx(seconds[:i], rel=1e-9)  # 1-3 rows already rise: kept as they are
    assert projected[i] < projected[i - 1]
    assert all(b >= a - 1e-12 for j, (a, b) in enumerate(zip(projected, projected[1:])) if j + 1 != i)
    assert all(abs(p / s - 1) < 0.10 for p, s in zip(projected, seconds))
    # 4, 5, 6 tokens (47.0, 45.9, 41.6 ms) pool into one value: least squares in relative error, by hand
    pool = seconds[i : i + 3]
    assert projected[i] == pytest.approx(sum(1 / a for a in pool) / sum(1 / a**2 for a in pool), rel=1e-6)
    rising = fit_profile(stats, seconds, knots=tokens, bootstrap=0).token_curve[1]
    assert max(abs(p / s - 1) for p, s in zip(rising, seconds)) > 0.3


def _known_steps() -> tuple[object, dict[str, float]]:
    """Decode-only steps of 1-6 sequences at 5 contexts each: 10, 20, 30 ms of dense layers at 1-3 rows (the plain
    kernel), 12, 14, 16 ms at 4-6 (packed), plus 10 us a key read; two steps after an idle wait 5 ms longer; busy
    gaps 1, 2, 4 ms (median 2 ms); wake-ups 0.3 and 0.5 ms (median 0.4 ms)."""
    from workbench.sim.measure import StepSamples

    dense = {1: 0.010, 2: 0.020, 3: 0.030, 4: 0.012, 5: 0.014, 6: 0.016}
    stats = [StepStats(0, 0, 0, 0, n, n * ctx, ctx) for n in dense for ctx in (8, 16, 24, 32, 40)]
    durations = [dense[s.decode_seqs] + 1e-5 * s.decode_context for s in stats]
    idle = [i in (3, 17) for i in range(len(stats))]
    durations = [t + 0.005 * after for t, after in zip(durations, idle)]
    samples = StepSamples(stats, durations, [0.001, 0.002, 0.004], idle, [0.0003, 0.0005])
    truth = {"decode_context": 1e-5, "host_gap_s": 0.002, "idle_step_s": 0.005, "wake_s": 0.0004}
    return samples, truth


def test_recorded_steps_round_trip_through_json_and_refit_to_the_known_answer(tmp_path, capsys) -> None:
    """``steps_record`` (what ``workbench fidelity --measure-profiles`` writes) through JSON and back
    (``refit_steps``, ``workbench fit-profile --from-steps``) fits what ``fit_samples`` fits in memory, and that is
    the answer by hand (``_known_steps``): every busy step priced exactly, 10 us a key, the fall at the recorded
    kernel break, the gap, the idle steps' extra time and the wake-up delay."""
    from workbench.cli import main
    from workbench.sim.costmodel import ProfiledCostModel
    from workbench.sim.measure import fit_samples, refit_steps, steps_record

    samples, truth = _known_steps()
    record = json.loads(json.dumps(steps_record(samples, (1, 65536), (4, 257))))
    assert record["fields"][-1] == "decode_max_context" and len(record["stats"]) == 30  # no speculative fields
    direct = fit_samples(samples, {"model": "tiny-gqa"}, (1, 65536), (4, 257))
    again = refit_steps(record, {"model": "tiny-gqa"})
    assert again.coefficients == direct.coefficients and again.token_curve == direct.token_curve
    for s, t, idle in zip(samples.stats, samples.durations_s, samples.after_idle):
        if not idle:
            assert again.step_time(s) == pytest.approx(t, rel=1e-6)
    assert again.coefficients["decode_context"] == pytest.approx(truth["decode_context"], rel=1e-6)
    tokens, seconds = again.token_curve
    assert tokens == [1, 2, 3, 4, 5, 6] and seconds[3] < seconds[2]  # 4 rows packed, cheaper than 3 plain
    assert again.host_gap_s == pytest.approx(truth["host_gap_s"])
    assert again.idle_step_s == pytest.approx(truth["idle_step_s"], rel=1e-6)
    assert again.wake_s == pytest.approx(truth["wake_s"])
    # the command: from a fidelity JSON's profiled model, its meta kept and the source named
    fidelity_json = tmp_path / "fidelity.json"
    meta = {"model": "SmolLM2-135M", "machine": "AMD EPYC", "fit": {"stale": True}}
    fidelity_json.write_text(json.dumps({"cost_models": {"profiled": {"meta": meta, "steps": record}}}))
    out = tmp_path / "refit.json"
    assert main(["fit-profile", "--from-steps", str(fidelity_json), "--out", str(out), "--json"]) == 0
    written = ProfiledCostModel.load(out)
    assert written.coefficients == again.coefficients
    assert written.meta["model"] == "SmolLM2-135M" and written.meta["refitted_from"] == str(fidelity_json)
    assert "stale" not in written.meta["fit"] and written.meta["fit"]["num_steps"] == 30
    capsys.readouterr()


def test_fit_profile_from_steps_refuses_a_file_without_steps_and_a_missing_out(tmp_path, capsys) -> None:
    from workbench.cli import main

    no_steps = tmp_path / "old.json"
    no_steps.write_text(json.dumps({"cost_models": {"profiled": {"meta": {}}}}))
    assert main(["fit-profile", "--from-steps", str(no_steps), "--out", str(tmp_path / "p.json")]) == 2
    assert "holds no recorded steps" in capsys.readouterr().err
    assert main(["fit-profile", "--from-steps", str(no_steps)]) == 2
    assert "--from-steps needs --out" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "workbench-steps-v1", "fields": ["prefill_tokens"], "stats": [[1, 2]],
                               "durations_s": [0.1], "gaps_s": [], "after_idle": [0], "wakes_s": []}))  # fmt: skip
    assert main(["fit-profile", "--from-steps", str(bad), "--out", str(tmp_path / "p.json")]) == 2
    assert "step 0 has 2 values for 1 fields" in capsys.readouterr().err
