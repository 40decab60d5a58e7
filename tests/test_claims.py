"""Claim verdicts and sanity checks: numbers written by hand that support, contradict, or cannot decide each claim,
and the conclusion text that must say so."""

from __future__ import annotations

import pytest

from workbench import record
from workbench.experiments import claims as C
from workbench.experiments import hygiene as H


def _prefill(n: int, t: float, spread: float = 0.0, intensity: float = 50.0, mfu: float = 0.6, mbu: float = 0.1):
    return {"prompt_len": n, "time_s": t, "time_min_s": t - spread, "time_max_s": t + spread,
            "intensity": intensity, "mfu": mfu, "mbu": mbu}  # fmt: skip


def _decode(b: int, t: float, spread: float = 0.0, ctx: int = 128, mbu: float = 0.7, mfu: float = 0.01):
    return {"phase": "decode", "batch": b, "context_len": ctx, "time_s": t, "time_min_s": t - spread,
            "time_max_s": t + spread, "tokens_per_s": b / t, "tokens_per_s_min": b / (t + spread),
            "tokens_per_s_max": b / (t - spread), "intensity": 0.5 * b, "mbu": mbu, "mfu": mfu}  # fmt: skip


def test_prefill_claim_confirmed_contradicted_and_noise() -> None:
    ok = C.prefill_compute_bound([_prefill(16, 0.010, 0.001), _prefill(256, 0.100, 0.005)], balance_point=10.0)
    assert ok["verdict"] == "confirmed"
    # TTFT fell as the prompt grew (beyond the spread): not confirmed, and the numbers are in the text
    bad = C.prefill_compute_bound([_prefill(16, 0.100, 0.001), _prefill(256, 0.010, 0.001)], balance_point=10.0)
    assert bad["verdict"] == "not_confirmed" and "100.0" in bad["detail"] and "10.0" in bad["detail"]
    # below the balance point: not compute-bound
    low = C.prefill_compute_bound([_prefill(16, 0.01), _prefill(256, 0.1, intensity=5.0)], balance_point=10.0)
    assert low["verdict"] == "not_confirmed"
    noisy = C.prefill_compute_bound([_prefill(16, 0.010, 0.008), _prefill(256, 0.015, 0.008)], balance_point=10.0)
    assert noisy["verdict"] == "inconclusive" and "overlap" in noisy["detail"]


def test_decode_claim_needs_mbu_above_mfu_below_balance() -> None:
    assert C.decode_bandwidth_bound([_decode(1, 0.05)], balance_point=10.0)["verdict"] == "confirmed"
    assert C.decode_bandwidth_bound([_decode(1, 0.05, mbu=0.01, mfu=0.5)], 10.0)["verdict"] == "not_confirmed"


def test_batching_claim_from_spreads() -> None:
    # batch 8 step 0.2 s -> 40 tok/s; batch 1 0.05 s -> 20 tok/s
    assert C.batching_raises_throughput([_decode(1, 0.05, 0.002), _decode(8, 0.2, 0.01)])["verdict"] == "confirmed"
    # the issue's numbers: batch 2 at 4.37 s against batch 1 at 0.41 s: throughput fell
    bad = C.batching_raises_throughput([_decode(1, 0.41, 0.01), _decode(2, 4.37, 0.1)])
    assert bad["verdict"] == "not_confirmed" and bad["evidence"]["gain"] == pytest.approx(2 / 4.37 / (1 / 0.41))
    noisy = C.batching_raises_throughput([_decode(1, 0.05, 0.02), _decode(2, 0.09, 0.03)])
    assert noisy["verdict"] == "inconclusive"


def test_continuous_vs_static() -> None:
    s = {"output_throughput": 100.0, "ttft_p99_ms": 900.0}
    assert C.continuous_beats_static(s, {"output_throughput": 130.0, "ttft_p99_ms": 500.0}, "w")["verdict"] == (
        "confirmed"
    )
    lost = C.continuous_beats_static(s, {"output_throughput": 80.0, "ttft_p99_ms": 850.0}, "azure-conv")
    assert lost["verdict"] == "not_confirmed" and "80.0" in lost["detail"] and "azure-conv" in lost["claim"]
    same = C.continuous_beats_static(s, {"output_throughput": 102.0, "ttft_p99_ms": 880.0}, "w")
    assert same["verdict"] == "inconclusive"


def test_chunking_claims_catch_the_issue_numbers() -> None:
    # "The price: the long prompt's TTFT went from 13783 ms to 9613 ms" is a decrease: no price, not confirmed
    price = C.chunking_costs_ttft(13783, 9613)
    assert price["verdict"] == "not_confirmed" and "fell" in price["detail"] and "no TTFT price" in price["detail"]
    assert C.chunking_costs_ttft(1000, 1400)["verdict"] == "confirmed"
    assert C.chunking_removes_stalls(800, 120)["verdict"] == "confirmed"
    assert C.chunking_removes_stalls(120, 800)["verdict"] == "not_confirmed"
    tail = C.chunking_lowers_tail_itl({"continuous": 300.0, "decode-first": 250.0, "chunked": 420.0})
    assert tail["verdict"] == "not_confirmed" and "chunked 420 ms" in tail["detail"]


def test_kv_head_claims() -> None:
    good = {"MHA": {"num_kv_heads": 8, "bytes_per_token": 4096, "max_seqs": 10},
            "MQA": {"num_kv_heads": 1, "bytes_per_token": 512, "max_seqs": 80}}  # fmt: skip
    assert C.fewer_kv_heads_fewer_bytes(good)["verdict"] == "confirmed"
    bad = {**good, "MQA": {"num_kv_heads": 1, "bytes_per_token": 512, "max_seqs": 5}}
    assert C.fewer_kv_heads_fewer_bytes(bad)["verdict"] == "not_confirmed"
    t = {"MHA": {"num_kv_heads": 8, "time_s": 0.010, "time_min_s": 0.009, "time_max_s": 0.011},
         "MQA": {"num_kv_heads": 1, "time_s": 0.020, "time_min_s": 0.019, "time_max_s": 0.021}}  # fmt: skip
    assert C.fewer_kv_heads_faster_decode(t, 512)["verdict"] == "not_confirmed"
    assert C.paging_wastes_less(0.8, 0.02, 16)["verdict"] == "confirmed"


def test_anomalies_make_dependent_claims_inconclusive_and_the_text_says_so(tmp_path) -> None:
    claim = C.batching_raises_throughput([_decode(1, 0.05, 0.002), _decode(8, 0.2, 0.01)])
    analytic = C.paging_wastes_less(0.8, 0.02, 16)
    flagged = H.check_drift({"decode": 0.6, "prefill": 0.01})
    assert len(flagged) == 1 and flagged[0]["affects"] == "timing"
    final = C.apply_anomalies([claim, analytic], flagged)
    assert final[0]["verdict"] == "inconclusive" and final[0]["verdict_from_numbers"] == "confirmed"
    assert final[0]["unreliable"] and final[1]["verdict"] == "confirmed"
    text = C.claims_markdown(final, flagged)
    assert "Unreliable results" in text and "+60%" in text and "the numbers alone say confirmed" in text
    record.reset()
    record.set_output_dir(tmp_path)
    md = record.conclude([claim, analytic], flagged)
    saved = record.recorded()
    assert [c["verdict"] for c in saved["claims"]] == ["inconclusive", "confirmed"]
    assert saved["anomalies"] == flagged and "inconclusive" in md
    record.reset()


def test_sanity_checks_by_hand() -> None:
    rows = [{"phase": "prefill", "batch": 1, "context_len": 64, "mfu": 1.498, "mbu": 0.2},
            {"phase": "decode", "batch": 1, "context_len": 64, "mfu": 0.01, "mbu": 1.05}]  # fmt: skip
    flagged = H.check_utilization(rows)
    assert [a["check"] for a in flagged] == ["mfu_above_1"] and "1.50" in flagged[0]["message"]
    # notebook 02's numbers from the issue: batch 8 at 137 ms vs 3.8 s; per token the larger batch is slower
    slow = H.check_batching([_decode(1, 0.150, 0.01), _decode(8, 2.72, 0.1), _decode(16, 2.0, 0.1)])
    assert [a["batches"] for a in slow] == [[1, 8]]
    assert H.check_batching([_decode(1, 0.05, 0.01), _decode(8, 0.2, 0.01)]) == []
    moved = H.check_ceilings({"peak_flops": -0.5, "mem_bandwidth": 0.1})
    assert [(a["ceiling"], a["affects"]) for a in moved] == [("peak_flops", "timing")]
    assert H.check_drift({"decode": 0.2}) == []
    assert H.steal_share({"total": 100, "steal": 5}, {"total": 300, "steal": 25}) == pytest.approx(0.1)


def test_index_shows_the_running_experiment_verdicts_and_anomalies() -> None:
    from workbench.pipeline.index import render_run_index

    claim = C.paging_wastes_less(0.8, 0.02, 16)
    flagged = H.check_drift({"decode": 0.6})
    manifest = {
        "run_id": "r1",
        "complete": False,
        "running": "second",
        "pending": ["second", "third"],
        "experiments": [
            {"name": "first", "status": "ok", "duration_s": 1.0, "figures": ["first/figures/a.png"],
             "metrics": {"claims": [claim], "anomalies": flagged, "ttft_ms": 1234.5678, "n": 12000}},
        ],
    }  # fmt: skip
    page = render_run_index(manifest, {})
    assert "running second" in page and ">running<" in page and ">pending<" in page and "Not run" not in page
    assert "1 confirmed" in page and "Unreliable" in page and "+60%" in page
    timed = C.apply_anomalies([C.chunking_costs_ttft(1000, 1400)], flagged)
    manifest["experiments"][0]["metrics"]["claims"] = timed
    assert "numbers alone: confirmed" in render_run_index(manifest, {})
    assert "1,235" in page and "12,000" in page  # one number format per column
    assert 'src="first/figures/a.png"' in page
