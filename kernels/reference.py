"""Plain-PyTorch fp32 references of the kernels' ops, with the same signatures as the kernel wrappers.

Slow and obviously correct: loops over sequences, gathers each sequence's K/V from the paged pool token by
token through its block table, builds the causal mask explicitly and runs softmax in fp32. Outputs are in the
query's dtype, computed in fp32. ``tests/test_kernels_reference.py`` checks these against PyTorch's
``scaled_dot_product_attention`` on contiguous tensors, so the reference itself is checked against a peer.
"""

from __future__ import annotations

import math

import torch


def kv_write_reference(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (num_tokens,), < 0 means skip
) -> None:
    """Write ``k[t]``/``v[t]`` into slot ``slot_mapping[t]`` (block ``slot // block_size``, row ``slot % bs``)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t]
        v_cache[slot // block_size, slot % block_size] = v[t]


def gather_sequence_kv(
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # (max_blocks,) physical block of each logical block
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K and V as contiguous fp32 ``(seq_len, num_kv_heads, head_dim)`` tensors."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table.to(device=k_cache.device, dtype=torch.int64)[pos // block_size]
    rows = pos % block_size
    return k_cache[blocks, rows].float(), v_cache[blocks, rows].float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 attention of q (q_len, heads, d) over k, v (s_len, kv_heads, d) with mask allowed (q_len, s_len)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (s_len, heads, d): query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # (heads, q_len, s_len)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # (q_len, heads, d)


def paged_prefill_attention_reference(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks)
    seq_lens: torch.Tensor,  # (num_seqs,) context length after this step
    cu_seqlens_q: torch.Tensor,  # (num_seqs + 1,) start of each sequence's queries
    max_query_len: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim), q's dtype
    """Causal attention of ragged query chunks over their sequences' paged context, in fp32.

    Query ``i`` of sequence ``s`` sits at position ``seq_len - q_len + i`` and sees keys ``0..`` that position.
    ``max_query_len`` is accepted for signature parity with the kernel and not needed here.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for s, s_len in enumerate(seq_lens.tolist()):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        ks, vs = gather_sequence_kv(k_cache, v_cache, block_tables[s], s_len)
        q_pos = torch.arange(s_len - q_len, s_len, device=q.device)
        allowed = torch.arange(s_len, device=q.device)[None, :] <= q_pos[:, None]  # (q_len, s_len)
        out[start:end] = _attend(q[start:end], ks, vs, allowed, scale)
    return out.to(q.dtype)


def paged_decode_attention_reference(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim): one query per sequence, at position seq_len - 1
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (num_seqs, max_blocks)
    seq_lens: torch.Tensor,  # (num_seqs,)
    scale: float | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim), q's dtype
    """One query per sequence over all of its context (no mask needed), in fp32.

    ``num_splits`` and ``max_seq_len`` are accepted for signature parity with the kernel and ignored.
    """
    num_seqs = q.shape[0]
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, cu, 1, scale)


def dequantize_paged_cache(
    cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim) int8 or float8_e4m3fn
    scale: torch.Tensor,  # int8: (num_blocks, block_size, num_kv_heads) fp32; fp8: one element
) -> torch.Tensor:
    """The fp32 values a quantized pool stands for: ``q * scale``, per token and head (int8) or for all (fp8)."""
    if cache.dtype == torch.int8:
        return cache.float() * scale.float()[..., None]
    return cache.float() * scale.float().reshape(())


def paged_decode_attention_quantized_reference(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim)
    k_cache: torch.Tensor,  # quantized (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dequantizing decode kernel's op: the whole pool dequantized in fp32, then the plain decode reference."""
    k = dequantize_paged_cache(k_cache, k_scale)
    v = dequantize_paged_cache(v_cache, v_scale)
    return paged_decode_attention_reference(q.float(), k, v, block_tables, seq_lens, scale).to(q.dtype)


def paged_mla_decode_attention_reference(
    q: torch.Tensor,  # (num_seqs, num_heads, latent_dim + rope_dim)
    kv_cache: torch.Tensor,  # (num_blocks, block_size, 1, latent_dim + rope_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks)
    seq_lens: torch.Tensor,  # (num_seqs,)
    latent_dim: int,
    scale: float,
) -> torch.Tensor:  # (num_seqs, num_heads, latent_dim), q's dtype
    """MLA decode in fp32, one sequence at a time: each head's scores over the whole entries, values their first
    ``latent_dim`` values."""
    out = torch.empty((*q.shape[:2], latent_dim), dtype=torch.float32, device=q.device)
    for s, s_len in enumerate(seq_lens.tolist()):
        entries, _ = gather_sequence_kv(kv_cache, kv_cache, block_tables[s], s_len)  # (s_len, 1, d)
        probs = torch.softmax(q[s].float() @ entries[:, 0].T * scale, dim=-1)  # (heads, s_len)
        out[s] = probs @ entries[:, 0, :latent_dim]
    return out.to(q.dtype)
