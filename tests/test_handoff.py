"""The handoff of disaggregation (``workbench.engine.handoff.Handoff``), one object for the real pair and the
simulator's: its queue and routing, and the simulated pair's backpressure on an example computed by hand. The real
pair's backpressure through the same object: tests/test_disagg.py (a full decode pool makes requests wait)."""

from __future__ import annotations

import pytest

from workbench.config import ModelConfig
from workbench.engine.handoff import Handoff
from workbench.engine.scheduler import Scheduler, SchedulerConfig
from workbench.kv.block_manager import BlockManager
from workbench.request import SamplingParams, Sequence
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import ProfiledCostModel
from workbench.workloads import Request


def test_the_decode_side_admits_first_come_first_served_and_the_first_refused_stops_the_queue() -> None:
    handoff: Handoff[str] = Handoff()
    for rid, name in enumerate("abc"):
        handoff.arrive(rid, name)
    room = {"a", "c"}  # 'b' does not fit: 'c' must wait behind it
    taken: list[str] = []

    def take(item: str) -> bool:
        if item not in room:
            return False
        taken.append(item)
        return True

    assert handoff.admit(take) == 1 and taken == ["a"] and list(handoff) == ["b", "c"]
    assert handoff.admit(take) == 0 and handoff.num_backpressure == 1  # counted once per request
    room.add("b")
    assert handoff.admit(take) == 2 and taken == ["a", "b", "c"] and not handoff


def test_routing_is_arrival_order_modulo_each_pool() -> None:
    assert [Handoff(2, 3).route(n) for n in range(6)] == [(0, 0), (1, 1), (0, 2), (1, 0), (0, 1), (1, 2)]


def test_held_blocks_go_back_to_the_pool_only_when_released() -> None:
    bm = BlockManager(4, 16)
    sched = Scheduler(SchedulerConfig(max_model_len=64), bm)
    Handoff.hold(sched)
    sched.add(Sequence(7, [1] * 20, SamplingParams(max_tokens=1, ignore_eos=True)))
    plan = sched.schedule(now=0.0)
    assert [s.seq_id for s in sched.update(plan, {7: 5}, 1.0)] == [7]
    assert bm.num_used_blocks == 2 and list(sched.held) == [7]
    assert Handoff.release(sched, 7) and bm.num_used_blocks == 0
    assert not Handoff.release(sched, 7)  # no longer held


def test_a_simulated_pair_holds_prefills_until_the_decode_side_takes_them() -> None:
    # every step 10 ms, each KV 5 ms on the link; pools of one 16-token block and one sequence at a time; 8-token
    # prompts, 4 tokens out (without the hold, request 1 would prefill at 10 ms and request 2 at 20 ms)
    cost = ProfiledCostModel({"const": 0.01})
    cfg = SimConfig(num_blocks=1, block_size=16, max_num_seqs=1, disaggregate=(1, 1), link_gbps=1e9,
                    link_latency_s=0.005)  # fmt: skip
    model = ModelConfig.resolve("Llama-3.1-8B")
    res = simulate([Request(i, 0.0, 8, 4) for i in range(3)], model, cost, cfg)
    r0, r1, r2 = res.records
    # request 0: prefill [0, 10 ms], held; its KV lands at 15 ms, the decode side takes it then, decoding to 45 ms
    assert r0.first_token_time == pytest.approx(0.015) and r0.finish_time == pytest.approx(0.045)
    # request 1's prefill waits for request 0's block to come back (15 ms); its KV lands at 30 ms and finds the
    # decode pool full at the step of 35 ms (backpressure) until request 0 finishes at 45 ms
    assert r1.first_scheduled_time == pytest.approx(0.015) and r1.first_token_time == pytest.approx(0.045)
    # request 2's prefill waits for request 1's block, held on the prefill side until the decode side took it
    assert r2.first_scheduled_time == pytest.approx(0.045) and r2.first_token_time == pytest.approx(0.075)
    assert r2.finish_time == pytest.approx(0.105)
    prefill, decode = res.replicas
    assert prefill["role"] == "prefill" and decode["num_backpressure"] == 2


def test_a_prefill_pool_tracked_below_its_size_grows_by_what_held_prefills_take() -> None:
    # an accelerator's pool for tiny-gqa: millions of blocks, tracked at what one sequence of 128 tokens can fill
    # (9 blocks over the watermark: 11); the decode side takes one request at a time and holds it for 40 steps, so
    # the prefill side holds up to 19 prefills: its pool grows for them instead of stopping its admissions
    cost = ProfiledCostModel({"const": 0.01})
    cfg = SimConfig(max_num_seqs=1, max_model_len=128, disaggregate=(1, 1), link_gbps=1e9)
    res = simulate([Request(i, 0.0, 16, 41) for i in range(20)], "tiny-gqa", cost, cfg, hardware="h100-sxm")
    assert [r.first_scheduled_time for r in res.records] == pytest.approx([0.01 * i for i in range(20)])
    prefill = res.replicas[0]
    assert prefill["num_blocks_capacity"] > 10**6 and 11 < prefill["num_blocks"] <= 11 + 20
