"""The serving engine end to end on a real (tiny) model: every layout x policy x block size gives HF's greedy tokens."""

import random
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import hf_greedy_tokens
from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model import load_checkpoint
from workbench.model.attention import build_metadata
from workbench.request import SamplingParams

MAX_TOKENS = 10
rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 33, 17, 64, 1, 40)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    path = tiny_checkpoint("tiny-gqa")
    model = load_checkpoint(path)
    expected = hf_greedy_tokens(path, PROMPTS, MAX_TOKENS)
    return model, expected


GRID = [
    (cache, policy, block_size, chunk)
    for cache in ("paged", "contiguous")
    for policy in ("static", "continuous", "chunked", "decode-first")
    for block_size in ((1, 16) if cache == "paged" else (None,))
    for chunk in ((8, 7) if policy == "chunked" else (None,))  # 8 divides the 64- and 40-token prompts, 7 none
]


@pytest.mark.parametrize("cache, policy, block_size, chunk", GRID)
def test_greedy_tokens_identical_to_hf(setup, cache, policy, block_size, chunk):
    model, expected = setup
    cfg = EngineConfig(
        policy=policy, cache=cache, block_size=block_size or 16, max_model_len=96, max_num_seqs=4,
        chunk_size=chunk, token_budget=16 if chunk else None,
    )  # fmt: skip
    engine = Engine(model, cfg)
    res = engine.generate(PROMPTS, GREEDY)
    assert [r.tokens for r in res.requests] == expected
    log = engine.step_log.to_dataframe()
    assert log.num_seqs.max() <= 4
    if chunk:
        assert log.eval("num_prefill_tokens + num_decode_tokens").max() <= 16  # the token budget holds


def test_chunked_step_mixes_decodes_and_prefill_chunks(setup):
    model, _ = setup
    engine = Engine(model, EngineConfig(policy="chunked", max_model_len=96, token_budget=12, chunk_size=12))
    engine.generate(PROMPTS, GREEDY)
    log = engine.step_log.to_dataframe()
    mixed = log[(log.num_prefill_tokens > 0) & (log.num_decode_tokens > 0)]
    assert len(mixed) > 0


def test_chunked_prefill_logits_equal_one_shot(setup):
    model, _ = setup
    prompt = PROMPTS[3]  # 64 tokens
    block_size, table = 4, list(range(15, -1, -1))
    one = KVCache(model.config, 16, block_size)
    meta = build_metadata([64], [64], [table], block_size)
    expected = model.compute_logits(model.forward(torch.tensor(prompt), meta, one)[-1:])
    chunked = KVCache(model.config, 16, block_size)
    done = 0
    for n in (7, 7, 20, 1, 29):  # chunks that do not divide the prompt or the block size
        meta = build_metadata([n], [done + n], [table], block_size)
        hidden = model.forward(torch.tensor(prompt[done : done + n]), meta, chunked)
        done += n
    torch.testing.assert_close(model.compute_logits(hidden[-1:]), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.k, one.k, atol=1e-5, rtol=1e-5)


def test_prefix_cache_hit_same_tokens_fewer_prefill_tokens(setup):
    model, expected = setup
    shared = PROMPTS[3][:48]  # three full 16-token blocks
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    off = Engine(model, EngineConfig(max_model_len=96))
    on = Engine(model, EngineConfig(max_model_len=96, enable_prefix_caching=True))
    ref = off.generate(prompts, GREEDY)
    first = on.generate(prompts[:1], GREEDY)
    second = on.generate(prompts[1:], GREEDY)
    assert [r.tokens for r in first.requests + second.requests] == [r.tokens for r in ref.requests]
    assert second.requests[0].num_cached_tokens == 48
    computed_off = off.scheduler.num_prefill_tokens
    computed_on = on.scheduler.num_prefill_tokens
    assert computed_off - computed_on == 48


@pytest.mark.parametrize("policy", ["continuous", "chunked", "decode-first", "static"])
def test_tiny_pool_preempts_and_still_gives_the_same_tokens(setup, policy):
    model, expected = setup
    # 20 blocks of 4 tokens: the longest request (64 + 10) fits alone, not all at once
    cfg = EngineConfig(policy=policy, block_size=4, num_blocks=20, max_model_len=96,
                       token_budget=16 if policy == "chunked" else None)  # fmt: skip
    res = Engine(model, cfg).generate(PROMPTS, GREEDY)
    assert [r.tokens for r in res.requests] == expected
    assert res.num_preemptions > 0


def test_rejections_do_not_stop_the_others(setup):
    model, expected = setup
    engine = Engine(model, EngineConfig(max_model_len=96, block_size=4, num_blocks=20))
    prompts = [PROMPTS[0], [], [1, 999], [5] * 97, PROMPTS[2]]
    params = [GREEDY, GREEDY, GREEDY, GREEDY, GREEDY]
    res = engine.generate(prompts, params)
    reasons = [r.reject_reason or "" for r in res.requests]
    assert [r.finish_reason for r in res.requests] == ["length", "rejected", "rejected", "rejected", "length"]
    assert "empty prompt" in reasons[1] and "outside the vocabulary" in reasons[2] and "max_model_len" in reasons[3]
    assert res.requests[0].tokens == expected[0] and res.requests[4].tokens == expected[2]
    bad_params = engine.add_request([1, 2], {"temperature": -1.0})
    assert "temperature" in engine.sequences[bad_params].reject_reason


def test_replay_honours_arrivals_and_reports_contract_metrics(setup):
    model, expected = setup
    reqs = [SimpleNamespace(arrival_time_s=0.05 * i, prompt_token_ids=p, output_len=4) for i, p in enumerate(PROMPTS)]
    counter = SimpleNamespace(n=0, update=lambda k: setattr(counter, "n", counter.n + k))
    res = Engine(model, EngineConfig(max_model_len=96)).replay(reqs, progress=counter)
    assert counter.n == len(PROMPTS)  # the progress bar ticks once per finished request
    for r, e, req in zip(res.requests, expected, reqs):
        assert r.tokens == e[:4]
        assert r.arrival_time == req.arrival_time_s and r.first_token_time >= req.arrival_time_s
    summary = res.summary(slo_ttft_s=10.0)
    assert summary["num_requests"] == summary["num_finished"] == len(PROMPTS)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert set(summary["metrics"][key]) >= {"mean", "median", "p90", "p95", "p99"}
    assert summary["metrics"]["slo_attainment"] == 100.0
    assert res.duration_s >= reqs[-1].arrival_time_s


def test_engine_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="cache"):
        EngineConfig(cache="ring")
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="policy"):
        EngineConfig(policy="fastest")
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineConfig(max_model_len=10_000).cache_shape(ModelConfig.from_name("tiny-mha"))


def test_engine_ledger_and_memory_budget(setup):
    model, _ = setup
    cfg = model.config  # tiny-gqa: 2 layers x 2 kv heads x 16 dims x (K, V) x 4 bytes = 512 B/token in fp32
    engine = Engine(model, EngineConfig(max_model_len=96, block_size=8, kv_cache_bytes=100_000))
    assert cfg.kv_bytes_per_token("fp32") == 512
    assert engine.block_manager.num_blocks == 100_000 // (8 * 512) == 24
    finished = engine.generate(PROMPTS[:2], GREEDY).sequences  # the engine itself keeps no finished request
    assert engine.sequences == {}
    snap = engine.ledger.snapshot(finished)
    assert snap["pool_bytes"] == 24 * 8 * 512 and snap["blocks_used"] == 0
    # the two requests held 5 + 9 and 33 + 9 K/V positions (the last sampled token is never cached)
    assert snap["waste"]["used_tokens"] == (5 + MAX_TOKENS - 1) + (33 + MAX_TOKENS - 1)
    assert snap["waste"]["contiguous_tokens"] == 2 * 96
