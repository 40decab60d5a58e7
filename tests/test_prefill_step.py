"""The compiled ragged step (``EngineConfig.compile_prefill``): the engine's tokens against the eager engine's and
transformers' on chunked prefills mixed with decodes, one ragged step's hidden states and cache writes against the
eager ``Transformer.forward`` within the fp32 tolerance, one graph per token-count range (not per layer or
per token count), and its configuration errors."""

import pytest
import torch
from workbench.kernels.testing import TOLERANCES

from workbench import bench
from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.prefill_step import PrefillStep, num_compiled_graphs
from workbench.errors import ConfigError
from workbench.model import load_checkpoint
from workbench.model.attention import build_metadata
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams

FP32 = TOLERANCES[torch.float32]
# chunks of 8 in a budget of 16: the long prompts are prefilled in chunks that start mid-prompt, beside decodes
CONFIG = dict(policy="chunked", token_budget=16, chunk_size=8, block_size=4, max_num_seqs=4, max_model_len=64)
PROMPTS = [list(range(3, 24)), [7, 8, 9, 10, 11], [200 - i for i in range(13)], [40 + 3 * i for i in range(30)]]
NEW = [6, 9, 4, 7]


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint):
    """One engine with compiled ragged steps (tiny-gqa, every linear packed: its matrices are below
    ``PACKED_MIN_WEIGHT``, so the threshold is 0 while the engine packs them), warmed up: (engine, graphs the warm-up
    compiled)."""
    from workbench.model import packed

    # dynamo keeps compiled graphs on the compiled function's code, across engines: an earlier test in this process
    # that compiled the same ragged step (reports/PERFORMANCE.md's `bench compiled`, run by
    # tests/test_readme_commands.py) would leave this warm-up nothing to compile
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed, "PACKED_MIN_WEIGHT", 0)
        engine = Engine(load_checkpoint(tiny_checkpoint("tiny-gqa")), EngineConfig(**CONFIG, compile_prefill=True))
    assert packed.count_packed(engine.model) == 2 * 4 + 1
    before = num_compiled_graphs()
    engine.prefill.warmup(engine.scheduler.config.token_budget)
    return engine, num_compiled_graphs() - before


def test_warmup_compiles_one_graph_per_token_count_range(compiled):
    """Token counts 1, 2 and, where packing starts at 4 rows (an Intel CPU), 4: dynamo specialises 1, the packed
    linears' first row count splits the rest; one graph each for the whole step, attention inside it as an opaque
    operator."""
    from workbench.model.packed import PACKED_MIN_ROWS

    engine, graphs = compiled
    want = [1, 2, 4] if PACKED_MIN_ROWS == 4 else [1, 2]
    assert engine.model.config.num_layers == 2 and engine.prefill.compiled
    assert sorted(engine.prefill.compile_s) == want and all(t > 0 for t in engine.prefill.compile_s.values())
    assert graphs == len(want)


def test_compiled_prefill_engine_gives_eager_and_hf_tokens(tiny_checkpoint, compiled):
    engine, _ = compiled
    path = tiny_checkpoint("tiny-gqa")
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in NEW]
    eager = Engine(load_checkpoint(path), EngineConfig(**CONFIG))
    want = [r.tokens for r in eager.generate(PROMPTS, params).requests]
    plans = []
    engine.on_step = lambda plan, rec: plans.append(plan)
    graphs, steps = num_compiled_graphs(), engine.prefill.steps
    try:
        got = [r.tokens for r in engine.generate(PROMPTS, params).requests]
    finally:
        engine.on_step = None
    assert got == want
    hf = bench.load_hf_model(path, "fp32", torch.device("cpu"))
    assert got == [bench.hf_generate(hf, [p], n)[0] for p, n in zip(PROMPTS, NEW)]
    ragged = [p for p in plans if not p.is_pure_decode]
    assert engine.prefill.steps - steps == len(ragged)  # every ragged step went through the executor
    mixed = [p for p in ragged if any(c.num_new_tokens == 1 and c.start > 0 for c in p.chunks)]
    assert mixed and any(c.start > 0 and c.num_new_tokens > 1 for p in ragged for c in p.chunks)
    assert len({sum(c.num_new_tokens for c in p.chunks) for p in ragged}) > 2  # several token counts
    assert num_compiled_graphs() == graphs  # nothing compiled after the warm-up


def test_compiled_ragged_step_matches_eager_forward(compiled):
    """Three sequences in one step (a prompt's second chunk, a decode, a whole prompt), then steps of 2 and 1 tokens:
    hidden states and the pool within fp32 tolerance of the eager forward, and no graph compiled."""
    engine, _ = compiled
    model, cache, step = engine.model, engine.cache, engine.prefill
    gen = torch.Generator().manual_seed(3)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    ref_k, ref_v = cache.k.clone(), cache.v.clone()
    steps = [
        ([5, 1, 7], [12, 9, 7], [[9, 2, 11], [4, 0, 6], [1, 3]]),
        ([1, 1], [6, 3], [[8, 5], [10]]),
        ([1], [2], [[7]]),
    ]
    graphs = num_compiled_graphs()
    for query_lens, seq_lens, tables in steps:
        meta = build_metadata(query_lens, seq_lens, tables, cache.block_size)
        ids = torch.randint(0, model.config.vocab_size, (sum(query_lens),), generator=gen)
        got = step.run(ids, meta)
        got_k, got_v = cache.k.clone(), cache.v.clone()
        cache.k.copy_(ref_k)
        cache.v.copy_(ref_v)
        want = model.forward(ids, meta, cache, engine.backend)
        torch.testing.assert_close(got, want, **FP32)
        torch.testing.assert_close(got_k, cache.k, **FP32)
        torch.testing.assert_close(got_v, cache.v, **FP32)
        ref_k, ref_v = cache.k.clone(), cache.v.clone()
    assert num_compiled_graphs() == graphs


def test_compile_prefill_is_validated():
    with pytest.raises(ConfigError, match="compile_prefill"):
        EngineConfig(compile_prefill="yes")
    with pytest.raises(ConfigError, match="compile_prefill"):
        EngineConfig(compile_prefill=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="compile_prefill"):
        EngineConfig(compile_prefill=True, device="cuda")


def test_eager_prefill_step_is_the_default():
    model = Transformer.from_config(ModelConfig.resolve("tiny-gqa"), seed=1)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32))
    assert isinstance(engine.prefill, PrefillStep) and not engine.prefill.compiled
    assert engine.prefill.warmup() == {}
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.prefill.steps == 1 and engine.prefill.compile_s == {}


@pytest.mark.parametrize("preset, kv_cache_dtype", [("tiny-deepseek-v3", "auto"), ("tiny-qwen2-moe", "int8")])
def test_compiled_ragged_steps_of_moe_and_mla_give_the_eager_tokens(tiny_checkpoint, preset, kv_cache_dtype):
    """MoE layers (the expert loop an opaque operator), DeepSeek-V3's MLA (V a view of the latent K entry) and an int8
    pool (a dequantizing view per layer) in the one compiled graph of a ragged step: the eager engine's tokens with
    the same settings; over the int8 pool the compiled decode step beside it too."""
    model = load_checkpoint(tiny_checkpoint(preset))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in NEW]
    cfg = dict(CONFIG, kv_cache_dtype=kv_cache_dtype)
    want = [r.tokens for r in Engine(model, EngineConfig(**cfg)).generate(PROMPTS, params).requests]
    decode = kv_cache_dtype == "int8"  # the compiled decode too, once (its compilation is the test's cost)
    engine = Engine(model, EngineConfig(**cfg, compile_prefill=True, compile_decode=decode))
    graphs = num_compiled_graphs()
    assert [r.tokens for r in engine.generate(PROMPTS, params).requests] == want
    assert num_compiled_graphs() > graphs and engine.prefill.compile_s  # the ragged steps did run compiled
    assert bool(engine.decode.compiled_sizes) == decode  # and the pure decodes, where asked


def test_compiled_ragged_steps_of_two_engines_in_two_threads_keep_to_their_own_pools(compiled):
    """The operator finds the step in flight per thread: two engines over one model, generating at once from two
    threads (the graph's kernels release the GIL, so their steps interleave), give the tokens each gives alone."""
    import threading

    engine, _ = compiled
    other = Engine(engine.model, EngineConfig(**CONFIG, compile_prefill=True))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in NEW]
    prompts = {engine: PROMPTS, other: [list(reversed(p)) for p in PROMPTS]}
    alone = {e: [r.tokens for r in e.generate(ps, params).requests] for e, ps in prompts.items()}
    together: dict = {}

    def run(e: Engine) -> None:
        for _ in range(3):
            together.setdefault(e, []).append([r.tokens for r in e.generate(prompts[e], params).requests])

    threads = [threading.Thread(target=run, args=(e,)) for e in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert alone[engine] != alone[other]
    assert all(together[e] == [alone[e]] * 3 for e in prompts)
