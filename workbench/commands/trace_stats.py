"""``workbench trace-stats TRACE [--json]``: size, duration, rate, lengths and prefix sharing of a workload."""

from __future__ import annotations

import argparse
import json

from workbench.workloads import load_workload, trace_stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        help="azure-code, azure-conv, mooncake-conversation, mooncake-synthetic, poisson:RATE, gamma:RATE:CV, "
        "or a .csv/.jsonl file",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the request rate by X")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times by X")
    parser.add_argument("--max-len", type=int, default=None, help="clip prompt + output to this context")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="also draw length histograms and arrivals over time into FILE (.png, .svg)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    requests = load_workload(
        args.trace, limit=args.limit, time_scale=args.time_scale, rate_scale=args.rate_scale, max_len=args.max_len
    )
    stats = trace_stats(requests)
    stats["trace"] = args.trace
    if args.plot:
        from workbench import plots

        plots.use_file_backend()
        plots.save_figure(plots.plot_trace(requests, f"{args.trace}: {len(requests)} requests"), args.plot)
        stats["plot"] = args.plot
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"trace            {args.trace}")
    print(f"requests         {stats['num_requests']}")
    print(f"duration         {stats['duration_s']:.1f} s")
    print(f"request rate     {stats['request_rate']:.3f} req/s")
    for key in ("prompt_len", "output_len"):
        p = stats[key]
        print(
            f"{key:<16} mean {p['mean']:.0f}  p50 {p['p50']:.0f}  p90 {p['p90']:.0f}  p99 {p['p99']:.0f}  "
            f"max {p['max']:.0f} tokens"
        )
    ratio = stats["prefix_hit_ratio"]
    hit = "n/a (no hash ids)" if ratio is None else f"{ratio:.4f} (block level, unlimited cache)"
    print(f"prefix hit ratio {hit}")
    if args.plot:
        print(f"figure           {args.plot}")
    return 0
