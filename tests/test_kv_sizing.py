"""KV-cache calculator: bytes per token by hand, attention variants, capacity, paged versus contiguous."""

from __future__ import annotations

import dataclasses

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.experiments.kv import capacity_by_variant
from workbench.hardware import get_hardware
from workbench.kv.sizing import attention_variants, max_concurrent_sequences, paged_vs_contiguous

GIB = 2**30


def test_kv_bytes_per_token_of_llama_2_7b_and_llama_3_1_8b_by_hand() -> None:
    # K and V x 32 layers x 32 KV heads x head_dim 128 x 2 bytes (fp16) = 512 KiB
    assert ModelConfig.from_name("Llama-2-7B").kv_bytes_per_token("fp16") == 2 * 32 * 32 * 128 * 2 == 524_288
    # GQA with 8 KV heads: a quarter of that, 128 KiB
    assert ModelConfig.from_name("Llama-3.1-8B").kv_bytes_per_token("fp16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert ModelConfig.from_name("Llama-3.1-8B").kv_bytes_per_token("fp8") == 65_536


def test_attention_variants() -> None:
    rows = attention_variants(ModelConfig.from_name("Llama-2-7B"), "fp16")
    assert [(r["kind"], r["num_kv_heads"], r["bytes_per_token"]) for r in rows] == [
        ("MHA", 32, 524_288),
        ("GQA", 8, 131_072),
        ("MQA", 1, 16_384),
    ]
    assert [r["is_model"] for r in rows] == [True, False, False]
    rows = attention_variants(ModelConfig.from_name("Llama-3.1-8B"), "bf16")
    assert rows[1] == {"kind": "GQA", "num_kv_heads": 8, "bytes_per_token": 131_072, "ratio_to_mha": 0.25,
                       "is_model": True}  # fmt: skip
    # tiny-mha has 4 heads: the GQA counterpart is 2 KV heads
    assert attention_variants(ModelConfig.from_name("tiny-mha"))[1]["num_kv_heads"] == 2
    with pytest.raises(ConfigError, match="gqa_kv_heads"):
        attention_variants(ModelConfig.from_name("tiny-mha"), gqa_kv_heads=3)


def test_max_concurrent_sequences_by_hand() -> None:
    cfg = ModelConfig.from_name("Llama-3.1-8B")
    # 80 GiB minus 8,030,261,248 bf16 parameters (16,060,522,496 bytes) leaves 69,838,823,424 bytes;
    # a 4096-token sequence holds 4096 x 128 KiB = 512 MiB: 130 sequences (130.08)
    res = max_concurrent_sequences(cfg, 80 * GIB, 4096, dtype="bf16")
    assert res.max_seqs == 130
    assert res.bytes_per_seq == 4096 * 131_072
    # paged with 16-token blocks: 4000 tokens take 250 blocks = 4000 tokens exactly; 4001 take 251 blocks
    assert max_concurrent_sequences(cfg, 80 * GIB, 4000, block_size=16).bytes_per_seq == 4000 * 131_072
    assert max_concurrent_sequences(cfg, 80 * GIB, 4001, block_size=16).bytes_per_seq == 4016 * 131_072
    # a reserve for activations comes off the budget; weights that do not fit leave room for none
    assert max_concurrent_sequences(cfg, 80 * GIB, 4096, reserve_bytes=GIB).max_seqs == 128
    assert max_concurrent_sequences(cfg, 10 * GIB, 16).max_seqs == 0
    with pytest.raises(ConfigError, match="seq_len"):
        max_concurrent_sequences(cfg, 80 * GIB, 0)


def test_capacity_by_variant_counts_the_weights_in_bf16_under_an_int8_kv_cache() -> None:
    # Llama-3.1-8B in 80 GiB: the bf16 weights (16,060,522,496 bytes) leave 69,838,823,424 bytes; an int8 token is
    # 2 (K, V) x 32 layers x 8 KV heads x (128 bytes + a 4-byte fp32 scale) = 67,584 bytes, a 4096-token sequence
    # 276,824,064 bytes: 252 sequences (252.3). Weights counted at int8's 1 byte would have given 281.
    hw = dataclasses.replace(get_hardware("h100-sxm"), mem_capacity=80 * GIB)
    rows = capacity_by_variant(ModelConfig.from_name("Llama-3.1-8B"), hw, 4096, kv_dtype="int8")
    gqa = next(r for r in rows if r["kind"] == "GQA")
    assert gqa["bytes_per_seq"] == 4096 * 67_584 == 276_824_064
    assert gqa["max_seqs"] == 252


def test_paged_versus_contiguous_by_hand() -> None:
    cfg = ModelConfig.from_name("tiny-gqa")  # 2 layers x 2 KV heads x 16 x 2 bytes x 2 = 256 bytes per token
    lengths = [5, 16, 17, 1]
    cmp = paged_vs_contiguous(cfg, lengths, block_size=16, max_len=64, kv_dtype="bf16")
    assert cmp.used_tokens == 39
    assert cmp.contiguous_tokens == 4 * 64
    assert cmp.paged_tokens == 16 + 16 + 32 + 16
    assert cmp.paged_bytes == 80 * 256
    assert cmp.contiguous_waste == pytest.approx(1 - 39 / 256)
    assert cmp.paged_waste == pytest.approx(1 - 39 / 80)
    # block size 1 wastes nothing
    assert paged_vs_contiguous(cfg, lengths, block_size=1).paged_waste == 0.0
    # default max_len is the longest request
    assert paged_vs_contiguous(cfg, lengths).contiguous_tokens == 4 * 17
    with pytest.raises(ConfigError, match="max_len"):
        paged_vs_contiguous(cfg, lengths, max_len=10)
    assert set(cmp.to_dict()) >= {"paged_bytes", "contiguous_bytes", "used_bytes", "paged_waste"}
