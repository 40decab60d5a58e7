"""Byte counts of quantized weights and KV caches, checked against sums done by hand.

Toy shape (untied head): hidden 64, intermediate 128, 4 query heads and 2 KV heads of 16, 2 layers, vocab 100.
Per layer the seven matrices hold 4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192 = 36,864 weights in 512 rows;
the embedding (6,400), the four layer norms and the final norm (320) stay in the activation dtype.
"""

import pytest

from workbench.config import ConfigError, ModelConfig, canonical_quantization, resolve_kv_cache_dtype

TOY = ModelConfig(
    name="toy",
    architecture="LlamaForCausalLM",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
PLAIN_FP32 = (6400 + 320) * 4  # embedding + norms, fp32


def test_unquantized_weight_bytes_are_params_times_dtype():
    assert TOY.weight_bytes("fp32") == TOY.num_params() * 4
    assert TOY.num_params() == 2 * 36_864 + 6_400 + 6_400 + 320


def test_int8_per_channel_weight_bytes():
    # per layer: 36,864 bytes + 512 fp32 scales; head: 6,400 bytes + 100 scales
    expected = 2 * (36_864 + 512 * 4) + (6_400 + 100 * 4) + PLAIN_FP32
    assert TOY.weight_bytes("fp32", "int8") == expected == 111_504


def test_int4_groupwise_weight_bytes():
    # groups of 32 along the input: q 64x2, k 32x2, v 32x2, o 64x2, gate 128x2, up 128x2, down 64x4 = 1,152 groups,
    # each a (scale, zero) pair of fp32; the head 100 rows x 2 groups
    per_layer = 36_864 // 2 + 1_152 * 2 * 4
    head = 6_400 // 2 + 200 * 2 * 4
    assert TOY.weight_bytes("fp32", "int4", group_size=32) == 2 * per_layer + head + PLAIN_FP32 == 86_976


def test_tied_head_is_a_quantized_copy_beside_the_table():
    tied = TOY.with_overrides(tie_word_embeddings=True)
    # layers as above; the head's copy 6,400 bytes + 100 bf16 scales; the table (the lookup's) and the norms in bf16
    assert tied.weight_bytes("bf16", "int8") == 2 * (36_864 + 512 * 2) + (6_400 + 100 * 2) + (6_400 + 320) * 2
    assert tied.weight_bytes("bf16") == tied.num_params() * 2  # unquantized: the head is the table itself


def test_int4_group_size_must_divide_every_input():
    with pytest.raises(ConfigError, match="group size 48 does not divide q_proj's input size 64"):
        TOY.check_quantization("int4", 48)
    with pytest.raises(ConfigError, match="positive integer"):
        TOY.check_quantization("int4", 0)
    TOY.check_quantization("int8", 48)  # group size means nothing to int8


def test_kv_bytes_per_token_counts_int8_scales():
    cfg = ModelConfig.from_name("Llama-3.1-8B")  # 32 layers, 8 KV heads of 128
    assert cfg.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert cfg.kv_bytes_per_token("fp8") == 65_536
    assert cfg.kv_bytes_per_token("int8") == 2 * 32 * 8 * (128 + 4) == 67_584


def test_flag_vocabulary():
    assert canonical_quantization(None) is None
    assert canonical_quantization("none") is None
    assert canonical_quantization("INT4") == "int4"
    with pytest.raises(ConfigError, match="unknown quantization 'int3'"):
        canonical_quantization("int3")
    assert resolve_kv_cache_dtype("auto", "float32") == "fp32"
    assert resolve_kv_cache_dtype(None, "bf16") == "bf16"
    assert resolve_kv_cache_dtype("fp8", "bf16") == "fp8"
    with pytest.raises(ConfigError, match="unknown kv cache dtype 'fp4'"):
        resolve_kv_cache_dtype("fp4", "bf16")
    assert resolve_kv_cache_dtype("bf16", "bfloat16") == "bf16"  # what 'auto' resolved to resolves again
    with pytest.raises(ConfigError, match="'fp32' differs from the activation dtype 'bf16'"):
        resolve_kv_cache_dtype("fp32", "bf16")  # another float dtype than the activations' is not a KV format


def test_a_resolved_simulator_config_can_be_copied_with_a_change() -> None:
    import dataclasses

    from workbench.sim.cluster import SimConfig

    cfg = SimConfig(dtype="fp32", max_num_seqs=16)
    copy = dataclasses.replace(cfg, max_num_seqs=8)
    assert (copy.kv_cache_dtype, copy.max_num_seqs) == ("fp32", 8)
