"""Speculative decoding in the simulator: steps counted by hand, the verify step priced as the roofline's
``verify``, the expected tokens per step of Leviathan et al. (eq. 1), the speed-up against the analytic formula."""

from __future__ import annotations

import argparse
import json

import pytest

from workbench.config import ModelConfig
from workbench.engine.scheduler import ScheduledChunk, StepPlan
from workbench.engine.speculative import SpeculativeConfig, expected_speedup
from workbench.errors import ConfigError
from workbench.request import Sequence
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import ProfiledCostModel, RooflineCostModel, decode_stats, plan_stats
from workbench.sim.speculation import SimSpeculator, conditional_acceptance
from workbench.workloads import Request

LLAMA = ModelConfig.resolve("Llama-3.1-8B")


def oracle(alpha: float, k: int = 4) -> dict:
    return {"method": "oracle", "acceptance": alpha, "num_speculative_tokens": k}


def run(spec: dict | None, output_len: int, cost=None, batch: int = 1, prompt_len: int = 8, **config):  # noqa: ANN001, ANN201
    requests = [Request(i, 0.0, prompt_len, output_len) for i in range(batch)]
    cfg = SimConfig(num_blocks=4096, block_size=16, max_num_seqs=max(batch, 1), max_model_len=8192,
                    speculative_config=spec, **config)  # fmt: skip
    return simulate(requests, LLAMA, cost or ProfiledCostModel({"const": 0.01}), cfg)


@pytest.mark.parametrize(("alpha", "steps", "verifies"), [(1.0, 5, 4), (0.0, 21, 19)])
def test_steps_by_hand(alpha: float, steps: int, verifies: int) -> None:
    # 21 tokens: the prefill samples the first; with every proposal accepted each verify emits k + 1 = 5 (4 steps),
    # with none accepted each emits the target's token alone (20 steps, the last a plain decode: with one token left
    # to generate there is nothing to propose)
    result = run(oracle(alpha), 21)
    assert result.num_steps == steps
    assert result.records[0].num_output_tokens == 21
    spec = result.speculative
    assert spec["num_drafts"] == verifies
    assert spec["acceptance_rate"] == alpha


def test_mean_tokens_per_verify_is_leviathans() -> None:
    # alpha 0.8, k 4: 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616 tokens per verify step (Leviathan et al., eq. 1)
    result = run(oracle(0.8), 8001, batch=2)
    spec = result.speculative
    tokens_per_verify = spec["mean_accepted_length"] + 1.0
    assert tokens_per_verify == pytest.approx(3.3616, abs=0.06)  # ~4,700 verifies: sd of the mean ~0.02
    for i, cumulative in enumerate(spec["per_position_acceptance"]):
        assert cumulative == pytest.approx(0.8 ** (i + 1), abs=0.03)


def test_verify_step_is_priced_as_the_roofline_verify() -> None:
    cost = RooflineCostModel(LLAMA, "h100-sxm")
    seqs = [Sequence(i, list(range(100 + 37 * i))) for i in range(3)]
    chunks = [ScheduledChunk(s, 5, s.num_tokens - 1, False, True, [1, 2, 3, 4]) for s in seqs]
    expected = cost.roofline.verify([s.num_tokens for s in seqs], 4).time_s  # k + 1 query tokens over L - 1 cached
    assert cost.step_time(plan_stats(StepPlan(chunks))) == pytest.approx(expected, rel=1e-9)


def test_batch_one_speedup_matches_the_analytic_formula() -> None:
    cost = RooflineCostModel(LLAMA, "h100-sxm")
    alpha, k, out = 0.8, 4, 2001
    base = run(None, out, cost, prompt_len=1024)
    spec = run(oracle(alpha, k), out, cost, prompt_len=1024)
    context = 1024 + out // 2  # the middle of the run: the costs grow little with the context
    decode_s = cost.roofline.decode([context]).time_s
    verify_s = cost.roofline.verify([context], k).time_s
    prefill_s = cost.roofline.prefill([1024]).time_s
    decode_only = (base.duration_s - prefill_s) / (spec.duration_s - prefill_s)
    assert decode_only == pytest.approx(expected_speedup(alpha, k, decode_s, verify_s), rel=0.03)


def test_draft_model_proposals_cost_the_drafts_steps() -> None:
    draft = ProfiledCostModel({"const": 0.002})
    spec = {"model": "tiny-gqa", "num_speculative_tokens": 4}
    free = run(oracle(1.0), 21)
    cfg = SimConfig(num_blocks=4096, block_size=16, max_num_seqs=1, max_model_len=8192, speculative_config=spec,
                    spec_acceptance=1.0)  # fmt: skip
    drafted = simulate([Request(0, 0.0, 8, 21)], LLAMA, ProfiledCostModel({"const": 0.01}), cfg,
                       draft_cost_model=draft)  # fmt: skip
    # 4 verifies, each after 4 draft forwards of 2 ms: 32 ms more than the oracle's free proposals
    assert drafted.duration_s - free.duration_s == pytest.approx(4 * 4 * 0.002)
    with pytest.raises(ConfigError, match="draft"):
        simulate([Request(0, 0.0, 8, 21)], LLAMA, ProfiledCostModel({"const": 0.01}), cfg)


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ConfigError, match="needs an acceptance rate"):
        SimConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match="disaggregation"):
        SimConfig(speculative_config=oracle(0.5), disaggregate=(1, 1))
    with pytest.raises(ConfigError, match="needs a speculative config"):
        SimConfig(spec_acceptance=0.5)
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        SimConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, spec_acceptance=1.5)
    with pytest.raises(ConfigError, match="not valid JSON"):
        SimConfig(speculative_config="{method")
    assert isinstance(SimConfig(speculative_config=json.dumps(oracle(0.5))).speculative_config, SpeculativeConfig)


def test_per_position_acceptance() -> None:
    assert conditional_acceptance([0.8, 0.64, 0.512]) == pytest.approx([0.8, 0.8, 0.8])
    assert conditional_acceptance([0.5, 0.0, None]) == [0.5, 0.0, 0.0]
    sim = SimSpeculator({"method": "ngram", "num_speculative_tokens": 4}, [1.0, 0.0])
    assert sim.acceptance == [1.0, 0.0, 0.0, 0.0]  # the last given repeats
    seq = Sequence(0, [5, 6, 7])
    seq.num_computed_tokens = 2
    plan = StepPlan([ScheduledChunk(seq, 5, 2, False, True, [0, 0, 0, 0])])
    assert sim.verify(plan) == {0: [0, 0]}  # the first accepted, the second rejected, then the target's token
    assert sim.draft_time(plan) == 0.0


def test_simulate_cli_takes_the_engines_speculative_config() -> None:
    from workbench import cli
    from workbench.commands.simulate import _draft_cost, _spec_acceptance

    argv = ["simulate", "--model", "tiny-gqa", "--trace", "poisson:5", "--speculative-config",
            json.dumps(oracle(1.0, 3)), "--spec-acceptance", "0.9", "0.5"]  # fmt: skip
    args = cli.build_parser("simulate").parse_args(argv)
    config = SimConfig(
        speculative_config=args.speculative_config, spec_acceptance=_spec_acceptance(args.spec_acceptance)
    )
    assert config.speculative_config == SpeculativeConfig.parse(oracle(1.0, 3)) and config.spec_acceptance == (0.9, 0.5)
    assert _spec_acceptance([0.7]) == 0.7 and _spec_acceptance(None) is None
    assert _draft_cost(args, config, "h100-sxm", False) is None  # no draft model, no draft cost
    draft = SimConfig(speculative_config={"model": "tiny-gqa", "num_speculative_tokens": 2}, spec_acceptance=0.5)
    with pytest.raises(ConfigError, match="no profile of the draft"):
        _draft_cost(argparse.Namespace(cost_model="profiled"), draft, None, True)


def test_decode_stats_unchanged_without_speculation() -> None:
    seq = Sequence(0, list(range(10)))
    seq.num_computed_tokens = 9
    stats = plan_stats(StepPlan([ScheduledChunk(seq, 1, 9, False, True)]))
    assert stats[:7] == decode_stats(1, 10)[:6] + (10,) and stats.spec_tokens == 0


def test_profiled_model_prices_a_verify_as_a_decode_of_its_rows() -> None:
    # two verifies (k = 4 at 20 cached tokens, k = 2 at 7) beside a plain decode at context 31: the fitted models
    # see 5 + 3 + 1 = 9 decode rows; a verify's row j at p cached tokens reads p + j + 1 keys
    seqs = [Sequence(i, list(range(n))) for i, n in enumerate((21, 8, 31))]
    chunks = [ScheduledChunk(seqs[0], 5, 20, False, True, [1, 2, 3, 4]),
              ScheduledChunk(seqs[1], 3, 7, False, True, [1, 2]),
              ScheduledChunk(seqs[2], 1, 30, False, True)]  # fmt: skip
    stats = plan_stats(StepPlan(chunks))
    pairs = (21 + 22 + 23 + 24 + 25) + (8 + 9 + 10)
    assert (stats.prefill_tokens, stats.prefill_seqs, stats.prefill_pairs) == (8, 2, pairs)  # the roofline's view
    assert (stats.verify_seqs, stats.verify_pairs, stats.spec_tokens) == (2, pairs, 6)
    rows = stats.verifies_as_decodes()
    assert (rows.prefill_tokens, rows.prefill_seqs, rows.prefill_pairs, rows.prefill_context) == (0, 0, 0, 0)
    assert (rows.decode_seqs, rows.decode_context, rows.decode_max_context) == (9, pairs + 31, 31)
    coef = {"const": 0.5, "prefill_seqs": 100.0, "prefill_pairs": 100.0, "decode_seqs": 0.25, "decode_context": 0.01}
    cost = ProfiledCostModel(coef)
    assert cost.step_time(stats) == pytest.approx(0.5 + 0.25 * 9 + 0.01 * (pairs + 31), rel=1e-12)
    assert cost.step_time(stats) == pytest.approx(cost.step_time(decode_stats(9, pairs + 31)), rel=1e-12)
    # the op profile too: its decode-attention and LM-head operations at 9 rows, not a 5- and a 3-token prefill
    from pathlib import Path

    from workbench.sim.op_profile import OpProfileCostModel

    path = next((Path(__file__).parents[1] / "data" / "profiles").glob("op-tiny-gqa-*.json"))
    ops = OpProfileCostModel.from_dict(json.loads(path.read_text()))
    assert ops.step_time(stats) == pytest.approx(ops.step_time(rows), rel=1e-12)
    assert ops.op_times(rows)["lm_head"] == ops.ops["lm_head"].at(9)


def test_predicted_speedup_by_hand() -> None:
    from workbench.experiments.speculative import predict_speedup

    # every step 10 ms: 21 steps without speculation (a prefill, 20 decodes), 5 with every proposal accepted
    out = predict_speedup(ProfiledCostModel({"const": 0.01}), LLAMA, oracle(1.0), batch=2, prompt_len=8,
                          max_tokens=21, num_seeds=2)  # fmt: skip
    assert out["base_s"] == pytest.approx(0.21) and out["spec_s"] == pytest.approx(0.05)
    assert out["speedup"] == pytest.approx(4.2) and out["tokens_per_verify"] == 5.0


def test_gain_falls_claim_contrasts_the_two_speedups() -> None:
    import math

    from workbench.experiments.speculative import speculation_gain_falls
    from workbench.experiments.trials import Comparison, DecisionRule

    rule = DecisionRule("higher", 0.05)

    def cmp(speedups: list[float], failed: bool = False) -> Comparison:
        control = {"ratio": 1.0, "ci_low": 0.98, "ci_high": 1.02, "failed": False}
        if failed:
            control = {"ratio": 1.4, "ci_low": 1.3, "ci_high": 1.5, "failed": True}
        values = {"base": [10.0] * len(speedups), "spec": [10.0 * s for s in speedups]}
        return Comparison(("base", "spec"), rule, 1.0, 0.0, 0.0, len(speedups), "confirmed", "", values, control, 0.95)

    small, large = cmp([1.9, 2.0, 1.8, 1.9]), cmp([0.8, 0.85, 0.75, 0.8])
    claim = speculation_gain_falls(small, large, 1, 8, 16, 8)
    ev = claim["evidence"]
    # the speed-ups' geometric means over their four rounds, by hand
    expected = math.prod([1.9, 2.0, 1.8, 1.9]) ** 0.25 / math.prod([0.8, 0.85, 0.75, 0.8]) ** 0.25
    assert claim["verdict"] == "confirmed" and ev["ratio"] == pytest.approx(expected)
    assert ev["ci_low"] < ev["ratio"] < ev["ci_high"] and ev["rounds"] == 4
    assert ev["predicted_crossover_batch"] == 16 and ev["arms"] == ["speed-up at batch 8", "speed-up at batch 1"]
    assert speculation_gain_falls(large, small, 1, 8, None, None)["verdict"] == "not_confirmed"
    close = cmp([1.5, 2.2, 1.7, 2.1])  # about the same speed-up, far noisier
    assert speculation_gain_falls(small, close, 1, 8, None, None)["verdict"] == "inconclusive"
    # a failed A/A control of up to 50%: log 1.05 + log 1.5 = 0.45 is less than log(1.9 / 0.8) = 0.86: it stands
    assert speculation_gain_falls(small, cmp([0.8, 0.85, 0.75, 0.8], True), 1, 8, None, None)["verdict"] == "confirmed"
    slight = [1.5, 1.45, 1.55, 1.5]  # log(1.9 / 1.5) = 0.24: within what the failed control allows
    assert speculation_gain_falls(small, cmp(slight, True), 1, 8, None, None)["verdict"] == "inconclusive"
    assert speculation_gain_falls(small, cmp(slight), 1, 8, None, None)["verdict"] == "confirmed"


def test_bench_speculative_options() -> None:
    from workbench import cli

    args = cli.build_parser("bench").parse_args(["bench", "speculative", "--max-tokens", "16"])
    assert (args.kind, args.batch, args.max_tokens, args.repeats, args.cost_model) == (
        "speculative",
        [1, 2, 4, 8],
        16,
        3,
        "profiled",
    )
    assert cli.build_parser("bench").parse_args(["bench", "decode"]).batch == [1, 8, 32]


def test_text_prompts_repeat_a_passage_of_the_public_domain_text() -> None:
    from workbench.experiments.speculative import text_prompts

    prompts = text_prompts(ModelConfig.resolve("tiny-gqa"), 24, period=4)
    rep, free = prompts["repetitive"], prompts["free"]
    assert len(rep) == len(free) == 24
    assert rep == free[:4] * 6  # the running text's first 4 tokens, six times
    assert len(set(free)) > 4
    with pytest.raises(ConfigError, match="prompt_len"):
        text_prompts(ModelConfig.resolve("tiny-gqa"), 10**6)


def test_repeated_ngram_share_counts_bigrams_seen_before() -> None:
    from workbench.experiments.speculative import repeated_ngram_share

    # prompt 1 2 3; output 1 2 1 2 9: bigrams (3,1) new, (1,2) seen in the prompt, (2,1) new, (1,2) seen, (2,9) new
    assert repeated_ngram_share([1, 2, 3], [1, 2, 1, 2, 9]) == pytest.approx(2 / 5)
    assert repeated_ngram_share([5, 6], [7, 8, 9]) == 0.0  # nothing repeats
    assert repeated_ngram_share([4, 4], [4, 4, 4]) == 1.0  # a loop: every token repeats (4, 4)
    assert repeated_ngram_share([1], []) == 0.0
    with pytest.raises(ConfigError, match="n must be"):
        repeated_ngram_share([1], [1], n=0)


def test_ngram_claim_reports_each_output_repetition() -> None:
    from workbench.experiments.speculative import ngram_pays_on_repeating_output
    from workbench.experiments.trials import DecisionRule, run_rounds

    # speed-ups per round written by hand: sampled ~1.0, greedy ~1.8 -> B/A ~1.8, beyond the 5% margin
    sampled, greedy = [1.0, 0.98, 1.02, 1.0, 0.99, 1.01], [1.8, 1.75, 1.85, 1.8, 1.78, 1.82]
    arms = {"sampled (T=1)": lambda i: sampled[i], "greedy (loops)": lambda i: greedy[i]}
    cmp = run_rounds(arms, DecisionRule("higher", 0.05), min_rounds=6, max_rounds=6, warmup=0, control=False)
    stats = {"sampled (T=1)": {"acceptance_rate": None, "repeated_bigram_share": 0.0},
             "greedy (loops)": {"acceptance_rate": 1.0, "repeated_bigram_share": 0.9}}  # fmt: skip
    claim = ngram_pays_on_repeating_output(cmp, stats)
    assert claim["verdict"] == "confirmed" and claim["uses"] == ["paired"]
    assert claim["evidence"]["repeated_bigram_share"] == {"sampled (T=1)": 0.0, "greedy (loops)": 0.9}
    assert "sampled (T=1): none proposed, 0% of its tokens repeat a bigram" in claim["detail"]
    assert "greedy (loops): acceptance 1.00, 90% of its tokens repeat a bigram" in claim["detail"]
