"""Paged decode attention: one query token per sequence against its blocks, split-K over the context.

Decode reads the whole KV cache for one new token, so it is bound by memory bandwidth and the kernel's job is
to read each K/V byte once, at full speed:

- One program per (sequence, KV head, split) handles *all* query heads of that KV group, so GQA/MQA load each
  K/V tile once for ``num_heads // num_kv_heads`` queries (the group is padded to 16 rows for ``tl.dot``).
- Split-K (flash-decoding, Dao et al. 2023): the context is cut into ``num_splits`` contiguous partitions that
  run as separate programs, so few long sequences still fill the GPU. Each writes a partial output normalised
  by its own softmax sum plus that sum's log-sum-exp; a second kernel merges the partials, weighting each by
  ``exp(lse_split - lse_total)``. With one split the first kernel writes the output directly.
- Head sizes that are not powers of two are padded to the next power of two and masked.
- Tokens of a tile are gathered through the block table one by one, so any block size (1, 16, 32, ...)
  works; offsets into the pool are int64.
- Multi-head latent attention (``paged_mla_decode_attention``; DeepSeek-V2/V3, ``workbench.model.mla``): the pool
  holds one entry per token, ``[latent, rotary key]``, and V is the entry's first ``latent_dim`` values: the same
  kernel, with V a view of the K pool and ``HEAD_DIM_V < HEAD_DIM`` (the absorbed form is an MQA of head size
  ``latent + rope``), so each entry is read once for every query head.
- A quantized pool (``KV_QUANT``) is dequantized as it is loaded, in fp32: int8 with one fp32 scale per (token,
  KV head) read beside each row (``KV_QUANT = 1``), fp8 e4m3 with one scale for the layer (``KV_QUANT = 2``). The
  kernel then reads 1 byte per cached value (plus 4 per token and head for int8's scale) instead of 2 or 4.
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

# split lengths are multiples of this many tokens; a split shorter than MIN_SPLIT_TOKENS is not worth a program
SPLIT_ALIGN = 16
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64

_DECODE_CONFIGS = pick_configs(
    [
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 32}, num_warps=2, num_stages=4),
    ],
    single=triton.Config({"BLOCK_N": 32 if INTERPRET else 64}, num_warps=4, num_stages=2),
)


@triton.autotune(configs=_DECODE_CONFIGS, key=["tune_bucket", "HEAD_DIM_PAD", "GROUP_PAD", "PAGE_SIZE", "WRITE_FINAL"])
@triton.jit
def _paged_decode_kernel(
    q_ptr,  # (num_seqs, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, page_size, num_kv_heads, head_dim)
    v_cache_ptr,  # (num_blocks, page_size, num_kv_heads, head_dim)
    block_tables_ptr,  # (num_seqs, max_blocks) int32
    seq_lens_ptr,  # (num_seqs,) int32/int64
    out_ptr,  # (num_seqs, num_heads, head_dim): written when WRITE_FINAL
    part_out_ptr,  # (num_seqs, num_heads, num_splits, HEAD_DIM_PAD) fp32: written when not WRITE_FINAL
    part_lse_ptr,  # (num_seqs, num_heads, num_splits) fp32, log2 domain: written when not WRITE_FINAL
    k_scale_ptr,  # KV_QUANT 1: (num_blocks, page_size, num_kv_heads) fp32; 2: (1,) fp32; 0: unused
    v_scale_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    split_len,  # tokens per split (a multiple of SPLIT_ALIGN)
    num_splits,
    tune_bucket,  # unused by the body: split_len rounded to a power of two, so autotuning is per length range
    stride_q_s,
    stride_q_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt_s,
    stride_o_s,
    stride_o_h,
    stride_sc_b,  # scales (block, slot); the KV head's scale is contiguous
    stride_sc_s,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    HEAD_DIM_V: tl.constexpr,  # V's (and the output's) head size: HEAD_DIM, or MLA's latent (<= HEAD_DIM)
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    WRITE_FINAL: tl.constexpr,  # one split: write the normalised output instead of partials
    IEEE_DOT: tl.constexpr,  # fp32 inputs: full-precision dot instead of TF32
    KV_QUANT: tl.constexpr,  # 0: caches in q's dtype; 1: int8 with per-(token, head) scales; 2: fp8 with one scale
    BLOCK_N: tl.constexpr,  # context tokens per tile
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_d < HEAD_DIM_V
    heads = kv_head * GROUP + offs_g  # (GROUP_PAD,) query heads of this KV group
    q_ptrs = q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # (GROUP_PAD, HEAD_DIM_PAD)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running softmax sum
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt_s
    kc_head = k_cache_ptr + kv_head * stride_kc_h
    vc_head = v_cache_ptr + kv_head * stride_vc_h

    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) token positions
        n_mask = offs_n < split_end
        block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            kc_head + block[:, None] * stride_kc_b + row[:, None] * stride_kc_s + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, HEAD_DIM_PAD)
        v = tl.load(
            vc_head + block[:, None] * stride_vc_b + row[:, None] * stride_vc_s + offs_d[None, :],
            mask=n_mask[:, None] & dv_mask[None, :],
            other=0.0,
        )  # columns past HEAD_DIM_V are 0, so are the output's
        if KV_QUANT == 1:
            sc_off = block * stride_sc_b + row * stride_sc_s + kv_head  # (BLOCK_N,)
            k_sc = tl.load(k_scale_ptr + sc_off, mask=n_mask, other=0.0)
            v_sc = tl.load(v_scale_ptr + sc_off, mask=n_mask, other=0.0)
            k = (k.to(tl.float32) * k_sc[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
        elif KV_QUANT == 2:
            k = (k.to(tl.float32) * tl.load(k_scale_ptr)).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(v_scale_ptr)).to(q.dtype)
        if IEEE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))  # (GROUP_PAD, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if WRITE_FINAL:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & dv_mask[None, :])
    else:
        # an empty split (a sequence shorter than the longest) has l_i = 0: output 0, lse -inf (weight 0)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(safe_l), float("-inf"))
        row_hs = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split  # (GROUP_PAD,) (seq, head, split)
        tl.store(part_lse_ptr + row_hs, lse, mask=g_mask)
        po_ptrs = part_out_ptr + row_hs[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(po_ptrs, acc / safe_l[:, None], mask=g_mask[:, None])


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # (num_seqs, num_heads, num_splits, HEAD_DIM_PAD) fp32
    part_lse_ptr,  # (num_seqs, num_heads, num_splits) fp32, log2 domain
    out_ptr,  # (num_seqs, num_heads, head_dim)
    num_splits,
    stride_o_s,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits padded to a power of two
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head  # (seq, head) in the partial tensors
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))  # (SPLITS_PAD,)
    lse_max = tl.max(lse, axis=0)  # finite: split 0 always holds at least one token
    w = tl.math.exp2(lse - lse_max)  # (SPLITS_PAD,) each split's share of the softmax sum, up to a factor
    po_ptrs = part_out_ptr + (row * num_splits + offs_s[:, None]) * HEAD_DIM_PAD + offs_d[None, :]
    parts = tl.load(po_ptrs, mask=s_mask[:, None], other=0.0)  # (SPLITS_PAD, HEAD_DIM_PAD)
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    o_ptrs = out_ptr + seq * stride_o_s + head * stride_o_h + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) so that the grid gives every SM a few programs, none shorter than
    ``MIN_SPLIT_TOKENS`` tokens of context."""
    programs = num_seqs * num_kv_heads
    target = 4 * _num_sms(device)  # a few resident programs per SM hide the gather latency
    by_occupancy = triton.cdiv(target, max(programs, 1))
    by_length = triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, head_dim), rotary applied
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32/int64, each >= 1
    scale: float | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # (num_seqs, num_heads, head_dim), q's dtype
    """Attention of one query per sequence over its whole paged context (the token at position seq_len - 1).

    ``scale`` defaults to ``1/sqrt(head_dim)``. ``num_splits`` (split-K partitions per sequence) defaults to
    ``default_num_splits``; it is capped so that no split of the longest sequence is empty. ``max_seq_len``
    (the largest of ``seq_lens``) saves a device-to-host sync when the caller knows it.

    Quantized caches (``workbench.kv.cache``): int8 caches with ``k_scale``/``v_scale`` of shape
    ``(num_blocks, block_size, num_kv_heads)`` fp32 (value = q * scale per token and head), or float8_e4m3fn caches
    with one-element fp32 scales (value = q * scale).
    """
    num_seqs = q.shape[0] if q.dim() == 3 else -1
    quantized = k_scale is not None or v_scale is not None
    page_size, num_kv_heads, head_dim = check_paged_attention_inputs(
        q, k_cache, v_cache, block_tables, num_seqs, "num_seqs", quantized_cache=quantized
    )
    kv_quant = 0
    if quantized:
        if k_scale is None or v_scale is None or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
            raise KernelInputError("a quantized cache needs both k_scale and v_scale, fp32")
        if k_cache.dtype == torch.int8:
            kv_quant = 1
            if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_cache.shape[:3]:
                raise KernelInputError(f"int8 caches need scales of shape {tuple(k_cache.shape[:3])}, got "
                                       f"{tuple(k_scale.shape)}, {tuple(v_scale.shape)}")  # fmt: skip
            check_last_dim_contiguous(k_scale=k_scale, v_scale=v_scale)
            if k_scale.stride() != v_scale.stride():
                raise KernelInputError("k_scale and v_scale must have the same strides")
        else:
            kv_quant = 2
            if k_scale.numel() != 1 or v_scale.numel() != 1:
                raise KernelInputError("fp8 caches take one scale each for K and V")
        check_device(q, k_scale, v_scale)
    if seq_lens.shape != (num_seqs,):
        raise KernelInputError(f"seq_lens must be ({num_seqs},), got {tuple(seq_lens.shape)}")
    check_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    check_device(q, k_cache, v_cache, block_tables, seq_lens)
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)

    return _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, max_seq_len, k_scale,
                          v_scale, kv_quant, page_size, num_kv_heads, head_dim, head_dim)  # fmt: skip


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None,
    num_splits: int | None,
    max_seq_len: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_quant: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
) -> torch.Tensor:
    """The split-K decode kernel and the merge of its partials, on checked inputs; output (seqs, heads, head_dim_v)."""
    num_seqs, num_heads = q.shape[0], q.shape[1]
    quantized = kv_quant != 0
    out = torch.empty((num_seqs, num_heads, head_dim_v), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    if num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    num_splits = triton.cdiv(max(max_seq_len, 1), split_len)  # no split of the longest sequence is empty

    group = num_heads // num_kv_heads
    head_dim_pad = next_pow2(head_dim, 16)
    write_final = num_splits == 1
    if write_final:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        k_scale if quantized else out,  # unused when not quantized
        v_scale if quantized else out,
        scale * math.log2(math.e),
        split_len,
        num_splits,
        min(max(next_pow2(split_len), 64), 8192),
        *paged_attention_strides(q, k_cache, v_cache, block_tables, out),
        k_scale.stride(0) if kv_quant == 1 else 0,
        k_scale.stride(1) if kv_quant == 1 else 0,
        GROUP=group,
        GROUP_PAD=next_pow2(group, 16),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEAD_DIM_V=head_dim_v,
        PAGE_SIZE=page_size,
        WRITE_FINAL=write_final,
        IEEE_DOT=q.dtype == torch.float32,
        KV_QUANT=kv_quant,
    )
    if not write_final:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim_v,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=next_pow2(num_splits),
            num_warps=4 if head_dim_pad >= 128 else 1,
        )
    return out


def paged_mla_decode_attention(
    q: torch.Tensor,  # (num_seqs, num_heads, latent_dim + rope_dim): absorbed queries (workbench.model.mla)
    kv_cache: torch.Tensor,  # (num_blocks, block_size, 1, latent_dim + rope_dim): [latent, rotary key] per token
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32
    seq_lens: torch.Tensor,  # (num_seqs,) int32/int64, each >= 1
    latent_dim: int,
    scale: float,  # MLA's (qk_nope_head_dim + qk_rope_head_dim)^-0.5, not the entry's size
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # (num_seqs, num_heads, latent_dim), q's dtype
    """MLA decode over a paged pool of latent entries: softmax(q . entry * scale) . entry[:latent_dim], every
    query head against the one shared entry per token (an MQA whose V is the latent part of K)."""
    num_seqs = q.shape[0] if q.dim() == 3 else -1
    page_size, num_kv_heads, head_dim = check_paged_attention_inputs(
        q, kv_cache, kv_cache, block_tables, num_seqs, "num_seqs"
    )
    if num_kv_heads != 1:
        raise KernelInputError(f"an MLA pool has one entry per token (num_kv_heads 1), got {num_kv_heads}")
    if not 0 < latent_dim <= head_dim:
        raise KernelInputError(f"latent_dim must be in [1, {head_dim}] (the entry's size), got {latent_dim}")
    if seq_lens.shape != (num_seqs,):
        raise KernelInputError(f"seq_lens must be ({num_seqs},), got {tuple(seq_lens.shape)}")
    check_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    check_device(q, kv_cache, block_tables, seq_lens)
    check_last_dim_contiguous(q=q, kv_cache=kv_cache, block_tables=block_tables)
    return _launch_decode(q, kv_cache, kv_cache[..., :latent_dim], block_tables, seq_lens, scale, num_splits,
                          max_seq_len, None, None, 0, page_size, 1, head_dim, latent_dim)  # fmt: skip
