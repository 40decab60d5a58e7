"""The Triton attention backend against the PyTorch one: the same attention, the same cache, the same tokens.

Checked three ways: the backend alone on random q/k/v (a ragged step from ``build_metadata``, decode-only and
mixed; a pure decode from ``build_decode_metadata``); a tiny ``Transformer``'s prefill and decode logits; and
greedy generation through the engine (chunked prefill mixing prefill chunks with decodes, and prefix-cache hits),
token for token.
"""

import pytest
import torch
from workbench.kernels._common import INTERPRET
from workbench.kernels.reference import kv_write_reference
from workbench.kernels.testing import TOLERANCES, random_block_tables

from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.kv.cache import KVCache
from workbench.model.attention import TorchAttentionBackend, build_decode_metadata, build_metadata
from workbench.model.transformer import Transformer
from workbench.model.triton_backend import TritonAttentionBackend
from workbench.request import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

# (query_lens, seq_lens): decode-only through the ragged path, then a mixed batch
STEPS = [
    ([1, 1, 1, 1, 1], [1, 9, 16, 33, 20]),
    ([12, 1, 5, 1], [12, 30, 21, 1]),
]


@pytest.mark.parametrize("num_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("step", STEPS, ids=["decode", "mixed"])
def test_backend_matches_torch_backend(num_heads, step):
    (n_q, n_kv), d, bs = num_heads, 24, 16
    q_lens, s_lens = step
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // bs) for s in s_lens) + 2
    tables = random_block_tables(s_lens, bs, num_blocks, gen)
    meta = build_metadata(q_lens, s_lens, tables, bs, DEVICE)
    t = sum(q_lens)
    q = torch.randn(t, n_q, d, generator=gen).to(DEVICE)
    k = torch.randn(t, n_kv, d, generator=gen).to(DEVICE)
    v = torch.randn(t, n_kv, d, generator=gen).to(DEVICE)
    k_cache = torch.randn(num_blocks, bs, n_kv, d, generator=gen).to(DEVICE)  # the cached prefixes (and junk)
    v_cache = torch.randn(num_blocks, bs, n_kv, d, generator=gen).to(DEVICE)
    kv_write_reference(k, v, k_cache, v_cache, meta.slot_mapping)  # the model writes before the backend attends
    out_triton = TritonAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    out_torch = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out_triton, out_torch, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_decode_matches_torch_backend(preset):
    """A pure decode: Triton writes the new K/V and reads them from the pool, torch attends to them directly."""
    cfg = ModelConfig.from_name(preset)
    seq_lens, bs = [1, 9, 16, 33, 20], 16
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 2
    tables = random_block_tables(seq_lens, bs, num_blocks, gen)
    meta = build_decode_metadata(seq_lens, tables, bs, DEVICE)
    caches = [KVCache(cfg, num_blocks, bs, device=DEVICE) for _ in range(2)]
    # drawn on the CPU and copied: a CUDA tensor's normal_ refuses a CPU generator (the H200 run of gpu_check)
    caches[0].k.copy_(torch.randn(caches[0].k.shape, generator=gen))
    caches[0].v.copy_(torch.randn(caches[0].v.shape, generator=gen))
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    b, n_kv, d = len(seq_lens), cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(b, cfg.num_heads, d, generator=gen).to(DEVICE)
    k, v = torch.randn(b, n_kv, d, generator=gen).to(DEVICE), torch.randn(b, n_kv, d, generator=gen).to(DEVICE)
    out_triton = TritonAttentionBackend().decode(1, q, k, v, caches[0], meta, 0.2)
    out_torch = TorchAttentionBackend().decode(1, q, k, v, caches[1], meta, 0.2)
    caches[1].write(meta.slot_mapping, k, v, layer=1)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    torch.testing.assert_close(out_triton, out_torch, **TOLERANCES[torch.float32])


def tiny_model() -> Transformer:
    cfg = ModelConfig.from_name("tiny-gqa")
    return Transformer.from_config(cfg, dtype=torch.float32, device=DEVICE, seed=0)


PROMPTS = [[1, 17, 33, 250, 4, 99, 100, 3, 7, 7, 8, 9, 10, 11, 12, 200, 5, 6, 7], [4, 4, 4], [42]]


def test_tiny_transformer_same_logits_and_greedy_tokens():
    models = {"torch": tiny_model(), "triton": tiny_model()}
    backends = {"torch": TorchAttentionBackend(), "triton": TritonAttentionBackend(num_splits=2)}
    caches = {name: m.new_cache(len(PROMPTS), 32) for name, m in models.items()}
    slots = [2, 0, 1]
    logits = {name: m.prefill(PROMPTS, caches[name], slots, backends[name]) for name, m in models.items()}
    for _ in range(6):
        torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
        tokens = {name: lg.argmax(-1).tolist() for name, lg in logits.items()}
        assert tokens["triton"] == tokens["torch"]
        logits = {name: m.decode(tokens[name], caches[name], slots, backends[name]) for name, m in models.items()}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_engine_greedy_tokens_identical(prefix_caching):
    shared = list(range(3, 40))  # 37 tokens: two full blocks of 16 shared by the first two prompts
    prompts = [shared + [200, 201], shared + [7], list(range(100, 140))]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        cfg = EngineConfig(
            policy="chunked", block_size=16, num_blocks=24, max_num_seqs=4, token_budget=24, chunk_size=16,
            enable_prefix_caching=prefix_caching, attention_backend=backend, dtype="fp32", device=DEVICE,
        )  # fmt: skip
        engine = Engine(Transformer.from_config(ModelConfig.from_name("tiny-gqa"), device=DEVICE, seed=0), cfg)
        assert engine.backend.name == backend
        # the first prompt alone, then the rest: with prefix caching the second finds the shared blocks cached
        requests = engine.generate(prompts[:1], params).requests + engine.generate(prompts[1:], params).requests
        results[backend] = [r.tokens for r in requests]
        # the run exercised what the backend must serve: steps mixing prefill chunks with decodes, prefix hits
        assert any(s.num_prefill_tokens > 0 and s.num_decode_tokens > 0 for s in engine.step_log.steps)
        assert (requests[1].num_cached_tokens > 0) == prefix_caching
    assert results["triton"] == results["torch"]
    assert all(len(t) == 5 for t in results["torch"])
