"""Memory ledger: sizes checked against published figures and hand arithmetic."""

from __future__ import annotations

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.kv.ledger import MemoryLedger
from workbench.kv.sizing import paged_vs_contiguous, plan_num_blocks
from workbench.request import SamplingParams, Sequence


def test_llama31_8b_sizes() -> None:
    model = ModelConfig.from_name("Llama-3.1-8B")
    # 32 layers, 8 KV heads of 128: 2 * 32 * 8 * 128 * 2 bytes = 128 KiB per token in bf16
    assert model.kv_bytes_per_token("bf16") == 131_072
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
    full = mha.kv_bytes_per_token()
    assert gqa.kv_bytes_per_token() * 2 == full
    assert mqa.kv_bytes_per_token() * mha.num_heads == full
    # tiny-mha: 2 layers x 4 kv heads x 16 dims x (K, V) x 4 bytes in fp32
    assert mha.kv_bytes_per_token("fp32") == 2 * 2 * 4 * 16 * 4


def test_plan_num_blocks() -> None:
    model = ModelConfig.from_name("Llama-3.1-8B")
    # 1 GiB / (16 tokens * 128 KiB) = 512 blocks; 1,000 wanted tokens need ceil(1000 / 16) = 63 of them
    assert plan_num_blocks(model, 16, "bf16", 1 << 30) == 512
    assert plan_num_blocks(model, 16, "bf16", 1 << 30, wanted_tokens=1000) == 63
    with pytest.raises(ConfigError, match="holds no block"):
        plan_num_blocks(model, 16, "bf16", 1000)


def test_contiguous_versus_paged_waste() -> None:
    # max_model_len 100, blocks of 16; requests holding 10, 40 and 100 tokens
    model = ModelConfig.from_name("tiny-mha")
    per_token = model.kv_bytes_per_token("bf16")
    w = paged_vs_contiguous(model, [10, 40, 100], block_size=16, max_len=100)
    assert w.used_tokens == 150 and w.contiguous_tokens == 300
    # paged: 16 + 48 + 112 = 176 reserved, waste 6 + 8 + 12 = 26
    assert w.paged_tokens == 176
    assert w.contiguous_bytes - w.used_bytes == 150 * per_token and w.paged_bytes - w.used_bytes == 26 * per_token
    assert w.contiguous_waste == pytest.approx(0.5) and w.paged_waste == pytest.approx(26 / 176)


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
    waste = snap["waste"]
    assert waste["contiguous_tokens"] - waste["used_tokens"] == 23 and waste["paged_tokens"] - waste["used_tokens"] == 3


def test_contiguous_block_manager_waste_matches_the_contiguous_formula() -> None:
    # the engine's contiguous cache is a BlockManager with one max_model_len block per sequence: its
    # paged waste equals the contiguous waste
    w = paged_vs_contiguous(ModelConfig.from_name("tiny-mha"), [5, 30], block_size=32, max_len=32)
    assert w.paged_tokens == w.contiguous_tokens == 64 and w.paged_waste == w.contiguous_waste == (64 - 35) / 64
