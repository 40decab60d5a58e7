"""Notebook 02's MLA and MoE sections (workbench.experiments.moe): hand counts and the routers' own choices."""

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.experiments.claims import CONFIRMED, NOT_CONFIRMED
from workbench.experiments.moe import (
    distinct_experts_as_predicted,
    measure_distinct_experts,
    mla_caches_less_than_gqa,
    mla_variants,
    moe_bytes_per_seq_fall_with_batch,
    moe_decode_bytes,
)
from workbench.hardware import get_hardware
from workbench.model import Transformer

V3 = ModelConfig.from_name("DeepSeek-V3")


def test_mla_variants_hand_counts():
    hw = get_hardware("h100-sxm")
    rows = {r["kind"]: r for r in mla_variants(V3, hw, seq_len=1000, kv_budget_bytes=2**30, batch=2)}
    # per KV head K = 128 nope + 64 rope, V = 128; 61 layers; bf16
    assert rows["MHA"]["bytes_per_token"] == 61 * 128 * (192 + 128) * 2
    assert rows["GQA"]["bytes_per_token"] == 61 * 8 * (192 + 128) * 2
    assert rows["MQA"]["bytes_per_token"] == 61 * 1 * (192 + 128) * 2
    assert rows["MLA"]["bytes_per_token"] == 61 * (512 + 64) * 2
    assert rows["MLA"]["max_seqs"] == 2**30 // (61 * 576 * 2 * 1000) == 15
    assert rows["MLA"]["kv_read_ms"] == pytest.approx(2 * 1000 * 61 * 576 * 2 / hw.mem_bandwidth * 1e3)
    assert mla_caches_less_than_gqa(list(rows.values()))["verdict"] == CONFIRMED
    with pytest.raises(ConfigError, match="not an MLA model"):
        mla_variants(ModelConfig.from_name("Llama-3.1-8B"), hw, 10, 1e9, 1)


def test_moe_decode_bytes_claim():
    rows = moe_decode_bytes(ModelConfig.from_name("Mixtral-8x7B"), [1, 4, 16])
    assert moe_bytes_per_seq_fall_with_batch(rows)["verdict"] == CONFIRMED
    flat = [dict(r, weight_bytes=1.0, bytes_per_seq=1.0 / r["batch"]) for r in rows]  # no growth: not an MoE read
    assert moe_bytes_per_seq_fall_with_batch(flat)["verdict"] == NOT_CONFIRMED


def test_measured_distinct_experts_of_a_real_router():
    model = Transformer.from_config(ModelConfig.from_name("tiny-mixtral"), seed=0)  # 4 experts, top-2
    rows = measure_distinct_experts(model, [1, 3, 64])
    assert rows[0]["measured_experts"] == 2  # one token reads exactly its k experts
    assert rows[0]["measured_weight_bytes"] == rows[0]["predicted_weight_bytes"]
    assert 2 <= rows[1]["measured_experts"] <= 4
    assert rows[2]["measured_experts"] == 4  # 64 tokens hit all four
    claim = distinct_experts_as_predicted(rows)
    assert claim["verdict"] == CONFIRMED
    off = [dict(r, measured_experts=r["expected_experts"] * 2) for r in rows]
    assert distinct_experts_as_predicted(off)["verdict"] == NOT_CONFIRMED


def test_attention_variants_of_an_mla_model_name_its_own_row():
    from workbench.kv.sizing import attention_variants

    rows = attention_variants(V3)
    assert [r["kind"] for r in rows] == ["MHA", "GQA", "MQA", "MLA"]
    assert [r["kind"] for r in rows if r["is_model"]] == ["MLA"]
    assert rows[-1]["ratio_to_mha"] == (512 + 64) / (128 * (192 + 128))
