"""``workbench replay``: serve a workload on the real engine in real time and report serving metrics.

    workbench replay --model PRESET_OR_PATH --trace NAME_OR_FILE [--limit N] [--rate-scale X] [--time-scale X]
        [--policy P] [engine options] [--slo-ttft S] [--slo-tpot S] [--slo-e2el S] [--json]

Traces: ``azure-code``, ``azure-conv``, ``mooncake-conversation``, ``mooncake-synthetic``, ``poisson:RATE``
(``gamma:RATE:CV``), or a file. Requests are clipped to the engine's ``max_model_len`` and get deterministic random
prompt ids (equal Mooncake hash ids give equal blocks). Each request generates exactly its trace output length.
With ``--json``: one object with ``num_requests``, ``num_finished``, ``num_preemptions``, ``metrics`` (``ttft_s``,
``tpot_s``, ``itl_s``, ``e2el_s`` each with ``mean``, ``median``, ``p90``, ``p95``, ``p99``; ``request_throughput``,
``output_throughput``, ``goodput``, ``slo_attainment``), plus ``rejected`` (id and reason of each rejected request)
and the engine configuration.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from workbench.commands.generate import add_engine_arguments, add_model_arguments, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--trace", required=True, help="azure-code | azure-conv | mooncake-conversation | "
                   "mooncake-synthetic | poisson:RATE | gamma:RATE:CV | a .csv/.jsonl file")  # fmt: skip
    p.add_argument("--limit", type=int, default=None, help="first N requests")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the request rate (compress time)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply inter-arrival times")
    p.add_argument("--num-requests", type=int, default=100, help="synthetic traces: number of requests")
    p.add_argument("--prompt-lens", default="uniform:16:256", help="synthetic traces: prompt length distribution")
    p.add_argument("--output-lens", default="uniform:8:64", help="synthetic traces: output length distribution")
    p.add_argument("--trace-seed", type=int, default=0, help="seed of synthetic arrivals, lengths and prompt ids")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds (goodput)")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds (goodput)")
    p.add_argument("--slo-e2el", type=float, default=None, help="end-to-end latency SLO in seconds (goodput)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from workbench.engine.engine import Engine
    from workbench.workloads import load_workload

    config = engine_config_from_args(args)
    engine = Engine.from_model(args.model, config, seed=args.model_seed)
    max_len = engine.scheduler.config.max_model_len
    requests = load_workload(
        args.trace, limit=args.limit, time_scale=args.time_scale, rate_scale=args.rate_scale, max_len=max_len,
        num_requests=args.num_requests, prompt_lens=args.prompt_lens, output_lens=args.output_lens,
        seed=args.trace_seed,
    )  # fmt: skip
    result = engine.replay(requests, seed=args.trace_seed)
    summary = result.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, slo_e2el_s=args.slo_e2el)
    summary["rejected"] = [
        {"request_id": r.request_id, "reason": r.reject_reason}
        for r in result.requests
        if r.finish_reason == "rejected"
    ]
    summary["engine"] = asdict(config)
    summary["model"] = str(args.model)
    summary["trace"] = args.trace
    if args.json:
        print(json.dumps(summary))
        return 0
    m = summary["metrics"]
    print(f"{summary['num_finished']}/{summary['num_requests']} finished, {summary['num_preemptions']} preemptions, "
          f"{summary['duration_s']:.2f} s")  # fmt: skip
    for key in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        s = m[key]
        print(f"  {key:7s} mean {s['mean'] * 1e3:9.2f} ms  median {s['median'] * 1e3:9.2f} ms  "
              f"p99 {s['p99'] * 1e3:9.2f} ms")  # fmt: skip
    print(f"  throughput {m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} tok/s; "
          f"goodput {m['goodput']:.2f} req/s ({m['slo_attainment']:.0f}% within SLOs)")  # fmt: skip
    return 0
