"""Simulator core: cost models, the bulk-decode fast path against step-by-step, event ordering by hand."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from workbench.config import ModelConfig
from workbench.engine.scheduler import Scheduler, SchedulerConfig
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.request import SamplingParams, Sequence
from workbench.roofline import get_model
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import (
    FEATURES,
    ProfiledCostModel,
    RooflineCostModel,
    StepStats,
    decode_stats,
    fit_profile,
)
from workbench.workloads import Request, synthetic_workload

LLAMA = ModelConfig.resolve("Llama-3.1-8B")


def const_cost(step_s: float, **coefficients: float) -> ProfiledCostModel:
    return ProfiledCostModel({"const": step_s, **coefficients})


# ---- cost models ---------------------------------------------------------------------------------------------
def test_roofline_decode_fast_path_equals_step_time() -> None:
    cost = RooflineCostModel(LLAMA, "h100-sxm", prefill_efficiency=0.5, decode_efficiency=0.7)
    rm = get_model(LLAMA, "h100-sxm")
    for n in (1, 3, 32, 256):
        for ctx in (n, 10 * n, 1000 * n, 4096 * n, 100_000 * n):
            expected = rm.time_from_stats(n, n, ctx, ctx) / 0.7
            assert cost.decode_time(n, ctx) == pytest.approx(expected, rel=1e-12)
            assert cost.step_time(decode_stats(n, ctx)) == pytest.approx(expected, rel=1e-12)
            starts, ends = cost.decode_run(2.0, n, ctx, 3, float("inf"))
            assert starts[0] == 2.0 and ends[0] == pytest.approx(2.0 + expected, rel=1e-12)
            second = rm.time_from_stats(n, n, ctx + n, ctx + n) / 0.7
            assert ends[1] - starts[1] == pytest.approx(second, rel=1e-9)


def test_roofline_efficiency_per_phase() -> None:
    rm = get_model(LLAMA, "h100-sxm")
    cost = RooflineCostModel(LLAMA, "h100-sxm", prefill_efficiency=0.5, decode_efficiency=0.25)
    prefill = StepStats(prefill_tokens=100, prefill_seqs=1, prefill_pairs=5050, prefill_context=100)
    assert cost.step_time(prefill) == pytest.approx(rm.time_from_stats(100, 1, 5050, 100) / 0.5)
    mixed = StepStats(100, 1, 5050, 100, 4, 400)
    tp, td = rm.time_from_stats(100, 1, 5050, 100), rm.time_from_stats(4, 4, 400, 400)
    t = rm.time_from_stats(104, 5, 5450, 500)
    assert cost.step_time(mixed) == pytest.approx(t * (tp / 0.5 + td / 0.25) / (tp + td))
    with pytest.raises(ConfigError, match="decode_efficiency"):
        RooflineCostModel(LLAMA, "h100-sxm", decode_efficiency=0)
    with pytest.raises(ConfigError, match="unknown hardware"):
        RooflineCostModel(LLAMA, "h900-imaginary")


def test_profiled_linear_save_load_and_fit(tmp_path) -> None:
    model = ProfiledCostModel({"const": 0.002, "prefill_tokens": 1e-4, "decode_seqs": 5e-4, "decode_context": 1e-6})
    # 2 ms + 100 tokens * 0.1 ms + 3 decodes * 0.5 ms + 3000 context * 1 us = 2 + 10 + 1.5 + 3 = 16.5 ms
    assert model.step_time(StepStats(100, 1, 5050, 100, 3, 3000)) == pytest.approx(0.0165)
    path = model.save(tmp_path / "p.json")
    again = ProfiledCostModel.load(path)
    assert again.coefficients == {f: model.coefficients.get(f, 0.0) for f in FEATURES}
    # a fit recovers coefficients that generated noiseless data
    rng = random.Random(0)
    stats = [StepStats(p, 1 if p else 0, p * p // 2, p, d, d * rng.randrange(1, 500))
             for p, d in ((rng.choice([0, 0, 16, 64, 200]), rng.randrange(0, 9)) for _ in range(200))
             if p or d]  # fmt: skip
    fitted = fit_profile(stats, [model.step_time(s) for s in stats], gaps_s=[1e-4, 2e-4, 3e-4])
    for f in FEATURES:
        assert fitted.coefficients[f] == pytest.approx(model.coefficients.get(f, 0.0), abs=1e-9)
    assert fitted.host_gap_s == pytest.approx(2e-4)
    with pytest.raises(ConfigError, match="not found"):
        ProfiledCostModel.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="unknown feature"):
        ProfiledCostModel({"flux": 1.0})


def test_profiled_token_curve_by_hand() -> None:
    # knots (1, 4, 16) at 10, 40, 100 ms; 1 ms per prefill sequence, 10 us per decode context token
    model = ProfiledCostModel(
        {"prefill_seqs": 1e-3, "decode_context": 1e-5}, token_curve=([1, 4, 16], [0.01, 0.04, 0.1])
    )
    assert model.curve_time(1) == pytest.approx(0.01)
    assert model.curve_time(2) == pytest.approx(0.02)  # a third of the way from 10 to 40 ms
    assert model.curve_time(10) == pytest.approx(0.07)  # halfway from 40 to 100 ms
    assert model.curve_time(32) == pytest.approx(0.2)  # past the last knot: proportional, 100 ms * 32 / 16
    # 8 prefill + 2 decode tokens = 10 on the curve (70 ms) + 1 prefill sequence (1 ms) + 100 context (1 ms)
    assert model.step_time(StepStats(8, 1, 36, 8, 2, 100, 60)) == pytest.approx(0.072)
    # the bulk decode path: 4 sequences reading 40, then 44 keys: 40 ms + 0.4 ms, then 40 ms + 0.44 ms
    starts, ends = model.decode_run(1.0, 4, 40, 2, float("inf"))
    assert starts == [1.0, pytest.approx(1.0404)] and ends == [pytest.approx(1.0404), pytest.approx(1.08084)]
    with pytest.raises(ConfigError, match="token_curve"):
        ProfiledCostModel({}, token_curve=([4, 1], [0.01, 0.02]))


def test_looped_decodes_follow_the_engines_padded_gather_rule() -> None:
    rule = (4, 2048)  # at least 4 decodes and (sequences x longest context) <= 2048 key slots: one padded gather
    assert StepStats(decode_seqs=4, decode_context=400, decode_max_context=512).looped_decodes(rule) == 0
    assert StepStats(decode_seqs=4, decode_context=400, decode_max_context=513).looped_decodes(rule) == 4
    assert StepStats(decode_seqs=3, decode_context=30, decode_max_context=10).looped_decodes(rule) == 3
    assert StepStats(8, 1, 36, 8, 4, 40, 10).looped_decodes(rule) == 4  # a mixed step attends one at a time
    assert StepStats(decode_seqs=3, decode_context=30, decode_max_context=10).looped_decodes(None) == 0
    model = ProfiledCostModel({"decode_seqs": 1e-3, "decode_looped_seqs": 2e-3}, batched_decode=rule)
    assert model.step_time(StepStats(decode_seqs=4, decode_context=400, decode_max_context=100)) == pytest.approx(4e-3)
    assert model.step_time(StepStats(decode_seqs=4, decode_context=4000, decode_max_context=1000)) == pytest.approx(
        12e-3
    )
    assert model.decode_run(0.0, 4, 400, 5, float("inf")) == ([], [])  # no bulk path: it needs the longest context


def test_profiled_idle_wait_by_hand() -> None:
    # steps of 0.5 s, 0.25 s between busy steps; after an idle wait the step starts 0.05 s after the arrival and
    # takes 0.1 s more
    model = ProfiledCostModel({"const": 0.5}, host_gap_s=0.25, idle_step_s=0.1, wake_s=0.05)
    start = model.start_time(0.0)
    assert start == pytest.approx(0.05)
    end = model.end_time(start, StepStats(decode_seqs=1))
    assert end == pytest.approx(0.65)
    assert model.start_time(end) == pytest.approx(0.9)  # busy: the host gap
    assert model.end_time(0.9, StepStats(decode_seqs=1)) == pytest.approx(1.4)
    assert model.start_time(3.0) == pytest.approx(3.05)  # the clock moved to an arrival: idle again
    # a request at t = 0 with 3 output tokens: prefill 0.05 -> 0.65, decodes 0.9 -> 1.4 and 1.65 -> 2.15
    sim = simulate(
        [Request(0, 0.0, 4, 3)], "tiny-gqa", model.with_noise(None), SimConfig(max_model_len=64, num_blocks=64)
    )
    (rec,) = sim.records
    assert rec.first_token_time == pytest.approx(0.65) and rec.finish_time == pytest.approx(2.15)


def test_profile_round_trip_and_v1_files(tmp_path) -> None:
    import json

    model = ProfiledCostModel({"prefill_seqs": 1e-3}, host_gap_s=1e-4, batched_decode=(4, 2048),
                              token_curve=([1, 8], [0.01, 0.03]), idle_step_s=2e-3, wake_s=3e-4,
                              wake_quantiles_s=[2e-4, 3e-4, 5e-4])  # fmt: skip
    again = ProfiledCostModel.load(model.save(tmp_path / "v2.json"))
    assert (again.batched_decode, again.token_curve, again.idle_step_s, again.wake_s, again.wake_quantiles_s) == (
        (4, 2048), ([1, 8], [0.01, 0.03]), 2e-3, 3e-4, [2e-4, 3e-4, 5e-4])  # fmt: skip
    v1 = {"format": "workbench-profile-v1", "coefficients": {f: 0.0 for f in FEATURES[:6]} | {"const": 0.02}}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    old = ProfiledCostModel.load(tmp_path / "v1.json")
    assert old.step_time(StepStats(decode_seqs=3)) == pytest.approx(0.02) and old.token_curve is None


def test_nnls_by_hand_and_curve_fit_recovers_its_generator() -> None:
    import numpy as np

    from workbench.sim.costmodel import nnls, token_knots

    # min (x1 - 1)^2 + (x2 + 1)^2 + (x1 + x2)^2 with x >= 0: x2 = 0, then x1 = 1/2
    x = nnls(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), np.array([1.0, -1.0, 0.0]))
    assert x.tolist() == pytest.approx([0.5, 0.0])
    # a free constant: the line through (0, 2), (1, 1), (2, 0) has slope -1 < 0, so the slope is 0 and the
    # constant the mean, 1; a constant may go negative (-1) where a constrained column could not
    line = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    assert nnls(line, np.array([2.0, 1.0, 0.0]), free=1).tolist() == pytest.approx([1.0, 0.0])
    assert nnls(line, np.array([-1.0, -1.0, -1.0]), free=1).tolist() == pytest.approx([-1.0, 0.0])
    rule = (4, 2048)
    truth = ProfiledCostModel({"prefill_pairs": 1e-7, "decode_context": 2e-6, "decode_looped_seqs": 1e-3},
                              batched_decode=rule, token_curve=([1, 2, 4, 8, 15, 16, 32, 64],
                              [0.010, 0.011, 0.015, 0.016, 0.0165, 0.012, 0.02, 0.04]))  # fmt: skip
    rng = random.Random(0)
    stats = []
    for _ in range(400):
        p, d = rng.choice([0, 0, 0, 5, 20, 50]), rng.randrange(0, 17)
        ctx = [rng.randrange(1, 200) for _ in range(d)]
        if p or d:
            stats.append(StepStats(p, 1 if p else 0, p * (p + 1) // 2, p, d, sum(ctx), max(ctx, default=0)))
    knots = token_knots([s.prefill_tokens + s.decode_seqs for s in stats], ratio=2.0, min_steps=1)
    assert knots[:16] == list(range(1, 17))
    # the generator's drop from 15 to 16 tokens is a kernel switch: a break there starts a new rising segment
    fitted = fit_profile(stats, [truth.step_time(s) for s in stats], batched_decode=rule, knots=knots,
                         kernel_breaks=(16,))  # fmt: skip
    for s in stats:
        assert fitted.step_time(s) == pytest.approx(truth.step_time(s), rel=1e-6)
    assert fitted.coefficients["decode_looped_seqs"] == pytest.approx(1e-3, rel=1e-6)


# ---- the scheduler's bulk decode equals step-by-step -----------------------------------------------------------
def _running_scheduler(seed: int, policy: str, caching: bool) -> Scheduler:
    rng = random.Random(seed)
    bm = BlockManager(
        num_blocks=rng.choice([40, 400]), block_size=rng.choice([1, 4, 16]), enable_prefix_caching=caching
    )
    sched = Scheduler(SchedulerConfig(policy=policy, max_model_len=256, enable_prefix_caching=caching), bm)
    for i in range(rng.randrange(1, 6)):
        sched.add(Sequence(i, [rng.randrange(50) for _ in range(rng.randrange(1, 40))],
                           SamplingParams(max_tokens=rng.randrange(2, 60), ignore_eos=True)))  # fmt: skip
    for _ in range(3):  # prefill everything
        plan = sched.schedule(now=0.0)
        sched.update(plan, {c.seq.seq_id: 7 for c in plan.chunks if c.samples}, 0.0)
    return sched


def _state(sched: Scheduler) -> list[tuple]:
    return [(s.seq_id, s.num_computed_tokens, list(s.output_token_ids), list(s.token_times), len(s.block_table),
             s.status) for s in sched.running] + [(sched.num_steps, sched.num_decode_tokens,
                                                   sched.block_manager.num_free_blocks)]  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_advance_decode_steps_equals_schedule_update(seed: int) -> None:
    policy = ("continuous", "chunked", "decode-first", "static")[seed % 4]
    bulk, ref = _running_scheduler(seed, policy, seed % 3 == 0), _running_scheduler(seed, policy, seed % 3 == 0)
    window = bulk.decode_steps_until_change()
    assert window == ref.decode_steps_until_change()
    if window < 2:
        return
    times = [1.0 + j for j in range(window - 1)]
    bulk.advance_decode_steps(times, token=7)
    for t in times:
        plan = ref.schedule(now=t)
        assert plan.is_pure_decode and not plan.preempted
        assert not ref.update(plan, {c.seq.seq_id: 7 for c in plan.chunks}, t)  # nothing finishes inside
    assert _state(bulk) == _state(ref)
    # the last step of the window finishes a sequence (or meets the pool's end): both agree afterwards
    plan_b, plan_r = bulk.schedule(now=99.0), ref.schedule(now=99.0)
    assert [(c.seq.seq_id, c.num_new_tokens) for c in plan_b.chunks] == [(c.seq.seq_id, c.num_new_tokens)
                                                                        for c in plan_r.chunks]  # fmt: skip
    with pytest.raises(ValueError, match="bulk"):
        bulk.advance_decode_steps([1.0] * 10_000)


def test_decode_steps_until_change_counts_blocks() -> None:
    # block size 4, 8 blocks; prompts of 5 and 9 tokens take 2 + 3 blocks at admission, 3 stay free
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=64), bm)
    sched.add(Sequence(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True)))
    sched.add(Sequence(1, list(range(9)), SamplingParams(max_tokens=20, ignore_eos=True)))
    plan = sched.schedule()
    sched.update(plan, {0: 9, 1: 9}, 0.0)
    assert bm.num_free_blocks == 3
    # k steps need ceil((5+k)/4) - 2 + ceil((9+k)/4) - 3 new blocks: 2 for k = 4..7, 4 for k = 8 > 3 free
    assert sched.decode_steps_until_change() == 7
    assert sched._blocks_needed(7) == 2 and sched._blocks_needed(8) == 4


# ---- simulator loop ---------------------------------------------------------------------------------------------
def test_event_order_arrival_at_step_end_is_admitted_by_the_next_step() -> None:
    cost = const_cost(1.0)
    cfg = SimConfig(num_blocks=100, max_model_len=64)
    # A at 0 (2 tokens), B exactly when A's prefill ends: continuous prefills B before A's decode (a stall)
    res = simulate([Request(0, 0.0, 4, 2), Request(1, 1.0, 4, 1)], LLAMA, cost, cfg)
    a, b = res.records
    assert a.token_times == [1.0, 3.0] and b.token_times == [2.0]
    # B a hair later: A's decode starts at 1.0 without it, B waits for that step's end
    res = simulate([Request(0, 0.0, 4, 2), Request(1, 1.0 + 1e-9, 4, 1)], LLAMA, cost, cfg)
    a, b = res.records
    assert a.token_times == [1.0, 2.0] and b.token_times == [3.0]
    assert res.duration_s == 3.0 and res.replicas[0]["busy_s"] == 3.0


def test_idle_replica_waits_for_the_next_arrival_and_host_gap_counts() -> None:
    cost = ProfiledCostModel({"const": 0.5}, host_gap_s=0.25)
    ticks = []
    res = simulate([Request(0, 0.0, 4, 1), Request(1, 10.0, 4, 2)], LLAMA, cost, SimConfig(num_blocks=100),
                   progress=SimpleNamespace(update=ticks.append))  # fmt: skip
    assert ticks == [1, 1]  # the progress bar ticks once per finished request
    a, b = res.records
    assert a.first_token_time == 0.75  # gap 0.25 then a 0.5 s step
    assert b.token_times == [10.75, 11.5]  # idle until 10, then gap + step, gap + step
    assert res.summary()["metrics"]["ttft_s"]["median"] == pytest.approx(0.75)


@pytest.mark.parametrize("policy", ["continuous", "chunked", "decode-first", "static"])
def test_bulk_fast_path_equals_step_by_step(policy: str) -> None:
    requests = synthetic_workload(60, rate=20.0, prompt_lens="uniform:8:300", output_lens="uniform:1:80", seed=3)
    cfg = SimConfig(policy=policy, num_blocks=300, max_model_len=512, max_num_seqs=8,
                    token_budget=256 if policy == "chunked" else None)  # fmt: skip
    for cost in (RooflineCostModel(LLAMA, "a100-80gb"), const_cost(0.01, prefill_tokens=1e-4, decode_context=1e-7)):
        fast = simulate(requests, LLAMA, cost, cfg)
        slow = simulate(requests, LLAMA, cost, cfg, fast=False)
        assert fast.num_steps == slow.num_steps
        assert sum(r["num_bulk_steps"] for r in fast.replicas) > 0
        assert slow.replicas[0]["num_bulk_steps"] == 0
        for f, s in zip(fast.records, slow.records):
            assert f.num_output_tokens == s.num_output_tokens and f.num_preemptions == s.num_preemptions
            assert f.token_times == pytest.approx(s.token_times, rel=1e-9)


def test_kv_pool_from_hardware_memory() -> None:
    # Llama-3.1-8B bf16 on an 80 GB H100 at 0.9: KV bytes per block of 16 tokens = 16 * 131072
    cfg = SimConfig()
    from workbench.hardware import get_hardware

    hw = get_hardware("h100-sxm")
    expected = int((hw.mem_capacity * 0.9 - LLAMA.weight_bytes("bf16")) // (16 * 131072))
    assert LLAMA.kv_bytes_per_token("bf16") == 2 * 8 * 128 * 32 * 2
    assert cfg.resolved_num_blocks(LLAMA, "h100-sxm") == expected
    with pytest.raises(ConfigError, match="no KV block"):
        SimConfig(gpu_memory_utilization=0.1).resolved_num_blocks(ModelConfig.resolve("Llama-3.1-70B"), "h100-sxm")


def test_profiled_noise_is_seeded_and_drawn_from_the_residuals() -> None:
    base = ProfiledCostModel({"const": 0.01}, residual_quantiles_s=[-0.001, 0.0, 0.004])
    assert base.step_time(StepStats(decode_seqs=1)) == 0.01  # no seed: deterministic
    a, b = base.with_noise(5), base.with_noise(5)
    draws = [a.step_time(StepStats(decode_seqs=1)) for _ in range(200)]
    assert draws == [b.step_time(StepStats(decode_seqs=1)) for _ in range(200)]
    assert min(draws) >= 0.009 - 1e-12 and max(draws) <= 0.014 + 1e-12  # const + a residual in [-1 ms, 4 ms]
    assert len(set(draws)) > 100
    _, ends = base.with_noise(5).decode_run(0.0, 2, 10, 50, float("inf"))
    steps = [e - s for s, e in zip([0.0, *ends], ends)]
    assert all(0.009 - 1e-12 <= d <= 0.014 + 1e-12 for d in steps)
    with pytest.raises(ConfigError, match="residual"):
        ProfiledCostModel({"const": 0.01}, noise_seed=1)


def test_profiled_wakes_are_drawn_from_their_quantiles_with_a_seed() -> None:
    """Wake quantiles 1, 2, 3 ms: with a seed each wake-up is drawn uniformly from [1 ms, 3 ms] (linear between the
    quantiles), so over 400 lone requests the queue's median is near 2 ms and its p90 near 2.8 ms; without a seed
    every wake is ``wake_s``; and the wake draws leave the steps' residual draws as they were."""
    noise = {"residual_quantiles_s": [-1e-4, 0.0, 1e-4]}
    base = ProfiledCostModel({"const": 0.01}, wake_s=0.002, wake_quantiles_s=[0.003, 0.001, 0.002], **noise)
    assert base.wake_quantiles_s == [0.001, 0.002, 0.003]  # sorted
    reqs = [Request(i, float(i), 4, 1) for i in range(400)]  # 1 s apart: every one finds the replica idle
    cfg = SimConfig(max_model_len=64, num_blocks=64)

    def queues(cost: ProfiledCostModel) -> tuple[list[float], list[float]]:
        result = simulate(list(reqs), "tiny-gqa", cost, cfg, record_steps=True)
        steps = result.step_logs[0].to_records()
        return [s["start_s"] - float(i) for i, s in enumerate(steps)], [s["end_s"] - s["start_s"] for s in steps]

    drawn, durations = queues(base.with_noise(3))
    assert min(drawn) >= 0.001 - 1e-12 and max(drawn) <= 0.003 + 1e-12
    drawn.sort()
    assert drawn[199] == pytest.approx(0.002, abs=2e-4) and drawn[359] == pytest.approx(0.0028, abs=1.5e-4)
    assert queues(base.with_noise(None))[0] == pytest.approx([0.002] * 400)
    without = ProfiledCostModel({"const": 0.01}, wake_s=0.002, **noise).with_noise(3)
    steady, steady_durations = queues(without)
    assert steady == pytest.approx([0.002] * 400) and steady_durations == pytest.approx(durations)
    with pytest.raises(ConfigError, match="wake_quantiles_s"):
        ProfiledCostModel({"const": 0.01}, wake_s=0.002, wake_quantiles_s=[0.001, -0.001])
    with pytest.raises(ConfigError, match="needs wake_s"):
        ProfiledCostModel({"const": 0.01}, wake_quantiles_s=[0.001, 0.002])


def test_bulk_decode_stamps_the_first_token_of_a_prefill_that_ended_one_short() -> None:
    # chunk size 8 and a 9-token prompt: the first chunk computes 8 tokens, the 9th is computed as a "decode"
    # that samples the first output token; a bulk run starting there must stamp first_token_time
    cost = const_cost(1.0)
    cfg = SimConfig(policy="chunked", num_blocks=100, token_budget=8, chunk_size=8, max_model_len=64)
    for fast in (True, False):
        res = simulate([Request(0, 0.0, 9, 5)], LLAMA, cost, cfg, fast=fast)
        rec = res.records[0]
        assert rec.token_times == [2.0, 3.0, 4.0, 5.0, 6.0]
        assert rec.first_token_time == 2.0
    assert res.replicas[0]["num_bulk_steps"] == 0
    fast_run = simulate([Request(0, 0.0, 9, 5)], LLAMA, cost, cfg)
    assert fast_run.replicas[0]["num_bulk_steps"] > 0
