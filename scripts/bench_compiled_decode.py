"""The compiled decode step against the eager one: per batch bucket, and on the whole offline set, interleaved.

    .venv/bin/python scripts/bench_compiled_decode.py [--model bench-300m] [--threads 2] [--repeats 3]
        [--batches 8,16,24,32] [--context 128] [--no-mm] [--no-offline] [--json]

1. Builds the engine of ``workbench bench offline`` (``workbench.bench.bench_engine``, packed linears on) and two
   decode executors over its one KV pool: eager and compiled (``workbench.engine.decode_step``). The compiled one's
   ``warmup`` compiles every batch bucket first; the seconds of each are printed (a second run on the same machine
   loads inductor's on-disk cache, so it shows the start-up a warm cache costs).
2. Per batch size of ``--batches``: one pure decode step at ``--context`` tokens per sequence, eager, compiled and
   (unless ``--no-mm``) compiled on a second copy of the model without packed linears, where inductor multiplies
   with ``aten.mm``: the executors in turn (ABAB...), ``--repeats`` x 5 steps each, medians, and each one's
   largest logit difference from eager.
3. Unless ``--no-offline``: the 64-request offline set, eager and compiled in turn, ``--repeats`` times each:
   median wall time, the ratio, and whether the tokens are the same (greedy).

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


def main(argv: list[str] | None = None) -> int:
    p = make_parser(prog="bench_compiled_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-300m", help="preset (random weights) or checkpoint directory")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=3, help="rounds of each comparison")
    p.add_argument("--batches", default="8,16,24,32", help="comma-separated decode batch sizes of part 2")
    p.add_argument("--context", type=int, default=128, help="part 2: tokens per sequence (cached + new)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine batch limit (the largest bucket)")
    p.add_argument("--num-requests", type=int, default=64, help="offline set size")
    p.add_argument("--no-mm", action="store_true", help="part 2 without the compiled plain-mm executor")
    p.add_argument("--no-offline", action="store_true", help="skip part 3")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    import torch

    from workbench.bench import bench_engine, load_bench_model, offline_requests, run_engine_offline, set_threads
    from workbench.engine.decode_step import DecodeStep
    from workbench.timing import median

    set_threads(args.threads)
    load_start = loadavg()
    batches = [int(b) for b in args.batches.split(",")]
    model = load_bench_model(args.model, "fp32", "cpu")
    requests = offline_requests(model.config.vocab_size, args.num_requests)
    max_len = max(args.context + 1, max(len(q) + n for q, n in requests))
    engine = bench_engine(model, args.max_num_seqs, max_len)
    cache, backend = engine.cache, engine.backend
    eager = DecodeStep(model, cache, backend, "eager", args.max_num_seqs, max_len)
    compiled = DecodeStep(model, cache, backend, "compile", args.max_num_seqs, max_len)
    t0 = time.perf_counter()
    compile_s = compiled.warmup()
    result: dict = {"model": args.model, "threads": torch.get_num_threads(), "buckets": compiled.buckets,
                    "compile_s": compile_s, "startup_s": time.perf_counter() - t0}  # fmt: skip
    executors = {"eager": (eager, engine), "compiled": (compiled, engine)}
    if not args.no_mm:
        plain = load_bench_model(args.model, "fp32", "cpu")
        plain_engine = bench_engine(plain, args.max_num_seqs, max_len, packed_linears=False)
        mm = DecodeStep(plain, plain_engine.cache, backend, "compile", args.max_num_seqs, max_len)
        t0 = time.perf_counter()
        result["mm_compile_s"] = mm.warmup(batches)
        result["mm_startup_s"] = time.perf_counter() - t0
        executors["compiled mm"] = (mm, plain_engine)

    # part 2: one step per batch size; sequence i owns blocks [i * per_seq, (i + 1) * per_seq)
    bs = cache.block_size
    per_seq = -(-args.context // bs)
    steps: dict[int, dict] = {}
    for b in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        seq_lens, tokens = [args.context] * b, [(7 * i + 3) % model.config.vocab_size for i in range(b)]
        times: dict[str, list[float]] = {k: [] for k in executors}
        logits = {}
        for _ in range(args.repeats):
            for name, (step, _) in executors.items():
                for _ in range(5):
                    t0 = time.perf_counter()
                    logits[name] = step.run(tokens, seq_lens, tables)
                    times[name].append(time.perf_counter() - t0)
        steps[b] = {
            "padded_to": compiled.padded_batch(b),
            **{f"{name}_ms": 1e3 * median(t) for name, t in times.items()},
            **{f"{name}_max_logit_diff": float((logits[name] - logits["eager"]).abs().max()) for name in executors},
        }
    result["steps"] = steps

    if not args.no_offline:  # part 3: the offline set, the engine's decode executor swapped in turn
        from torch._dynamo.utils import counters

        run_engine_offline(model, requests[:4], args.max_num_seqs, engine)  # warm-up
        graphs_before = counters["stats"]["unique_graphs"]
        walls: dict[str, list[float]] = {"eager": [], "compiled": []}
        tokens_of: dict[str, list] = {}
        for _ in range(args.repeats):
            for name in walls:
                engine.runner.decode = engine.decode = executors[name][0]
                t, tokens_of[name] = run_engine_offline(model, requests, args.max_num_seqs, engine)
                walls[name].append(t)
        out_tokens = sum(n for _, n in requests)
        result["offline"] = {
            "output_tokens": out_tokens,
            "eager_times_s": walls["eager"],
            "compiled_times_s": walls["compiled"],
            "eager_tok_s": out_tokens / median(walls["eager"]),
            "compiled_tok_s": out_tokens / median(walls["compiled"]),
            "speedup": median(walls["eager"]) / median(walls["compiled"]),
            "identical_tokens": tokens_of["eager"] == tokens_of["compiled"],
            "graphs_compiled_during_timing": counters["stats"]["unique_graphs"] - graphs_before,
        }
    result["load_average"] = {"start": load_start, "end": loadavg()}
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.model} fp32, {result['threads']} threads; compiled buckets {result['buckets']}: "
        f"{result['startup_s']:.1f} s (" + ", ".join(f"b={b} {t:.1f} s" for b, t in compile_s.items()) + ")"
    )
    if "mm_startup_s" in result:
        print(f"compiled without packed linears (plain mm), buckets used below: {result['mm_startup_s']:.1f} s")
    names = list(executors)
    print(f"{'batch':>5s} {'bucket':>6s} " + " ".join(f"{n + ' ms':>14s}" for n in names) + "  max |logit - eager|")
    for b, row in steps.items():
        print(f"{b:5d} {row['padded_to']:6d} " + " ".join(f"{row[n + '_ms']:14.1f}" for n in names) + "  "
              + ", ".join(f"{row[n + '_max_logit_diff']:.1e}" for n in names[1:]))  # fmt: skip
    if "offline" in result:
        off = result["offline"]
        print(f"offline set ({off['output_tokens']} output tokens, ABAB x{args.repeats}): eager "
              f"{off['eager_tok_s']:.1f} tok/s, compiled {off['compiled_tok_s']:.1f} tok/s, {off['speedup']:.2f}x; "
              f"tokens identical: {off['identical_tokens']}; graphs compiled while timed: "
              f"{off['graphs_compiled_during_timing']}")  # fmt: skip
    la = result["load_average"]
    print(f"load average: start {la['start'][0]:.2f}, end {la['end'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
