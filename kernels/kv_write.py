"""KV write: scatter a step's new K and V rows into the paged pool through the slot mapping.

Token ``t`` goes to slot ``s = slot_mapping[t]``, i.e. block ``s // block_size``, row ``s % block_size`` of every
layer's ``(num_blocks, block_size, num_kv_heads, head_dim)`` pool; ``s < 0`` marks a padding token (skipped).
One program per token copies all its KV heads at once. Offsets into the pool are int64 (pools past 2**31
elements). The PyTorch twin is ``workbench.kernels.reference.kv_write_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from workbench.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    KernelInputError,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    next_pow2,
)


@triton.jit
def _kv_write_kernel(
    k_ptr,  # (num_tokens, num_kv_heads, head_dim)
    v_ptr,  # (num_tokens, num_kv_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping_ptr,  # (num_tokens,) int32/int64, < 0 means skip
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,  # next power of two of NUM_KV_HEADS
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        row = slot % block_size
        offs_h = tl.arange(0, KV_HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # (KV_HEADS_PAD, HEAD_DIM_PAD)
        k = tl.load(k_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
        kc = k_cache_ptr + block * stride_kc_b + row * stride_kc_s
        vc = v_cache_ptr + block * stride_vc_b + row * stride_vc_s
        tl.store(kc + offs_h[:, None] * stride_kc_h + offs_d[None, :], k, mask=mask)
        tl.store(vc + offs_h[:, None] * stride_vc_h + offs_d[None, :], v, mask=mask)


def kv_write(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    slot_mapping: torch.Tensor,  # (num_tokens,) int32/int64
) -> None:
    """Write ``k[t]``/``v[t]`` into slot ``slot_mapping[t]`` of the caches, in place; slots < 0 are skipped.

    K/V must have the cache's dtype; every tensor must be contiguous in its last dimension (other strides are
    free, e.g. K/V sliced out of a fused QKV projection).
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise KernelInputError(f"k and v must be (num_tokens, num_kv_heads, head_dim), got {k.shape}, {v.shape}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"caches must be (num_blocks, block_size, num_kv_heads, head_dim), got {k_cache.shape}, {v_cache.shape}"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise KernelInputError(f"k {tuple(k.shape)} does not match the cache's heads/head_dim {k_cache.shape}")
    if slot_mapping.shape != (num_tokens,):
        raise KernelInputError(f"slot_mapping must be ({num_tokens},), got {tuple(slot_mapping.shape)}")
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache)):
        if t.dtype != k_cache.dtype:
            raise KernelInputError(f"{name} must have the cache dtype {k_cache.dtype}, got {t.dtype}")
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_device(k, v, k_cache, v_cache, slot_mapping)
    check_last_dim_contiguous(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if num_tokens == 0:
        return
    kv_heads_pad, head_dim_pad = next_pow2(num_kv_heads), next_pow2(head_dim)
    num_warps = 4 if kv_heads_pad * head_dim_pad >= 2048 else 1
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=kv_heads_pad,
        HEAD_DIM_PAD=head_dim_pad,
        num_warps=num_warps,
    )
