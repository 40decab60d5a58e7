"""The compiled ragged step (prefill, chunks, mixed) against the eager one: single steps, and the offline set by step
kind, interleaved.

    .venv/bin/python scripts/bench_compiled_prefill.py [--model bench-300m] [--threads 2] [--repeats 3]
        [--tokens 64,320,1024] [--policies continuous,chunked] [--compile-decode] [--no-offline] [--json]

1. Builds the engine of ``workbench bench offline`` (``workbench.bench.bench_engine``, packed linears on) with two
   ragged-step executors over its one KV pool: eager and compiled (``workbench.engine.prefill_step``). The compiled
   one's ``warmup`` compiles every token-count range first; the seconds of each are printed (a second run on the
   same machine loads inductor's on-disk cache).
2. Per token count of ``--tokens``: one ragged step of that many new tokens over four fresh prompts, eager and
   compiled in turn (ABAB...), ``--repeats`` x 3 steps each: medians, the ratio, the largest difference of the
   hidden states.
3. Unless ``--no-offline``: the 64-request offline set per policy of ``--policies``, eager and compiled in turn,
   ``--repeats`` times each: median wall time, the model's seconds in prefill-only, mixed and pure-decode steps
   (``ModelRunner.time_model``), and whether the tokens are the same (greedy). Pure decodes run eagerly in both
   unless ``--compile-decode`` (then every decode bucket compiles first, as in ``offline_breakdown.py``).

The load average before and after is printed: on a shared machine the figures are indicative only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from workbench.parsing import make_parser


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def step_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    """'prefill' (prefill chunks only), 'mixed' (chunks beside decodes) or 'decode'."""
    if num_prefill_tokens:
        return "mixed" if num_decode_tokens else "prefill"
    return "decode"


def main(argv: list[str] | None = None) -> int:
    p = make_parser(prog="bench_compiled_prefill.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-300m", help="preset (random weights) or checkpoint directory")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=3, help="rounds of each comparison")
    p.add_argument("--tokens", default="64,320,1024", help="comma-separated token counts of part 2's steps")
    p.add_argument("--policies", default="continuous,chunked", help="comma-separated scheduler policies of part 3")
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine batch limit")
    p.add_argument("--num-requests", type=int, default=64, help="offline set size")
    p.add_argument("--compile-decode", action="store_true", help="part 3: pure decodes compiled in both")
    p.add_argument("--no-offline", action="store_true", help="skip part 3")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    import torch

    from workbench.bench import bench_engine, load_bench_model, offline_requests, run_engine_offline, set_threads
    from workbench.engine.prefill_step import PrefillStep
    from workbench.model.attention import build_metadata
    from workbench.timing import median

    set_threads(args.threads)
    load_start = loadavg()
    model = load_bench_model(args.model, "fp32", "cpu")
    requests = offline_requests(model.config.vocab_size, args.num_requests)
    token_counts = [int(n) for n in args.tokens.split(",")]
    max_len = max(max(token_counts), max(len(q) + n for q, n in requests))
    policies = [] if args.no_offline else args.policies.split(",")
    result: dict = {"model": args.model, "threads": torch.get_num_threads(), "load_average_start": load_start,
                    "single_steps": [], "offline": {}}  # fmt: skip

    def executors(engine) -> dict[str, PrefillStep]:  # noqa: ANN001
        compiled = PrefillStep(engine.model, engine.cache, engine.backend, compile=True)
        t0 = time.perf_counter()
        compile_s = compiled.warmup(engine.token_budget)
        result.setdefault("warmup_s", time.perf_counter() - t0)
        result.setdefault("compile_s", compile_s)
        return {"eager": engine.prefill, "compiled": compiled}

    # part 2: single ragged steps of four fresh prompts each
    engine = bench_engine(model, args.max_num_seqs, max_len)
    steps = executors(engine)
    bs = engine.cache.block_size
    for n in token_counts:
        lens = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
        tables, first = [], 0
        for q in lens:
            tables.append(list(range(first, first + -(-q // bs))))
            first += len(tables[-1])
        meta = build_metadata(lens, lens, tables, bs)
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        hidden = {}
        for _ in range(args.repeats):
            for name, step in steps.items():
                for _ in range(3):
                    t0 = time.perf_counter()
                    hidden[name] = step.run(ids, meta)
                    times[name].append(time.perf_counter() - t0)
        row = {"tokens": n, **{f"{k}_ms": median(v) * 1e3 for k, v in times.items()}}
        row["speedup"] = row["eager_ms"] / row["compiled_ms"]
        row["max_abs_diff"] = float((hidden["eager"] - hidden["compiled"]).abs().max())
        result["single_steps"].append(row)
    # part 3: the offline set per policy, the two executors in turn
    for policy in policies:
        engine = bench_engine(model, args.max_num_seqs, max_len, policy=policy, compile_decode=args.compile_decode)
        engine.decode.warmup()
        steps = executors(engine)
        runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
        tokens: dict[str, list] = {}
        engine.runner.time_model = True
        for step in steps.values():  # warm-up of each (a few requests)
            engine.runner.prefill = step
            run_engine_offline(model, requests[:4], args.max_num_seqs, engine)
        for _ in range(args.repeats):
            for name, step in steps.items():
                engine.runner.prefill = step
                by_kind: dict[str, float] = {"prefill": 0.0, "mixed": 0.0, "decode": 0.0}

                def record(plan, rec, by_kind=by_kind, runner=engine.runner) -> None:  # noqa: ANN001
                    by_kind[step_kind(rec.num_prefill_tokens, rec.num_decode_tokens)] += runner.last_model_s

                engine.on_step = record
                wall, tokens[name] = run_engine_offline(model, requests, args.max_num_seqs, engine)
                runs[name].append({"wall_s": wall, **{f"{k}_model_s": v for k, v in by_kind.items()}})
        engine.on_step = None
        summary = {
            name: {key: median([r[key] for r in rs]) for key in rs[0]} | {"runs": rs} for name, rs in runs.items()
        }
        summary["speedup_wall"] = summary["eager"]["wall_s"] / summary["compiled"]["wall_s"]
        summary["identical_tokens"] = tokens["eager"] == tokens["compiled"]
        result["offline"][policy] = summary
    result["load_average_end"] = loadavg()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.model}, {result['threads']} threads; compiled ragged step warmed up in {result['warmup_s']:.1f} s ("
          + ", ".join(f"{n} tokens {t:.1f} s" for n, t in result["compile_s"].items()) + ")")  # fmt: skip
    print(f"{'tokens':>7s} {'eager ms':>9s} {'compiled ms':>12s} {'speedup':>8s} {'max |diff|':>11s}")
    for r in result["single_steps"]:
        print(f"{r['tokens']:7d} {r['eager_ms']:9.1f} {r['compiled_ms']:12.1f} {r['speedup']:7.2f}x "
              f"{r['max_abs_diff']:11.1e}")  # fmt: skip
    for policy, s in result["offline"].items():
        print(f"offline set, policy {policy}: speedup {s['speedup_wall']:.2f}x, tokens identical "
              f"{s['identical_tokens']}")  # fmt: skip
        for name in ("eager", "compiled"):
            m = s[name]
            print(f"  {name:9s} wall {m['wall_s']:6.2f} s; model in prefill {m['prefill_model_s']:6.2f} s, mixed "
                  f"{m['mixed_model_s']:6.2f} s, decode {m['decode_model_s']:6.2f} s (medians)")  # fmt: skip
    print(f"load average: start {load_start}, end {result['load_average_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
