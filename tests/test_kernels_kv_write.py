"""KV write: the Triton scatter into the paged pool equals the reference loop and index_copy (``KVCache.write``)."""

import pytest
import torch
from workbench.kernels._common import INTERPRET, KernelInputError
from workbench.kernels.kv_write import kv_write
from workbench.kernels.reference import kv_write_reference

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

NUM_KV_HEADS = [1, 2, 4]
HEAD_SIZES = [24, 64, 128]
BLOCK_SIZES = [1, 16, 32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # a copy: exact in every dtype, bf16 included


def pools(num_blocks, block_size, n_kv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, n_kv, d, generator=gen).to(DEVICE, dtype)
    return k, torch.randn(num_blocks, block_size, n_kv, d, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("n_kv", NUM_KV_HEADS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_reference(n_kv, head_size, block_size, dtype):
    num_blocks, num_tokens = 12, 11
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    k = torch.randn(num_tokens, n_kv, head_size, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, n_kv, head_size, generator=gen).to(DEVICE, dtype)
    kc, vc = pools(num_blocks, block_size, n_kv, head_size, dtype)
    kr, vr = kc.clone(), vc.clone()
    ke, ve = kc.clone(), vc.clone()
    kv_write(k, v, kc, vc, slots)
    kv_write_reference(k, v, kr, vr, slots)
    ke.view(-1, n_kv, head_size).index_copy_(0, slots, k)  # index_copy, as KVCache.write does: a peer
    ve.view(-1, n_kv, head_size).index_copy_(0, slots, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert torch.equal(kc, ke) and torch.equal(vc, ve)


def test_negative_slots_are_skipped_and_int32_slots_work():
    kc, vc = pools(4, 16, 2, 64, torch.float32)
    before_k, before_v = kc.clone(), vc.clone()
    k, v = torch.randn(5, 2, 64, device=DEVICE), torch.randn(5, 2, 64, device=DEVICE)
    slots = torch.tensor([3, -1, 40, -7, 63], dtype=torch.int32, device=DEVICE)
    kv_write(k, v, kc, vc, slots)
    kv_write_reference(k, v, before_k, before_v, slots)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)
    assert torch.equal(kc[0, 3], k[0]) and torch.equal(vc[3, 15], v[4])


def test_strided_inputs_from_a_fused_projection():
    n_kv, d, t = 2, 24, 7
    qkv = torch.randn(t, 4 * n_kv * d, device=DEVICE)  # (T, q | k | v) with 2 query heads per KV head
    k = qkv[:, 2 * n_kv * d : 3 * n_kv * d].view(t, n_kv, d)
    v = qkv[:, 3 * n_kv * d :].view(t, n_kv, d)
    assert not k.is_contiguous()
    kc, vc = pools(3, 16, n_kv, d, torch.float32)
    kr, vr = kc.clone(), vc.clone()
    slots = torch.tensor([0, 5, 17, 18, 30, 47, 2], device=DEVICE)
    kv_write(k, v, kc, vc, slots)
    kv_write_reference(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_rejects_bad_inputs():
    kc, vc = pools(2, 16, 2, 64, torch.float32)
    k = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(KernelInputError, match="dtype"):
        kv_write(k.half(), k.half(), kc, vc, slots)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        kv_write(k, k, kc, vc, slots[:2])
    with pytest.raises(KernelInputError, match="heads"):
        kv_write(k[:, :1], k[:, :1], kc, vc, slots)
