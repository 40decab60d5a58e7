"""``workbench fit-profile``: measure the real engine's step times on this machine and fit the ``profiled`` cost model.

    workbench fit-profile --model PRESET [--out data/profiles/NAME.json] [--policies continuous,chunked]
        [--num-requests N] [--max-num-seqs S] [--max-model-len L] [--json]
    workbench fit-profile --from-steps FIDELITY.json --out PROFILE.json [--json]

Replays synthetic workloads (a light and a heavy Poisson load and a burst) on the engine under each policy, pairs
every step with what it computed (its tokens, prefill sequences, prefill attention pairs, decode context tokens read,
decodes attended one at a time) and fits step time to them by non-negative least squares: a token curve (the dense
layers' time, piecewise linear in the step's tokens) plus linear attention and per-sequence terms, the extra time of
a step after an idle wait, the wake-up delay and the median busy host gap between steps; the curve rises within each
kernel's range of rows (``fit_profile``'s ``kernel_breaks``), every coefficient gets a bootstrap interval, and the fit's
quality warnings (a kind of step priced more than 10% off, a coefficient at its bound) go to stderr. Written as
JSON for ``workbench simulate --cost-model profiled --profile FILE``.

``--from-steps FILE`` measures nothing: it repeats the fit on steps recorded elsewhere, the
``cost_models.profiled.steps`` of a ``workbench fidelity --measure-profiles --out FILE`` JSON (or a bare steps record,
``workbench.sim.measure.steps_record``), with the engine facts recorded there (its kernel breaks and batched-decode
rule, not this machine's), and keeps the recorded profile's meta (model, machine, loads); ``--out`` is then required.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-gqa", help="preset measured with random weights (default tiny-gqa)")
    p.add_argument("--out", default=None, help="profile file to write (default data/profiles/<model>-<machine>.json)")
    p.add_argument("--policies", default="continuous,chunked", help="comma-separated policies to measure under")
    p.add_argument("--num-requests", type=int, default=24, help="requests per measured workload")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--seed", type=int, default=1000, help="seed of the measured workloads")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads while measuring (default 1)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--from-steps", default=None, metavar="FILE",
                   help="re-fit the steps recorded in FILE (a `workbench fidelity --measure-profiles` JSON) instead "
                        "of measuring (default: measure now)")  # fmt: skip


def steps_from_file(path: str) -> tuple[dict, dict]:
    """(steps record, meta) from ``path``: a fidelity JSON's ``cost_models.profiled`` (its ``steps`` and ``meta``)
    or a bare steps record (its own ``meta``, if any). ConfigError when the file holds neither."""
    from workbench.errors import ConfigError, read_json_file

    data = read_json_file(path, "steps file")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object (a `workbench fidelity` result or a steps record)")
    if "cost_models" in data:
        profiled = (data.get("cost_models") or {}).get("profiled") or {}
        if "steps" not in profiled:
            raise ConfigError(f"{path}: its profiled cost model holds no recorded steps (only a `workbench fidelity "
                              "--measure-profiles` run that fitted it records them)")  # fmt: skip
        return profiled["steps"], dict(profiled.get("meta") or {})
    return data, dict(data.get("meta") or {})


def run(args: argparse.Namespace) -> int:
    from workbench.commands.common import check_output_file, progress_bar
    from workbench.engine.scheduler import POLICIES
    from workbench.errors import ConfigError
    from workbench.sim.measure import default_profile_path, fit_engine_profile, training_workloads

    for name in ("num_requests", "threads", "max_num_seqs", "max_model_len"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.from_steps is not None:
        from workbench.sim.measure import refit_steps

        if args.out is None:
            raise ConfigError("--from-steps needs --out PROFILE.json (the steps may be another machine's: no default)")
        check_output_file(args.out, "--out")
        record, meta = steps_from_file(args.from_steps)
        profile = refit_steps(record, {**meta, "refitted_from": str(args.from_steps)}, args.from_steps)
        return _report(profile, profile.save(args.out), args.json)
    out = args.out or default_profile_path(args.model)
    check_output_file(out, "--out")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ConfigError(f"--policies must name some of {', '.join(POLICIES)}; got {args.policies!r}")
    total = len(policies) * len(training_workloads(args.max_model_len, args.num_requests, args.seed))
    with progress_bar(total=total, desc="fit-profile", unit="workload") as bar:
        profile = fit_engine_profile(
            args.model, policies, num_requests=args.num_requests, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, seed=args.seed, device=args.device, dtype=args.dtype,
            threads=args.threads, progress=bar,
        )  # fmt: skip
    return _report(profile, profile.save(out), args.json)


def _report(profile: Any, path: Any, as_json: bool) -> int:
    """Print a fitted profile (its warnings on stderr): as JSON with ``as_json``, else as lines."""
    import sys

    for warning in profile.meta["fit"].get("warnings") or []:  # the fit's quality checks (fit.fit_quality)
        print(f"workbench fit-profile: warning: {warning}", file=sys.stderr)
    if as_json:
        print(json.dumps({**profile.to_dict(), "path": str(path)}))
        return 0
    fit = profile.meta["fit"]
    print(f"profile written to {path}")
    ci = fit.get("coefficient_ci") or {}
    for name, value in profile.coefficients.items():
        band = f"  (bootstrap 5-95%: {ci[name][0]:.3g}..{ci[name][2]:.3g})" if name in ci else ""
        print(f"  {name:18s} {value:.6g} s{band}")
    if profile.token_curve is not None:
        knots, secs = profile.token_curve
        print("  token curve        " + ", ".join(f"{k}: {v * 1e3:.3g}" for k, v in zip(knots, secs)) + " (tokens: ms)")
    print(f"  host gap           {profile.host_gap_s * 1e3:.3f} ms")
    print(f"  after an idle wait {profile.idle_step_s * 1e3:.3f} ms more, started "
          f"{(profile.wake_s or 0.0) * 1e3:.3f} ms after the arrival")  # fmt: skip
    print(f"  fit over {fit['num_steps']} steps: median relative error {100 * fit['median_rel_error']:.1f}%, "
          f"p90 {100 * fit['p90_rel_error']:.1f}%")  # fmt: skip
    return 0
