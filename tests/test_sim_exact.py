"""The simulator, fed the step times an engine run measured, reproduces that run's per-request TTFT and E2E exactly."""

from __future__ import annotations

import random

import pytest

from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.model import load_checkpoint
from workbench.request import SamplingParams
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import TraceCostModel
from workbench.workloads import Request

POLICIES = ("static", "continuous", "chunked", "prefill-first", "decode-first")
rng = random.Random(1)
PROMPT_LENS = [rng.randrange(1, 70) for _ in range(10)]
OUTPUT_LENS = [rng.randrange(1, 14) for _ in range(10)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint("tiny-gqa"))


def _configs(policy: str) -> tuple[EngineConfig, SimConfig]:
    # a pool of 12 blocks of 8 tokens (the longest request needs 11), so requests get preempted; at most 4
    # sequences a step; chunked: a budget of 32 tokens in chunks of 12
    chunked = policy == "chunked"
    common = dict(policy=policy, block_size=8, num_blocks=12, max_num_seqs=4, max_model_len=96,
                  token_budget=32 if chunked else None, chunk_size=12 if chunked else None)  # fmt: skip
    return EngineConfig(**common), SimConfig(**common, dtype="fp32")


def _compare(run, sim) -> None:
    assert len(run.requests) == len(sim.records)
    for r, s in zip(run.requests, sim.records):
        assert s.num_output_tokens == len(r.tokens)
        assert s.first_token_time - s.arrival_time == r.ttft_s  # exact: same floats
        assert s.finish_time - s.arrival_time == r.finish_time - r.arrival_time
        assert s.token_times == r.token_times
        assert s.num_preemptions == r.num_preemptions


@pytest.mark.parametrize("policy", POLICIES)
def test_generate_reproduced_exactly(model, policy: str) -> None:
    ecfg, scfg = _configs(policy)
    engine = Engine(model, ecfg)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in OUTPUT_LENS]
    run = engine.generate(prompts, params)
    arrival = run.requests[0].arrival_time  # generate: everything arrives when it starts
    requests = [
        Request(i, arrival, len(p), m, prompt_token_ids=p) for i, (p, m) in enumerate(zip(prompts, OUTPUT_LENS))
    ]
    sim = simulate(requests, model.config, TraceCostModel(engine.step_log), scfg)
    _compare(run, sim)
    assert sim.num_steps == len(engine.step_log)


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_reproduced_exactly(model, policy: str) -> None:
    ecfg, scfg = _configs(policy)
    engine = Engine(model, ecfg)
    arrivals = sorted(rng.uniform(0.0, 0.15) for _ in PROMPT_LENS)
    arrivals[3] = arrivals[2]  # two requests at the same instant
    requests = [Request(i, t, n, m) for i, (t, n, m) in enumerate(zip(arrivals, PROMPT_LENS, OUTPUT_LENS))]
    run = engine.replay(requests)
    sim = simulate(requests, model.config, TraceCostModel(engine.step_log), scfg)
    _compare(run, sim)
    assert sim.num_steps == len(engine.step_log)
    assert sim.duration_s <= run.duration_s


def test_trace_cost_model_detects_divergence(model) -> None:
    ecfg, scfg = _configs("continuous")
    engine = Engine(model, ecfg)
    requests = [Request(i, 0.0, n, m) for i, (n, m) in enumerate(zip(PROMPT_LENS, OUTPUT_LENS))]
    engine.replay(requests)
    other = SimConfig(policy="decode-first", block_size=8, num_blocks=12, max_num_seqs=4, max_model_len=96)
    with pytest.raises(RuntimeError, match="prefill"):
        simulate(requests, model.config, TraceCostModel(engine.step_log), other)


def test_measure_engine_steps_pairs_each_logged_step_with_its_plan(model) -> None:
    from workbench.sim.costmodel import ProfiledCostModel, fit_profile
    from workbench.sim.measure import measure_engine_steps

    ecfg, _ = _configs("chunked")
    requests = [Request(i, 0.01 * i, n, m) for i, (n, m) in enumerate(zip(PROMPT_LENS, OUTPUT_LENS))]
    samples = measure_engine_steps(lambda: Engine(model, ecfg), [requests])
    assert len(samples.stats) == len(samples.durations_s) > 0
    # each request computes its prompt and all its outputs but the last (more after a preemption)
    computed = sum(s.prefill_tokens + s.decode_seqs for s in samples.stats)
    assert computed >= sum(PROMPT_LENS) + sum(OUTPUT_LENS) - len(OUTPUT_LENS)
    assert all(d > 0 for d in samples.durations_s) and all(g >= 0 for g in samples.gaps_s)
    profile = fit_profile(samples.stats, samples.durations_s, samples.gaps_s)
    assert isinstance(profile, ProfiledCostModel) and profile.coefficients["const"] != 0.0
