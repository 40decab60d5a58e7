"""Mixture of experts (model.moe) and multi-head latent attention (model.mla): peers and hand counts.

Routers against transformers' own router modules; the MoE block against transformers' DeepSeek-V3 MoE; MLA's
absorbed form against its naive form; the three tiny MoE/MLA presets through the engine against HF's greedy tokens
(paged KV, every policy, chunked prefill, preemption); the KV pool and bytes per token against hand counts.
"""

import random

import pytest
import torch
import transformers
from workbench.kernels.testing import TOLERANCES

from tests.conftest import hf_greedy_tokens
from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model import load_checkpoint
from workbench.model.checkpoint import hf_config_object
from workbench.model.layers import RotaryEmbedding, signed_sin
from workbench.model.mla import MLAttention
from workbench.model.moe import MoE, route
from workbench.request import SamplingParams

MOE_MLA_PRESETS = ("tiny-mixtral", "tiny-qwen2-moe", "tiny-deepseek-v3")


def _hf_router(cfg: ModelConfig, weight: torch.Tensor, bias: torch.Tensor | None = None):
    hf_cfg = hf_config_object(cfg)
    mod = {
        "MixtralForCausalLM": transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter,
        "Qwen2MoeForCausalLM": transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter,
        "DeepseekV3ForCausalLM": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter,
    }[cfg.architecture](hf_cfg)
    with torch.no_grad():
        mod.weight.copy_(weight)
        if bias is not None:
            mod.e_score_correction_bias.copy_(bias)
    return mod


@pytest.mark.parametrize("preset", MOE_MLA_PRESETS)
@pytest.mark.parametrize("norm", [True, False])
def test_router_weights_and_experts_equal_transformers(preset, norm):
    cfg = ModelConfig.from_name(preset).with_overrides(norm_topk_prob=norm or preset == "tiny-mixtral")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(cfg.num_experts, cfg.hidden_size, generator=gen)
    bias = torch.rand(cfg.num_experts, generator=gen) if cfg.router_scoring == "sigmoid" else None
    x = torch.randn(50, cfg.hidden_size, generator=gen)
    _, hf_w, hf_ids = _hf_router(cfg, w, bias)(x)
    ours_w, ours_ids = route(x @ w.T, cfg, bias)
    # order within the top-k is not part of the contract: compare per token as expert -> weight maps
    for t in range(x.shape[0]):
        theirs = dict(zip(hf_ids[t].tolist(), hf_w[t].tolist()))
        ours = dict(zip(ours_ids[t].tolist(), ours_w[t].tolist()))
        assert set(theirs) == set(ours)
        torch.testing.assert_close(torch.tensor([ours[e] for e in theirs]), torch.tensor(list(theirs.values())))


def test_sigmoid_router_only_picks_from_the_best_groups():
    """Hand-made scores: 8 experts in 4 groups of 2, topk_group 2. Group sums of the two best: g0 = 0.9 + 0.8,
    g1 = 0.1 + 0.1, g2 = 0.95 + 0.05, g3 = 0.7 + 0.7. The best groups are g0 (1.7) and g3 (1.4); expert 4 (0.95,
    the best single score) sits in g2 and must not be chosen."""
    cfg = ModelConfig.from_name("tiny-deepseek-v3").with_overrides(routed_scaling_factor=1.0)
    probs = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.95, 0.05, 0.7, 0.7]])
    weights, ids = route(torch.logit(probs), cfg)
    assert set(ids[0].tolist()) == {0, 1}
    torch.testing.assert_close(weights[0].sort().values, torch.tensor([0.8, 0.9]) / 1.7)


def test_moe_block_equals_transformers_deepseek_moe():
    cfg = ModelConfig.from_name("tiny-deepseek-v3")
    hf = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(hf_config_object(cfg)).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.rand(cfg.num_experts, generator=gen))
    ours = MoE(cfg)
    e = range(cfg.num_experts)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.w_gate_up.copy_(hf.experts.gate_up_proj)
        ours.w_down.copy_(hf.experts.down_proj)
        sh = hf.shared_experts
        ours.shared_expert.gate_up_proj.weight.copy_(torch.cat((sh.gate_proj.weight, sh.up_proj.weight)))
        ours.shared_expert.down_proj.weight.copy_(sh.down_proj.weight)
        x = torch.randn(1, 37, cfg.hidden_size, generator=gen)
        expected = hf(x)[0]
        got = ours(x[0])
    assert len(e) == 8
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


def _mla(cfg: ModelConfig, seed: int = 3) -> MLAttention:
    attn = MLAttention(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "layernorm" in name else
                    torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)  # fmt: skip
    return attn


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_absorbed_equals_naive(q_lora_rank):
    """The absorbed form (queries in the latent space, an MQA over the cache) gives the naive form's output
    (K and V decompressed per head), for a prefix of cached latents and a chunk of new tokens."""
    cfg = ModelConfig.from_name("tiny-deepseek-v3").with_overrides(q_lora_rank=q_lora_rank)
    attn, rotary = _mla(cfg), RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(4)
    s0, t = 11, 5
    x = torch.randn(s0 + t, cfg.hidden_size, generator=gen)
    cos, sin = rotary(torch.arange(s0 + t), torch.float32)
    ss = signed_sin(sin)
    _, cached = attn.naive(x[:s0], cos[:s0], ss[:s0])
    expected, _ = attn.naive(x[s0:], cos[s0:], ss[s0:], cached)
    q, k, v = attn.project(x, cos, ss)  # (T, heads, r + dr), (T, 1, r + dr), (T, 1, r)
    torch.testing.assert_close(k[:s0], cached)
    scores = torch.einsum("thd,sd->ths", q[s0:], k[:, 0]) * attn.scale  # new tokens over all keys
    mask = torch.arange(s0 + t)[None, :] <= torch.arange(s0, s0 + t)[:, None]
    p = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    got = attn.output(torch.einsum("ths,sr->thr", p, v[:, 0]))
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


def test_mla_pool_holds_latent_plus_rope_per_token():
    cfg = ModelConfig.from_name("tiny-deepseek-v3")
    cache = KVCache(cfg, num_blocks=3, block_size=4)
    assert cache.k.shape == (3, 3, 4, 1, 16 + 8)  # (layers, blocks, block_size, 1, kv_lora_rank + rope)
    assert cache.v.data_ptr() == cache.k.data_ptr() and cache.v.shape[-1] == 16  # V: the latent, no copy
    assert cache.bytes_per_token == 3 * (16 + 8) * 4 == cfg.kv_bytes_per_token("fp32")
    entry = torch.randn(2, 1, 24)
    cache.write(torch.tensor([5, 0]), entry, entry[..., :16], layer=1)
    k, v = cache.gather(1, torch.tensor([0, 5]))
    torch.testing.assert_close(k, entry.flip(0))
    torch.testing.assert_close(v, entry.flip(0)[..., :16])
    with pytest.raises(ConfigError, match="quantized KV cache of an MLA"):
        KVCache(cfg, 3, 4, kv_cache_dtype="int8")


def test_kv_bytes_per_token_hand_counts():
    # DeepSeek-V3: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes (bf16)
    assert ModelConfig.from_name("DeepSeek-V3").kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2 == 70272
    # dense and MoE presets: 2 (K, V) x layers x kv_heads x head_dim x 2 bytes
    hand = {
        "Llama-2-7B": 2 * 32 * 32 * 128 * 2,
        "Llama-2-70B": 2 * 80 * 8 * 128 * 2,
        "Llama-3.1-8B": 2 * 32 * 8 * 128 * 2,
        "Llama-3.1-70B": 2 * 80 * 8 * 128 * 2,
        "Mistral-7B-v0.1": 2 * 32 * 8 * 128 * 2,
        "Qwen2.5-0.5B": 2 * 24 * 2 * 64 * 2,
        "Qwen2.5-7B": 2 * 28 * 4 * 128 * 2,
        "Qwen2.5-72B": 2 * 80 * 8 * 128 * 2,
        "TinyLlama-1.1B": 2 * 22 * 4 * 64 * 2,
        "SmolLM2-135M": 2 * 30 * 3 * 64 * 2,
        "SmolLM2-360M": 2 * 32 * 5 * 64 * 2,
        "Mixtral-8x7B": 2 * 32 * 8 * 128 * 2,
        "Qwen2-57B-A14B": 2 * 28 * 4 * 128 * 2,
    }
    for name, expected in hand.items():
        assert ModelConfig.from_name(name).kv_bytes_per_token("bf16") == expected, name


def test_published_parameter_counts():
    """Totals and active parameters as the model cards state them (Mixtral: 46.7B / 12.9B; Qwen2-57B-A14B:
    57B / 14B; DeepSeek-V3: 671B / 37B, without the multi-token-prediction module)."""
    for name, total, active in (("Mixtral-8x7B", 46.7, 12.9), ("Qwen2-57B-A14B", 57.4, 14.2),
                                ("DeepSeek-V3", 671.0, 37.0)):  # fmt: skip
        cfg = ModelConfig.from_name(name)
        assert abs(cfg.num_params() / 1e9 - total) < 0.5, name
        assert abs(cfg.num_params(active=True) / 1e9 - active) < 0.6, name


def test_moe_and_mla_refuse_what_is_not_implemented():
    cfg = ModelConfig.from_name("Mixtral-8x7B")
    with pytest.raises(ConfigError, match="quantization of mixture-of-experts"):
        cfg.check_quantization("int8")
    with pytest.raises(ConfigError, match="yarn"):
        MLAttention(ModelConfig.from_name("DeepSeek-V3"))


# ---- through the engine ------------------------------------------------------------------------------------------
MAX_TOKENS = 8
rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 33, 17, 40, 1)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=MOE_MLA_PRESETS)
def engine_setup(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    return load_checkpoint(path), hf_greedy_tokens(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("policy", ["static", "continuous", "chunked", "decode-first"])
def test_engine_paged_greedy_tokens_equal_hf(engine_setup, policy):
    model, expected = engine_setup
    chunked = policy == "chunked"
    cfg = EngineConfig(policy=policy, block_size=4, max_model_len=64, max_num_seqs=3,
                       chunk_size=7 if chunked else None, token_budget=12 if chunked else None)  # fmt: skip
    res = Engine(model, cfg).generate(PROMPTS, GREEDY)
    assert [r.tokens for r in res.requests] == expected


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
def test_engine_tiny_pool_preempts_and_still_gives_hf_tokens(engine_setup, policy):
    model, expected = engine_setup
    # 13 blocks of 4 tokens: the longest request (40 + 8) fits alone, not all of them at once
    cfg = EngineConfig(policy=policy, block_size=4, num_blocks=13, max_model_len=64,
                       token_budget=16 if policy == "chunked" else None)  # fmt: skip
    res = Engine(model, cfg).generate(PROMPTS, GREEDY)
    assert [r.tokens for r in res.requests] == expected
    assert res.num_preemptions > 0


def test_qwen3_moe_qk_norm_weights_load_per_head(tmp_path):
    """Qwen3-MoE's q_norm and k_norm (one RMSNorm weight over head_dim each, shared by the heads) given distinct
    random weights in the checkpoint: prefill logits equal transformers' (a swapped or unloaded norm would not)."""
    from safetensors.torch import load_file, save_file

    from workbench.model.checkpoint import save_random_checkpoint

    path = save_random_checkpoint("tiny-qwen3-moe", tmp_path / "ckpt", seed=3, tokenizer=False)
    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    for name in tensors:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = 0.5 + torch.rand(tensors[name].shape, generator=gen)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_checkpoint(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = [5, 17, 200, 3, 99, 42, 7]
    logits = ours.prefill([prompt], ours.new_cache(1, 16), [0])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, **TOLERANCES[torch.float32])
    # Qwen3-30B-A3B (published: 30.5B parameters): embedding and LM head, final norm; per layer q and o 4096 x 2048,
    # k and v 512 x 2048, q/k norms of 128, two norms, the router 128 x 2048 and 128 experts of 3 x 2048 x 768
    layer = 2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * 2048 * 768
    cfg = ModelConfig.from_name("Qwen3-30B-A3B")
    assert cfg.qk_norm and cfg.num_params() == 2 * 151936 * 2048 + 2048 + 48 * layer
    assert round(cfg.num_params() / 1e9, 1) == 30.5
