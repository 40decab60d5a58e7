"""Simulator fidelity on this machine: a cost model against the engine's measured latencies, per policy, with the
measured runs repeated and their spread reported.

    .venv/bin/python scripts/sim_fidelity.py [--model tiny-gqa] [--cost-model op-profile,profiled]
        [--op-profile FILE] [--fit-profile FILE] [--num-requests 40] [--rate 10] [--repeats 3] [--policies ...]
    .venv/bin/python scripts/sim_fidelity.py --disaggregate 1:1 [--repeats 3] [...]

The cost models (one or several, compared on the same measured runs): ``profiled`` (``workbench fit-profile``'s
linear model) and ``op-profile`` (the sum of the model's operations measured by ``workbench profile-ops``, with its
fitted per-step overhead). Each is read from ``--fit-profile`` / ``--op-profile``, else from the profile committed
for this CPU model in ``data/profiles/``, else measured here first
(``workbench.experiments.fidelity.profile_for_this_machine``).
Then the real engine replays a held-out Poisson workload (another seed, other lengths) under every policy,
``--repeats`` times, interleaved (every policy once, then again), with the load average read before and after each
run; the simulator replays the same workload with the same scheduler settings and pool, deterministically and with
the profile's residuals drawn as seeded noise (``<model> noise``). Prints one JSON object
(``workbench.experiments.fidelity``): per policy and statistic (TTFT and ITL, median and p90) the measured min,
median and max over the repeats, their spread (the largest deviation of a repeat from the median), the simulated
value, its relative error against the median, the tolerance (10% or the spread, whichever is larger) and whether it
is within; the claim's verdict per model; the load averages. A report, not a test: CPU timings on a shared machine
are noisy, which is why the spread is measured rather than assumed.

``--disaggregate P:D``: the real disaggregated engines instead (``workbench.dist.disagg``, one thread per engine
process, as the profile was measured), ``--repeats`` times, against the simulator's disaggregated model with the
same profile on every replica and the real engines' handoff: the KV link (fitted to the wire times), the handoff
from a prefill's end to the decode side, each role's wake-up and idle-step excess, all measured on a calibration
run of another workload (seed ``--seed + 1``) before the measured repeats (``fidelity.disaggregated_fidelity``).
"""

from __future__ import annotations

import json
import sys

from workbench.engine.scheduler import POLICIES
from workbench.parsing import make_parser


def main() -> int:
    p = make_parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-gqa")
    p.add_argument("--cost-model", default="op-profile,profiled", help="comma-separated: op-profile, profiled")
    p.add_argument("--op-profile", default=None, help="op profile file (default: this CPU's in data/profiles)")
    p.add_argument("--fit-profile", default=None, help="fit-profile file (default: this CPU's in data/profiles)")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=7, help="seed of the held-out workload and of the noise")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per policy (interleaved)")
    p.add_argument("--disaggregate", default=None, metavar="P:D", help="the real disaggregated engines instead")
    args = p.parse_args()

    import torch

    from workbench.config import ModelConfig, parse_disaggregate
    from workbench.experiments import fidelity
    from workbench.experiments.hygiene import load_average
    from workbench.model.checkpoint import load_model

    torch.set_num_threads(args.threads)  # as the profile was measured (fit-profile / profile-ops --threads, 1)
    load_start = load_average()
    kinds = [k.strip() for k in args.cost_model.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("op-profile", "profiled")]
    if bad or not kinds:
        p.error(f"--cost-model takes op-profile and/or profiled, got {args.cost_model!r}")
    costs, sources = {}, {}
    for kind in kinds:
        path = args.op_profile if kind == "op-profile" else args.fit_profile
        costs[kind], sources[kind] = fidelity.profile_for_this_machine(kind, args.model, path, args.max_num_seqs,
                                                                       args.max_model_len)  # fmt: skip
    held_out = fidelity.held_out_workload(args.num_requests, args.rate, args.seed)
    out: dict = {"model": args.model, "cost_models": {k: {"source": sources[k], **c.describe()} for k, c in
                 costs.items()}, "num_requests": args.num_requests, "rate": args.rate, "repeats": args.repeats,
                 "threads": args.threads, "load_average_start": load_start}  # fmt: skip
    labels = [name for kind in kinds for name in (kind, f"{kind} noise")]
    rows = []
    if args.disaggregate:
        split = parse_disaggregate(args.disaggregate)
        calibration = fidelity.held_out_workload(args.num_requests, args.rate, args.seed + 1)
        res = fidelity.disaggregated_fidelity(args.model, list(costs.values()), held_out, split, args.repeats,
                                              args.threads, args.max_num_seqs, args.max_model_len,
                                              args.seed, calibration)  # fmt: skip
        rows = res["rows"]
        out.update(disaggregate=args.disaggregate, link=res["link"], handoff=res["handoff"],
                   idle_step_s=res["idle_step_s"], loads=res["loads"])  # fmt: skip
    else:
        net = load_model(args.model, seed=0)
        policies = [x for x in args.policies.split(",") if x]
        measured = fidelity.measure_policies(net, held_out, policies, args.repeats, args.max_num_seqs,
                                             args.max_model_len, progress=True)  # fmt: skip
        cfg = ModelConfig.resolve(args.model)
        for kind, cost in costs.items():
            for name, seed in ((kind, None), (f"{kind} noise", args.seed)):
                sim = fidelity.simulate_policies(held_out, cfg, cost, measured, args.max_num_seqs,
                                                 args.max_model_len, seed)  # fmt: skip
                rows += fidelity.compare(measured["runs"], sim, name)
        out["loads"] = measured["loads"]
    out["rows"] = rows
    out["claims"] = [fidelity.fidelity_claim(rows, name) for name in labels]
    out["max_abs_rel_error"] = {name: max(abs(r["rel_error"]) for r in rows if r["model"] == name)
                                for name in labels}  # fmt: skip
    out["load_average_end"] = load_average()
    for r in rows:
        print(f"{r['model']:18s} {r['policy']:18s} {r['statistic']:11s} measured {r['measured_ms']:8.2f} ms "
              f"[{r['measured_min_ms']:.2f}..{r['measured_max_ms']:.2f}] simulated {r['simulated_ms']:8.2f} ms "
              f"{100 * r['rel_error']:+6.1f}% (tol {100 * r['tolerance']:.0f}%){'' if r['within'] else '  OUTSIDE'}",
              file=sys.stderr)  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
