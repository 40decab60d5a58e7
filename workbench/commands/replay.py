"""``workbench replay``: serve a workload on the real engine in real time and report serving metrics.

    workbench replay --model PRESET_OR_PATH --trace NAME_OR_FILE [--limit N] [--rate-scale X] [--time-scale X]
        [--policy P] [engine options] [--slo-ttft S] [--slo-tpot S] [--slo-e2el S] [--max-duration S] [--json]
        [--disaggregate P:D [--threads-per-engine N] [--prefill-tp N] [--decode-tp M]]

Traces: ``azure-code``, ``azure-conv``, ``mooncake-conversation``, ``mooncake-synthetic``, ``poisson:RATE``
(``gamma:RATE:CV``), or a file. Requests get deterministic random prompt ids (equal Mooncake hash ids give equal
blocks) and each generates exactly its trace output length; a row whose prompt + output exceeds ``max_model_len`` is
rejected, as any request (``workbench.request.validate_request``; never clipped), and the others are served.
With ``--json``: one object with ``num_requests``, ``num_finished``, ``num_preemptions``, ``metrics`` (``ttft_s``,
``tpot_s``, ``itl_s``, ``e2el_s`` each with ``mean``, ``median``, ``p90``, ``p95``, ``p99``; ``request_throughput``,
``output_throughput``, ``goodput``, ``slo_attainment``: null without an SLO), plus ``rejected`` (id and reason of
each rejected request), ``num_rejected`` and ``first_rejected`` (the first of them; stderr names it too), the
engine configuration and ``decode_compile_s`` (with ``--compile-decode``: the seconds each decode batch bucket took
to compile, before the replay's clock started).
Before it starts it prints the wall-clock span of the arrivals (stderr) and refuses a span beyond
``--max-duration`` (default one hour). The exit code is 1 when every request was rejected.

With ``--disaggregate P:D`` the trace goes through P prefill and D decode engines (``workbench.cluster.disagg``;
TTFT counts the KV transfer) and the object also holds ``kv_transfer`` (``bytes``, ``seconds``, ``num_transfers``,
``num_retries``, ``num_recomputed``, ``num_backpressure``), a ``requests`` list (``request_id``, ``prompt_len``,
``output_len``, ``kv_transfer_bytes``, ``kv_transfer_s``, ...) and ``pools``, each pool's step log. Each pool has its
own tensor-parallel size, ``--prefill-tp`` / ``--decode-tp`` (default ``--tensor-parallel-size``: the names and
meaning of ``simulate --disaggregate``), and ``--kv-cache-dtype int8|fp8`` moves the quantized KV with its scales.

Ctrl-C (SIGINT): the worker ranks (tensor-parallel, disaggregated) ignore it and are stopped by the driver; the
results of the requests that had finished are printed (the same layout, over those requests, with ``interrupted``
true and ``num_requests`` the trace's), then one line on stderr, exit code 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from workbench.commands.common import (
    add_rejections,
    add_slo_arguments,
    add_trace_arguments,
    all_rejected_exit_code,
    print_serving_metrics,
    progress_bar,
)
from workbench.commands.generate import add_engine_arguments, add_model_arguments, engine_config_from_args
from workbench.errors import ConfigError
from workbench.timing import now


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    add_trace_arguments(p, num_requests_default=100, prompt_lens_default="uniform:16:256",
                        output_lens_default="uniform:8:64")  # fmt: skip
    add_slo_arguments(p)
    p.add_argument("--max-duration", type=float, default=3600.0, metavar="S",
                   help="refuse a replay whose arrivals span more wall-clock seconds than this "
                   "(default 3600)")  # fmt: skip
    p.add_argument("--yes", action="store_true",
                   help=f"start a replay whose arrivals span more than {CONFIRM_S / 60:g} minutes of wall clock "
                   "(without it such a replay states its duration and stops)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


CONFIRM_S = 600.0  # a real-time replay longer than this (10 minutes) starts only with --yes


def check_span(requests: list, max_duration_s: float, yes: bool = True) -> float:
    """The replay's wall-clock span (its last arrival, s), printed to stderr before anything runs; a ConfigError
    naming ``--time-scale`` and ``--limit`` when it exceeds ``max_duration_s``, or (without ``yes``) ``CONFIRM_S``,
    stating the duration and asking for ``--yes``."""
    if not max_duration_s > 0:
        raise ConfigError(f"--max-duration must be a positive number of seconds, got {max_duration_s}")
    span = max((r.arrival_time_s for r in requests), default=0.0)
    if span > max_duration_s:
        raise ConfigError(
            f"the trace's arrivals span {span:.0f} s of wall clock, beyond --max-duration {max_duration_s:g} s; "
            "compress it with --time-scale (e.g. 0.01) or --rate-scale, take fewer requests with --limit, or raise "
            "--max-duration"
        )
    if span > CONFIRM_S and not yes:
        raise ConfigError(
            f"the trace's arrivals span {span:.0f} s ({span / 60:.0f} min) of wall clock, replayed in real time; pass "
            "--yes to start it, or compress it with --time-scale (e.g. 0.01) or --rate-scale, or take fewer "
            "requests with --limit"
        )
    print(f"workbench replay: {len(requests)} requests arriving over {span:.1f} s of wall clock", file=sys.stderr)
    return span


def _workload(args: argparse.Namespace) -> list[Any]:
    """The trace's requests as they are (a row beyond ``max_model_len`` is the engine's to reject), span checked."""
    from workbench.commands.common import TraceStream
    from workbench.workloads import load_workload

    requests = load_workload(
        args.trace, limit=args.limit, time_scale=args.time_scale, rate_scale=args.rate_scale,
        num_requests=args.num_requests, prompt_lens=args.prompt_lens, output_lens=args.output_lens,
        seed=args.trace_seed,
    )  # fmt: skip
    requests = list(TraceStream(iter(requests)))  # a TraceError for a trace without requests
    check_span(requests, args.max_duration, yes=args.yes)
    return requests


def run(args: argparse.Namespace) -> int:
    from workbench.commands.common import check_parallel_layout
    from workbench.config import ModelConfig
    from workbench.engine.engine import Engine

    config = engine_config_from_args(args)
    check_parallel_layout(args)
    max_len = config.resolved_max_model_len(ModelConfig.resolve(args.model))
    requests = _workload(args)
    if args.disaggregate:
        return _run_disaggregated(args, config, requests, max_len)
    engine = Engine.from_model(args.model, config, seed=args.model_seed)
    try:
        compile_s = engine.warmup_decode()  # --compile-decode: every batch bucket before the clock starts
        if compile_s:
            print(f"workbench replay: decode compiled for batches {sorted(compile_s)} in "
                  f"{sum(compile_s.values()):.1f} s", file=sys.stderr)  # fmt: skip
        with progress_bar(total=len(requests), desc="replay", unit="request") as bar:
            result = engine.replay(requests, seed=args.trace_seed, progress=bar)
    except KeyboardInterrupt as exc:
        duration = engine.now()
        engine.shutdown()
        _print_partial(args, getattr(exc, "partial", []), len(requests), duration)
        raise
    finally:
        engine.shutdown()
    summary = result.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, slo_e2el_s=args.slo_e2el)
    rejected = [r for r in result.requests if r.finish_reason == "rejected"]
    add_rejections(summary, [{"request_id": r.request_id, "reason": r.reject_reason} for r in rejected])
    summary["engine"] = asdict(config)
    summary["model"] = str(args.model)
    summary["trace"] = args.trace
    summary["max_model_len"] = max_len
    summary["decode_compile_s"] = compile_s
    summary["device"] = str(engine.model.device)
    summary |= result.extra  # speculative decoding's counters, when on
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"replay of {args.trace} on the real engine: model {args.model}, device {summary['device']}, "
              f"policy {config.policy}")  # fmt: skip
        print(f"{summary['num_finished']}/{summary['num_requests']} finished, {summary['num_preemptions']} "
              f"preemptions, {summary['duration_s']:.2f} s; max_model_len {max_len}, {summary['num_rejected']} "
              "request(s) rejected")  # fmt: skip
        print_serving_metrics(summary["metrics"])
    return all_rejected_exit_code("replay", summary)


def _print_partial(args: argparse.Namespace, finished: list[Any], num_requests: int, duration_s: float) -> None:
    """After Ctrl-C: the serving summary of the requests that had finished (``interrupted`` true; ``num_requests``
    is the trace's), as JSON or the table, before the command's one line and exit code 130."""
    from workbench.engine.metrics import summarize

    summary = summarize(finished, duration_s=duration_s, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                        slo_e2el_s=args.slo_e2el)  # fmt: skip
    summary |= {"num_requests": num_requests, "interrupted": True, "model": str(args.model), "trace": args.trace}
    summary["finished_request_ids"] = sorted(r.request_id for r in finished)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"replay of {args.trace} interrupted: {summary['num_finished']}/{num_requests} requests had finished "
              f"in {duration_s:.2f} s; their metrics:")  # fmt: skip
        print_serving_metrics(summary["metrics"])
    sys.stdout.flush()


def _run_disaggregated(args: argparse.Namespace, config: Any, trace: list[Any], max_len: int) -> int:
    """``replay --disaggregate P:D``: the same trace through prefill and decode engine processes; the colocated
    JSON plus ``kv_transfer``, a ``requests`` list and the per-pool step logs (``pools``)."""
    from workbench.cluster.disagg import disagg_config_from_args, run_disaggregated
    from workbench.config import ModelConfig
    from workbench.engine.metrics import summarize
    from workbench.request import SamplingParams
    from workbench.workloads import prompt_token_ids

    cfg = disagg_config_from_args(args, config)
    vocab = ModelConfig.resolve(args.model).vocab_size
    requests = [
        (
            list(r.prompt_token_ids or prompt_token_ids(r, vocab, args.trace_seed)),
            SamplingParams(max_tokens=r.output_len, ignore_eos=True),
            r.arrival_time_s,
        )
        for r in trace
    ]
    t0 = now()
    try:
        with progress_bar(total=len(requests), desc=f"replay {args.disaggregate}", unit="request") as bar:
            result = run_disaggregated(args.model, requests, cfg, seed=args.model_seed, online=True, progress=bar)
    except KeyboardInterrupt as exc:
        finished = getattr(exc, "partial", [])  # RequestResults, request_id their index in the trace
        for r in finished:
            r.request_id = trace[r.request_id].request_id
        _print_partial(args, finished, len(requests), now() - t0)
        raise
    summary = summarize(
        result.requests, duration_s=result.duration_s, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
        slo_e2el_s=args.slo_e2el,
    )  # fmt: skip
    summary |= {
        "rejected": [
            {"request_id": trace[i].request_id, "reason": r.reject_reason}
            for i, r in enumerate(result.requests)
            if r.finish_reason == "rejected"
        ],
        "kv_transfer": result.kv_transfer(),
        "requests": [dict(row, request_id=trace[i].request_id) for i, row in enumerate(result.request_rows())],
        "pools": result.pools,
        "disaggregate": args.disaggregate,
        "prefill_tp": cfg.prefill.tensor_parallel_size,
        "decode_tp": cfg.decode.tensor_parallel_size,
        "max_model_len": max_len,
        "engine": asdict(config),
        "model": str(args.model),
        "trace": args.trace,
    }
    add_rejections(summary, summary["rejected"])
    if args.json:
        print(json.dumps(summary))
        return all_rejected_exit_code("replay", summary)
    kv = summary["kv_transfer"]
    print(f"replay of {args.trace} through {args.disaggregate} prefill:decode engines: model {args.model}, "
          f"policy {config.policy}; max_model_len {max_len}, {summary['num_rejected']} request(s) "
          "rejected")  # fmt: skip
    print(f"{summary['num_finished']}/{summary['num_requests']} finished, {summary['duration_s']:.2f} s; KV moved: "
          f"{kv['bytes'] / 1e6:.2f} MB in {kv['num_transfers']} transfers ({kv['seconds'] * 1e3:.1f} ms), "
          f"{kv['num_retries']} retried, {kv['num_recomputed']} recomputed, {kv['num_backpressure']} waited for "
          "decode room")  # fmt: skip
    print_serving_metrics(summary["metrics"])
    return all_rejected_exit_code("replay", summary)
