"""Expert parallelism and MoE / MLA models in the simulator and the planner: per-GPU bytes and pool by hand, the
all-to-all's time on a toy link, the decode fast path against the step-by-step roofline, refused layouts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.conftest import one_line_error
from workbench.cli import main
from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.hardware import Calibration, HardwareSpec, Interconnect, get_hardware
from workbench.roofline import RooflineModel
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import RooflineCostModel, decode_stats
from workbench.sim.planner import Candidate, candidates
from workbench.workloads import synthetic_workload

MIXTRAL = ModelConfig.from_name("Mixtral-8x7B")
# Mixtral-8x7B: everything but the routed experts (embedding, LM head, final norm; per layer q, o, k, v, router and
# two norms), and one expert's gate, up and down
NON_EXPERT = 2 * 32000 * 4096 + 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 8 * 4096 + 2 * 4096)
EXPERT = 3 * 4096 * 14336

# round numbers: links of 1 GB/s in a server of 8, 10 us per collective
TOY_IC = Interconnect("toy-link", 1e9, 1e8, 1e-5, 1e-6, 2e-6, 8)
TOY_HW = HardwareSpec(name="toy-ep", peak_flops={"fp32": 1e15, "bf16": 1e15}, mem_bandwidth=1e12, mem_capacity=8e10,
                      source="test", interconnect=TOY_IC)  # fmt: skip


def test_pool_of_an_expert_parallel_replica_by_hand():
    """EP 8: each GPU holds every non-expert weight and one expert per layer, and the KV of its own sequences;
    the replica's pool is eight GPUs' blocks (KV per token: 32 layers x 2 x 8 heads x 128 x 2 bytes)."""
    config = SimConfig(expert_parallel_size=8, block_size=16)
    weights = (NON_EXPERT + 32 * EXPERT) * 2
    per_gpu = int((80e9 * 0.9 - weights) // (16 * 32 * 2 * 8 * 128 * 2))
    assert config.resolved_num_blocks(MIXTRAL, TOY_HW) == 8 * per_gpu
    assert config.num_gpus == 8
    small = dataclasses.replace(TOY_HW, mem_capacity=4e10)  # 4 experts per layer: 48 GB > 36 GB
    with pytest.raises(ConfigError, match="does not fit on toy-ep .* expert_parallel_size 2"):
        SimConfig(expert_parallel_size=2).resolved_num_blocks(MIXTRAL, small)


def test_sim_config_refuses_ep_with_tensor_parallelism():
    with pytest.raises(ConfigError, match="needs tensor_parallel_size 1"):
        SimConfig(expert_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="expert_parallel_size must be a positive integer"):
        SimConfig(expert_parallel_size=0)


def test_all_to_all_time_on_a_toy_link():
    """Ideal roofline on the toy part: each MoE layer adds two all-to-alls of 10 us + 7/8 of the GPU's buffer
    (its 2 tokens x 2 experts x 4096 values x 2 bytes) at 1 GB/s, in all 32 layers."""
    ep8 = RooflineModel(MIXTRAL, TOY_HW, expert_parallel_size=8)
    op = {o.name: o for o in ep8.decode([10] * 16).ops}["moe_all_to_all"]
    held = 2 * 2 * 4096 * 2
    assert op.time_s == pytest.approx(32 * 2 * (1e-5 + 7 / 8 * held / 1e9), rel=1e-12)
    assert op.link_bytes == pytest.approx(32 * 2 * 7 / 8 * held, rel=1e-12)
    assert op.count == 64


@pytest.mark.parametrize(("name", "ep"), [("Mixtral-8x7B", 1), ("Mixtral-8x7B", 8), ("DeepSeek-V3", 16)])
def test_decode_fast_path_equals_the_step_time(name, ep):
    """The simulator's piecewise-linear decode path keeps the distinct-experts term: equal to the step time."""
    cost = RooflineCostModel(name, "h200", calibration="hardware", expert_parallel_size=ep)
    for n, context in ((1, 7), (3, 500), (40, 40 * 900), (256, 256 * 2000)):
        assert cost.decode_time(n, context) == pytest.approx(cost.step_time(decode_stats(n, context)), rel=1e-9)


def test_simulate_runs_an_expert_parallel_moe_and_reports_the_layout():
    cfg = ModelConfig.from_name("DeepSeek-V3")
    requests = synthetic_workload(12, rate=50.0, prompt_lens="uniform:32:256", output_lens="uniform:4:32", seed=0)
    config = SimConfig(expert_parallel_size=16)
    cost = RooflineCostModel(cfg, "h200", expert_parallel_size=16, calibration=Calibration())
    result = simulate(requests, cfg, cost, config, hardware="h200")
    assert result.replicas[0]["expert_parallel_size"] == 16 and len(result.records) == 12
    assert result.summary()["num_finished"] == 12


def test_simulate_cli_refuses_impossible_layouts(capsys):
    base = ["simulate", "--trace", "poisson:5", "--num-requests", "4", "--hardware", "h100-sxm"]
    rc = main([*base, "--model", "Mixtral-8x7B", "--expert-parallel-size", "3"])
    one_line_error(capsys, rc, "expert_parallel_size 3 must divide Mixtral-8x7B's 8 routed experts")
    rc = main([*base, "--model", "Llama-3.1-8B", "--expert-parallel-size", "2"])
    one_line_error(capsys, rc, "dense model")
    rc = main([*base, "--model", "Mixtral-8x7B", "--expert-parallel-size", "16"])
    one_line_error(capsys, rc, "must divide Mixtral-8x7B's 8 routed experts")


def test_simulate_cli_mixtral_json(capsys):
    rc = main(["simulate", "--model", "Mixtral-8x7B", "--hardware", "h100-sxm", "--trace", "poisson:5",
               "--num-requests", "8", "--expert-parallel-size", "8", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["num_finished"] == 8
    assert out["cost_model"]["expert_parallel_size"] == 8 and out["replicas"][0]["expert_parallel_size"] == 8


def test_plan_candidates_with_expert_parallelism():
    found = candidates(16, tps=(1, 2), pps=(1, 2), policies=("continuous",), disaggregated=False,
                       expert_parallel_size=8)  # fmt: skip
    assert {(c.tp, c.pp, c.replicas, c.ep) for c in found} == {(1, 1, 1, 8), (1, 1, 2, 8), (1, 2, 1, 8)}
    assert Candidate(pp=2, ep=8).num_gpus == 16 and Candidate(ep=8, replicas=2).name == "2xTP1xEP8 continuous"
    with pytest.raises(ConfigError, match="expert_parallel_size 16 needs 16 GPUs per replica .* the 8 GPU"):
        candidates(8, expert_parallel_size=16)
    with pytest.raises(ConfigError, match="needs tensor-parallel size 1"):
        candidates(8, tps=(2, 4), expert_parallel_size=2)


def test_plan_cli_refuses_ep_beyond_the_gpus(capsys):
    rc = main(["plan", "--model", "Mixtral-8x7B", "--num-gpus", "4", "--slo-ttft", "1", "--slo-tpot", "0.1",
               "--trace", "poisson:1", "--num-requests", "4", "--serial", "--expert-parallel-size", "8"])  # fmt: skip
    one_line_error(capsys, rc, "expert_parallel_size 8 needs 8 GPUs per replica", "4 GPU(s)")


def test_hardware_without_interconnect_refuses_ep():
    cpu = HardwareSpec(name="no-link", peak_flops={"fp32": 1e12}, mem_bandwidth=1e11, mem_capacity=1e12, source="t")
    with pytest.raises(ConfigError, match="expert parallelism"):
        RooflineModel(MIXTRAL, cpu, expert_parallel_size=2)
    assert get_hardware("h200").interconnect is not None
