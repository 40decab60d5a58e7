"""The simulator's own speed (``workbench bench simulator``): requests simulated per wall second and microseconds per
scheduler step on a whole trace, timed with ``workbench.timing`` (loading the trace excluded, the summary included).
"""

from __future__ import annotations

from typing import Any

from workbench.config import ModelConfig
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import RooflineCostModel
from workbench.timing import now
from workbench.workloads import load_workload


def simulator_speed(
    trace: str, model: str, hardware: str, policy: str = "continuous", limit: int | None = None, profiler: Any = None
) -> dict[str, Any]:
    """Simulate ``trace`` (its first ``limit`` requests) for ``model`` on ``hardware`` with the roofline cost model:
    ``wall_s``, ``simulate_s``, ``summary_s``, ``requests_per_wall_s``, ``num_steps``, ``us_per_step``,
    ``bulk_step_fraction`` (steps advanced in bulk), the simulated duration, TTFT and ITL medians, preemptions and
    ``num_rejected`` (rows beyond ``max_model_len``: rejected and counted as at every entry point, never clipped).
    ``profiler``: a ``cProfile.Profile`` enabled around the simulation and its summary."""
    cfg = ModelConfig.resolve(model)
    config = SimConfig(policy=policy)
    requests = load_workload(trace, limit=limit)  # rows beyond max_model_len are rejected as they run, never clipped
    cost = RooflineCostModel(cfg, hardware)
    t0 = now()
    if profiler is not None:
        profiler.enable()
    result = simulate(requests, cfg, cost, config, hardware=hardware)
    sim_s = now() - t0
    summary = result.summary()
    wall = now() - t0
    if profiler is not None:
        profiler.disable()
    bulk = sum(r["num_bulk_steps"] for r in result.replicas)
    return {
        "trace": trace, "model": cfg.name, "hardware": hardware, "policy": policy,
        "num_requests": len(requests), "wall_s": wall, "simulate_s": sim_s, "summary_s": wall - sim_s,
        "requests_per_wall_s": len(requests) / wall, "num_steps": result.num_steps,
        "us_per_step": 1e6 * wall / result.num_steps, "bulk_step_fraction": bulk / result.num_steps,
        "simulated_duration_s": result.duration_s,
        "ttft_median_s": summary["metrics"]["ttft_s"]["median"], "itl_median_s": summary["metrics"]["itl_s"]["median"],
        "num_preemptions": summary["num_preemptions"], "num_rejected": len(result.rejected),
    }  # fmt: skip
