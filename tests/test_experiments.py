"""The computations behind the notebooks, on a tiny model: shapes of the results and hand-checkable accounting."""

import pytest

from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.errors import TraceError
from workbench.experiments.phases import add_roofline, measure_decode, measure_decode_paged, measure_prefill
from workbench.experiments.serving import compare_policies, long_prompt_among_decodes, pool_for, scale_lengths
from workbench.hardware import get_hardware
from workbench.model import Transformer
from workbench.workloads import Request


@pytest.fixture(scope="module")
def model():
    return Transformer.from_config(ModelConfig.from_name("tiny-gqa"), seed=0)


def test_measure_and_place_on_roofline(model):
    rows = measure_prefill(model, [8, 16], repeats=1) + measure_decode(model, [1, 2], [4, 32], repeats=1)
    rows += measure_decode_paged(model, 2, [5], block_size=4, repeats=1)
    assert [(r["phase"], r["batch"], r["context_len"]) for r in rows] == [
        ("prefill", 1, 8), ("prefill", 1, 16), ("decode", 1, 4), ("decode", 2, 4), ("decode", 1, 32),
        ("decode", 2, 32), ("decode", 2, 5),
    ]  # fmt: skip
    hw = get_hardware("h100-sxm")
    placed = add_roofline(rows, model, hw, "fp32")
    for r in placed:
        assert r["time_s"] > 0
        assert r["mfu"] == pytest.approx(r["flops"] / r["time_s"] / hw.peak("fp32"))
        # the one MBU: weight + KV bytes (activations left out) over the read bandwidth
        assert r["read_bytes"] < r["bytes"]
        assert r["mbu"] == pytest.approx(r["read_bytes"] / r["time_s"] / hw.mem_bandwidth)
    # a batch-2 decode does twice the batch-1 matmul work (plus twice the attention): FLOPs scale with the batch
    d1, d2 = placed[2], placed[3]
    assert d2["flops"] == pytest.approx(2 * d1["flops"])
    assert placed[3]["tokens_per_s"] == pytest.approx(2 / placed[3]["time_s"])


def test_scale_lengths_by_hand():
    reqs = [Request(0, 0.0, 100, 40), Request(1, 0.5, 1000, 3), Request(2, 1.0, 7, 1)]
    out = scale_lengths(reqs, 0.1, max_len=64)
    # 100*0.1=10, 40*0.1=4; 1000*0.1=100 -> clipped to 63 prompt + 1 output; 7*0.1 -> at least 1 each
    assert [(r.prompt_len, r.output_len, r.arrival_time_s) for r in out] == [(10, 4, 0.0), (63, 1, 0.5), (1, 1, 1.0)]
    with pytest.raises(TraceError, match="factor"):
        scale_lengths(reqs, 0.0, 64)


def test_long_prompt_scenario_one_shot_vs_chunked(model):
    kw = dict(num_decodes=3, decode_prompt_len=4, decode_output_len=12, long_prompt_len=100, inject_after_steps=3)
    one_shot = long_prompt_among_decodes(model, EngineConfig(policy="continuous", max_model_len=256), **kw)
    chunked_cfg = EngineConfig(policy="chunked", max_model_len=256, token_budget=24, chunk_size=24)
    chunked = long_prompt_among_decodes(model, chunked_cfg, **kw)
    s1, s2 = one_shot["steps"], chunked["steps"]
    assert s1.num_prefill_tokens.max() == 100  # the whole prompt in one step, no decode in it
    assert (s1[s1.num_prefill_tokens == 100].num_decode_tokens == 0).all()
    # chunked: every step holds at most the budget; the prompt is spread over ceil(100 / (24 - 3)) = 5 steps
    assert (s2.num_prefill_tokens + s2.num_decode_tokens).max() <= 24
    assert (s2.num_prefill_tokens > 0).sum() == 1 + 5  # the three 4-token prompts share the first step
    for run in (one_shot, chunked):
        assert run["long_ttft_s"] > 0 and len(run["requests"]) == 4
        assert run["stall_itl_max_s"] <= run["steps"].duration_s.sum()


def test_pool_for_sizes_the_pool_by_hand(model):
    cfg = EngineConfig(max_model_len=256)  # default pool: 32 x 256 tokens = 512 blocks of 16 (tiny-gqa fits it)
    assert cfg.cache_shape(model.config) == (512, 16)
    # 20 and 40 tokens: at most 3 blocks each; 2 x 3 blocks over the 1% watermark: ceil(6 / 0.99) + 1 = 8
    assert pool_for(cfg, model, [20, 40]).num_blocks == 8
    assert pool_for(cfg, model, [17] * 5).num_blocks == 12  # 5 x 2 = 10: ceil(10 / 0.99) + 1
    for kept in (
        EngineConfig(max_model_len=256, num_blocks=100),  # the caller's pool
        EngineConfig(max_model_len=256, kv_cache_bytes=1 << 20),
        EngineConfig(max_model_len=256, cache="contiguous"),
        EngineConfig(max_model_len=256, max_num_seqs=1),  # the default (16 blocks) is smaller than 32 x 256 needs
    ):
        assert pool_for(kept, model, [256] * 32) is kept
    assert pool_for(cfg, model, []) is cfg


def test_long_prompt_scenario_schedules_alike_in_its_sized_pool(model):
    """The scenario's engine gets the pool its requests need (``pool_for``), not the default: the same steps as in a
    pool of 512 blocks, token for token."""
    kw = dict(num_decodes=3, decode_prompt_len=4, decode_output_len=12, long_prompt_len=100, inject_after_steps=3)
    for policy, extra in (("continuous", {}), ("chunked", {"token_budget": 24, "chunk_size": 24})):
        sized = long_prompt_among_decodes(model, EngineConfig(policy=policy, max_model_len=256, **extra), **kw)
        large = EngineConfig(policy=policy, max_model_len=256, num_blocks=512, **extra)
        big = long_prompt_among_decodes(model, large, **kw)
        cols = ["num_prefill_tokens", "num_decode_tokens", "num_seqs", "num_preempted"]
        assert sized["steps"][cols].values.tolist() == big["steps"][cols].values.tolist()
        # 3 x ceil(16 / 16) + ceil(104 / 16) = 3 + 7 blocks at most in use, of ceil(4 x 7 / 0.99) + 1 = 30
        assert sized["steps"].num_blocks_used.max() <= 10 < 30


def test_compare_policies_same_requests(model):
    reqs = [Request(i, 0.01 * i, 10 + i, 5) for i in range(5)]
    cfgs = {p: EngineConfig(policy=p, max_model_len=64, max_num_seqs=2) for p in ("static", "continuous")}
    table, results = compare_policies(model, cfgs, reqs, {"slo_ttft_s": 100.0})
    assert list(table.label) == ["static", "continuous"]
    assert (table.num_finished == 5).all() and (table.slo_attainment == 100.0).all()
    tokens = {p: [r.tokens for r in res.requests] for p, res in results.items()}
    assert tokens["static"] == tokens["continuous"]
