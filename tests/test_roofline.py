"""Roofline model: hand-computed FLOPs and bytes, the fast path against the slow reference, the CLI contract."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from workbench.cli import main
from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.hardware import HardwareSpec, get_hardware
from workbench.roofline import (
    LAYER_OPS,
    MODEL_OPS,
    RooflineModel,
    attended_pairs,
    get_model,
    linear_flops,
    phase_report,
    reference_step_cost,
    step_cost,
    utilization,
)

# a toy machine with round numbers: 1 TFLOP/s matmul (bf16 and fp32 alike), 1 GB/s
TOY_HW = HardwareSpec(
    name="toy", peak_flops={"fp32": 1e12, "bf16": 1e12}, mem_bandwidth=1e9, mem_capacity=1e10, source="test"
)
TINY_PRESETS = ("tiny-mha", "tiny-gqa", "tiny-mqa", "tiny-qwen2")
# mixed steps: (prefill chunks (num_new, num_cached), decode context lengths)
STEPS = [
    ([(7, 0)], []),
    ([], [1]),
    ([], [5, 17, 33]),
    ([(4, 12), (1, 0)], [9, 2]),
    ([(16, 0), (3, 5)], [64]),
]


def small_cfg() -> ModelConfig:
    """A config small enough to count by hand: GQA 2 query heads / 1 KV head of size 4."""
    return ModelConfig(
        name="hand",
        architecture="LlamaForCausalLM",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=64,
    )


def test_linear_layer_flops_by_hand() -> None:
    assert linear_flops(4096, 4096, 1024) == 2 * 4096 * 4096 * 1024
    # Llama-2-7B's q_proj is 4096 -> 4096: a prefill of 1024 tokens, over 32 layers
    cost = step_cost("Llama-2-7B", "h100-sxm", prefill_chunks=[(1024, 0)], dtype="fp16")
    q_proj = next(op for op in cost.ops if op.name == "q_proj")
    assert q_proj.flops == 32 * 2 * 4096 * 4096 * 1024
    assert q_proj.bound == "compute"


def test_lower_triangle_attention_count_on_a_tiny_example() -> None:
    # 4 new tokens, nothing cached: the causal mask keeps 1 + 2 + 3 + 4 = 10 of the 16 (query, key) pairs
    assert attended_pairs(4, 0) == 10
    # 3 new tokens after 2 cached: they see 3, 4 and 5 keys
    assert attended_pairs(3, 2) == 12
    cfg = small_cfg()
    cost = step_cost(cfg, TOY_HW, prefill_chunks=[(4, 0)], dtype="fp32")
    ops = {op.name: op for op in cost.ops}
    # 2 layers x 2 heads x (2 * head_dim 4) FLOPs per pair x 10 pairs
    assert ops["attn_scores"].flops == 2 * 2 * (2 * 4) * 10
    assert ops["attn_value"].flops == 2 * 2 * (2 * 4) * 10
    assert ops["softmax"].flops == 2 * 2 * 5 * 10


def test_decode_bytes_of_a_small_config_term_by_term() -> None:
    """Decode of one sequence at context 3 in fp32, every byte counted by hand (4 bytes per element)."""
    cfg = small_cfg()  # h=8, q=2*4=8, kv=1*4=4, I=16, V=10, 2 layers
    cost = step_cost(cfg, TOY_HW, decode_contexts=[3], dtype="fp32")
    ops = {op.name: op for op in cost.ops}
    e = 4  # bytes per element
    layers = 2
    # weights read once per layer: norms 8 each, q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8
    per_layer_weights = 8 + 8 + 64 + 32 + 32 + 64 + 128 + 128 + 128
    # plus once per model: one embedding row (8), final norm (8), LM head (8x10)
    weights = layers * per_layer_weights + 8 + 8 + 80
    assert cost.weight_bytes == weights * e
    # KV: write one token's K and V (2 x 4), read K and V of 3 tokens (2 x 3 x 4), per layer
    assert cost.kv_bytes == layers * (2 * 4 + 2 * 3 * 4) * e
    # activations per layer: norm in/out 2x8 (twice), q in/out 8+8, k 8+4, v 8+4, rope r/w q and k 2x(8+4),
    # kv_write reads k, v 2x4, scores reads q 8, attn_value writes 8, o 8+8, residual 3x8 (twice),
    # gate 8+16, up 8+16, act_mul 3x16, down 16+8
    per_layer_act = 16 + 16 + 16 + 12 + 12 + 24 + 8 + 8 + 8 + 16 + 24 + 24 + 24 + 24 + 48 + 24
    # softmax writes one fp32 log-sum-exp per head and query row: 2 heads x 1 row x 4 bytes (not x e)
    lse = 2 * 4
    # once per model: embedding writes 8, final norm 2x8, LM head reads 8, writes 10 logits
    model_act = 8 + 16 + 18
    assert cost.act_bytes == (layers * per_layer_act + model_act) * e + layers * lse
    assert ops["kv_write"].kv_bytes == layers * 2 * 4 * e
    assert ops["attn_scores"].kv_bytes == layers * 3 * 4 * e
    assert ops["lm_head"].weight_bytes == 80 * e
    # FLOPs of the projections by hand: 2 per multiply-add, one token
    assert ops["q_proj"].flops == layers * 2 * 8 * 8
    assert ops["down_proj"].flops == layers * 2 * 16 * 8
    assert ops["lm_head"].flops == 2 * 8 * 10


def test_decode_floor_of_a_7b_fp16_model_on_h100_is_near_4_ms() -> None:
    # ~6.74e9 parameters x 2 bytes ~ 13.5 GB; 13.5e9 / 3.35e12 B/s ~ 4.0 ms
    cost = step_cost("Llama-2-7B", "h100-sxm", decode_contexts=[128], dtype="fp16")
    assert 3.7e-3 < cost.time_s < 4.3e-3
    assert cost.bound == "memory"
    # the weights are nearly all of it; the embedding table (32000 x 4096) is not read, only one row
    assert cost.weight_bytes == pytest.approx((6_738_415_616 - 32000 * 4096 + 4096) * 2, rel=1e-9)


def test_decode_intensity_is_about_one_at_batch_1_and_grows_with_batch() -> None:
    model = get_model("Llama-2-7B", "h100-sxm", dtype="fp16")
    # 2 FLOPs per parameter per token over 2 bytes per parameter: ~1 FLOP/byte
    i1 = model.decode([128]).intensity
    assert 0.9 < i1 < 1.1
    # short contexts: the weights are shared, so intensity ~ batch (at context 16 each sequence adds only
    # 16 x 512 KiB of KV and ~12 MB of activations to the 13.2 GB of weights)
    for batch in (2, 8, 32):
        assert model.decode([16] * batch).intensity == pytest.approx(batch * i1, rel=0.1)
    # long contexts: each sequence reads its own 4096 x 512 KiB = 2.1 GB of KV for ~2 x 6.6 GFLOP of
    # projections + 4 x 4096 x 4096 x 32 = 2.1 GFLOP of attention: intensity tends to ~15.3 / 2.15 ~ 7.1
    i64_long = model.decode([4096] * 64).intensity
    assert 5.5 < i64_long < 7.2
    assert model.decode_compute_bound_batch(4096) is None  # MHA decode at 4k context never becomes compute-bound


def test_decode_compute_bound_batch_is_where_the_step_turns() -> None:
    model = get_model("Llama-3.1-8B", "h100-sxm", dtype="bf16")
    batch = model.decode_compute_bound_batch(64)
    assert batch is not None
    # weights alone would give balance * (weight bytes / 2 / FLOPs per token) ~ the balance point (295);
    # activations through memory push it above, but not by more than 2x
    assert 295 <= batch <= 600
    assert model.decode([64] * batch, detailed=False).bound == "compute"
    assert model.decode([64] * (batch - 1), detailed=False).bound == "memory"


@pytest.mark.parametrize("preset", TINY_PRESETS)
@pytest.mark.parametrize("prefill_chunks,decode_contexts", STEPS)
def test_fast_path_and_reference_agree(preset: str, prefill_chunks: list, decode_contexts: list) -> None:
    cfg = ModelConfig.from_name(preset)
    model = RooflineModel(cfg, TOY_HW, dtype="bf16", kv_dtype="fp8")
    detailed = model.step_cost(prefill_chunks, decode_contexts)
    ref = reference_step_cost(cfg, prefill_chunks, decode_contexts, dtype="bf16", kv_dtype="fp8")
    assert [op.name for op in detailed.ops] == list(LAYER_OPS + MODEL_OPS)
    for op in detailed.ops:
        for field in ("flops", "weight_bytes", "kv_bytes", "act_bytes"):
            assert getattr(op, field) == pytest.approx(ref[op.name][field], rel=1e-12, abs=1e-9), (op.name, field)
        # the toy machine's matmul and vector peaks are both 1 TFLOP/s
        assert op.time_s == pytest.approx(max(op.flops / 1e12, op.bytes / 1e9), rel=1e-12)
    assert model.step_time(prefill_chunks, decode_contexts) == pytest.approx(detailed.time_s, rel=1e-12)
    assert sum(op.time_s for op in detailed.ops) == pytest.approx(detailed.time_s, rel=1e-12)


def test_mixed_step_is_the_sum_of_its_parts_where_it_should_be() -> None:
    cfg = ModelConfig.from_name("bench-300m")
    model = RooflineModel(cfg, "h100-sxm", dtype="bf16")
    chunks, contexts = [(256, 0), (128, 512)], [100, 2000, 37]
    mixed = model.step_cost(chunks, contexts)
    pre = model.step_cost(chunks, ())
    dec = model.step_cost((), contexts)
    # FLOPs, KV bytes and activation bytes add up
    assert mixed.flops == pytest.approx(pre.flops + dec.flops, rel=1e-12)
    assert mixed.kv_bytes == pytest.approx(pre.kv_bytes + dec.kv_bytes, rel=1e-12)
    assert mixed.act_bytes == pytest.approx(pre.act_bytes + dec.act_bytes, rel=1e-12)
    # but the weights are read once: every matrix except the embedding table (tied: the LM head reads it),
    # plus one embedding row per new token
    static = (cfg.num_params(include_embeddings=False) + cfg.vocab_size * cfg.hidden_size) * 2
    assert dec.weight_bytes == pytest.approx(static + 3 * cfg.hidden_size * 2)
    assert mixed.weight_bytes == pytest.approx(pre.weight_bytes + dec.weight_bytes - static, rel=1e-12)
    # per-op times of a mixed step are at most those of the parts run separately
    assert mixed.time_s <= pre.time_s + dec.time_s


def test_decode_is_a_one_token_prefill_chunk() -> None:
    model = RooflineModel(ModelConfig.from_name("tiny-gqa"), TOY_HW)
    a = model.step_cost((), [10, 3])
    b = model.step_cost([(1, 9), (1, 2)], ())
    assert a.to_dict() == b.to_dict()


def test_kv_dtype_and_kv_heads_scale_kv_bytes() -> None:
    cfg = ModelConfig.from_name("Llama-3.1-8B")
    bf16 = step_cost(cfg, "h200", decode_contexts=[1000] * 4, dtype="bf16", kv_dtype="bf16")
    fp8 = step_cost(cfg, "h200", decode_contexts=[1000] * 4, dtype="bf16", kv_dtype="fp8")
    assert fp8.kv_bytes == pytest.approx(bf16.kv_bytes / 2)
    mha = step_cost(cfg.with_overrides(num_kv_heads=32), "h200", decode_contexts=[1000] * 4)
    assert mha.kv_bytes == pytest.approx(4 * bf16.kv_bytes)  # 32 KV heads instead of 8
    # reads per decode step: K and V of 1000 tokens x 4 sequences x 32 layers x 8 heads x 128 x 2 bytes
    reads = 2 * 1000 * 4 * 32 * 8 * 128 * 2
    writes = 2 * 4 * 32 * 8 * 128 * 2
    assert bf16.kv_bytes == reads + writes


def test_utilization_by_hand() -> None:
    cost = step_cost("tiny-mha", TOY_HW, decode_contexts=[8], dtype="bf16")
    util = utilization(cost, 2e-3, TOY_HW, "bf16")
    # MBU counts what decode must read, weights and KV, not the activations
    assert cost.act_bytes > 0
    assert util.mbu == pytest.approx((cost.weight_bytes + cost.kv_bytes) / 2e-3 / 1e9)
    assert util.mfu == pytest.approx(cost.flops / 2e-3 / 1e12)
    with pytest.raises(ConfigError):
        utilization(cost, 0.0, TOY_HW)


def test_errors_name_the_problem() -> None:
    model = RooflineModel(small_cfg(), TOY_HW)
    with pytest.raises(ConfigError, match="num_new"):
        model.step_cost([(0, 3)], ())
    with pytest.raises(ConfigError, match="context"):
        model.step_cost((), [0])
    with pytest.raises(ConfigError, match="dtype"):
        RooflineModel(small_cfg(), TOY_HW, dtype="fp13")
    with pytest.raises(ConfigError, match="unknown hardware"):
        get_model("tiny-mha", "tpu-v9")
    with pytest.raises(ConfigError, match="batch"):
        phase_report("tiny-mha", TOY_HW, batch=0, prompt_len=4, context_len=4)
    assert model.step_cost((), ()).time_s == 0.0


def test_roofline_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["roofline", "--model", "tiny-gqa", "--hardware", "h200", "--batch", "3", "--prompt-len", "20",
            "--context-len", "50", "--dtype", "fp16", "--kv-cache-dtype", "fp8", "--json"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    for phase in ("prefill", "decode"):
        for key in ("flops", "bytes", "time_s", "intensity", "ops"):
            assert key in data[phase]
        for op in data[phase]["ops"]:
            assert set(op) >= {"name", "flops", "bytes", "intensity", "bound", "time_s"}
            assert op["bound"] in ("compute", "memory", "floor")  # tiny ops of the calibrated default hit the floor
        assert sum(op["flops"] for op in data[phase]["ops"]) == pytest.approx(data[phase]["flops"])
        assert sum(op["time_s"] for op in data[phase]["ops"]) == pytest.approx(data[phase]["time_s"])
    cfg = ModelConfig.from_name("tiny-gqa")
    # prefill: 3 prompts of 20 tokens; decode: 3 sequences at context 50
    assert data["prefill"]["num_tokens"] == 60 and data["decode"]["num_tokens"] == 3
    scores = next(op for op in data["prefill"]["ops"] if op["name"] == "attn_scores")
    assert scores["flops"] == cfg.num_layers * 2 * cfg.q_size * 3 * (20 * 21 // 2)
    assert data["balance_point"] == pytest.approx(989.5 / 4.8, rel=1e-6)


def test_roofline_table_and_unknown_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "--model", "tiny-mqa", "--hardware", "l4", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "lm_head" in out and "ITL floor" in out
    assert main(["roofline", "--model", "tiny-mqa", "--hardware", "nope"]) == 2
    err = capsys.readouterr().err
    assert "h100-sxm" in err and "measured" in err


def test_roofline_imports_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, workbench.roofline, workbench.kv.sizing, workbench.hardware, workbench.commands.roofline;"
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_time_is_finite_and_positive_on_every_table_hardware() -> None:
    from workbench.hardware import hardware_names

    for name in hardware_names():
        if name == "measured":
            continue
        cost = step_cost("tiny-gqa", get_hardware(name), [(32, 0)], [16, 40], dtype="bf16")
        assert math.isfinite(cost.time_s) and cost.time_s > 0


def test_step_work_counts_without_a_hardware_spec() -> None:
    """The counts of ``step_work`` are the priced model's on any spec, and a decode reads every weight once."""
    from workbench.roofline import RooflineModel, step_work

    cfg = ModelConfig.from_name("Llama-3.1-8B")
    for chunks, decodes in (([(512, 0), (64, 100)], [40, 7]), ([], [1024] * 8)):
        work = step_work(cfg, "bf16", chunks, decodes)
        for hw in ("h100-sxm", "a100-80gb"):
            cost = RooflineModel(cfg, hw, dtype="bf16").step_cost(chunks, decodes, detailed=False)
            assert (work.flops, work.weight_bytes, work.kv_bytes, work.act_bytes) == pytest.approx(
                (cost.flops, cost.weight_bytes, cost.kv_bytes, cost.act_bytes)
            )
    # a batch-1 decode reads every weight once but only one row of the (untied) embedding table, in bf16
    decode = step_work(cfg, "bf16", decode_contexts=[1])
    assert decode.weight_bytes == cfg.weight_bytes("bf16") - (cfg.vocab_size - 1) * cfg.hidden_size * 2


def test_speculative_verify_step_by_hand() -> None:
    """A verify step of one sequence at context 3 with k = 2 proposals: 3 query tokens (positions 2, 3, 4) over 2
    cached, fp32, counted by hand on the small config (h=8, q=8, kv=4, V=10, 2 layers, 2 heads)."""
    from workbench.engine.speculative import expected_speedup, expected_tokens_per_step

    model = get_model(small_cfg(), TOY_HW, dtype="fp32")
    cost = model.verify([3], 2)
    ops = {op.name: op for op in cost.ops}
    e, layers = 4, 2
    assert (cost.num_tokens, cost.num_seqs) == (3, 1)
    assert ops["q_proj"].flops == layers * 2 * 8 * 8 * 3
    assert ops["lm_head"].flops == 2 * 8 * 10 * 3  # logits at all 3 positions
    # the same weights as a decode, plus two more embedding rows of 8
    assert cost.weight_bytes == model.decode([3]).weight_bytes + 2 * 8 * e
    # KV: write 3 tokens' K and V (2 x 3 x 4), read K and V of 5 tokens (2 x 5 x 4), per layer
    assert cost.kv_bytes == layers * (2 * 3 * 4 + 2 * 5 * 4) * e
    # pairs: the 3 queries see 3, 4 and 5 keys = 12; 2 heads x 2 * head_dim 4 FLOPs each
    assert ops["attn_scores"].flops == layers * 2 * (2 * 4) * 12
    assert model.verify([5, 9], 0).to_dict() == model.decode([5, 9]).to_dict()
    # Leviathan et al.'s expected tokens per step and the speed-up it buys
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, decode_s=1.0, verify_s=1.0) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, decode_s=1.0, verify_s=1.2, draft_step_s=0.1) == pytest.approx(3.3616 / 1.6)


def test_a_weight_only_product_ramps_over_one_tensor_core_tile_by_hand() -> None:
    """int8/int4 weight-only products (tinygemm, Marlin) reach ``max * M / (M + min(half, 16))`` of the peak: at batch
    1 a Llama-2-7B q_proj is priced as 17 rows' work, not the 65 of a bf16 GEMM on a 64-row ramp (on a machine whose
    memory is free, so the compute time is the op's time)."""
    from dataclasses import replace

    from workbench.hardware import Calibration

    cal = Calibration(linear_max=0.5, linear_half_tokens=64)
    fast_memory = replace(TOY_HW, mem_bandwidth=1e30)
    llama = ModelConfig.resolve("Llama-2-7B")
    flops = 32 * 2 * 4096 * 4096  # one decode token through 32 layers' q_proj
    for quant, half in ((None, 64), ("int8", 16), ("int4", 16)):
        m = RooflineModel(llama, fast_memory, quantization=quant, group_size=128, calibration=cal)
        q_proj = next(op for op in m.decode([10]).ops if op.name == "q_proj")
        assert q_proj.flops == flops and q_proj.bound == "compute"
        assert q_proj.time_s == pytest.approx(flops / (1e12 * 0.5 / (1 + half)), rel=1e-9), quant
    # a ramp already shorter than the tile is kept (the ideal roofline has none)
    short = Calibration(linear_max=0.5, linear_half_tokens=4)
    m = RooflineModel(llama, fast_memory, quantization="int4", group_size=128, calibration=short)
    q_proj = next(op for op in m.decode([10]).ops if op.name == "q_proj")
    assert q_proj.time_s == pytest.approx(flops / (1e12 * 0.5 / 5), rel=1e-9)
