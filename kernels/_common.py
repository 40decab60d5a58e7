"""What the kernel files share: where kernels run, autotune config lists, and input checks.

The choice between one config and a small list is made once, at import, because ``@triton.autotune`` with
more than one config needs a GPU to time them: under the interpreter (``TRITON_INTERPRET=1``) or without CUDA
every kernel gets a single config. ``KERNELS_AUTOTUNE=0`` also forces the single config on a GPU (the GPU
check's test phase uses it to compile each shape once instead of once per config).
"""

from __future__ import annotations

import os

import torch
import triton


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


INTERPRET: bool = _env_flag("TRITON_INTERPRET", "0")
AUTOTUNE: bool = not INTERPRET and torch.cuda.is_available() and _env_flag("KERNELS_AUTOTUNE", "1")


class KernelInputError(ValueError):
    """A kernel wrapper got tensors of the wrong shape, dtype, layout or device."""


def pick_configs(gpu_configs: list[triton.Config], single: triton.Config) -> list[triton.Config]:
    """The autotune list: ``gpu_configs`` on a GPU with autotuning on, else only ``single``."""
    return gpu_configs if AUTOTUNE else [single]


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum) (tile extents must be powers of two)."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and a device Triton can run on (CUDA, or anything under the interpreter)."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise KernelInputError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type != "cuda" and not INTERPRET:
        raise KernelInputError(
            f"Triton kernels need CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before importing kernels"
        )


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise KernelInputError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise KernelInputError(f"{name} must have dtype in {allowed}, got {t.dtype}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_paged_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_seqs: int,
    q_name: str,
    quantized_cache: bool = False,
) -> tuple[int, int, int]:
    """Checks shared by the paged attention wrappers; returns (page_size, num_kv_heads, head_dim).

    q: (``q_name``, num_heads, head_dim); caches: (num_blocks, block_size, num_kv_heads, head_dim) in q's dtype;
    block_tables: (num_seqs, max_blocks) int32.
    """
    if q.dim() != 3:
        raise KernelInputError(f"q must be ({q_name}, num_heads, head_dim), got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"caches must be (num_blocks, block_size, num_kv_heads, head_dim), got {k_cache.shape}, {v_cache.shape}"
        )
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise KernelInputError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise KernelInputError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise KernelInputError(f"block_tables must be ({num_seqs}, max_blocks), got {tuple(block_tables.shape)}")
    check_dtype("q", q, FLOAT_DTYPES)
    if quantized_cache:  # int8 (per-token scales) or fp8 e4m3 (per-tensor scale), dequantized in the kernel
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_dtype(name, t, QUANTIZED_KV_DTYPES)
        if k_cache.dtype != v_cache.dtype:
            raise KernelInputError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype}, {v_cache.dtype}")
    elif k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelInputError(f"caches must have q's dtype {q.dtype}, got {k_cache.dtype}, {v_cache.dtype}")
    check_dtype("block_tables", block_tables, (torch.int32,))
    return page_size, num_kv_heads, head_dim


def paged_attention_strides(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor
) -> tuple[int, ...]:
    """The stride arguments of both paged attention kernels, in their order: q (token, head), K and V caches
    (block, slot, head), the block-table row, out (token, head). Last dimensions are contiguous (checked)."""
    return (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
    )  # fmt: skip
