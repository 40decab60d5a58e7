"""Where the op-profile cost model misses the engine's steps: per kind of step, the summed operations and the fitted
model against the measured steps it was fitted on and against held-out ones, with each kind's largest operations.

    .venv/bin/python scripts/op_profile_steps.py [--model SmolLM2-135M] [--op-profile FILE] [--max-tokens 1024]
        [--held-out-seed 2000] [--threads 1]

1. The op profile: ``--op-profile FILE``, else measured now (``workbench.sim.op_timing.profile_ops``, linears
   packed as the engine runs them).
2. The engine replays the fit's training workloads (``measure_training_steps``, seed 1000) and, as a check the fit
   never sees, the same kinds of workload drawn with ``--held-out-seed``; the per-step overhead is fitted on the
   training steps only (``fit_overhead``).
3. Per kind of step (pure decodes by batch size; ragged steps by tokens, with or without decodes) and set: the
   number of busy steps, the median measured and summed-operation times, the median signed error of the
   operations alone and of the fitted model, and the kind's five largest operations (ms).
4. The first product of a new (matrix, rows) shape against a repeat (oneDNN builds a primitive per shape once per
   process; ``workbench.sim.measure.warm_packed_linears``): per distinct packed matrix, the median over 7 new row
   counts of each, measured first in the process.

Prints one JSON object (with the load average before and after); the table goes to stderr. A report, not a test.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from workbench.parsing import make_parser


def kind(stats, cost) -> str:  # noqa: ANN001
    if cost.is_batched_decode(stats):
        b = stats.decode_seqs
        return "decode b1" if b == 1 else "decode b2-4" if b <= 4 else "decode b5-8" if b <= 8 else "decode b9+"
    t = stats.prefill_tokens + stats.decode_seqs
    size = "<=32" if t <= 32 else "<=128" if t <= 128 else ">128"
    return f"ragged {size}{' +decodes' if stats.decode_seqs else ''}"


def table(cost, samples) -> dict:  # noqa: ANN001
    groups: dict[str, list[tuple[float, float, float, dict]]] = {}
    for s, y, idle in zip(samples.stats, samples.durations_s, samples.after_idle):
        if idle:
            continue
        ops = cost.op_times(s)
        groups.setdefault(kind(s, cost), []).append((sum(ops.values()), cost.step_time(s), y, ops))
    out = {}
    for name in sorted(groups):
        rows = groups[name]
        mean_ops: dict[str, float] = {}
        for *_, ops in rows:
            for op, x in ops.items():
                mean_ops[op] = mean_ops.get(op, 0.0) + x / len(rows)
        out[name] = {
            "num_steps": len(rows),
            "measured_ms": 1e3 * statistics.median(y for _, _, y, _ in rows),
            "ops_ms": 1e3 * statistics.median(o for o, _, _, _ in rows),
            "ops_only_error": statistics.median(o / y - 1 for o, _, y, _ in rows),
            "fitted_error": statistics.median(p / y - 1 for _, p, y, _ in rows),
            "top_ops_ms": {op: 1e3 * x for op, x in sorted(mean_ops.items(), key=lambda kv: -kv[1])[:5]},
        }
    everything = [(o, p, y) for rows in groups.values() for o, p, y, _ in rows]
    out["all"] = {"num_steps": len(everything),
                  "ops_only_error": statistics.median(o / y - 1 for o, _, y in everything),
                  "fitted_error": statistics.median(p / y - 1 for _, p, y in everything),
                  "fitted_abs_error": statistics.median(abs(p / y - 1) for _, p, y in everything)}  # fmt: skip
    return out


def first_products(model: str) -> dict:
    """Per distinct packed matrix of ``model``: median ms of the first product at 7 new row counts, and of a
    repeat at the same row counts."""
    import torch

    from workbench.model.checkpoint import load_model
    from workbench.model.packed import PackedLinear, pack_linears

    net = load_model(model, seed=0)
    if not pack_linears(net):
        return {}
    shapes = {}
    for m in net.modules():
        if isinstance(m, PackedLinear):
            shapes.setdefault((m.in_features, m.out_features), m)
    out = {}
    with torch.inference_mode():
        for (i, o), lin in shapes.items():
            times: dict[str, list[float]] = {"first": [], "repeat": []}
            for phase in times:
                for rows in (5, 7, 9, 11, 13, 15, 17):
                    x = torch.randn(rows, i)
                    t0 = time.perf_counter()
                    lin(x)
                    times[phase].append(time.perf_counter() - t0)
            out[f"{i}x{o}"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return out


def main() -> int:
    p = make_parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M")
    p.add_argument("--op-profile", default=None, help="op profile file (default: measured now)")
    p.add_argument("--max-tokens", type=int, default=1024, help="largest size profiled when measured now")
    p.add_argument("--held-out-seed", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    from workbench.sim.measure import enlarge_onednn_cache

    enlarge_onednn_cache()  # before torch's first oneDNN primitive, here and in the engine processes started later

    import torch

    from workbench.experiments.hygiene import load_average
    from workbench.sim.op_profile import OpProfileCostModel, fit_overhead
    from workbench.sim.op_timing import measure_training_steps, profile_ops

    torch.set_num_threads(args.threads)
    load_start, t0 = load_average(), time.perf_counter()
    firsts = first_products(args.model)  # first: oneDNN's primitives are per process, and the steps below build them
    if args.op_profile:
        profile = json.loads(open(args.op_profile).read())
    else:
        profile = profile_ops(args.model, "cpu", "fp32", max_tokens=args.max_tokens, progress=False)
        profile["model"] = args.model
    base = OpProfileCostModel.from_dict(profile)
    train, _ = measure_training_steps(profile)
    held, _ = measure_training_steps(profile, seed=args.held_out_seed)
    over = fit_overhead(base, train.stats, train.durations_s, train.gaps_s, train.after_idle, train.wakes_s)
    cost = OpProfileCostModel.from_dict({**profile, "overhead": over})
    out = {"model": args.model, "packed_linears": profile.get("packed_linears", False),
           "overhead": over["coefficients"], "training": table(cost, train), "held_out": table(cost, held),
           "first_products_ms": firsts, "load_average_start": load_start,
           "load_average_end": load_average(), "wall_s": time.perf_counter() - t0}  # fmt: skip
    for name in ("training", "held_out"):
        print(f"{name}:", file=sys.stderr)
        for k, r in out[name].items():
            if k == "all":
                line = (f"  all {r['num_steps']} busy steps: operations alone {100 * r['ops_only_error']:+.1f}%, "
                        f"fitted {100 * r['fitted_error']:+.1f}% (abs {100 * r['fitted_abs_error']:.1f}%)")  # fmt: skip
                print(line, file=sys.stderr)
                continue
            top = ", ".join(f"{op} {ms:.1f}" for op, ms in r["top_ops_ms"].items())
            print(f"  {k:22s} n={r['num_steps']:3d} measured {r['measured_ms']:7.2f} ms ops {r['ops_ms']:7.2f} ms "
                  f"ops alone {100 * r['ops_only_error']:+6.1f}% fitted {100 * r['fitted_error']:+6.1f}%  [{top}]",
                  file=sys.stderr)  # fmt: skip
    for shape, t in out["first_products_ms"].items():
        print(f"first product {shape}: {t['first']:.2f} ms, repeat {t['repeat']:.2f} ms", file=sys.stderr)
    print(f"load average {load_start} -> {out['load_average_end']}; {out['wall_s']:.0f} s", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
