"""Attention over a paged KV cache for a flattened, ragged batch: metadata and backends.

One step of the engine is a flat list of new tokens from several sequences. Sequence ``s`` contributes
``query_lens[s]`` new tokens that sit at the end of its ``seq_lens[s]`` tokens of context: its new tokens have
positions ``seq_lens[s] - query_lens[s] ... seq_lens[s] - 1`` and each attends causally to every earlier position
of its own sequence (the cached prefix plus the new tokens up to itself). A decode is ``query_len == 1``; a whole
prompt is ``query_len == seq_len``; a prefill chunk or a prefix-cache hit is anything in between. One code path
serves all of them, and MHA/GQA/MQA differ only in ``num_kv_heads``.

Names follow flash-attention and vLLM: ``cu_seqlens_q``, ``seq_lens`` (K lengths), ``slot_mapping``,
``block_tables``. A backend writes the step's new K/V into the cache and then attends; ``TorchAttentionBackend``
does it with PyTorch's scaled_dot_product_attention, the Triton backend (``kernels/``) with its own kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from workbench.config import ceil_div


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once per step by ``build_metadata``."""

    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    block_size: int
    block_tables_list: list[list[int]]  # blocks owned per sequence (at least ceil(seq_len / block_size))
    positions: torch.Tensor  # (num_tokens,) int64
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot of each new token
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32: start of each sequence's queries in the flat batch
    seq_lens_t: torch.Tensor  # (num_seqs,) int32
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0
    # per-sequence helpers for the torch backend, computed once per step rather than once per layer
    seq_block_ids: list[torch.Tensor] = field(default_factory=list)
    seq_masks: list[torch.Tensor | None] = field(default_factory=list)
    batch_gather: tuple[torch.Tensor, torch.Tensor] | None = None  # decode-only: (block ids (B, nb), mask (B,1,1,S))

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index in the flat batch of each sequence's last new token (where its next token is sampled)."""
        return (self.cu_seqlens_q[1:] - 1).long()


# A decode-only step of at least BATCHED_DECODE_MIN_SEQS sequences may gather every sequence's K/V into one padded
# tensor and attend in one call; the gather copies (batch x longest context) key slots, so past
# BATCHED_DECODE_MAX_KEY_SLOTS the per-sequence loop over cache views is faster. Measured on a 2-core CPU with
# SmolLM2-135M shapes, 8 sequences at context 2048: 1110 ms batched vs 253 ms looped (MHA), 176 vs 147 ms (GQA 9/3);
# 32 sequences at context 32: 79 ms batched vs 95 ms looped.
BATCHED_DECODE_MIN_SEQS = 4
BATCHED_DECODE_MAX_KEY_SLOTS = 2048


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    """The cache slot of position ``pos`` of a sequence whose block table is ``table``."""
    return table[pos // block_size] * block_size + pos % block_size


def pad_block_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    """Each block table cut or padded with block 0 to ``width`` entries: the rows of a rectangular tensor."""
    return [t[:width] + [0] * (width - min(len(t), width)) for t in tables]


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Turn per-sequence lengths and block tables into the step's tensors."""
    positions: list[int] = []
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        for p in range(s_len - q_len, s_len):
            positions.append(p)
            slots.append(slot_of(table, p, block_size))
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    max_blocks = max(ceil_div(s, block_size) for s in seq_lens)
    meta = AttentionMetadata(
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_size=block_size,
        block_tables_list=[list(t) for t in block_tables],
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(pad_block_tables(block_tables, max_blocks), dtype=torch.int32, device=device),
    )
    _prepare_torch_helpers(meta, device)
    return meta


def _prepare_torch_helpers(meta: AttentionMetadata, device: torch.device | str) -> None:
    bs = meta.block_size
    s_max = meta.max_seq_len
    if (
        meta.is_decode_only
        and meta.num_seqs >= BATCHED_DECODE_MIN_SEQS
        and meta.num_seqs * s_max <= BATCHED_DECODE_MAX_KEY_SLOTS
    ):
        ids = meta.block_tables[:, : ceil_div(s_max, bs)].long()  # (B, nb)
        key_pos = torch.arange(ids.shape[1] * bs, device=device)
        mask = (key_pos[None, :] < meta.seq_lens_t[:, None]).view(meta.num_seqs, 1, 1, -1)  # (B, 1, 1, nb*bs)
        meta.batch_gather = (ids, mask)
        return
    for q_len, s_len, table in zip(meta.query_lens, meta.seq_lens, meta.block_tables_list):
        meta.seq_block_ids.append(torch.tensor(table[: ceil_div(s_len, bs)], dtype=torch.int64, device=device))
        if q_len == 1 or q_len == s_len:
            meta.seq_masks.append(None)  # no mask, or plain causal
        else:
            # query i sits at position s_len - q_len + i and sees keys 0..that position
            q_pos = torch.arange(s_len - q_len, s_len, device=device)
            meta.seq_masks.append(torch.arange(s_len, device=device)[None, :] <= q_pos[:, None])  # (q_len, s_len)


class AttentionBackend(Protocol):
    """Writes a step's new K/V into the paged cache, then attends every new query to its sequence's context."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim), rotary applied
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), rotary applied
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), one layer
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        ...


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into their cache slots (the PyTorch twin of ``kernels.kv_write``)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend:
    """PyTorch SDPA per sequence (or one padded batch for many decodes). The engine's default on CPU."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        n_kv, d = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // n_kv  # query heads per KV head (1: MHA)
        if meta.batch_gather is not None:
            ids, mask = meta.batch_gather
            b = meta.num_seqs
            kk = k_cache[ids].view(b, -1, n_kv, d).transpose(1, 2)  # (B, kv_heads, nb*bs, d)
            vv = v_cache[ids].view(b, -1, n_kv, d).transpose(1, 2)
            # GQA without copies: the `group` query heads of KV head j (heads j*group ...) act as its query rows
            qg = q.view(b, n_kv, group, d)  # (B, kv_heads, group, d)
            out = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask, scale=scale)  # (B, kv_heads, group, d)
            return out.reshape(b, n_kv * group, d)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
            ids = meta.seq_block_ids[i]
            if ids.numel() == 1:  # contiguous slot: a view, no copy
                ks, vs = k_cache[ids[0], :s_len], v_cache[ids[0], :s_len]
            else:
                ks = k_cache[ids].view(-1, n_kv, d)[:s_len]
                vs = v_cache[ids].view(-1, n_kv, d)[:s_len]
            kt, vt = ks.transpose(0, 1), vs.transpose(0, 1)  # (kv_heads, s_len, d)
            if q_len == 1:
                # a decode sees its whole context: the group's query heads are the rows of one unmasked product
                # 4-D inputs select SDPA's fused CPU kernel (3-D ones take the slower math path)
                qg = q[start].view(1, n_kv, group, d)  # (1, kv_heads, group, d)
                o = F.scaled_dot_product_attention(qg, kt[None], vt[None], scale=scale)  # (1, kv_heads, group, d)
                if meta.num_seqs == 1:  # batch-1 decode: the output is the answer, no copy into `out`
                    return o.view(1, n_kv * group, d)
                out[start] = o.view(n_kv * group, d)
                start += 1
                continue
            if group > 1:  # expanded K/V keep SDPA on its fused kernel (enable_gqa falls back to the math path)
                kt, vt = kt.repeat_interleave(group, dim=0), vt.repeat_interleave(group, dim=0)
            mask = meta.seq_masks[i]
            o = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1)[None],  # (1, heads, q_len, d)
                kt[None],  # (1, heads, s_len, d)
                vt[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out


def gathered_decode_attention(
    q: torch.Tensor,  # (B, num_heads, head_dim): one new token per sequence, rotary applied
    k: torch.Tensor,  # (B, num_kv_heads, head_dim): the new tokens' K, rotary applied
    v: torch.Tensor,  # (B, num_kv_heads, head_dim)
    k_slots: torch.Tensor,  # (num_slots, num_kv_heads, head_dim): one layer's pool, flat
    v_slots: torch.Tensor,
    key_slots: torch.Tensor,  # (B, C) int64: slot of each cached key position (any valid slot past the length)
    key_mask: torch.Tensor,  # (B, 1, 1, C + 1) bool: which cached keys count; the last column (new key) True
    scale: float,
) -> torch.Tensor:  # (B, num_heads, head_dim)
    """Decode attention over the cached keys plus the new one, without writing the cache.

    Each sequence's cached K/V are gathered through ``key_slots`` (C columns, padded to the longest sequence and
    masked), the new token's K/V appended as the last key. The shapes depend only on (B, C), which is what lets
    ``Transformer.decode_gathered`` be compiled as one graph with C dynamic.
    """
    b, n_kv, d = k.shape
    group = q.shape[1] // n_kv
    kk = torch.cat((k_slots[key_slots], k[:, None]), dim=1).transpose(1, 2)  # (B, kv_heads, C + 1, d)
    vv = torch.cat((v_slots[key_slots], v[:, None]), dim=1).transpose(1, 2)
    qg = q.reshape(b, n_kv, group, d)  # GQA without copies: a KV head's query heads are its query rows
    out = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=key_mask, scale=scale)  # (B, kv_heads, group, d)
    return out.reshape(b, n_kv * group, d)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The slow, obviously-correct attention: per sequence, per head, fp32, explicit causal mask and softmax."""
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for q_len, s_len, table in zip(meta.query_lens, meta.seq_lens, meta.block_tables_list):
        pos = torch.arange(s_len)
        slots = torch.tensor([table[p // meta.block_size] for p in range(s_len)]) * meta.block_size
        slots = slots + pos % meta.block_size
        ks = k_cache.reshape(-1, n_kv, k_cache.shape[-1])[slots].float()  # (s_len, kv_heads, d)
        vs = v_cache.reshape(-1, n_kv, v_cache.shape[-1])[slots].float()
        q_pos = torch.arange(s_len - q_len, s_len)
        allowed = pos[None, :] <= q_pos[:, None]  # (q_len, s_len)
        for h in range(n_heads):
            qh = q[start : start + q_len, h].float()  # (q_len, d)
            scores = (qh @ ks[:, h // group].T) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[start : start + q_len, h] = torch.softmax(scores, dim=-1) @ vs[:, h // group]
        start += q_len
    return out.to(q.dtype)
