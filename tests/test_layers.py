"""Each layer against a hand computation or a peer (PyTorch, transformers' own rope initialisation)."""

import math

import pytest
import torch
import torch.nn.functional as F
from workbench.kernels.reference import kv_write_reference, paged_prefill_attention_reference

from workbench.config import ModelConfig
from workbench.model.attention import TorchAttentionBackend, build_metadata
from workbench.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, rope_inv_freq


def test_rmsnorm_by_hand():
    norm = RMSNorm(2, eps=0.0)
    norm.weight.data = torch.tensor([1.0, 2.0])
    # x = (3, 4): mean of squares 12.5, so y = (3, 4) / sqrt(12.5) * (1, 2)
    y = norm(torch.tensor([[3.0, 4.0]]))
    s = math.sqrt(12.5)
    torch.testing.assert_close(y, torch.tensor([[3 / s, 8 / s]]))


def test_rmsnorm_fp16_normalises_in_fp32():
    x = torch.randn(4, 64, dtype=torch.float16) * 300  # squares overflow fp16 (max 65504)
    y = RMSNorm(64, 1e-5).half()(x)
    assert torch.isfinite(y).all()
    ref = (x.float() / x.float().pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()).half()
    torch.testing.assert_close(y, ref)


def test_rotary_rotates_pairs_by_position_times_frequency():
    cfg = ModelConfig.from_name("tiny-mha").with_overrides(head_dim=4, rope_theta=100.0)
    rope = RotaryEmbedding(cfg)
    # head_dim 4: frequencies 1 and 100^(-1/2) = 0.1; pairs are (x0, x2) and (x1, x3)
    x = torch.tensor([[[1.0, 0.0, 0.0, 1.0]]])  # (T=1, heads=1, d=4)
    p = 3
    cos, sin = rope(torch.tensor([p]), torch.float32)
    y = apply_rotary(x, cos, sin)[0, 0]
    # pair 0 (x0=1, x2=0) rotated by 3 rad: (cos 3, sin 3); pair 1 (x1=0, x3=1) by 0.3 rad: (-sin .3, cos .3)
    expected = torch.tensor([math.cos(3), -math.sin(0.3), math.sin(3), math.cos(0.3)])
    torch.testing.assert_close(y, expected)


def test_rotary_is_identity_at_position_zero_and_preserves_norm():
    cfg = ModelConfig.from_name("tiny-mqa")
    rope = RotaryEmbedding(cfg)
    x = torch.randn(5, 4, cfg.head_dim)
    cos, sin = rope(torch.arange(5), torch.float32)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("preset", ["Llama-3.1-8B", "tiny-gqa", "Llama-2-7B"])
def test_rope_inv_freq_matches_transformers(preset):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workbench.model.checkpoint import hf_config_object

    cfg = ModelConfig.from_name(preset)
    hf_cfg = hf_config_object(cfg)
    rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        expected = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), expected.float())


def test_llama3_scaling_by_hand():
    cfg = ModelConfig.from_name("Llama-3.1-8B")
    inv = rope_inv_freq(cfg)
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    # highest frequency: wavelength 2*pi < 8192/4 -> unchanged; lowest: wavelength > 8192/1 -> divided by 8
    assert inv[0] == pytest.approx(base[0].item())
    assert inv[-1] == pytest.approx(base[-1].item() / 8, rel=1e-6)
    # a band in between is blended: smooth = (8192/wavelength - 1) / (4 - 1)
    wl = 2 * math.pi / base
    i = int(torch.nonzero((wl >= 8192 / 4) & (wl <= 8192)).flatten()[0])
    smooth = (8192 / wl[i].item() - 1) / 3
    assert inv[i].item() == pytest.approx((1 - smooth) * base[i].item() / 8 + smooth * base[i].item(), rel=1e-5)


def test_swiglu_against_explicit_formula():
    torch.manual_seed(0)
    mlp = SwiGLU(8, 16)
    x = torch.randn(3, 8)
    wg, wu = mlp.gate_up_proj.weight[:16], mlp.gate_up_proj.weight[16:]
    expected = (F.silu(x @ wg.T) * (x @ wu.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected)


def _reference(q, k_cache, v_cache, meta, scale):
    """The kernels' fp32 reference (``workbench.kernels.reference``) on the engine's metadata."""
    return paged_prefill_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t,
                                             meta.cu_seqlens_q, meta.max_query_len, scale)  # fmt: skip


def _paged_case(heads: int, kv_heads: int, head_dim: int, block_size: int, q_lens, s_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in s_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, at = [], 0
    for s in s_lens:
        n = -(-s // block_size)
        tables.append(perm[at : at + n])
        at += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    meta = build_metadata(list(q_lens), list(s_lens), tables, block_size)
    t = sum(q_lens)
    q = torch.randn(t, heads, head_dim, generator=g)
    k = torch.randn(t, kv_heads, head_dim, generator=g)
    v = torch.randn(t, kv_heads, head_dim, generator=g)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    "q_lens, s_lens",
    [
        ([7, 1, 3], [7, 9, 12]),  # a whole prompt, a decode, a chunk on top of a cached prefix
        ([1, 1, 1, 1, 1], [5, 17, 2, 9, 1]),  # decode only, through the ragged path
    ],
)
def test_torch_backend_matches_reference(heads, kv_heads, block_size, q_lens, s_lens):
    q, k, v, k_cache, v_cache, meta = _paged_case(heads, kv_heads, 24, block_size, q_lens, s_lens)
    kv_write_reference(k, v, k_cache, v_cache, meta.slot_mapping)  # the model writes before the backend attends
    out = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, scale=24**-0.5)
    # the backend wrote k, v into the cache; the reference reads them from there
    ref = _reference(q, k_cache, v_cache, meta, 24**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # given the step's K/V as written, a whole prompt attends to them rather than to its blocks: the same result
    written = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 24**-0.5, k, v)
    torch.testing.assert_close(written, ref, atol=1e-5, rtol=1e-5)


def test_step_kv_are_not_used_over_a_quantized_pool():
    # an int8 pool holds rounded K/V: a whole prompt must attend to what the pool holds (as a later step will), not
    # to the step's fp32 K/V; the pool's values differ from them, so using the step's would change the result
    from workbench.config import ModelConfig
    from workbench.kv.cache import KVCache

    cfg = ModelConfig.from_name("tiny-gqa")
    q, k, v, _, _, meta = _paged_case(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4, [7, 1, 3], [7, 9, 12])
    cache = KVCache(cfg, 12, 4, kv_cache_dtype="int8")
    cache.write(meta.slot_mapping, k, v, layer=0)
    k_layers, v_layers = cache.layer_views()
    backend, scale = TorchAttentionBackend(), cfg.head_dim**-0.5
    out = backend.forward(q, k_layers[0], v_layers[0], meta, scale, k, v)
    assert torch.equal(out, backend.forward(q, k_layers[0], v_layers[0], meta, scale))
    # the same step over a plain pool of the fp32 K/V: the whole prompt's rows differ by the int8 rounding
    k_plain = torch.zeros(12, 4, cfg.num_kv_heads, cfg.head_dim)
    v_plain = torch.zeros_like(k_plain)
    kv_write_reference(k, v, k_plain, v_plain, meta.slot_mapping)
    plain = backend.forward(q, k_plain, v_plain, meta, scale)
    assert not torch.allclose(out[:7], plain[:7], atol=1e-4, rtol=0)


def test_reference_attention_matches_sdpa_on_contiguous_causal():
    # one sequence, whole prompt: the reference over a paged cache equals plain causal SDPA
    q, k, v, k_cache, v_cache, meta = _paged_case(4, 2, 16, 4, [10], [10])
    kv_write_reference(k, v, k_cache, v_cache, meta.slot_mapping)
    ref = _reference(q, k_cache, v_cache, meta, 0.25)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(2, 0), v.transpose(0, 1).repeat_interleave(2, 0),
        is_causal=True, scale=0.25,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(ref, sdpa, atol=1e-5, rtol=1e-5)


def test_slot_mapping_by_hand():
    # block size 4, sequence owns blocks [7, 2]; a 2-token chunk at positions 3, 4 -> slots 7*4+3, 2*4+0
    meta = build_metadata([2], [5], [[7, 2]], 4)
    assert meta.positions.tolist() == [3, 4]
    assert meta.slot_mapping.tolist() == [31, 8]
    assert meta.cu_seqlens_q.tolist() == [0, 2]
