"""Paged decode attention (split-K) against the fp32 reference, on grids in the manner of vLLM's kernel tests.

On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1); bf16 is wrong there, so
bf16 cases run only on CUDA.
"""

import pytest
import torch
from workbench.kernels._common import INTERPRET, KernelInputError
from workbench.kernels.paged_decode import default_num_splits, paged_decode_attention
from workbench.kernels.reference import paged_decode_attention_reference
from workbench.kernels.testing import TOLERANCES, random_paged_batch, repage

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
ON_CUDA = DEVICE == "cuda"

NUM_HEADS = [(4, 4), (8, 2), (8, 1)]  # (query heads, KV heads): MHA, GQA, MQA
HEAD_SIZES = [24, 64, 128]  # 24 is not a power of two: padded to 32 and masked
BLOCK_SIZES = [1, 16, 32]
SEQ_LENS = [1, 17, 40, 75]  # end mid-block for block sizes 16 and 32; 1 is a lone token
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_SPLITS = [1, 3]


def skip_unsupported(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not computed correctly by the Triton interpreter: CUDA only")


def decode_batch(num_heads, head_size, block_size, dtype, seq_lens=SEQ_LENS, seed=0):
    n_q, n_kv = num_heads
    ones = [1] * len(seq_lens)
    return random_paged_batch(ones, seq_lens, n_q, n_kv, head_size, block_size, dtype, DEVICE, seed=seed)


def run(batch, **kwargs) -> torch.Tensor:
    return paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, **kwargs)


def reference(batch, scale=None) -> torch.Tensor:
    return paged_decode_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale
    )


@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_splits", NUM_SPLITS)
def test_decode_matches_reference_fp32(num_heads, head_size, block_size, num_splits):
    batch = decode_batch(num_heads, head_size, block_size, torch.float32)
    out = run(batch, num_splits=num_splits)
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", [24, 128])
def test_decode_matches_reference_half(dtype, num_heads, head_size):
    skip_unsupported(dtype)
    batch = decode_batch(num_heads, head_size, 16, dtype, seed=1)
    out = run(batch, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(batch).float(), **TOLERANCES[dtype])


def test_decode_custom_scale_and_default_splits():
    batch = decode_batch((8, 2), 64, 16, torch.float32, seq_lens=[300, 5])
    out = run(batch, scale=0.05)  # default split heuristic, several splits for the long sequence
    torch.testing.assert_close(out, reference(batch, scale=0.05), **TOLERANCES[torch.float32])


def test_block_size_1_equals_block_size_16():
    batch16 = decode_batch((8, 2), 64, 16, torch.float32, seq_lens=[3, 33, 50])
    batch1 = repage(batch16, block_size=1)
    torch.testing.assert_close(run(batch1, num_splits=2), run(batch16, num_splits=2), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("num_splits", [2, 5, 64])
def test_split_k_equals_no_split(num_splits):
    # 64 splits of a 90-token context: the longest gets several, the 3-token sequence leaves most splits empty
    batch = decode_batch((8, 1), 64, 16, torch.float32, seq_lens=[90, 3, 47])
    # another reduction order: equal within the dtype's tolerance, not bit for bit (that depends on the CPU)
    torch.testing.assert_close(run(batch, num_splits=num_splits), run(batch, num_splits=1), **TOLERANCES[torch.float32])


def test_non_contiguous_query():
    batch = decode_batch((4, 4), 64, 16, torch.float32, seq_lens=[20, 9])
    fused = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)  # (B, 2 * heads, d), as a QKV slice
    q_view = fused[:, :4]
    assert not q_view.is_contiguous()
    out = paged_decode_attention(q_view, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    torch.testing.assert_close(out, reference(batch), **TOLERANCES[torch.float32])


def test_default_num_splits_fills_the_device_and_respects_length():
    cpu = torch.device("cpu")
    assert default_num_splits(1, 1, 10, cpu) == 1  # a short context is never split
    assert default_num_splits(1, 8, 4096, cpu) > 1  # few programs, long context: split
    assert default_num_splits(512, 8, 4096, cpu) == 1  # plenty of programs already


def test_rejects_bad_inputs():
    batch = decode_batch((4, 4), 64, 16, torch.float32, seq_lens=[5])
    with pytest.raises(KernelInputError, match="dtype"):
        paged_decode_attention(batch.q.half(), batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    with pytest.raises(KernelInputError, match="multiple"):
        paged_decode_attention(batch.q[:, :3], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    with pytest.raises(KernelInputError, match="block_tables"):
        paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables.long(), batch.seq_lens)


@pytest.mark.skipif(not ON_CUDA, reason="a pool past 2**31 elements needs a GPU (and ~8 GB)")
def test_large_pool_int64_offsets():
    # 2**31 / (16 * 1 * 64) = 2**21 blocks; the sequences use blocks beyond that, where int32 offsets wrap
    block_size, n_kv, d = 16, 1, 64
    num_blocks = 2**21 + 64
    batch = decode_batch((4, 1), d, block_size, torch.float16, seq_lens=[40, 70])
    k_cache = torch.zeros((num_blocks, block_size, n_kv, d), dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables = [[num_blocks - 1 - 8 * s - i for i in range(len(t))] for s, t in enumerate(batch.block_tables_list)]
    for old, new in zip(batch.block_tables_list, tables):
        k_cache[new] = batch.k_cache[old]
        v_cache[new] = batch.v_cache[old]
    bt = torch.tensor([t + [0] * (5 - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(batch.q, k_cache, v_cache, bt, batch.seq_lens, num_splits=2)
    torch.testing.assert_close(out.float(), reference(batch).float(), **TOLERANCES[torch.float16])
