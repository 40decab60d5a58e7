"""What a report page shows of a ``metrics.json``: one row per claim, one per key result, and their CSV.

A claim row has one verdict label (confirmed | not confirmed | inconclusive) beside the numbers that decided it:
for a claim decided by paired rounds, its ``evidence``'s ``ratio`` with the interval ``ci_low``..``ci_high``, the
``rounds``, the ``margin`` and ``confidence`` of its rule and its A/A ``control``; a ratio of exact figures (an
analytic or simulated claim: ``rounds`` 0) is marked "exact", one whose interval is its repeats' min..max says so,
and a claim with no natural ratio shows its evidence's ``no_ratio`` (why) in the ratio's place. An inconclusive
claim says what would decide it (more rounds, a quieter machine), and a claim voided by the sanity checks
(``unreliable``) says why in its note, with the verdict its numbers alone gave, rather than in a second label.

A key result row is ``workbench.record.result_row``'s: a bare value with the unit its name gives it, or a structured
one (``record.result``) with its unit, its spread and the conditions it was measured at.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from workbench.record import STRUCTURED_KEYS, number, result_row

VERDICT_TEXT = {"confirmed": "confirmed", "not_confirmed": "not confirmed", "inconclusive": "inconclusive"}
CLAIM_COLUMNS = ("experiment", "claim", "verdict", "ratio", "ci_low", "ci_high", "rounds", "margin", "confidence",
                 "control_ratio", "control_ci_low", "control_ci_high", "note", "detail")  # fmt: skip
RESULT_COLUMNS = ("experiment", "key", "value", "unit", "low", "high", "conditions")


def _pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.01 else f"{x:.1%}"


def _next_step(claim: Mapping[str, Any], evidence: Mapping[str, Any]) -> str:
    """What would decide an inconclusive claim."""
    control = evidence.get("control") if isinstance(evidence.get("control"), Mapping) else None
    if claim.get("unreliable"):
        return "rerun on a quieter machine (the sanity checks flagged what it rests on)"
    if control and control.get("failed"):
        return "the A/A control failed: the rounds were not comparable; rerun on a quieter machine"
    if number(evidence.get("ci_low")) is not None:
        return "the interval straddles the margin: more rounds (a larger max_rounds or time budget) would decide it"
    return "the numbers overlap within their spread: more repeats would decide it"


def claim_row(claim: Mapping[str, Any], experiment: str = "") -> dict[str, Any]:
    """One claim as a table row: ``verdict`` (its one label) and ``verdict_text``, the ``ratio`` and interval of
    its paired rounds when its evidence has them (``ratio_text`` 'B/A 5.87× [5.2, 6.6]'), ``rounds``,
    ``margin_text``, ``control_text``, a ``note`` (why it is unreliable, what would decide it) and its
    ``detail``; numbers are None where the evidence has none (a claim with ``no_ratio``: ``ratio_text`` says why)."""
    evidence = claim.get("evidence") if isinstance(claim.get("evidence"), Mapping) else {}
    verdict = str(claim.get("verdict", "?"))
    ratio, lo, hi = (number(evidence.get(k)) for k in ("ratio", "ci_low", "ci_high"))
    rounds = evidence.get("rounds") if isinstance(evidence.get("rounds"), int) else None
    margin, confidence = number(evidence.get("margin")), number(evidence.get("confidence"))
    control = evidence.get("control") if isinstance(evidence.get("control"), Mapping) else {}
    c_ratio, c_lo, c_hi = (number(control.get(k)) for k in ("ratio", "ci_low", "ci_high"))
    arms = evidence.get("arms")
    ratio_text = ""
    if ratio is not None:
        ratio_text = f"{ratio:.3g}×"
        if rounds == 0:
            ratio_text += " exact"  # a zero-width interval: the ratio itself
        elif lo is not None and hi is not None:
            ratio_text += f" [{lo:.3g}, {hi:.3g}]"
        if rounds != 0 and evidence.get("interval") == "min..max":
            ratio_text += f" min..max of {rounds}" if rounds else " min..max"
        if isinstance(arms, Sequence) and not isinstance(arms, str) and len(arms) == 2:
            ratio_text = f"{arms[1]} / {arms[0]}: {ratio_text}"
    elif evidence.get("no_ratio"):
        ratio_text = f"no ratio: {evidence['no_ratio']}"
    margin_text = ""
    if margin is not None:
        direction = evidence.get("direction")
        margin_text = f"{'+' if direction == 'higher' else '-' if direction == 'lower' else '±'}{_pct(margin)}"
        if confidence is not None:
            margin_text += f" at {confidence:.0%}"
    control_text = ""
    if c_ratio is not None:
        control_text = f"{c_ratio:.3g}×" + (
            f" [{c_lo:.3g}, {c_hi:.3g}]" if c_lo is not None and c_hi is not None else ""
        )
        control_text += " failed" if control.get("failed") else ""
    notes = []
    if claim.get("unreliable"):
        because = claim.get("unreliable_because") or []
        notes.append("unreliable: " + ("; ".join(str(b) for b in because) or "the sanity checks flagged it"))
        if claim.get("verdict_from_numbers") in VERDICT_TEXT:
            notes.append(f"numbers alone: {VERDICT_TEXT[claim['verdict_from_numbers']]}")
    if verdict == "inconclusive":
        notes.append(_next_step(claim, evidence))
    return {
        "experiment": experiment,
        "claim": str(claim.get("claim", "?")),
        "verdict": verdict,
        "verdict_text": VERDICT_TEXT.get(verdict, verdict),
        "ratio": ratio,
        "ci_low": lo,
        "ci_high": hi,
        "rounds": rounds,
        "margin": margin,
        "confidence": confidence,
        "control_ratio": c_ratio,
        "control_ci_low": c_lo,
        "control_ci_high": c_hi,
        "ratio_text": ratio_text,
        "margin_text": margin_text,
        "control_text": control_text,
        "note": " · ".join(notes),
        "detail": str(claim.get("detail", "")),
    }


def claim_rows(metrics: Mapping[str, Any] | None, experiment: str = "") -> list[dict[str, Any]]:
    """``claim_row`` of every claim in ``metrics`` (an experiment's metrics.json), in order."""
    claims = (metrics or {}).get("claims") or []
    return [claim_row(c, experiment) for c in claims if isinstance(c, Mapping)]


def result_rows(metrics: Mapping[str, Any] | None, experiment: str = "") -> list[dict[str, Any]]:
    """``result_row`` of every key result in ``metrics`` (claims, anomalies and hygiene are not key results)."""
    return [result_row(k, v, experiment) for k, v in (metrics or {}).items() if k not in STRUCTURED_KEYS]


def to_csv(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as CSV text with a header of ``columns`` (None as an empty cell; a dict as ``k=v; ...``)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        cells = []
        for col in columns:
            v = row.get(col)
            if v is None:
                cells.append("")
            elif isinstance(v, Mapping):
                cells.append("; ".join(f"{k}={x}" for k, x in v.items()))
            else:
                cells.append(v if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v))
        writer.writerow(cells)
    return out.getvalue()


def claims_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    """Claim rows (``claim_row``) as CSV."""
    return to_csv(rows, CLAIM_COLUMNS)


def results_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    """Key-result rows (``result_row``) as CSV."""
    return to_csv(rows, RESULT_COLUMNS)
