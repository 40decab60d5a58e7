"""Simulator fidelity on this machine: a cost model against the engine's measured latencies, per policy, with the
measured runs repeated and their spread reported.

    .venv/bin/python scripts/sim_fidelity.py [--model tiny-gqa] [--cost-model op-profile,profiled]
        [--op-profile FILE] [--fit-profile FILE] [--num-requests 40] [--rate 10] [--repeats 3] [--policies ...]
        [--measure-profiles] [--measure-max-tokens 1024]
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

``--measure-profiles``: measure both profiles now, on this machine and in this run's conditions, instead of reading
the committed ones (a committed profile is used only when it records this machine: CPU model, number of CPUs and
torch's instruction set). Each cost model's provenance (its machine, the load average while it was measured and
whether that load exceeded the CPUs) is printed and kept in the JSON; so are the load averages of the measured runs
and the wall time.

``--disaggregate P:D``: the real disaggregated engines instead (``workbench.cluster.disagg``, one thread per engine
process, as the profile was measured), ``--repeats`` times, against the simulator's disaggregated model with the
same profile on every replica and the real engines' handoff: the KV link (fitted to the wire times), the handoff
from a prefill's end to the decode side, each role's wake-up and idle-step excess, all measured on calibration runs
of another workload (seed ``--seed + 1``), one before each measured repeat, pooled, after a warm-up that builds every
shape's oneDNN primitive in the engine processes (``fidelity.disaggregated_fidelity``). Each model's ``noise``
variant draws every step's residual, every handoff (rank-correlated with its prefill step's residual, as measured)
and every wake-up from the calibration runs' measured ones, with ``--repeats`` seeds: its statistics are the
seeded simulations' medians, as the measured ones are the repeats'.
"""

from __future__ import annotations

import json
import os
import sys
import time

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
    p.add_argument(
        "--measure-profiles",
        action="store_true",
        help="measure both profiles now, on this machine, before the runs (not the committed ones)",
    )
    p.add_argument("--measure-max-tokens", type=int, default=1024,
                   help="largest size the op profile measures when measured now (default 1024)")  # fmt: skip
    args = p.parse_args()

    from workbench.sim.measure import enlarge_onednn_cache

    enlarge_onednn_cache()  # before torch's first oneDNN primitive, here and in the engine processes started later

    import torch

    from workbench.config import ModelConfig, parse_disaggregate
    from workbench.experiments import fidelity
    from workbench.experiments.hygiene import load_average
    from workbench.model.checkpoint import load_model

    torch.set_num_threads(args.threads)  # as the profile was measured (fit-profile / profile-ops --threads, 1)
    load_start = load_average()
    t_start = time.perf_counter()
    kinds = [k.strip() for k in args.cost_model.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("op-profile", "profiled")]
    if bad or not kinds:
        p.error(f"--cost-model takes op-profile and/or profiled, got {args.cost_model!r}")
    costs, sources = {}, {}
    for kind in kinds:
        path = args.op_profile if kind == "op-profile" else args.fit_profile
        costs[kind], sources[kind] = fidelity.profile_for_this_machine(
            kind, args.model, path, args.max_num_seqs, args.max_model_len, args.measure_max_tokens,
            measure=args.measure_profiles,
        )  # fmt: skip
        prov = fidelity.profile_provenance(kind, costs[kind])
        print(
            f"{kind}: {sources[kind]}; load average while measured {prov['load_average_1min']}"
            f"{'  LOADED: its times hold other processes' if prov['loaded'] else ''}",
            file=sys.stderr,
        )
    profile_s = time.perf_counter() - t_start
    held_out = fidelity.held_out_workload(args.num_requests, args.rate, args.seed)
    models = {k: {"source": sources[k], **c.describe(), "provenance": fidelity.profile_provenance(k, c)}
              for k, c in costs.items()}  # fmt: skip
    out: dict = {"model": args.model, "cost_models": models, "num_requests": args.num_requests, "rate": args.rate,
                 "repeats": args.repeats, "threads": args.threads, "load_average_start": load_start}  # fmt: skip
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
                   idle_step_s=res["idle_step_s"], loads=res["loads"], ttft_parts=res["ttft_parts"])  # fmt: skip
        keys = ("queue", "prefill", "after", "sum_of_medians", "ttft", "handoff", "decode_wait", "wire")
        print("TTFT in parts, medians over the requests (ms; after = handoff + decode-side wait + wire):",
              file=sys.stderr)  # fmt: skip
        named = [(f"measured {i}", x) for i, x in enumerate(res["ttft_parts"]["measured"])]
        for label, x in named + [(k, v) for k, v in res["ttft_parts"].items() if k != "measured"]:
            print(f"  {label:18s} " + "  ".join(f"{k} {x[k]:.2f}" for k in keys if x.get(k) is not None),
                  file=sys.stderr)  # fmt: skip
            p90 = x.get("p90") or {}
            print(f"  {'  p90':18s} " + "  ".join(f"{k} {p90[k]:.2f}" for k in keys if p90.get(k) is not None),
                  file=sys.stderr)  # fmt: skip
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
    out["wall_s"] = {"profiles": profile_s, "total": time.perf_counter() - t_start}
    for r in rows:
        print(f"{r['model']:18s} {r['policy']:18s} {r['statistic']:11s} measured {r['measured_ms']:8.2f} ms "
              f"[{r['measured_min_ms']:.2f}..{r['measured_max_ms']:.2f}] simulated {r['simulated_ms']:8.2f} ms "
              f"{100 * r['rel_error']:+6.1f}% (spread {100 * r['spread']:.0f}%, tol {100 * r['tolerance']:.0f}%)"
              f"{'' if r['within'] else '  OUTSIDE'}", file=sys.stderr)  # fmt: skip
    loads = [x for run in out.get("loads", []) for x in (run["load_before"], run["load_after"]) if x]
    out["measured_runs_loaded"] = bool(loads) and max(x[0] for x in loads) > (os.cpu_count() or 1)
    if loads:
        warn = "  LOADED: other processes shared the CPUs, the errors are not the simulator's"
        print(f"load average (1 min) over the measured runs: {min(x[0] for x in loads):.2f}.."
              f"{max(x[0] for x in loads):.2f} on {os.cpu_count()} CPUs{warn if out['measured_runs_loaded'] else ''}",
              file=sys.stderr)  # fmt: skip
    for name in labels:
        n_in = sum(r["within"] for r in rows if r["model"] == name)
        print(f"{name}: {n_in} of {sum(r['model'] == name for r in rows)} statistics within 10% or the spread",
              file=sys.stderr)  # fmt: skip
    print(f"wall time {out['wall_s']['total']:.0f} s (profiles {profile_s:.0f} s)", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
