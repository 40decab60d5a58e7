"""The engine with tensor_parallel_size=2 (two gloo ranks, fp32): transformers' greedy tokens for every tiny
architecture, and for a paged pool, chunked prefill, prefix caching and a pool small enough to preempt.

One pair of ranks serves the whole module: each test asks the workers to load its checkpoint and builds an engine
on them (spawned ranks are slow to start on 2 cores). The fault tests come first and start groups of their own,
since a process holds one torch.distributed group at a time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

from tests.conftest import TINY_PRESETS, hf_greedy_tokens
from workbench.dist.group import WorkerError
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.executor import start_workers
from workbench.errors import ConfigError
from workbench.request import SamplingParams

MAX_TOKENS = 8
rng = random.Random(1)
PROMPTS = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 33, 17, 64, 1, 40)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def hf_greedy(path, prompts):
    return hf_greedy_tokens(path, prompts, MAX_TOKENS)


def test_a_killed_worker_makes_the_engine_raise_and_leaves_no_process(tiny_checkpoint):
    engine = Engine.from_model(str(tiny_checkpoint("tiny-gqa")), EngineConfig(device="cpu", tensor_parallel_size=2))
    try:
        assert len(engine.generate(PROMPTS[:2], GREEDY).requests) == 2
        worker = engine.workers._workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1"):
            engine.generate(PROMPTS[:2], GREEDY)
        assert time.monotonic() - started < 30
        assert not worker.is_alive()
    finally:
        engine.shutdown()


def test_a_stopped_worker_ends_the_run_within_15_s_naming_the_rank(tiny_checkpoint, monkeypatch):
    """Issue 35, case 11: a worker stopped by SIGSTOP (as a hung process looks) is alive to ``is_alive()``; the
    liveness watchdog (default bound) kills it so the driver's collective fails, and the error names the rank."""
    monkeypatch.delenv("WORKBENCH_LIVENESS_TIMEOUT", raising=False)
    engine = Engine.from_model(str(tiny_checkpoint("tiny-gqa")), EngineConfig(device="cpu", tensor_parallel_size=2))
    try:
        assert len(engine.generate(PROMPTS[:2], GREEDY).requests) == 2
        worker = engine.workers._workers.processes[0]
        os.kill(worker.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 .*no sign of life.*WORKBENCH_LIVENESS_TIMEOUT"):
            engine.generate(PROMPTS[:2], GREEDY)
        assert time.monotonic() - started < 15
        worker.join(5)
        assert not worker.is_alive()
    finally:
        engine.shutdown()


def test_a_bad_liveness_bound_is_a_config_error(monkeypatch):
    from workbench.dist.group import liveness_timeout_s

    for bad in ("soon", "0", "-3", "inf", "nan", "1"):
        monkeypatch.setenv("WORKBENCH_LIVENESS_TIMEOUT", bad)
        with pytest.raises(ConfigError, match="WORKBENCH_LIVENESS_TIMEOUT"):
            liveness_timeout_s()
    monkeypatch.setenv("WORKBENCH_LIVENESS_TIMEOUT", "30")
    assert liveness_timeout_s() == 30.0


def test_sizes_that_cannot_work_are_config_errors_before_any_process_starts(monkeypatch):
    with pytest.raises(ConfigError, match="num_heads"):
        Engine.from_model("tiny-gqa", EngineConfig(device="cpu", tensor_parallel_size=3))
    with pytest.raises(ConfigError, match="int4 group size 32 does not divide"):  # a shard's down is 160 / 2 wide
        Engine.from_model("tiny-gqa", EngineConfig(device="cpu", tensor_parallel_size=2, quantization="int4",
                                                   group_size=32))  # fmt: skip
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(ConfigError, match="exceeds the 1 CPU cores"):
        Engine.from_model("tiny-gqa", EngineConfig(device="cpu", tensor_parallel_size=2))


def test_bench_decode_reports_the_all_reduces_of_a_tp_step(capsys):
    from workbench.cli import main

    args = ["bench", "decode", "--model", "tiny-gqa", "--tensor-parallel-size", "2", "--threads", "1", "--device",
            "cpu", "--batch", "2", "--steps", "2", "--warmup", "1", "--cached-ceilings", "--json"]  # fmt: skip
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    # eager and compiled side by side (one batch size: each compiled one compiles a graph); the compiled graph calls
    # the all-reduce at the same two places
    assert [(r["batch"], r["compiled_decode"]) for r in rows] == [(2, False), (2, True)]
    for row in rows:
        assert row["tensor_parallel_size"] == 2
        assert row["all_reduces_per_step"] == 2 * 2  # after O and after down, in each of tiny-gqa's 2 layers
        assert 0 < row["all_reduce_share"] < 1 and row["all_reduce_bytes_per_s"] > 0


def test_the_notebooks_engine_helpers_take_a_tensor_parallel_config():
    # before the module's shared ranks start: it starts its own (one group per process)
    from workbench.experiments.serving import compare_policies
    from workbench.model.checkpoint import load_model
    from workbench.workloads import Request

    model = load_model("tiny-gqa", seed=0)
    configs = {
        "tp1": EngineConfig(device="cpu", max_model_len=96),
        "tp2": EngineConfig(device="cpu", max_model_len=96, tensor_parallel_size=2),
    }
    requests = [Request(i, 0.01 * i, len(p), 4, prompt_token_ids=p) for i, p in enumerate(PROMPTS[:3])]
    table, results = compare_policies(model, configs, requests)
    assert [r.tokens for r in results["tp2"].requests] == [r.tokens for r in results["tp1"].requests]
    assert table.num_finished.tolist() == [3, 3]


@pytest.fixture(scope="module")
def workers():
    group = start_workers("tiny-gqa", 2, "fp32", "cpu", 0, num_threads=1)
    yield group
    group.shutdown()


def tp_engine(workers, path, **config) -> Engine:
    workers.call("load", str(path), "fp32", "cpu", 0)
    return Engine(workers.worker.model, EngineConfig(device="cpu", tensor_parallel_size=2, **config), workers=workers)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tp2_engine_gives_transformers_greedy_tokens(preset, tiny_checkpoint, workers):
    path = tiny_checkpoint(preset)
    res = tp_engine(workers, path, max_model_len=96).generate(PROMPTS, GREEDY)
    assert [r.tokens for r in res.requests] == hf_greedy(path, PROMPTS)


QUANTIZED = {"quantization": "int8", "kv_cache_dtype": "int8", "max_num_seqs": 4}


def one_device_and_tp2_tokens(path, workers, prompts, **settings):
    """(tokens of one device, tokens of TP 2 on ``workers``, the TP engine), both engines with ``settings``."""
    one = Engine.from_model(path, EngineConfig(device="cpu", max_model_len=96, **settings))
    want = [r.tokens for r in one.generate(prompts, GREEDY).requests]
    workers.call("load", path, "fp32", "cpu", 0, settings.get("quantization"))
    config = EngineConfig(device="cpu", max_model_len=96, tensor_parallel_size=2, **settings)
    engine = Engine(workers.worker.model, config, workers=workers)
    return want, [r.tokens for r in engine.generate(prompts, GREEDY).requests], engine, one


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tp2_int8_weights_and_int8_kv_give_the_one_device_tokens(preset, tiny_checkpoint, workers):
    """Every rank quantizes its shard as one device would (a row-parallel layer with the whole row's int8 scale) and
    keeps its KV heads in an int8 pool: the tokens of one device with the same settings."""
    want, got, engine, one = one_device_and_tp2_tokens(str(tiny_checkpoint(preset)), workers, PROMPTS[:3], **QUANTIZED)
    assert got == want
    assert engine.cache.k.dtype == torch.int8 and engine.cache.k_scale is not None
    # rank 0's O projection: the first columns of the one-device int8 weight, with the one-device scales
    o_tp, o_one = engine.model.layers[0].self_attn.o_proj, one.model.layers[0].self_attn.o_proj
    assert torch.equal(o_tp.scale, o_one.scale)
    assert torch.equal(o_tp.qweight, o_one.qweight[:, : o_tp.in_features])


def test_tp2_compiled_decode_gives_the_one_device_tokens(tiny_checkpoint, workers):
    """The compiled decode on every rank (the all-reduce one operator in its graph), with int8 weights and KV: the
    tokens of one device's compiled decode with the same settings. One preset: each compiles its graphs."""
    path = str(tiny_checkpoint("tiny-qwen2"))  # biased QKV, tied head: the other presets' paths and one more
    want, got, engine, _ = one_device_and_tp2_tokens(path, workers, PROMPTS[:3], compile_decode=True, **QUANTIZED)
    assert got == want
    assert engine.decode.mode == "compile" and engine.decode.compiled_sizes  # the driver's decodes were compiled


@pytest.fixture(scope="module")
def gqa_expected(tiny_checkpoint):
    return hf_greedy(tiny_checkpoint("tiny-gqa"), PROMPTS)


@pytest.mark.parametrize(
    "config",
    [
        {"policy": "chunked", "chunk_size": 7, "token_budget": 16, "block_size": 4},
        {"policy": "continuous", "block_size": 4, "num_blocks": 18},  # preempts: 18 blocks of 4 for ~200 tokens
        {"policy": "chunked", "token_budget": 16, "block_size": 4, "num_blocks": 18},
    ],
    ids=["chunked", "preempting", "chunked-preempting"],
)
def test_tp2_policies_and_small_pools_keep_the_tokens(config, tiny_checkpoint, workers, gqa_expected):
    engine = tp_engine(workers, tiny_checkpoint("tiny-gqa"), max_model_len=96, **config)
    res = engine.generate(PROMPTS, GREEDY)
    assert [r.tokens for r in res.requests] == gqa_expected
    if "num_blocks" in config:
        assert res.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0


def test_tp2_prefix_caching_skips_the_shared_blocks(tiny_checkpoint, workers):
    shared = PROMPTS[3][:48]  # three full 16-token blocks
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    engine = tp_engine(workers, tiny_checkpoint("tiny-gqa"), max_model_len=96, enable_prefix_caching=True)
    first = engine.generate(prompts[:1], GREEDY)
    second = engine.generate(prompts[1:], GREEDY)
    assert second.requests[0].num_cached_tokens == 48
    assert [r.tokens for r in first.requests + second.requests] == hf_greedy(tiny_checkpoint("tiny-gqa"), prompts)


def test_each_rank_holds_half_the_kv_heads(tiny_checkpoint, workers):
    engine = tp_engine(workers, tiny_checkpoint("tiny-gqa"), num_blocks=10, block_size=4)
    # tiny-gqa has 2 KV heads of 16: each of the 2 ranks keeps one of them, in a pool of the same 10 blocks
    assert tuple(engine.cache.k.shape) == (2, 10, 4, 1, 16)


def test_under_torchrun_the_ranks_are_torchruns_and_the_tokens_the_same():
    import subprocess
    import sys

    gen = ["-m", "workbench.cli", "generate", "--model", "tiny-gqa", "--prompt-ids", "1,2,3", "--prompt-ids", "9,8",
           "--max-new-tokens", "5", "--device", "cpu", "--json"]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run([*torchrun, *gen, "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]  # rank 0 alone prints the result
    alone = subprocess.run([sys.executable, *gen], capture_output=True, text=True, timeout=120, check=True)
    tokens = [[r["tokens"] for r in json.loads(text)["requests"]] for text in (line, alone.stdout)]
    assert tokens[0] == tokens[1]
