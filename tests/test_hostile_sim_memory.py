"""Issue 35, case 17: the simulator's memory does not grow with the trace.

A 10^6-row trace once peaked at 10.7 GB (every finished request's token timeline kept, and the KV pool tracked at
the workload's size). Now the trace is read as the simulation runs, a finished request leaves only its latencies
(``ServingStats``) and KV blocks are made as they are first taken. These tests count objects, never time anything:
the requests alive while a long trace streams stay bounded by what can be in flight, and the statistics kept are
numpy's over the same samples.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import weakref

import numpy as np
import pytest

from workbench.cli import main
from workbench.config import ModelConfig
from workbench.engine.metrics import ServingStats, counted_stats, stats
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.request import RequestRecord, Sequence
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import ProfiledCostModel
from workbench.workloads import Request, iter_workload, load_workload

LLAMA = ModelConfig.resolve("Llama-3.1-8B")
# 1 ms a step + 1 us per prefill token + 0.1 ms per decoding sequence: fast enough to queue at 200 requests/s
COST = ProfiledCostModel({"const": 1e-3, "prefill_tokens": 1e-6, "decode_seqs": 1e-4})


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_counted_stats_are_numpys_stats_of_the_expanded_sample(n: int) -> None:
    rng = np.random.default_rng(n)
    sample = np.round(rng.exponential(0.02, size=n), 4)  # rounded: many repeated values, as equal decode gaps are
    values, counts = np.unique(sample, return_counts=True)
    got, want = counted_stats(values, counts), stats(sample)
    for key in ("median", "p90", "p95", "p99"):  # the same order statistics and interpolation: equal
        assert got[key] == want[key], key
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)


def count(objects: list, cls: type) -> int:
    """Instances of ``cls`` among ``objects`` (gc.get_objects() may hold weak proxies whose referent is gone: they
    raise ReferenceError on isinstance, and are no instance)."""
    n = 0
    for o in objects:
        try:
            n += isinstance(o, cls)
        except ReferenceError:
            pass
    return n


def test_a_streamed_trace_keeps_only_the_requests_in_flight() -> None:
    # 3000 requests at 200/s, at most 8 running and a queue that stays short: if the simulator held every request,
    # sequence or record, thousands would be alive by the end; streamed, what is alive is what waits or runs
    most = {"requests": 0, "sequences": 0, "records": 0}
    live = [0]
    # what earlier tests of this process left alive (the census counts the whole heap): not the simulator's
    before = gc.get_objects()
    base = {"sequences": count(before, Sequence), "records": count(before, RequestRecord)}
    del before

    def gone() -> None:
        live[0] -= 1

    def stream():
        for i, r in enumerate(iter_workload("poisson:200", num_requests=3000, prompt_lens="uniform:16:64",
                                            output_lens="uniform:2:12", seed=3)):  # fmt: skip
            live[0] += 1
            weakref.finalize(r, gone)
            if i % 1000 == 999:  # a few censuses of the heap (gc.get_objects: no timing involved)
                objects = gc.get_objects()
                most["requests"] = max(most["requests"], live[0])
                most["sequences"] = max(most["sequences"], count(objects, Sequence) - base["sequences"])
                most["records"] = max(most["records"], count(objects, RequestRecord) - base["records"])
                del objects
            yield r

    config = SimConfig(max_num_seqs=8, max_model_len=128)
    result = simulate(stream(), "tiny-gqa", COST, config, hardware="h100-sxm", keep_records=False)
    assert result.stats.num_requests == result.stats.num_completed == 3000
    assert result.records == []
    assert 0 < most["requests"] <= 3 and 0 < most["sequences"] <= 40 and most["records"] == 0, most
    # the pool an 80 GB accelerator holds for tiny-gqa is tracked at what 8 sequences of 128 tokens can fill:
    # 8 + 1 blocks of 16 tokens each, over the 1% watermark
    assert result.replicas[0]["num_blocks_capacity"] > 10**6
    assert result.replicas[0]["num_blocks"] == math.ceil(8 * 9 / 0.99) + 1


def test_streamed_and_kept_records_give_numpys_statistics() -> None:
    work = load_workload("gamma:300:2", num_requests=400, prompt_lens="uniform:16:200", output_lens="uniform:1:80")
    config = SimConfig(num_blocks=80, max_num_seqs=16)  # small pool: preemptions happen
    kept = simulate(work, LLAMA, COST, config)
    streamed = simulate(iter(work), LLAMA, COST, config, keep_records=False)
    slos = {"slo_ttft_s": 0.05, "slo_tpot_s": 0.002}
    assert streamed.summary(**slos) | {"wall_s": 0, "requests_per_wall_s": 0, "us_per_step": 0} == kept.summary(
        **slos
    ) | {"wall_s": 0, "requests_per_wall_s": 0, "us_per_step": 0}
    assert kept.num_preemptions > 0
    # the peer: numpy over the kept records' own timelines, as the metrics module defines them
    recs = [r for r in kept.records if r.finish_reason == "length"]
    m = streamed.summary()["metrics"]
    ttft = [r.first_token_time - r.arrival_time for r in recs]
    gaps = np.concatenate([np.diff(r.token_times) for r in recs])
    assert m["ttft_s"] == stats(ttft)
    for key, q in (("p90", 90), ("p95", 95), ("p99", 99)):
        assert m["itl_s"][key] == np.percentile(gaps, q)
    assert m["itl_s"]["median"] == np.median(gaps)
    assert m["itl_s"]["mean"] == pytest.approx(gaps.mean(), rel=1e-12)


def test_a_stream_out_of_arrival_order_is_refused() -> None:
    work = [Request(0, 0.0, 8, 2), Request(1, 2.0, 8, 2), Request(2, 1.0, 8, 2)]
    with pytest.raises(ConfigError, match="request 2 arrives at 1.0 s, before the one read before it"):
        simulate(iter(work), LLAMA, COST, SimConfig(num_blocks=64), keep_records=False)
    assert len(simulate(work, LLAMA, COST, SimConfig(num_blocks=64)).records) == 3  # a list is sorted, as before


def test_serving_stats_hold_no_token_timelines() -> None:
    acc = ServingStats()
    seq = Sequence(7, [1, 2, 3], arrival_time=1.0)
    seq.output_token_ids = [0] * 5
    seq.first_token_time, seq.finish_time = 1.5, 2.5
    seq.token_times = [1.5, 1.75, 2.0, 2.25, 2.5]
    seq.finish_reason = "length"
    acc.add(seq, position=0)
    seq.token_times.append(99.0)  # nothing of the sequence is kept by reference
    m = acc.summary()["metrics"]
    assert m["ttft_s"]["mean"] == 0.5 and m["e2el_s"]["mean"] == 1.5 and m["tpot_s"]["mean"] == 0.25
    assert m["itl_s"] == {"mean": 0.25, "median": 0.25, "p90": 0.25, "p95": 0.25, "p99": 0.25}


def test_block_manager_makes_blocks_as_they_are_first_taken() -> None:
    # ids as a free list 0..n-1 would give them: fresh ids first, then freed ones in the order they were freed
    bm = BlockManager(10, 4)
    a, b, c = (Sequence(i, list(range(n))) for i, n in ((0, 16), (1, 16), (2, 20)))
    assert bm.blocks == [] and bm.num_free_blocks == 10
    assert bm.allocate(a) and bm.allocate(b)
    assert (a.block_table, b.block_table, len(bm.blocks)) == ([0, 1, 2, 3], [4, 5, 6, 7], 8)
    bm.free(a)  # released last block first: 3, 2, 1, 0
    assert bm.allocate(c)
    assert c.block_table == [8, 9, 3, 2, 1]
    assert len(bm.blocks) == 10 and bm.num_free_blocks == 1
    bm.check_invariants([b.block_table, c.block_table])
    huge = BlockManager(10**12, 16)
    assert huge.num_free_blocks == 10**12 and huge.blocks == []


def test_simulate_reads_its_trace_file_lazily(tmp_path, capsys) -> None:
    # a row the reader never reaches cannot fail the run: --limit stops the file's reading at 3 rows
    trace = tmp_path / "t.csv"
    rows = [f"2023-11-16 18:15:4{i}.0000000,{10 + i},{2 + i}" for i in range(4)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\nnot,a,row\n")
    rc = main(["simulate", "--model", "tiny-gqa", "--hardware", "h100-sxm", "--trace", str(trace), "--limit", "3",
               "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    summary = json.loads(out)
    assert summary["num_requests"] == summary["num_finished"] == 3
    assert summary["metrics"]["output_throughput"] > 0
    assert list(itertools.islice(iter_workload(str(trace)), 4))[3].prompt_len == 13
