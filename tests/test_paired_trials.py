"""The paired trials behind the timing claims (phases, serving and levers arms on workbench.experiments.trials) on a
tiny model: what each arm runs and returns, that every round replays one workload under both arms, and the round
bookkeeping. Structure only: no assertion rests on a measured time."""

import pytest

from workbench.engine.config import EngineConfig
from workbench.errors import ConfigError
from workbench.experiments import levers
from workbench.experiments.phases import batching_trial, kv_heads_trial, prefill_trial
from workbench.experiments.serving import long_prompt_trial, policy_trial, reseed_arrivals, round_medians
from workbench.experiments.trials import DecisionRule, Rounds, run_rounds
from workbench.workloads import Request

ROUNDS = Rounds(6, 6, warmup=0)


@pytest.fixture(scope="module")
def model():
    from workbench.config import ModelConfig
    from workbench.model import Transformer

    return Transformer.from_config(ModelConfig.from_name("tiny-gqa"), seed=0)


def test_reseed_arrivals_keeps_the_requests_and_draws_new_arrivals():
    reqs = [Request(i, 1.0 + 0.5 * i, 10 + i, 3 + i) for i in range(5)]  # 4 gaps over 2 s: 2 requests/s
    a, again, b = reseed_arrivals(reqs, 3), reseed_arrivals(reqs, 3), reseed_arrivals(reqs, 4)
    assert [(r.request_id, r.prompt_len, r.output_len) for r in a] == [(r.request_id, r.prompt_len, r.output_len)
                                                                       for r in reqs]  # fmt: skip
    assert a[0].arrival_time_s == 1.0 and all(x.arrival_time_s <= y.arrival_time_s for x, y in zip(a, a[1:]))
    assert [r.arrival_time_s for r in a] == [r.arrival_time_s for r in again]
    assert [r.arrival_time_s for r in a] != [r.arrival_time_s for r in b]
    assert reseed_arrivals(reqs, -1) != reseed_arrivals(reqs, 1)  # a warm-up round's seed is its own
    offline = [Request(i, 0.0, 4, 2) for i in range(3)]
    assert reseed_arrivals(offline, 7) == offline


def test_reseed_arrivals_shortest_first_gives_the_same_times_in_order_of_prompt_length():
    reqs = [Request(i, 1.0 + 0.5 * i, n, 3) for i, n in enumerate((50, 10, 40, 10, 30))]
    drawn, ordered = reseed_arrivals(reqs, 3), reseed_arrivals(reqs, 3, shortest_first=True)
    # the same five times, taken by prompt length: 10 (id 1), 10 (id 3: ties in the slice's order), 30, 40, 50
    assert [r.arrival_time_s for r in ordered] == [r.arrival_time_s for r in drawn]
    assert [(r.request_id, r.prompt_len) for r in ordered] == [(1, 10), (3, 10), (4, 30), (2, 40), (0, 50)]
    assert [r.request_id for r in drawn] == [0, 1, 2, 3, 4]
    offline = [Request(i, 0.0, 4 - i, 2) for i in range(3)]
    assert reseed_arrivals(offline, 7, shortest_first=True) == offline  # all at once: nothing to order


def test_reseed_arrivals_at_a_given_rate_spreads_the_same_draws():
    reqs = [Request(i, 1.0 + 0.5 * i, 10 + i, 3 + i) for i in range(5)]  # the slice's own rate: 2 requests/s
    own, slower = reseed_arrivals(reqs, 3), reseed_arrivals(reqs, 3, rate=0.5)
    # the same exponential draws divided by a rate 4x lower: every gap from the first arrival is 4x longer
    for a, b in zip(own[1:], slower[1:]):
        assert b.arrival_time_s - 1.0 == pytest.approx(4 * (a.arrival_time_s - 1.0))
    with pytest.raises(ConfigError, match="rate must be > 0"):
        reseed_arrivals(reqs, 3, rate=0.0)


def test_policy_trial_replays_one_slice_per_round_under_both_policies(model):
    reqs = [Request(i, 0.002 * i, 6 + i, 3) for i in range(3)]
    cfgs = {p: EngineConfig(policy=p, max_model_len=64, max_num_seqs=2) for p in ("static", "continuous")}
    cmp = policy_trial(model, cfgs, reqs, ROUNDS, slos={"slo_ttft_s": 100.0})
    assert cmp.arms == ("static", "continuous") and cmp.rounds == 6 and cmp.rule == DecisionRule("lower", 0.10)
    assert set(cmp.records) == {"static", "continuous", "static (A/A)"}
    for recs in cmp.records.values():
        assert len(recs) == 6 and all(r["num_finished"] == 3 and r["slo_attainment"] == 100.0 for r in recs)
    assert cmp.values["static"] == [r["ttft_p99_ms"] for r in cmp.records["static"]]
    thr = cmp.on("output_throughput", DecisionRule("higher", 0.05))
    assert thr.values["continuous"] == [r["output_throughput"] for r in cmp.records["continuous"]]
    assert thr.rounds == 6 and thr.control is not None
    rows = round_medians(cmp)
    assert [r["label"] for r in rows] == ["static", "continuous"] and all(r["rounds"] == 6 for r in rows)
    with pytest.raises(ConfigError, match="missing"):
        cmp.on("no_such_figure", DecisionRule("higher"))


def test_long_prompt_trial_gives_stall_and_ttft_from_the_same_rounds(model):
    cfgs = {"one-step": EngineConfig(policy="continuous", max_model_len=128),
            "chunked": EngineConfig(policy="chunked", max_model_len=128, token_budget=16, chunk_size=16)}  # fmt: skip
    kw = dict(num_decodes=2, decode_prompt_len=4, decode_output_len=6, long_prompt_len=40, inject_after_steps=2)
    cmp = long_prompt_trial(model, cfgs, ROUNDS, seed=5, **kw)
    assert cmp.arms == ("one-step", "chunked") and cmp.rule.direction == "lower"
    assert all(set(r) == {"stall_ms", "long_ttft_ms", "itl_p99_ms"} for recs in cmp.records.values() for r in recs)
    ttft = cmp.on("long_ttft_ms", DecisionRule("higher", 0.10))
    assert ttft.rule.direction == "higher" and len(ttft.values["chunked"]) == 6
    by_ttft = long_prompt_trial(model, cfgs, ROUNDS, metric="long_ttft_ms", direction="higher", seed=5, **kw)
    assert by_ttft.rule == DecisionRule("higher", 0.10)
    assert by_ttft.values["chunked"] == [r["long_ttft_ms"] for r in by_ttft.records["chunked"]]


def test_phase_and_lever_trials_run_their_arms(model):
    b = batching_trial(model, 1, 4, 16, ROUNDS, steps=1)
    assert b.arms == ("batch 1", "batch 4") and all(len(v) == 6 and min(v) > 0 for v in b.values.values())
    mha = type(model).from_config(model.config.with_overrides(num_kv_heads=model.config.num_heads), seed=0)
    k = kv_heads_trial({"GQA": model, "MHA": mha}, 2, 16, ROUNDS, steps=1)  # A: the most KV heads, whatever the order
    assert k.arms == ("MHA", "GQA") and k.rule == DecisionRule("higher", 0.05) and k.control is not None
    assert all(len(v) == 6 and min(v) > 0 for v in k.values.values())
    with pytest.raises(ConfigError, match="different numbers of KV heads"):
        kv_heads_trial({"a": model, "b": model}, 2, 16, ROUNDS)
    p = prefill_trial(model, 4, 32, ROUNDS)
    assert p.arms == ("4 tokens", "32 tokens") and p.rule == DecisionRule("higher", 0.10)
    schemes = [levers.Scheme("fp32"), *levers.make_schemes(["int4", "int8"], [32])]
    models = levers.load_scheme_models("tiny-gqa", schemes, "cpu")
    pairs = levers.weight_trials(models, schemes, 1, 8, ROUNDS, steps=1)
    # sorted by weight bytes, most first, whatever the order given
    assert [c.arms for c in pairs] == [("fp32", "int8"), ("int8", "int4-g32")]
    assert all(c.rounds == 6 and c.control is not None for c in pairs)
    kv = levers.make_schemes([None], [32], ["auto", "int8", "fp8"])
    kv_pairs = levers.kv_trials(models, kv, 2, 8, ROUNDS, steps=1)
    assert [c.arms for c in kv_pairs] == [("fp32", "fp32 kv-int8"), ("fp32", "fp32 kv-fp8")]
    assert all(c.rounds == 6 and c.control is not None and c.rule == DecisionRule("higher", 0.05) for c in kv_pairs)
    with pytest.raises(ConfigError, match="same weights"):
        levers.kv_trials(models, [kv[0], schemes[1]], 2, 8, ROUNDS)
    with pytest.raises(ConfigError, match="ran out of decode steps"):
        arm = levers.scheme_decode_arm(models[schemes[0].weights_key], schemes[0], 1, 8, steps=2, trials=1)
        arm(0), arm(1)


def test_rounds_settings_and_mapping_arms_are_checked():
    with pytest.raises(ConfigError, match="min_rounds"):
        Rounds(3, 8)
    with pytest.raises(ConfigError, match="budget_s"):
        Rounds(budget_s=0.0)
    assert Rounds(6, 10, warmup=2).max_trials == 12
    with pytest.raises(ConfigError, match="metric"):
        run_rounds({"A": lambda i: {"x": 1.0}, "B": lambda i: {"x": 2.0}}, DecisionRule("higher"), warmup=0)
