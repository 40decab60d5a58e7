"""Claims the experiments test, and their verdicts computed from a run's own numbers and their spread.

Each function takes measured numbers and returns one claim::

    {"claim": "Batching raises decode throughput", "verdict": "confirmed" | "not_confirmed" | "inconclusive",
     "evidence": {...the numbers...}, "detail": "a sentence with the numbers", "uses": ["timing", ...]}

Every claim that compares the engine's timings (batching, policies, chunking, weight formats) is decided by paired,
interleaved rounds (``workbench.experiments.trials``): ``paired_claim`` turns a ``Comparison`` into a claim whose
verdict is the pre-registered rule's on the B/A interval and whose ``evidence`` carries ``ratio``, ``ci_low``,
``ci_high``, ``rounds``, ``margin``, ``confidence`` and ``control`` (the A/A ratio and interval); it ``uses``
("paired",), which no sanity check flags: a paired claim is voided only by its own failed A/A control (the
harness makes it *inconclusive*), since a machine whose speed drifts slowly moves both arms of a round alike.

The other claims are analytic (no ``uses``) or rest on absolute figures: an MFU or MBU, a time quoted as the
machine's ("timing": a measured time; "ceilings": a figure divided by a measured ceiling); a verdict there is
*confirmed* when the numbers support the claim beyond their spread (min..max of the repeats), *not confirmed* when
they contradict it, *inconclusive* within the noise, and ``apply_anomalies`` turns every such claim resting on
something a sanity check flagged (a drifting reference step, a moving ceiling) into *inconclusive*, marked
unreliable, keeping what the numbers alone would have said; a claim flagged only by the machine's drift (a
reference step's or a ceiling's) whose interval, widened by the drift's factor, still gives its verdict keeps it
(``drift_bound``).

Every claim's ``evidence`` carries a ratio with its interval (``RATIO_KEYS``: ``ratio``, ``ci_low``, ``ci_high``,
``rounds``, ``margin``, ``confidence``): a paired claim its rounds'; an analytic one an exact ratio
(``exact_ratio``: a zero-width interval, ``rounds`` 0, ``confidence`` None); a claim on repeats that were not run
as rounds (the roofline claims against the ceiling readings, 08's decode and prefill speed-ups) a
``repeat_comparison``; or, where no ratio belongs to the claim (a count on a Pareto front), ``no_ratio`` saying why.

The claims are the seed's: prefill is compute-bound and sets TTFT; decode is bandwidth-bound and sets ITL;
batching raises decode throughput; continuous beats static under load; chunking removes generation stalls at a
TTFT price; fewer KV heads mean fewer bytes and more sequences; fewer bytes per weight or per cached token move
decode, not prefill (notebook 08).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CONFIRMED, NOT_CONFIRMED, INCONCLUSIVE = "confirmed", "not_confirmed", "inconclusive"
VERDICTS = (CONFIRMED, NOT_CONFIRMED, INCONCLUSIVE)
SINGLE_RUN_TOLERANCE = 0.10  # relative difference below which two single-run figures are noise


def make_claim(
    claim: str, verdict: str, evidence: Mapping[str, Any], detail: str, uses: Sequence[str] = ("timing",)
) -> dict[str, Any]:
    """One claim object (see the module docstring)."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
    return {"claim": claim, "verdict": verdict, "evidence": dict(evidence), "detail": detail, "uses": list(uses)}


def span(lo: float, mid: float, hi: float) -> tuple[float, float, float]:
    """A measured value with its spread, checked to be ordered."""
    lo, hi = min(lo, mid, hi), max(lo, mid, hi)
    return lo, mid, hi


def order(a: tuple[float, float, float], b: tuple[float, float, float]) -> int:
    """+1 when ``a`` is above ``b`` beyond both spreads, -1 when below, 0 when the spreads overlap."""
    if a[0] > b[2]:
        return 1
    if a[2] < b[0]:
        return -1
    return 0


def exact_comparison(
    name_a: str, value_a: float, name_b: str, value_b: float, direction: str, margin: float = SINGLE_RUN_TOLERANCE
) -> dict[str, Any]:
    """B against A where both are exact figures (an analytic model's, a deterministic simulation's: no sampling
    spread to average over), decided by the paired claims' rule on a zero-width interval
    (``trials.decide_exact``): ``{"arms", "a", "b", "ratio", "margin", "direction", "verdict", "reason"}``, the
    verdict *confirmed* beyond ``margin`` in ``direction`` (B ``higher`` or ``lower`` than A), else
    *not_confirmed*: ``opposite`` beyond it the other way, ``equivalent`` inside it; ``ci_low`` and ``ci_high`` are
    the ratio itself, ``rounds`` 0 and ``confidence`` None (exact). The ``margin`` defaults to 10%,
    about the simulator's held-out median error on GPUs: a smaller gap is not a finding."""
    from workbench.experiments.trials import DecisionRule, decide_exact

    verdict, reason = decide_exact(float(value_a), float(value_b), DecisionRule(direction, margin))
    ratio = float(value_b) / float(value_a) if value_a else (1.0 if not value_b else None)  # None: B > 0 against 0
    return {"arms": [name_a, name_b], "a": float(value_a), "b": float(value_b), "ratio": ratio, "ci_low": ratio,
            "ci_high": ratio, "rounds": 0, "margin": margin, "confidence": None, "direction": direction,
            "verdict": verdict, "reason": reason}  # fmt: skip


# the evidence keys of a ratio (``exact_comparison``, ``repeat_comparison``): an exact one has a zero-width
# interval, ``rounds`` 0 and ``confidence`` None (no sampling spread, nothing to be confident about)
RATIO_KEYS = ("arms", "ratio", "ci_low", "ci_high", "rounds", "margin", "confidence", "direction")


def exact_ratio(name_a: str, value_a: float, name_b: str, value_b: float, direction: str,
                margin: float = SINGLE_RUN_TOLERANCE) -> dict[str, Any]:  # fmt: skip
    """The ``RATIO_KEYS`` of an ``exact_comparison``: the ratio an analytic claim (decided by its own rule on exact
    figures: bytes, counts, a deterministic model) carries in its evidence."""
    c = exact_comparison(name_a, value_a, name_b, value_b, direction, margin)
    return {k: c[k] for k in RATIO_KEYS}


def exact_text(comparison: Mapping[str, Any]) -> str:
    """'1.07x, within the 10% margin (equivalent)': an ``exact_comparison``'s ratio and what decided it."""
    m = _pct(comparison["margin"])
    r = comparison["ratio"]
    r = f"{r:.3g}x" if r is not None else f"{comparison['b']:.3g} against 0"
    if comparison["verdict"] == CONFIRMED:
        return f"{r}, beyond the {m} margin"
    if comparison["reason"] == "equivalent":
        return f"{r}, within the {m} margin (equivalent)"
    return f"{r}, beyond the {m} margin the other way (opposite)"


def _fmt_span(s: tuple[float, float, float], scale: float = 1.0, fmt: str = ".1f") -> str:
    return f"{s[1] * scale:{fmt}} ({s[0] * scale:{fmt}}-{s[2] * scale:{fmt}})"


def _row_span(row: Mapping[str, Any], key: str = "time_s") -> tuple[float, float, float]:
    base = key.removesuffix("_s")
    if key == "tokens_per_s":
        return span(row.get("tokens_per_s_min", row[key]), row[key], row.get("tokens_per_s_max", row[key]))
    return span(row.get(f"{base}_min_s", row[key]), row[key], row.get(f"{base}_max_s", row[key]))


# ---------------------------------------------------------------- paired claims (trials)

PAIRED = "paired"  # the ``uses`` of a claim decided by paired rounds: no hygiene anomaly voids it


def _pct(x: float) -> str:
    return f"{x:.0%}"


def paired_claim(claim: str, comparison: Any, what: str, **evidence: Any) -> dict[str, Any]:
    """A claim decided by the paired rounds of ``comparison`` (a ``trials.Comparison``): its verdict, its
    ``evidence()`` (plus ``evidence``), and a detail sentence: ``what`` was compared, then B/A with its interval,
    the rounds, the margin and the A/A control."""
    ev = {**comparison.evidence(), **evidence}
    control = comparison.control
    aa = "no A/A control" if control is None else (
        f"A/A {control['ratio']:.3g} [{control['ci_low']:.3g}, {control['ci_high']:.3g}]"
        + ("" if not control["failed"] else " (failed: the rounds were not comparable)"
           if comparison.verdict == INCONCLUSIVE else f" (failed, by up to {_pct(control['deviation'])}: the "
           "effect clears the margin plus that deviation)")
    )  # fmt: skip
    rule = comparison.rule
    detail = (
        f"{what}: {comparison.summary()} ({rule.confidence:.0%} interval; claimed {rule.direction} by more than "
        f"{_pct(rule.margin)}; {aa})"
    )
    if comparison.verdict == NOT_CONFIRMED:
        detail += {"opposite": "; the interval lies beyond the margin the other way",
                   "equivalent": "; the interval lies inside the margin: no effect as large as claimed",
                   "short of the margin": "; the interval excludes an effect as large as claimed"}.get(
            comparison.reason, "")  # fmt: skip
    elif comparison.verdict == INCONCLUSIVE:
        detail += "; " + (
            "the A/A control failed" if comparison.reason.startswith("control_failed")
            else "the interval straddles the margin: more rounds (a larger max_rounds or budget) would decide it"
        )  # fmt: skip
    return make_claim(claim, comparison.verdict, ev, detail, (PAIRED,))


def _brief(comparison: Any) -> dict[str, Any]:
    """The numbers of a comparison without its per-round values (for a claim resting on several)."""
    ev = comparison.evidence()
    ev.pop("values")
    return {**ev, "verdict": comparison.verdict}


def same_rule(comparison: Any, direction: str) -> Any:
    """``comparison``'s rule (margin, confidence) with another ``direction``: for a figure read from the same
    rounds."""
    from dataclasses import replace

    return replace(comparison.rule, direction=direction)


def ratio_text(comparison: Any) -> str:
    """'5.9x [5.2, 6.6]': B/A with its interval, for a claims table."""
    return f"{comparison.ratio:.3g}x [{comparison.ci_low:.3g}, {comparison.ci_high:.3g}]"


# ---------------------------------------------------------------- notebook 01: the two phases


def repeat_comparison(
    name_a: str, values_a: Sequence[float], name_b: str, values_b: Sequence[float], direction: str,
    margin: float = SINGLE_RUN_TOLERANCE, confidence: float = 0.95,
) -> dict[str, Any]:  # fmt: skip
    """B against A from paired repeats that were not run as a ``trials.Rounds`` comparison (interleaved repeats of a
    sweep, the ceiling probe's readings at the start and the end): ``{"arms", "ratio", "ci_low", "ci_high", "rounds",
    "margin", "confidence", "direction", "interval", "verdict", "reason"}``, decided by the paired claims' rule on
    the log-ratio interval (``trials.decide``). From ``trials.MIN_ROUNDS`` pairs on, the interval is the paired
    rounds' Student-t one (``trials.compare``, at ``confidence``); with fewer (a t interval on under 3 degrees of
    freedom is not taken) it is the pairs' own min..max, ``confidence`` None and ``interval`` "min..max". ``ratio``
    is the geometric mean of the pairs' B/A either way."""
    import math
    import statistics

    from workbench.experiments.trials import MIN_ROUNDS, DecisionRule, compare, decide

    if not values_a or len(values_a) != len(values_b):
        raise ValueError(f"repeat_comparison needs as many A as B values (>= 1), got {len(values_a)}, {len(values_b)}")
    rule = DecisionRule(direction, margin, confidence)
    if len(values_a) >= MIN_ROUNDS:
        ratio, low, high, verdict, reason = compare(values_a, values_b, rule)
        interval, conf = "t", confidence
    else:
        if any(v <= 0 for v in (*values_a, *values_b)):
            raise ValueError("repeat_comparison: values must be positive (times, rates) for a log-ratio")
        logs = [math.log(b / a) for a, b in zip(values_a, values_b)]
        verdict, reason = decide(min(logs), max(logs), rule)
        ratio, low, high = (math.exp(x) for x in (statistics.fmean(logs), min(logs), max(logs)))
        interval, conf = "min..max", None
    return {"arms": [name_a, name_b], "ratio": ratio, "ci_low": low, "ci_high": high, "rounds": len(values_a),
            "margin": margin, "confidence": conf, "direction": direction, "interval": interval, "verdict": verdict,
            "reason": reason}  # fmt: skip


def interval_text(evidence: Mapping[str, Any], unit: str | None = None) -> str:
    """'28.6x [25.1, 32.4] (95%, 4 pairs)': the ratio of a ``repeat_comparison`` (or any evidence with ``ratio``,
    ``ci_low``, ``ci_high``) with its interval and what the interval is: a t interval at its ``confidence`` over
    ``rounds``, the ``rounds``' own min..max (``interval`` "min..max"), or exact (``rounds`` 0). ``unit`` (plural)
    names what ``rounds`` counts: given, else the evidence's ``rounds_unit`` ("repeats" for a fidelity claim's
    measured repeats, "steps" for engine steps), else "pairs" (a ``repeat_comparison``'s pairs of repeats); a claim
    decided by paired rounds passes "rounds"."""
    if evidence.get("ratio") is None:
        return "no ratio"
    text = f"{evidence['ratio']:.3g}x"
    if evidence.get("ci_low") is not None and evidence.get("ci_high") is not None:
        text += f" [{evidence['ci_low']:.3g}, {evidence['ci_high']:.3g}]"
    rounds = evidence.get("rounds")
    unit = unit or evidence.get("rounds_unit") or "pairs"
    counted = f"{rounds} {unit.removesuffix('s') if rounds == 1 else unit}"
    if evidence.get("interval") == "min..max":
        text += f" (min..max of {counted})" if rounds else " (min..max)"
    elif evidence.get("confidence") is not None and rounds:
        text += f" ({evidence['confidence']:.0%}, {counted})"
    elif rounds == 0:
        text += " (exact)"
    return text


def _against_ceilings(intensity: float, balance_point: float, balance_points: Sequence[float], direction: str,
                      margin: float) -> dict[str, Any]:  # fmt: skip
    """A step's arithmetic intensity over the balance point, the interval from the ceiling probe's readings (each
    reading's peak / bandwidth: ``hygiene.balance_points``), or from the one ``balance_point`` when none."""
    readings = [float(b) for b in balance_points] or [float(balance_point)]
    return repeat_comparison("balance point", readings, "intensity", [float(intensity)] * len(readings), direction,
                             margin)  # fmt: skip


def _with_side(comparison: Mapping[str, Any], side: bool) -> str:
    """A roofline claim's verdict: the intensity's side of the balance point (``comparison``) and the utilisation's
    (``side``: MFU above MBU for prefill, MBU above MFU for decode) must both agree."""
    if comparison["verdict"] == NOT_CONFIRMED or not side:
        return NOT_CONFIRMED
    return comparison["verdict"]


def prefill_compute_bound(
    prefill_rows: Sequence[Mapping[str, Any]], balance_point: float, balance_points: Sequence[float] = (),
    margin: float = SINGLE_RUN_TOLERANCE,
) -> dict[str, Any]:  # fmt: skip
    """Prefill is compute-bound: the longest prompt's step runs above the balance point, MFU above MBU (absolute
    figures: voided by a flagged ceiling or drift). The ratio is the step's intensity over the balance point, its
    interval from the ceiling probe's readings (``balance_points``, start and end: ``hygiene.balance_points``),
    decided higher by more than ``margin`` by the paired claims' rule (``repeat_comparison``)."""
    long = max(prefill_rows, key=lambda r: r["prompt_len"])
    cmp = _against_ceilings(long["intensity"], balance_point, balance_points, "higher", margin)
    compute_side = long["mfu"] > long["mbu"]
    evidence = {
        **{k: v for k, v in cmp.items() if k != "verdict"},
        "prompt_len": long["prompt_len"],
        "intensity": long["intensity"],
        "balance_point": balance_point,
        "mfu": long["mfu"],
        "mbu": long["mbu"],
    }
    text = (
        f"a {long['prompt_len']}-token prefill ran at {long['intensity']:.1f} FLOP/byte against a balance point of "
        f"{balance_point:.1f} ({interval_text(cmp)} of the ceiling readings' balance points, claimed higher by more "
        f"than {_pct(margin)}), MFU {long['mfu']:.2f} against MBU {long['mbu']:.2f}"
    )
    return make_claim("Prefill is compute-bound", _with_side(cmp, compute_side), evidence, text, ("timing", "ceilings"))


def prefill_sets_ttft(comparison: Any, short_len: int, long_len: int) -> dict[str, Any]:
    """Prefill sets TTFT: prefilling a ``long_len``-token prompt takes longer than a ``short_len``-token one, by
    more than the rule's margin (paired rounds of the two prefills: B = the long prompt)."""
    what = f"prefill of {long_len} against {short_len} tokens (time to the first token, per round a fresh prompt)"
    return paired_claim("Prefill sets TTFT: a longer prompt waits longer for its first token", comparison, what,
                        short_len=short_len, long_len=long_len)  # fmt: skip


def decode_bandwidth_bound(
    decode_rows: Sequence[Mapping[str, Any]], balance_point: float, balance_points: Sequence[float] = (),
    margin: float = SINGLE_RUN_TOLERANCE,
) -> dict[str, Any]:  # fmt: skip
    """Decode is memory-bandwidth-bound (batch 1: intensity below the balance point, MBU above MFU) and sets ITL.
    The ratio is the highest batch-1 intensity over the balance point, its interval from the ceiling probe's
    readings (``balance_points``), decided lower by more than ``margin`` (``repeat_comparison``)."""
    b1 = sorted((r for r in decode_rows if r["batch"] == 1), key=lambda r: r["context_len"])
    if not b1:
        b1 = sorted(decode_rows, key=lambda r: (r["batch"], r["context_len"]))[:1]
    worst = max(b1, key=lambda r: r["intensity"])
    cmp = _against_ceilings(worst["intensity"], balance_point, balance_points, "lower", margin)
    bytes_side = all(r["mbu"] > r["mfu"] for r in b1)
    t = _row_span(b1[0])
    evidence = {
        **{k: v for k, v in cmp.items() if k != "verdict"},
        "batch": b1[0]["batch"],
        "max_intensity": worst["intensity"],
        "balance_point": balance_point,
        "mbu": [r["mbu"] for r in b1],
        "mfu": [r["mfu"] for r in b1],
        "itl_ms": t[1] * 1e3,
    }
    mbus = ", ".join(f"{r['mbu']:.2f}" for r in b1)
    mfus = ", ".join(f"{r['mfu']:.3f}" for r in b1)
    text = (
        f"batch-{b1[0]['batch']} decode steps ran at up to {worst['intensity']:.2f} FLOP/byte against a balance point "
        f"of {balance_point:.1f} ({interval_text(cmp)} of the ceiling readings' balance points, claimed lower by more "
        f"than {_pct(margin)}), MBU {mbus} against MFU {mfus}; a step (the ITL) took {_fmt_span(t, 1e3)} ms"
    )
    verdict = _with_side(cmp, bytes_side)
    return make_claim("Decode is memory-bandwidth-bound and sets ITL", verdict, evidence, text, ("timing", "ceilings"))


def batching_raises_throughput(comparison: Any, context_len: int, batch_small: int, batch_large: int) -> dict:
    """Batching raises decode throughput: decode tokens/s at ``batch_large`` against ``batch_small`` at the same
    context length, from paired rounds (B = the larger batch)."""
    what = f"decode tokens/s at context {context_len}, batch {batch_large} against batch {batch_small}"
    return paired_claim("Batching raises decode throughput", comparison, what, context_len=context_len,
                        batch_small=batch_small, batch_large=batch_large)  # fmt: skip


# ---------------------------------------------------------------- notebook 02: KV layouts


def fewer_kv_heads_fewer_bytes(variants: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """Fewer KV heads mean fewer KV bytes per token and more sequences that fit (analytical: from the shapes).

    ``variants`` maps a label to ``{"num_kv_heads", "bytes_per_token", "max_seqs"}``.
    """
    rows = sorted(variants.items(), key=lambda kv: -kv[1]["num_kv_heads"])
    bytes_down = all(b[1]["bytes_per_token"] < a[1]["bytes_per_token"] for a, b in zip(rows, rows[1:]))
    seqs_up = all(b[1]["max_seqs"] >= a[1]["max_seqs"] for a, b in zip(rows, rows[1:]))
    strictly = rows[-1][1]["max_seqs"] > rows[0][1]["max_seqs"]
    text = "; ".join(
        f"{k} ({v['num_kv_heads']:g} KV heads): {v['bytes_per_token'] / 1024:g} KiB/token, {v['max_seqs']:g} sequences"
        for k, v in rows
    )
    verdict = CONFIRMED if bytes_down and seqs_up and strictly else NOT_CONFIRMED
    (most, a), (fewest, b) = rows[0], rows[-1]
    ratio = exact_ratio(most, a["bytes_per_token"], fewest, b["bytes_per_token"], "lower")  # bytes per token
    return make_claim(
        "Fewer KV heads mean fewer bytes per token and more sequences that fit",
        verdict,
        {**ratio, **{k: dict(v) for k, v in rows}},
        text,
        (),
    )


def fewer_kv_heads_faster_decode(comparison: Any, context_len: int, batch: int) -> dict[str, Any]:
    """Fewer KV heads make a decode step faster: decode tokens/s of the variant with the fewest KV heads against the
    one with the most, ``batch`` sequences at ``context_len``, from paired rounds (``phases.kv_heads_trial``; B = the
    fewest heads)."""
    most, fewest = comparison.arms
    what = f"decode tokens/s of {batch} sequences at context {context_len}, {fewest} against {most}"
    return paired_claim("Fewer KV heads make a decode step faster", comparison, what, context_len=context_len,
                        batch=batch)  # fmt: skip


def paging_wastes_less(contiguous_waste: float, paged_waste: float, block_size: int) -> dict[str, Any]:
    """Paged blocks waste less reserved KV memory than contiguous ``max_model_len`` slots (exact, from lengths)."""
    text = f"contiguous slots leave {contiguous_waste:.1%} of the reserved memory empty, {block_size}-token blocks " + (
        f"{paged_waste:.1%}"
    )
    verdict = CONFIRMED if paged_waste < contiguous_waste else NOT_CONFIRMED
    evidence = {**exact_ratio("contiguous", contiguous_waste, "paged", paged_waste, "lower"),
                "contiguous_waste": contiguous_waste, "paged_waste": paged_waste, "block_size": block_size}  # fmt: skip
    return make_claim("Paged blocks waste less KV memory than contiguous slots", verdict, evidence, text, ())


# ---------------------------------------------------------------- notebook 03: batching policies


def continuous_beats_static(comparison: Any, workload: str) -> dict[str, Any]:
    """Continuous batching beats static on ``workload``: a lower p99 TTFT beyond the rule's margin, from paired
    rounds (each round the same slice of requests with fresh arrivals, both policies; B = continuous). The
    rounds' output throughput is in the evidence (``throughput``) and the detail."""
    thr = comparison.on("output_throughput", same_rule(comparison, "higher"))
    what = f"p99 TTFT on {workload}, continuous against static"
    claim = paired_claim(f"Continuous batching beats static under load ({workload})", comparison, what,
                         workload=workload, throughput=_brief(thr))  # fmt: skip
    claim["detail"] += f"; output tokens/s continuous/static {ratio_text(thr)}"
    return claim


# ---------------------------------------------------------------- notebook 04: chunked prefill


def chunking_removes_stalls(comparison: Any) -> dict[str, Any]:
    """Chunked prefill removes generation stalls: the worst decode ITL while a long prompt prefills is lower with
    chunking than with the whole prompt in one step (paired rounds of the scenario: B = chunked)."""
    what = "worst decode ITL while the long prompt prefilled, chunked against one-step prefill"
    return paired_claim("Chunked prefill removes generation stalls", comparison, what)


def chunking_costs_ttft(comparison: Any) -> dict[str, Any]:
    """Chunking has a TTFT price: the long prompt's TTFT is higher when its prefill is spread over steps (the same
    rounds as ``chunking_removes_stalls``, decided on the long prompt's TTFT: B = chunked)."""
    what = "the long prompt's TTFT, chunked against one-step prefill"
    return paired_claim("Chunked prefill raises the long prompt's TTFT (its price)", comparison, what)


def chunking_lowers_tail_itl(comparison: Any) -> dict[str, Any]:
    """On a mixed workload, chunked prefill gives a lower p99 ITL than prefill-first scheduling (paired rounds of
    the workload with fresh arrivals each round: B = chunked)."""
    what = "p99 ITL of the mixed workload, chunked against prefill-first (continuous)"
    return paired_claim("Chunked prefill lowers the p99 ITL of a mixed workload", comparison, what)


# ---------------------------------------------------------------- anomalies and text


# ---------------------------------------------------------------- notebook 08: decode levers


def _tps_span(row: Mapping[str, Any]) -> tuple[float, float, float]:
    return span(row.get("tokens_per_s_min", row["tokens_per_s"]), row["tokens_per_s"],
                row.get("tokens_per_s_max", row["tokens_per_s"]))  # fmt: skip


def fewer_weight_bytes_faster_decode(comparisons: Sequence[Any]) -> dict[str, Any]:
    """Fewer bytes per weight raise batch-1 decode tokens/s: for each scheme and the next one with fewer bytes per
    step (in that order), paired rounds of their decode steps (B = fewer bytes). Confirmed when every step down in
    bytes is confirmed faster; not confirmed when one is not (its reason: opposite, equivalent or short of the
    margin); else inconclusive. The evidence's top-level ratio is the first step's; ``pairs`` holds every step's."""
    if not comparisons:
        raise ValueError("fewer_weight_bytes_faster_decode needs at least one paired comparison")
    return _every_pair_claim(
        "Fewer bytes per weight make decode faster",
        comparisons,
        "batch-1 decode tokens/s",
        "batch-1 decode tokens/s, each scheme against the next with more bytes per weight: ",
    )


def _every_pair_claim(
    title: str, comparisons: Sequence[Any], metric: str, lead: str, also: str = CONFIRMED, **evidence: Any
) -> dict[str, Any]:
    """A claim that holds when every paired comparison (and ``also``, a further verdict) is confirmed: not confirmed
    when one is not, else inconclusive; the detail lists each comparison after ``lead``."""
    verdicts = [c.verdict for c in comparisons] + [also]
    if all(v == CONFIRMED for v in verdicts):
        verdict = CONFIRMED
    elif any(v == NOT_CONFIRMED for v in verdicts):
        verdict = NOT_CONFIRMED
    else:
        verdict = INCONCLUSIVE
    first = comparisons[0]
    claim = paired_claim(title, first, metric, pairs=[_brief(c) for c in comparisons], **evidence)
    claim["verdict"] = verdict
    claim["detail"] = (
        lead
        + "; ".join(
            f"{c.summary()} ({VERDICT_TEXT[c.verdict]}{', ' + c.reason if c.verdict == NOT_CONFIRMED else ''})"
            for c in comparisons
        )
        + f" (margin {_pct(first.rule.margin)}, {first.rule.confidence:.0%} intervals)"
    )
    return claim


def fewer_kv_bytes_faster_long_decode(
    comparisons: Sequence[Any], capacity: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """At a long context, a quantized KV cache raises decode tokens/s and more sequences fit in the same KV budget.

    ``comparisons``: paired rounds (``levers.kv_trials``) of each quantized KV dtype (B) against the cache in the
    activation dtype (A), tokens/s, claimed higher; ``capacity``: ``levers.kv_capacity`` rows, the unquantized cache
    first. Confirmed when every quantized cache is confirmed faster and fits more sequences; not confirmed when one
    is not confirmed faster (its reason: opposite, equivalent or short of the margin) or fits no more; else
    inconclusive. The evidence's top-level ratio is the first comparison's; ``pairs`` holds every one,
    ``sequences_that_fit`` the capacity per KV dtype."""
    if not comparisons:
        raise ValueError("fewer_kv_bytes_faster_long_decode needs at least one paired comparison")
    fits = {c["kv_cache_dtype"]: c["sequences_that_fit"] for c in capacity}
    base_kv = capacity[0]["kv_cache_dtype"]
    more = all(fits[c["kv_cache_dtype"]] > fits[base_kv] for c in capacity[1:])
    claim = _every_pair_claim(
        "A quantized KV cache makes long-context decode faster and fits more sequences", comparisons,
        "long-context decode tokens/s", "long-context decode tokens/s, each quantized KV cache against the unquantized "
        "one: ", also=CONFIRMED if more else NOT_CONFIRMED, sequences_that_fit=fits,
    )  # fmt: skip
    claim["detail"] += "; sequences that fit: " + ", ".join(f"KV {k} {v}" for k, v in fits.items())
    return claim


def fewer_bytes_move_decode_not_prefill(
    decode_rows: Sequence[Mapping[str, Any]], prefill_rows: Sequence[Mapping[str, Any]],
    tolerance: float = SINGLE_RUN_TOLERANCE,
) -> dict[str, Any]:  # fmt: skip
    """The seed's contrast: the scheme that speeds batch-1 decode most does not speed prefill the same way.

    Both lists are per scheme, the unquantized first, with ``speedup`` over it and ``times_s``, the interleaved
    steps (decode) or repeats (prefill) in order, each paired across schemes (``levers.decode_schemes``,
    ``levers.prefill_schemes``). Each phase's speed-up of that scheme over the first is a ``repeat_comparison`` of
    those pairs (rate = 1 / time, claimed higher by more than ``tolerance``): the evidence's top-level ratio and
    interval are decode's, ``prefill`` holds prefill's. Confirmed when decode's is confirmed and prefill's is not
    (its interval excludes a gain beyond the margin); not confirmed when decode's is not confirmed or prefill's is
    (prefill gains too); else inconclusive."""
    pre = {r["scheme"]: r for r in prefill_rows}
    best = max((r for r in decode_rows[1:] if r["scheme"] in pre), key=lambda r: r["speedup"])
    base = decode_rows[0]
    p, b0 = pre[best["scheme"]], pre[base["scheme"]]

    def rates(row: Mapping[str, Any]) -> list[float]:
        return [1.0 / t for t in row.get("times_s") or [row["time_s"]]]

    def phase(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
        ra, rb = rates(a), rates(b)
        n = min(len(ra), len(rb))
        return repeat_comparison(a["scheme"], ra[:n], b["scheme"], rb[:n], "higher", tolerance)

    dec, pf = phase(base, best), phase(b0, p)
    t_p, t_0 = _row_span(p), _row_span(b0)
    text = (
        f"{best['scheme']} against {base['scheme']}: decode {interval_text(dec)} the tokens/s "
        f"({best['bytes_ratio']:.2f}x fewer bytes per step); prefill of {p['prompt_len']} tokens "
        f"{_fmt_span(t_p, 1e3)} ms against {_fmt_span(t_0, 1e3)} ms ({interval_text(pf)} the speed; claimed: decode "
        f"higher by more than {_pct(tolerance)}, prefill not)"
    )
    if dec["verdict"] == CONFIRMED and pf["verdict"] == NOT_CONFIRMED:
        verdict = CONFIRMED
    elif dec["verdict"] == NOT_CONFIRMED or pf["verdict"] == CONFIRMED:
        verdict = NOT_CONFIRMED
    else:
        verdict = INCONCLUSIVE
    evidence = {
        **{k: v for k, v in dec.items() if k != "verdict"},
        "decode_verdict": dec["verdict"],
        "prefill": pf,
        "scheme": best["scheme"],
        "decode_speedup": best["speedup"],
        "prefill_speedup": p["speedup"],
    }
    return make_claim("Fewer bytes move decode, not prefill", verdict, evidence, text, ("timing",))


def int4_costs_more_accuracy(accuracy: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """int4 weights move the logits more than int8 (higher KL against the unquantized model, no better top-1
    agreement). ``accuracy``: ``levers.accuracy_schemes`` rows with ``scheme`` labels 'int8' and 'int4-g*'."""
    i8 = next(a for a in accuracy if a["scheme"] == "int8")
    i4 = next(a for a in accuracy if a["scheme"].startswith("int4") and " " not in a["scheme"])
    text = (
        f"int8: KL {i8['kl']:.2e} nats, top-1 agreement {i8['top1_agreement']:.1%}; {i4['scheme']}: KL {i4['kl']:.2e}, "
        f"top-1 agreement {i4['top1_agreement']:.1%} (random weights: see the notebook)"
    )
    verdict = CONFIRMED if i4["kl"] > i8["kl"] and i4["top1_agreement"] <= i8["top1_agreement"] else NOT_CONFIRMED
    evidence = {**exact_ratio("int8", i8["kl"], i4["scheme"], i4["kl"], "higher"),  # KL divergence, deterministic
                **{a["scheme"]: {"kl": a["kl"], "top1_agreement": a["top1_agreement"]} for a in (i8, i4)}}  # fmt: skip
    return make_claim("int4 weights cost more accuracy than int8", verdict, evidence, text, ())


DRIFT_CHECKS = ("reference_drift", "ceiling_moved")  # the anomalies that say the machine moved (drift_bound)


def drift_bound(claim: Mapping[str, Any], anomalies: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A claim's interval widened by the machine's own drift, and the verdict of the claim's rule on it; None
    unless every one of ``anomalies`` is a drift of the machine (``DRIFT_CHECKS``: a reference step's,
    ``hygiene.check_drift``, or a ceiling's, ``hygiene.check_ceilings``; ``value``, the relative change from start
    to end) and the claim has a ratio interval with a direction.

    Two times measured at different moments (operations timed before the runs, a pair run after the profiles) can
    be biased by as much as the machine's speed moved between them: by the factor ``1 + value`` for a step that got
    slower, ``1 / (1 + value)`` for one that got faster, the largest over ``anomalies``. A figure divided by a
    ceiling (a balance point: peak / bandwidth) moves by at most the factor its ceilings moved by, ``1 + value``
    (a ceiling is flagged only when its end reading is higher). Dividing the interval's low end and multiplying its
    high end by that factor bounds what the drift could have done, as far as the reference steps and the ceiling
    probes at the start and the end see it. ``{"factor", "ci_low", "ci_high", "verdict", "reason"}``."""
    import math

    from workbench.experiments.trials import DIRECTIONS, DecisionRule, decide

    evidence = claim.get("evidence") or {}
    low, high, margin = (evidence.get(k) for k in ("ci_low", "ci_high", "margin"))
    if not anomalies or evidence.get("direction") not in DIRECTIONS:
        return None
    if not all(isinstance(x, (int, float)) and x > 0 for x in (low, high, margin)) or margin >= 1:
        return None
    values = [a.get("value") for a in anomalies]
    if any(a.get("check") not in DRIFT_CHECKS for a in anomalies) or not all(
        isinstance(v, (int, float)) and v > -1 for v in values
    ):
        return None
    factor = max(1 + v if v >= 0 else 1 / (1 + v) for v in values)
    low, high = low / factor, high * factor
    verdict, reason = decide(math.log(low), math.log(high), DecisionRule(evidence["direction"], margin))
    return {"factor": factor, "ci_low": low, "ci_high": high, "verdict": verdict, "reason": reason}


def apply_anomalies(claims: Sequence[Mapping[str, Any]], anomalies: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Claims with every one that rests on a flagged quantity turned *inconclusive* and marked ``unreliable``,
    unless the flag is the machine's drift alone and the claim's verdict survives it (``drift_bound``).

    The verdict the numbers alone gave stays in ``verdict_from_numbers``; ``unreliable_because`` lists the
    anomalies' messages. A paired claim (``uses`` ("paired",)) is never touched: its own A/A control decides
    whether its rounds were comparable. A claim flagged only by the machine's drift (a reference step or a ceiling
    that moved) whose interval, widened by that drift, still gives its decided verdict keeps it: the evidence's
    ``drift_bound`` holds the widened interval and ``held_despite`` the anomalies' messages (an effect larger than
    anything the drift could make).
    """
    out = []
    for c in claims:
        c = dict(c)
        uses = [u for u in c.get("uses", ()) if u != PAIRED]
        flagged = [a for a in anomalies if a.get("affects") in uses]
        if not flagged:
            out.append(c)
            continue
        hits = [a["message"] for a in flagged]
        bound = drift_bound(c, flagged) if c["verdict"] != INCONCLUSIVE else None
        if bound is not None and bound["verdict"] == c["verdict"]:
            c["evidence"] = {**c.get("evidence", {}), "drift_bound": bound}
            c["held_despite"] = hits
            c["detail"] = (
                f"{c.get('detail', '')}; holds with its interval widened by the machine's drift "
                f"(x{bound['factor']:.2f}: [{bound['ci_low']:.3g}, {bound['ci_high']:.3g}])"
            )
        else:
            c["verdict_from_numbers"] = c["verdict"]
            c["verdict"] = INCONCLUSIVE
            c["unreliable"] = True
            c["unreliable_because"] = hits
        out.append(c)
    return out


VERDICT_TEXT = {CONFIRMED: "confirmed", NOT_CONFIRMED: "not confirmed", INCONCLUSIVE: "inconclusive"}


def claims_markdown(claims: Sequence[Mapping[str, Any]], anomalies: Sequence[Mapping[str, Any]] = ()) -> str:
    """The conclusion of a notebook: the anomalies first (the run is unreliable where they say), then each claim
    with its verdict, its ratio with the interval (``interval_text``; a claim with no ratio says why: its evidence's
    ``no_ratio``) and the numbers behind it."""
    lines = []
    if anomalies:
        lines.append(f"**Unreliable results**: the sanity checks flagged {len(anomalies)} problem(s):")
        lines += [f"  - {a['message']}" for a in anomalies]
        lines.append("")
    for c in claims:
        verdict = VERDICT_TEXT[c["verdict"]]
        ev = c.get("evidence", {})
        if ev.get("ratio") is not None:
            verdict += f" · {interval_text(ev, 'rounds' if PAIRED in c.get('uses', ()) else None)}"
        elif ev.get("no_ratio"):
            verdict += f" · no ratio: {ev['no_ratio']}"
        if c.get("unreliable"):
            verdict += f" (unreliable; the numbers alone say {VERDICT_TEXT[c['verdict_from_numbers']]})"
        lines.append(f"- **{verdict}**: {c['claim']}. {c['detail'][:1].upper()}{c['detail'][1:]}.")
    return "\n".join(lines)


__all__ = [
    "VERDICTS",
    "PAIRED",
    "make_claim",
    "paired_claim",
    "ratio_text",
    "same_rule",
    "prefill_sets_ttft",
    "order",
    "exact_comparison",
    "exact_text",
    "exact_ratio",
    "RATIO_KEYS",
    "repeat_comparison",
    "interval_text",
    "prefill_compute_bound",
    "decode_bandwidth_bound",
    "batching_raises_throughput",
    "fewer_kv_heads_fewer_bytes",
    "fewer_kv_heads_faster_decode",
    "paging_wastes_less",
    "continuous_beats_static",
    "chunking_removes_stalls",
    "chunking_costs_ttft",
    "chunking_lowers_tail_itl",
    "fewer_weight_bytes_faster_decode",
    "fewer_kv_bytes_faster_long_decode",
    "fewer_bytes_move_decode_not_prefill",
    "int4_costs_more_accuracy",
    "drift_bound",
    "apply_anomalies",
    "claims_markdown",
]
