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
