"""Simulator speed: requests simulated per wall second and microseconds per scheduler step on a whole trace.

    .venv/bin/python scripts/sim_speed.py [--trace azure-conv] [--model Llama-3.1-8B] [--hardware h100-sxm]
        [--policy continuous] [--limit N] [--profile]

Prints one JSON object: wall_s (loading the trace excluded, summary included), requests_per_wall_s,
num_steps, us_per_step, the share of steps advanced in bulk, and the simulated TTFT/ITL medians. ``--profile``
prints the top of a cProfile of the simulation to stderr.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time

from workbench.config import ModelConfig
from workbench.parsing import make_parser
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import RooflineCostModel
from workbench.workloads import load_workload


def main() -> int:
    p = make_parser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--model", default="Llama-3.1-8B")
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--policy", default="continuous")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    cfg = ModelConfig.resolve(args.model)
    config = SimConfig(policy=args.policy)
    requests = load_workload(args.trace, limit=args.limit, max_len=config.resolved_max_model_len(cfg))
    cost = RooflineCostModel(cfg, args.hardware)
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    result = simulate(requests, cfg, cost, config, hardware=args.hardware)
    sim_s = time.perf_counter() - t0
    summary = result.summary()
    wall = time.perf_counter() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    bulk = sum(r["num_bulk_steps"] for r in result.replicas)
    print(json.dumps({
        "trace": args.trace, "model": cfg.name, "hardware": args.hardware, "policy": args.policy,
        "num_requests": len(requests), "wall_s": wall, "simulate_s": sim_s, "summary_s": wall - sim_s,
        "requests_per_wall_s": len(requests) / wall, "num_steps": result.num_steps,
        "us_per_step": 1e6 * wall / result.num_steps, "bulk_step_fraction": bulk / result.num_steps,
        "simulated_duration_s": result.duration_s,
        "ttft_median_s": summary["metrics"]["ttft_s"]["median"], "itl_median_s": summary["metrics"]["itl_s"]["median"],
        "num_preemptions": summary["num_preemptions"],
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
