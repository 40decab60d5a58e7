"""Notebook 05's computations and claims: each claim fed numbers that support it, contradict it, and are noise."""

from __future__ import annotations

import pandas as pd
import pytest

from workbench.experiments import disaggregation as dx
from workbench.experiments.trials import DecisionRule, run_rounds


def test_node_layouts_are_colocation_and_every_split():
    assert dx.node_layouts(4) == {"colocated x4": None, "1:3": (1, 3), "2:2": (2, 2), "3:1": (3, 1)}


@pytest.mark.parametrize(
    "scale, verdict, words",
    [(0.05, "confirmed", "A/A"), (20.0, "not_confirmed", "other way"), (0.98, "not_confirmed", "inside the margin")],
)
def test_interference_claim_follows_the_paired_itl_tails(scale, verdict, words):
    colocated = [120.0, 118.0, 125.0, 121.0, 119.0, 122.0]
    wobble = [1.0, 1.01, 0.99, 1.0, 1.005, 0.995]
    arms = {"colocated continuous": lambda i: colocated[i], "disaggregated 1:1": lambda i: colocated[i] * scale *
            wobble[i]}  # fmt: skip
    cmp = run_rounds(arms, DecisionRule("lower", 0.10), min_rounds=6, max_rounds=6, warmup=0,
                     control=lambda i: colocated[i] * wobble[5 - i])  # fmt: skip
    claim = dx.removes_interference(cmp)
    assert claim["verdict"] == verdict and words in claim["detail"] and claim["uses"] == ["paired"]
    assert claim["evidence"]["ratio"] == pytest.approx(scale, rel=0.01) and claim["evidence"]["rounds"] == 6


def _best(split: float, colocated: float) -> pd.DataFrame:
    return pd.DataFrame(
        [{"rate": 80.0, "colocated_goodput_per_gpu": colocated, "best_split": "2:6", "split_goodput_per_gpu": split}]
    )


@pytest.mark.parametrize(
    "tight, loose, verdict, reason",
    [
        ((6.0, 4.0), (4.0, 4.1), "confirmed", "beyond the margin in the claimed direction"),  # only under tight
        ((4.0, 6.0), (6.0, 4.0), "not_confirmed", "tight SLOs: opposite"),  # the other way round
        ((6.0, 4.0), (6.0, 4.0), "not_confirmed", "it pays under the loose SLOs too"),  # not "only under tight"
        # the simulator is exact: within 10% both times is decided, "equivalent", not left to more repeats
        ((4.0, 4.1), (4.0, 4.1), "not_confirmed", "tight SLOs: equivalent"),
        ((4.39, 4.0), (4.0, 4.0), "not_confirmed", "tight SLOs: equivalent"),  # 9.75%: inside the 10% margin
        ((4.41, 4.0), (4.0, 4.0), "confirmed", "beyond the margin in the claimed direction"),  # 10.25%
        ((0.5, 0.0), (4.0, 4.0), "confirmed", "beyond the margin in the claimed direction"),  # colocated meets none
    ],
)
def test_tight_slo_claim(tight, loose, verdict, reason):
    claim = dx.pays_under_tight_slos(_best(*tight), _best(*loose))
    ev = claim["evidence"]
    assert claim["verdict"] == verdict and ev["reason"] == reason
    assert ev["margin"] == 0.10 and ev["direction"] == "higher" and ev["arms"] == ["colocated", "split 2:6"]
    assert ev["ratio"] == (pytest.approx(tight[0] / tight[1]) if tight[1] else None)
    assert "within the 10% margin" in claim["detail"] or reason != "tight SLOs: equivalent"


def _links(goodputs: list[float], colocated: float) -> pd.DataFrame:
    gbps = [1.0, 10.0, 100.0, 400.0][: len(goodputs)]
    return pd.DataFrame({"link_gbps": gbps, "goodput_per_gpu": goodputs, "colocated_goodput_per_gpu": colocated})


@pytest.mark.parametrize(
    "goodputs, verdict, breakeven",
    [
        ([0.1, 2.0, 4.0, 4.4], "confirmed", 100.0),
        ([5.0, 5.0, 5.0, 5.0], "not_confirmed", 1.0),  # even 1 Gb/s keeps up: the link does not erase it
        ([4.2, 4.1, 4.0, 4.3], "not_confirmed", 400.0),  # within 10% at every link: equivalent, decided
    ],
)
def test_slow_link_claim_and_break_even(goodputs, verdict, breakeven):
    links = _links(goodputs, 4.3 if breakeven == 400.0 else 4.0)
    claim = dx.slow_link_erases_it(links)
    assert claim["verdict"] == verdict
    assert claim["evidence"]["ratio"] == pytest.approx(goodputs[0] / (4.3 if breakeven == 400.0 else 4.0))
    reasons = {100.0: "beyond the margin in the claimed direction", 1.0: "slowest link: opposite",
               400.0: "slowest link: equivalent"}  # fmt: skip
    assert claim["evidence"]["reason"] == reasons[breakeven]
    assert dx.break_even_link_gbps(links) == breakeven


def test_slow_link_claim_fails_when_even_the_fastest_link_loses():
    claim = dx.slow_link_erases_it(_links([0.1, 0.2, 0.3, 1.0], 4.0))
    assert claim["verdict"] == "not_confirmed" and claim["evidence"]["reason"] == "the fastest link loses too"


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


def _tp_row(layout: str, rate: float, ptp: int, dtp: int, goodput: float) -> dict:
    return {"layout": layout, "rate": rate, "prefill_tp": ptp, "decode_tp": dtp, "goodput_per_gpu": goodput}


def test_best_by_tp_separates_one_tp_from_a_tp_per_phase():
    sweep = pd.DataFrame(
        [
            _tp_row("8xTP1", 10.0, 1, 1, 1.0),
            _tp_row("P2xTP2:D2xTP2", 10.0, 2, 2, 1.4),
            _tp_row("P2xTP2:D4xTP1", 10.0, 2, 1, 1.2),
            _tp_row("P4xTP1:D2xTP2", 10.0, 1, 2, 0.9),
            _tp_row("8xTP1", 20.0, 1, 1, 1.5),
            _tp_row("P2xTP2:D4xTP1", 20.0, 2, 1, 2.5),
        ]
    )
    best = dx.best_by_tp(sweep)
    assert best.one_tp_layout.tolist() == ["P2xTP2:D2xTP2", "8xTP1"]
    assert best.tp_per_phase_layout.tolist() == ["P2xTP2:D4xTP1", "P2xTP2:D4xTP1"]
    assert best.tp_per_phase_goodput_per_gpu.tolist() == [1.2, 2.5]


def _best_tp(pairs: list[tuple[float, float]]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "rate": 10.0 * (i + 1),
                "one_tp_layout": "8xTP1",
                "one_tp_goodput_per_gpu": one,
                "tp_per_phase_layout": "P2xTP2:D4xTP1",
                "tp_per_phase_goodput_per_gpu": per,
            }  # fmt: skip
            for i, (one, per) in enumerate(pairs)
        ]
    )


@pytest.mark.parametrize(
    "pairs, verdict, rate",
    [
        ([(1.0, 1.05), (2.0, 2.6)], "confirmed", 20.0),  # 30% more at 20 req/s
        ([(1.0, 0.5), (2.0, 2.1)], "not_confirmed", 20.0),  # never 10% above, once far below
        ([(1.0, 1.05), (2.0, 1.95)], "not_confirmed", 10.0),  # within 10% at every rate: exact, so equivalent
        ([(1.0, 0.8), (2.0, 1.5)], "not_confirmed", 10.0),  # below by more than 10% at every rate: opposite
    ],
)
def test_tp_per_phase_claim(pairs, verdict, rate):
    # the evidence is the rate most favourable to a TP per phase
    claim = dx.tp_per_phase_pays(_best_tp(pairs))
    assert claim["verdict"] == verdict
    ev = claim["evidence"]
    assert ev["rate"] == rate
    one, per = pairs[int(rate / 10) - 1]
    assert ev["ratio"] == pytest.approx(per / one) and ev["margin"] == 0.10
    expected = "equivalent" if 1 / 1.1 < per / one < 1.1 else "opposite" if per / one < 1 else None
    assert ev["reason"] == (expected or "beyond the margin in the claimed direction")


def test_a_tp2_prefill_replica_gives_a_lone_request_a_shorter_ttft_than_a_tp1_one():
    # each role is priced at its own TP: one request alone, so TTFT is its prefill (+ the transfer) with no queue
    from workbench.sim.planner import Candidate, PlanSettings, evaluate
    from workbench.workloads import Request

    requests = [Request(0, 0.0, 2048, 8)]
    settings = PlanSettings("Llama-3.1-8B", "h100-sxm", slo_ttft_s=1.0, slo_tpot_s=1.0)
    ttft = {
        ptp: evaluate(Candidate(tp=ptp, disaggregate=(1, 1), prefill_tp=ptp, decode_tp=1), requests, settings)[
            "ttft_median_s"
        ]
        for ptp in (1, 2)
    }
    assert ttft[2] < 0.75 * ttft[1]  # half the FLOPs per GPU, plus the all-reduces: well under 3/4 of TP1's


def test_a_layout_that_does_not_fit_or_does_not_fill_the_node_is_refused():
    from workbench.errors import ConfigError
    from workbench.workloads import Request

    requests = [Request(0, 0.0, 64, 4)]
    slos = {"slo_ttft_s": 1.0, "slo_tpot_s": 0.1}
    with pytest.raises(ConfigError, match="does not fit"):
        dx.simulate_layout(requests, "Llama-3.1-70B", "h100-sxm", 8, None, slos, tp=1)
    with pytest.raises(ConfigError, match="use 6 GPUs, not 8"):
        dx.simulate_layout(requests, "Llama-3.1-8B", "h100-sxm", 8, (1, 2), slos, tp=2)
