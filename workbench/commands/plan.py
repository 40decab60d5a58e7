"""``workbench plan``: the deployment of a model on N GPUs with the most goodput per GPU on a trace.

    workbench plan --model M --hardware H --num-gpus N --trace T --slo-ttft S --slo-tpot S [--json]
        [--ray-address ADDR | --serial] [--tp 1,2,4,8] [--pp 1,2] [--policies continuous,chunked]
        [--chunk-sizes 512,2048] [--expert-parallel-size N] [--no-disaggregate] [--max-replicas-only]
        [format and calibration options]

Searches replicas x TP x PP x (colocated | P:D with each side's TP) x policy x chunk size
(``workbench.sim.planner``), simulating the trace on each candidate, in parallel on Ray (a local Ray of
``--num-cpus`` CPUs unless ``--ray-address`` joins a cluster; ``--serial`` runs in this process, with the same
results). Prints the best configurations and the Pareto table (goodput per GPU, GPUs, p90 TTFT, p90 TPOT), or with
``--json`` one object: ``best``, ``pareto``, ``rows`` (every candidate, skipped ones with their reason), ``wall_s``.

A trace row whose prompt + output exceeds ``max_model_len`` is rejected, as everywhere (``workbench.request.
validate_request``; never capped): the plan is made on the others, and ``num_rejected``, ``first_rejected`` and
``rejected`` say which (one line on stderr too).
"""

from __future__ import annotations

import argparse
import json

from workbench.commands.common import add_serving_arguments, add_trace_arguments, slo_seconds
from workbench.commands.sim_args import add_calibration_arguments, add_expert_parallel_argument, add_format_arguments
from workbench.errors import ConfigError


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{option} takes comma-separated positive integers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or config.json")
    p.add_argument("--hardware", default="h100-sxm", help="accelerator name (default h100-sxm)")
    p.add_argument("--num-gpus", type=int, required=True, help="GPUs to deploy on (at most)")
    add_trace_arguments(p, num_requests_default=1000, prompt_lens_default="uniform:64:1024",
                        output_lens_default="uniform:16:256")  # fmt: skip
    p.add_argument("--slo-ttft", type=slo_seconds("--slo-ttft", "ttft"), required=True, metavar="S",
                   help="TTFT SLO in seconds")  # fmt: skip
    p.add_argument("--slo-tpot", type=slo_seconds("--slo-tpot", "tpot"), required=True, metavar="S",
                   help="TPOT SLO in seconds")  # fmt: skip
    add_format_arguments(p)
    add_calibration_arguments(p)
    s = p.add_argument_group("search")
    s.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes to try (default 1,2,4,8)")
    s.add_argument("--pp", default="1,2", help="pipeline-parallel sizes to try (default 1,2)")
    add_expert_parallel_argument(s)
    s.add_argument("--policies", default="continuous,chunked", help="scheduling policies to try")
    s.add_argument("--chunk-sizes", default="512,2048", help="chunked policy: chunk sizes (token budgets) to try")
    s.add_argument("--no-disaggregate", action="store_true", help="colocated deployments only")
    s.add_argument("--max-replicas-only", action="store_true",
                   help="each shape with as many replicas as fit, not 1 .. that many")  # fmt: skip
    from workbench.sim.cluster import SimConfig

    add_serving_arguments(s, SimConfig, ("max_model_len",))  # the one config's flag, help and default
    s.add_argument("--link-gbps", type=float, default=400.0, help="disaggregated KV link per GPU, Gb/s")
    r = p.add_argument_group("execution")
    r.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    r.add_argument("--num-cpus", type=int, default=2, help="local Ray: CPUs (default 2)")
    r.add_argument("--serial", action="store_true", help="simulate in this process, one after another")
    r.add_argument("--top", type=int, default=5, help="best configurations to print")
    p.add_argument("--json", action="store_true", help="print one JSON object")


RAY_CONNECT_TIMEOUT_S = 5.0


def check_ray_args(address: str | None, num_cpus: int) -> None:
    """ConfigError before Ray starts: a local Ray needs a CPU per task (``--num-cpus 0`` would wait forever), and a
    ``HOST:PORT`` cluster address must accept a TCP connection within ``RAY_CONNECT_TIMEOUT_S`` (Ray itself retries
    an unreachable address for minutes)."""
    import socket

    if address is None:
        if num_cpus < 1:
            raise ConfigError(f"--num-cpus must be >= 1 (each candidate runs as a 1-CPU Ray task), got {num_cpus}")
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local" or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(
            f"--ray-address {address}: nothing accepts connections there ({exc.strerror or exc}); start the cluster "
            "(ray start --head) or drop --ray-address for a local Ray"
        ) from None


def run(args: argparse.Namespace) -> int:
    import sys

    from workbench.commands.common import add_rejections, reject_beyond_context
    from workbench.commands.sim_args import format_kwargs
    from workbench.config import ModelConfig
    from workbench.engine.config import ServingConfig
    from workbench.hardware import get_hardware
    from workbench.sim.planner import PlanSettings, candidates, plan
    from workbench.workloads import load_workload

    formats = format_kwargs(args)
    if not args.serial:
        check_ray_args(args.ray_address, args.num_cpus)
    get_hardware(args.hardware)
    cfg = ModelConfig.resolve(args.model)
    if args.step_overhead_s is not None and args.step_overhead_s < 0:
        raise ConfigError(f"--step-overhead-s must be >= 0, got {args.step_overhead_s}")
    settings = PlanSettings(
        model=args.model, hardware=args.hardware, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
        dtype=formats["dtype"], quantization=formats["quantization"], kv_cache_dtype=formats["kv_cache_dtype"],
        calibration=args.calibration, step_overhead_s=args.step_overhead_s, max_model_len=args.max_model_len,
        link_gbps=args.link_gbps, seed=args.trace_seed,
    )  # fmt: skip
    search = candidates(
        args.num_gpus, _ints(args.tp, "--tp"), _ints(args.pp, "--pp"),
        [p for p in args.policies.split(",") if p], _ints(args.chunk_sizes, "--chunk-sizes"),
        disaggregated=not args.no_disaggregate, all_replica_counts=not args.max_replicas_only,
        expert_parallel_size=args.expert_parallel_size,
    )  # fmt: skip
    trace = load_workload(args.trace, limit=args.limit, time_scale=args.time_scale, rate_scale=args.rate_scale,
                          num_requests=args.num_requests, prompt_lens=args.prompt_lens,
                          output_lens=args.output_lens, seed=args.trace_seed)  # fmt: skip
    max_len = ServingConfig(max_model_len=args.max_model_len).resolved_max_model_len(cfg)
    requests, rejected = reject_beyond_context(trace, max_len)  # the one rule: rejected and counted, never capped
    if not requests:
        raise ConfigError(f"all {len(rejected)} requests of the trace exceed max_model_len {max_len}, so there is "
                          f"nothing to plan for; the first: {rejected[0]['reason']}")  # fmt: skip
    if rejected:
        print(f"workbench plan: {len(rejected)} of {len(trace)} requests rejected (planned on the others); the "
              f"first, request {rejected[0]['request_id']}: {rejected[0]['reason']}", file=sys.stderr)  # fmt: skip
    result = plan(requests, settings, args.num_gpus, search, parallel="serial" if args.serial else "ray",
                  ray_address=args.ray_address, num_cpus=args.num_cpus, top=args.top)  # fmt: skip
    out = result.to_dict()
    out.update(model=args.model, hardware=args.hardware, trace=args.trace, num_requests=len(trace),
               max_model_len=max_len)  # fmt: skip
    add_rejections(out, rejected)
    if args.json:
        print(json.dumps(out))
        return 0 if out["num_evaluated"] else 1
    print(f"plan: {args.model} on up to {args.num_gpus} x {args.hardware}, {args.trace} ({len(requests)} requests, "
          f"{len(rejected)} rejected), SLOs TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot:g} s; "
          f"{out['num_candidates']} candidates ({out['num_evaluated']} simulated) in {out['wall_s']:.1f} s "
          f"({result.parallel})")  # fmt: skip
    header = f"  {'deployment':36s} {'GPUs':>4s} {'goodput/GPU':>11s} {'SLO %':>6s} {'TTFT p90':>9s} {'TPOT p90':>9s}"

    def line(r: dict) -> str:
        return (f"  {r['name']:36s} {r['num_gpus']:4d} {r['goodput_per_gpu']:11.3f} {r['slo_attainment']:6.1f} "
                f"{r['ttft_p90_s'] * 1e3:7.1f}ms {r['tpot_p90_s'] * 1e3:7.1f}ms")  # fmt: skip

    print("best by goodput per GPU (requests/s within both SLOs, per GPU):")
    print(header)
    for r in result.best:
        print(line(r))
    print("Pareto front (goodput per GPU, GPUs, p90 TTFT, p90 TPOT):")
    print(header)
    for r in result.pareto:
        print(line(r))
    skipped = [r for r in result.rows if r["status"] != "ok"]
    if skipped:
        print(f"{len(skipped)} skipped, e.g. {skipped[0]['name']}: {skipped[0]['reason']}")
    return 0 if out["num_evaluated"] else 1
