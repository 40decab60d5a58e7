"""The one decode step: its attention against the fp32 reference, the model's decode step against ``forward``,
the cache writer against the reference loop, and every executor mode's greedy tokens against HF transformers'
(eager, compiled, and the CUDA-graph path's static buffers run eagerly on the CPU; MHA, GQA and MQA tiny models)."""

import pytest
import torch
from workbench.kernels.reference import kv_write_reference, paged_decode_attention_reference
from workbench.kernels.testing import TOLERANCES

from workbench import bench
from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.decode_step import DecodeStep, batch_buckets, compile_buckets
from workbench.engine.engine import Engine
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model import load_checkpoint
from workbench.model.attention import TorchAttentionBackend, build_decode_metadata, build_metadata
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams

NEW = 12
PROMPTS = [[5, 6, 7], list(range(10, 43)), [99] * 17, [1]]
FP32 = TOLERANCES[torch.float32]


def _hf_tokens(path, prompts, n):
    """HF ``generate``, one prompt at a time, with EOS turned off (``min_new_tokens`` would mask the EOS logit)."""
    hf = bench.load_hf_model(path, "fp32", torch.device("cpu"))
    return [bench.hf_generate(hf, [p], n)[0] for p in prompts]


def _random_cache(preset, num_blocks, block_size, seed):
    cfg = ModelConfig.resolve(preset)
    cache = KVCache(cfg, num_blocks=num_blocks, block_size=block_size)
    gen = torch.Generator().manual_seed(seed)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    return cfg, cache


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert compile_buckets(1) == [1]
    assert compile_buckets(6) == [1, 2, 4, 6]
    assert compile_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert compile_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]


@pytest.mark.parametrize("layer", [None, 1])
def test_cache_write_equals_the_reference_loop(layer):
    cfg, cache = _random_cache("tiny-gqa", num_blocks=6, block_size=4, seed=0)
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([7, 0, 23, 12])
    shape = (4, cfg.num_kv_heads, cfg.head_dim) if layer is not None else (cfg.num_layers, 4, cfg.num_kv_heads,
                                                                            cfg.head_dim)  # fmt: skip
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    want_k, want_v = cache.k.clone(), cache.v.clone()
    for i in range(cfg.num_layers) if layer is None else [layer]:
        kv_write_reference(k[i] if layer is None else k, v[i] if layer is None else v, want_k[i], want_v[i], slots)
    cache.write(slots, k, v, layer=layer)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)


def test_torch_decode_attention_equals_the_reference_after_a_write_and_writes_nothing():
    gen = torch.Generator().manual_seed(0)
    cfg, cache = _random_cache("tiny-gqa", num_blocks=12, block_size=4, seed=3)
    n_heads, n_kv, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4
    seq_lens = [9, 1, 14]  # after this step: 8, 0 and 13 cached keys plus the new token
    tables = [[7, 2, 5], [0], [1, 3, 4, 6]]
    q = torch.randn(3, n_heads, d, generator=gen)
    k, v = torch.randn(3, n_kv, d, generator=gen), torch.randn(3, n_kv, d, generator=gen)
    meta = build_decode_metadata(seq_lens, tables, bs)
    assert meta.key_slots.shape == (3, 16) and meta.key_mask.shape == (3, 1, 1, 17)  # 13 cached keys, padded to 16
    before_k, before_v = cache.k.clone(), cache.v.clone()
    got = TorchAttentionBackend().decode(1, q, k, v, cache, meta, d**-0.5)
    assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)
    cache.write(meta.slot_mapping, k, v, layer=1)
    expected = paged_decode_attention_reference(q, cache.k[1], cache.v[1], meta.block_tables, meta.seq_lens, d**-0.5)
    torch.testing.assert_close(got, expected, **FP32)


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_decode_step_equals_forward_with_a_write(preset):
    """The model's one decode step: same logits as the ragged ``forward``, and the K/V ``forward`` writes."""
    model = Transformer.from_config(ModelConfig.resolve(preset), seed=1)
    cfg, cache = _random_cache(preset, num_blocks=10, block_size=4, seed=2)
    tables, seq_lens = [[3, 8, 1], [6, 0]], [11, 5]
    tokens = torch.tensor([17, 200])
    with torch.inference_mode():
        logits, k_new, v_new = model.decode_step(tokens, build_decode_metadata(seq_lens, tables, 4), cache,
                                                 write=False)  # fmt: skip
        meta = build_metadata([1, 1], seq_lens, tables, 4)
        expected = model.compute_logits(model.forward(tokens, meta, cache))  # writes the new K/V
    torch.testing.assert_close(logits, expected, **FP32)
    flat_k = cache.k.view(cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
    flat_v = cache.v.view(cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
    torch.testing.assert_close(k_new, flat_k[:, meta.slot_mapping], **FP32)
    torch.testing.assert_close(v_new, flat_v[:, meta.slot_mapping], **FP32)


def test_the_compiled_decode_graph_is_one_aot_autograds_cache_keeps():
    """The step's graph, traced as ``DecodeStep`` compiles it (under inference mode, ``write=False``), passes AOT
    autograd's own cacheability check: a graph that enters inference mode itself (the decorated ``compute_logits``
    called inside the step did) is one its on-disk cache bypasses, so every new process traced and lowered each
    decode bucket again (the 4 bypasses of a second ``bench offline``'s warm-up)."""
    from torch._functorch._aot_autograd.autograd_cache import check_cacheable

    graphs = []

    def keep(gm, example_inputs):  # a dynamo backend that only keeps the graph
        graphs.append(gm)
        return gm.forward

    model = Transformer.from_config(ModelConfig.resolve("tiny-gqa"), seed=1)
    _, cache = _random_cache("tiny-gqa", num_blocks=10, block_size=4, seed=2)
    step = torch.compile(model.decode_step, backend=keep, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        step(torch.tensor([17, 200]), build_decode_metadata([11, 5], [[3, 8, 1], [6, 0]], 4), cache, write=False)
    assert len(graphs) == 1
    check_cacheable(graphs[0])  # raises BypassAOTAutogradCache with the reason


# tiny-gqa at block size 4 with padded buckets: test_warmup_compiles_every_bucket_and_padded_batches_give_eager_tokens
@pytest.mark.parametrize(("preset", "block_size"), [("tiny-gqa", 1), ("tiny-mqa", 16)])
def test_compiled_engine_gives_hfs_greedy_tokens(tiny_checkpoint, preset, block_size):
    path = tiny_checkpoint(preset)
    expected = _hf_tokens(path, PROMPTS, NEW)
    engine = Engine(load_checkpoint(path), EngineConfig(block_size=block_size, max_num_seqs=3, max_model_len=64,
                                                        compile_decode=True))  # fmt: skip
    got = [r.tokens for r in engine.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True)).requests]
    assert got == expected
    assert engine.decode.mode == "compile" and engine.decode.compiled_sizes  # the compiled step served decodes
    assert engine.decode.compiled_sizes <= {1, 2, 3}


@pytest.fixture(scope="module")
def compiled_engine(tiny_checkpoint):
    """One compiled engine for the bucket tests: tiny-gqa, up to 4 sequences (buckets 1, 2, 4), warmed up."""
    engine = Engine(load_checkpoint(tiny_checkpoint("tiny-gqa")),
                    EngineConfig(block_size=4, max_num_seqs=4, max_model_len=64, compile_decode=True))  # fmt: skip
    engine.decode.warmup()
    return engine


def test_warmup_compiles_every_bucket_and_padded_batches_give_eager_tokens(tiny_checkpoint, compiled_engine):
    """Four requests of different lengths: decode batches of 4, 3 (padded to 4), 2 and 1, all through the graphs
    the warm-up compiled; the tokens are the eager engine's and transformers' (one prompt at a time)."""
    engine = compiled_engine
    assert engine.decode.buckets == [1, 2, 4] and sorted(engine.decode.compile_s) == [1, 2, 4]
    assert all(t > 0 for t in engine.decode.compile_s.values())
    lens = [9, 3, 6, 1]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    path = tiny_checkpoint("tiny-gqa")
    eager = Engine(load_checkpoint(path), EngineConfig(block_size=4, max_num_seqs=4, max_model_len=64))
    want = [r.tokens for r in eager.generate(PROMPTS, params).requests]
    steps = engine.decode.steps
    got = [r.tokens for r in engine.generate(PROMPTS, params).requests]
    assert got == want
    hf = bench.load_hf_model(path, "fp32", torch.device("cpu"))
    assert got == [bench.hf_generate(hf, [p], n)[0] for p, n in zip(PROMPTS, lens)]
    assert engine.decode.steps > steps and sorted(engine.decode.compile_s) == [1, 2, 4]  # no new compilation


def test_padding_rows_change_neither_the_real_rows_nor_other_slots(compiled_engine):
    """A batch of 3 runs the bucket of 4: logits within fp32 tolerance of the eager step on the 3 rows alone, and
    the pool afterwards as the eager write of the 3 rows leaves it."""
    step, cache, model = compiled_engine.decode, compiled_engine.cache, compiled_engine.model
    gen = torch.Generator().manual_seed(5)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    ref = KVCache(model.config, num_blocks=cache.num_blocks, block_size=cache.block_size)
    ref.k.copy_(cache.k)
    ref.v.copy_(cache.v)
    tables, seq_lens, tokens = [[3, 8, 1], [6, 0], [2, 5, 7, 9]], [11, 5, 14], [17, 200, 9]
    with torch.inference_mode():
        expected = model.decode_step(torch.tensor(tokens), build_decode_metadata(seq_lens, tables, 4), ref)[0]
    assert step.padded_batch(3) == 4
    got = step.run(tokens, seq_lens, tables)
    assert got.shape == expected.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(got, expected, **FP32)
    torch.testing.assert_close(cache.k, ref.k, **FP32)
    torch.testing.assert_close(cache.v, ref.v, **FP32)
    assert sorted(step.compile_s) == [1, 2, 4]


@pytest.mark.parametrize(("mode", "block_size"), [("eager", 16), ("graph", 1), ("graph", 16)])
def test_decode_modes_give_hfs_tokens(tiny_checkpoint, mode, block_size):
    """Eager, and the CUDA-graph path (one static buffer set, batches padded to buckets) run eagerly on the CPU."""
    path = tiny_checkpoint("tiny-gqa")
    expected = _hf_tokens(path, PROMPTS, 9)
    engine = Engine(load_checkpoint(path), EngineConfig(block_size=block_size, max_num_seqs=3, max_model_len=64))
    engine.runner.decode = engine.decode = DecodeStep(engine.model, engine.cache, engine.backend, mode, 3, 64,
                                                      capture=False)  # fmt: skip
    got = [r.tokens for r in engine.generate(PROMPTS, SamplingParams(max_tokens=9, ignore_eos=True)).requests]
    assert got == expected
    assert engine.decode.steps > 0  # the executor did serve decode steps


def test_graph_mode_pads_a_batch_to_its_bucket_without_touching_other_slots():
    model = Transformer.from_config(ModelConfig.resolve("tiny-gqa"), seed=1)
    cfg, cache = _random_cache("tiny-gqa", num_blocks=10, block_size=4, seed=2)
    step = DecodeStep(model, cache, TorchAttentionBackend(), "graph", max_batch=8, max_model_len=40, capture=False)
    assert step.padded_batch(3) == 4 and step.padded_batch(5) == 8
    tables, seq_lens, tokens = [[3, 8, 1], [6, 0], [2]], [11, 5, 2], [17, 200, 9]
    eager = cache.k.clone(), cache.v.clone()
    ref = KVCache(cfg, num_blocks=10, block_size=4)
    ref.k.copy_(eager[0])
    ref.v.copy_(eager[1])
    with torch.inference_mode():
        expected = model.decode_step(torch.tensor(tokens), build_decode_metadata(seq_lens, tables, 4), ref)[0]
    got = step.run(tokens, seq_lens, tables)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, **FP32)
    torch.testing.assert_close(cache.k, ref.k, **FP32)  # the padding row wrote row 0's K/V to row 0's slot only
    torch.testing.assert_close(cache.v, ref.v, **FP32)


def test_the_engine_leaves_its_model_alone():
    model = Transformer.from_config(ModelConfig.resolve("tiny-gqa"), seed=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = set(vars(model))
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert set(vars(model)) == before and not hasattr(model, "attn_backend")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_decode_modes_are_validated():
    with pytest.raises(ConfigError, match="compile_decode"):
        EngineConfig(compile_decode=True, attention_backend="triton")
    with pytest.raises(ConfigError, match="compile_decode"):
        EngineConfig(compile_decode="yes")
    model = Transformer.from_config(ModelConfig.resolve("tiny-gqa"), seed=1)
    cache = KVCache(model.config, num_blocks=4, block_size=4)
    with pytest.raises(ConfigError, match="decode mode"):
        DecodeStep(model, cache, TorchAttentionBackend(), "fast", 2, 16)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA graphs"):
            DecodeStep(model, cache, TorchAttentionBackend(), "graph", 2, 16, capture=True)


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


def test_decodes_past_the_gather_limit_take_the_ragged_path(tiny_checkpoint, monkeypatch):
    """With the limit at 32 key slots, a batch of 3 (width 16 or more each) no longer gathers: the ragged
    ``forward`` serves it, with transformers' tokens all the same."""
    import workbench.engine.decode_step as decode_step

    path = tiny_checkpoint("tiny-gqa")
    expected = _hf_tokens(path, PROMPTS, 6)
    monkeypatch.setattr(decode_step, "MAX_GATHER_KEY_SLOTS", 32)
    engine = Engine(load_checkpoint(path), EngineConfig(max_num_seqs=3, max_model_len=64, attention_backend="torch"))
    assert not engine.decode.supports([40, 20, 18]) and engine.decode.supports([9])
    got = [r.tokens for r in engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True)).requests]
    assert got == expected
