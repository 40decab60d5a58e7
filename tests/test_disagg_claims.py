"""Notebook 05's computations and claims: each claim fed numbers that support it, contradict it, and are noise."""

from __future__ import annotations

import pandas as pd
import pytest

from workbench.experiments import disaggregation as dx


def test_node_layouts_are_colocation_and_every_split():
    assert dx.node_layouts(4) == {"colocated x4": None, "1:3": (1, 3), "2:2": (2, 2), "3:1": (3, 1)}


@pytest.mark.parametrize(
    "colocated, disaggregated, verdict",
    [(120.0, 6.0, "confirmed"), (6.0, 120.0, "not_confirmed"), (100.0, 95.0, "inconclusive")],
)
def test_interference_claim_follows_the_itl_tails(colocated, disaggregated, verdict):
    claim = dx.removes_interference(colocated, disaggregated)
    assert claim["verdict"] == verdict
    assert claim["evidence"] == {"itl_p99_ms_colocated": colocated, "itl_p99_ms_disaggregated": disaggregated}
    if verdict == "not_confirmed":
        assert "colocated tail is lower" in claim["detail"]


def _best(split: float, colocated: float) -> pd.DataFrame:
    return pd.DataFrame(
        [{"rate": 80.0, "colocated_goodput_per_gpu": colocated, "best_split": "2:6", "split_goodput_per_gpu": split}]
    )


@pytest.mark.parametrize(
    "tight, loose, verdict",
    [
        ((6.0, 4.0), (4.0, 4.1), "confirmed"),  # wins only under the tight SLOs
        ((4.0, 6.0), (6.0, 4.0), "not_confirmed"),  # the other way round
        ((6.0, 4.0), (6.0, 4.0), "not_confirmed"),  # wins under both: not "only under tight"
        ((4.0, 4.1), (4.0, 4.1), "inconclusive"),  # within 10% both times
    ],
)
def test_tight_slo_claim(tight, loose, verdict):
    assert dx.pays_under_tight_slos(_best(*tight), _best(*loose))["verdict"] == verdict


def _links(goodputs: list[float], colocated: float) -> pd.DataFrame:
    gbps = [1.0, 10.0, 100.0, 400.0][: len(goodputs)]
    return pd.DataFrame({"link_gbps": gbps, "goodput_per_gpu": goodputs, "colocated_goodput_per_gpu": colocated})


@pytest.mark.parametrize(
    "goodputs, verdict, breakeven",
    [
        ([0.1, 2.0, 4.0, 4.4], "confirmed", 100.0),
        ([5.0, 5.0, 5.0, 5.0], "not_confirmed", 1.0),  # even 1 Gb/s keeps up: the link does not erase it
        ([4.2, 4.1, 4.0, 4.3], "inconclusive", 400.0),
    ],
)
def test_slow_link_claim_and_break_even(goodputs, verdict, breakeven):
    links = _links(goodputs, 4.0 if verdict != "inconclusive" else 4.3)
    assert dx.slow_link_erases_it(links)["verdict"] == verdict
    assert dx.break_even_link_gbps(links) == breakeven


def test_best_layouts_picks_the_best_split_per_rate():
    sweep = pd.DataFrame(
        [
            {"layout": "colocated x8", "rate": 10.0, "goodput_per_gpu": 1.0},
            {"layout": "2:6", "rate": 10.0, "goodput_per_gpu": 0.8},
            {"layout": "4:4", "rate": 10.0, "goodput_per_gpu": 1.1},
            {"layout": "colocated x8", "rate": 20.0, "goodput_per_gpu": 1.5},
            {"layout": "2:6", "rate": 20.0, "goodput_per_gpu": 2.0},
            {"layout": "4:4", "rate": 20.0, "goodput_per_gpu": 1.2},
        ]
    )
    best = dx.best_layouts(sweep)
    assert best.best_split.tolist() == ["4:4", "2:6"]
    assert best.split_goodput_per_gpu.tolist() == [1.1, 2.0]
    assert best.colocated_goodput_per_gpu.tolist() == [1.0, 1.5]
