"""Cluster simulation: routers and prefill/decode disaggregation on examples computed by hand; capacity search
with a known answer; bad inputs give clear errors."""

from __future__ import annotations

import pytest

from workbench.cli import main
from workbench.config import ModelConfig
from workbench.errors import ConfigError, TraceError
from workbench.sim.capacity import capacity_search, rate_scaled, sweep
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import ProfiledCostModel
from workbench.workloads import Request, load_workload

LLAMA = ModelConfig.resolve("Llama-3.1-8B")
ONE_SECOND = ProfiledCostModel({"const": 1.0})


def ttfts(result) -> list[float]:
    return [r.first_token_time - r.arrival_time for r in result.records]


# A (3 tokens) at 0 keeps a replica busy until 3 (max_num_seqs 1); B, C, D (1 token each) at 0.5, 1.5, 2.5.
ROUTER_WORKLOAD = [Request(0, 0.0, 4, 3), Request(1, 0.5, 4, 1), Request(2, 1.5, 4, 1), Request(3, 2.5, 4, 1)]


@pytest.mark.parametrize(
    "router, expected",
    [
        # A->R0, B->R1, C->R0 (waits for A until 3: TTFT 4 - 1.5), D->R1
        ("round-robin", [1.0, 1.0, 2.5, 1.0]),
        # B->R1 (R0 has A); C->R1 (B finished at 1.5, before C is routed); D->R1 (C done at 2.5, A still out)
        ("least-outstanding", [1.0, 1.0, 1.0, 1.0]),
        # B ties on empty queues -> R0 and waits for A (TTFT 4 - 0.5); C and D -> R1 (R0 has B queued)
        ("shortest-queue", [1.0, 3.5, 1.0, 1.0]),
    ],
)
def test_router_policies_by_hand(router: str, expected: list[float]) -> None:
    cfg = SimConfig(num_blocks=64, max_num_seqs=1, num_replicas=2, router=router)
    res = simulate(ROUTER_WORKLOAD, LLAMA, ONE_SECOND, cfg)
    assert ttfts(res) == pytest.approx(expected)
    assert res.records[0].finish_time == 3.0
    assert len(res.replicas) == 2


def test_disaggregation_two_requests_by_hand() -> None:
    # step = 10 ms + 10 us per prefill token + 1 ms per decode; KV of Llama-3.1-8B bf16: 131072 B/token
    cost = ProfiledCostModel({"const": 0.01, "prefill_tokens": 1e-5, "decode_seqs": 1e-3})
    cfg = SimConfig(num_blocks=1000, disaggregate=(1, 1), link_gbps=100.0, link_latency_s=0.001)
    res = simulate([Request(0, 0.0, 1000, 3), Request(1, 0.0, 500, 2)], LLAMA, cost, cfg)
    r0, r1 = res.records
    prefill_end = 0.01 + 1500 * 1e-5  # both prompts in one prefill step: 0.025
    xfer0 = 1000 * 131072 / 12.5e9 + 0.001  # 0.01148576 s over 100 Gb/s plus 1 ms
    xfer1 = 500 * 131072 / 12.5e9 + 0.001  # 0.00624288
    decode = 0.01 + 1e-3
    # request 1's KV lands first and the idle decode replica admits it at once: its first token reaches the client
    # then (DistServe's TTFT) and its decode step starts; request 0's lands during that step and waits for it
    t1 = prefill_end + xfer1 + decode
    assert r1.token_times == pytest.approx([prefill_end + xfer1, t1], rel=1e-12)
    assert r0.token_times == pytest.approx([t1, t1 + decode, t1 + 2 * decode], rel=1e-12)
    assert prefill_end + xfer0 < t1  # (the premise of "waits for that step")
    assert [r["role"] for r in res.replicas] == ["prefill", "decode"]
    summary = res.summary()
    assert summary["metrics"]["ttft_s"]["median"] == pytest.approx(((prefill_end + xfer1) + t1) / 2)


def test_disaggregation_single_token_request_never_transfers() -> None:
    cfg = SimConfig(num_blocks=100, disaggregate=(1, 1))
    res = simulate([Request(0, 0.0, 10, 1)], LLAMA, ONE_SECOND, cfg)
    assert res.records[0].token_times == [1.0]
    assert res.replicas[1]["num_steps"] == 0


def _evenly_spaced(rate: float, n: int = 10) -> list[Request]:
    return [Request(i, i / rate, 1, 1) for i in range(n)]


def test_capacity_search_known_answer() -> None:
    # one request per step of d = 0.1 s; arrivals every 1/r. Above r = 1/d request i starts at i d, so its TTFT is
    # (i + 1) d - i / r, largest for i = 9: all ten meet TTFT <= 1.5 d while 10 d - 9 / r <= 1.5 d, r <= 9 / (8.5 d)
    cost = ProfiledCostModel({"const": 0.1})
    cfg = SimConfig(num_blocks=16, max_num_seqs=1)

    def evaluate(rate: float) -> dict:
        return simulate(_evenly_spaced(rate), LLAMA, cost, cfg).summary(slo_ttft_s=0.15 + 1e-12)

    found = capacity_search(evaluate, target=100.0, lo=1.0, hi=5.0, rel_tol=1e-4)
    assert found.rate == pytest.approx(9 / (8.5 * 0.1), rel=2e-4)
    assert found.rate <= 9 / (8.5 * 0.1) + 1e-9
    assert any(not ok for _, _, ok in found.evaluations)
    goodput = capacity_search(evaluate, target=1.0, metric="goodput", lo=1.0, hi=5.0, rel_tol=1e-4)
    assert goodput.rate == pytest.approx(found.rate, rel=2e-4)
    with pytest.raises(ConfigError, match="metric"):
        capacity_search(evaluate, target=1.0, metric="latency")


def test_rate_scaled_and_sweep() -> None:
    reqs = _evenly_spaced(2.0)  # 9 gaps of 0.5 s
    fast = rate_scaled(reqs, 8.0)
    assert fast[-1].arrival_time_s == pytest.approx(9 / 8.0)
    out = sweep({"a": 1, "b": 2}, lambda x: x * 10, progress=False)
    assert out == {"a": 10, "b": 20}
    with pytest.raises(ConfigError, match="rate"):
        rate_scaled(reqs, -1.0)


def test_bad_inputs_give_clear_errors(capsys) -> None:
    with pytest.raises(ConfigError, match="policy"):
        SimConfig(policy="lottery")
    with pytest.raises(ConfigError, match="router"):
        SimConfig(router="random")
    with pytest.raises(ConfigError, match="link_gbps"):
        SimConfig(link_gbps=-5)
    with pytest.raises(ConfigError, match="disaggregate"):
        SimConfig(disaggregate=(0, 2))
    with pytest.raises(TraceError, match="rate"):
        load_workload("poisson:-3")
    with pytest.raises(TraceError, match="unknown trace"):
        load_workload("azure-nonexistent")
    with pytest.raises(ConfigError, match="arrival"):
        simulate([Request(0, -1.0, 4, 1)], LLAMA, ONE_SECOND, SimConfig(num_blocks=10))
    for argv, needle in (
        (["--hardware", "h900"], "unknown hardware"),
        (["--trace", "nope-trace"], "unknown trace"),
        (["--trace", "poisson:-1"], "rate"),
        (["--rate-scale", "-2"], "rate_scale"),
        (["--disaggregate", "2x1"], "disaggregate"),
        (["--cost-model", "profiled", "--profile", "/nonexistent.json"], "profile file not found"),
    ):
        args = ["simulate", "--model", "Llama-3.1-8B", "--trace", "poisson:5", "--num-requests", "5", *argv]
        assert main(args) == 2
        assert needle in capsys.readouterr().err


def test_simulate_command_json_has_replay_keys(capsys) -> None:
    import json

    rc = main(["simulate", "--model", "Llama-3.1-8B", "--hardware", "h100-sxm", "--trace", "poisson:4",
               "--num-requests", "30", "--replicas", "2", "--router", "least-outstanding", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("num_requests", "num_finished", "num_preemptions", "duration_s", "metrics", "rejected", "engine",
                "model", "trace", "wall_s", "requests_per_wall_s"):  # fmt: skip
        assert key in out
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert set(out["metrics"][key]) == {"mean", "median", "p90", "p95", "p99"}
    assert out["num_finished"] == 30 and len(out["replicas"]) == 2
