"""``workbench fidelity``: the simulator against the real engine on this machine, per policy, with the measured runs
repeated and their spread (and bimodality) reported.

    workbench fidelity [--model tiny-gqa] [--cost-model op-profile,profiled] [--op-profile FILE]
        [--fit-profile FILE] [--num-requests 40] [--rate 10] [--repeats 3] [--policies ...]
        [--measure-profiles] [--measure-max-tokens 1024] [--disaggregate P:D] [--out FILE]

The logic is ``workbench.experiments.fidelity.fidelity_report`` (notebook 07's ``colocated_fidelity`` inside): each cost
model from its file, else this CPU's committed profile, else measured here, its engine workloads between the measured
runs and fitted after them (a shared CPU's speed drifts within minutes); the real engine replays a held-out Poisson
workload under every policy ``--repeats`` times, interleaved, with the load average before and after each run; the
simulator replays the same workload deterministically and with the profile's residuals as seeded noise (``<model>
noise``). The table gives per policy and statistic the measured min, median and max, the spread, the simulated value,
its error, the tolerance (10% or the spread) and BIMODAL where the repeats fall in two modes; the JSON holds it all,
with the machine (CPU model, CPUs, the instruction set torch uses). As every command that prints results: the table on
stdout, or with ``--json`` the JSON on stdout and the table on stderr; ``--out FILE`` writes the JSON there too. A
report, not a test.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workbench.engine.scheduler import POLICIES

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
    p.add_argument("--measure-profiles", action="store_true",
                   help="measure both profiles now, here (not the committed ones): the op profile's operations "
                        "before the runs; both profiles' engine workloads between the runs, fitted after "
                        "them")  # fmt: skip
    p.add_argument("--measure-max-tokens", type=int, default=1024,
                   help="largest size the op profile measures when measured now (default 1024)")  # fmt: skip
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout (the table then on stderr)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import sys

    from workbench.atomic import atomic_write_text
    from workbench.commands.common import check_output_file
    from workbench.experiments import fidelity

    check_output_file(args.out, "--out")

    out = fidelity.fidelity_report(
        args.model, [k.strip() for k in args.cost_model.split(",") if k.strip()],
        {"op-profile": args.op_profile, "profiled": args.fit_profile}, args.num_requests, args.rate,
        [x for x in args.policies.split(",") if x], args.max_num_seqs, args.max_model_len, args.seed, args.threads,
        args.repeats, args.disaggregate, args.measure_profiles, args.measure_max_tokens, not args.no_progress,
        lambda line: print(line, file=sys.stderr),
    )  # fmt: skip
    text = json.dumps(out)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    fidelity.print_report(out, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(text)
    return 0
