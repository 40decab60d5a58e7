"""Paged prefill attention over ragged query chunks against the fp32 reference; chunked equals one-shot.

Each batch mixes a whole prompt, a chunk after a cached prefix (chunked prefill or a prefix-cache hit) and
decodes (one query), with lengths that end mid-block. On CPU through the Triton interpreter; bf16 on CUDA only.
"""

import pytest
import torch
from workbench.kernels._common import INTERPRET, KernelInputError
from workbench.kernels.kv_write import kv_write
from workbench.kernels.paged_prefill import paged_prefill_attention
from workbench.kernels.reference import paged_prefill_attention_reference
from workbench.kernels.testing import TOLERANCES, pad_tables, random_block_tables, random_paged_batch, repage

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
ON_CUDA = DEVICE == "cuda"

NUM_HEADS = [(4, 4), (8, 2), (8, 1)]  # (query heads, KV heads): MHA, GQA, MQA
HEAD_SIZES = [24, 64, 128]  # 24 is not a power of two
BLOCK_SIZES = [1, 16, 32]
# (query_len, seq_len): whole prompt, chunk after a cached prefix, decode, decode of a lone token, long chunk
MIXED_BATCH = [(19, 19), (9, 42), (1, 33), (1, 1), (37, 50)]


def skip_unsupported(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not computed correctly by the Triton interpreter: CUDA only")


def mixed_batch(num_heads, head_size, block_size, dtype, lens=MIXED_BATCH, seed=0):
    q_lens, s_lens = [q for q, _ in lens], [s for _, s in lens]
    n_q, n_kv = num_heads
    return random_paged_batch(q_lens, s_lens, n_q, n_kv, head_size, block_size, dtype, DEVICE, seed=seed)


def run(batch, scale=None) -> torch.Tensor:
    return paged_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
        batch.max_query_len, scale=scale,
    )  # fmt: skip


def reference(batch, scale=None) -> torch.Tensor:
    return paged_prefill_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
        batch.max_query_len, scale=scale,
    )  # fmt: skip


@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_mixed_batch_matches_reference_fp32(num_heads, head_size, block_size):
    batch = mixed_batch(num_heads, head_size, block_size, torch.float32)
    torch.testing.assert_close(run(batch), reference(batch), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", [24, 128])
def test_prefill_mixed_batch_matches_reference_half(dtype, num_heads, head_size):
    skip_unsupported(dtype)
    batch = mixed_batch(num_heads, head_size, 16, dtype, seed=1)
    out = run(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(batch).float(), **TOLERANCES[dtype])


def test_prefill_custom_scale():
    batch = mixed_batch((8, 2), 64, 16, torch.float32, lens=[(30, 30), (4, 70)])
    torch.testing.assert_close(run(batch, scale=0.3), reference(batch, scale=0.3), **TOLERANCES[torch.float32])


def test_block_size_1_equals_block_size_16():
    batch16 = mixed_batch((8, 2), 64, 16, torch.float32)
    batch1 = repage(batch16, block_size=1)
    torch.testing.assert_close(run(batch1), run(batch16), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_equals_one_shot(dtype):
    """Two prompts written and attended in one step, or chunk by chunk (chunks of different sizes per step)."""
    n_q, n_kv, d, bs = 8, 2, 64, 16
    prompt_lens = [45, 29]
    chunks = [[13, 1, 20, 11], [16, 13]]  # per prompt; a sequence with no chunk left sits a step out
    gen = torch.Generator().manual_seed(3)
    tables = random_block_tables(prompt_lens, bs, 12, gen)
    q = [torch.randn(n, n_q, d, generator=gen).to(DEVICE, dtype) for n in prompt_lens]
    k = [torch.randn(n, n_kv, d, generator=gen).to(DEVICE, dtype) for n in prompt_lens]
    v = [torch.randn(n, n_kv, d, generator=gen).to(DEVICE, dtype) for n in prompt_lens]

    def step(k_cache, v_cache, spans):  # spans: per sequence index, (start, end) of this step's new tokens
        seqs = [i for i, (a, b) in enumerate(spans) if b > a]
        slots = [tables[i][p // bs] * bs + p % bs for i in seqs for p in range(*spans[i])]
        cat = lambda xs: torch.cat([xs[i][spans[i][0] : spans[i][1]] for i in seqs])  # noqa: E731
        kv_write(cat(k), cat(v), k_cache, v_cache, torch.tensor(slots, device=DEVICE))
        q_lens = [spans[i][1] - spans[i][0] for i in seqs]
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        out = paged_prefill_attention(
            cat(q), k_cache, v_cache, pad_tables([tables[i] for i in seqs], DEVICE),
            torch.tensor([spans[i][1] for i in seqs], dtype=torch.int32, device=DEVICE), cu, max(q_lens),
        )  # fmt: skip
        return dict(zip(seqs, out.split(q_lens)))

    pool = lambda: torch.zeros(12, bs, n_kv, d, dtype=dtype, device=DEVICE)  # noqa: E731
    one_shot = step(pool(), pool(), [(0, n) for n in prompt_lens])
    k_cache, v_cache = pool(), pool()
    pieces: list[list[torch.Tensor]] = [[], []]
    starts = [0, 0]
    for s in range(max(len(c) for c in chunks)):
        spans = []
        for i, c in enumerate(chunks):
            n = c[s] if s < len(c) else 0
            spans.append((starts[i], starts[i] + n))
            starts[i] += n
        for i, out in step(k_cache, v_cache, spans).items():
            pieces[i].append(out)
    for i in range(2):
        chunked = torch.cat(pieces[i])
        # chunks change the reduction order: equal within the dtype's tolerance (bits differ between CPUs)
        torch.testing.assert_close(chunked.float(), one_shot[i].float(), **TOLERANCES[dtype])


def test_rejects_bad_inputs():
    batch = mixed_batch((4, 4), 64, 16, torch.float32, lens=[(3, 5)])
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    with pytest.raises(KernelInputError, match="cu_seqlens_q"):
        paged_prefill_attention(batch.q, *args, batch.cu_seqlens_q[:1], 3)
    with pytest.raises(KernelInputError, match="head_dim"):
        paged_prefill_attention(batch.q[..., :32], *args, batch.cu_seqlens_q, 3)
    with pytest.raises(KernelInputError, match="contiguous"):
        paged_prefill_attention(batch.q.transpose(1, 2).contiguous().transpose(1, 2), *args, batch.cu_seqlens_q, 3)


@pytest.mark.skipif(not ON_CUDA, reason="a pool past 2**31 elements needs a GPU (and ~8 GB)")
def test_large_pool_int64_offsets():
    block_size, n_kv, d = 16, 1, 64
    num_blocks = 2**21 + 64  # 2**31 elements / (16 * 1 * 64) = 2**21 blocks
    batch = mixed_batch((4, 1), d, block_size, torch.float16, lens=[(20, 40), (70, 70)])
    k_cache = torch.zeros((num_blocks, block_size, n_kv, d), dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables = [[num_blocks - 1 - 8 * s - i for i in range(len(t))] for s, t in enumerate(batch.block_tables_list)]
    for old, new in zip(batch.block_tables_list, tables):
        k_cache[new] = batch.k_cache[old]
        v_cache[new] = batch.v_cache[old]
    out = paged_prefill_attention(
        batch.q, k_cache, v_cache, pad_tables(tables, DEVICE), batch.seq_lens, batch.cu_seqlens_q, 70
    )
    torch.testing.assert_close(out.float(), reference(batch).float(), **TOLERANCES[torch.float16])
