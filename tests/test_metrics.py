"""Metrics on a hand-built timeline; every expected number is worked out by hand in the comments."""

from __future__ import annotations

import json

import pytest

from workbench.engine.metrics import STAT_KEYS, StepLog, requests_to_dataframe, stats, summarize
from workbench.engine.scheduler import ScheduledChunk, StepPlan
from workbench.request import RequestRecord, SamplingParams, Sequence

# A: arrives 0.0, tokens at 1.0, 1.5, 2.5  -> TTFT 1.0, E2E 2.5, TPOT (2.5-1.0)/2 = 0.75, ITL 0.5, 1.0
# B: arrives 1.0, one token at 3.0         -> TTFT 2.0, E2E 2.0, no TPOT, no ITL
# C: arrives 2.0, tokens 2.5 .. 3.3 by 0.2 -> TTFT 0.5, E2E 1.3, TPOT 0.8/4 = 0.2, ITL 0.2 x 4
# D: rejected
TIMELINE = [
    RequestRecord(0, 0.0, 10, 3, 1.0, 2.5, [1.0, 1.5, 2.5]),
    RequestRecord(1, 1.0, 5, 1, 3.0, 3.0, [3.0]),
    RequestRecord(2, 2.0, 20, 5, 2.5, 3.3, [2.5, 2.7, 2.9, 3.1, 3.3]),
    RequestRecord(3, 2.0, 100, 0, None, 2.0, [], finish_reason="rejected"),
]


def approx_stats(expected: dict[str, float]) -> dict[str, object]:
    return {k: pytest.approx(v, abs=1e-12) for k, v in expected.items()}


def test_latency_aggregates() -> None:
    out = summarize(TIMELINE, duration_s=4.0)
    assert out["num_requests"] == 4 and out["num_finished"] == 3 and out["num_preemptions"] == 0
    m = out["metrics"]
    # TTFT [0.5, 1.0, 2.0]: linear percentiles at ranks 0.9*2 = 1.8, 1.9, 1.98
    assert m["ttft_s"] == approx_stats({"mean": 3.5 / 3, "median": 1.0, "p90": 1.8, "p95": 1.9, "p99": 1.98})
    # TPOT [0.2, 0.75]: rank 0.9 -> 0.2 + 0.9 * 0.55
    assert m["tpot_s"] == approx_stats({"mean": 0.475, "median": 0.475, "p90": 0.695, "p95": 0.7225, "p99": 0.7445})
    # ITL [0.2, 0.2, 0.2, 0.2, 0.5, 1.0]: rank 4.5 -> 0.75, rank 4.75 -> 0.875, rank 4.95 -> 0.975
    assert m["itl_s"] == approx_stats({"mean": 2.3 / 6, "median": 0.2, "p90": 0.75, "p95": 0.875, "p99": 0.975})
    # E2E [1.3, 2.0, 2.5]: rank 1.8 -> 2.0 + 0.8 * 0.5
    assert m["e2el_s"] == approx_stats({"mean": 5.8 / 3, "median": 2.0, "p90": 2.4, "p95": 2.45, "p99": 2.49})
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(9 / 4)
    assert m["total_token_throughput"] == pytest.approx((35 + 9) / 4)
    # no SLO: nothing to attain, so goodput and attainment are null (not "100% within SLOs")
    assert m["goodput"] is None and m["slo_attainment"] is None
    # an SLO every completed request meets: the rejected one is a miss
    m = summarize(TIMELINE, duration_s=4.0, slo_e2el_s=100.0)["metrics"]
    assert m["goodput"] == pytest.approx(0.75)
    assert m["slo_attainment"] == pytest.approx(75.0)


def test_goodput_and_slo_attainment() -> None:
    # TTFT <= 1.5 and TPOT <= 0.5: A fails TPOT (0.75), B fails TTFT (2.0), C meets both
    m = summarize(TIMELINE, duration_s=4.0, slo_ttft_s=1.5, slo_tpot_s=0.5)["metrics"]
    assert m["goodput"] == pytest.approx(1 / 4)
    assert m["slo_attainment"] == pytest.approx(25.0)
    # E2E <= 2.0: A fails (2.5), B meets (2.0, inclusive), C meets; TPOT SLO is met by B's single token
    m = summarize(TIMELINE, duration_s=4.0, slo_e2el_s=2.0, slo_tpot_s=0.1)["metrics"]
    assert m["goodput"] == pytest.approx(1 / 4)  # only B: C's TPOT 0.2 > 0.1
    m = summarize(TIMELINE, duration_s=4.0, slo_e2el_s=2.0)["metrics"]
    assert m["goodput"] == pytest.approx(2 / 4) and m["slo_attainment"] == pytest.approx(50.0)


def test_contract_layout_and_default_duration() -> None:
    out = summarize(TIMELINE)
    # duration: last finish 3.3 - first arrival 0.0
    assert out["duration_s"] == pytest.approx(3.3)
    assert set(out) >= {"num_requests", "num_finished", "num_preemptions", "metrics"}
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert set(out["metrics"][key]) == set(STAT_KEYS)
    for key in ("request_throughput", "output_throughput"):
        assert isinstance(out["metrics"][key], float)
    assert out["metrics"]["goodput"] is None and out["metrics"]["slo_attainment"] is None
    json.dumps(out)


def test_from_sequences() -> None:
    seq = Sequence(7, [1, 2, 3, 4], SamplingParams(max_tokens=2), arrival_time=10.0)
    seq.output_token_ids = [5, 6]
    seq.first_token_time, seq.token_times, seq.finish_time = 10.5, [10.5, 11.25], 11.25
    seq.num_preemptions = 2
    seq.finish_reason = "length"
    out = summarize([seq], duration_s=2.0)
    assert out["num_preemptions"] == 2
    assert out["metrics"]["ttft_s"]["mean"] == pytest.approx(0.5)
    assert out["metrics"]["tpot_s"]["mean"] == pytest.approx(0.75)
    assert out["metrics"]["total_token_throughput"] == pytest.approx(3.0)
    df = requests_to_dataframe([seq])
    assert df.loc[0, "request_id"] == 7 and df.loc[0, "e2el_s"] == pytest.approx(1.25)


def test_empty_inputs() -> None:
    assert stats([]) == {k: 0.0 for k in STAT_KEYS}
    out = summarize([], duration_s=0.0)
    assert out["num_requests"] == 0 and out["metrics"]["request_throughput"] == 0.0


def test_step_log_records_plans_and_exports() -> None:
    log = StepLog()
    a, b, c = Sequence(0, [1] * 6), Sequence(1, [2] * 3), Sequence(2, [3] * 2)
    b.output_token_ids = [5]
    prefill = StepPlan([ScheduledChunk(a, 4, 0, True, False), ScheduledChunk(b, 1, 3, False, True)])
    padded = StepPlan([ScheduledChunk(b, 1, 3, False, True)], preempted=[c], num_padding_tokens=3, num_idle_slots=1)
    log.record(prefill, 0.0, 0.25, num_blocks_used=10)
    row = log.record(padded, 0.25, 0.30, num_blocks_used=11)
    assert (row.num_prefill_tokens, row.num_decode_tokens, row.num_seqs, row.num_preempted) == (0, 1, 1, 1)
    assert (row.num_padding_tokens, row.num_idle_slots) == (3, 1)  # the static policy's counts are kept
    df = log.to_dataframe()
    assert list(df["step"]) == [0, 1]
    assert list(df["num_prefill_tokens"]) == [4, 0] and list(df["num_seqs"]) == [2, 1]
    assert df["duration_s"].tolist() == pytest.approx([0.25, 0.05])
    records = log.to_records()
    assert records[1]["num_preempted"] == 1 and records[1]["num_blocks_used"] == 11
