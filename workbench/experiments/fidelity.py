"""Simulator fidelity on this machine: the simulator against the real engine, per policy, with the measured runs'
own spread (``workbench fidelity`` and notebook 07).

- ``fidelity_report`` is the whole check of ``workbench fidelity``: the cost models (read or measured now), the
  measured runs (or the real disaggregated pair), the simulated ones, the table and the claims, in one JSON-able
  dict; ``print_report`` writes its table. Its colocated half, ``colocated_fidelity``, is notebook 07's too: a
  profile measured now runs its engine workloads between the measured runs and is fitted after them, so that a
  machine whose speed drifts moves the model's steps and the runs alike (its claims, ``fidelity_claim``, are then
  not voided by a drifting reference step; those on a profile of another time are).

- ``measure_policies`` replays one held-out workload on the real engine under every policy, ``repeats`` times,
  interleaved (repeat 1 of every policy, then repeat 2, ...), so that a change of the machine's load during the
  run falls on every policy alike; the load average is read before and after every run.
- ``simulate_policies`` simulates the same workload with the same scheduler settings and pool on a cost model
  (``profiled``, ``op-profile``; deterministic, or with the profile's residuals drawn as seeded noise).
- ``compare`` sets each simulated statistic (TTFT and ITL, median and p90) against the median of the measured
  repeats and their spread: ``tolerance = max(FIDELITY_TOLERANCE, spread)``, where ``spread`` is the largest
  deviation of one repeat from their median, relative to it; a statistic is ``within`` when its relative error is at
  most that. ``fidelity_claim`` states the verdict.
- ``disaggregated_fidelity`` does the same for the real disaggregated engines (``workbench.cluster.disagg``) against
  the simulator's disaggregated model, the KV link fitted to the real transfers.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.engine.config import EngineConfig
from workbench.experiments.claims import CONFIRMED, INCONCLUSIVE, NOT_CONFIRMED, make_claim
from workbench.experiments.hygiene import load_average
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.stats import rank_correlation
from workbench.timing import now, set_threads
from workbench.workloads import Request, synthetic_workload

FIDELITY_TOLERANCE = 0.10  # the simulator's target: within 10% of the measured median (or the spread, if larger)
NOISY_SPREAD = 0.25  # a spread beyond this makes the comparison inconclusive: the runs do not bound the error
BIMODAL_GAP = 0.25  # repeats split by a gap beyond 25% of their median (and far wider than each cluster): two modes
BIMODAL_SEPARATION = 2.0
STATISTICS = (("ttft_s", "median"), ("ttft_s", "p90"), ("itl_s", "median"), ("itl_s", "p90"))


def held_out_workload(num_requests: int = 40, rate: float = 10.0, seed: int = 7) -> list[Request]:
    """The held-out Poisson workload of the fidelity check (other seed and lengths than the training workloads)."""
    return synthetic_workload(num_requests, rate=rate, prompt_lens="uniform:4:160", output_lens="uniform:2:48",
                              seed=seed)  # fmt: skip


WARMUP_MAX_PROMPT = 256  # the longest prompt ``warmup_workload`` sends


def warmup_workload(max_model_len: int = 256, max_num_seqs: int = 16, gap_s: float = 0.01) -> list[Request]:
    """A warm-up for engines in other processes (``disaggregated_fidelity``): one request of every prompt length
    from 1 to ``min(WARMUP_MAX_PROMPT, max_model_len - 2)``, ``gap_s`` apart (each prefilled alone when a prefill
    takes less: every token count of a prefill step), then a burst of ``max_num_seqs`` requests with 2 to
    ``max_num_seqs + 1`` output tokens (decode batches of every size from ``max_num_seqs`` down to 1 as they finish),
    so that whatever a process pays on the first step of a shape (with oneDNN's packed products, until 2026-12-06, a
    primitive per (matrix, rows) shape, ~0.7 ms each) is paid before the measured runs, as a steady-state server
    has long paid it."""
    top = max(1, min(WARMUP_MAX_PROMPT, max_model_len - 2))
    out = [Request(i, i * gap_s, i + 1, 2) for i in range(top)]
    burst = top * gap_s + 0.1
    out += [Request(top + j, burst, 8, 2 + j) for j in range(max_num_seqs)]
    return out


def engine_config(policy: str, max_num_seqs: int = 16, max_model_len: int = 256) -> EngineConfig:
    """The engine of the fidelity check: the profiles' settings (chunked: a budget of half the context)."""
    budget = max_model_len // 2 if policy == "chunked" else None
    return EngineConfig(policy=policy, max_num_seqs=max_num_seqs, max_model_len=max_model_len, token_budget=budget,
                        device="cpu")  # fmt: skip


def sim_config(policy: str, num_blocks: int, block_size: int, max_num_seqs: int = 16, max_model_len: int = 256,
               **kwargs: Any) -> SimConfig:  # fmt: skip
    """The simulator's settings matching ``engine_config``, with the real engine's pool."""
    budget = max_model_len // 2 if policy == "chunked" else None
    return SimConfig(policy=policy, max_num_seqs=max_num_seqs, max_model_len=max_model_len, token_budget=budget,
                     num_blocks=num_blocks, block_size=block_size, dtype="fp32", **kwargs)  # fmt: skip


def measure_policies(
    net: Any,
    requests: Sequence[Request],
    policies: Sequence[str],
    repeats: int = 3,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    progress: bool = False,
    *,
    between: Any = None,
) -> dict[str, Any]:
    """The real engine on ``requests`` under each policy, ``repeats`` times, interleaved: ``runs`` (per policy the
    metrics of each repeat), ``loads`` (per run: policy, repeat, load average before and after), ``pool`` (per
    policy: num_blocks, block_size). One warm-up replay first, not measured: the measured runs are the engine's
    steady state, as the profiles'. ``steps``:
    every run's steps (``workbench.sim.measure.StepSamples``), for the cost models' per-step error. ``between``:
    called after each run with the fraction of the runs done (the fidelity check measures a profile's training
    workloads there, ``workbench.sim.measure.InterleavedTraining.run_due``)."""
    from workbench.engine.engine import Engine
    from workbench.sim.measure import StepSamples, engine_samples, observe_steps

    if repeats < 1:
        from workbench.errors import ConfigError

        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    Engine(net, engine_config(policies[0], max_num_seqs, max_model_len)).replay(list(requests[:4]))
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    loads, pool, steps = [], {}, StepSamples()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=repeats * len(policies), desc="measured runs", leave=False)
    for rep in range(repeats):
        for policy in policies:
            before = load_average()
            engine = Engine(net, engine_config(policy, max_num_seqs, max_model_len))
            plans = observe_steps(engine)
            runs[policy].append(engine.replay(list(requests)).summary()["metrics"])
            steps.extend(engine_samples(engine, list(requests), plans))
            loads.append({"policy": policy, "repeat": rep, "load_before": before, "load_after": load_average()})
            st = engine.stats()
            pool[policy] = {"num_blocks": st["num_blocks"], "block_size": st["block_size"]}
            if between is not None:
                between((rep * len(policies) + policies.index(policy) + 1) / (repeats * len(policies)))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return {"runs": runs, "loads": loads, "pool": pool, "repeats": repeats, "steps": steps}


def simulate_policies(
    requests: Sequence[Request],
    model: Any,
    cost: Any,
    measured: Mapping[str, Any],
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    noise_seed: int | None = None,
) -> dict[str, dict]:
    """Per policy of ``measured`` (``measure_policies``), the simulated metrics on ``cost`` (a fresh copy per
    policy; with ``noise_seed``, its residuals drawn as seeded noise)."""
    out = {}
    for policy, pool in measured["pool"].items():
        scfg = sim_config(policy, pool["num_blocks"], pool["block_size"], max_num_seqs, max_model_len)
        out[policy] = simulate(list(requests), model, cost.with_noise(noise_seed), scfg).summary()["metrics"]
    return out


def median_metrics(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Each of ``STATISTICS``' median over ``runs`` (metrics dicts as ``summarize`` gives them): the simulator's
    value to set against the measured repeats' median, when its noise is drawn with several seeds."""
    out: dict[str, dict[str, float]] = {}
    for metric, stat in STATISTICS:
        out.setdefault(metric, {})[stat] = statistics.median(r[metric][stat] for r in runs)
    return out


def _spread(values: Sequence[float]) -> tuple[float, float, float, float]:
    mid = statistics.median(values)
    dev = max(abs(v - mid) for v in values) / mid if mid else 0.0
    return min(values), mid, max(values), dev


def bimodal_split(values: Sequence[float]) -> dict[str, Any] | None:
    """Whether repeated measurements of one statistic fall in two separate modes rather than scatter about one:
    sorted, the values split at their widest gap; the split is bimodal when that gap exceeds ``BIMODAL_GAP`` of the
    median and ``BIMODAL_SEPARATION`` times the wider group's own range (two tight clusters far apart; one stray
    value counts as a mode of its own). None when not bimodal or fewer than 3 values (two values cannot say).
    Otherwise ``modes``: each group's median, low first; ``counts``; ``typical``: the median of the larger group
    (None on a tie: more repeats are needed to say which mode is typical)."""
    xs = sorted(values)
    if len(xs) < 3:
        return None
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    i = max(range(len(gaps)), key=gaps.__getitem__)
    low, high = xs[: i + 1], xs[i + 1 :]
    mid = statistics.median(xs)
    width = max(low[-1] - low[0], high[-1] - high[0])
    if mid <= 0 or gaps[i] <= BIMODAL_GAP * mid or gaps[i] <= BIMODAL_SEPARATION * width:
        return None
    modes = [statistics.median(low), statistics.median(high)]
    typical = None if len(low) == len(high) else modes[0] if len(low) > len(high) else modes[1]
    return {"modes": modes, "counts": [len(low), len(high)], "typical": typical}


def compare(runs: Mapping[str, Sequence[Mapping]], simulated: Mapping[str, Mapping], label: str) -> list[dict]:
    """One row per policy and statistic: the measured repeats' min, median, max and ``spread``, the simulated
    value, its ``rel_error`` against the median, the ``tolerance``, whether it is ``within`` it and ``num_repeats``;
    ``bimodal``:
    whether the repeats fall in two modes (``bimodal_split``), and then ``modes_ms``, ``typical_ms`` (the larger
    mode's median, None on a tie) and ``rel_error_typical`` (the simulated value against it, None on a tie)."""
    rows = []
    for policy, reps in runs.items():
        sim = simulated[policy]
        for metric, stat in STATISTICS:
            values = [r[metric][stat] for r in reps]
            lo, mid, hi, spread = _spread(values)
            s = sim[metric][stat]
            err = (s - mid) / mid if mid else 0.0
            tol = max(FIDELITY_TOLERANCE, spread)
            row = {"model": label, "policy": policy, "statistic": f"{metric.removesuffix('_s')} {stat}",
                   "measured_min_ms": lo * 1e3, "measured_ms": mid * 1e3, "measured_max_ms": hi * 1e3,
                   "spread": spread, "simulated_ms": s * 1e3, "rel_error": err, "tolerance": tol,
                   "within": abs(err) <= tol, "bimodal": False, "num_repeats": len(values)}  # fmt: skip
            split = bimodal_split(values)
            if split is not None:
                typical = split["typical"]
                row.update(bimodal=True, modes_ms=[m * 1e3 for m in split["modes"]], mode_counts=split["counts"],
                           typical_ms=None if typical is None else typical * 1e3,
                           rel_error_typical=None if typical is None else (s - typical) / typical)  # fmt: skip
            rows.append(row)
    return rows


INTERLEAVED = "interleaved"  # a claim's ``uses``: its cost model was fitted to steps measured between its runs


def runs_load(loads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The load on the measured runs (``measure_policies``' ``loads``: each run's 1-minute load average before and
    after): ``peak``, this machine's ``cpus`` and ``loaded``, whether the peak exceeded them (other processes then
    took CPU time from the runs: their tails hold preemptions no cost model of this machine prices)."""
    import os

    peaks = [x[0] for run in loads for x in (run.get("load_before"), run.get("load_after")) if x]
    cpus = os.cpu_count() or 1
    peak = max(peaks) if peaks else None
    return {"peak": peak, "cpus": cpus, "loaded": peak is not None and peak > cpus}


def worst_ratio(row: Mapping[str, Any]) -> dict[str, Any]:
    """A compared statistic (a ``compare`` row) as a claim's ratio: simulated / measured median (1 + its
    ``rel_error``), its interval the simulated value against the measured repeats' max and min (the ratio any one
    repeat would have given), ``rounds`` the repeats (``rounds_unit`` "repeats": no pairs here, each repeat is one
    measured run against the one simulated value), ``margin`` the statistic's tolerance, ``direction`` "within"
    (the claim is that the ratio stays inside 1 +- margin); the verdict is ``fidelity_claim``'s, not decided here."""
    sim, mid, lo, hi = (row[k] for k in ("simulated_ms", "measured_ms", "measured_min_ms", "measured_max_ms"))
    return {"arms": ["measured", "simulated"], "ratio": sim / mid if mid > 0 else None,
            "ci_low": sim / hi if hi > 0 else None, "ci_high": sim / lo if lo > 0 else None,
            "rounds": row.get("num_repeats"), "rounds_unit": "repeats", "margin": row["tolerance"],
            "confidence": None, "direction": "within", "interval": "min..max",
            "of": f"{row['model']}: {row['policy']} {row['statistic']}"}  # fmt: skip


def _loaded_miss(load: Mapping[str, Any] | None) -> str:
    return (f"; the measured runs shared the CPUs with other processes (load average up to {load['peak']:.2f} on "
            f"{load['cpus']} CPUs): a miss there is the machine's, not the cost model's to answer for, so it "
            f"decides nothing")  # fmt: skip


def noisy_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The statistics beyond 10% that count as within only because a spread beyond ``NOISY_SPREAD`` set their
    tolerance: the runs themselves vary too much to say (the fidelity claims' own control)."""
    return [r for r in rows if abs(r["rel_error"]) > FIDELITY_TOLERANCE and r["spread"] > NOISY_SPREAD]


def fidelity_claim(
    rows: Sequence[Mapping[str, Any]],
    label: str,
    interleaved: Sequence[str] = (),
    load: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """ "The simulator (``label``) reproduces every policy within 10% or the measured spread": confirmed when every
    statistic is within its tolerance, not confirmed when one is not, inconclusive when a spread beyond
    ``NOISY_SPREAD`` sets the tolerance of a statistic outside 10% (the runs themselves vary too much to say: the
    claim's own control). ``interleaved``: the cost models (``op-profile``, ``profiled``) fitted to steps measured
    between the runs (``colocated_fidelity``); a claim on one of them ``uses`` ``INTERLEAVED``, which no hygiene
    anomaly voids (a drift of the machine during the check moved the model's steps and the runs alike); a claim on
    a model measured before the runs or read from a file rests on the absolute step times of another time
    (``uses`` "timing"), which a drifting reference step does void. ``load`` (``runs_load``): when the runs were
    loaded beyond the machine's CPUs, a statistic outside its tolerance makes the claim inconclusive, not "not
    confirmed" (a check of the machine, its load average, shows the runs were not the machine the models priced).
    The evidence's ratio and interval are the worst statistic's (``worst_ratio``)."""
    mine = [r for r in rows if r["model"] == label]
    worst = max(mine, key=lambda r: abs(r["rel_error"]))
    outside = [r for r in mine if not r["within"]]
    noisy = noisy_rows(mine)
    fitted_between = label.removesuffix(" noise") in interleaved
    evidence = {**worst_ratio(worst), "num_statistics": len(mine), "num_within": len(mine) - len(outside),
                "worst": {k: worst[k] for k in ("policy", "statistic", "rel_error", "tolerance")},
                "max_spread": max(r["spread"] for r in mine), "num_noisy": len(noisy),
                "fitted_between_runs": fitted_between,
                "bimodal": [f"{r['policy']} {r['statistic']}" for r in mine if r.get("bimodal")]}  # fmt: skip
    text = (f"worst {worst['policy']} {worst['statistic']}: {100 * worst['rel_error']:+.1f}% against a tolerance of "
            f"{100 * worst['tolerance']:.0f}%; {evidence['num_within']}/{len(mine)} statistics within")  # fmt: skip
    if evidence["bimodal"]:
        text += f"; measured bimodal across repeats: {', '.join(evidence['bimodal'])}"
    text += (
        "; the profile fitted to steps measured between the runs (a drift of the machine moves both alike)"
        if fitted_between
        else "; the profile's step times measured before the runs or read from a file"
    )
    uses = (INTERLEAVED,) if fitted_between else ("timing",)
    claim = f"The simulator ({label}) reproduces every policy's TTFT and ITL within 10% or the run-to-run spread"
    if load is not None:
        evidence["runs_load"] = dict(load)
    if outside and load is not None and load["loaded"]:
        return make_claim(claim, INCONCLUSIVE, evidence, text + _loaded_miss(load), uses)
    if outside:
        return make_claim(claim, NOT_CONFIRMED, evidence, text, uses)
    if noisy:
        return make_claim(claim, INCONCLUSIVE, evidence, text + f"; but {len(noisy)} only thanks to a spread > "
                          f"{100 * NOISY_SPREAD:.0f}%", uses)  # fmt: skip
    return make_claim(claim, CONFIRMED, evidence, text, uses)


def fidelity_claims(rows: Sequence[Mapping[str, Any]], labels: Sequence[str], interleaved: Sequence[str] = (),
                    load: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """``fidelity_claim`` of each of ``labels``, then ``best_cost_model`` over every model of ``rows``
    (``interleaved``, ``load``: as there)."""
    return [fidelity_claim(rows, name, interleaved, load) for name in labels] + [
        best_cost_model(rows, interleaved, load)
    ]


INTERVAL_MIN_REPEATS = 5  # min..max of n repeats holds their median with probability 1 - 2 / 2**n: 94% at 5


def interval_position(row: Mapping[str, Any], tolerance: float = FIDELITY_TOLERANCE) -> str:
    """Where a compared statistic's interval (``worst_ratio``'s: the simulated value against each of the measured
    repeats' extremes) lies against 1 +- ``tolerance``: "inside", "outside" (every repeat puts the simulated value
    beyond it, on one side) or "straddles"."""
    ev = worst_ratio(row)
    lo, hi = ev["ci_low"], ev["ci_high"]
    if lo is None or hi is None:
        return "straddles"
    if 1 - tolerance <= lo and hi <= 1 + tolerance:
        return "inside"
    return "outside" if hi < 1 - tolerance or lo > 1 + tolerance else "straddles"


def best_cost_model(
    rows: Sequence[Mapping[str, Any]], interleaved: Sequence[str] = (), load: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """ "The best cost model of this machine reproduces every policy within 10% or the run-to-run spread": the model
    (``rows``' ``model``: op-profile, profiled, each with its noise variant) with the most statistics within their
    tolerance, ties broken by the smaller worst error; confirmed when it holds all of them, not confirmed otherwise,
    inconclusive when it holds them all but one only thanks to a spread beyond ``NOISY_SPREAD`` (``fidelity_claim``'s
    control). With ``INTERVAL_MIN_REPEATS`` measured repeats or more behind every statistic, the claim is decided as an
    equivalence test on the repeats' min..max instead (a 94% interval for their median at 5 repeats): "within 10%"
    (``FIDELITY_TOLERANCE``); confirmed when one model has every statistic's interval inside 1 +- 10%
    (``interval_position``), not confirmed when every model has one interval wholly outside it, inconclusive
    otherwise (the repeats cannot tell: a statistic's spread alone is then wider than the margin). The best model is
    then the one with the most intervals inside, then the fewest outside, then the smaller worst error.
    The detail names it and every model's count, so the claim says which cost model was best. It ``uses`` what the
    best model's own claim uses (``fidelity_claim``: ``INTERLEAVED`` when fitted between the runs); with ``load``
    (``runs_load``) loaded beyond the CPUs, a best model short of every statistic leaves it inconclusive. The
    evidence's ratio and interval are the best model's worst statistic's (``worst_ratio``)."""
    labels = list(dict.fromkeys(r["model"] for r in rows))
    if not labels:
        raise ValueError("best_cost_model needs compared rows")
    by_interval = all((r.get("num_repeats") or 0) >= INTERVAL_MIN_REPEATS for r in rows)
    scores, places = {}, {}
    for label in labels:
        mine = [r for r in rows if r["model"] == label]
        scores[label] = (sum(1 for r in mine if r["within"]), len(mine), max(abs(r["rel_error"]) for r in mine))
        places[label] = [interval_position(r) for r in mine]
    if by_interval:
        best = max(labels, key=lambda k: (places[k].count("inside"), -places[k].count("outside"), -scores[k][2]))
    else:
        best = max(labels, key=lambda k: (scores[k][0], -scores[k][2]))
    within, total, worst = scores[best]
    counts = ", ".join(f"{k} {w}/{n}" for k, (w, n, _t) in scores.items())
    text = f"best: {best}, {within}/{total} statistics within (worst |error| {100 * worst:.1f}%); {counts}"
    claim = "The best cost model of this machine reproduces every policy's TTFT and ITL within 10% or the spread"
    worst_row = max((r for r in rows if r["model"] == best), key=lambda r: abs(r["rel_error"]))
    evidence = {**worst_ratio(worst_row), "best": best,
                **{k: {"num_within": w, "num_statistics": n, "max_abs_rel_error": t}
                   for k, (w, n, t) in scores.items()}}  # fmt: skip
    uses = (INTERLEAVED,) if best.removesuffix(" noise") in interleaved else ("timing",)
    if by_interval:
        claim = (f"The best cost model of this machine reproduces every policy's TTFT and ITL within "
                 f"{100 * FIDELITY_TOLERANCE:.0f}% of each of the measured repeats")  # fmt: skip
        inside = places[best].count("inside")
        text = (f"best: {best}, {inside}/{total} statistics inside 1 +- {FIDELITY_TOLERANCE:.2f} against every "
                f"measured repeat (min..max of {worst_row['num_repeats']}); per model inside/outside: "
                + ", ".join(f"{k} {p.count('inside')}/{p.count('outside')}" for k, p in places.items())
                + f"; against the repeats' median: {counts}")  # fmt: skip
        evidence["margin"] = FIDELITY_TOLERANCE
        evidence["decided_by"] = "interval"
        if inside == total:
            verdict = CONFIRMED
        elif all("outside" in p for p in places.values()):
            verdict = NOT_CONFIRMED
        else:
            verdict = INCONCLUSIVE
            text += ": no model is beyond the margin for every repeat, none inside it for all, the repeats cannot tell"
    else:
        # as fidelity_claim: a model "within" only because a spread beyond NOISY_SPREAD widened the tolerance
        # confirms nothing (noisier runs would otherwise make a confirmation easier)
        noisy = noisy_rows([r for r in rows if r["model"] == best])
        verdict = NOT_CONFIRMED if within < total else INCONCLUSIVE if noisy else CONFIRMED
        if verdict == INCONCLUSIVE:
            evidence["num_noisy"] = len(noisy)
            text += f"; but {len(noisy)} only thanks to a spread > {100 * NOISY_SPREAD:.0f}%"
    if verdict != CONFIRMED and load is not None and load["loaded"]:
        return make_claim(claim, INCONCLUSIVE, {**evidence, "runs_load": dict(load)}, text + _loaded_miss(load), uses)
    return make_claim(claim, verdict, evidence, text, uses)


def disaggregated_fidelity(
    model: str,
    costs: Any,
    requests: Sequence[Request],
    split: tuple[int, int],
    repeats: int = 3,
    threads: int = 1,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    noise_seed: int | None = 7,
    calibration: Sequence[Request] | None = None,
) -> dict[str, Any]:
    """The real disaggregated run (``repeats`` times) against the simulated one on each cost model of ``costs`` (one
    or a list): ``rows`` as ``compare`` (models ``cost.name`` and ``cost.name + " noise"``), ``handoff``, ``loads``.

    The simulator models the real engines' handoff (``SimConfig.kv_handoff_s``, ``kv_receive='between-steps'``: the
    decode engine receives between its steps), with the link, the handoff and each role's wake-up measured on
    **calibration runs** of another workload (``calibration``; default: this one's lengths and rate, another seed)
    by ``handoff_profile``: one before each measured repeat (calibration and repeats alternate, so a change of the
    machine's load during the run falls on both alike), pooled. Each role's extra time of a step after an idle wait
    (``idle_step_s``) and its steps' spread (the residuals the ``noise`` variant draws) are re-fitted on those runs
    too (``_calibrate_roles``: the profile's come from the colocated replay loop, which sleeps on a timer where these
    engines block on a queue, and from another hour's load); the ``noise`` variant also draws each handoff from the
    calibration runs' (rank-correlated with its prefill step's residual draw, as measured there), and runs
    ``repeats`` simulations with as many seeds, each statistic being their median as the measured one is the
    repeats' (one seed's TTFT p90 of 40 requests ranged 10.1-12.0 ms over 20 seeds: a single draw carries that
    sampling noise into the comparison). ``ttft_parts``: each measured repeat's and each simulation's TTFT in parts
    (``ttft_parts``; of the noise variant, its first seed's).
    The measured repeats replay the held-out ``requests``. Before all of them the engines serve
    ``warmup_workload`` (every prefill length, every decode batch size), so that the calibration and every repeat
    run shapes the process has seen: with oneDNN's packed products (until 2026-12-06) the calibration run and the
    first repeat paid ~0.7 ms per new (matrix, rows) shape on nearly every tiny-gqa prefill (3 ms steps, ~1.9 ms of
    work), the later repeats did not, and the calibrated model carried the first runs' cost."""
    import dataclasses

    from workbench.cluster.disagg import DisaggCluster, DisaggConfig
    from workbench.config import ModelConfig
    from workbench.engine.metrics import summarize
    from workbench.request import SamplingParams
    from workbench.workloads import prompt_token_ids

    cfg_model = ModelConfig.resolve(model)
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, device="cpu")

    def as_work(reqs: Sequence[Request]) -> list:
        return [(prompt_token_ids(r, cfg_model.vocab_size, 0), SamplingParams(max_tokens=r.output_len,
                 ignore_eos=True), r.arrival_time_s) for r in reqs]  # fmt: skip

    if calibration is None:
        calibration = _recalibration_workload(requests)
    work = as_work(requests)
    dcfg = DisaggConfig(prefill=ecfg, decode=ecfg, num_prefill=split[0], num_decode=split[1],
                        threads_per_engine=threads)  # fmt: skip
    runs, loads, measured = [], [], []
    with DisaggCluster(model, dcfg) as cluster:
        cluster.run(as_work(warmup_workload(max_model_len, max_num_seqs)), online=True)  # warm-up, not measured
        cals = []
        for rep in range(repeats):  # calibration and measured runs alternate: the same machine states feed both
            before = load_average()
            cals.append(cluster.run(as_work(calibration), online=True))
            loads.append({"repeat": f"calibration {rep}", "load_before": before, "load_after": load_average()})
            before = load_average()
            result = cluster.run(work, online=True)
            loads.append({"repeat": rep, "load_before": before, "load_after": load_average()})
            runs.append(summarize(result.requests, duration_s=result.duration_s)["metrics"])
            measured.append(result)
    check_pool_engines(measured[0], threads)
    handoff = handoff_profile(cals)

    def sim_config(**handoff_draws: Any) -> SimConfig:
        return SimConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         num_blocks=ecfg.cache_shape(cfg_model)[0], block_size=ecfg.block_size, dtype="fp32",
                         disaggregate=split, link_gbps=handoff["link_gbps"], link_latency_s=handoff["link_latency_s"],
                         kv_handoff_s=handoff["kv_handoff_s"], kv_receive="between-steps", **handoff_draws)  # fmt: skip

    scfg = sim_config()

    def noisy(k: int) -> SimConfig:  # the k-th seeded simulation's handoff draws
        return sim_config(kv_handoff_quantiles_s=tuple(handoff["kv_handoff_quantiles_s"]),
                          kv_handoff_seed=(noise_seed or 0) + k,
                          kv_handoff_rank_correlation=handoff["kv_handoff_rank_correlation"])  # fmt: skip

    roles = ["prefill"] * split[0] + ["decode"] * split[1]
    rows, calibrated = [], {}
    parts: dict[str, Any] = {"measured": [ttft_parts(r, split[0]) for r in measured]}
    setup = f"disaggregated {split[0]}:{split[1]}"
    for cost in costs if isinstance(costs, (list, tuple)) else [costs]:
        base = [dataclasses.replace(cost, noise_seed=None, wake_s=handoff["wake_s"][r], idle_step_s=0.0) for r in roles]
        plain = simulate(list(calibration), cfg_model, base, scfg, record_steps=True)
        cal_roles = calibrated[cost.name] = _calibrate_roles(cals, plain, split)

        def replicas(seeds: list[int | None], cost: Any = cost, cal_roles: dict = cal_roles) -> list:
            idle_key = "idle_step_s" if seeds[0] is None else "noise_idle_step_s"
            return [dataclasses.replace(cost, noise_seed=s, wake_s=handoff["wake_s"][role],
                                        wake_quantiles_s=handoff["wake_quantiles_s"][role],
                                        idle_step_s=cal_roles[role][idle_key],
                                        residual_quantiles_s=cal_roles[role]["residual_quantiles_s"] or
                                        cost.residual_quantiles_s)
                    for s, role in zip(seeds, roles)]  # fmt: skip

        result = simulate(list(requests), cfg_model, replicas([None] * len(roles)), scfg, record_steps=True)
        parts[cost.name] = ttft_parts(result, split[0])
        rows += compare({setup: runs}, {setup: result.summary()["metrics"]}, cost.name)
        if noise_seed is not None:  # as many seeded simulations as measured repeats, each statistic's median
            sims = [simulate(list(requests), cfg_model, replicas([noise_seed + k * len(roles) + i for i in
                    range(len(roles))]), noisy(k), record_steps=True) for k in range(repeats)]  # fmt: skip
            parts[f"{cost.name} noise"] = ttft_parts(sims[0], split[0])
            noise_metrics = median_metrics([x.summary()["metrics"] for x in sims])
            rows += compare({setup: runs}, {setup: noise_metrics}, f"{cost.name} noise")
    link = {"latency_s": handoff["link_latency_s"], "gbps": handoff["link_gbps"],
            "num_transfers": handoff["num_transfers"], "fit": handoff["link_fit"]}  # fmt: skip
    idle = {name: {role: c["idle_step_s"] for role, c in roles_.items()} for name, roles_ in calibrated.items()}
    return {
        "rows": rows,
        "link": link,
        "handoff": handoff,
        "idle_step_s": idle,
        "loads": loads,
        "repeats": repeats,
        "ttft_parts": parts,
    }


def check_pool_engines(result: Any, threads: int) -> None:
    """ConfigError unless every engine of a real disaggregated run (``DisaggResult.pools``) ran the attention backend
    of the colocated engine the cost models were timed on (``engine_attention_backend``) with ``threads`` torch
    threads: a profile of another backend or thread count does not price that pool's steps."""
    from workbench.errors import ConfigError

    backend = engine_attention_backend()
    for name, pool in sorted(result.pools.items()):
        ran = (pool.get("attention_backend"), pool.get("num_threads"))
        if ran != (backend, threads):
            raise ConfigError(
                f"the disaggregated {name} engine ran attention backend {ran[0]!r} on {ran[1]} thread(s); the cost "
                f"models time the colocated engine's {backend!r} on {threads}"
            )


def ttft_parts(result: Any, num_prefill: int = 1) -> dict[str, Any]:
    """A disaggregated run's TTFT in parts, medians over its requests in ms: ``queue`` (arrival to the start of the
    prefill step that computed its prompt), ``prefill`` (that step), ``after`` (the step's end to the first token
    at the decode side: handoff, the decode engine's wait and the wire), ``ttft``, ``sum_of_medians`` (the three
    parts' medians added: short of the TTFT median when the parts' spreads are wide and skewed); of a real run
    (``DisaggResult``) also ``handoff`` (first token to the announcement read by the decode engine), ``decode_wait``
    (to the receive posted) and ``wire`` (to the KV landed). ``result``: a ``DisaggResult`` or a ``SimResult``
    recorded with its steps. A request's prefill step: its prefill engine (the real run's routing; the simulator's
    round-robin in arrival order) serves prompts first come first served, one step each (no token budget), so each
    step with prefill tokens takes the next ``num_seqs`` of its requests in arrival order. ``p90``: each part's
    p90 (as the engine's metrics compute it), to see which part carries the TTFT's tail."""
    real = hasattr(result, "transfers")
    reqs = list(result.requests if real else result.records)
    step_of = _prefill_steps(result, num_prefill)
    names = ("queue", "prefill", "after", "ttft") + (("handoff", "decode_wait", "wire") if real else ())
    values: dict[str, list[float]] = {n: [] for n in names}
    for r in reqs:
        step = step_of.get(r.request_id)
        tl = result.transfers.get(r.request_id, {}).get("timeline") if real else None
        if step is None or r.first_token_time is None or (real and tl is None):
            continue
        values["queue"].append(step["start_s"] - r.arrival_time)
        values["prefill"].append(step["end_s"] - step["start_s"])
        values["after"].append(r.first_token_time - step["end_s"])
        values["ttft"].append(r.first_token_time - r.arrival_time)
        if tl is not None:
            values["handoff"].append(tl["announced_s"] - tl["prefill_token_s"])
            values["decode_wait"].append(tl["receive_posted_s"] - tl["announced_s"])
            values["wire"].append(tl["landed_s"] - tl["receive_posted_s"])
    from workbench.engine.metrics import stats

    out: dict[str, Any] = {n: 1e3 * statistics.median(v) if v else None for n, v in values.items()}
    if values["ttft"]:
        out["sum_of_medians"] = out["queue"] + out["prefill"] + out["after"]
    out["p90"] = {n: 1e3 * stats(v)["p90"] if v else None for n, v in values.items()}  # where the tail is
    out["num_requests"] = len(values["ttft"])
    return out


def _prefill_steps(result: Any, num_prefill: int = 1) -> dict[int, dict[str, Any]]:
    """Each request's prefill step (``ttft_parts``' rule: its prefill engine serves prompts first come first
    served, one step each, so each step with prefill tokens takes the next ``num_seqs`` of its requests in arrival
    order), by request id. ``result``: a ``DisaggResult`` or a ``SimResult`` recorded with its steps."""
    real = hasattr(result, "transfers")
    order = sorted(result.requests if real else result.records, key=lambda r: (r.arrival_time, r.request_id))
    by_engine: dict[int, list[Any]] = {}
    for i, r in enumerate(order):
        p = result.engines.get(r.request_id, (i % num_prefill, 0))[0] if real else i % num_prefill
        by_engine.setdefault(p, []).append(r)
    step_of: dict[int, dict[str, Any]] = {}
    for p, queue in by_engine.items():
        steps = result.pools[f"prefill{p}"]["steps"] if real else result.step_logs[p].to_records()
        it = iter(queue)
        for step in steps:
            for _ in range(step["num_seqs"] if step["num_prefill_tokens"] else 0):
                r = next(it, None)
                if r is not None:
                    step_of[r.request_id] = step
    return step_of


def _step_residuals(steps: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each step's duration less a least-squares plane in its prefill tokens and sequences (a plane through the
    mean when the steps cannot fix one): how much slower than steps of its size it ran."""
    import numpy as np

    y = np.array([s["duration_s"] for s in steps], dtype=float)
    x = np.array([[1.0, s["num_prefill_tokens"], s["num_seqs"]] for s in steps], dtype=float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return [float(v) for v in y - x @ coef]


def handoff_profile(results: Any) -> dict[str, Any]:
    """What real disaggregated runs (``workbench.cluster.disagg.DisaggResult``, one or a list, pooled) say about their
    handoff, in the simulator's terms (``workbench.sim.cluster``; all medians):

    - ``link_latency_s``, ``link_gbps``: ``time = latency + bytes / bandwidth`` fitted to the wire times (receive
      posted to KV landed; ``workbench.sim.comm.fit_latency_bandwidth``), else, when that fit is not physical (a
      loaded machine's outliers), the line through the medians of the smaller and the larger half of the transfers
      (``link_fit`` says which);
    - ``kv_handoff_s``: from the prefill side's first token to the announcement reaching the decode engine (the
      sender's gather and the control message), and ``kv_handoff_quantiles_s``, 100 quantiles of them, over the
      transfers sent while the decode engine was between steps (one sent mid-step also waits for that step, which
      the simulator models itself; ``num_handoffs`` counts those used);
    - ``wake_s``: per role, from a request's arrival (prefill) or announcement (decode) that finds its engine idle
      to the engine's next step or receive, and ``wake_quantiles_s``, 100 quantiles of them (the ``noise`` variant
      draws each wake from these: the median alone left the real TTFT's tail out, a prefill engine's wake being
      1.3 ms at the median and 1.8-1.9 ms at the p90 on tiny-gqa);
    - ``kv_handoff_rank_correlation``: Spearman's rank correlation, over those handoffs, of each with its request's
      prefill step's residual (``_step_residuals``, within each run): a slow step and a slow handoff come
      together (0.22-0.49 over 12 runs on tiny-gqa, where shuffled pairs give about 0); the
      ``noise`` variant draws each handoff so correlated with its prefill step's residual draw
      (``SimConfig.kv_handoff_rank_correlation``).
    """
    from workbench.sim.comm import fit_latency_bandwidth

    runs = results if isinstance(results, (list, tuple)) else [results]
    lines, free, wakes = [], [], {"prefill": [], "decode": []}
    pairs: list[tuple[float, float]] = []  # (prefill step residual, handoff) of the free handoffs
    for result in runs:
        step_of = _prefill_steps(result, 1 + max((p for p, _ in result.engines.values()), default=0))
        own = list({id(s): s for s in step_of.values()}.values())  # each step once
        residual = dict(zip(map(id, own), _step_residuals(own))) if len(own) >= 3 else {}
        for rid, t in result.transfers.items():
            if t.get("kv_transfer_bytes", 0) <= 0 or "timeline" not in t:
                continue
            tl = t["timeline"]
            lines.append((t["kv_transfer_bytes"], tl))
            # the decode engine reads its inbox between its steps: an announcement sent while it was mid-step waited
            # for that step's end, which the simulator adds itself (a transfer is admitted at the top of the
            # replica's next step), so the handoff is measured on the announcements that found it between steps
            d = result.engines.get(rid, (0, 0))[1]
            steps = result.pools.get(f"decode{d}", {}).get("steps", [])
            if not any(s["start_s"] <= tl["sent_s"] < s["end_s"] for s in steps):
                free.append(tl)
                if (step := step_of.get(rid)) is not None and id(step) in residual:
                    pairs.append((residual[id(step)], max(tl["announced_s"] - tl["prefill_token_s"], 0.0)))
        by_id = {r.request_id: r for r in result.requests}
        for rid, (p, d) in result.engines.items():
            steps = result.pools.get(f"prefill{p}", {}).get("steps", [])
            if rid in by_id and (w := _wake(steps, by_id[rid].arrival_time)) is not None:
                wakes["prefill"].append(w)
            tl = result.transfers.get(rid, {}).get("timeline")
            steps = result.pools.get(f"decode{d}", {}).get("steps", [])
            if tl is not None and not any(s["start_s"] <= tl["announced_s"] < s["end_s"] for s in steps):
                wakes["decode"].append(tl["receive_posted_s"] - tl["announced_s"])
    if len(lines) < 2:
        from workbench.errors import ConfigError

        raise ConfigError("a handoff profile needs at least two transferred requests")
    wire = [(b, max(tl["landed_s"] - tl["receive_posted_s"], 1e-9)) for b, tl in lines]
    latency, bandwidth = fit_latency_bandwidth(wire)
    fit = "latency-bandwidth"
    if not (bandwidth > 0 and latency >= 0):  # noisy transfers on a loaded machine: the line through two medians
        latency, bandwidth = _two_medians_line(wire)
        fit = "the medians of the smaller and larger halves (the least-squares fit was not physical)"
    handoffs = [max(tl["announced_s"] - tl["prefill_token_s"], 0.0) for tl in (free or [tl for _, tl in lines])]
    return {
        "link_latency_s": latency,
        "link_gbps": bandwidth * 8 / 1e9,
        "link_fit": fit,
        "kv_handoff_s": statistics.median(handoffs),
        "kv_handoff_quantiles_s": _quantiles(handoffs),
        "num_handoffs": len(handoffs),
        "kv_handoff_rank_correlation": rank_correlation([p for p, _ in pairs], [h for _, h in pairs]),
        "wake_s": {role: statistics.median(w) if w else 0.0 for role, w in wakes.items()},
        "wake_quantiles_s": {role: _quantiles(w) for role, w in wakes.items()},
        "num_transfers": len(lines),
        "num_runs": len(runs),
    }


def _two_medians_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency, bytes per second) of the line through the (bytes, seconds) medians of the smaller and the larger
    half of ``points``; a flat or falling line is all latency (the median time) over a link of no cost per byte."""
    ordered = sorted(points)
    half = len(ordered) // 2
    lo, hi = ordered[:half], ordered[half:]
    (b1, t1), (b2, t2) = ((statistics.median(b for b, _ in h), statistics.median(t for _, t in h)) for h in (lo, hi))
    if b2 > b1 and t2 > t1:
        slope = (t2 - t1) / (b2 - b1)
        return max(t1 - b1 * slope, 0.0), 1.0 / slope
    return statistics.median(t for _, t in points), 1e15


def _wake(steps: list[dict[str, Any]], t: float) -> float | None:
    """From ``t`` to the next step's start when no step runs at ``t`` (the engine idled); None otherwise."""
    if any(s["start_s"] <= t < s["end_s"] for s in steps):
        return None
    later = [s["start_s"] for s in steps if s["start_s"] >= t]
    return min(later) - t if later else None


def _recalibration_workload(requests: Sequence[Request]) -> list[Request]:
    """Another draw of a workload like ``requests`` (their count and mean rate, the held-out lengths)."""
    span = max(r.arrival_time_s for r in requests) or 1.0
    return held_out_workload(len(requests), len(requests) / span, seed=10_007)


def _first_step_after(steps: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    later = [x for x in steps if x["start_s"] >= t - 1e-12]
    return min(later, key=lambda x: x["start_s"]) if later else None


def _quantiles(values: list[float], n: int = 100) -> list[float]:
    """``n`` equally spaced order statistics of ``values``, the smallest to the largest (none of fewer than two)."""
    v = sorted(values)
    return [v[min(len(v) - 1, round(q * (len(v) - 1) / (n - 1)))] for q in range(n)] if len(v) > 1 else []


def _calibrate_roles(reals: Any, sim: Any, split: tuple[int, int]) -> dict[str, dict[str, Any]]:
    """Per role, from the calibration runs (one ``DisaggResult`` or a list of runs of one workload, pooled) and its
    simulation with no idle excess: ``idle_step_s``, the median of
    (real - simulated) duration of the step that serves a request which found its engine idle (the prefill step
    after its arrival; the decode step after its KV landed), at least 0; and ``residual_quantiles_s``, the spread of
    the real steps around the model (prefill: those paired differences less their median; decode: each real pure
    decode step less the median simulated one of as many sequences, so the draws carry the machine's speed during the
    calibration run, the steps after an idle wait left out: their excess is ``idle_step_s``, which the simulator adds
    to its own steps after idling, and drawn again as noise it counted twice: ~4% of the steps of a lightly loaded
    decode engine, enough to move the ITL's p90), which the ``noise`` variant draws, with ``noise_idle_step_s`` (the
    excess less the residuals' median, not to count a slower machine twice)."""
    runs = reals if isinstance(reals, (list, tuple)) else [reals]
    sim_by_id = {r.request_id: r for r in sim.records}
    diffs: dict[str, list[float]] = {"prefill": [], "decode": []}
    after_idle: set[tuple[int, int, float]] = set()  # (run, engine, start) of each decode step paired below
    ids = [{r.request_id: r for r in run.requests} for run in runs]
    pairs = [(run, by_id, rid, pd) for run, by_id in zip(runs, ids) for rid, pd in run.engines.items()]
    for real, by_id, rid, (p, d) in pairs:
        r, s = by_id.get(rid), sim_by_id.get(rid)
        if r is None or s is None:
            continue
        steps, sim_steps = real.pools[f"prefill{p}"]["steps"], sim.step_logs[p].to_records()
        if not any(x["start_s"] <= r.arrival_time < x["end_s"] for x in steps):
            a, b = _first_step_after(steps, r.arrival_time), _first_step_after(sim_steps, s.arrival_time)
            if a is not None and b is not None:
                diffs["prefill"].append(a["duration_s"] - b["duration_s"])
        tl = real.transfers.get(rid, {}).get("timeline")
        steps, sim_steps = real.pools[f"decode{d}"]["steps"], sim.step_logs[split[0] + d].to_records()
        if tl is not None and not any(x["start_s"] <= tl["announced_s"] < x["end_s"] for x in steps):
            a, b = _first_step_after(steps, tl["landed_s"]), _first_step_after(sim_steps, s.first_token_time)
            if a is not None and b is not None:
                diffs["decode"].append(a["duration_s"] - b["duration_s"])
                after_idle.add((id(real), d, a["start_s"]))
    out: dict[str, dict[str, Any]] = {}
    for role, count in (("prefill", split[0]), ("decode", split[1])):
        excess = statistics.median(diffs[role]) if diffs[role] else 0.0
        if role == "prefill":
            spread = [x - excess for x in diffs[role]]
        else:  # every pure decode step against the simulated ones of as many sequences
            modelled: dict[int, list[float]] = {}
            for i in range(split[0], split[0] + count):
                for x in sim.step_logs[i].to_records():
                    if x["num_prefill_tokens"] == 0:
                        modelled.setdefault(x["num_seqs"], []).append(x["duration_s"])
            typical = {n: statistics.median(v) for n, v in modelled.items()}
            spread = [x["duration_s"] - typical[x["num_seqs"]] for real in runs for i in range(count)
                      for x in real.pools[f"decode{i}"]["steps"]
                      if x["num_prefill_tokens"] == 0 and x["num_seqs"] in typical
                      and (id(real), i, x["start_s"]) not in after_idle]  # fmt: skip
        shift = statistics.median(spread) if spread else 0.0
        out[role] = {"idle_step_s": max(excess, 0.0), "residual_quantiles_s": _quantiles(spread),
                     "noise_idle_step_s": max(excess - shift, 0.0), "num_paired": len(diffs[role])}  # fmt: skip
    return out


# ---- notebook 07: the profiles of this machine, where a step's time goes, published GPU measurements ------------
def profile_provenance(kind: str, cost: Any) -> dict[str, Any]:
    """Where a cost model's profile was measured: its machine facts (``workbench.sim.measure.machine_identity``, as
    far as the file records them), the load average while it was measured, and ``loaded``: whether that load
    exceeded the machine's CPUs (the profile then holds other processes' time: unreliable)."""
    if kind == "op-profile":
        data = cost.source or {}
        machine = dict(data.get("machine") or {})
        loads = [x[0] for x in (data.get("load_average_start"), data.get("load_average_end")) if x]
    else:
        meta = cost.meta or {}
        machine = {"cpu": meta.get("machine"), "cpu_count": meta.get("cpu_count"),
                   "cpu_capability": meta.get("cpu_capability")}  # fmt: skip
        loads = [x for x in (meta.get("load_average_1min") or []) if x is not None]
    cpus = machine.get("cpu_count")
    peak = max(loads) if loads else None
    return {"machine": machine, "load_average_1min": loads or None,
            "loaded": None if peak is None or not cpus else peak > cpus}  # fmt: skip


def engine_packs(model: str | None) -> bool:
    """Whether today's default engine (``EngineConfig.packed_linears``) packs any linear layer of ``model`` on a CPU
    in fp32/bf16: some weight of the model (``workbench.bench.linear_shapes``) is ``worth_packing``. A profile
    without a model name: the flag alone."""
    from workbench.bench import linear_shapes
    from workbench.config import ModelConfig
    from workbench.model.packed import worth_packing

    if not EngineConfig().packed_linears:
        return False
    if not model:
        return True
    return any(worth_packing(i, o) for i, o in linear_shapes(ModelConfig.resolve(model)))


def packed_mismatch(kind: str, data: Mapping[str, Any]) -> bool:
    """Whether a profile (``data``: its file's content, ``to_dict()`` of the loaded cost model) timed its linear
    layers otherwise than today's default engine runs them on its model (``engine_packs``): an op profile records
    ``packed_linears``, whether any layer was packed; a fitted profile ``meta.packed_layers``, how many its engines
    packed, and before that only the engine configs it ran, whose ``packed_linears`` then packed every layer; a
    file from before the option existed has none of them and was timed with plain layers."""
    if kind == "op-profile":
        if data.get("device", "cpu") != "cpu":
            return False
        return bool(data.get("packed_linears", False)) != engine_packs(data.get("model"))
    meta = data.get("meta") or {}
    configs = meta.get("engine_configs") or [{}]
    if all(c.get("device", "cpu") != "cpu" for c in configs):
        return False
    packs = engine_packs(meta.get("model"))
    if "packed_layers" in meta:
        return (int(meta["packed_layers"]) > 0) != packs
    return any(c.get("device", "cpu") == "cpu" and bool(c.get("packed_linears", False)) != packs
               for c in configs)  # fmt: skip


def timed_attention_backend(kind: str, data: Mapping[str, Any]) -> str:
    """The attention backend a profile (``data``: its file's content) timed: an op profile's ``attention_backend``;
    a fitted profile's ``meta.attention_backend`` (the name its engines resolved, recorded since issue 33), else its
    engine configs' when not "auto" ("auto, unresolved" when only that: which backend ran is unknown); "torch" for a
    file from before either (the engine's only CPU backend then)."""
    if kind == "op-profile":
        return str(data.get("attention_backend", "torch"))
    meta = data.get("meta") or {}
    if meta.get("attention_backend"):
        return str(meta["attention_backend"])
    named = [str(c["attention_backend"]) for c in meta.get("engine_configs") or [] if c.get("attention_backend")]
    if not named:
        return "torch"
    return next((b for b in named if b != "auto"), "auto, unresolved")


def profile_for_this_machine(
    kind: str,
    model: str,
    path: str | None = None,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    max_tokens: int = 2048,
    num_requests: int = 24,
    measure: bool = False,
    threads: int | None = 1,
) -> tuple[Any, str]:
    """(cost model, where it came from): ``kind`` ``op-profile`` or ``profiled``; from ``path`` when given, else
    the committed profile of this machine (``stored_profile``), else measured now (``max_tokens``: the op profile's
    largest size; ``num_requests``: per workload of the engine runs that fit), all at once. ``measure``: measure now
    in any case; ``threads``: torch threads of a profile fitted now. The fidelity check measures a profile it fits
    now otherwise: its engine workloads between its measured runs (``colocated_fidelity``)."""
    from workbench.sim.measure import fit_engine_profile
    from workbench.sim.op_profile import OpProfileCostModel
    from workbench.sim.op_timing import measure_overhead

    cost, why = (None, "") if measure and path is None else stored_profile(kind, model, path)
    if cost is not None:
        return cost, why
    if kind == "op-profile":
        profile = measure_op_profile(model, max_tokens)
        profile["overhead"] = measure_overhead(profile, num_requests=num_requests, max_num_seqs=max_num_seqs,
                                               max_model_len=max_model_len)  # fmt: skip
        profile["load_average_end"] = load_average()
        return OpProfileCostModel.from_dict(profile, "the measured op profile"), "measured now (profile-ops)" + why
    fitted = fit_engine_profile(model, num_requests=num_requests, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, threads=threads)  # fmt: skip
    return fitted, "fitted now (fit-profile)" + why


def stored_profile(kind: str, model: str, path: str | None = None) -> tuple[Any, str]:
    """(cost model, its file) of ``kind`` (``op-profile`` or ``profiled``): ``path`` when given, else the committed
    profile of this machine (``data/profiles/``, named after the CPU model as ``workbench profile-ops`` and ``workbench
    fit-profile`` name them) when there is one, it records this machine (the CPU model, the number of CPUs and torch's
    instruction set, ``workbench.sim.measure.machine_identity``: a VM's CPU name can cover parts of several kinds), it
    ran the linear layers as the engine does (``packed_mismatch``) and timed the attention backend the engine runs
    (``timed_attention_backend`` against ``engine_attention_backend``; a fitted profile too, since the engine's steps
    it timed attend through that backend). Otherwise (None, why not: "" when there is no such file, else a
    parenthesis to append to the source of a profile measured now)."""
    from pathlib import Path

    from workbench.errors import ConfigError
    from workbench.hardware import cpu_model_name
    from workbench.sim.costmodel import ProfiledCostModel
    from workbench.sim.measure import default_op_profile_path, default_profile_path, identity_mismatch, machine_identity
    from workbench.sim.op_profile import OpProfileCostModel

    if kind not in ("op-profile", "profiled"):
        raise ConfigError(f"unknown profile kind {kind!r}; expected op-profile or profiled")
    cls = OpProfileCostModel if kind == "op-profile" else ProfiledCostModel
    if path is not None:
        return cls.load(path), path
    found = default_op_profile_path(model, cpu_model_name()) if kind == "op-profile" else default_profile_path(model)
    if not Path(found).is_file():
        return None, ""
    cost = cls.load(found)
    differ = identity_mismatch(profile_provenance(kind, cost)["machine"], machine_identity())
    if differ:
        return None, f" (the committed {found} is of another machine: {'; '.join(differ)})"
    if packed_mismatch(kind, cost.to_dict()):
        return None, (f" (the committed {found} timed its linear layers otherwise than the engine runs them on "
                      f"{model}: EngineConfig.packed_linears, PACKED_MIN_WEIGHT)")  # fmt: skip
    timed, runs = timed_attention_backend(kind, cost.to_dict()), engine_attention_backend()
    if timed != runs:
        return None, f" (the committed {found} timed the {timed} attention backend; the engine runs {runs})"
    return cost, found


def engine_attention_backend() -> str:
    """The attention backend the fidelity check's engine runs on this CPU (``engine_config``'s, resolved by
    ``make_backend``: ``cpu``, the paged C++ decode, where its op builds, else ``torch``). An op profile must time
    the same: SmolLM2-135M's decode attention per layer took 0.35 ms with the torch backend's gather against 0.07 ms
    with the C++ op at batch 4 x context 128 (5x; interleaved, AMD EPYC), so a profile of the torch backend priced
    the engine's steps ~15% high."""
    from workbench.engine.runner import make_backend

    return make_backend(engine_config("continuous").attention_backend, "cpu").name


def measure_op_profile(model: str, max_tokens: int = 2048) -> dict[str, Any]:
    """Every operation of ``model`` timed now on this CPU (``workbench.sim.op_timing.profile_ops``, fp32) with the
    attention backend the fidelity check's engine runs (``engine_attention_backend``), with the machine
    (``machine_identity``) and the load average at the start; its ``overhead`` is still to be fitted
    (``op_timing.measure_overhead``, or ``overhead_from_samples`` on workloads measured elsewhere), on an engine of the
    same backend (``op_timing.overhead_engine_configs``)."""
    from workbench.sim.measure import machine_identity
    from workbench.sim.op_timing import profile_ops

    load_start = load_average()
    profile = profile_ops(model, "cpu", "fp32", engine_attention_backend(), max_tokens=max_tokens, progress=False)
    profile["model"] = model
    profile["machine"] = machine_identity()
    profile["load_average_start"] = load_start
    return profile


def colocated_fidelity(
    net: Any,
    model: str,
    requests: Sequence[Request],
    policies: Sequence[str],
    kinds: Sequence[str] = ("op-profile", "profiled"),
    paths: Mapping[str, str | None] | None = None,
    repeats: int = 3,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    measure_max_tokens: int = 1024,
    measure_requests: int = 24,
    measure_profiles: bool = False,
    noise_seed: int = 7,
    progress: bool = False,
    log: Any = None,
) -> dict[str, Any]:
    """The colocated half of the fidelity check (``workbench fidelity`` and notebook 07 share it): each cost model
    of ``kinds`` read (``stored_profile``: ``paths[kind]``, else this machine's committed profile, unless
    ``measure_profiles``) or measured now, the real engine (``net``, the preset ``model``) on ``requests`` under
    every policy, ``repeats`` times interleaved (``measure_policies``), and each model simulated on the same,
    deterministic and with seeded noise (``noise_seed``), compared (``compare``).

    A profile measured now measures its engine workloads **between the runs** (``InterleavedTraining``, one
    workload after every run or so) and is fitted after them: the ``profiled`` fit on all its steps; the op
    profile's operations are timed alone first (``measure_op_profile``), its overhead fitted after the runs
    (``op_timing.overhead_from_samples``) on the training workloads replayed between them on its engine
    (``op_timing.overhead_engine_configs``). A shared CPU's speed drifts by more than the check's 10% within
    minutes; a model fitted to steps of the same minutes as the runs compares with them whatever the drift, where
    one measured before them carries the speed of its own minutes into the comparison (the AMD EPYC's repeats
    moved by 22%, a profile fitted before the runs was ~20% off).

    Returns ``costs`` and ``sources`` (per kind, in ``kinds``' order), ``interleaved`` (the kinds fitted between
    the runs), ``fitted_steps`` (the ``profiled`` fit's steps when fitted now, ``InterleavedTraining.steps_record``:
    what ``workbench fit-profile --from-steps`` re-fits; else absent), ``measured`` (``measure_policies``' result),
    ``rows`` (``compare``'s, the models ``kind`` and ``kind noise``), ``step_errors`` (each model's per-step error on
    the runs' own steps, ``sim.measure.step_errors``) and ``profile_s`` (seconds spent measuring profiles).
    ``log``: a callable given one line per profile."""
    from workbench.config import ModelConfig
    from workbench.errors import ConfigError
    from workbench.sim.measure import InterleavedTraining, step_errors, training_configs
    from workbench.sim.op_profile import OpProfileCostModel
    from workbench.sim.op_timing import overhead_engine_configs, overhead_from_samples

    kinds = list(kinds)
    if not kinds or any(k not in ("op-profile", "profiled") for k in kinds):
        raise ConfigError(f"cost models must be some of op-profile, profiled (--cost-model), got {kinds!r}")
    paths = paths or {}
    costs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    training: dict[str, InterleavedTraining] = {}
    op_profile: dict[str, Any] = {}
    t0 = now()
    for kind in kinds:
        cost, why = (
            (None, "") if measure_profiles and not paths.get(kind) else stored_profile(kind, model, paths.get(kind))
        )
        if cost is not None:
            costs[kind], sources[kind] = cost, why
            _tell(log, kind, cost, why)
            continue
        if kind == "profiled":
            configs = training_configs(max_num_seqs=max_num_seqs, max_model_len=max_model_len)
            sources[kind] = "fitted now (fit-profile), its workloads measured between the runs" + why
        else:
            op_profile = measure_op_profile(model, measure_max_tokens)
            configs = overhead_engine_configs(op_profile, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
            sources[kind] = "measured now (profile-ops), its overhead's workloads measured between the runs" + why
        training[kind] = InterleavedTraining(net, configs, measure_requests, model=model)
    profile_s = now() - t0

    def between(fraction: float) -> None:
        for t in training.values():
            t.run_due(fraction)

    measured = measure_policies(net, requests, policies, repeats, max_num_seqs, max_model_len, progress,
                                between=between if training else None)  # fmt: skip
    between(1.0)  # none left normally; all of them when there were no runs
    if "profiled" in training:
        costs["profiled"] = training["profiled"].fit()
    if "op-profile" in training:
        t = training["op-profile"]
        op_profile["overhead"] = overhead_from_samples(op_profile, t.samples, t.configs, t.seed)
        op_profile["load_average_end"] = load_average()
        costs["op-profile"] = OpProfileCostModel.from_dict(op_profile, "the measured op profile")
    for kind in training:
        _tell(log, kind, costs[kind], sources[kind])
    costs = {k: costs[k] for k in kinds}  # the table's order
    profile_s += sum(t.seconds for t in training.values())
    cfg = ModelConfig.resolve(model)
    rows: list[dict] = []
    for kind, cost in costs.items():
        for name, seed in ((kind, None), (f"{kind} noise", noise_seed)):
            sim = simulate_policies(requests, cfg, cost, measured, max_num_seqs, max_model_len, seed)
            rows += compare(measured["runs"], sim, name)
    fitted_steps = {"fitted_steps": training["profiled"].steps_record()} if "profiled" in training else {}
    return {"costs": costs, "sources": sources, "interleaved": list(training), "measured": measured, "rows": rows,
            "step_errors": {k: step_errors(c.with_noise(None), measured["steps"]) for k, c in costs.items()},
            "profile_s": profile_s, **fitted_steps}  # fmt: skip


def _tell(log: Any, kind: str, cost: Any, source: str) -> None:
    """One line to ``log`` (when given) on a profile read or measured: its source, machine, load and fit warnings."""
    if log is None:
        return
    prov = profile_provenance(kind, cost)
    quality = (getattr(cost, "meta", None) or {}).get("fit", {}).get("warnings") or []
    log(f"{kind}: {source}; machine {prov['machine']}; load average while measured {prov['load_average_1min']}"
        f"{'  LOADED: its times hold other processes' if prov['loaded'] else ''}"
        + "".join(f"\n  FIT WARNING: {w}" for w in quality))  # fmt: skip


def step_breakdown(cost: Any, steps: Mapping[str, Any]) -> list[dict]:
    """Per named step (``StepStats``), the op-profile model's seconds per operation and its fitted overhead, in
    ms: where a step's time goes by the profile."""
    rows = []
    for label, stats in steps.items():
        ops = cost.op_times(stats)
        total_ops = sum(ops.values())
        for op, seconds in sorted(ops.items(), key=lambda kv: -kv[1]):
            rows.append({"step": label, "part": op, "ms": seconds * 1e3})
        rows.append({"step": label, "part": "overhead (fitted)", "ms": cost.overhead_time(stats, total_ops) * 1e3})
    return rows


def overhead_claim(overhead: Mapping[str, Any]) -> dict[str, Any]:
    """ "The isolated operations alone underestimate an engine step here": from the op profile's overhead fit,
    confirmed when the summed operations are more than 10% below the measured steps on average, not confirmed
    when they are more than 10% above, inconclusive within 10%. The evidence's ratio is the operations' sum over the
    measured step on average (1 + the mean signed relative error), its interval the mean's Student-t one over the
    busy steps (``rounds``, ``rounds_unit`` "steps"; from the fit's ``ops_only_signed_rel_error_sd``; none from a
    profile fitted before it was kept)."""
    import math

    from workbench.experiments.claims import SINGLE_RUN_TOLERANCE
    from workbench.experiments.trials import t_quantile

    fit = overhead["fit"]
    bias = fit["ops_only_mean_signed_rel_error"]
    n, sd = fit["num_steps"] - fit.get("num_idle_steps", 0), fit.get("ops_only_signed_rel_error_sd")  # busy steps
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n) if sd is not None and n >= 4 else None
    interval = "t" if half is not None else "none: a profile fitted without the errors' sd"
    ratio = {"arms": ["engine step", "operations alone"], "ratio": 1 + bias,
             "ci_low": None if half is None else 1 + bias - half, "ci_high": None if half is None else 1 + bias + half,
             "rounds": n, "rounds_unit": "steps", "margin": SINGLE_RUN_TOLERANCE,
             "confidence": 0.95 if half is not None else None,
             "direction": "lower", "interval": interval}  # fmt: skip
    evidence = {**ratio, "ops_only_mean_signed_rel_error": bias,
                "ops_only_median_rel_error": fit["ops_only_median_rel_error"],
                "with_overhead_median_rel_error": fit["median_rel_error"], "num_steps": fit["num_steps"],
                "coefficients": dict(overhead["coefficients"])}  # fmt: skip
    text = (f"over {fit['num_steps']} engine steps the summed operations are {100 * bias:+.1f}% off on average "
            f"(median |error| {100 * fit['ops_only_median_rel_error']:.1f}%); with the fitted overhead the median "
            f"|error| is {100 * fit['median_rel_error']:.1f}%")  # fmt: skip
    claim = "The operations timed alone underestimate an engine step on this machine (a per-step overhead is needed)"
    if bias < -SINGLE_RUN_TOLERANCE:
        return make_claim(claim, CONFIRMED, evidence, text)
    if bias > SINGLE_RUN_TOLERANCE:
        return make_claim(claim, NOT_CONFIRMED, evidence, text)
    return make_claim(claim, INCONCLUSIVE, evidence, text)


def published_measurements(directory: Any) -> list[dict] | None:
    """Every record of the YAML files in ``directory`` (``data/validation/``: published GPU measurements), each
    with its ``source_file``; a file is a list of records or a mapping whose list values are the records. None when
    there is no such file (the notebook then says so rather than showing anything)."""
    from pathlib import Path

    import yaml

    files = sorted(Path(directory).glob("*.yaml")) if directory is not None else []
    if not files:
        return None
    rows: list[dict] = []
    for path in files:
        data = yaml.safe_load(path.read_text())
        lists = [data] if isinstance(data, list) else [v for v in (data or {}).values() if isinstance(v, list)]
        for records in lists:
            for rec in records:
                if isinstance(rec, dict):
                    rows.append(
                        {"source_file": path.name, **{k: v for k, v in rec.items() if not isinstance(v, (dict, list))}}
                    )
    return rows


HELD_OUT_MEDIAN_TARGET = 0.15  # the bar on published GPU rows of a source the calibration never saw
HELD_OUT_MAX_TARGET = 0.30


def published_errors() -> tuple[list[dict], dict[str, dict]]:
    """The calibrated roofline against every published GPU row (``workbench.sim.published.error_table`` with each
    source's stack, as ``workbench bench gpu-costs`` prints it) and the median and largest absolute error per
    split (calibration, held_out)."""
    from workbench.sim.published import error_table, load_published, load_stack_overheads, summarize_errors

    table = error_table(load_published(), "hardware", None, load_stack_overheads())
    return table, {split: summarize_errors([r for r in table if r["split"] == split])
                   for split in ("calibration", "held_out")}  # fmt: skip


def published_leave_one_source_out(rounds: int = 2) -> tuple[list[dict], dict[str, dict]]:
    """Every published GPU row priced by a calibration fitted on the *other* sources' rows
    (``workbench.sim.published.leave_one_source_out``): the error on a source the fit never saw. Returns the table
    and ``summarize_errors`` per left-out source and over all rows (key ``all``)."""
    from workbench.sim.published import leave_one_source_out, load_published, summarize_errors

    table, overall = leave_one_source_out(load_published(), rounds=rounds)
    per_source = {src: summarize_errors([r for r in table if r["left_out"] == src])
                  for src in sorted({r["left_out"] for r in table})}  # fmt: skip
    return table, {**per_source, "all": overall}


def published_claim(summary: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """ "On published GPU measurements of a source the calibration never saw, the median absolute error is at most
    15% and no case is off by more than 30%": confirmed or not from ``published_leave_one_source_out``'s summary
    (its ``all``; per source in the evidence; analytic: no timing, no spread)."""
    overall = summary["all"]
    med, top = overall["median_abs_error"], overall["max_abs_error"]
    claim = (f"On published GPU measurements of a source the calibration never saw (each source left out of the "
             f"fit in turn), the cost model's median absolute error is at most {100 * HELD_OUT_MEDIAN_TARGET:.0f}% "
             f"and no case is off by more than {100 * HELD_OUT_MAX_TARGET:.0f}%")  # fmt: skip
    per = "; ".join(f"{src} {100 * s['median_abs_error']:.1f}% / {100 * s['max_abs_error']:.1f}%"
                    for src, s in summary.items() if src != "all")  # fmt: skip
    text = (f"{overall['n']} rows, each from a fit without its source: median |error| {100 * med:.1f}%, largest "
            f"{100 * top:.1f}% (per source, median / largest: {per})")  # fmt: skip
    ok = med <= HELD_OUT_MEDIAN_TARGET and top <= HELD_OUT_MAX_TARGET
    evidence = {k: dict(v) for k, v in summary.items()}
    evidence["no_ratio"] = ("error summaries against two fixed bars (median and largest |error|), not a comparison "
                            "of two figures")  # fmt: skip
    return make_claim(claim, CONFIRMED if ok else NOT_CONFIRMED, evidence, text, uses=("published",))


# ---- workbench fidelity: the whole check -------------------------------------------------------------------------
def fidelity_report(
    model: str = "tiny-gqa",
    kinds: Sequence[str] = ("op-profile", "profiled"),
    paths: Mapping[str, str | None] | None = None,
    num_requests: int = 40,
    rate: float = 10.0,
    policies: Sequence[str] | None = None,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    seed: int = 7,
    threads: int = 1,
    repeats: int = 3,
    disaggregate: str | None = None,
    measure_profiles: bool = False,
    measure_max_tokens: int = 1024,
    progress: bool = False,
    log: Any = None,
) -> dict[str, Any]:
    """The fidelity check of ``workbench fidelity``: each cost model of ``kinds`` (``op-profile``, ``profiled``) from
    ``paths[kind]``, else this machine's committed profile, else measured now (always with ``measure_profiles``);
    the real engine on the held-out workload under every policy, ``repeats`` times interleaved, a profile measured
    now measuring its engine workloads between those runs (``colocated_fidelity``, notebook 07's code), or the real
    disaggregated pair ``disaggregate`` "P:D" (``disaggregated_fidelity``, the profiles measured first); the
    simulator on the same, deterministic and with seeded noise; the table (``compare``), the claims
    (``fidelity_claims``), the load averages, the machine (``machine_identity``: the CPU model, its CPUs, the
    instruction set torch dispatches to) and wall times. A ``profiled`` model fitted now (colocated) keeps the steps
    it was fitted on in ``cost_models.profiled.steps`` (``workbench.sim.measure.steps_record``, ~60 bytes a step),
    which ``workbench fit-profile --from-steps FILE`` re-fits on any machine. ``log``: a callable given one line per
    profile read or measured (None: quiet)."""

    from workbench.config import parse_disaggregate
    from workbench.engine.scheduler import POLICIES
    from workbench.errors import ConfigError
    from workbench.model.checkpoint import load_model
    from workbench.sim.measure import machine_identity

    kinds = list(kinds)
    bad = [k for k in kinds if k not in ("op-profile", "profiled")]
    if bad or not kinds:
        raise ConfigError(f"cost models must be some of op-profile, profiled (--cost-model), got {kinds!r}")
    policies = list(policies or POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ConfigError(f"unknown policy {unknown!r} (--policies); expected some of {', '.join(POLICIES)}")
    for name, value in (("num_requests", num_requests), ("repeats", repeats), ("threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    set_threads(threads)  # as the profile was measured (fit-profile / profile-ops --threads, 1)
    load_start = load_average()
    t_start = now()
    held_out = held_out_workload(num_requests, rate, seed)
    out: dict[str, Any] = {"model": model, "machine": machine_identity(), "num_requests": num_requests, "rate": rate,
                           "repeats": repeats, "threads": threads, "load_average_start": load_start}  # fmt: skip
    labels = [name for kind in kinds for name in (kind, f"{kind} noise")]
    interleaved: list[str] = []
    if disaggregate:
        costs, sources = {}, {}
        for kind in kinds:
            costs[kind], sources[kind] = profile_for_this_machine(
                kind, model, (paths or {}).get(kind), max_num_seqs, max_model_len, measure_max_tokens,
                measure=measure_profiles,
            )  # fmt: skip
            _tell(log, kind, costs[kind], sources[kind])
        profile_s = now() - t_start
        split = parse_disaggregate(disaggregate)
        calibration = held_out_workload(num_requests, rate, seed + 1)
        res = disaggregated_fidelity(model, list(costs.values()), held_out, split, repeats, threads, max_num_seqs,
                                     max_model_len, seed, calibration)  # fmt: skip
        rows = res["rows"]
        out.update(disaggregate=disaggregate, link=res["link"], handoff=res["handoff"],
                   idle_step_s=res["idle_step_s"], loads=res["loads"], ttft_parts=res["ttft_parts"])  # fmt: skip
    else:
        res = colocated_fidelity(load_model(model, seed=0), model, held_out, policies, kinds, paths, repeats,
                                 max_num_seqs, max_model_len, measure_max_tokens, measure_profiles=measure_profiles,
                                 noise_seed=seed, progress=progress, log=log)  # fmt: skip
        costs, sources, rows, profile_s = res["costs"], res["sources"], res["rows"], res["profile_s"]
        interleaved = res["interleaved"]
        out["step_errors"] = res["step_errors"]
        out["loads"] = res["measured"]["loads"]
    out["cost_models"] = {k: {"source": sources[k], **c.describe(), "provenance": profile_provenance(k, c)}
                          for k, c in costs.items()}  # fmt: skip
    if not disaggregate and "fitted_steps" in res:  # the steps the profile was fitted on: re-fittable elsewhere
        out["cost_models"]["profiled"]["steps"] = res["fitted_steps"]
    out["rows"] = rows
    load = runs_load(out.get("loads", []))
    out["claims"] = fidelity_claims(rows, labels, interleaved, load)
    out["max_abs_rel_error"] = {name: max(abs(r["rel_error"]) for r in rows if r["model"] == name)
                                for name in labels}  # fmt: skip
    out["load_average_end"] = load_average()
    out["wall_s"] = {"profiles": profile_s, "total": now() - t_start}
    out["measured_runs_loaded"] = load["loaded"]
    return out


def print_report(out: Mapping[str, Any], file: Any = None) -> None:
    """The table of ``fidelity_report``'s result: one line per model, policy and statistic (BIMODAL where the
    measured repeats fall in two modes, with the modes and the error against the typical one), the TTFT parts of a
    disaggregated run, the load averages and each model's count within tolerance."""
    import os
    import sys

    def say(line: str) -> None:
        print(line, file=file or sys.stderr)

    if out.get("ttft_parts"):
        keys = ("queue", "prefill", "after", "sum_of_medians", "ttft", "handoff", "decode_wait", "wire")
        say("TTFT in parts, medians over the requests (ms; after = handoff + decode-side wait + wire):")
        parts = out["ttft_parts"]
        named = [(f"measured {i}", x) for i, x in enumerate(parts["measured"])]
        for label, x in named + [(k, v) for k, v in parts.items() if k != "measured"]:
            say(f"  {label:18s} " + "  ".join(f"{k} {x[k]:.2f}" for k in keys if x.get(k) is not None))
            p90 = x.get("p90") or {}
            say(f"  {'  p90':18s} " + "  ".join(f"{k} {p90[k]:.2f}" for k in keys if p90.get(k) is not None))
    for r in out["rows"]:
        mode = ""
        if r.get("bimodal"):
            modes = "/".join(f"{m:.0f}" for m in r["modes_ms"])
            typical = ("no typical mode (even split)" if r.get("typical_ms") is None else
                       f"vs typical {100 * r['rel_error_typical']:+.1f}%")  # fmt: skip
            mode = f"  BIMODAL (modes {modes} ms, {typical})"
        say(f"{r['model']:18s} {r['policy']:18s} {r['statistic']:11s} measured {r['measured_ms']:8.2f} ms "
            f"[{r['measured_min_ms']:.2f}..{r['measured_max_ms']:.2f}] simulated {r['simulated_ms']:8.2f} ms "
            f"{100 * r['rel_error']:+6.1f}% (spread {100 * r['spread']:.0f}%, tol {100 * r['tolerance']:.0f}%)"
            f"{'' if r['within'] else '  OUTSIDE'}{mode}")  # fmt: skip
    loads = [x for run in out.get("loads", []) for x in (run["load_before"], run["load_after"]) if x]
    if loads:
        warn = "  LOADED: other processes shared the CPUs, the errors are not the simulator's"
        say(
            f"load average (1 min) over the measured runs: {min(x[0] for x in loads):.2f}.."
            f"{max(x[0] for x in loads):.2f} on {os.cpu_count()} CPUs{warn if out['measured_runs_loaded'] else ''}"
        )
    for kind, e in (out.get("step_errors") or {}).items():
        if e["num_steps"]:
            say(f"{kind} on the measured runs' own {e['num_steps']} steps (not after an idle wait): median error "
                f"{100 * e['median']:+.1f}%, median |error| {100 * e['median_abs']:.1f}%, p90 |error| "
                f"{100 * e['p90_abs']:.1f}%, predicted/measured time {e['total_ratio']:.3f}")  # fmt: skip
    m = out.get("machine") or {}
    say(f"machine: {m.get('cpu')}, {m.get('cpu_count')} CPUs, torch dispatches to {m.get('cpu_capability')}")
    for claim in out["claims"]:
        say(f"{claim['claim']}: {claim['verdict']} ({claim['detail']})")
    say(f"wall time {out['wall_s']['total']:.0f} s (profiles {out['wall_s']['profiles']:.0f} s)")
