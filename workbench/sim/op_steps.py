"""Where the op-profile cost model misses the engine's steps (``workbench bench op-steps``): per kind of step, the
summed operations and the fitted model against the measured steps it was fitted on and against held-out ones, with
each kind's largest operations; and the first product of a new (matrix, rows) shape against a repeat.

1. The op profile: given, else measured now (``workbench.sim.op_timing.profile_ops``, linears packed as the engine
   runs them).
2. The engine replays the fit's training workloads (``measure_training_steps``, seed 1000) and, as a check the fit
   never sees, the same kinds of workload drawn with ``held_out_seed``; the per-step overhead is fitted on the
   training steps only (``fit_overhead``).
3. Per kind of step (pure decodes by batch size; ragged steps by tokens, with or without decodes) and set: the
   number of busy steps, the median measured and summed-operation times, the median signed error of the operations
   alone and of the fitted model, and the kind's five largest operations (ms).
4. ``first_products``: per distinct packed matrix, the median over 7 new row counts of the first product in the
   process and of a repeat (oneDNN's packed products, until 2026-12-06, built a primitive per shape on its first
   product, ~0.7 ms for tiny-gqa's matrices; the blocked op keeps no per-shape state). Run it first in a process.
"""

from __future__ import annotations

import statistics
from typing import Any

from workbench.sim.op_profile import OpProfileCostModel, fit_overhead
from workbench.timing import timed

FIRST_PRODUCT_ROWS = (5, 7, 9, 11, 13, 15, 17)


def step_kind(stats: Any, cost: OpProfileCostModel) -> str:
    """'decode b1' / 'decode b2-4' / 'decode b5-8' / 'decode b9+' for a batched pure decode, else 'ragged <=32' /
    'ragged <=128' / 'ragged >128' by tokens, with ' +decodes' when decodes ride along."""
    if cost.is_batched_decode(stats):
        b = stats.decode_seqs
        return "decode b1" if b == 1 else "decode b2-4" if b <= 4 else "decode b5-8" if b <= 8 else "decode b9+"
    t = stats.prefill_tokens + stats.decode_seqs
    size = "<=32" if t <= 32 else "<=128" if t <= 128 else ">128"
    return f"ragged {size}{' +decodes' if stats.decode_seqs else ''}"


def step_table(cost: OpProfileCostModel, samples: Any) -> dict[str, dict[str, Any]]:
    """Per kind of busy step (steps after an idle wait left out) and ``all``: the errors of the operations alone and
    of the fitted model (predicted / measured - 1, medians)."""
    groups: dict[str, list[tuple[float, float, float, dict[str, float]]]] = {}
    for s, y, idle in zip(samples.stats, samples.durations_s, samples.after_idle):
        if idle:
            continue
        ops = cost.op_times(s)
        groups.setdefault(step_kind(s, cost), []).append((sum(ops.values()), cost.step_time(s), y, ops))
    out: dict[str, dict[str, Any]] = {}
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
    if everything:
        out["all"] = {"num_steps": len(everything),
                      "ops_only_error": statistics.median(o / y - 1 for o, _, y in everything),
                      "fitted_error": statistics.median(p / y - 1 for _, p, y in everything),
                      "fitted_abs_error": statistics.median(abs(p / y - 1) for _, p, y in everything)}  # fmt: skip
    return out


def first_products(model: str, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per distinct packed matrix of ``model`` (``IN x OUT``): median ms of the first product at each of
    ``FIRST_PRODUCT_ROWS`` new row counts, and of a repeat at the same row counts ({} where nothing packs)."""
    import torch

    from workbench.model.checkpoint import load_model
    from workbench.model.packed import PackedLinear, pack_linears

    net = load_model(model, seed=seed)
    if not pack_linears(net):
        return {}
    shapes: dict[tuple[int, int], Any] = {}
    for m in net.modules():
        if isinstance(m, PackedLinear):
            shapes.setdefault((m.in_features, m.out_features), m)
    out = {}
    with torch.inference_mode():
        for (i, o), lin in shapes.items():
            times: dict[str, list[float]] = {"first": [], "repeat": []}
            for phase in times:
                for rows in FIRST_PRODUCT_ROWS:
                    x = torch.randn(rows, i)
                    times[phase].append(timed(lambda lin=lin, x=x: lin(x))[0])
            out[f"{i}x{o}"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return out


def op_profile_steps(profile: dict[str, Any], held_out_seed: int = 2000, num_requests: int = 24) -> dict[str, Any]:
    """Replay the training and the held-out workloads of ``profile`` (``num_requests`` each) on the engine, fit the
    overhead on the training steps, and tabulate both sets (``step_table``): ``overhead`` (the fitted coefficients),
    ``training``, ``held_out``, ``packed_linears``."""
    from workbench.sim.op_timing import measure_training_steps

    base = OpProfileCostModel.from_dict(profile)
    train, _ = measure_training_steps(profile, num_requests=num_requests)
    held, _ = measure_training_steps(profile, num_requests=num_requests, seed=held_out_seed)
    over = fit_overhead(base, train.stats, train.durations_s, train.gaps_s, train.after_idle, train.wakes_s)
    cost = OpProfileCostModel.from_dict({**profile, "overhead": over})
    return {"packed_linears": profile.get("packed_linears", False), "overhead": over["coefficients"],
            "training": step_table(cost, train), "held_out": step_table(cost, held)}  # fmt: skip
