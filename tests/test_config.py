"""ModelConfig: HF config.json parsing, presets, validation, derived sizes checked against published figures."""

import json

import pytest

from workbench.config import ModelConfig, canonical_dtype, dtype_bytes, preset_names
from workbench.errors import ConfigError

REQUIRED_PRESETS = [
    "Llama-2-7B", "Llama-2-70B", "Llama-3.1-8B", "Llama-3.1-70B", "Mistral-7B-v0.1", "Qwen2.5-0.5B",
    "Qwen2.5-7B", "Qwen2.5-72B", "TinyLlama-1.1B", "SmolLM2-135M", "SmolLM2-360M",
    "tiny-mha", "tiny-gqa", "tiny-mqa", "bench-300m",
]  # fmt: skip


def test_all_required_presets_load():
    names = preset_names()
    for name in REQUIRED_PRESETS:
        assert name in names
        ModelConfig.from_name(name)


def test_from_name_is_case_insensitive_and_unknown_lists_names():
    assert ModelConfig.from_name("llama-3.1-8b").name == "Llama-3.1-8B"
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_name("llama-9")
    assert "llama-9" in str(exc.value) and "Llama-3.1-8B" in str(exc.value)


# Parameter counts published for the Hugging Face checkpoints (model cards / safetensors metadata).
@pytest.mark.parametrize(
    "name, params",
    [("Llama-2-7B", 6_738_415_616), ("Llama-3.1-8B", 8_030_261_248), ("Qwen2.5-0.5B", 494_032_768)],
)
def test_num_params_matches_published(name, params):
    assert ModelConfig.from_name(name).num_params() == params


def test_kv_bytes_per_token_by_hand():
    # Llama-2-7B, MHA: 2 (K and V) * 32 layers * 32 kv heads * 128 dims * 2 bytes (fp16) = 524,288 B = 512 KiB
    assert ModelConfig.from_name("Llama-2-7B").kv_bytes_per_token("fp16") == 2 * 32 * 32 * 128 * 2 == 524_288
    # Llama-3.1-8B, GQA with 8 kv heads: a quarter of that, 128 KiB
    assert ModelConfig.from_name("Llama-3.1-8B").kv_bytes_per_token("fp16") == 131_072


def test_attention_kind_follows_num_kv_heads():
    assert ModelConfig.from_name("tiny-mha").attention_kind == "MHA"
    assert ModelConfig.from_name("tiny-gqa").attention_kind == "GQA"
    assert ModelConfig.from_name("tiny-mqa").attention_kind == "MQA"


def test_llama31_rope_scaling_and_eos_parsed():
    cfg = ModelConfig.from_name("Llama-3.1-8B")
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.rope_theta == 500000.0 and cfg.eos_token_ids == (128001,)


def test_transformers_v5_rope_parameters_are_read():
    hf = json.loads(open_preset("tiny-gqa"))
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {**scaling, "rope_theta": hf.pop("rope_theta")}
    cfg = ModelConfig.from_hf_config(hf, name="v5")
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling["rope_type"] == "llama3"


def open_preset(name: str) -> str:
    from workbench.config import MODELS_DIR

    return (MODELS_DIR / f"{name}.json").read_text()


def test_qwen2_has_bias_by_default_and_head_dim_derived():
    hf = json.loads(open_preset("Qwen2.5-0.5B"))
    cfg = ModelConfig.from_hf_config(hf, name="q")
    assert cfg.attention_bias and cfg.head_dim == 896 // 14 and cfg.tie_word_embeddings


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),  # 4 heads not divisible by 3
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": 15}, "head_dim"),
        ({"architecture": "GPT2LMHeadModel"}, "architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "low_freq_factor"),
        ({"eos_token_ids": (999,)}, "eos"),
    ],
)
def test_validation_names_the_field(change, field):
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_name("tiny-mha").with_overrides(**change)
    assert field in str(exc.value)


def test_missing_keys_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 10}, name="x")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.resolve(tmp_path / "empty")


def test_hf_round_trip_keeps_the_shape():
    for name in REQUIRED_PRESETS:
        cfg = ModelConfig.from_name(name)
        again = ModelConfig.from_hf_config(cfg.to_hf_config(), name=cfg.name)
        assert again == cfg


def test_dtype_names():
    assert canonical_dtype("torch.bfloat16") == "bf16" and canonical_dtype("half") == "fp16"
    assert dtype_bytes("float32") == 4
    with pytest.raises(ConfigError, match="unknown dtype"):
        canonical_dtype("fp7")
