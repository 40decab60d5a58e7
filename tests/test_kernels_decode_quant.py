"""The dequantizing paged decode kernel (int8 K/V with per-token-and-head scales; fp8 e4m3 with one scale) against
its fp32 reference, on a vLLM-style grid. Under the Triton interpreter only fp32 and fp16 queries run; bf16 runs on
CUDA."""

import pytest
import torch
from workbench.kernels._common import INTERPRET, KernelInputError
from workbench.kernels.paged_decode import paged_decode_attention
from workbench.kernels.reference import paged_decode_attention_quantized_reference
from workbench.kernels.testing import TOLERANCES, random_paged_batch

from workbench.kv.cache import quantize_kv_fp8, quantize_kv_int8

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
ON_CUDA = DEVICE == "cuda"

NUM_HEADS = [(4, 4), (8, 2), (8, 1)]  # MHA, GQA, MQA
HEAD_SIZES = [24, 64]  # 24: padded to 32 and masked
BLOCK_SIZES = [1, 16]
SEQ_LENS = [1, 17, 40, 75]  # ending mid-block


def quantized_batch(num_heads, head_size, block_size, dtype, kv_dtype, seed=0):
    n_q, n_kv = num_heads
    batch = random_paged_batch([1] * len(SEQ_LENS), SEQ_LENS, n_q, n_kv, head_size, block_size, dtype, DEVICE,
                               seed=seed)  # fmt: skip
    if kv_dtype == "int8":
        (kq, ks), (vq, vs) = quantize_kv_int8(batch.k_cache), quantize_kv_int8(batch.v_cache)
    else:
        ks = vs = torch.tensor([0.5], device=DEVICE)
        kq, vq = quantize_kv_fp8(batch.k_cache, ks), quantize_kv_fp8(batch.v_cache, vs)
    return batch, kq, vq, ks, vs


def check(batch, kq, vq, ks, vs, dtype, **kwargs):
    args = (batch.q, kq, vq, batch.block_tables, batch.seq_lens)
    out = paged_decode_attention(*args, k_scale=ks, v_scale=vs, **kwargs)
    ref = paged_decode_attention_quantized_reference(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_int8_decode_matches_reference_fp32(num_heads, head_size, block_size, num_splits):
    check(*quantized_batch(num_heads, head_size, block_size, torch.float32, "int8"), torch.float32,
          num_splits=num_splits)  # fmt: skip


@pytest.mark.parametrize("num_heads", NUM_HEADS)
def test_int8_decode_matches_reference_fp16(num_heads):
    check(*quantized_batch(num_heads, 64, 16, torch.float16, "int8"), torch.float16, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_fp8_decode_matches_reference(dtype, num_heads, block_size):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not computed correctly by the Triton interpreter: CUDA only")
    check(*quantized_batch(num_heads, 24, block_size, dtype, "fp8"), dtype, num_splits=3)


def test_quantized_cache_input_errors():
    batch, kq, vq, ks, vs = quantized_batch((4, 2), 24, 16, torch.float32, "int8")
    args = (batch.q, kq, vq, batch.block_tables, batch.seq_lens)
    with pytest.raises(KernelInputError, match="caches must have q's dtype"):
        paged_decode_attention(*args)  # int8 without scales
    with pytest.raises(KernelInputError, match="both k_scale and v_scale"):
        paged_decode_attention(*args, k_scale=ks)
    with pytest.raises(KernelInputError, match="scales of shape"):
        paged_decode_attention(*args, k_scale=ks[:, :1], v_scale=vs[:, :1])
