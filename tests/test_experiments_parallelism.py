"""Notebook 06's computations: the TP sweep's columns by their definitions, phase preferences, and each claim
against numbers that confirm and that contradict it."""

from __future__ import annotations

import pandas as pd
import pytest

from workbench.experiments import parallelism as px
from workbench.roofline import get_model


def test_tp_sweep_is_the_roofline_of_each_group() -> None:
    sweep = px.tp_sweep(["Llama-3.1-8B", "Llama-2-70B"], "h100-sxm", [1, 2, 3, 4], prompt_len=256, context_len=512)
    assert 3 not in set(sweep.tp)  # 3 divides neither model's heads: left out
    seventy = sweep[sweep.model == "Llama-2-70B"].set_index("tp")
    assert not seventy.loc[1, "fits"] and seventy.loc[2, "fits"]  # 129 GiB of fp16 weights: two 80 GB GPUs
    m = get_model("Llama-3.1-8B", "h100-sxm", tensor_parallel_size=4, calibration="hardware")
    row = sweep[(sweep.model == "Llama-3.1-8B") & (sweep.tp == 4)].iloc[0]
    assert row.ttft_s == pytest.approx(m.prefill([256]).time_s) and row.itl_s == pytest.approx(m.decode([512]).time_s)
    assert row.ttft_gpu_s == pytest.approx(4 * row.ttft_s) and 0 < row.itl_comm_share < 1
    assert sweep[sweep.tp == 1].itl_comm_share.eq(0).all()


def sweep_of(itl: dict, ttft: dict, comm: dict) -> pd.DataFrame:
    return pd.DataFrame([{"model": "m", "tp": tp, "fits": True, "ttft_s": ttft[tp], "itl_s": itl[tp],
                          "ttft_gpu_s": ttft[tp] * tp, "itl_gpu_s": itl[tp] * tp, "ttft_comm_share": comm[tp],
                          "itl_comm_share": comm[tp]} for tp in itl])  # fmt: skip


def test_claims_confirm_and_contradict() -> None:
    good = sweep_of({1: 10.0, 8: 4.0}, {1: 100.0, 8: 20.0}, {1: 0.0, 8: 0.3})
    assert px.tp_cuts_latency_with_growing_comm(good, "m")["verdict"] == "confirmed"
    slower = sweep_of({1: 10.0, 8: 12.0}, {1: 100.0, 8: 20.0}, {1: 0.0, 8: 0.3})
    assert px.tp_cuts_latency_with_growing_comm(slower, "m")["verdict"] == "not_confirmed"
    prefs = px.phase_preferences(good)
    assert prefs.set_index("phase").loc["prefill", "speedup"] == pytest.approx(5.0)
    assert px.decode_gains_less_from_tp(prefs, "m")["verdict"] == "confirmed"  # decode 2.5x < prefill 5x
    flipped = px.phase_preferences(sweep_of({1: 10.0, 8: 1.0}, {1: 100.0, 8: 50.0}, {1: 0.0, 8: 0.1}))
    assert px.decode_gains_less_from_tp(flipped, "m")["verdict"] == "not_confirmed"
    rows = pd.DataFrame({"name": ["a", "b"], "goodput_per_gpu": [2.0, 1.0]})
    assert px.plan_has_a_tradeoff(rows, rows)["verdict"] == "confirmed"
    assert px.plan_has_a_tradeoff(rows.iloc[:1], rows)["verdict"] == "not_confirmed"


@pytest.mark.parametrize(
    "decode_itl_8, verdict, reason",
    [
        (4.0, "confirmed", "beyond the margin in the claimed direction"),  # decode 2.5x < prefill 5x
        (2.1, "not_confirmed", "equivalent"),  # decode 4.76x against prefill 5x: the roofline is exact, within 10%
        (1.0, "not_confirmed", "opposite"),  # decode 10x: gains more than prefill
    ],
)
def test_decode_gains_less_is_decided_on_the_exact_speedups(decode_itl_8, verdict, reason) -> None:
    # the roofline model has no spread: a gap within the 10% margin is "equivalent", never left inconclusive
    prefs = px.phase_preferences(sweep_of({1: 10.0, 8: decode_itl_8}, {1: 100.0, 8: 20.0}, {1: 0.0, 8: 0.3}))
    claim = px.decode_gains_less_from_tp(prefs, "m")
    ev = claim["evidence"]
    assert claim["verdict"] == verdict and ev["reason"] == reason
    assert ev["ratio"] == pytest.approx(5.0 / (10.0 / decode_itl_8)) and ev["margin"] == 0.10


def test_tp_cut_within_the_margin_is_equivalent() -> None:
    near = sweep_of({1: 10.0, 8: 9.5}, {1: 100.0, 8: 20.0}, {1: 0.0, 8: 0.3})  # ITL 5% lower: not a 10% cut
    claim = px.tp_cuts_latency_with_growing_comm(near, "m")
    assert claim["verdict"] == "not_confirmed" and claim["evidence"]["reason"] == "equivalent"
    assert claim["evidence"]["ratio"] == pytest.approx(0.95)
