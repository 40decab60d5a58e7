"""Disaggregation with a tensor-parallel pool and with a quantized KV cache: the KV moves per rank, as head pieces,
and with an int8 pool's scales.

One module-scoped cluster per configuration: a prefill engine of TP 1 and a decode engine of TP 2 (three processes:
the prefill engine sends each decode rank its half of the KV heads), and the two-process 1:1 with an int8 and with
an fp8 KV cache.
"""

from __future__ import annotations

import random

import pytest

from workbench.cluster.disagg import DisaggCluster, DisaggConfig, Layout
from workbench.config import ModelConfig
from workbench.dist.kv_connector import Piece, transfer_plan
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.errors import ConfigError
from workbench.request import SamplingParams

rng = random.Random(5)
PROMPTS = [[rng.randrange(3, 256) for _ in range(n)] for n in (7, 33, 20, 1)]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
BASE = EngineConfig(device="cpu", max_model_len=96, num_blocks=40)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("tiny-gqa"))  # 4 query heads, 2 KV heads of 16, 2 layers


def colocated(checkpoint, config, prompts=PROMPTS):
    engine = Engine.from_model(checkpoint, config)
    try:
        return [r.tokens for r in engine.generate(prompts, GREEDY).requests]
    finally:
        engine.shutdown()


def offline(prompts=PROMPTS):
    return [(p, GREEDY, 0.0) for p in prompts]


def test_transfer_plan_re_slices_heads_between_unequal_tp():
    gqa = ModelConfig.resolve("tiny-gqa")  # 2 KV heads; 4 query heads, two per KV head
    assert transfer_plan(gqa, 1, 1) == [Piece(0, 0, 0, 2)]
    assert transfer_plan(gqa, 2, 2) == [Piece(0, 0, 0, 1), Piece(1, 1, 1, 2)]  # rank i to rank i
    assert transfer_plan(gqa, 1, 2) == [Piece(0, 0, 0, 1), Piece(0, 1, 1, 2)]  # one sender, each its half
    assert transfer_plan(gqa, 2, 1) == [Piece(0, 0, 0, 1), Piece(1, 0, 1, 2)]  # one receiver, a half from each
    # TP 4 over 2 KV heads replicates each on two ranks: the decode side's replicas each receive their copy
    assert transfer_plan(gqa, 4, 1) == [Piece(0, 0, 0, 1), Piece(2, 0, 1, 2)]
    assert transfer_plan(gqa, 1, 4) == [Piece(0, d, d // 2, d // 2 + 1) for d in range(4)]


def test_layout_places_each_engines_ranks_together():
    layout = Layout(num_prefill=2, num_decode=1, prefill_tp=1, decode_tp=2)
    assert layout.world == 4
    assert [layout.place(r) for r in range(4)] == [("prefill", 0, 0), ("prefill", 1, 0), ("decode", 0, 0),
                                                   ("decode", 0, 1)]  # fmt: skip
    assert layout.driver("decode", 0) == 2 and layout.ranks("decode", 0) == [2, 3]


def test_a_pool_whose_tp_cannot_split_the_model_is_a_config_error(checkpoint):
    cfg = DisaggConfig(prefill=BASE, decode=EngineConfig(device="cpu", tensor_parallel_size=3))
    with pytest.raises(ConfigError, match="decode pool: tensor_parallel_size 3 must divide"):
        DisaggCluster(checkpoint, cfg)


def test_the_pools_must_store_one_kv_dtype():
    with pytest.raises(ConfigError, match="same kv_cache_dtype"):
        DisaggConfig(prefill=BASE, decode=EngineConfig(device="cpu", kv_cache_dtype="int8"))


def test_a_tp2_decode_pool_gets_each_rank_its_heads_and_serves_colocated_tokens(checkpoint):
    decode = EngineConfig(device="cpu", max_model_len=96, num_blocks=40, tensor_parallel_size=2)
    with DisaggCluster(checkpoint, DisaggConfig(prefill=BASE, decode=decode)) as cluster:
        assert len(cluster.processes.processes) == 3
        result = cluster.run(offline(), online=False)
    assert [r.tokens for r in result.requests] == colocated(checkpoint, BASE)
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32: each decode rank gets one head
    assert ModelConfig.resolve(checkpoint).kv_bytes_per_token("fp32") == per_token
    for prompt, row in zip(PROMPTS, result.request_rows()):
        assert row["kv_transfer_bytes"] == len(prompt) * per_token
    assert result.kv_transfer()["num_transfers"] == len(PROMPTS)
    assert set(result.pools) == {"prefill0", "decode0"}


@pytest.mark.parametrize(
    "kv_dtype, per_token",
    [
        ("int8", 2 * 2 * 2 * (16 * 1 + 4)),  # int8 codes and one fp32 scale per token and KV head
        ("fp8", 2 * 2 * 2 * 16 * 1),  # e4m3 codes; the per-layer scales are constants, checked and not sent
    ],
)
def test_a_quantized_kv_cache_moves_its_codes_and_scales(checkpoint, kv_dtype, per_token):
    config = EngineConfig(device="cpu", max_model_len=96, num_blocks=40, kv_cache_dtype=kv_dtype)
    assert ModelConfig.resolve(checkpoint).kv_bytes_per_token(kv_dtype) == per_token
    with DisaggCluster(checkpoint, DisaggConfig(prefill=config, decode=config)) as cluster:
        result = cluster.run(offline(), online=False)
    assert [r.tokens for r in result.requests] == colocated(checkpoint, config)
    for prompt, row in zip(PROMPTS, result.request_rows()):
        assert row["kv_transfer_bytes"] == len(prompt) * per_token
    assert result.kv_transfer()["num_recomputed"] == 0


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_pack_then_unpack_moves_a_tokens_kv_heads_into_other_slots(kv_dtype):
    import torch

    from workbench.dist.kv_connector import pack, packed_bytes, unpack
    from workbench.kv.cache import KVCache

    cfg = ModelConfig.resolve("tiny-gqa")
    src, dst = (KVCache(cfg, 6, 4, kv_cache_dtype=kv_dtype) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_layers):
        k, v = (torch.randn(24, 2, 16, generator=gen) for _ in range(2))
        src.write(torch.arange(24), k, v, layer)
    from_slots, to_slots = torch.tensor([1, 2, 9, 17]), torch.tensor([20, 3, 4, 11])
    buffer = pack(src, from_slots, slice(1, 2))  # the second KV head only
    assert buffer.numel() == packed_bytes(src, 4, 1) == 4 * cfg.kv_bytes_per_token(kv_dtype if kv_dtype != "auto"
                                                                                    else "fp32") // 2  # fmt: skip
    unpack(dst, to_slots, slice(1, 2), buffer)
    for layer in range(cfg.num_layers):
        for got, want in zip(dst.gather(layer, to_slots), src.gather(layer, from_slots)):
            assert torch.equal(got[:, 1], want[:, 1])  # bit for bit, scales included
            assert not got[:, 0].any()  # the other head untouched


def test_cli_prefill_and_decode_tp_give_each_pool_its_tp():
    import argparse

    from workbench.cluster.disagg import disagg_config_from_args
    from workbench.commands.generate import add_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", "tiny-gqa", "--prompt-ids", "1,2"]
    args = parser.parse_args([*base, "--disaggregate", "1:2", "--decode-tp", "2"])
    cfg = disagg_config_from_args(args, engine_config_from_args(args))
    assert (cfg.prefill.tensor_parallel_size, cfg.decode.tensor_parallel_size) == (1, 2)
    assert cfg.layout.world == 1 + 2 * 2
    args = parser.parse_args([*base, "--disaggregate", "1:1", "--tensor-parallel-size", "2", "--prefill-tp", "1"])
    cfg = disagg_config_from_args(args, engine_config_from_args(args))
    assert (cfg.prefill.tensor_parallel_size, cfg.decode.tensor_parallel_size) == (1, 2)
    with pytest.raises(ConfigError, match="need --disaggregate"):
        engine_config_from_args(parser.parse_args([*base, "--decode-tp", "2"]))
    args = parser.parse_args([*base, "--disaggregate", "1:1", "--decode-tp", "2", "--kv-cache-dtype", "int8"])
    with pytest.raises(ConfigError, match="not supported with tensor_parallel_size > 1"):
        disagg_config_from_args(args, engine_config_from_args(args))


def test_a_message_that_overtakes_the_start_of_a_run_is_kept_for_that_run():
    # the prefill engine's first announcement of a run can reach a decode engine before the coordinator's start
    # (two writers, two feeder threads): it belongs to the new run and must not be dropped
    import queue

    from workbench.cluster.disagg import _next_run

    class Stub:
        logs = 0

        def reset_clock(self, t0):
            self.t0 = t0

        def new_step_log(self):
            self.logs += 1

    inbox = queue.Queue()
    for message in (("kv", "first announcement"), ("start", 12.5, "option"), ("kv", "second")):
        inbox.put(message)
    stub = Stub()
    t0, options, early = _next_run(stub, inbox)
    assert (t0, options, early, stub.t0, stub.logs) == (12.5, ("option",), [("kv", "first announcement")], 12.5, 1)
    assert inbox.get_nowait() == ("kv", "second")  # the rest is the run loop's
    inbox.put(("exit",))
    assert _next_run(stub, inbox) is None


def test_handoff_profile_by_hand():
    from types import SimpleNamespace

    from workbench.cluster.disagg import DisaggResult
    from workbench.experiments.fidelity import handoff_profile

    def transfer(num_bytes, token, announced, posted, wire):
        return {"kv_transfer_bytes": num_bytes, "timeline": {"prefill_token_s": token, "sent_s": token,
                "announced_s": announced, "receive_posted_s": posted, "landed_s": posted + wire}}  # fmt: skip

    # wire times on one line: 0.5 ms + 0.5 us per byte (2 MB/s)
    transfers = {0: transfer(1000, 1.0, 1.001, 1.0012, 0.001), 1: transfer(3000, 2.0, 2.002, 2.1, 0.002),
                 2: transfer(5000, 3.0, 3.003, 3.0031, 0.003)}  # fmt: skip
    pools = {
        "prefill0": {
            "steps": [
                {"start_s": 0.5, "end_s": 0.9, "duration_s": 0.4, "num_seqs": 1, "num_prefill_tokens": 8},
                {"start_s": 2.5, "end_s": 2.6, "duration_s": 0.1, "num_seqs": 1, "num_prefill_tokens": 8},
            ]
        },
        "decode0": {"steps": [{"start_s": 2.0, "end_s": 2.05}]},  # busy when request 1's announcement arrives
    }
    # request 0 arrives at an idle prefill engine 0.1 s before its step; 1 during a step; 2 after the last one
    requests = [SimpleNamespace(request_id=i, arrival_time=t) for i, t in enumerate((0.4, 0.6, 2.45))]
    profile = handoff_profile(DisaggResult(requests, transfers, pools, 4.0, 0, {0: (0, 0), 1: (0, 0), 2: (0, 0)}))
    assert profile["link_latency_s"] == pytest.approx(0.0005, abs=1e-12)
    assert profile["link_gbps"] == pytest.approx(2e6 * 8 / 1e9, rel=1e-9)
    assert profile["link_fit"] == "latency-bandwidth"
    assert profile["kv_handoff_s"] == pytest.approx(0.002)  # the median of 1, 2 and 3 ms
    assert profile["wake_s"]["prefill"] == pytest.approx((0.1 + 0.05) / 2)  # requests 0 and 2
    assert profile["wake_s"]["decode"] == pytest.approx((0.0002 + 0.0001) / 2)  # 0 and 2 (1 found a step running)
    # 100 quantiles of the two prefill wakes (0.1 s and 0.05 s): the smaller for the lower half, then the larger
    assert profile["wake_quantiles_s"]["prefill"] == pytest.approx([0.05] * 50 + [0.1] * 50)
