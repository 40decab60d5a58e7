"""Where the offline set's time goes: the engine's steps by kind, model against engine overhead, and the top ops.

    .venv/bin/python scripts/offline_breakdown.py [--model bench-300m] [--threads 2] [--no-compile-decode] [--json]
        [--no-compile-prefill] [--no-packed-linears] [--policy continuous] [--no-profiler]

The same 64-request set as ``workbench bench offline`` (``workbench.bench.offline_requests``), served at once by the
engine ``bench offline`` builds (``workbench.bench.bench_engine``), with its pure decode steps compiled
(``--no-compile-decode``: eager; every batch bucket is compiled first and that time reported apart) and its prefill
and mixed steps compiled (``--no-compile-prefill``: eager; every token-count range compiled first, reported
apart), after a 4-request warm-up. Pass 1 times every
step (``ModelRunner.time_model``: the model's forward and LM head, synchronised) and sorts it into prefill-only,
mixed (prefill chunks beside decodes) and pure-decode steps by batch size; what is left of a step outside the model
is engine overhead (scheduling, batch preparation, sampling), and the run's wall time minus its steps is the time
between steps. Pass 2 runs the set again under ``torch.profiler`` (CPU ops, self time) for the operators that
dominate; the profiler slows the run, so only its shares are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

from workbench.parsing import make_parser


def step_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    """'prefill', 'mixed', or 'decode b<=8' / 'decode b<=16' / 'decode b<=32' / 'decode b>32'."""
    if num_prefill_tokens and num_decode_tokens:
        return "mixed"
    if num_prefill_tokens:
        return "prefill"
    for top in (1, 8, 16, 32):
        if num_decode_tokens <= top:
            return f"decode b<={top}" if top > 1 else "decode b=1"
    return "decode b>32"


def main(argv: list[str] | None = None) -> int:
    p = make_parser(prog="offline_breakdown.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-300m", help="preset (random weights) or checkpoint directory")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--num-requests", type=int, default=64, help="offline set size")
    p.add_argument("--context", type=int, default=256, help="longest prompt + output")
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine batch limit")
    p.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's compiled decode step, every batch bucket (default on)",
    )
    p.add_argument(
        "--compile-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's compiled prefill and mixed steps, every token-count range (default on)",
    )
    p.add_argument("--no-packed-linears", action="store_true", help="plain F.linear only (EngineConfig.packed_linears)")
    p.add_argument("--policy", default="continuous", help="scheduler policy of the engine")
    p.add_argument("--top", type=int, default=12, help="operators listed from the profiler")
    p.add_argument("--no-profiler", action="store_true", help="skip pass 2")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    import torch

    from workbench.bench import bench_engine, load_bench_model, offline_requests, run_engine_offline, set_threads

    set_threads(args.threads)
    model = load_bench_model(args.model, "fp32", "cpu")
    requests = offline_requests(model.config.vocab_size, args.num_requests, args.context, 0)
    engine = bench_engine(model, args.max_num_seqs, max(len(q) + n for q, n in requests),
                          compile_decode=args.compile_decode, compile_prefill=args.compile_prefill,
                          packed_linears=not args.no_packed_linears,
                          policy=args.policy)  # fmt: skip
    t0 = time.perf_counter()
    compile_s = engine.decode.warmup()  # every decode bucket, before anything is timed
    prefill_compile_s = engine.prefill.warmup(engine.token_budget)  # every token-count range
    startup_s = time.perf_counter() - t0
    run_engine_offline(model, requests[:4], args.max_num_seqs, engine)  # warm-up
    engine.runner.time_model = True
    rows: list[tuple[str, float, float]] = []
    engine.on_step = lambda plan, rec: rows.append(
        (step_kind(rec.num_prefill_tokens, rec.num_decode_tokens), rec.duration_s, engine.runner.last_model_s)
    )
    t0 = time.perf_counter()
    run_engine_offline(model, requests, args.max_num_seqs, engine)
    wall = time.perf_counter() - t0
    engine.on_step = None
    engine.runner.time_model = False
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"steps": 0, "wall_s": 0.0, "model_s": 0.0})
    for kind, dur, model_s in rows:
        k = kinds[kind]
        k["steps"] += 1
        k["wall_s"] += dur
        k["model_s"] += model_s
    in_steps = sum(r[1] for r in rows)
    table = {
        kind: {**v, "overhead_s": v["wall_s"] - v["model_s"], "share": v["wall_s"] / wall}
        for kind, v in sorted(kinds.items())
    }
    result = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "compile_decode": args.compile_decode,
        "startup_s": startup_s,
        "compile_s": compile_s,
        "compile_prefill": args.compile_prefill,
        "prefill_compile_s": prefill_compile_s,
        "packed_linears": not args.no_packed_linears,
        "policy": args.policy,
        "wall_s": wall,
        "output_tokens": sum(n for _, n in requests),
        "steps": len(rows),
        "between_steps_s": wall - in_steps,
        "by_kind": table,
    }
    if not args.no_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_engine_offline(model, requests, args.max_num_seqs, engine)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        result["profiler_top_ops"] = [
            {"op": e.key, "self_share": e.self_cpu_time_total / total, "calls": e.count} for e in top
        ]
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"offline set: {result['output_tokens']} output tokens in {wall:.2f} s "
          f"({result['output_tokens'] / wall:.1f} tok/s), {len(rows)} steps, {args.threads} threads, "
          f"compiled decode {'on' if args.compile_decode else 'off'}, compiled prefill "
          f"{'on' if args.compile_prefill else 'off'}, packed linears "
          f"{'off' if args.no_packed_linears else 'on'}, policy {args.policy}")  # fmt: skip
    if compile_s or prefill_compile_s:
        print(
            f"compiled first (not timed): {startup_s:.1f} s; decode "
            + ", ".join(f"b={b} {t:.1f} s" for b, t in compile_s.items())
            + "; prefill "
            + ", ".join(f"{n} tokens {t:.1f} s" for n, t in prefill_compile_s.items())
        )
    print(f"{'step kind':14s} {'steps':>6s} {'wall s':>8s} {'share':>6s} {'model s':>8s} {'overhead s':>10s}")
    for kind, v in table.items():
        print(f"{kind:14s} {v['steps']:6d} {v['wall_s']:8.2f} {100 * v['share']:5.1f}% {v['model_s']:8.2f} "
              f"{v['overhead_s']:10.2f}")  # fmt: skip
    print(
        f"{'between steps':14s} {'':6s} {result['between_steps_s']:8.2f} {100 * result['between_steps_s'] / wall:5.1f}%"
    )
    for op in result.get("profiler_top_ops", []):
        print(f"  {op['op']:40s} {100 * op['self_share']:5.1f}% of CPU self time, {op['calls']} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
