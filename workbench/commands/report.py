"""``workbench report``: run the experiment notebooks into ``reports/<run-id>/`` (see workbench.pipeline)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workbench.commands.common import check_output_dir

DEFAULT_SPEC = Path("notebooks") / "pipeline.yaml"
DEFAULT_THREADS = 1


def _default_spec() -> Path:
    """``notebooks/pipeline.yaml`` of the current folder, else of the repository this package lives in."""
    if DEFAULT_SPEC.is_file():
        return DEFAULT_SPEC
    return Path(__file__).resolve().parents[2] / DEFAULT_SPEC


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``workbench report``."""
    from workbench.pipeline.spec import PROFILES

    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default=None,
        help="parameter set to run (default: gpu when torch sees CUDA, else cpu; smoke is the tiny CI set)",
    )
    parser.add_argument(
        "--only", nargs="+", action="extend", metavar="NAME", help="run only these experiments (by name)"
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a notebook parameter; VALUE is JSON (else a string); KEY or EXPERIMENT.KEY",
    )
    parser.add_argument("--out", type=Path, default=Path("reports"), help="reports folder (default: reports)")
    parser.add_argument("--spec", type=Path, default=None, help=f"pipeline spec (default: {DEFAULT_SPEC})")
    parser.add_argument(
        "--kernel", default=None, help="Jupyter kernel (default: the spec's, 'workbench'; python3 if missing)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-ceilings",
        action="store_true",
        help="do not measure the hardware ceilings for environment.json (faster; recorded as not measured)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        metavar="N",
        help="torch threads for the notebooks and the ceilings measured around them. One by default: OpenMP "
        "teams wait for their slowest thread at every barrier, so on a shared machine two threads turned a "
        "150 ms batch-8 decode step into 2,720 ms, while one thread only shares its core",
    )
    parser.add_argument("--list", action="store_true", help="list the experiments of the spec and exit")


def run(args: argparse.Namespace) -> int:
    """Plan (validating every name before anything runs), run, print where the report is; 1 if any failed."""
    from workbench.pipeline.params import parse_params
    from workbench.pipeline.runner import plan_run, run_pipeline
    from workbench.pipeline.spec import load_spec

    spec = load_spec(args.spec or _default_spec())
    if args.list:
        for exp in spec.experiments:
            requires = f"  (requires {', '.join(exp.requires)})" if exp.requires else ""
            print(f"{exp.name}: {exp.notebook.name}{requires}")
        return 0
    check_output_dir(args.out, "--out")
    plan = plan_run(spec, profile=args.profile, only=args.only, overrides=parse_params(args.param), kernel=args.kernel)
    if plan.kernel_note:
        print(f"workbench report: note: {plan.kernel_note}", file=sys.stderr)
    try:
        result = run_pipeline(
            plan, args.out, progress=not args.no_progress, measure_ceilings=not args.no_ceilings,
            num_threads=args.threads,
        )  # fmt: skip
    except OSError as exc:  # the folder passed the check but a file in it could not be written
        from workbench.commands.common import write_failed

        raise write_failed("--out", args.out, exc) from None
    counts = result.manifest["counts"]
    print(
        f"report {result.manifest['run_id']} (profile {plan.profile}): {counts['ok']} ok, {counts['failed']} failed, "
        f"{counts['skipped']} skipped -> {result.run_dir / 'index.html'}"
    )
    for entry in result.manifest["experiments"]:
        if entry["status"] == "failed":
            err = entry["error"]
            cell = f"cell {err['cell_index']}" if err.get("cell_index") is not None else "before any cell"
            print(f"  FAILED {entry['name']}: {err['ename']} in {cell}: {err['evalue']}", file=sys.stderr)
        elif entry["status"] == "skipped":
            print(f"  skipped {entry['name']}: {entry['skip_reason']}", file=sys.stderr)
    return result.exit_code
