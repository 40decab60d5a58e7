"""Attention over a paged KV cache: the metadata of a step and the backends that attend.

Two kinds of step, each with its own metadata and one builder:

- a *ragged* step (prefill, chunked prefill, prefix hits, prefill mixed with decodes; ``Transformer.forward``):
  sequence ``s`` contributes ``query_lens[s]`` new tokens at the end of its ``seq_lens[s]`` tokens of context, and
  each new token attends causally to every earlier position of its own sequence. ``AttentionMetadata`` from
  ``build_metadata``; the model writes the step's K/V into the cache (``KVCache.write``), then the backend attends.
- a *pure decode* (``Transformer.decode_step``; ``workbench.engine.decode_step`` runs it eagerly, compiled or as a
  CUDA graph): one new token per sequence. ``DecodeMetadata`` from ``build_decode_metadata``: besides the paged
  view (block tables, lengths) it holds the slot of every cached key, padded to a common width ``C`` and masked,
  so that the torch backend attends to the cached keys plus the new one without writing the cache first.

Names follow flash-attention and vLLM: ``cu_seqlens_q``, ``seq_lens`` (K lengths), ``slot_mapping``,
``block_tables``. ``TorchAttentionBackend`` attends with PyTorch's scaled_dot_product_attention, the Triton backend
(``workbench.model.triton_backend``) with the kernels of ``kernels/``. MHA/GQA/MQA differ only in ``num_kv_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from workbench.config import ceil_div

if TYPE_CHECKING:
    from workbench.kv.cache import KVCache

KEY_PAD = 16  # a decode's cached-key columns are padded to a multiple of this (C is never 1, which dynamo specialises)
# The torch backend's decode gathers every sequence's cached keys into one (B, C) tensor; past this many key slots
# the copy costs more than attending one sequence at a time over views of the cache, and a pure decode takes the
# ragged path instead (the one "gather too big" limit of every decode mode).
MAX_GATHER_KEY_SLOTS = 1 << 16


@dataclass
class AttentionMetadata:
    """Everything attention needs about one ragged step, built once per step by ``build_metadata``."""

    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    positions: torch.Tensor  # (num_tokens,) int64
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot of each new token
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32: start of each sequence's queries in the flat batch
    seq_lens_t: torch.Tensor  # (num_seqs,) int32
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0
    # per-sequence helpers for the torch backend, computed once per step rather than once per layer
    seq_block_ids: list[torch.Tensor] = field(default_factory=list)
    seq_masks: list[torch.Tensor | None] = field(default_factory=list)
    _splits: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]] = field(default_factory=dict,
                                                                                            repr=False)  # fmt: skip

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step as one decode row per new token, once its K/V are in the pool: (block tables (num_tokens,
        max_blocks) int32, each token's sequence's row; key counts (num_tokens,) int64, its position + 1, the keys
        it attends causally). Every chunk is short against the longest, so it is ``split_chunks``'s, kept as that is
        (every layer of the step asks)."""
        return self.split_chunks(self.max_query_len)[1:3]

    def split_chunks(self, max_short: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """The step's chunks of at most ``max_short`` new tokens apart from the longer ones: (the short chunks' token
        indices in the flat batch, int64; their tokens as decode rows, as ``token_rows`` gives them: block tables and
        key counts; the long chunks' sequence indices). Computed on first use and kept for the step's next layers."""
        if max_short not in self._splits:
            lens = torch.tensor(self.query_lens, device=self.positions.device)
            short = lens <= max_short
            tokens = torch.arange(self.num_tokens, device=self.positions.device)[short.repeat_interleave(lens)]
            tables = self.block_tables[short].repeat_interleave(lens[short], dim=0)
            long = [i for i, n in enumerate(self.query_lens) if n > max_short]
            self._splits[max_short] = (tokens, tables, self.positions[tokens] + 1, long)
        return self._splits[max_short]

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index in the flat batch of each sequence's last new token (where its next token is sampled)."""
        return (self.cu_seqlens_q[1:] - 1).long()


@dataclass
class DecodeMetadata:
    """One pure-decode step of ``B`` sequences, built by ``build_decode_metadata`` (or copied into static buffers).

    Row ``b``'s new token sits at position ``positions[b]`` (its number of cached keys) and is written to slot
    ``slot_mapping[b]``. ``key_slots[b, j]`` is the slot of cached key ``j`` (past the row's length: some valid
    slot, masked off by ``key_mask``); ``key_mask[b, 0, 0, C]``, the new key's column, is always True.
    """

    positions: torch.Tensor  # (B,) int64
    slot_mapping: torch.Tensor  # (B,) int64
    seq_lens: torch.Tensor  # (B,) int32: cached keys + the new one
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    key_slots: torch.Tensor  # (B, C) int64
    key_mask: torch.Tensor  # (B, 1, 1, C + 1) bool
    max_seq_len: int  # what the paged kernels size their split-K by (static steps: the longest allowed)

    def copy_(self, other: DecodeMetadata) -> None:
        """Copy ``other``'s tensors into this one's storage (the static buffers a CUDA graph reads)."""
        for name in ("positions", "slot_mapping", "seq_lens", "block_tables", "key_slots", "key_mask"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    """The cache slot of position ``pos`` of a sequence whose block table is ``table``."""
    return table[pos // block_size] * block_size + pos % block_size


def pad_block_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    """Each block table cut or padded with block 0 to ``width`` entries: the rows of a rectangular tensor."""
    return [t[:width] + [0] * (width - min(len(t), width)) for t in tables]


def decode_key_width(max_cached: int) -> int:
    """Cached-key columns ``C`` of a decode whose longest sequence has ``max_cached`` keys: padded to ``KEY_PAD``."""
    return KEY_PAD * ceil_div(max(max_cached, 1), KEY_PAD)


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Turn per-sequence lengths and block tables into a ragged step's tensors."""
    positions: list[int] = []
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        for p in range(s_len - q_len, s_len):
            positions.append(p)
            slots.append(slot_of(table, p, block_size))
    cu = [0, *accumulate(query_lens)]
    max_blocks = max(ceil_div(s, block_size) for s in seq_lens)
    meta = AttentionMetadata(
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(pad_block_tables(block_tables, max_blocks), dtype=torch.int32, device=device),
    )
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        meta.seq_block_ids.append(torch.tensor(table[: ceil_div(s_len, block_size)], dtype=torch.int64, device=device))
        if q_len == 1 or q_len == s_len:
            meta.seq_masks.append(None)  # no mask, or plain causal
        else:
            # query i sits at position s_len - q_len + i and sees keys 0..that position
            q_pos = torch.arange(s_len - q_len, s_len, device=device)
            meta.seq_masks.append(torch.arange(s_len, device=device)[None, :] <= q_pos[:, None])  # (q_len, s_len)
    return meta


def build_decode_metadata(
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    width: int | None = None,
    max_seq_len: int | None = None,
) -> DecodeMetadata:
    """A pure decode's tensors: sequence ``b`` has ``seq_lens[b] - 1`` cached keys and one new token.

    ``width`` (C): cached-key columns, by default ``decode_key_width`` of the longest; ``max_seq_len``: what the
    paged kernels are told is the longest (default: the true longest). Static steps pass both as the largest
    the engine allows, so every shape stays the same from step to step.
    """
    cached = [n - 1 for n in seq_lens]
    width = decode_key_width(max(cached)) if width is None else width
    max_seq_len = max(seq_lens) if max_seq_len is None else max_seq_len
    tables = torch.tensor(pad_block_tables(block_tables, ceil_div(max(width, max_seq_len), block_size)), device=device)
    pos = torch.tensor(cached, dtype=torch.int64, device=device)
    j = torch.arange(width, device=device)
    key_mask = torch.ones(len(seq_lens), 1, 1, width + 1, dtype=torch.bool, device=device)
    torch.lt(j[None, :], pos[:, None], out=key_mask[:, 0, 0, :width])  # the last column (the new key) stays True
    return DecodeMetadata(
        positions=pos,
        slot_mapping=torch.tensor([slot_of(t, p, block_size) for t, p in zip(block_tables, cached)], device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(torch.int32),
        key_slots=tables[:, j // block_size] * block_size + j % block_size,  # (B, C)
        key_mask=key_mask,
        max_seq_len=max_seq_len,
    )


class AttentionBackend(Protocol):
    """Attends a step's new queries to their sequences' cached context.

    ``forward`` serves a ragged step whose K/V the model has already written; ``decode`` a pure decode, given the
    new tokens' K/V. ``decode_writes_cache``: whether ``decode`` writes the new K/V itself (a kernel that reads
    them from the pool must); otherwise the caller writes them (``KVCache.write``) after the step.
    """

    name: str
    gathers: bool  # whether decode gathers the cached keys (bounded by MAX_GATHER_KEY_SLOTS)
    decode_writes_cache: bool

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim), rotary applied
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), one layer, step's K/V written
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k: torch.Tensor | None = None,  # (num_tokens, num_kv_heads, head_dim): the step's K/V as written, if at hand
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        ...

    def decode(
        self,
        layer: int,
        q: torch.Tensor,  # (B, num_heads, head_dim): one new token per sequence, rotary applied
        k: torch.Tensor,  # (B, num_kv_heads, head_dim): the new tokens' K, rotary applied
        v: torch.Tensor,  # (B, num_kv_heads, head_dim)
        cache: KVCache,
        meta: DecodeMetadata,
        scale: float,
    ) -> torch.Tensor:  # (B, num_heads, head_dim)
        ...


class TorchAttentionBackend:
    """PyTorch SDPA: per sequence for a ragged step, one padded gather for a pure decode. The CPU default."""

    name = "torch"
    gathers = True
    decode_writes_cache = False

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        seqs: list[int] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each sequence's new tokens against its context, one SDPA per sequence. ``k``/``v``: the step's K/V as the
        model wrote them into the pool; a sequence whose new tokens are its whole context (a fresh prompt) attends to
        these rows instead of reading its blocks back, when the pool holds them unchanged (a plain pool of their dtype
        and width). ``seqs``: only these sequences (indices into ``meta``), their rows written into ``out`` (given, or
        new), the other rows left as they are."""
        n_kv, d, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]  # dv < d: MLA's latent (model.mla)
        group = q.shape[1] // n_kv  # query heads per KV head (1: MHA)
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], dv)
        as_written = (
            k is not None
            and v is not None
            and isinstance(k_cache, torch.Tensor)  # a quantized pool's layer is a dequantizing view
            and k_cache.dtype == k.dtype
            and (k.shape[-1], v.shape[-1]) == (d, dv)
        )
        starts = [0, *accumulate(meta.query_lens)]
        for i in range(meta.num_seqs) if seqs is None else seqs:
            q_len, s_len, start = meta.query_lens[i], meta.seq_lens[i], starts[i]
            ids = meta.seq_block_ids[i]
            if as_written and q_len == s_len:  # the pool's rows of this sequence are these, copied
                ks, vs = k[start : start + q_len], v[start : start + q_len]
            elif ids.numel() == 1:  # contiguous slot: a view, no copy
                ks, vs = k_cache[ids[0], :s_len], v_cache[ids[0], :s_len]
            else:
                ks = k_cache[ids].view(-1, n_kv, d)[:s_len]
                vs = v_cache[ids].reshape(-1, n_kv, dv)[:s_len]
            kt, vt = ks.transpose(0, 1), vs.transpose(0, 1)  # (kv_heads, s_len, d)
            if q_len == 1:
                # a decode sees its whole context: the group's query heads are the rows of one unmasked product
                # 4-D inputs select SDPA's fused CPU kernel (3-D ones take the slower math path)
                qg = q[start].view(1, n_kv, group, d)  # (1, kv_heads, group, d)
                o = F.scaled_dot_product_attention(qg, kt[None], vt[None], scale=scale)  # (1, kv_heads, group, d)
                out[start] = o.reshape(n_kv * group, dv)  # CUDA SDPA may return a non-contiguous layout
                continue
            # GQA: torch 2.13's fused CPU kernel takes the KV heads as they are (enable_gqa: the same result, no
            # expanded copy of K/V); on other devices expanded K/V (not checked there)
            gqa = group > 1 and q.device.type == "cpu"
            if group > 1 and not gqa:
                kt, vt = kt.repeat_interleave(group, dim=0), vt.repeat_interleave(group, dim=0)
            mask = meta.seq_masks[i]
            o = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1)[None],  # (1, heads, q_len, d)
                kt[None],  # (1, kv_heads, s_len, d), or (1, heads, s_len, d) expanded
                vt[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
        return out

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        meta: DecodeMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Each row's cached K/V gathered through ``meta.key_slots`` (masked; dequantized from an int8 or fp8
        pool by ``KVCache.gather``), its new K/V appended as the last key (as the pool will hold it,
        ``KVCache.round_trip``): the scores and values of a write followed by attention, with the cache only read.
        The shapes depend only on (B, C), so the step compiles as one graph with C dynamic."""
        b, n_kv, d = k.shape
        group = q.shape[1] // n_kv
        k_old, v_old = cache.gather(layer, meta.key_slots)  # (B, C, kv_heads, d), dequantized if the pool is
        k, v = cache.round_trip(layer, k, v)  # the new key as the pool will hold it (a no-op unquantized)
        kk = torch.cat((k_old, k[:, None]), dim=1).transpose(1, 2)  # (B, kv_heads, C + 1, d)
        vv = torch.cat((v_old, v[:, None]), dim=1).transpose(1, 2)
        qg = q.reshape(b, n_kv, group, d)  # GQA without copies: a KV head's query heads are its query rows
        out = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=meta.key_mask, scale=scale)  # (B, kv, group, d)
        return out.reshape(b, n_kv * group, -1)  # (B, heads, dv)


TORCH_BACKEND = TorchAttentionBackend()  # stateless: what a model's forward uses unless given another
