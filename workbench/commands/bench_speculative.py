"""``workbench bench speculative``: speculative decoding's speed-up against batch size, measured and simulated.

    workbench bench speculative [--model bench-300m] [--speculative-config JSON] [--batch 1 2 4 8] [--prompt-len 32]
        [--max-tokens 64] [--repeats 3] [--cost-model profiled|op-profile] [--profile FILE] [--sim-seeds 16]
        [--threads N] [--json]

For each batch size, ``workbench.experiments.speculative.speedup_against_batch``: the engine's tokens/s with and
without ``--speculative-config`` (default: the oracle at acceptance 0.8, k = 4) in ``--repeats`` interleaved rounds
on the same greedy requests, beside the simulator's predicted speed-up for the same run on this machine's cost model,
and the error (predicted / measured - 1). The cost model: ``--profile FILE``, else this machine's committed profile
of the model (``data/profiles/``), else one fitted now on the engine (``workbench fit-profile``'s measurement, at
``--threads``; ``--profile-requests`` per workload). With ``--json`` one object: ``results`` one row per batch
(``measured_speedup``, ``predicted_speedup``, ``error``, ``predicted_at_measured_acceptance`` and its error,
tokens/s of both arms, ``acceptance_rate``, ``mean_accepted_length``, ``per_position_acceptance``), ``cost_model``
(where it came from), ``max_abs_error``, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_SPEC = '{"method": "oracle", "acceptance": 0.8, "num_speculative_tokens": 4}'


def add_speculative_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench speculative`` beside the engine modes' shared ones (``--batch``, ``--prompt-len``,
    ``--repeats``, ``--threads``, ``--dtype``, ``--device``: ``bench``'s own)."""
    from workbench.commands.common import add_speculative_arguments

    g = p.add_argument_group("speculative decoding")
    if "--speculative-config" not in p._option_string_actions:  # bench's all-modes parser: soak declared it
        add_speculative_arguments(g)
    g.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (EOS ignored)")
    g.add_argument("--cost-model", default="profiled", choices=("profiled", "op-profile"),
                   help="the simulator's cost model of this machine")  # fmt: skip
    g.add_argument("--profile", default=None,
                   help="its profile file (default: this machine's committed one, else fitted now)")  # fmt: skip
    g.add_argument("--profile-requests", type=int, default=12,
                   help="requests per workload when the profile is fitted now")  # fmt: skip
    g.add_argument("--sim-seeds", type=int, default=16, help="simulated runs (acceptance draws) per prediction")


def run_speculative(args: argparse.Namespace) -> int:
    """Measure and predict (module docstring); prints a table or one JSON object."""
    from workbench import bench
    from workbench.commands.common import progress_bar
    from workbench.device import resolve_device
    from workbench.engine.speculative import SpeculativeConfig
    from workbench.errors import ConfigError
    from workbench.experiments.fidelity import profile_for_this_machine
    from workbench.experiments.hygiene import load_average
    from workbench.experiments.speculative import speedup_against_batch
    from workbench.timing import set_threads

    spec = SpeculativeConfig.parse(args.speculative_config or DEFAULT_SPEC)
    for name in ("max_tokens", "repeats", "sim_seeds", "profile_requests"):
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if not args.batch or min(args.batch) < 1:
        raise ConfigError(f"--batch sizes must be positive integers, got {args.batch!r}")
    prompt_len = (args.prompt_len or [32])[0]
    threads = set_threads(args.threads, what="--threads")
    device = resolve_device(args.device)
    load_start = load_average()
    cost, source = profile_for_this_machine(
        args.cost_model, args.model, args.profile, max_num_seqs=max(args.batch),
        max_model_len=max(64, prompt_len + args.max_tokens + 1), num_requests=args.profile_requests, threads=threads,
    )  # fmt: skip
    set_threads(threads)  # a profile fitted now set the threads it measured at: the same
    model = bench.load_bench_model(args.model, args.dtype, str(device), args.seed, "none", 128)
    rows = speedup_against_batch(
        model, spec, cost, list(args.batch), prompt_len, args.max_tokens, args.repeats, args.seed, args.sim_seeds,
        progress=progress_bar(total=len(args.batch), desc="speculative", unit="batch"),
    )  # fmt: skip
    out: dict[str, Any] = {
        "bench": "speculative", "model": args.model, "dtype": args.dtype, "num_threads": threads,
        "device": str(device), "spec_config": vars(spec).copy(), "prompt_len": prompt_len,
        "max_tokens": args.max_tokens, "rounds": args.repeats, "sim_seeds": args.sim_seeds,
        "cost_model": {"kind": args.cost_model, "source": source},
        "results": rows, "max_abs_error": max(abs(r["error"]) for r in rows),
        "load_average": [load_start, load_average()],
    }  # fmt: skip
    print(json.dumps(out) if args.json else format_table(out))
    return 0


def format_table(out: dict[str, Any]) -> str:
    """A plain-text table of ``bench speculative``'s result."""
    spec = out["spec_config"]
    lines = [
        f"workbench bench speculative: model {out['model']} {out['dtype']}, {out['num_threads']} threads, "
        f"{spec['method']} k={spec['num_speculative_tokens']}"
        + (f" acceptance {spec['acceptance']}" if spec.get("acceptance") is not None else "")
        + f"; cost model {out['cost_model']['kind']} ({out['cost_model']['source']})",
        f"{'batch':>5} {'base tok/s':>10} {'spec tok/s':>10} {'measured':>8} {'predicted':>9} {'error':>7} "
        f"{'at meas. acc.':>13} {'acceptance':>10} {'accepted/step':>13}",
    ]
    for r in out["results"]:
        lines.append(
            f"{r['batch']:>5} {r['base_tokens_per_s']:>10.1f} {r['spec_tokens_per_s']:>10.1f} "
            f"{r['measured_speedup']:>7.2f}x {r['predicted_speedup']:>8.2f}x {r['error']:>+7.1%} "
            f"{r['predicted_at_measured_acceptance']:>12.2f}x {r['acceptance_rate'] or 0:>10.3f} "
            f"{r['mean_accepted_length'] or 0:>13.2f}"
        )
    load = out["load_average"]
    lines.append(f"largest |error| {out['max_abs_error']:.1%}; load average {load[0]} -> {load[1]}")
    return "\n".join(lines)
