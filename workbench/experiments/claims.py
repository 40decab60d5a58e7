"""Claims the experiments test, and their verdicts computed from a run's own numbers and their spread.

Each function takes measured numbers and returns one claim::

    {"claim": "Batching raises decode throughput", "verdict": "confirmed" | "not_confirmed" | "inconclusive",
     "evidence": {...the numbers...}, "detail": "a sentence with the numbers", "uses": ["timing", ...]}

A verdict is *confirmed* when the numbers support the claim beyond their spread (min..max of the repeats) or, for
single runs, beyond a stated relative tolerance; *not confirmed* when they contradict it beyond the same margin
(the detail says with which numbers); *inconclusive* when the difference is within the noise. ``uses`` names what
the claim rests on ("timing": measured times; "ceilings": figures divided by a measured ceiling; "batching": the
batch sweep); ``apply_anomalies`` turns every claim resting on something a sanity check flagged into
*inconclusive* and marks it unreliable, keeping what the numbers alone would have said.

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


def order_single(a: float, b: float, tolerance: float = SINGLE_RUN_TOLERANCE) -> int:
    """+1 when ``a`` exceeds ``b`` by more than ``tolerance`` (relative), -1 when below by more, else 0."""
    if a > b * (1 + tolerance):
        return 1
    if a < b * (1 - tolerance):
        return -1
    return 0


def _fmt_span(s: tuple[float, float, float], scale: float = 1.0, fmt: str = ".1f") -> str:
    return f"{s[1] * scale:{fmt}} ({s[0] * scale:{fmt}}-{s[2] * scale:{fmt}})"


def _row_span(row: Mapping[str, Any], key: str = "time_s") -> tuple[float, float, float]:
    base = key.removesuffix("_s")
    if key == "tokens_per_s":
        return span(row.get("tokens_per_s_min", row[key]), row[key], row.get("tokens_per_s_max", row[key]))
    return span(row.get(f"{base}_min_s", row[key]), row[key], row.get(f"{base}_max_s", row[key]))


# ---------------------------------------------------------------- notebook 01: the two phases


def prefill_compute_bound(prefill_rows: Sequence[Mapping[str, Any]], balance_point: float) -> dict[str, Any]:
    """Prefill is compute-bound (intensity above the balance point, MFU above MBU) and sets TTFT (it grows with the
    prompt beyond the spread)."""
    rows = sorted(prefill_rows, key=lambda r: r["prompt_len"])
    short, long = rows[0], rows[-1]
    ts, tl = _row_span(short), _row_span(long)
    grows = order(tl, ts) if len(rows) > 1 else 0
    above = long["intensity"] > balance_point
    compute_side = long["mfu"] > long["mbu"]
    evidence = {
        "prompt_len": long["prompt_len"],
        "intensity": long["intensity"],
        "balance_point": balance_point,
        "mfu": long["mfu"],
        "mbu": long["mbu"],
        "ttft_ms_shortest": ts[1] * 1e3,
        "ttft_ms_longest": tl[1] * 1e3,
    }
    text = (
        f"a {long['prompt_len']}-token prefill ran at {long['intensity']:.1f} FLOP/byte against a balance point of "
        f"{balance_point:.1f}, MFU {long['mfu']:.2f} against MBU {long['mbu']:.2f}; TTFT went from "
        f"{_fmt_span(ts, 1e3)} ms at {short['prompt_len']} tokens to {_fmt_span(tl, 1e3)} ms at {long['prompt_len']}"
    )
    if not above or not compute_side or grows < 0:
        verdict = NOT_CONFIRMED
    elif grows > 0:
        verdict = CONFIRMED
    else:
        verdict = INCONCLUSIVE
        text += " (the two TTFTs overlap within their spread)"
    return make_claim("Prefill is compute-bound and sets TTFT", verdict, evidence, text, ("timing", "ceilings"))


def decode_bandwidth_bound(decode_rows: Sequence[Mapping[str, Any]], balance_point: float) -> dict[str, Any]:
    """Decode is memory-bandwidth-bound (batch 1: intensity below the balance point, MBU above MFU) and sets ITL."""
    b1 = sorted((r for r in decode_rows if r["batch"] == 1), key=lambda r: r["context_len"])
    if not b1:
        b1 = sorted(decode_rows, key=lambda r: (r["batch"], r["context_len"]))[:1]
    worst = max(b1, key=lambda r: r["intensity"])
    below = all(r["intensity"] < balance_point for r in b1)
    bytes_side = all(r["mbu"] > r["mfu"] for r in b1)
    t = _row_span(b1[0])
    evidence = {
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
        f"of {balance_point:.1f}, MBU {mbus} against MFU {mfus}; a step (the ITL) took {_fmt_span(t, 1e3)} ms"
    )
    verdict = CONFIRMED if below and bytes_side else NOT_CONFIRMED
    return make_claim("Decode is memory-bandwidth-bound and sets ITL", verdict, evidence, text, ("timing", "ceilings"))


def batching_raises_throughput(decode_rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Batching raises decode throughput: tokens/s at the largest batch against batch 1 (same context length),
    beyond both spreads."""
    ctx = max(r["context_len"] for r in decode_rows)
    rows = sorted((r for r in decode_rows if r["context_len"] == ctx), key=lambda r: r["batch"])
    small, big = rows[0], rows[-1]
    a, b = _row_span(big, "tokens_per_s"), _row_span(small, "tokens_per_s")
    o = order(a, b) if big["batch"] > small["batch"] else 0
    evidence = {
        "context_len": ctx,
        "batch_small": small["batch"],
        "batch_large": big["batch"],
        "tokens_per_s_small": b[1],
        "tokens_per_s_large": a[1],
        "gain": a[1] / b[1],
    }
    text = (
        f"at context {ctx}, batch {big['batch']} made {_fmt_span(a)} tokens/s against {_fmt_span(b)} at batch "
        f"{small['batch']} ({a[1] / b[1]:.1f}x)"
    )
    verdict = {1: CONFIRMED, -1: NOT_CONFIRMED, 0: INCONCLUSIVE}[o]
    if o == 0:
        text += "; the spreads overlap"
    return make_claim("Batching raises decode throughput", verdict, evidence, text, ("timing", "batching"))


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
    return make_claim(
        "Fewer KV heads mean fewer bytes per token and more sequences that fit",
        verdict,
        {k: dict(v) for k, v in rows},
        text,
        (),
    )


def fewer_kv_heads_faster_decode(times: Mapping[str, Mapping[str, float]], context_len: int) -> dict[str, Any]:
    """Fewer KV heads make a decode step faster (measured): the fewest-heads variant against the most-heads one.

    ``times`` maps a label to ``{"num_kv_heads", "time_s", "time_min_s", "time_max_s"}``.
    """
    rows = sorted(times.items(), key=lambda kv: -kv[1]["num_kv_heads"])
    (most, m), (fewest, f) = rows[0], rows[-1]
    tm, tf = _row_span(m), _row_span(f)
    o = order(tm, tf)  # +1: the most-heads variant is slower beyond the spreads, as claimed
    text = (
        f"at context {context_len}, a decode step took {_fmt_span(tm, 1e3, '.2f')} ms with {most} and "
        f"{_fmt_span(tf, 1e3, '.2f')} ms with {fewest}"
    )
    if o == 0:
        text += "; the spreads overlap"
    verdict = {1: CONFIRMED, -1: NOT_CONFIRMED, 0: INCONCLUSIVE}[o]
    evidence = {k: {"time_ms": v["time_s"] * 1e3, "num_kv_heads": v["num_kv_heads"]} for k, v in rows}
    return make_claim("Fewer KV heads make a decode step faster", verdict, evidence, text, ("timing",))


def paging_wastes_less(contiguous_waste: float, paged_waste: float, block_size: int) -> dict[str, Any]:
    """Paged blocks waste less reserved KV memory than contiguous ``max_model_len`` slots (exact, from lengths)."""
    text = f"contiguous slots leave {contiguous_waste:.1%} of the reserved memory empty, {block_size}-token blocks " + (
        f"{paged_waste:.1%}"
    )
    verdict = CONFIRMED if paged_waste < contiguous_waste else NOT_CONFIRMED
    evidence = {"contiguous_waste": contiguous_waste, "paged_waste": paged_waste, "block_size": block_size}
    return make_claim("Paged blocks waste less KV memory than contiguous slots", verdict, evidence, text, ())


# ---------------------------------------------------------------- notebook 03: batching policies


def continuous_beats_static(
    static: Mapping[str, float], continuous: Mapping[str, float], workload: str, tolerance: float = SINGLE_RUN_TOLERANCE
) -> dict[str, Any]:
    """Continuous batching beats static on ``workload``: higher output throughput or lower p99 TTFT beyond
    ``tolerance``, and worse in neither. Rows are ``summary_row`` dicts (``output_throughput``, ``ttft_p99_ms``)."""
    thr = order_single(continuous["output_throughput"], static["output_throughput"], tolerance)
    ttft = -order_single(continuous["ttft_p99_ms"], static["ttft_p99_ms"], tolerance)  # lower is better
    text = (
        f"on {workload}, continuous served {continuous['output_throughput']:.1f} output tokens/s against "
        f"{static['output_throughput']:.1f} for static, p99 TTFT {continuous['ttft_p99_ms']:.0f} ms against "
        f"{static['ttft_p99_ms']:.0f} ms (single runs; differences under {tolerance:.0%} count as noise)"
    )
    if thr < 0 or ttft < 0:
        verdict = NOT_CONFIRMED
    elif thr > 0 or ttft > 0:
        verdict = CONFIRMED
    else:
        verdict = INCONCLUSIVE
    evidence = {
        "workload": workload,
        "output_throughput_static": static["output_throughput"],
        "output_throughput_continuous": continuous["output_throughput"],
        "ttft_p99_ms_static": static["ttft_p99_ms"],
        "ttft_p99_ms_continuous": continuous["ttft_p99_ms"],
        "tolerance": tolerance,
    }
    return make_claim(f"Continuous batching beats static under load ({workload})", verdict, evidence, text)


# ---------------------------------------------------------------- notebook 04: chunked prefill


def chunking_removes_stalls(
    stall_ms_one_shot: float, stall_ms_chunked: float, tolerance: float = SINGLE_RUN_TOLERANCE
) -> dict[str, Any]:
    """Chunked prefill removes generation stalls: the worst decode ITL while a long prompt prefills is lower with
    chunking than with the whole prompt in one step."""
    o = order_single(stall_ms_one_shot, stall_ms_chunked, tolerance)
    text = (
        f"the worst decode ITL while the long prompt prefilled was {stall_ms_one_shot:.0f} ms with the prompt in one "
        f"step (prefill-first) and {stall_ms_chunked:.0f} ms with chunking"
    )
    verdict = {1: CONFIRMED, -1: NOT_CONFIRMED, 0: INCONCLUSIVE}[o]
    evidence = {"stall_ms_one_shot": stall_ms_one_shot, "stall_ms_chunked": stall_ms_chunked, "tolerance": tolerance}
    return make_claim("Chunked prefill removes generation stalls", verdict, evidence, text)


def chunking_costs_ttft(
    ttft_ms_one_shot: float, ttft_ms_chunked: float, tolerance: float = SINGLE_RUN_TOLERANCE
) -> dict[str, Any]:
    """Chunking has a TTFT price: the long prompt's TTFT is higher when its prefill is spread over steps."""
    o = order_single(ttft_ms_chunked, ttft_ms_one_shot, tolerance)
    change = "rose" if ttft_ms_chunked > ttft_ms_one_shot else "fell"
    text = f"the long prompt's TTFT {change} from {ttft_ms_one_shot:.0f} ms (one step) to {ttft_ms_chunked:.0f} ms"
    if o < 0:
        text += " (chunking paid no TTFT price here)"
    verdict = {1: CONFIRMED, -1: NOT_CONFIRMED, 0: INCONCLUSIVE}[o]
    evidence = {"ttft_ms_one_shot": ttft_ms_one_shot, "ttft_ms_chunked": ttft_ms_chunked, "tolerance": tolerance}
    return make_claim("Chunked prefill raises the long prompt's TTFT (its price)", verdict, evidence, text)


def chunking_lowers_tail_itl(
    itl_p99_ms: Mapping[str, float], one_shot: str = "continuous", chunked: str = "chunked",
    tolerance: float = SINGLE_RUN_TOLERANCE,
) -> dict[str, Any]:  # fmt: skip
    """On a mixed workload, chunked prefill gives a lower p99 ITL than prefill-first scheduling."""
    a, b = itl_p99_ms[one_shot], itl_p99_ms[chunked]
    o = order_single(a, b, tolerance)
    text = "p99 ITL on the mixed workload: " + ", ".join(f"{k} {v:.0f} ms" for k, v in itl_p99_ms.items())
    verdict = {1: CONFIRMED, -1: NOT_CONFIRMED, 0: INCONCLUSIVE}[o]
    return make_claim(
        "Chunked prefill lowers the p99 ITL of a mixed workload", verdict, {**itl_p99_ms, "tolerance": tolerance}, text
    )


# ---------------------------------------------------------------- anomalies and text


# ---------------------------------------------------------------- notebook 08: decode levers


def _tps_span(row: Mapping[str, Any]) -> tuple[float, float, float]:
    return span(row.get("tokens_per_s_min", row["tokens_per_s"]), row["tokens_per_s"],
                row.get("tokens_per_s_max", row["tokens_per_s"]))  # fmt: skip


def fewer_weight_bytes_faster_decode(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Fewer bytes per weight raise batch-1 decode tokens/s: each scheme with fewer bytes per step than the next
    larger one is faster beyond the spreads. ``rows``: one batch size's decode rows (``levers.decode_schemes``),
    each with ``scheme``, ``bytes_per_step``, ``tokens_per_s`` and its min/max."""
    ordered = sorted(rows, key=lambda r: -r["bytes_per_step"])
    steps = [order(_tps_span(b), _tps_span(a)) for a, b in zip(ordered, ordered[1:])]
    text = "; ".join(
        f"{r['scheme']}: {r['bytes_per_step'] / 1e6:.3g} MB/step, {_fmt_span(_tps_span(r))} tok/s" for r in ordered
    )
    verdict = (
        CONFIRMED if all(o == 1 for o in steps) else NOT_CONFIRMED if any(o == -1 for o in steps) else INCONCLUSIVE
    )
    if verdict == INCONCLUSIVE:
        text += "; some spreads overlap"
    evidence = {
        r["scheme"]: {"bytes_per_step": r["bytes_per_step"], "tokens_per_s": r["tokens_per_s"]} for r in ordered
    }
    return make_claim("Fewer bytes per weight make decode faster", verdict, evidence, text, ("timing",))


def fewer_kv_bytes_faster_long_decode(
    rows: Sequence[Mapping[str, Any]], capacity: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """At a long context, a quantized KV cache raises decode tokens/s (beyond the spreads) and more sequences fit.

    ``rows``: decode rows at one (batch, context) with the same weights and different ``kv_cache_dtype``, the
    unquantized cache first; ``capacity``: ``levers.kv_capacity`` rows."""
    base, others = rows[0], rows[1:]
    fits = {c["kv_cache_dtype"]: c["sequences_that_fit"] for c in capacity}
    faster = [order(_tps_span(r), _tps_span(base)) for r in others]
    more = all(fits[r["kv_cache_dtype"]] > fits[base["kv_cache_dtype"]] for r in others)
    text = "; ".join(
        f"KV {r['kv_cache_dtype']}: {_fmt_span(_tps_span(r))} tok/s at context {r['context_len']}, "
        f"{fits[r['kv_cache_dtype']]} sequences fit"
        for r in rows
    )
    if all(o == 1 for o in faster) and more:
        verdict = CONFIRMED
    elif any(o == -1 for o in faster) or not more:
        verdict = NOT_CONFIRMED
    else:
        verdict, text = INCONCLUSIVE, text + "; the spreads overlap"
    evidence = {r["kv_cache_dtype"]: {"tokens_per_s": r["tokens_per_s"], "sequences_that_fit":
                fits[r["kv_cache_dtype"]]} for r in rows}  # fmt: skip
    return make_claim(
        "A quantized KV cache makes long-context decode faster and fits more sequences", verdict, evidence, text,
        ("timing",),
    )  # fmt: skip


def fewer_bytes_move_decode_not_prefill(
    decode_rows: Sequence[Mapping[str, Any]], prefill_rows: Sequence[Mapping[str, Any]],
    tolerance: float = SINGLE_RUN_TOLERANCE,
) -> dict[str, Any]:  # fmt: skip
    """The seed's contrast: the scheme that speeds batch-1 decode most does not speed prefill the same way.

    Both lists are per scheme, the unquantized first, with ``speedup`` over it (and time spreads for prefill).
    Confirmed when that scheme's decode speed-up exceeds 1 + ``tolerance`` while its prefill speed-up stays
    below it; not confirmed when prefill gains as much as decode."""
    pre = {r["scheme"]: r for r in prefill_rows}
    best = max((r for r in decode_rows[1:] if r["scheme"] in pre), key=lambda r: r["speedup"])
    p, b0 = pre[best["scheme"]], pre[decode_rows[0]["scheme"]]
    t_p, t_0 = _row_span(p), _row_span(b0)
    text = (
        f"{best['scheme']} against {decode_rows[0]['scheme']}: decode {best['speedup']:.2f}x the tokens/s "
        f"({best['bytes_ratio']:.2f}x fewer bytes per step); prefill of {p['prompt_len']} tokens "
        f"{_fmt_span(t_p, 1e3)} ms against {_fmt_span(t_0, 1e3)} ms ({p['speedup']:.2f}x)"
    )
    if best["speedup"] > 1 + tolerance and p["speedup"] < 1 + tolerance:
        verdict = CONFIRMED
    elif p["speedup"] >= best["speedup"]:
        verdict = NOT_CONFIRMED
    else:
        verdict = INCONCLUSIVE
    evidence = {"scheme": best["scheme"], "decode_speedup": best["speedup"], "prefill_speedup": p["speedup"]}
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
    evidence = {a["scheme"]: {"kl": a["kl"], "top1_agreement": a["top1_agreement"]} for a in (i8, i4)}
    return make_claim("int4 weights cost more accuracy than int8", verdict, evidence, text, ())


def apply_anomalies(claims: Sequence[Mapping[str, Any]], anomalies: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Claims with every one that rests on a flagged quantity turned *inconclusive* and marked ``unreliable``.

    The verdict the numbers alone gave stays in ``verdict_from_numbers``; ``unreliable_because`` lists the
    anomalies' messages.
    """
    out = []
    for c in claims:
        c = dict(c)
        hits = [a["message"] for a in anomalies if a.get("affects") in c.get("uses", ())]
        if hits:
            c["verdict_from_numbers"] = c["verdict"]
            c["verdict"] = INCONCLUSIVE
            c["unreliable"] = True
            c["unreliable_because"] = hits
        out.append(c)
    return out


VERDICT_TEXT = {CONFIRMED: "confirmed", NOT_CONFIRMED: "not confirmed", INCONCLUSIVE: "inconclusive"}


def claims_markdown(claims: Sequence[Mapping[str, Any]], anomalies: Sequence[Mapping[str, Any]] = ()) -> str:
    """The conclusion of a notebook: the anomalies first (the run is unreliable where they say), then each claim
    with its verdict and the numbers behind it."""
    lines = []
    if anomalies:
        lines.append(f"**Unreliable results**: the sanity checks flagged {len(anomalies)} problem(s):")
        lines += [f"  - {a['message']}" for a in anomalies]
        lines.append("")
    for c in claims:
        verdict = VERDICT_TEXT[c["verdict"]]
        if c.get("unreliable"):
            verdict += f" (unreliable; the numbers alone say {VERDICT_TEXT[c['verdict_from_numbers']]})"
        lines.append(f"- **{verdict}**: {c['claim']}. {c['detail'][:1].upper()}{c['detail'][1:]}.")
    return "\n".join(lines)


__all__ = [
    "VERDICTS",
    "make_claim",
    "order",
    "order_single",
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
    "apply_anomalies",
    "claims_markdown",
]
