"""The simulator's model of the real disaggregated engine's handoff (``kv_handoff_s``, ``kv_receive``), by hand."""

from __future__ import annotations

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import ProfiledCostModel
from workbench.workloads import Request

LLAMA = ModelConfig.resolve("Llama-3.1-8B")  # bf16 KV: 131072 B per token


def test_a_decode_replica_that_receives_between_steps_spends_the_wire_time_before_its_step():
    # step = 10 ms + 10 us per prefill token + 1 ms per decode
    cost = ProfiledCostModel({"const": 0.01, "prefill_tokens": 1e-5, "decode_seqs": 1e-3})
    cfg = SimConfig(num_blocks=1000, disaggregate=(1, 1), link_gbps=100.0, link_latency_s=0.001, kv_handoff_s=0.002,
                    kv_receive="between-steps")  # fmt: skip
    res = simulate([Request(0, 0.0, 1000, 3), Request(1, 0.0, 500, 2)], LLAMA, cost, cfg)
    r0, r1 = res.records
    announced = 0.01 + 1500 * 1e-5 + 0.002  # one prefill step for both prompts, then the handoff: 0.027
    wire0 = 1000 * 131072 / 12.5e9 + 0.001
    wire1 = 500 * 131072 / 12.5e9 + 0.001
    # both are announced at once to the idle decode replica; it receives request 0's KV, then request 1's (the
    # first tokens reach the client as each lands), then runs one decode step of both
    start = announced + wire0 + wire1
    step = 0.01 + 2e-3
    assert r0.token_times[:2] == pytest.approx([announced + wire0, start + step], rel=1e-12)
    assert r0.token_times[2] == pytest.approx(start + step + 0.01 + 1e-3, rel=1e-12)  # request 1 done: one decode
    assert r1.token_times == pytest.approx([announced + wire0 + wire1, start + step], rel=1e-12)


def test_the_overlapped_default_is_unchanged_by_a_zero_handoff():
    cost = ProfiledCostModel({"const": 0.01, "prefill_tokens": 1e-5, "decode_seqs": 1e-3})
    work = [Request(0, 0.0, 1000, 3), Request(1, 0.0, 500, 2)]
    base = SimConfig(num_blocks=1000, disaggregate=(1, 1), link_gbps=100.0, link_latency_s=0.001)
    handoff = SimConfig(num_blocks=1000, disaggregate=(1, 1), link_gbps=100.0, link_latency_s=0.0, kv_handoff_s=0.001)
    a, b = (simulate(work, LLAMA, cost, c).records for c in (base, handoff))
    # a handoff of 1 ms in place of the link's 1 ms latency: the same times (the handoff does not use the link)
    for x, y in zip(a, b):
        assert x.token_times == pytest.approx(y.token_times, rel=1e-12)


def test_bad_handoff_settings_are_config_errors():
    with pytest.raises(ConfigError, match="kv_receive must be one of"):
        SimConfig(disaggregate=(1, 1), kv_receive="sometimes")
    with pytest.raises(ConfigError, match="kv_handoff_s must be a number >= 0"):
        SimConfig(disaggregate=(1, 1), kv_handoff_s=-1.0)


def test_handoffs_drawn_from_measured_ones_are_seeded_and_come_from_them():
    cost = ProfiledCostModel({"const": 0.01, "prefill_tokens": 1e-5, "decode_seqs": 1e-3})
    work = [Request(i, 0.1 * i, 100, 2) for i in range(20)]

    def first_tokens(seed: int) -> list[float]:
        cfg = SimConfig(num_blocks=1000, disaggregate=(1, 1), link_gbps=100.0, kv_receive="between-steps",
                        kv_handoff_quantiles_s=(0.001, 0.005), kv_handoff_seed=seed)  # fmt: skip
        return [r.first_token_time for r in simulate(work, LLAMA, cost, cfg).records]

    wire = 100 * 131072 / 12.5e9
    # each request is alone: its prefill step ends at arrival + 11 ms, then a drawn handoff, then the wire
    offsets = {round(t - (0.1 * i + 0.01 + 100 * 1e-5) - wire, 9) for i, t in enumerate(first_tokens(3))}
    assert offsets == {0.001, 0.005}
    assert first_tokens(3) == first_tokens(3)


def test_rank_correlation_by_hand() -> None:
    from workbench.sim.stats import rank_correlation

    assert rank_correlation([1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 4.0, 3.0]) == pytest.approx(0.6)  # 1 - 6*4/(4*15)
    # a tie takes the average rank: x ranks (0.5, 0.5, 2), y (0, 1, 2); Pearson of the ranks 1.5 / sqrt(1.5 * 2)
    assert rank_correlation([1.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(1.5 / 3**0.5)
    assert rank_correlation([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]) == 0.0  # no spread: no correlation to measure


def test_a_gaussian_copula_gives_uniform_draws_with_the_rank_correlation_asked_for() -> None:
    import random

    from workbench.sim.stats import correlated_uniform, rank_correlation

    rng, src = random.Random(1), random.Random(2)
    us = [src.random() for _ in range(4000)]
    for target in (0.0, 0.4, -0.7):
        vs = [correlated_uniform(u, target, rng) for u in us]
        # Spearman's estimate over 4000 pairs has a standard error of about 1/sqrt(4000) = 0.016
        assert rank_correlation(us, vs) == pytest.approx(target, abs=0.06)
        deciles = [sum(int(10 * v) == k for v in vs) for k in range(10)]
        assert all(330 <= n <= 470 for n in deciles)  # uniform: 400 each, binomial sd 19
    assert all(correlated_uniform(u, 1.0, rng) == pytest.approx(u, abs=1e-9) for u in us[:50])


def test_drawn_handoffs_follow_their_prefill_steps_noise_by_the_rank_correlation_asked_for() -> None:
    from workbench.sim.stats import rank_correlation

    quantiles = [0.001 * i for i in range(101)]  # 0 .. 100 ms, uniform
    cost = ProfiledCostModel({"const": 0.01, "decode_seqs": 1e-3}, residual_quantiles_s=quantiles)
    work = [Request(i, 1.0 * i, 100, 2) for i in range(400)]  # each prefilled alone, the decode side idle

    def steps_and_handoffs(rho: float, noise: int | None) -> tuple[list[float], list[float]]:
        cfg = SimConfig(num_blocks=1000, disaggregate=(1, 1), link_gbps=100.0, kv_handoff_quantiles_s=quantiles,
                        kv_handoff_seed=5, kv_handoff_rank_correlation=rho)  # fmt: skip
        res = simulate(work, LLAMA, [cost.with_noise(noise), cost.with_noise(None)], cfg, record_steps=True)
        prefills = [s for s in res.step_logs[0].to_records() if s["num_prefill_tokens"]]
        wire = 100 * 131072 / 12.5e9
        after = [r.first_token_time - s["end_s"] - wire for r, s in zip(res.records, prefills)]
        return [s["duration_s"] for s in prefills], after

    steps, handoffs = steps_and_handoffs(0.6, noise=3)
    assert len(steps) == 400 and min(handoffs) >= -1e-9 and max(handoffs) <= 0.1 + 1e-9
    assert rank_correlation(steps, handoffs) == pytest.approx(0.6, abs=0.1)  # standard error ~0.04 at n = 400
    steps, handoffs = steps_and_handoffs(0.0, noise=3)
    assert abs(rank_correlation(steps, handoffs)) < 0.15
    # without step noise there is nothing to follow: the handoffs are drawn as without a correlation
    assert steps_and_handoffs(0.6, noise=None)[1] == pytest.approx(steps_and_handoffs(0.0, noise=None)[1], abs=1e-12)


def test_a_handoff_correlation_needs_drawn_handoffs_and_a_coefficient() -> None:
    with pytest.raises(ConfigError, match="needs kv_handoff_quantiles_s"):
        SimConfig(disaggregate=(1, 1), kv_handoff_rank_correlation=0.3)
    with pytest.raises(ConfigError, match=r"kv_handoff_rank_correlation must be a number in \[-1, 1\]"):
        SimConfig(disaggregate=(1, 1), kv_handoff_quantiles_s=(0.001, 0.002), kv_handoff_rank_correlation=1.5)
