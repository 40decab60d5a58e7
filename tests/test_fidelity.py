"""Fidelity bookkeeping (``workbench.experiments.fidelity``): spread, tolerance and verdicts against hand-computed
numbers."""

from __future__ import annotations

import pytest

from workbench.experiments.claims import CONFIRMED, INCONCLUSIVE, NOT_CONFIRMED, claims_markdown
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
    # its ratio: the worst statistic's simulated / measured, 11.5 ms against three repeats of 10 ms
    ev = claim["evidence"]
    assert (ev["ratio"], ev["ci_low"], ev["ci_high"]) == (pytest.approx(1.15),) * 3
    assert ev["rounds"] == 3 and ev["margin"] == pytest.approx(0.10) and ev["direction"] == "within"
    # three measured repeats against one simulated value: repeats, not pairs, in the conclusion's text
    assert "1.15x [1.15, 1.15] (min..max of 3 repeats)" in claims_markdown([claim])
    # the TTFT median's: 120 ms against repeats 100..120 ms (median 110)
    t = fidelity_claim([{**ttft, "model": "n"}], "n")["evidence"]
    assert (t["ratio"], t["ci_low"], t["ci_high"]) == (pytest.approx(12 / 11), pytest.approx(1.0), pytest.approx(1.2))


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


def test_a_profile_is_of_this_machine_only_when_every_fact_it_recorded_matches() -> None:
    from workbench.sim.measure import identity_mismatch

    here = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 2, "cpu_capability": "AVX512"}
    # the same generic CPU name on a part of another kind (AVX2): not this machine's profile
    other = {**here, "cpu_capability": "AVX2"}
    (why,) = identity_mismatch(other, here)
    assert why.startswith("cpu_capability 'AVX2'") and "AVX512" in why
    assert identity_mismatch({"cpu": "Intel(R) Xeon(R) Processor"}, here) == []  # an older file: what it recorded
    assert len(identity_mismatch({"cpu": "AMD EPYC 7B13", "cpu_count": 4}, here)) == 2


def test_a_profile_measured_beyond_its_cpus_load_is_marked_loaded() -> None:
    from workbench.experiments.fidelity import profile_provenance
    from workbench.sim.costmodel import ProfiledCostModel

    def profiled(meta: dict) -> ProfiledCostModel:
        return ProfiledCostModel({"const": 1e-3}, meta=meta)

    busy = profile_provenance("profiled", profiled({"machine": "x", "cpu_count": 2, "load_average_1min": [1.5, 3.2]}))
    assert busy["loaded"] is True and busy["load_average_1min"] == [1.5, 3.2]
    quiet = profile_provenance("profiled", profiled({"machine": "x", "cpu_count": 2, "load_average_1min": [0.4, 1.1]}))
    assert quiet["loaded"] is False
    assert profile_provenance("profiled", profiled({"machine": "x"}))["loaded"] is None  # not recorded: unknown


def test_the_training_workloads_include_one_of_steps_after_idle_waits() -> None:
    from workbench.sim.measure import training_workloads

    sparse = training_workloads(256, num_requests=24, seed=1000)[-1]
    gaps = [b.arrival_time_s - a.arrival_time_s for a, b in zip(sparse, sparse[1:])]
    assert len(sparse) == 12 and max(r.output_len for r in sparse) <= 8
    assert 0.3 < sum(gaps) / len(gaps) < 0.7 and min(gaps) > 0.1  # near-regular arrivals 0.5 s apart


def test_the_published_claim_holds_the_issues_bar() -> None:
    from workbench.experiments.fidelity import published_claim

    def summary(med: float, top: float) -> dict:
        return {"gptfast": {"n": 13, "median_abs_error": 0.1, "max_abs_error": 0.2},
                "all": {"n": 29, "median_abs_error": med, "max_abs_error": top}}  # fmt: skip

    assert published_claim(summary(0.08, 0.27))["verdict"] == CONFIRMED
    assert published_claim(summary(0.08, 0.31))["verdict"] == NOT_CONFIRMED  # one case beyond 30%
    assert published_claim(summary(0.16, 0.20))["verdict"] == NOT_CONFIRMED  # the median beyond 15%


def test_the_best_cost_model_is_the_one_with_most_statistics_within_by_hand() -> None:
    from workbench.experiments.fidelity import best_cost_model

    def row(model: str, within: bool, err: float) -> dict:
        return {"model": model, "within": within, "rel_error": err, "policy": "p", "statistic": "ttft median",
                "measured_ms": 100.0, "measured_min_ms": 90.0, "measured_max_ms": 125.0, "spread": 0.25,
                "simulated_ms": 100.0 * (1 + err), "tolerance": 0.25, "num_repeats": 3}  # fmt: skip

    rows = [row("op-profile", True, 0.05), row("op-profile", False, -0.5), row("profiled", True, 0.09),
            row("profiled", True, -0.02), row("profiled noise", True, 0.2),
            row("profiled noise", True, 0.01)]  # fmt: skip
    claim = best_cost_model(rows)
    # profiled and profiled noise both hold 2/2; profiled's worst (9%) is below the noise variant's (20%)
    assert claim["evidence"]["best"] == "profiled" and claim["verdict"] == CONFIRMED
    assert claim["evidence"]["op-profile"] == {"num_within": 1, "num_statistics": 2, "max_abs_rel_error": 0.5}
    assert "best: profiled, 2/2" in claim["detail"]
    # the ratio is the best model's worst statistic's: 109 ms simulated against 100 (repeats 90..125)
    ev = claim["evidence"]
    assert (ev["ratio"], ev["ci_low"], ev["ci_high"]) == (pytest.approx(1.09), pytest.approx(109 / 125),
                                                          pytest.approx(109 / 90))  # fmt: skip
    assert ev["margin"] == 0.25 and ev["rounds"] == 3
    assert best_cost_model(rows[:2])["verdict"] == NOT_CONFIRMED
    # profiled's 9% is inside 10%; at 20% off, within only because its repeats spread 35% (> NOISY_SPREAD): no verdict
    noisy = [{**r, "spread": 0.35} for r in (row("profiled", True, 0.2), row("profiled", True, -0.02))]
    claim = best_cost_model(noisy)
    assert claim["verdict"] == INCONCLUSIVE and "only thanks to a spread > 25%" in claim["detail"]
    assert best_cost_model([{**r, "spread": 0.2} for r in noisy])["verdict"] == CONFIRMED  # a spread below 25%


def test_the_overhead_claim_carries_the_mean_ratio_with_its_t_interval() -> None:
    from workbench.experiments.fidelity import overhead_claim

    fit = {"ops_only_mean_signed_rel_error": -0.2, "ops_only_signed_rel_error_sd": 0.1, "num_steps": 20,
           "num_idle_steps": 4, "ops_only_median_rel_error": 0.2, "median_rel_error": 0.03}  # fmt: skip
    claim = overhead_claim({"fit": fit, "coefficients": {}})
    ev = claim["evidence"]
    assert claim["verdict"] == CONFIRMED and ev["rounds"] == 16 and ev["ratio"] == pytest.approx(0.8)
    half = 2.131 * 0.1 / 4  # t(0.975, 15 df) from the tables, 16 busy steps
    assert (ev["ci_low"], ev["ci_high"]) == (pytest.approx(0.8 - half, abs=1e-3), pytest.approx(0.8 + half, abs=1e-3))
    assert "0.8x [0.747, 0.853] (95%, 16 steps)" in claims_markdown([claim])  # 0.8 -+ 0.0533
    old = overhead_claim({"fit": {k: v for k, v in fit.items() if k != "ops_only_signed_rel_error_sd"},
                          "coefficients": {}})["evidence"]  # fmt: skip
    assert old["ratio"] == pytest.approx(0.8) and old["ci_low"] is None and old["interval"].startswith("none")


def test_the_handoff_leaves_out_announcements_that_waited_for_a_decode_step() -> None:
    """The decode engine reads its inbox between steps: a KV announced mid-step waited for that step's end, which the
    simulator adds itself, so it is not part of the handoff (1 and 2 ms are; 10 ms, sent mid-step, is not)."""
    from types import SimpleNamespace

    from workbench.cluster.disagg import DisaggResult
    from workbench.experiments.fidelity import handoff_profile

    def transfer(num_bytes: int, token: float, handoff: float) -> dict:
        return {"kv_transfer_bytes": num_bytes, "timeline": {"prefill_token_s": token, "sent_s": token + 0.0001,
                "announced_s": token + handoff, "receive_posted_s": token + handoff,
                "landed_s": token + handoff + 0.001 + num_bytes * 1e-6}}  # fmt: skip

    transfers = {0: transfer(1000, 1.0, 0.001), 1: transfer(2000, 2.0, 0.010), 2: transfer(3000, 3.0, 0.002)}
    pools = {"prefill0": {"steps": []}, "decode0": {"steps": [{"start_s": 1.995, "end_s": 2.0099}]}}
    requests = [SimpleNamespace(request_id=i, arrival_time=float(i)) for i in range(3)]
    profile = handoff_profile(DisaggResult(requests, transfers, pools, 4.0, 0, {i: (0, 0) for i in range(3)}))
    assert profile["num_handoffs"] == 2
    assert profile["kv_handoff_s"] == pytest.approx(0.0015)  # the median of 1 and 2 ms
    assert min(profile["kv_handoff_quantiles_s"]) == pytest.approx(0.001)
    assert max(profile["kv_handoff_quantiles_s"]) == pytest.approx(0.002)


def test_the_handoffs_rank_correlation_with_their_prefill_steps_by_hand() -> None:
    """Four requests, each prefilled alone in a step of the same size: the steps' residuals are their durations less
    the mean, and the handoffs' ranks against theirs give Spearman's 1 - 6 * 4 / (4 * 15) = 0.6."""
    from types import SimpleNamespace

    from workbench.cluster.disagg import DisaggResult
    from workbench.experiments.fidelity import handoff_profile

    durations, handoffs = [0.001, 0.002, 0.003, 0.004], [0.0020, 0.0010, 0.0040, 0.0030]
    steps, transfers = [], {}
    for i, (d, h) in enumerate(zip(durations, handoffs)):
        start = float(i)
        steps.append({"start_s": start, "end_s": start + d, "duration_s": d, "num_seqs": 1, "num_prefill_tokens": 50})
        token = start + d
        transfers[i] = {"kv_transfer_bytes": 1000 * (i + 1), "timeline": {"prefill_token_s": token,
                        "sent_s": token + 1e-4, "announced_s": token + h, "receive_posted_s": token + h,
                        "landed_s": token + h + 0.001 + 1e-6 * 1000 * (i + 1)}}  # fmt: skip
    requests = [SimpleNamespace(request_id=i, arrival_time=float(i)) for i in range(4)]
    pools = {"prefill0": {"steps": steps}, "decode0": {"steps": []}}
    result = DisaggResult(requests, transfers, pools, 5.0, 0, {i: (0, 0) for i in range(4)})
    assert handoff_profile(result)["kv_handoff_rank_correlation"] == pytest.approx(0.6)
    # twice the same run: the pooled pairs rank alike
    assert handoff_profile([result, result])["kv_handoff_rank_correlation"] == pytest.approx(0.6)


def test_seeded_simulations_are_summarised_by_each_statistics_median() -> None:
    from workbench.experiments.fidelity import median_metrics

    def run(t50: float, t90: float, i50: float, i90: float) -> dict:
        return {"ttft_s": {"median": t50, "p90": t90, "mean": 9.0}, "itl_s": {"median": i50, "p90": i90}}

    runs = [run(1.0, 5.0, 0.3, 0.9), run(3.0, 4.0, 0.1, 0.7), run(2.0, 9.0, 0.2, 0.8)]
    assert median_metrics(runs) == {"ttft_s": {"median": 2.0, "p90": 5.0}, "itl_s": {"median": 0.2, "p90": 0.8}}


def test_the_warmup_workload_prefills_every_length_then_drains_every_batch_size() -> None:
    from workbench.experiments.fidelity import warmup_workload

    reqs = warmup_workload(max_model_len=10, max_num_seqs=3, gap_s=0.5)
    singles, burst = reqs[:8], reqs[8:]
    assert [r.prompt_len for r in singles] == list(range(1, 9))  # 1 .. max_model_len - 2
    assert [r.arrival_time_s for r in singles] == [0.5 * i for i in range(8)]
    assert [r.output_len for r in burst] == [2, 3, 4] and {r.arrival_time_s for r in burst} == {4.1}
    assert [r.request_id for r in reqs] == list(range(11))


def test_ttft_parts_of_a_real_and_a_simulated_run_by_hand() -> None:
    """Requests 0 and 1 arrive at 1.0 and 1.001 s and are prefilled together in one step (1.002-1.006); request 2
    arrives at 2.0 and has a step of its own (2.001-2.004). Real: the first tokens reach the decode side at 1.010,
    1.012 and 2.006; the simulated run's at 1.009, 1.009 and 2.007."""
    from types import SimpleNamespace

    from workbench.cluster.disagg import DisaggResult
    from workbench.experiments.fidelity import ttft_parts

    steps = [{"start_s": 1.002, "end_s": 1.006, "num_prefill_tokens": 20, "num_seqs": 2},
             {"start_s": 2.001, "end_s": 2.004, "num_prefill_tokens": 9, "num_seqs": 1}]  # fmt: skip
    arrivals, firsts = (1.0, 1.001, 2.0), (1.010, 1.012, 2.006)
    requests = [SimpleNamespace(request_id=i, arrival_time=a, first_token_time=f)
                for i, (a, f) in enumerate(zip(arrivals, firsts))]  # fmt: skip

    def timeline(token: float, landed: float) -> dict:
        return {"timeline": {"prefill_token_s": token, "sent_s": token, "announced_s": token + 0.001,
                             "receive_posted_s": token + 0.0012, "landed_s": landed}}  # fmt: skip

    transfers = {0: timeline(1.006, 1.010), 1: timeline(1.006, 1.012), 2: timeline(2.004, 2.006)}
    real = DisaggResult(requests, transfers, {"prefill0": {"steps": steps}}, 3.0, 0, {i: (0, 0) for i in range(3)})
    parts = ttft_parts(real)
    assert parts["num_requests"] == 3
    assert parts["queue"] == pytest.approx(1.0)  # waits of 2, 1 and 1 ms
    assert parts["prefill"] == pytest.approx(4.0)  # steps of 4, 4 and 3 ms
    assert parts["after"] == pytest.approx(4.0)  # 4, 6 and 2 ms
    assert parts["ttft"] == pytest.approx(10.0)  # 10, 11 and 6 ms
    assert parts["sum_of_medians"] == pytest.approx(9.0)
    assert parts["handoff"] == pytest.approx(1.0) and parts["decode_wait"] == pytest.approx(0.2)
    assert parts["wire"] == pytest.approx(2.8)  # 2.8, 4.8 and 0.8 ms
    # p90 by linear interpolation of the sorted values, position 0.9 x (3 - 1) = 1.8
    assert parts["p90"]["ttft"] == pytest.approx(10.8)  # 6, 10, 11
    assert parts["p90"]["queue"] == pytest.approx(1.8)  # 1, 1, 2
    log = SimpleNamespace(to_records=lambda: steps)
    records = [SimpleNamespace(request_id=i, arrival_time=a, first_token_time=f)
               for i, (a, f) in enumerate(zip(arrivals, (1.009, 1.009, 2.007)))]  # fmt: skip
    sim = ttft_parts(SimpleNamespace(records=records, step_logs=[log, None]))
    assert sim["after"] == pytest.approx(3.0) and sim["ttft"] == pytest.approx(8.0) and "wire" not in sim


SMOL, TINY = {"model": "SmolLM2-135M"}, {"model": "tiny-gqa"}  # matrices of 331,776+ elements; of 20,480 at most


@pytest.mark.parametrize(
    "kind, data, stale",
    [
        ("op-profile", {**SMOL, "device": "cpu"}, True),  # from before packed linears: timed plain layers
        ("op-profile", {**SMOL, "device": "cpu", "packed_linears": True}, False),
        ("op-profile", {**SMOL, "device": "cpu", "packed_linears": False}, True),  # for an engine run without them
        ("op-profile", {**SMOL, "device": "cuda"}, False),  # the engine packs on a CPU only
        # tiny-gqa's weights are all below PACKED_MIN_WEIGHT: the engine keeps them plain, as its profile records
        ("op-profile", {**TINY, "device": "cpu", "packed_linears": False}, False),
        ("op-profile", {**TINY, "device": "cpu", "packed_linears": True}, True),  # from before the threshold
        ("profiled", {"meta": {**SMOL, "engine_configs": [{"device": "cpu"}, {"device": "cpu"}]}}, True),
        ("profiled", {"meta": {**SMOL, "engine_configs": [{"device": "cpu", "packed_linears": True}] * 2}}, False),
        ("profiled", {"meta": {**SMOL, "packed_layers": 121, "engine_configs": [{"device": "cpu"}]}}, False),
        # flag on, nothing packed (recorded since the threshold), or flag on before it (every layer packed)
        ("profiled", {"meta": {**TINY, "packed_layers": 0, "engine_configs": [{"packed_linears": True}]}}, False),
        ("profiled", {"meta": {**TINY, "engine_configs": [{"device": "cpu", "packed_linears": True}]}}, True),
    ],
)
def test_a_committed_profile_timed_with_plain_linears_is_not_used_for_a_packing_engine(kind, data, stale):
    from workbench.experiments.fidelity import packed_mismatch

    assert packed_mismatch(kind, data) is stale


def test_repeats_in_two_separate_modes_are_bimodal_and_the_larger_mode_is_typical() -> None:
    from workbench.experiments.fidelity import bimodal_split

    # the AMD EPYC's continuous TTFT p90 over three repeats (issue 33): one fast repeat, two slow ones
    split = bimodal_split([1.760, 0.730, 1.660])
    assert split is not None and split["counts"] == [1, 2]
    assert split["modes"] == pytest.approx([0.730, 1.710]) and split["typical"] == pytest.approx(1.710)
    # scatter about one value (the same run's static TTFT median): gap 0.48 s is 9% of the median
    assert bimodal_split([4.818, 5.301, 5.421]) is None
    # a wide but even scatter: the widest gap (0.06) is not twice the lower group's range (0.04)
    assert bimodal_split([0.10, 0.14, 0.20]) is None
    # two values cannot say; an even split has no typical mode
    assert bimodal_split([1.0, 2.0]) is None
    tie = bimodal_split([1.0, 1.05, 2.0, 2.1])
    assert tie is not None and tie["typical"] is None and tie["modes"] == pytest.approx([1.025, 2.05])


def test_the_fidelity_table_marks_a_bimodal_measurement_and_the_error_against_its_typical_mode() -> None:
    runs = {"continuous": [metrics(0.73, 0.01), metrics(1.66, 0.0101), metrics(1.76, 0.0099)]}
    rows = compare(runs, {"continuous": metrics(1.5, 0.01)}, "m")
    ttft = rows[0]
    assert ttft["bimodal"] and ttft["typical_ms"] == pytest.approx(1710.0)
    assert ttft["rel_error_typical"] == pytest.approx((1.5 - 1.71) / 1.71)
    assert not rows[2]["bimodal"]  # ITL median: 1% scatter
    assert "continuous ttft median" in fidelity_claim(rows, "m")["evidence"]["bimodal"]


def test_workbench_fidelity_runs_on_a_tiny_model_and_names_the_machine(tmp_path, capsys) -> None:
    """`workbench fidelity` end to end on tiny settings: the real engine (tiny-gqa, 4 requests, 3 repeats) against
    a hand-written profile (10 ms a step, 1 ms between steps); the JSON names the machine as torch sees it."""
    import json

    import torch

    from workbench.cli import main
    from workbench.hardware import cpu_model_name
    from workbench.sim.costmodel import ProfiledCostModel

    profile = tmp_path / "p.json"
    meta = {"model": "tiny-gqa", "machine": cpu_model_name()}
    ProfiledCostModel({"const": 0.010}, 0.001, meta, [-0.001, 0.0, 0.001]).save(profile)
    out = tmp_path / "f.json"
    rc = main(["fidelity", "--model", "tiny-gqa", "--cost-model", "profiled", "--fit-profile", str(profile),
               "--num-requests", "4", "--rate", "50", "--repeats", "3", "--policies", "continuous,static",
               "--no-progress", "--out", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["machine"]["cpu"] == cpu_model_name()
    assert data["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    # 2 policies x 4 statistics, each for the model and its noise variant; one run per policy and repeat
    assert len(data["rows"]) == 16 and {r["model"] for r in data["rows"]} == {"profiled", "profiled noise"}
    assert len(data["loads"]) == 6 and data["cost_models"]["profiled"]["source"] == str(profile)
    assert all(isinstance(r["bimodal"], bool) for r in data["rows"])
    # the hand-written profile's error on the runs' own steps: each priced 10 ms
    assert data["step_errors"]["profiled"]["num_steps"] > 0
    text = capsys.readouterr().out  # without --json the table is the command's stdout
    assert "torch dispatches to" in text and "statistics within" in text
    assert "profiled on the measured runs' own" in text


def test_workbench_fidelity_refuses_an_unknown_cost_model(capsys) -> None:
    from workbench.cli import main

    assert main(["fidelity", "--cost-model", "roofline"]) == 2
    assert "op-profile, profiled" in capsys.readouterr().err


def test_the_fitted_profile_measures_its_workloads_between_the_runs() -> None:
    """``--measure-profiles``: the profile's training workloads run between the measured runs (a shared CPU's speed
    drifts between minutes), two after each of 2 runs for 4 workloads, and the profile is fitted to their steps."""
    from workbench.experiments.fidelity import measure_policies
    from workbench.model.checkpoint import load_model
    from workbench.sim.measure import InterleavedTraining, training_configs
    from workbench.workloads import synthetic_workload

    net = load_model("tiny-gqa", seed=0)
    configs = training_configs(("continuous",), max_num_seqs=4, max_model_len=32)
    training = InterleavedTraining(net, configs, num_requests=2, model="tiny-gqa")
    calls = []

    def between(fraction: float) -> None:
        calls.append((fraction, training.run_due(fraction), training.done))

    held_out = synthetic_workload(3, rate=50.0, prompt_lens="uniform:4:12", output_lens="uniform:2:4", seed=1)
    measure_policies(net, held_out, ["continuous", "static"], 1, 4, 32, between=between)
    # 2 runs and 4 workloads: floor(4 j / 2 + 1/2) = 2 j due after run j, so two workloads after each run
    assert calls == [(0.5, 2, 2), (1.0, 2, 4)]
    profile = training.fit()
    assert profile.meta["workloads_measured"] == "4 of 4" and profile.meta["model"] == "tiny-gqa"
    assert profile.meta["fit"]["num_steps"] == len(training.samples.stats) > 0
    # the backend its engines attended through, as resolved (the config says "auto"): what stored_profile compares
    from workbench.experiments.fidelity import engine_attention_backend

    assert configs[0].attention_backend == "auto" and profile.meta["attention_backend"] == engine_attention_backend()


def test_step_errors_price_the_measured_runs_own_steps_by_hand() -> None:
    from workbench.sim.costmodel import ProfiledCostModel
    from workbench.sim.measure import StepSamples, step_errors
    from workbench.sim.stats import StepStats

    cost = ProfiledCostModel({"const": 0.010, "decode_seqs": 0.001})  # 10 ms + 1 ms a decode
    steps = [StepStats(decode_seqs=2), StepStats(decode_seqs=2), StepStats(decode_seqs=8), StepStats(decode_seqs=1)]
    # predicted 12, 12, 18, 11 ms; the last step follows an idle wait and is left out
    samples = StepSamples(steps, [0.012, 0.024, 0.009, 0.5], after_idle=[False, False, False, True])
    e = step_errors(cost, samples)
    # errors 0, -0.5, +1.0: median 0, |errors| 0, 0.5, 1.0 (median 0.5, p90 the largest), 42 ms over 45 ms
    assert e["num_steps"] == 3
    assert e["median"] == pytest.approx(0.0) and e["median_abs"] == pytest.approx(0.5)
    assert e["p90_abs"] == pytest.approx(1.0) and e["total_ratio"] == pytest.approx(0.042 / 0.045)
    assert step_errors(cost, StepSamples())["median"] is None


def test_a_drift_of_the_machine_voids_only_the_claims_on_a_model_measured_at_another_time() -> None:
    """Issue 28's terms: a model fitted to steps measured between the runs moved with the machine as the runs did,
    so a drifting reference step (a hygiene anomaly on "timing") leaves its claim decided; a model measured before
    the runs or read from a file rests on another time's step times and is voided; the best model's claim follows
    the best model."""
    from workbench.experiments.claims import apply_anomalies
    from workbench.experiments.fidelity import INTERLEAVED, fidelity_claims
    from workbench.experiments.hygiene import check_drift

    runs = {"continuous": [metrics(0.10, 0.01)] * 3}
    rows = (compare(runs, {"continuous": metrics(0.105, 0.0102)}, "profiled")
            + compare(runs, {"continuous": metrics(0.2, 0.01)}, "op-profile"))  # fmt: skip
    claims = fidelity_claims(rows, ["profiled", "op-profile"], interleaved=["profiled"])
    assert [c["uses"] for c in claims] == [[INTERLEAVED], ["timing"], [INTERLEAVED]]
    assert claims[0]["evidence"]["fitted_between_runs"] and not claims[1]["evidence"]["fitted_between_runs"]
    drift = check_drift({"prefill": 0.73})  # notebook 07's reference prefill step, +73% from start to end
    assert len(drift) == 1 and drift[0]["affects"] == "timing"
    final = apply_anomalies(claims, drift)
    assert [c["verdict"] for c in final] == [CONFIRMED, INCONCLUSIVE, CONFIRMED]
    assert final[1]["unreliable"] and final[1]["verdict_from_numbers"] == NOT_CONFIRMED
    assert final[2]["evidence"]["best"] == "profiled"
    # nothing fitted between the runs: every claim rests on absolute step times
    assert all(c["uses"] == ["timing"] for c in fidelity_claims(rows, ["profiled", "op-profile"]))


def test_the_notebook_and_the_command_fit_both_profiles_between_the_runs(monkeypatch) -> None:
    """``colocated_fidelity`` (notebook 07 and ``workbench fidelity --measure-profiles``): both models measured now
    run their engine workloads between the measured runs, fitted after them: ``profiled`` on its workloads, the op
    profile's overhead on the same workloads replayed on its own engine (torch attention, as its operations were
    timed). The operations alone are stood in for by the committed tiny-gqa op profile (their timing is seconds of
    micro-benchmarks, tested with profile-ops)."""
    import json
    from pathlib import Path

    from workbench.experiments import fidelity
    from workbench.model.checkpoint import load_model
    from workbench.workloads import synthetic_workload

    path = next((Path(__file__).parents[1] / "data" / "profiles").glob("op-tiny-gqa-*.json"))
    ops = {**json.loads(path.read_text()), "overhead": None}
    measured_ops = []
    monkeypatch.setattr(fidelity, "measure_op_profile", lambda model, max_tokens: measured_ops.append(1) or dict(ops))
    net = load_model("tiny-gqa", seed=0)
    held_out = synthetic_workload(3, rate=50.0, prompt_lens="uniform:4:12", output_lens="uniform:2:4", seed=1)
    res = fidelity.colocated_fidelity(net, "tiny-gqa", held_out, ["continuous", "static"], repeats=1, max_num_seqs=4,
                                      max_model_len=32, measure_requests=2, measure_profiles=True)  # fmt: skip
    assert measured_ops == [1] and res["interleaved"] == ["op-profile", "profiled"]
    assert list(res["costs"]) == ["op-profile", "profiled"]
    assert all("between the runs" in s for s in res["sources"].values())
    fitted = res["costs"]["profiled"].meta
    assert fitted["workloads_measured"] == "8 of 8" and fitted["fit"]["num_steps"] > 0
    over = res["costs"]["op-profile"].source["overhead"]
    assert {c["policy"] for c in over["fit"]["engine_configs"]} == {"continuous", "chunked"}
    assert over["fit"]["num_steps"] > 0 and res["costs"]["op-profile"].source["load_average_end"] is not None
    # 2 policies x 4 statistics x (each model, its noise variant)
    assert len(res["rows"]) == 32 and set(res["step_errors"]) == {"op-profile", "profiled"}
    # the steps the profile was fitted on come along (fidelity_report writes them into its JSON) and, through JSON,
    # re-fit to the same profile
    from workbench.sim.measure import refit_steps

    steps = json.loads(json.dumps(res["fitted_steps"]))
    # tiny-gqa's matrices are too small to pack (PACKED_MIN_WEIGHT): no kernel break, nothing packed
    assert len(steps["stats"]) == fitted["fit"]["num_steps"] and steps["kernel_breaks"] == []
    assert fitted["packed_layers"] == 0
    again = refit_steps(steps, fitted)
    assert again.coefficients == res["costs"]["profiled"].coefficients
    assert again.token_curve == res["costs"]["profiled"].token_curve


def test_a_committed_op_profile_of_another_attention_backend_is_not_used(tmp_path, monkeypatch) -> None:
    """An op profile times the attention the engine runs: a committed one of this machine that timed the torch
    backend's gather, where the engine attends with the C++ paged op, is measured anew (the torch gather took 5x the
    op's time per layer for SmolLM2-135M's decode); the same file with the engine's backend is read."""
    import json
    from pathlib import Path

    from workbench.experiments import fidelity
    from workbench.sim import measure

    source = next((Path(__file__).parents[1] / "data" / "profiles").glob("op-tiny-gqa-*.json"))
    # tiny-gqa: nothing packed (PACKED_MIN_WEIGHT), as the engine runs it
    data = {**json.loads(source.read_text()), "machine": measure.machine_identity(), "packed_linears": False}
    path = tmp_path / "op.json"
    monkeypatch.setattr(measure, "default_op_profile_path", lambda model, machine: str(path))
    for timed, runs, read in (("torch", "cpu", False), ("cpu", "cpu", True), ("torch", "torch", True)):
        path.write_text(json.dumps({**data, "attention_backend": timed}))
        monkeypatch.setattr(fidelity, "engine_attention_backend", lambda runs=runs: runs)
        cost, why = fidelity.stored_profile("op-profile", "tiny-gqa")
        assert (cost is not None) == read
        assert why == (str(path) if read else f" (the committed {path} timed the torch attention backend; the engine "
                                               "runs cpu)")  # fmt: skip


@pytest.mark.parametrize(
    "meta, timed",
    [
        ({"engine_configs": [{"attention_backend": "torch"}] * 2}, "torch"),  # the committed Intel Xeon profiles
        ({"engine_configs": [{"attention_backend": "auto"}] * 2, "attention_backend": "cpu"}, "cpu"),  # as resolved
        ({"engine_configs": [{"attention_backend": "auto"}]}, "auto, unresolved"),  # unknown: never matches
        ({"engine_configs": [{"device": "cpu"}]}, "torch"),  # from before the field: the only CPU backend then
    ],
)
def test_a_fitted_profile_names_the_attention_backend_its_engine_steps_ran(meta, timed) -> None:
    from workbench.experiments.fidelity import timed_attention_backend

    assert timed_attention_backend("profiled", {"meta": meta}) == timed


def test_a_committed_fitted_profile_of_another_attention_backend_is_not_used(tmp_path, monkeypatch) -> None:
    """The engine steps a ``profiled`` model was fitted on attended through its engine's backend: a committed one
    of this machine fitted with the torch backend (the Intel Xeon profiles) is measured anew where the engine runs
    the C++ op, and read where it runs torch."""
    import json
    from pathlib import Path

    from workbench.experiments import fidelity
    from workbench.sim import measure

    source = next((Path(__file__).parents[1] / "data" / "profiles").glob("tiny-gqa-*.json"))
    data = json.loads(source.read_text())
    ident = measure.machine_identity()
    # packed_layers 0: tiny-gqa's engine packs nothing (PACKED_MIN_WEIGHT), as a profile fitted now records
    meta = {**data["meta"], "machine": ident["cpu"], "cpu_count": ident["cpu_count"],
            "cpu_capability": ident["cpu_capability"], "packed_layers": 0}  # fmt: skip
    path = tmp_path / "p.json"
    monkeypatch.setattr(measure, "default_profile_path", lambda model: str(path))
    for timed, runs, read in (("torch", "cpu", False), ("cpu", "cpu", True), ("torch", "torch", True)):
        path.write_text(json.dumps({**data, "meta": {**meta, "attention_backend": timed}}))
        monkeypatch.setattr(fidelity, "engine_attention_backend", lambda runs=runs: runs)
        cost, why = fidelity.stored_profile("profiled", "tiny-gqa")
        assert (cost is not None) == read
        assert why == (str(path) if read else f" (the committed {path} timed the torch attention backend; the engine "
                                               "runs cpu)")  # fmt: skip


def test_a_miss_on_runs_loaded_beyond_the_cpus_decides_nothing() -> None:
    """The load average read around every run is a check of the machine: beyond its CPUs, other processes took
    time from the runs, so a statistic outside its tolerance leaves the claim inconclusive (not the opposite of a
    quiet run's verdict); within every tolerance it stays confirmed, and a quiet machine's miss is not confirmed."""
    import os

    from workbench.experiments.fidelity import fidelity_claims, runs_load

    cpus = os.cpu_count() or 1
    loads = [{"load_before": [cpus + 0.5, 1.0, 1.0], "load_after": [cpus - 0.5, 1.0, 1.0]}]
    assert runs_load(loads) == {"peak": cpus + 0.5, "cpus": cpus, "loaded": True}
    quiet = runs_load([{"load_before": [cpus - 0.5, 1.0, 1.0], "load_after": None}])
    assert not quiet["loaded"] and quiet["peak"] == cpus - 0.5
    runs = {"continuous": [metrics(0.10, 0.01)] * 3}
    rows = (compare(runs, {"continuous": metrics(0.105, 0.0102)}, "profiled")
            + compare(runs, {"continuous": metrics(0.2, 0.01)}, "op-profile"))  # fmt: skip
    loaded = fidelity_claims(rows, ["profiled", "op-profile"], load=runs_load(loads))
    assert [c["verdict"] for c in loaded] == [CONFIRMED, INCONCLUSIVE, CONFIRMED]
    assert "load average up to" in loaded[1]["detail"] and loaded[1]["evidence"]["runs_load"]["loaded"]
    assert [c["verdict"] for c in fidelity_claims(rows, ["op-profile"], load=quiet)] == [NOT_CONFIRMED, CONFIRMED]
    assert fidelity_claims(rows[4:], ["op-profile"], load=runs_load(loads))[1]["verdict"] == INCONCLUSIVE


def test_five_repeats_or_more_decide_the_best_model_on_their_min_max_by_hand() -> None:
    from workbench.experiments.fidelity import best_cost_model, interval_position

    def row(model: str, sim: float, lo: float, mid: float, hi: float) -> dict:
        err = sim / mid - 1
        return {"model": model, "within": abs(err) <= 0.1, "rel_error": err, "policy": "p", "statistic": "ttft p90",
                "measured_ms": mid, "measured_min_ms": lo, "measured_max_ms": hi, "simulated_ms": sim,
                "spread": max(hi - mid, mid - lo) / mid, "tolerance": 0.1, "num_repeats": 5}  # fmt: skip

    # 100 ms simulated against repeats of 95..105 ms: 100/105 = 0.952 and 100/95 = 1.053, both within 1 +- 0.1
    assert interval_position(row("a", 100.0, 95.0, 100.0, 105.0)) == "inside"
    # against 120..130: 100/130 = 0.77 and 100/120 = 0.83, below 0.9 for every repeat
    assert interval_position(row("a", 100.0, 120.0, 125.0, 130.0)) == "outside"
    # against 105..130 (a spread of 24%): 0.77 .. 0.95 straddles 0.9, although the median's error is -20%
    straddling = row("a", 100.0, 105.0, 125.0, 130.0)
    assert interval_position(straddling) == "straddles" and not straddling["within"]

    def model(name: str, first: dict) -> list[dict]:  # a model's two statistics: the given one and one inside
        return [{**first, "model": name}, row(name, 50.0, 49.0, 50.0, 51.0)]

    inside, outside = row("x", 100.0, 95.0, 100.0, 105.0), row("x", 100.0, 120.0, 125.0, 130.0)
    claim = best_cost_model(model("a", straddling) + model("b", outside))
    assert claim["verdict"] == INCONCLUSIVE and claim["evidence"]["best"] == "a"  # a: 1 inside, none outside
    assert best_cost_model(model("a", straddling) + model("b", inside))["verdict"] == CONFIRMED  # b: both inside
    refuted = best_cost_model(model("a", outside) + model("b", outside))
    assert refuted["verdict"] == NOT_CONFIRMED and refuted["evidence"]["margin"] == 0.1
    # with 3 repeats the spread-widened tolerance decides, as before: the straddling row is a miss
    assert best_cost_model([{**straddling, "num_repeats": 3}])["verdict"] == NOT_CONFIRMED


def test_calibrated_decode_spread_leaves_out_the_step_after_an_idle_wait() -> None:
    # one request through a 1:1 pair, by hand: its KV lands at t = 10 s on an idle decode engine, whose next step
    # takes 1.5 ms where the simulator's takes 0.5 ms: the idle excess is 1.0 ms. The decode engine's other pure decode
    # steps take 0.5, 0.6, 0.5, 0.7 ms against the simulator's 0.5 ms for one sequence: a spread of 0, 0.1, 0, 0.2 ms.
    # The excess is the simulator's idle_step_s; drawn again as noise it would be counted twice
    from types import SimpleNamespace

    from workbench.experiments.fidelity import _calibrate_roles

    def step(start: float, ms: float, prefill: int = 0) -> dict:
        return {"start_s": start, "end_s": start + ms / 1e3, "duration_s": ms / 1e3, "num_prefill_tokens": prefill,
                "num_seqs": 1}  # fmt: skip

    def log(steps: list[dict]) -> SimpleNamespace:
        return SimpleNamespace(to_records=lambda: steps)

    decode = [step(10.0, 1.5), step(10.01, 0.5), step(10.02, 0.6), step(10.03, 0.5), step(10.04, 0.7)]
    real = SimpleNamespace(
        requests=[SimpleNamespace(request_id=0, arrival_time=9.0)],
        engines={0: (0, 0)},
        pools={"prefill0": {"steps": [step(9.001, 3.0, prefill=20)]}, "decode0": {"steps": decode}},
        transfers={0: {"timeline": {"announced_s": 9.5, "landed_s": 10.0}}},
    )
    sim = SimpleNamespace(
        records=[SimpleNamespace(request_id=0, arrival_time=9.0, first_token_time=9.004)],
        step_logs=[log([step(9.0, 2.5, prefill=20)]), log([step(9.004 + 0.001 * i, 0.5) for i in range(5)])],
    )
    out = _calibrate_roles(real, sim, (1, 1))
    assert out["prefill"]["idle_step_s"] == pytest.approx(0.5e-3)  # 3.0 against 2.5 ms
    dec = out["decode"]
    assert dec["idle_step_s"] == pytest.approx(1.0e-3) and dec["num_paired"] == 1
    assert min(dec["residual_quantiles_s"]) == pytest.approx(0.0, abs=1e-12)
    assert max(dec["residual_quantiles_s"]) == pytest.approx(0.2e-3)  # not the 1.0 ms excess
    assert dec["noise_idle_step_s"] == pytest.approx(1.0e-3 - 0.05e-3)  # less the spread's median, (0 + 0.1) / 2
