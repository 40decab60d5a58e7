"""Parallelism in the roofline and the simulator: sharded FLOPs and bytes and communication costs by hand, per-GPU
memory, the calibrated fast paths against the detailed table, FP8/quantized formats, and TP=1 equal to the ideal
single-GPU roofline that the previous releases priced."""

from __future__ import annotations

import json

import pytest

from workbench.cli import main
from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.hardware import Calibration, HardwareSpec, Interconnect, ring_all_gather_time, ring_all_reduce_time
from workbench.roofline import RooflineModel, Shard, reference_step_cost
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import RooflineCostModel, decode_stats
from workbench.sim.stats import CostModel, StepStats
from workbench.workloads import synthetic_workload

# round numbers: 1 TFLOP/s, 1 GB/s memory; links of 1 GB/s in a server, 0.1 GB/s between, 10 us per collective and
# 1 us per ring hop, 4 GPUs per server
TOY_IC = Interconnect("toy-link", 1e9, 1e8, 1e-5, 1e-6, 2e-6, 4)
TOY_HW = HardwareSpec(name="toy-par", peak_flops={"fp32": 1e12, "bf16": 1e12}, mem_bandwidth=1e9, mem_capacity=1e10,
                      source="test", interconnect=TOY_IC)  # fmt: skip


def hand_cfg(**changes) -> ModelConfig:
    """2 layers, hidden 8, 2 query heads sharing 1 KV head of size 4, intermediate 16, vocabulary 10."""
    base = dict(name="hand", architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=64)  # fmt: skip
    return ModelConfig(**{**base, **changes})


def ops_of(cost) -> dict:
    return {op.name: op for op in cost.ops}


# ---- collectives -----------------------------------------------------------------------------------------------
def test_ring_collectives_by_hand() -> None:
    # 4 ranks, 1 MB over 1 GB/s: reduce-scatter + all-gather = 2 * 3 / 4 MB -> 1.5 ms, plus 6 hops of 1 us and 10 us
    assert ring_all_reduce_time(1e6, 4, 1e9, 1e-6, 1e-5) == pytest.approx(1e-5 + 6e-6 + 1.5e-3)
    assert ring_all_gather_time(1e6, 4, 1e9, 1e-6, 1e-5) == pytest.approx(1e-5 + 3e-6 + 0.75e-3)
    assert ring_all_reduce_time(1e6, 1, 1e9, 1e-6, 1e-5) == 0.0
    # a group larger than a server uses the inter-node link and its hop latency
    assert TOY_IC.all_reduce_s(1e6, 8) == pytest.approx(1e-5 + 14 * 2e-6 + 14 / 8 * 1e6 / 1e8)
    assert TOY_IC.send_s(100.0) == pytest.approx(1e-5 + 100 / 1e9)
    assert TOY_IC.send_s(100.0, cross_node=True) == pytest.approx(1e-5 + 2e-6 + 100 / 1e8)


# ---- shards --------------------------------------------------------------------------------------------------
def test_sharded_flops_and_bytes_by_hand() -> None:
    cfg = hand_cfg()
    tp2 = RooflineModel(cfg, TOY_HW, dtype="bf16", tensor_parallel_size=2)
    shard = tp2.shard
    # one query head per GPU; the single KV head is replicated on both; intermediate 8 per GPU; 5 vocabulary rows
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.vocab_size) == (1, 1, 8, 5)
    ops = ops_of(tp2.decode([3]))  # one token at context 3
    # per GPU, 2 layers: q 8 -> 4, k 8 -> 4, gate 8 -> 8, down 8 -> 8 (input split), 2 bytes per weight
    assert ops["q_proj"].flops == 2 * (2 * 8 * 4) and ops["q_proj"].weight_bytes == 2 * (4 * 8 * 2)
    assert ops["k_proj"].flops == 2 * (2 * 8 * 4) and ops["k_proj"].weight_bytes == 2 * (4 * 8 * 2)
    assert ops["gate_proj"].flops == 2 * (2 * 8 * 8) and ops["down_proj"].weight_bytes == 2 * (8 * 8 * 2)
    assert ops["o_proj"].act_bytes == 2 * (4 + 8) * 2  # reads its 4-wide input share, writes all 8
    # attention: 1 head, 3 pairs, 2 * head_dim FLOPs per pair; K of 3 tokens of one 4-wide head in bf16
    assert ops["attn_scores"].flops == 2 * (2 * 4 * 3) and ops["attn_scores"].kv_bytes == 2 * (3 * 4 * 2)
    assert ops["lm_head"].flops == 2 * 8 * 5 and ops["lm_head"].weight_bytes == 5 * 8 * 2
    # norms are replicated: each GPU does the whole hidden size
    assert ops["attn_norm"].flops == 2 * 4 * 8


def test_communication_ops_by_hand() -> None:
    cfg = hand_cfg()
    tp2 = RooflineModel(cfg, TOY_HW, dtype="bf16", tensor_parallel_size=2)
    ops = ops_of(tp2.decode([3, 5]))  # 2 tokens: all-reduces of 2 x 8 x 2 = 32 bytes
    per_reduce = 1e-5 + 2 * 1e-6 + 32 / 1e9  # 2 (n-1)/n = 1 for n = 2
    assert ops["tp_all_reduce"].count == 4  # after O and after down, 2 layers
    assert ops["tp_all_reduce"].time_s == pytest.approx(4 * per_reduce)
    # logits of 2 sequences x 10 vocabulary x 2 bytes gathered: (n-1)/n of 40 bytes cross this GPU's link
    assert ops["lm_head_gather"].time_s == pytest.approx(1e-5 + 1e-6 + 0.5 * 40 / 1e9)
    assert ops["lm_head_gather"].link_bytes == pytest.approx(20)

    pp2 = RooflineModel(cfg, TOY_HW, dtype="bf16", pipeline_parallel_size=2)
    cost = pp2.decode([3, 5])
    ops = ops_of(cost)
    assert pp2.shard.num_layers == 1 and ops["q_proj"].count == 1
    assert ops["pp_send"].time_s == pytest.approx(1e-5 + 32 / 1e9)
    # the bubble is the other stage: one more time of this stage's layer ops
    from workbench.roofline import LAYER_OPS

    stage = sum(op.time_s for op in cost.ops if op.name in LAYER_OPS)
    assert ops["pipeline_bubble"].time_s == pytest.approx(stage)
    assert cost.time_s == pytest.approx(sum(op.time_s for op in cost.ops))
    # four GPUs (TP 2 x PP 2) fit in a server; eight (TP 4 x PP 2) do not, so their sends cross it
    wide = RooflineModel(hand_cfg(num_heads=4, num_kv_heads=2), TOY_HW, tensor_parallel_size=4,
                         pipeline_parallel_size=2)  # fmt: skip
    assert ops_of(wide.decode([3]))["pp_send"].time_s == pytest.approx(1e-5 + 2e-6 + 16 / 1e8)


def test_tp_shards_are_the_reference_count_of_a_shard_shaped_model() -> None:
    """A GPU of TP=t computes what the unsharded reference counts for a model with 1/t of the heads and of the
    intermediate size (the layer products; norms and the replicated embedding are the whole model's)."""
    cfg = ModelConfig.resolve("Llama-3.1-8B")
    tp4 = RooflineModel(cfg, "h100-sxm", tensor_parallel_size=4)
    small = cfg.with_overrides(num_heads=8, num_kv_heads=2, intermediate_size=cfg.intermediate_size // 4)
    ref = reference_step_cost(small, [(5, 3)], [7])
    ops = ops_of(tp4.step_cost([(5, 3)], [7]))
    for name in ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj", "attn_scores", "softmax", "kv_write"):
        for key in ("flops", "weight_bytes", "kv_bytes", "act_bytes"):
            assert getattr(ops[name], key) == pytest.approx(ref[name][key]), (name, key)


def test_per_gpu_weights_by_hand_and_equal_to_the_model_on_one_gpu() -> None:
    for name in ("Llama-3.1-8B", "Llama-2-70B", "Qwen2.5-0.5B", "tiny-qwen2"):
        cfg = ModelConfig.resolve(name)
        for quant in (None, "int8", "fp8"):
            assert Shard.of(cfg).weight_bytes(cfg, "bf16", quant) == cfg.weight_bytes("bf16", quant)
    cfg = ModelConfig.resolve("Llama-2-70B")  # h 8192, i 28672, 64 heads / 8 KV heads of 128, vocab 32000, untied
    h, i, q, kv, v, L = 8192, 28672, 8192, 1024, 32000, 80
    per_layer = (2 * h * q // 4 + 2 * h * kv // 4 + 3 * h * i // 4 + 2 * h) * 2
    expected = L * per_layer + 2 * (v // 4) * h * 2 + h * 2  # embedding and head split by vocabulary, final norm
    assert Shard.of(cfg, 4).weight_bytes(cfg, "fp16") == expected
    # PP 2: 40 layers, and the heavier end (the LM head with the final norm) on its GPU
    assert Shard.of(cfg, 4, 2).weight_bytes(cfg, "fp16") == 40 * per_layer + (v // 4) * h * 2 + h * 2
    assert Shard.of(cfg, 4).kv_bytes_per_token(cfg, "fp16") == cfg.kv_bytes_per_token("fp16") // 4
    # 8 KV heads over 16 GPUs: one per GPU, replicated
    assert Shard.of(cfg, 16).num_kv_heads == 1
    with pytest.raises(ConfigError, match="does not divide"):
        Shard.of(cfg, 3)
    with pytest.raises(ConfigError, match="exceeds"):
        Shard.of(hand_cfg(), 1, 3)


# ---- memory ----------------------------------------------------------------------------------------------------
def test_70b_does_not_fit_one_80gb_gpu_and_fits_four() -> None:
    cfg = ModelConfig.resolve("Llama-2-70B")
    with pytest.raises(ConfigError, match="tensor-parallel-size 2 would fit"):
        RooflineModel(cfg, "a100-80gb", dtype="fp16").check_memory(512)
    assert RooflineModel(cfg, "a100-80gb", dtype="fp16", tensor_parallel_size=4).check_memory(512)["free_bytes"] > 0
    with pytest.raises(ConfigError, match="no KV block"):
        SimConfig(dtype="fp16").resolved_num_blocks(cfg, "a100-80gb")
    # the pool of one TP=4 GPU: its memory less its weights, over its quarter of the KV of a block
    hw_bytes = 80 * 2**30 * 0.9
    shard = Shard.of(cfg, 4)
    expected = int((hw_bytes - shard.weight_bytes(cfg, "fp16")) // (16 * cfg.kv_bytes_per_token("fp16") // 4))
    assert SimConfig(dtype="fp16", tensor_parallel_size=4).resolved_num_blocks(cfg, "a100-80gb") == expected


def test_simulate_70b_on_four_a100s_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", "Llama-2-70B", "--hardware", "a100-80gb", "--dtype", "fp16", "--trace",
            "poisson:2", "--num-requests", "20", "--json"]  # fmt: skip
    assert main(argv) == 2
    assert "tensor-parallel-size" in capsys.readouterr().err
    assert main([*argv, "--tensor-parallel-size", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_finished"] == 20 and out["cost_model"]["tensor_parallel_size"] == 4
    assert out["replicas"][0]["tensor_parallel_size"] == 4


def test_roofline_cli_refuses_70b_on_one_gpu_and_reports_the_group(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["roofline", "--model", "Llama-2-70B", "--hardware", "h100-sxm", "--json"]
    assert main(base) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main([*base, "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    for phase in ("prefill", "decode"):
        ops = data[phase]["ops"]
        names = {op["name"] for op in ops}
        assert {"tp_all_reduce", "lm_head_gather", "pp_send", "pipeline_bubble"} <= names
        assert data[phase]["time_s"] == pytest.approx(sum(op["time_s"] for op in ops))
    assert main([*base, "--disaggregate", "--prefill-tp", "8", "--decode-tp", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prefill_tp"] == 8 and data["decode_tp"] == 4
    assert data["prefill"]["ops"][-1]["name"] == "kv_transfer"


# ---- fast paths ------------------------------------------------------------------------------------------------
CAL = Calibration(linear_max=0.8, linear_half_tokens=50, attention_max=0.6, attention_half_tokens=20,
                  memory_efficiency=0.85, kernel_floor_s=4e-6, step_overhead_s=0.0)  # fmt: skip


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2), (8, 1)])
def test_fast_path_equals_the_op_table_with_calibration_and_parallelism(tp: int, pp: int) -> None:
    cfg = ModelConfig.resolve("Llama-3.1-8B")
    model = RooflineModel(cfg, "h100-sxm", tensor_parallel_size=tp, pipeline_parallel_size=pp, calibration=CAL)
    for chunks, decodes in (([(512, 0)], []), ([], [100] * 8), ([(64, 300), (1, 0)], [40, 7, 900])):
        detailed = model.step_cost(chunks, decodes)
        assert model.step_time(chunks, decodes) == pytest.approx(detailed.time_s, rel=1e-12)
        assert detailed.time_s == pytest.approx(sum(op.time_s for op in detailed.ops), rel=1e-12)
    cost = RooflineCostModel(cfg, "h100-sxm", tensor_parallel_size=tp, pipeline_parallel_size=pp, calibration=CAL)
    for n in (1, 7, 64):
        for ctx in (n, 50 * n, 4000 * n):
            expected = model.time_from_stats(n, n, ctx, ctx)
            assert cost.decode_time(n, ctx) == pytest.approx(expected, rel=1e-9)
            assert cost.step_time(decode_stats(n, ctx)) == pytest.approx(expected, rel=1e-12)


def test_calibration_curve_floor_and_overhead_by_hand() -> None:
    cfg = hand_cfg()
    cal = Calibration(linear_max=0.5, linear_half_tokens=10, memory_efficiency=0.5, kernel_floor_s=1e-3,
                      step_overhead_s=0.25)  # fmt: skip
    model = RooflineModel(cfg, TOY_HW, calibration=cal)
    ideal = RooflineModel(cfg, TOY_HW)
    ops, base = ops_of(model.prefill([10])), ops_of(ideal.prefill([10]))
    # 10 rows: efficiency 0.5 * 10 / 20 = 0.25 -> compute 4x; memory at half the bandwidth -> 2x; floor 1 ms x 2
    q, q0 = ops["q_proj"], base["q_proj"]
    flops_t, bytes_t = q0.flops / 1e12, q0.bytes / 1e9
    assert q.time_s == pytest.approx(max(4 * flops_t, 2 * bytes_t, 2e-3))
    assert ops["step_overhead"].time_s == 0.25
    # the cost model takes the overhead as the gap between steps, not inside the step
    cm = RooflineCostModel(cfg, TOY_HW, calibration=cal, host_gap_s=None)
    assert cm.host_gap_s == 0.25
    stats = StepStats(10, 1, 55, 10)
    assert cm.step_time(stats) == pytest.approx(model.prefill([10], detailed=False).time_s - 0.25)


def test_kernel_latency_adds_to_every_kernel_by_hand() -> None:
    # hand_cfg's 2 layers x 17 kernels (attn_norm, q, k, v, rope, kv_write, attn_scores, softmax, attn_value, o,
    # residual, mlp_norm, gate, up, act_mul, down, residual) + embedding, final norm, LM head = 37 kernels a step;
    # at TP 2 each GPU runs the same 37, and the all-reduces (collectives, not kernels priced here) take none
    cfg = hand_cfg()
    lat = Calibration(kernel_latency_s=1e-3, kernel_floor_s=2e-3)
    floor_only = Calibration(kernel_floor_s=2e-3)
    for tp in (1, 2):
        with_lat = RooflineModel(cfg, TOY_HW, tensor_parallel_size=tp, calibration=lat)
        without = RooflineModel(cfg, TOY_HW, tensor_parallel_size=tp, calibration=floor_only)
        for chunks, decodes in (([(10, 0)], []), ([], [5, 9])):
            a, b = with_lat.step_cost(chunks, decodes), without.step_cost(chunks, decodes)
            assert a.time_s == pytest.approx(b.time_s + 37e-3, rel=1e-12)
            # one op: the floor (2 ms: the toy's kernels take microseconds) and 1 ms more, each of the 2 layers
            assert ops_of(a)["q_proj"].time_s == pytest.approx(2 * (2e-3 + 1e-3))
            assert with_lat.step_time(chunks, decodes) == pytest.approx(a.time_s, rel=1e-12)
    # the simulator's piecewise-linear decode segments carry it too
    cost = RooflineCostModel(cfg, TOY_HW, calibration=lat)
    assert cost.decode_time(3, 30) == pytest.approx(RooflineModel(cfg, TOY_HW, calibration=lat).time_from_stats(
        3, 3, 30, 30), rel=1e-12)  # fmt: skip
    with pytest.raises(ConfigError, match="kernel_latency_s"):
        Calibration(kernel_latency_s=-1e-6)


# ---- formats ---------------------------------------------------------------------------------------------------
def test_fp8_needs_fp8_hardware_and_every_kv_byte_count_agrees() -> None:
    cfg = ModelConfig.resolve("Llama-3.1-8B")
    with pytest.raises(ConfigError, match="no FP8"):
        RooflineModel(cfg, "a100-80gb", quantization="fp8")
    with pytest.raises(ConfigError, match="activations"):
        SimConfig(dtype="fp8")
    fp8 = RooflineModel(cfg, "h100-sxm", quantization="fp8", kv_dtype="fp8")
    assert fp8.matmul_peak == 1979e12
    assert ops_of(fp8.decode([100]))["q_proj"].weight_bytes == cfg.num_layers * (4096 * 4096 + 4)
    for kv in ("auto", "fp8", "int8"):
        model = RooflineModel(cfg, "h100-sxm", kv_dtype=kv)
        sim = SimConfig(kv_cache_dtype=kv)
        per_token = cfg.kv_bytes_per_token(sim.kv_cache_dtype)
        # the roofline writes a token's K and V at what the pool reserves for it
        assert ops_of(model.decode([1]))["kv_write"].kv_bytes == per_token
        assert model.kv_bytes_per_token_per_gpu() == per_token
        assert Shard.of(cfg).kv_bytes_per_token(cfg, sim.kv_cache_dtype) == per_token
    blocks = {kv: SimConfig(kv_cache_dtype=kv).resolved_num_blocks(cfg, "h100-sxm") for kv in ("auto", "fp8")}
    assert blocks["fp8"] == pytest.approx(2 * blocks["auto"], abs=1)
    int4 = RooflineModel(cfg, "a100-80gb", quantization="int4")
    assert int4.matmul_peak == 312e12  # weight-only: products at the activations' peak
    assert int4.weight_bytes_per_gpu() == cfg.weight_bytes("bf16", "int4")


# ---- TP=1 equals the ideal single-GPU roofline -------------------------------------------------------------------
def reference_time(cfg: ModelConfig, hw: str, chunks: list, decodes: list) -> float:
    from workbench.hardware import get_hardware
    from workbench.roofline import MATMUL_OPS

    spec = get_hardware(hw)
    total = 0.0
    for name, c in reference_step_cost(cfg, chunks, decodes).items():
        peak = spec.peak("bf16") if name in MATMUL_OPS else spec.vector_flops
        total += max(c["flops"] / peak, (c["weight_bytes"] + c["kv_bytes"] + c["act_bytes"]) / spec.mem_bandwidth)
    return total


class ReferencePriced(CostModel):
    """Prices each step's plan with ``reference_time`` (the simulator hands it (stats, plan), see the test)."""

    def __init__(self, cfg: ModelConfig, hw: str) -> None:
        self.cfg, self.hw = cfg, hw

    def end_time(self, start: float, item) -> float:
        _stats, plan = item
        chunks = [(c.num_new_tokens, c.start) for c in plan.chunks if c.is_prefill]
        decodes = [c.start + c.num_new_tokens for c in plan.chunks if not c.is_prefill]
        return start + reference_time(self.cfg, self.hw, chunks, decodes)


def test_tp1_ideal_equals_the_previous_roofline_step_by_step_and_in_a_simulation(monkeypatch) -> None:
    cfg = ModelConfig.resolve("tiny-gqa")
    model = RooflineModel(cfg, "h100-sxm", tensor_parallel_size=1, pipeline_parallel_size=1)
    for chunks, decodes in (([(17, 0)], []), ([], [5, 9, 30]), ([(4, 12), (1, 0)], [9, 2])):
        assert model.step_time(chunks, decodes) == pytest.approx(reference_time(cfg, "h100-sxm", chunks, decodes),
                                                                 rel=1e-12)  # fmt: skip
    # a whole simulation (bulk decode fast path on) against one whose every step the reference prices
    requests = synthetic_workload(30, rate=50.0, prompt_lens="uniform:4:60", output_lens="uniform:1:20", seed=1)
    config = SimConfig(num_blocks=200, max_model_len=128, max_num_seqs=8, policy="chunked", token_budget=32)
    ours = simulate(requests, cfg, RooflineCostModel(cfg, "h100-sxm"), config)
    import workbench.sim.cluster as cluster

    real = cluster.plan_stats
    monkeypatch.setattr(cluster, "plan_stats", lambda plan: (real(plan), plan))
    ref = simulate(requests, cfg, ReferencePriced(cfg, "h100-sxm"), config, fast=False)
    assert len(ours.records) == len(ref.records) == 30
    for a, b in zip(ours.records, ref.records):
        assert a.token_times == pytest.approx(b.token_times, rel=1e-9)


def test_kv_transfer_by_hand() -> None:
    from workbench.roofline import kv_transfer_op

    cfg = hand_cfg(num_heads=4, num_kv_heads=2)
    sender = RooflineModel(cfg, TOY_HW, tensor_parallel_size=2)
    # 10 tokens; each GPU holds 1 of the 2 KV heads: 2 layers x K and V x 4 x 2 bytes = 32 bytes a token
    op = kv_transfer_op(sender, 10, receiver_gpus=2)
    assert op.link_bytes == 320 and op.time_s == pytest.approx(1e-5 + 320 / 1e9)  # 2 + 2 GPUs: one server
    far = kv_transfer_op(sender, 10, receiver_gpus=4)  # 6 GPUs > 4 per server: over the NIC
    assert far.time_s == pytest.approx(1e-5 + 2e-6 + 320 / 1e8)
