"""Memory ledger: sizes checked against published figures and hand arithmetic."""

from __future__ import annotations

import pytest

from workbench.config import ModelConfig
from workbench.engine.sequence import SamplingParams, Sequence
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.kv.ledger import MemoryLedger, cache_waste, kv_bytes_per_token, num_blocks_for_budget


def test_llama31_8b_sizes() -> None:
    model = ModelConfig.from_name("Llama-3.1-8B")
    # 32 layers, 8 KV heads of 128: 2 * 32 * 8 * 128 * 2 bytes = 128 KiB per token in bf16
    assert kv_bytes_per_token(model, "bf16") == 131_072
    # 8,030,261,248 parameters (the HF model card's 8.03B, counted from the safetensors index)
    assert model.num_params() == 8_030_261_248
    bm = BlockManager(num_blocks=100, block_size=16)
    ledger = MemoryLedger(model, bm, weight_dtype="bf16", kv_dtype="fp8", max_model_len=8192)
    snap = ledger.snapshot()
    assert snap["weight_bytes"] == 2 * 8_030_261_248
    assert snap["kv_bytes_per_token"] == 65_536  # fp8 halves it
    assert snap["block_bytes"] == 16 * 65_536
    assert snap["pool_bytes"] == 100 * 16 * 65_536
    assert snap["blocks_free"] == 100 and snap["blocks_used"] == 0
    assert snap["attention"] == "GQA"


def test_mha_gqa_mqa_scale_kv_bytes() -> None:
    mha = ModelConfig.from_name("tiny-mha")
    gqa = mha.with_overrides(num_kv_heads=mha.num_heads // 2)
    mqa = mha.with_overrides(num_kv_heads=1)
    full = kv_bytes_per_token(mha)
    assert kv_bytes_per_token(gqa) * 2 == full
    assert kv_bytes_per_token(mqa) * mha.num_heads == full
    assert kv_bytes_per_token(mha, "fp32") == mha.kv_bytes_per_token("fp32")


def test_num_blocks_for_budget() -> None:
    model = ModelConfig.from_name("Llama-3.1-8B")
    # 1 GiB / (16 tokens * 128 KiB) = 512 blocks
    assert num_blocks_for_budget(model, 1 << 30, 16) == 512
    with pytest.raises(ConfigError, match="holds no block"):
        num_blocks_for_budget(model, 1000, 16)


def test_contiguous_versus_paged_waste() -> None:
    # max_model_len 100, blocks of 16; requests holding 10, 40 and 100 tokens
    w = cache_waste([10, 40, 100], max_model_len=100, block_size=16, kv_bytes_per_token=4)
    assert w.contiguous_reserved == 300 and w.contiguous_waste == 150
    # paged: 16 + 48 + 112 = 176 reserved, waste 6 + 8 + 12 = 26
    assert w.paged_reserved == 176 and w.paged_waste == 26
    d = w.as_dict()
    assert d["contiguous_waste_bytes"] == 600 and d["paged_waste_bytes"] == 104
    assert d["paged_waste_fraction"] == pytest.approx(26 / 176)


def test_ledger_follows_the_block_manager() -> None:
    model = ModelConfig.from_name("tiny-gqa")
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    ledger = MemoryLedger(model, bm, max_model_len=32)
    a = Sequence(0, list(range(9)), SamplingParams(max_tokens=4))  # 9 tokens: 3 blocks
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.mark_computed(a)
    snap = ledger.snapshot([a])
    assert snap["blocks_used"] == 3 and snap["blocks_free"] == 7 and snap["blocks_cached"] == 2
    assert snap["used_kv_bytes"] == 3 * 4 * model.kv_bytes_per_token("bf16")
    # 9 tokens held: contiguous reserves 32 (waste 23), paged 12 (waste 3)
    assert snap["waste"]["contiguous_waste"] == 23 and snap["waste"]["paged_waste"] == 3


def test_contiguous_block_manager_waste_matches_the_contiguous_formula() -> None:
    # the engine's contiguous cache is a BlockManager with one max_model_len block per sequence: its
    # paged waste equals the contiguous waste
    w = cache_waste([5, 30], max_model_len=32, block_size=32)
    assert w.paged_waste == w.contiguous_waste == 64 - 35
