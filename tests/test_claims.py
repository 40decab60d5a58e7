"""Claim verdicts and sanity checks: numbers written by hand that support, contradict, or cannot decide each claim,
and the conclusion text that must say so."""

from __future__ import annotations

import pytest

from workbench import record
from workbench.experiments import claims as C
from workbench.experiments import hygiene as H
from workbench.experiments.trials import DecisionRule, run_rounds


def _prefill(n: int, t: float, spread: float = 0.0, intensity: float = 50.0, mfu: float = 0.6, mbu: float = 0.1):
    return {"prompt_len": n, "time_s": t, "time_min_s": t - spread, "time_max_s": t + spread,
            "intensity": intensity, "mfu": mfu, "mbu": mbu}  # fmt: skip


def _decode(b: int, t: float, spread: float = 0.0, ctx: int = 128, mbu: float = 0.7, mfu: float = 0.01):
    return {"phase": "decode", "batch": b, "context_len": ctx, "time_s": t, "time_min_s": t - spread,
            "time_max_s": t + spread, "tokens_per_s": b / t, "tokens_per_s_min": b / (t + spread),
            "tokens_per_s_max": b / (t - spread), "intensity": 0.5 * b, "mbu": mbu, "mfu": mfu}  # fmt: skip


def _cmp(a, b, direction="higher", margin=0.05, control=None, names=("A", "B"), records=None):
    """A Comparison of per-round values written by hand: one look at len(a) rounds (confidence 95% exactly)."""
    n = len(a)

    def arm(values, key):
        return lambda i: {**(records or {}).get(key, [{}] * n)[i], "x": values[i]} if records else values[i]

    arms = {names[0]: arm(a, names[0]), names[1]: arm(b, names[1])}
    ctl = arm(control, "control") if control else False
    return run_rounds(arms, DecisionRule(direction, margin), min_rounds=n, max_rounds=n, warmup=0, control=ctl,
                      metric="x" if records else None)  # fmt: skip


# B/A per round: 2.0, 2.2, 1.8, 2.0, 2.1, 1.9; logs .6931 .7885 .5878 .6931 .7419 .6419: mean .69106, ratio 1.9958
A6 = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
B6 = [2.0, 2.2, 1.8, 2.0, 2.1, 1.9]
AA = [1.01, 0.99, 1.0, 1.02, 0.98, 1.0]


def test_a_paired_claim_carries_ratio_interval_rounds_margin_and_control() -> None:
    c = C.batching_raises_throughput(_cmp(A6, B6, control=AA, names=("batch 1", "batch 8")), 1024, 1, 8)
    assert c["verdict"] == "confirmed" and c["uses"] == ["paired"]
    ev = c["evidence"]
    assert set(ev) >= {"ratio", "ci_low", "ci_high", "rounds", "margin", "confidence", "control"}
    assert ev["ratio"] == pytest.approx(1.9958, rel=1e-4) and ev["ci_low"] < ev["ratio"] < ev["ci_high"]
    assert ev["rounds"] == 6 and ev["margin"] == 0.05 and ev["confidence"] == 0.95 and ev["context_len"] == 1024
    assert ev["control"]["failed"] is False and ev["control"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert "batch 8/batch 1 = 2" in c["detail"] and "A/A 1" in c["detail"]
    text = C.claims_markdown([c])
    assert "**confirmed · 2x [" in text and "(95%, 6 rounds)" in text  # interval_text's, counting rounds


def test_interval_text_says_what_its_interval_is_and_what_it_counts() -> None:
    ev = {"ratio": 1.05, "ci_low": 0.95, "ci_high": 1.2, "rounds": 3, "interval": "min..max"}
    assert C.interval_text(ev) == "1.05x [0.95, 1.2] (min..max of 3 pairs)"  # a repeat_comparison's pairs
    assert C.interval_text({**ev, "rounds_unit": "repeats"}) == "1.05x [0.95, 1.2] (min..max of 3 repeats)"
    assert C.interval_text({**ev, "rounds": 1, "rounds_unit": "repeats"}).endswith("(min..max of 1 repeat)")
    assert C.interval_text({**ev, "rounds": None}).endswith("[0.95, 1.2] (min..max)")
    t = {"ratio": 2.0, "ci_low": 1.8, "ci_high": 2.2, "rounds": 6, "confidence": 0.95}
    assert C.interval_text(t) == "2x [1.8, 2.2] (95%, 6 pairs)"
    assert C.interval_text(t, "rounds") == "2x [1.8, 2.2] (95%, 6 rounds)"  # the unit given wins
    assert C.interval_text({**t, "ci_low": 2.0, "ci_high": 2.0, "rounds": 0, "confidence": None}) == "2x [2, 2] (exact)"
    assert C.interval_text({"ratio": None}) == "no ratio"


def test_paired_claims_say_opposite_equivalent_and_failed_control() -> None:
    slower = C.batching_raises_throughput(_cmp(A6, [0.25 * x for x in B6], control=AA), 128, 1, 8)
    assert slower["verdict"] == "not_confirmed" and "other way" in slower["detail"]
    # +-1% around 1: inside a 5% margin
    same = C.prefill_sets_ttft(_cmp(A6, [1.01, 0.99, 1.0, 1.01, 0.99, 1.0], control=AA), 16, 1024)
    assert same["verdict"] == "not_confirmed" and "inside the margin" in same["detail"]
    # the same arm "differs from itself" by 1.5x: the rounds were not comparable, whatever B/A says
    broken = C.batching_raises_throughput(_cmp(A6, B6, control=[1.5 * x for x in B6[:6]]), 128, 1, 8)
    assert broken["verdict"] == "inconclusive" and "A/A control failed" in broken["detail"]
    assert broken["evidence"]["control"]["failed"] is True


def test_serving_claims_read_their_figures_from_the_same_rounds() -> None:
    # static (A) against continuous (B): p99 TTFT halves, throughput +10% in every round
    rec = {"static": [{"output_throughput": 10.0}] * 6, "continuous": [{"output_throughput": 11.0}] * 6,
           "control": [{"output_throughput": 10.0}] * 6}  # fmt: skip
    cmp = _cmp([900.0] * 6, [450.0, 470, 430, 460, 440, 450], "lower", 0.10, control=[905.0, 895, 900, 910, 890, 900],
               names=("static", "continuous"), records=rec)  # fmt: skip
    claim = C.continuous_beats_static(cmp, "azure-conv")
    assert claim["verdict"] == "confirmed" and "azure-conv" in claim["claim"]
    assert claim["evidence"]["throughput"]["ratio"] == pytest.approx(1.1)
    assert "1.1x [1.1, 1.1]" in claim["detail"]
    # the stall and TTFT claims of notebook 04 from one set of rounds: stall 11x lower, TTFT 22% higher
    rec = {"one-step": [{"long_ttft_ms": 4121.0}] * 6, "chunked": [{"long_ttft_ms": 5012.0 + i} for i in range(6)],
           "control": [{"long_ttft_ms": 4121.0}] * 6}  # fmt: skip
    stall = _cmp([4284.0] * 6, [379.0, 390, 370, 385, 375, 380], "lower", 0.10, control=[4280.0, 4290] * 3,
                 names=("one-step", "chunked"), records=rec)  # fmt: skip
    assert C.chunking_removes_stalls(stall)["verdict"] == "confirmed"
    price = C.chunking_costs_ttft(stall.on("long_ttft_ms", DecisionRule("higher", 0.10)))
    assert price["verdict"] == "confirmed" and price["evidence"]["ratio"] == pytest.approx(5014.5 / 4121, rel=1e-3)
    worse = [420.0, 430, 410, 425, 415, 420]
    tail = C.chunking_lowers_tail_itl(_cmp([300.0] * 6, worse, "lower", 0.10, [300 * x for x in AA]))
    assert tail["verdict"] == "not_confirmed" and "other way" in tail["detail"]


def test_prefill_compute_bound_rests_on_absolute_figures() -> None:
    ok = C.prefill_compute_bound([_prefill(16, 0.010), _prefill(256, 0.100)], balance_point=10.0)
    assert ok["verdict"] == "confirmed" and "timing" in ok["uses"]
    low = C.prefill_compute_bound([_prefill(16, 0.01), _prefill(256, 0.1, intensity=5.0)], balance_point=10.0)
    assert low["verdict"] == "not_confirmed"
    side = C.prefill_compute_bound([_prefill(256, 0.1, mfu=0.05, mbu=0.3)], balance_point=10.0)
    assert side["verdict"] == "not_confirmed" and "MFU 0.05" in side["detail"]


def test_roofline_claims_carry_intensity_over_balance_with_the_ceiling_readings_interval() -> None:
    # four ceiling readings (start and end settles): balance points 8, 10, 12, 10 FLOP/byte
    rec = {"ceilings_start": {"settle": {"readings": [{"peak_flops_dtype": 80.0, "mem_bandwidth": 10.0},
                                                      {"peak_flops_dtype": 100.0, "mem_bandwidth": 10.0}]}},
           "ceilings_end": {"settle": {"readings": [{"peak_flops_dtype": 120.0, "mem_bandwidth": 10.0},
                                                    {"peak_flops_dtype": 50.0, "mem_bandwidth": 5.0}]}}}  # fmt: skip
    readings = H.balance_points(rec)
    assert readings == pytest.approx([8.0, 10.0, 12.0, 10.0])
    ok = C.prefill_compute_bound([_prefill(256, 0.1, intensity=50.0)], 10.0, readings)
    ev = ok["evidence"]
    assert ok["verdict"] == "confirmed" and ev["rounds"] == 4 and ev["margin"] == 0.10 and ev["confidence"] == 0.95
    assert ev["ratio"] == pytest.approx(50.0 / 9600**0.25, rel=1e-9)  # the geometric mean of 50 / reading
    assert ev["ci_low"] < 50.0 / 10.0 < ev["ci_high"] and ev["ci_high"] < 50.0 / 8.0 * 1.5
    # an intensity at the balance point itself: the interval straddles the margin
    assert C.prefill_compute_bound([_prefill(256, 0.1, intensity=10.0)], 10.0, readings)["verdict"] == "inconclusive"
    dec = C.decode_bandwidth_bound([_decode(1, 0.05)], 10.0, readings)  # intensity 0.5
    assert dec["verdict"] == "confirmed" and dec["evidence"]["ratio"] == pytest.approx(0.5 / 9600**0.25)
    assert "[" in C.claims_markdown([dec]).split("**")[1]  # the ratio with its interval next to the verdict
    # no readings: the one balance point, a min..max interval of one pair
    one = C.prefill_compute_bound([_prefill(256, 0.1, intensity=50.0)], 10.0)["evidence"]
    assert (one["ratio"], one["ci_low"], one["ci_high"], one["rounds"]) == (pytest.approx(5.0),) * 3 + (1,)
    assert one["interval"] == "min..max" and one["confidence"] is None


def test_decode_claim_needs_mbu_above_mfu_below_balance() -> None:
    assert C.decode_bandwidth_bound([_decode(1, 0.05)], balance_point=10.0)["verdict"] == "confirmed"
    assert C.decode_bandwidth_bound([_decode(1, 0.05, mbu=0.01, mfu=0.5)], 10.0)["verdict"] == "not_confirmed"


def test_kv_head_claims() -> None:
    good = {"MHA": {"num_kv_heads": 8, "bytes_per_token": 4096, "max_seqs": 10},
            "MQA": {"num_kv_heads": 1, "bytes_per_token": 512, "max_seqs": 80}}  # fmt: skip
    assert C.fewer_kv_heads_fewer_bytes(good)["verdict"] == "confirmed"
    bad = {**good, "MQA": {"num_kv_heads": 1, "bytes_per_token": 512, "max_seqs": 5}}
    assert C.fewer_kv_heads_fewer_bytes(bad)["verdict"] == "not_confirmed"
    faster = C.fewer_kv_heads_faster_decode(_cmp(A6, B6, control=AA, names=("MHA", "MQA")), 512, 8)
    assert faster["verdict"] == "confirmed" and faster["uses"] == ["paired"]
    assert faster["evidence"]["context_len"] == 512 and faster["evidence"]["batch"] == 8
    assert "8 sequences at context 512, MQA against MHA" in faster["detail"]
    # MQA at half MHA's tokens/s in every round: slower, the other way
    slower = C.fewer_kv_heads_faster_decode(_cmp(A6, [0.5] * 6, control=AA, names=("MHA", "MQA")), 512, 8)
    assert slower["verdict"] == "not_confirmed" and "other way" in slower["detail"]
    assert C.paging_wastes_less(0.8, 0.02, 16)["verdict"] == "confirmed"


def test_drift_voids_absolute_claims_not_paired_ones(tmp_path) -> None:
    # 1.25x the balance point (exact): widened by the drift's x1.6 it is [0.78, 2.0], which the drift could have made
    absolute = C.prefill_compute_bound([_prefill(16, 0.010), _prefill(256, 0.100)], balance_point=40.0)
    paired = C.batching_raises_throughput(_cmp(A6, B6, control=AA), 128, 1, 8)
    analytic = C.paging_wastes_less(0.8, 0.02, 16)
    flagged = H.check_drift({"decode": 0.6, "prefill": 0.01}) + H.check_ceilings({"peak_flops": 0.35})
    assert [a["affects"] for a in flagged] == ["timing", "ceilings"]
    final = C.apply_anomalies([absolute, paired, analytic], flagged)
    assert final[0]["verdict"] == "inconclusive" and final[0]["verdict_from_numbers"] == "confirmed"
    assert final[0]["unreliable"] and final[1] == paired and final[2]["verdict"] == "confirmed"
    assert len(final[0]["unreliable_because"]) == 2  # an MFU rests on a time and on a ceiling
    text = C.claims_markdown(final, flagged)
    assert "Unreliable results" in text and "+60%" in text and "the numbers alone say confirmed" in text
    record.reset()
    record.set_output_dir(tmp_path)
    md = record.conclude([absolute, paired, analytic], flagged)
    saved = record.recorded()
    assert [c["verdict"] for c in saved["claims"]] == ["inconclusive", "confirmed", "confirmed"]
    assert saved["claims"][1]["evidence"]["ci_low"] > 1.05
    assert saved["anomalies"] == flagged and "inconclusive" in md
    record.reset()


def test_a_moving_ceiling_voids_only_the_claims_divided_by_it() -> None:
    # a simulator-against-engine claim (notebook 07) compares times measured in one notebook: the reference step's
    # drift voids it, a ceiling that moved does not; an MFU claim rests on both (1.25x its balance point: the
    # ceilings' x1.35 move could have made that, [0.93, 1.69])
    sim = C.make_claim("The simulator reproduces TTFT", "confirmed", {}, "within 10%")
    mfu = C.prefill_compute_bound([_prefill(256, 0.1)], 40.0)
    moved = H.check_ceilings({"peak_flops": 0.35, "mem_bandwidth": 0.30})
    final = C.apply_anomalies([sim, mfu], moved)
    assert final[0]["verdict"] == "confirmed" and "unreliable" not in final[0]
    assert final[1]["verdict"] == "inconclusive" and final[1]["unreliable"]
    drifted = C.apply_anomalies([sim], H.check_drift({"prefill": -0.3}))
    assert drifted[0]["verdict"] == "inconclusive"


def _spec(peak_gflops: float, bw_gbs: float, repeatability: float = 0.05):
    from workbench.hardware import HardwareSpec

    return HardwareSpec(name="measured", peak_flops={"fp32": peak_gflops * 1e9, "bf16": 2e9},
                        mem_bandwidth=bw_gbs * 1e9, mem_capacity=1e9, source="synthetic",
                        details={"repeatability": repeatability, "measured_at": "t"})  # fmt: skip


def _probe(*readings):
    """A ``measure`` that returns the given (GFLOP/s, GB/s, repeatability) readings in turn, counting its calls."""
    it = iter(readings)

    def measure():
        measure.calls += 1
        return _spec(*next(it))

    measure.calls = 0
    return measure


def test_settled_ceilings_probe_until_two_readings_agree_and_keep_the_best() -> None:
    # the start reading 20-35% low (55 vs 78 GFLOP/s, as on the VM): a second reading disagrees (78/55 - 1 > 10%),
    # the third agrees with the second within 10% of 80: settled after 3, the figure the best of all three
    probe = _probe((55, 15, 0.05), (78, 19, 0.05), (80, 20, 0.05), (10, 1, 0.05))
    hw = H.settled_ceilings(probe, "fp32")
    assert probe.calls == 3 and hw.details["settle"]["settled"]
    assert hw.peak("fp32") == pytest.approx(80e9) and hw.mem_bandwidth == pytest.approx(20e9)
    assert hw.peak_flops["bf16"] == pytest.approx(2e9)
    assert [r["peak_flops_dtype"] for r in hw.details["settle"]["readings"]] == pytest.approx([55e9, 78e9, 80e9])
    # the bandwidth must agree too: 78 -> 80 GFLOP/s agrees, 15 -> 19 GB/s does not (4/19 = 21% > 10%)
    probe = _probe((78, 15, 0.05), (80, 19, 0.05), (80, 19.5, 0.05))
    assert H.settled_ceilings(probe, "fp32").mem_bandwidth == pytest.approx(19.5e9) and probe.calls == 3
    # the probes' own repeatability widens the tolerance: 70 vs 80 GFLOP/s differ by 12.5%, within a 0.27 spread
    probe = _probe((70, 20, 0.27), (80, 20, 0.05))
    assert H.settled_ceilings(probe, "fp32").details["settle"]["settled"] and probe.calls == 2
    # bounded: readings that never agree stop at `tries`, marked unsettled, the best kept
    probe = _probe((40, 20, 0.0), (60, 20, 0.0), (40, 20, 0.0), (60, 20, 0.0), (99, 99, 0.0))
    hw = H.settled_ceilings(probe, "fp32", tries=4)
    assert probe.calls == 4 and not hw.details["settle"]["settled"] and hw.peak("fp32") == pytest.approx(60e9)
    with pytest.raises(ValueError, match="tries"):
        H.settled_ceilings(probe, "fp32", tries=1)


def test_sanity_checks_by_hand() -> None:
    rows = [{"phase": "prefill", "batch": 1, "context_len": 64, "mfu": 1.498, "mbu": 0.2},
            {"phase": "decode", "batch": 1, "context_len": 64, "mfu": 0.01, "mbu": 1.05}]  # fmt: skip
    flagged = H.check_utilization(rows)
    assert [a["check"] for a in flagged] == ["mfu_above_1"] and "1.50" in flagged[0]["message"]
    # notebook 02's numbers from the issue: batch 8 at 137 ms vs 3.8 s; per token the larger batch is slower
    slow = H.check_batching([_decode(1, 0.150, 0.01), _decode(8, 2.72, 0.1), _decode(16, 2.0, 0.1)])
    assert [a["batches"] for a in slow] == [[1, 8]]
    assert "disturbed" not in slow[0]["message"]  # the engine's own numbers never blame the machine
    assert H.check_batching([_decode(1, 0.05, 0.01), _decode(8, 0.2, 0.01)]) == []
    # one-sided: only an end reading above the start's (the start's ceiling was too low) is flagged
    moved = H.check_ceilings({"peak_flops": 0.5, "mem_bandwidth": -0.4})
    assert [(a["ceiling"], a["affects"]) for a in moved] == [("peak_flops", "ceilings")]
    assert H.check_ceilings({"peak_flops": 0.2, "mem_bandwidth": -0.9}) == []
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
    # a claim on a time and a ceiling, voided by an MBU above 1 (a drift alone leaves this 25x effect decided)
    moved = flagged + H.check_utilization([{"mbu": 1.5, "batch": 1}])
    timed = C.apply_anomalies([C.prefill_compute_bound([_prefill(256, 0.1)], 10.0)], moved)
    manifest["experiments"][0]["metrics"]["claims"] = timed
    assert "numbers alone: confirmed" in render_run_index(manifest, {})
    assert "1,235" in page and "12,000" in page  # one number format per column
    assert 'src="first/figures/a.png"' in page


def test_a_drift_voids_only_the_claims_it_could_have_turned() -> None:
    """A claim on times measured at different moments, flagged by a reference step that got 59% slower: its
    interval widened by x1.59 (lows divided, highs multiplied) still decides an effect far beyond its margin, so it
    keeps its verdict; an effect the drift could have made or hidden goes inconclusive; any other anomaly voids."""
    drift = H.check_drift({"prefill": 0.59})
    far = C.make_claim("far", "confirmed", {"ratio": 0.365, "ci_low": 0.36, "ci_high": 0.37, "margin": 0.1,
                                            "direction": "lower"}, "ops 0.365x of a step")  # fmt: skip
    near = C.make_claim("near", "confirmed", {"ratio": 0.82, "ci_low": 0.80, "ci_high": 0.85, "margin": 0.1,
                                              "direction": "lower"}, "0.82x")  # fmt: skip
    within = C.make_claim("within", "confirmed", {"ratio": 0.95, "ci_low": 0.9, "ci_high": 1.05, "margin": 0.1,
                                                  "direction": "within"}, "a fidelity claim")  # fmt: skip
    held, voided, fidelity = C.apply_anomalies([far, near, within], drift)
    # by hand: 0.37 * 1.59 = 0.5883 < 1 / 1.1 = 0.909 -> still lower by more than 10%
    assert held["verdict"] == "confirmed" and not held.get("unreliable")
    bound = held["evidence"]["drift_bound"]
    assert bound["factor"] == pytest.approx(1.59) and bound["ci_high"] == pytest.approx(0.5883)
    assert bound["ci_low"] == pytest.approx(0.36 / 1.59) and "widened by the machine's drift" in held["detail"]
    # 0.85 * 1.59 = 1.35 straddles the margin: the drift could have made this effect
    assert voided["verdict"] == "inconclusive" and voided["verdict_from_numbers"] == "confirmed"
    assert fidelity["verdict"] == "inconclusive"  # a 'within' claim has no direction to widen against
    # a machine that got faster by 40% bounds the bias at 1 / 0.6
    faster = C.drift_bound(far, H.check_drift({"decode": -0.4}))
    assert faster["factor"] == pytest.approx(1 / 0.6) and faster["verdict"] == "confirmed"
    # any other anomaly beside the drift voids: an MBU above 1 says the count or the ceiling is wrong
    on_ceiling = {**far, "uses": ["timing", "ceilings"]}
    flagged = C.apply_anomalies([on_ceiling], drift + H.check_utilization([{"mbu": 1.5, "batch": 1}]))[0]
    assert flagged["verdict"] == "inconclusive" and flagged["unreliable"]


def test_a_moving_ceiling_bounds_a_balance_point_claim_instead_of_voiding_it() -> None:
    """A quiet report's prefill claim: intensity / balance point 16.46 [14.59, 18.56], claimed higher by 10%, while
    the bandwidth probe read +32% at the end. A balance point (peak / bandwidth) moves by at most x1.32 with it:
    [14.59 / 1.32, 18.56 * 1.32] = [11.05, 24.50], all above 1.1, so the claim stays confirmed. A 1.3x [1.2, 1.4]
    effect widened the same way is [0.91, 1.85]: the ceiling's move could have made it, so it goes inconclusive."""
    moved = H.check_ceilings({"mem_bandwidth": 0.32, "peak_flops": 0.05})  # only the bandwidth is beyond 25%
    assert [a["ceiling"] for a in moved] == ["mem_bandwidth"]
    far = C.make_claim("far", "confirmed", {"ratio": 16.46, "ci_low": 14.59, "ci_high": 18.56, "margin": 0.1,
                                            "direction": "higher"}, "16.5x", uses=("timing", "ceilings"))  # fmt: skip
    near = C.make_claim("near", "confirmed", {"ratio": 1.3, "ci_low": 1.2, "ci_high": 1.4, "margin": 0.1,
                                              "direction": "higher"}, "1.3x", uses=("timing", "ceilings"))  # fmt: skip
    held, voided = C.apply_anomalies([far, near], moved)
    assert held["verdict"] == "confirmed" and not held.get("unreliable") and held["held_despite"]
    bound = held["evidence"]["drift_bound"]
    assert bound["factor"] == pytest.approx(1.32)
    assert bound["ci_low"] == pytest.approx(11.053, abs=1e-3) and bound["ci_high"] == pytest.approx(24.499, abs=1e-3)
    assert voided["verdict"] == "inconclusive" and voided["verdict_from_numbers"] == "confirmed"
    assert voided["evidence"].get("drift_bound") is None and voided["unreliable"]
