"""Paged prefill attention: a ragged batch of query chunks, each causal over its sequence's paged context.

Sequence ``s`` brings ``q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s]`` new queries that sit at the end of its
``seq_len = seq_lens[s]`` tokens: query ``i`` is at position ``seq_len - q_len + i`` and sees keys ``0..`` that
position, read from the paged pool (the new K/V are already written there by ``kv_write``). So one kernel
serves one-shot prefill (``q_len == seq_len``), chunked prefill and prefix-cache hits (``q_len < seq_len``) and
decodes mixed into the same batch (``q_len == 1``).

Flash-attention forward (online softmax in fp32, exp2): one program per (tile of BLOCK_M queries, sequence,
query head). Key tiles wholly visible to every query of the tile run without a mask; only the tiles that cross
the causal diagonal are masked. Tiles are walked from the last query tile down so the longest programs start
first. Head sizes that are not powers of two are padded and masked; pool offsets are int64.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from workbench.kernels._common import (
    INDEX_DTYPES,
    INTERPRET,
    KernelInputError,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_paged_attention_inputs,
    next_pow2,
    paged_attention_strides,
    pick_configs,
)

_PREFILL_CONFIGS = pick_configs(
    [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=4),
    ],
    single=triton.Config(
        {"BLOCK_M": 16, "BLOCK_N": 32} if INTERPRET else {"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2
    ),
)


@triton.jit
def _attend_tile(
    q,  # (BLOCK_M, HEAD_DIM_PAD)
    acc,  # (BLOCK_M, HEAD_DIM_PAD) fp32
    m_i,  # (BLOCK_M,) fp32 running max, log2 domain
    l_i,  # (BLOCK_M,) fp32 running softmax sum
    start,
    kc_head,  # k_cache_ptr advanced to this KV head
    vc_head,
    bt_row,  # block_tables_ptr advanced to this sequence
    q_pos,  # (BLOCK_M,) positions of the queries
    seq_len,
    qk_scale,
    stride_kc_b,
    stride_kc_s,
    stride_vc_b,
    stride_vc_s,
    offs_d,
    d_mask,
    MASKED: tl.constexpr,  # apply the causal and end-of-sequence mask
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
    if MASKED:
        n_mask = offs_n < seq_len
        block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
    row = offs_n % PAGE_SIZE
    k_ptrs = kc_head + block[:, None] * stride_kc_b + row[:, None] * stride_kc_s + offs_d[None, :]
    v_ptrs = vc_head + block[:, None] * stride_vc_b + row[:, None] * stride_vc_s + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_N, HEAD_DIM_PAD)
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif HEAD_DIM_PAD == HEAD_DIM:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    if IEEE_DOT:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale  # (BLOCK_M, BLOCK_N)
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < seq_len)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.autotune(configs=_PREFILL_CONFIGS, key=["tune_bucket", "HEAD_DIM_PAD", "PAGE_SIZE", "GROUP"])
@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # (num_tokens, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, page_size, num_kv_heads, head_dim)
    v_cache_ptr,  # (num_blocks, page_size, num_kv_heads, head_dim)
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    seq_lens_ptr,  # (num_seqs,) int32/int64
    cu_seqlens_q_ptr,  # (num_seqs + 1,) int32/int64
    out_ptr,  # (num_tokens, num_heads, head_dim)
    qk_scale,  # softmax scale * log2(e)
    tune_bucket,  # unused by the body: max_query_len rounded to a power of two, so autotuning is per size range
    stride_q_t,
    stride_q_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt_s,
    stride_o_t,
    stride_o_h,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    IEEE_DOT: tl.constexpr,  # fp32 inputs: full-precision dot instead of TF32
    BLOCK_M: tl.constexpr,  # queries per tile
    BLOCK_N: tl.constexpr,  # keys per tile
):
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)  # last query tiles (most keys) first
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
    m0 = tile_m * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        ctx_len = seq_len - q_len  # cached tokens before this chunk
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        tokens = (q_start + offs_m).to(tl.int64)  # (BLOCK_M,) rows of the flat batch
        q_ptrs = q_ptr + tokens[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM_PAD)
        q_pos = ctx_len + offs_m  # (BLOCK_M,) positions; rows past q_len are padding, never stored

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        bt_row = block_tables_ptr + seq * stride_bt_s
        kc_head = k_cache_ptr + kv_head * stride_kc_h
        vc_head = v_cache_ptr + kv_head * stride_vc_h

        # keys 0..ctx_len+m0 are visible to every row of the tile: whole tiles of them need no mask
        full_end = ((ctx_len + m0 + 1) // BLOCK_N) * BLOCK_N
        for start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, start, kc_head, vc_head, bt_row, q_pos, seq_len, qk_scale,
                stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, offs_d, d_mask,
                False, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, IEEE_DOT, BLOCK_N,
            )  # fmt: skip
        # the tiles crossing the diagonal, up to the last row's position (the first holds key 0 or follows a
        # full tile, so no row's running max stays -inf)
        end = tl.minimum(seq_len, ctx_len + m0 + BLOCK_M)
        for start in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, start, kc_head, vc_head, bt_row, q_pos, seq_len, qk_scale,
                stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s, offs_d, d_mask,
                True, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, IEEE_DOT, BLOCK_N,
            )  # fmt: skip

        out = acc / l_i[:, None]
        o_ptrs = out_ptr + tokens[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim), rotary applied
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), new K already written
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32/int64: context length after this step (cached + new)
    cu_seqlens_q: torch.Tensor,  # (num_seqs + 1,) int32/int64: start of each sequence's queries in q
    max_query_len: int,
    scale: float | None = None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim), q's dtype
    """Causal attention of each sequence's new queries over its paged context (cached prefix + the chunk).

    ``max_query_len`` (the longest chunk) sizes the grid; ``scale`` defaults to ``1/sqrt(head_dim)``.
    """
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or cu_seqlens_q.shape != (num_seqs + 1,):
        raise KernelInputError(
            f"seq_lens must be (num_seqs,) and cu_seqlens_q (num_seqs + 1,), got {tuple(seq_lens.shape)}, "
            f"{tuple(cu_seqlens_q.shape)}"
        )
    page_size, num_kv_heads, head_dim = check_paged_attention_inputs(
        q, k_cache, v_cache, block_tables, num_seqs, "num_tokens"
    )
    num_tokens, num_heads, _ = q.shape
    if max_query_len < 0:
        raise KernelInputError(f"max_query_len must be >= 0, got {max_query_len}")
    check_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    check_dtype("cu_seqlens_q", cu_seqlens_q, INDEX_DTYPES)
    check_device(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    grid = lambda meta: (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_seqs, num_heads)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        out,
        scale * math.log2(math.e),
        min(max(next_pow2(max_query_len), 16), 8192),
        *paged_attention_strides(q, k_cache, v_cache, block_tables, out),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_pow2(head_dim, 16),
        PAGE_SIZE=page_size,
        IEEE_DOT=q.dtype == torch.float32,
    )
    return out
