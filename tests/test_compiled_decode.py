"""The compiled decode step: its cache-reading attention against the reference, its eager form against the model's
``forward``, and the compiled engine's greedy tokens against HF transformers' (MHA, GQA and MQA tiny models)."""

import pytest
import torch

from workbench import bench
from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.sequence import SamplingParams
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model import load_checkpoint
from workbench.model.attention import build_metadata, gathered_decode_attention, reference_attention, write_kv
from workbench.model.transformer import Transformer

NEW = 12


def _hf_tokens(path, prompts, n):
    """HF ``generate``, one prompt at a time, with EOS turned off (``min_new_tokens`` would mask the EOS logit)."""
    hf = bench.load_hf_model(path, "fp32", torch.device("cpu"))
    return [bench.hf_generate(hf, [p], n)[0] for p in prompts]


def test_gathered_attention_equals_the_reference_after_a_write_and_writes_nothing():
    gen = torch.Generator().manual_seed(0)
    n_heads, n_kv, d, bs, n_blocks = 6, 2, 16, 4, 12
    k_cache = torch.randn(n_blocks, bs, n_kv, d, generator=gen)
    v_cache = torch.randn(n_blocks, bs, n_kv, d, generator=gen)
    seq_lens = [9, 1, 14]  # after this step: 8, 0 and 13 cached keys plus the new token
    tables = [[7, 2, 5], [0], [1, 3, 4, 6]]
    q = torch.randn(3, n_heads, d, generator=gen)
    k, v = torch.randn(3, n_kv, d, generator=gen), torch.randn(3, n_kv, d, generator=gen)
    width = 16  # cached-key columns, padded past every sequence's length
    key_slots = torch.tensor([[t[j // bs] * bs + j % bs if j // bs < len(t) else 0 for j in range(width)]
                              for t in tables])  # fmt: skip
    key_mask = torch.ones(3, 1, 1, width + 1, dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        key_mask[b, 0, 0, n - 1 : width] = False
    before_k, before_v = k_cache.clone(), v_cache.clone()
    got = gathered_decode_attention(
        q, k, v, k_cache.view(-1, n_kv, d), v_cache.view(-1, n_kv, d), key_slots, key_mask, d**-0.5
    )
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    meta = build_metadata([1, 1, 1], seq_lens, tables, bs)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    expected = reference_attention(q, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_decode_gathered_equals_forward_with_a_write(preset):
    """The eager form of the compiled function: same logits as ``forward``, and the K/V ``forward`` writes."""
    model = Transformer.from_config(ModelConfig.resolve(preset), seed=1)
    cfg, bs = model.config, 4
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(cfg, num_blocks=10, block_size=bs)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    tables, seq_lens = [[3, 8, 1], [6, 0]], [11, 5]
    tokens = torch.tensor([17, 200])
    pos = torch.tensor([n - 1 for n in seq_lens])
    width = 16
    key_slots = torch.tensor([[t[min(j // bs, len(t) - 1)] * bs + j % bs for j in range(width)] for t in tables])
    key_mask = torch.ones(2, 1, 1, width + 1, dtype=torch.bool)
    key_mask[:, 0, 0, :width] = torch.arange(width)[None, :] < pos[:, None]
    with torch.inference_mode():
        logits, k_new, v_new = model.decode_gathered(tokens, pos, key_slots, key_mask, cache.k, cache.v)
        meta = build_metadata([1, 1], seq_lens, tables, bs)
        expected = model.compute_logits(model.forward(tokens, meta, cache))  # writes the new K/V
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    slots = meta.slot_mapping
    flat_k = cache.k.view(cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
    flat_v = cache.v.view(cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
    torch.testing.assert_close(k_new, flat_k[:, slots], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_new, flat_v[:, slots], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("preset", "block_size"), [("tiny-gqa", 16), ("tiny-gqa", 1), ("tiny-mqa", 16)])
def test_compiled_engine_gives_hfs_greedy_tokens(tiny_checkpoint, preset, block_size):
    path = tiny_checkpoint(preset)
    prompts = [[5, 6, 7], list(range(10, 43)), [99] * 17, [1]]
    expected = _hf_tokens(path, prompts, NEW)
    engine = Engine(load_checkpoint(path), EngineConfig(block_size=block_size, max_num_seqs=3, max_model_len=64,
                                                        compile_decode=True))  # fmt: skip
    got = [r.tokens for r in engine.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True)).requests]
    assert got == expected
    assert engine.runner.compiled_decode.batch_sizes  # the compiled step did serve decode steps
    assert engine.runner.compiled_decode.batch_sizes <= {1, 2, 3}


def test_compile_decode_is_validated():
    with pytest.raises(ConfigError, match="compile_decode"):
        EngineConfig(compile_decode=True, attention_backend="triton")
    with pytest.raises(ConfigError, match="compile_decode"):
        EngineConfig(compile_decode="yes")


def test_cli_generate_compile_decode_gives_the_same_tokens(capsys):
    import json

    from workbench.cli import main

    args = ["generate", "--model", "tiny-mha", "--prompt-ids", "5,6,7", "--prompt-ids", "40,41", "--max-new-tokens",
            "6", "--ignore-eos", "--device", "cpu", "--json"]  # fmt: skip
    assert main(args) == 0
    eager = [r["tokens"] for r in json.loads(capsys.readouterr().out)["requests"]]
    assert main([*args, "--compile-decode"]) == 0
    compiled = [r["tokens"] for r in json.loads(capsys.readouterr().out)["requests"]]
    assert compiled == eager and len(eager[0]) == 6
