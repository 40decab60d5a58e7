"""Inputs for checking and timing the kernels: random ragged batches over a randomly paged KV pool.

Shared by the tests (``tests/test_kernels_*.py``), the benchmark (``workbench.kernels.bench``) and the GPU check
(``scripts/gpu_check.py``), so all three exercise the same layouts: each sequence owns distinct blocks drawn at
random from a pool with spare blocks, so a kernel that reads the wrong block, row or head reads random data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# tolerances against the fp32 reference, one row per dtype (outputs are rounded to the input dtype); invariance
# tests (block size 1 = 16, split-K = no split, chunked = one shot) use them too: a different reduction order is not
# bit-identical, and which bits differ depends on the CPU (AVX-512 or AVX2) running the interpreter
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


@dataclass
class PagedBatch:
    """One step's attention inputs: ragged queries and a paged pool holding every sequence's context."""

    q: torch.Tensor  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with 0
    seq_lens: torch.Tensor  # (num_seqs,) int32
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32
    query_lens: list[int]
    seq_lens_list: list[int]
    block_tables_list: list[list[int]]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list)

    @property
    def slot_mapping(self) -> torch.Tensor:  # (num_tokens,) int64: slots of the new tokens
        bs = self.k_cache.shape[1]
        slots = [
            table[p // bs] * bs + p % bs
            for q_len, s_len, table in zip(self.query_lens, self.seq_lens_list, self.block_tables_list)
            for p in range(s_len - q_len, s_len)
        ]
        return torch.tensor(slots, dtype=torch.int64, device=self.q.device)


def random_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> list[list[int]]:
    """Distinct random physical blocks for each sequence, ``ceil(seq_len / block_size)`` each."""
    needed = [-(-s // block_size) for s in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(perm[start : start + n])
        start += n
    return tables


def pad_tables(tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """(num_seqs, max_blocks) int32, padded with 0 like ``workbench.model.attention.build_metadata``."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def random_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 4,
    num_blocks: int | None = None,
) -> PagedBatch:
    """Random queries and a random paged pool (unused blocks are filled too, with different random values)."""
    if any(not 1 <= q <= s for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError(f"need 1 <= query_len <= seq_len, got {query_lens}, {seq_lens}")
    gen = torch.Generator().manual_seed(seed)
    if num_blocks is None:
        num_blocks = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=pad_tables(tables, device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        query_lens=list(query_lens),
        seq_lens_list=list(seq_lens),
        block_tables_list=tables,
    )


def repage(batch: PagedBatch, block_size: int, seed: int = 1) -> PagedBatch:
    """The same logical K/V (and queries) in a pool of another block size, under new random block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in batch.seq_lens_list) + 2
    tables = random_block_tables(batch.seq_lens_list, block_size, num_blocks, gen)
    _, old_bs, n_kv, d = batch.k_cache.shape
    device = batch.q.device
    k_cache = torch.zeros((num_blocks, block_size, n_kv, d), dtype=batch.k_cache.dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    for old, new, s_len in zip(batch.block_tables_list, tables, batch.seq_lens_list):
        pos = torch.arange(s_len, device=device)
        src_b = torch.tensor(old, device=device)[pos // old_bs]
        dst_b = torch.tensor(new, device=device)[pos // block_size]
        k_cache[dst_b, pos % block_size] = batch.k_cache[src_b, pos % old_bs]
        v_cache[dst_b, pos % block_size] = batch.v_cache[src_b, pos % old_bs]
    return PagedBatch(
        q=batch.q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=pad_tables(tables, device),
        seq_lens=batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        query_lens=batch.query_lens,
        seq_lens_list=batch.seq_lens_list,
        block_tables_list=tables,
    )
