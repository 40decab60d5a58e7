"""MLA paged decode (``paged_decode.paged_mla_decode_attention``) against the fp32 reference, and against
MLA's naive form (per-head K and V decompressed) through the model's absorbed queries.

On CPU the kernel runs in the Triton interpreter, fp32 only (bf16 is wrong there; half precision runs on CUDA)."""

import pytest
import torch
from workbench.kernels._common import INTERPRET, KernelInputError
from workbench.kernels.paged_decode import paged_mla_decode_attention
from workbench.kernels.reference import paged_mla_decode_attention_reference
from workbench.kernels.testing import TOLERANCES, random_paged_batch

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
NUM_HEADS = [1, 4, 16]
ENTRY = [(16, 8), (64, 16), (40, 8)]  # (latent, rope): 48 and 80 are not powers of two
BLOCK_SIZES = [1, 16]
SEQ_LENS = [1, 17, 40, 75]
NUM_SPLITS = [1, 3]


def mla_batch(num_heads, latent, rope, block_size, dtype=torch.float32, seed=0):
    ones = [1] * len(SEQ_LENS)
    return random_paged_batch(ones, SEQ_LENS, num_heads, 1, latent + rope, block_size, dtype, DEVICE, seed=seed)


@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("entry", ENTRY)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_splits", NUM_SPLITS)
def test_mla_decode_matches_reference_fp32(num_heads, entry, block_size, num_splits):
    latent, rope = entry
    b = mla_batch(num_heads, latent, rope, block_size)
    scale = (latent // 2 + rope) ** -0.5  # MLA's scale is the q/k head size's, not the entry's
    out = paged_mla_decode_attention(b.q, b.k_cache, b.block_tables, b.seq_lens, latent, scale, num_splits=num_splits)
    ref = paged_mla_decode_attention_reference(b.q, b.k_cache, b.block_tables, b.seq_lens, latent, scale)
    assert out.shape == (len(SEQ_LENS), num_heads, latent)
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


@pytest.mark.skipif(DEVICE != "cuda", reason="half precision in the interpreter is not the kernel's numerics")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mla_decode_matches_reference_half(dtype):
    b = mla_batch(16, 64, 16, 16, dtype)
    out = paged_mla_decode_attention(b.q, b.k_cache, b.block_tables, b.seq_lens, 64, 0.1)
    ref = paged_mla_decode_attention_reference(b.q, b.k_cache, b.block_tables, b.seq_lens, 64, 0.1)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_mla_decode_equals_naive_attention_of_the_model():
    """The tiny DeepSeek-V3's MLA: absorbed queries through the kernel over a paged pool of its latents, then
    ``output``, equal its naive form (K and V decompressed per head) for the last token of a sequence."""
    from workbench.config import ModelConfig
    from workbench.model.layers import RotaryEmbedding, signed_sin
    from workbench.model.mla import MLAttention

    cfg = ModelConfig.from_name("tiny-deepseek-v3")
    torch.manual_seed(0)
    attn = MLAttention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    n, block = 21, 4
    x = torch.randn(n, cfg.hidden_size)
    cos, sin = RotaryEmbedding(cfg)(torch.arange(n), torch.float32)
    ss = signed_sin(sin)
    _, cached = attn.naive(x[:-1], cos[:-1], ss[:-1])
    expected, _ = attn.naive(x[-1:], cos[-1:], ss[-1:], cached)
    q, k, _ = attn.project(x, cos, ss)  # k: (n, 1, r + dr), every token's entry
    table = [5, 0, 3, 1, 4, 2]  # 6 blocks of 4 hold 21 tokens, out of order
    pool = torch.zeros(6, block, 1, k.shape[-1])
    for pos in range(n):
        pool[table[pos // block], pos % block] = k[pos]
    # the module runs on the CPU; the kernel's inputs go where Triton runs (a CUDA launch refuses CPU tensors)
    o = paged_mla_decode_attention(q[-1:].contiguous().to(DEVICE), pool.to(DEVICE),
                                   torch.tensor([table], dtype=torch.int32, device=DEVICE),
                                   torch.tensor([n], device=DEVICE), cfg.kv_lora_rank, attn.scale)  # fmt: skip
    torch.testing.assert_close(attn.output(o.cpu()), expected, **TOLERANCES[torch.float32])


def test_mla_decode_rejects_bad_inputs():
    b = mla_batch(4, 16, 8, 16)
    with pytest.raises(KernelInputError, match="latent_dim"):
        paged_mla_decode_attention(b.q, b.k_cache, b.block_tables, b.seq_lens, 25, 0.1)
    two = random_paged_batch([1], [5], 4, 2, 24, 16, torch.float32, DEVICE)
    with pytest.raises(KernelInputError, match="one entry per token"):
        paged_mla_decode_attention(two.q, two.k_cache, two.block_tables, two.seq_lens, 16, 0.1)


def test_triton_backend_decodes_mla_like_the_torch_backend():
    """tiny-deepseek-v3's decode through the Triton backend (MLA kernel; ragged steps on the torch path) gives the
    torch backend's logits, a few steps on."""
    from workbench.config import ModelConfig
    from workbench.model import Transformer
    from workbench.model.triton_backend import TritonAttentionBackend

    model = Transformer.from_config(ModelConfig.from_name("tiny-deepseek-v3"), device=DEVICE, seed=1, init_std=0.1)
    prompts, slots = [[5, 9, 200, 3, 17, 40, 41], [8, 8]], [0, 1]
    caches = {name: model.new_cache(2, 32) for name in ("torch", "triton")}
    triton = TritonAttentionBackend(num_splits=2)
    logits = {name: model.prefill(prompts, c, slots) for name, c in caches.items()}
    for _ in range(3):
        nxt = logits["torch"].argmax(-1).tolist()
        logits = {
            "torch": model.decode(nxt, caches["torch"], slots),
            "triton": model.decode(nxt, caches["triton"], slots, backend=triton),
        }
        torch.testing.assert_close(logits["triton"], logits["torch"], **TOLERANCES[torch.float32])
