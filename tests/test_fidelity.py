"""Fidelity bookkeeping (``workbench.experiments.fidelity``): spread, tolerance and verdicts against hand-computed
numbers."""

from __future__ import annotations

import pytest

from workbench.experiments.claims import CONFIRMED, INCONCLUSIVE, NOT_CONFIRMED
from workbench.experiments.fidelity import compare, fidelity_claim


def metrics(ttft: float, itl: float) -> dict:
    return {"ttft_s": {"median": ttft, "p90": 2 * ttft}, "itl_s": {"median": itl, "p90": 2 * itl}}


def test_spread_tolerance_and_error_by_hand() -> None:
    runs = {"continuous": [metrics(0.10, 0.010), metrics(0.12, 0.010), metrics(0.11, 0.010)]}
    rows = compare(runs, {"continuous": metrics(0.12, 0.0115)}, "m")
    ttft = rows[0]
    assert ttft["statistic"] == "ttft median"
    assert ttft["measured_ms"] == pytest.approx(110.0)
    assert (ttft["measured_min_ms"], ttft["measured_max_ms"]) == pytest.approx((100.0, 120.0))
    assert ttft["spread"] == pytest.approx(0.01 / 0.11)  # the largest deviation of a repeat from the median
    assert ttft["tolerance"] == pytest.approx(0.10)  # 10% is larger than the spread of 9.1%
    assert ttft["rel_error"] == pytest.approx(0.01 / 0.11) and ttft["within"]
    itl = rows[2]
    assert itl["spread"] == 0.0 and itl["rel_error"] == pytest.approx(0.15) and not itl["within"]
    claim = fidelity_claim(rows, "m")
    assert claim["verdict"] == NOT_CONFIRMED
    assert claim["evidence"]["num_within"] == 2 and claim["evidence"]["worst"]["statistic"] == "itl median"


def test_a_wide_spread_widens_the_tolerance_and_leaves_it_inconclusive() -> None:
    runs = {"static": [metrics(0.10, 0.01), metrics(0.14, 0.01), metrics(0.20, 0.01)]}
    rows = compare(runs, {"static": metrics(0.18, 0.0105)}, "m")
    assert rows[0]["spread"] == pytest.approx(0.06 / 0.14)
    assert rows[0]["rel_error"] == pytest.approx(0.04 / 0.14) and rows[0]["within"]
    assert fidelity_claim(rows, "m")["verdict"] == INCONCLUSIVE


def test_every_statistic_within_ten_percent_is_confirmed() -> None:
    runs = {"chunked": [metrics(0.10, 0.01)] * 3, "static": [metrics(0.2, 0.02)] * 2}
    rows = compare(runs, {"chunked": metrics(0.109, 0.0091), "static": metrics(0.19, 0.021)}, "m")
    assert all(r["within"] for r in rows) and len(rows) == 8
    assert fidelity_claim(rows, "m")["verdict"] == CONFIRMED
