"""The kernels' fp32 references checked against a peer: PyTorch SDPA on contiguous tensors."""

import pytest
import torch
import torch.nn.functional as F
from workbench.kernels.reference import paged_decode_attention_reference, paged_prefill_attention_reference
from workbench.kernels.testing import pad_tables, random_block_tables

NUM_HEADS = [(4, 4), (8, 2), (8, 1)]
HEAD_SIZES = [24, 64]
BLOCK_SIZES = [1, 16]
# (query_len, seq_len): whole prompt, chunk after a cached prefix, decode
LENS = [(13, 13), (5, 37), (1, 20)]


def contiguous_and_paged(lens, n_q, n_kv, d, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seqs_k = [torch.randn(s, n_kv, d, generator=gen) for _, s in lens]  # (seq_len, kv_heads, d) each
    seqs_v = [torch.randn(s, n_kv, d, generator=gen) for _, s in lens]
    qs = [torch.randn(q, n_q, d, generator=gen) for q, _ in lens]
    s_lens = [s for _, s in lens]
    num_blocks = sum(-(-s // block_size) for s in s_lens) + 3
    tables = random_block_tables(s_lens, block_size, num_blocks, gen)
    k_cache = torch.randn(num_blocks, block_size, n_kv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, n_kv, d, generator=gen)
    for table, k, v in zip(tables, seqs_k, seqs_v):
        for p in range(k.shape[0]):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
    return qs, seqs_k, seqs_v, k_cache, v_cache, tables


def sdpa(q, k, v, seq_len, scale):
    """PyTorch SDPA on contiguous tensors: q (q_len, heads, d) at the end of k/v (seq_len, kv_heads, d)."""
    q_len = q.shape[0]
    allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return o.transpose(0, 1)  # (q_len, heads, d)


@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_reference_matches_sdpa(num_heads, head_size, block_size):
    (n_q, n_kv), scale = num_heads, head_size**-0.5
    qs, ks, vs, k_cache, v_cache, tables = contiguous_and_paged(LENS, n_q, n_kv, head_size, block_size)
    q_lens = [q for q, _ in LENS]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in LENS], dtype=torch.int32)
    out = paged_prefill_attention_reference(
        torch.cat(qs), k_cache, v_cache, pad_tables(tables, "cpu"), seq_lens, cu, max(q_lens), scale
    )
    expected = torch.cat([sdpa(q, k, v, s, scale) for q, k, v, (_, s) in zip(qs, ks, vs, LENS)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_reference_matches_sdpa():
    lens = [(1, 1), (1, 17), (1, 40)]
    qs, ks, vs, k_cache, v_cache, tables = contiguous_and_paged(lens, 8, 2, 64, 16, seed=2)
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32)
    out = paged_decode_attention_reference(torch.cat(qs), k_cache, v_cache, pad_tables(tables, "cpu"), seq_lens)
    expected = torch.cat([sdpa(q, k, v, s, 64**-0.5) for q, k, v, (_, s) in zip(qs, ks, vs, lens)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_reference_hand_computed():
    """Two keys, one query seeing both: softmax weights computed by hand."""
    k_cache = torch.zeros(1, 2, 1, 2)
    v_cache = torch.zeros(1, 2, 1, 2)
    k_cache[0, 0, 0] = torch.tensor([1.0, 0.0])
    k_cache[0, 1, 0] = torch.tensor([0.0, 1.0])
    v_cache[0, 0, 0] = torch.tensor([10.0, 0.0])
    v_cache[0, 1, 0] = torch.tensor([0.0, 20.0])
    q = torch.tensor([[[2.0, 0.0]]])  # scores 2 and 0 with scale 1: weights e^2/(e^2+1), 1/(e^2+1)
    out = paged_decode_attention_reference(
        q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2]), scale=1.0
    )
    w0 = 1 / (1 + torch.exp(torch.tensor(-2.0)))
    torch.testing.assert_close(out[0, 0], torch.stack([10 * w0, 20 * (1 - w0)]))
