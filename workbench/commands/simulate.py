"""``workbench simulate``: serve a workload on simulated replicas that run the engine's own scheduler.

    workbench simulate --model NAME --hardware NAME --trace azure-conv|azure-code|mooncake-conversation|poisson:RATE
        [--tensor-parallel-size N] [--pipeline-parallel-size N] [--expert-parallel-size N] [--quantization Q]
        [--kv-cache-dtype D]
        [--replicas N] [--router round-robin|least-outstanding|shortest-queue] [--policy P]
        [--disaggregate P:D --link-gbps X [--link-latency-s S]]
        [--cost-model roofline|profiled|op-profile [--profile FILE]]
        [--speculative-config JSON [--spec-acceptance ALPHA ...]]
        [engine options] [--slo-ttft S] [--slo-tpot S] [--slo-e2el S] [--step-log FILE] [--json]

Each step's duration comes from a cost model: ``roofline`` (the roofline prediction for the model on the hardware,
each replica a ``--tensor-parallel-size`` x ``--pipeline-parallel-size`` group (per phase with ``--disaggregate``:
``--prefill-tp``, ``--decode-tp``), its communication included, the KV pool what one GPU has left after its weight
shard; ``--dtype`` (activations), ``--quantization``, ``--kv-cache-dtype``; ``--calibration hardware`` (default) or
``ideal``, ``--step-overhead-s``; optional ``--prefill-efficiency``/``--decode-efficiency``), ``profiled`` (a
profile measured on this machine by ``workbench fit-profile``) or ``op-profile`` (the sum of the model's operations,
each measured here by ``workbench profile-ops``, plus the per-step overhead fitted there). Each request generates
exactly its trace output length, as in ``workbench replay``, and a row whose prompt + output exceeds
``max_model_len`` is rejected (the rule of every request, ``workbench.request.validate_request``; never clipped),
the others served. With ``--json``: the keys of ``workbench replay --json`` (``num_requests``, ``num_finished``,
``num_preemptions``, ``duration_s``, ``metrics``, ``rejected``, ``num_rejected``, ``first_rejected``, ``engine``,
``model``, ``trace``) plus ``wall_s`` and ``requests_per_wall_s``
(simulation speed), ``num_steps``, ``us_per_step``, ``replicas`` (per-replica steps and utilisation), ``hardware``
and ``cost_model``. A profile fitted on another model, or a ``--hardware`` accelerator other than the profile's
machine, is an error unless ``--force-profile``. The exit code is 1 when every request was rejected;
``--step-log``'s folder is checked before the simulation runs; the results are printed before ``--step-log`` and
``--plot`` are written, so a file that cannot be written (exit 2, one line) does not lose them.

``--speculative-config`` (the engine's JSON and ``SpeculativeConfig``): each decode verifies ``k`` proposals in one
step, priced as the engine runs it (``k + 1`` query tokens over the cached context), each proposal accepted with the
oracle's ``acceptance`` (or ``--spec-acceptance``: one alpha, or one per position, for ngram and draft); a draft
model's proposals are priced by the roofline of its config (``workbench.sim.speculation``). The JSON then holds
``speculative``: acceptance rate, mean accepted length, per-position acceptance.

Memory: the trace is read as the simulation runs, and a finished request leaves only its latencies (TTFT, TPOT,
E2EL: 32 bytes) and its inter-token gaps as counts per distinct value; a run of 10^6 trace rows stays well under
2 GB. ``--step-log`` holds a record of every step and ``--plot`` every request's token timeline until the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from workbench.commands.common import (
    TraceStream,
    add_rejections,
    add_scheduler_arguments,
    add_slo_arguments,
    add_speculative_arguments,
    add_trace_arguments,
    all_rejected_exit_code,
    check_output_file,
    print_serving_metrics,
    progress_bar,
    serving_config_kwargs,
    write_failed,
)
from workbench.commands.sim_args import (
    add_calibration_arguments,
    add_format_arguments,
    add_parallel_arguments,
    calibration_of,
    format_kwargs,
)
from workbench.config import parse_disaggregate


def roofline_costs(args: argparse.Namespace, cfg: object, hw: object, config: object) -> list:
    """One roofline cost model per replica (prefill replicas first): each with its role's tensor-parallel size,
    the options' formats and calibration."""
    from workbench.sim.costmodel import make_cost_model

    cal = calibration_of(args, hw)
    models = {}
    roles = (["prefill"] * config.disaggregate[0] + ["decode"] * config.disaggregate[1] if config.disaggregate
             else ["mixed"] * config.num_replicas)  # fmt: skip
    for role in set(roles):
        models[role] = make_cost_model(
            "roofline", cfg, hw, config.dtype, None, args.prefill_efficiency, args.decode_efficiency,
            quantization=config.quantization, group_size=config.group_size, kv_cache_dtype=config.kv_cache_dtype,
            tensor_parallel_size=config.role_tp(role), pipeline_parallel_size=config.pipeline_parallel_size,
            expert_parallel_size=config.expert_parallel_size, calibration=cal, host_gap_s=None,
        )  # fmt: skip
    return [models[role] for role in roles]


def _spec_acceptance(values: list[float] | None) -> float | tuple[float, ...] | None:
    """--spec-acceptance: one alpha, or one per position."""
    if values is None:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _draft_cost(args: argparse.Namespace, config: object, hw: object, profiled: bool) -> object:
    """The cost model of a draft model's proposals (the roofline of its config on the same hardware, formats and
    calibration as the target's), or None when no draft model speculates."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft":
        return None
    from workbench.config import ModelConfig
    from workbench.errors import ConfigError
    from workbench.sim.costmodel import make_cost_model

    if profiled:
        raise ConfigError(f"--cost-model {args.cost_model} has no profile of the draft model; simulate a draft "
                          "model with --cost-model roofline, or the oracle at its acceptance")  # fmt: skip
    return make_cost_model(
        "roofline", ModelConfig.resolve(spec.model), hw, config.dtype, None, args.prefill_efficiency,
        args.decode_efficiency, quantization=config.quantization, group_size=config.group_size,
        kv_cache_dtype=config.kv_cache_dtype, calibration=calibration_of(args, hw), host_gap_s=0.0,
    )  # fmt: skip


def _link_latency_s(args: argparse.Namespace) -> float:
    """--link-latency-s, or the deprecated --link-latency-ms (with a warning) converted to seconds."""
    if args.link_latency_ms is None:
        return args.link_latency_s
    from workbench.commands.common import warn_deprecated

    warn_deprecated("--link-latency-ms", "--link-latency-s (seconds)")
    return args.link_latency_ms / 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workbench.sim.cluster import ROUTERS, SimConfig
    from workbench.sim.costmodel import COST_MODELS

    p.add_argument("--model", required=True, help="preset name or config.json (only its shape matters)")
    p.add_argument("--hardware", default=None,
                   help="accelerator name (see `workbench hardware`; default h100-sxm, or with --cost-model profiled "
                   "the profile's own machine, with the pool the measured engine had)")  # fmt: skip
    add_format_arguments(p)
    add_trace_arguments(p, num_requests_default=1000, prompt_lens_default="uniform:64:1024",
                        output_lens_default="uniform:16:256")  # fmt: skip
    g = p.add_argument_group("replica (as the engine's options)")
    add_scheduler_arguments(g, SimConfig)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of memory for weights + KV")
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=1, help="number of replicas (without --disaggregate)")
    c.add_argument("--router", default="round-robin", choices=ROUTERS, help="how requests pick a replica")
    c.add_argument("--disaggregate", default=None, metavar="P:D", help="P prefill and D decode replicas")
    c.add_argument("--link-gbps", type=float, default=100.0, help="KV transfer link bandwidth, Gb/s")
    c.add_argument("--link-latency-s", type=float, default=0.0, metavar="S", help="KV transfer latency in seconds")
    c.add_argument("--link-latency-ms", type=float, default=None, metavar="MS",
                   help="deprecated: --link-latency-s in milliseconds")  # fmt: skip
    add_parallel_arguments(c, per_phase=True)
    m = p.add_argument_group("cost model")
    m.add_argument("--cost-model", default="roofline", choices=COST_MODELS)
    m.add_argument("--profile", default=None, help="profile JSON of the profiled or op-profile cost model")
    m.add_argument("--profile-noise-seed", type=int, default=None, help="profiled: draw measured residuals")
    m.add_argument("--force-profile", action="store_true",
                   help="profiled: use a profile fitted on another model or machine anyway")  # fmt: skip
    m.add_argument("--prefill-efficiency", type=float, default=1.0, help="roofline: achieved share in prefill")
    m.add_argument("--decode-efficiency", type=float, default=1.0, help="roofline: achieved share in decode")
    add_calibration_arguments(m)
    s = p.add_argument_group("speculative decoding")
    add_speculative_arguments(s)
    s.add_argument("--spec-acceptance", type=float, nargs="+", default=None, metavar="ALPHA",
                   help="acceptance of each proposed token (one for all positions, or one per position given the "
                   "earlier ones accepted), for methods ngram and draft; the oracle's is its 'acceptance'")  # fmt: skip
    add_slo_arguments(p)
    p.add_argument("--step-log", default=None, help="write every replica's per-step log to this JSON file")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="draw latency CDFs into FILE and queue, batch and KV blocks over time per replica into "
                   "FILE's stem + '-timeline' (.png, .svg, .pdf)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from workbench.config import ModelConfig
    from workbench.hardware import get_hardware
    from workbench.sim.cluster import SimConfig, simulate
    from workbench.sim.costmodel import make_cost_model
    from workbench.workloads import iter_workload

    check_output_file(args.step_log, "--step-log")
    cfg = ModelConfig.resolve(args.model)
    profiled = args.cost_model in ("profiled", "op-profile")  # measured here: the profile's machine and pool
    parallel = max(args.tensor_parallel_size, args.pipeline_parallel_size, args.expert_parallel_size)
    if profiled and (parallel > 1 or args.quantization != "none"):
        from workbench.errors import ConfigError

        raise ConfigError(f"--cost-model {args.cost_model} replays one measured engine: parallelism and quantization "
                          "are for --cost-model roofline")  # fmt: skip
    hw = get_hardware(args.hardware or "h100-sxm") if args.hardware or not profiled else None
    formats = format_kwargs(args)
    config = SimConfig(
        **(serving_config_kwargs(args) | formats), gpu_memory_utilization=args.gpu_memory_utilization,
        num_replicas=args.replicas, router=args.router,
        disaggregate=None if args.disaggregate is None else parse_disaggregate(args.disaggregate),
        link_gbps=args.link_gbps, link_latency_s=_link_latency_s(args),
        pipeline_parallel_size=args.pipeline_parallel_size,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, expert_parallel_size=args.expert_parallel_size,
        speculative_config=args.speculative_config, spec_acceptance=_spec_acceptance(args.spec_acceptance),
    )  # fmt: skip
    draft_cost = _draft_cost(args, config, hw, profiled)
    cost = roofline_costs(args, cfg, hw, config) if not profiled else make_cost_model(
        args.cost_model, cfg, hw, args.dtype, args.profile, noise_seed=args.profile_noise_seed)  # fmt: skip
    max_len = config.resolved_max_model_len(cfg)
    if profiled:
        from workbench.sim.measure import check_profile_matches, profiled_engine_num_blocks

        check_profile_matches(cost, args.profile, cfg.name, hw, force=args.force_profile)
        if hw is None and config.num_blocks is None and config.kv_cache_bytes is None:
            config.num_blocks = profiled_engine_num_blocks(config, cfg)
    # the trace is read as the simulation goes and only --plot keeps per-request records: the memory is what is in
    # flight, not the trace (workbench.sim.cluster.simulate)
    requests = TraceStream(iter_workload(
        args.trace, limit=args.limit, time_scale=args.time_scale, rate_scale=args.rate_scale,
        num_requests=args.num_requests, prompt_lens=args.prompt_lens,
        output_lens=args.output_lens, seed=args.trace_seed,
    ))  # fmt: skip
    with progress_bar(desc="simulate", unit="request") as bar:
        result = simulate(iter(requests), cfg, cost, config, hardware=hw, seed=args.trace_seed,
                          record_steps=args.step_log is not None or args.plot is not None, progress=bar,
                          keep_records=args.plot is not None, draft_cost_model=draft_cost)  # fmt: skip
    summary = result.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, slo_e2el_s=args.slo_e2el)
    add_rejections(summary, result.rejected)
    engine = asdict(config)
    engine["num_blocks"] = result.replicas[0]["num_blocks_capacity"] if result.replicas else config.num_blocks
    summary["engine"] = engine
    summary["model"] = str(args.model)
    summary["trace"] = args.trace
    summary["hardware"] = hw.name if hw is not None else f"profile: {cost.meta.get('machine', 'unknown machine')}"
    summary["cost_model"] = result.cost_model
    summary["max_model_len"] = max_len
    timeline = None
    if args.plot:
        from pathlib import Path

        target = Path(args.plot)
        timeline = target.with_name(f"{target.stem}-timeline{target.suffix or '.png'}")
        summary["plots"] = [str(target), str(timeline)]
    # the results first, then the files: a file that cannot be written does not lose the simulation's result
    if args.json:
        print(json.dumps(summary))
    else:
        cost_name = result.cost_model.get("name", args.cost_model)
        print(f"simulated {args.trace}: model {args.model}, hardware {summary['hardware']}, cost model "
              f"{cost_name}; max_model_len {max_len}, {summary['num_rejected']} request(s) rejected")  # fmt: skip
        print(f"{summary['num_finished']}/{summary['num_requests']} finished, {summary['num_preemptions']} "
              f"preemptions, {summary['duration_s']:.2f} s simulated in {summary['wall_s']:.2f} s "
              f"({summary['requests_per_wall_s']:.0f} req/s, {summary['us_per_step']:.1f} us/step)")  # fmt: skip
        print_serving_metrics(summary["metrics"])
        spec = summary.get("speculative")
        if spec and spec["num_drafts"]:
            print(f"  speculative decoding: {spec['num_drafts']} verifies, acceptance rate "
                  f"{spec['acceptance_rate']:.3f}, mean accepted length "
                  f"{spec['mean_accepted_length']:.2f}")  # fmt: skip
        for rep in summary["replicas"]:
            print(f"  replica {rep['index']} ({rep['role']}): {rep['num_steps']} steps, "
                  f"utilisation {100 * rep['utilization']:.0f}%")  # fmt: skip
        for path in summary.get("plots", []):
            print(f"  figure: {path}")
    sys.stdout.flush()
    if args.step_log:
        try:
            with open(args.step_log, "w") as fh:
                json.dump([log.to_records() if log is not None else [] for log in result.step_logs], fh)
        except OSError as exc:
            raise write_failed("--step-log", args.step_log, exc) from None
    if args.plot:
        from workbench import plots

        plots.use_file_backend()
        title = f"{args.model} on {summary['hardware']}, {args.trace}, {result.cost_model.get('name')} cost model"
        try:
            plots.save_figure(plots.plot_latency_cdfs(result.records, title), str(target))
            plots.save_figure(plots.plot_serving_timelines(result.records, result.step_logs, title), str(timeline))
        except (OSError, ValueError) as exc:  # ValueError: a format matplotlib does not know
            raise write_failed("--plot", args.plot, exc) from None
    return all_rejected_exit_code("simulate", summary)
