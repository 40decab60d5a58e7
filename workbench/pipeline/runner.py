"""Run the pipeline: plan (validate everything), then execute each notebook with papermill into a report.

Order of work, so that a mistake costs nothing and an interruption misleads no one:

1. ``plan_run`` resolves the profile, the selected experiments, their parameters (spec, then ``--param``) and
   checks every name against the notebook's ``parameters`` cell, and resolves the kernel. A ConfigError here
   means nothing ran and nothing was written.
2. ``run_pipeline`` creates ``<out>/<run-id>/`` and writes ``manifest.json`` with ``complete: false`` and
   ``environment.json``; then runs each experiment in its own folder, rewriting the manifest (atomically)
   after each; a failed notebook is recorded and the next one runs. Only the last write sets
   ``complete: true``. An interrupted run keeps ``complete: false`` (and ``interrupted: true``).
3. After the run (finished or interrupted), the run's ``index.html`` and ``<out>/index.html`` are rebuilt.

papermill and nbformat are imported inside the functions that need them.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from workbench.atomic import atomic_write_json, atomic_write_text
from workbench.errors import ConfigError
from workbench.pipeline.environment import capture_environment, finish_environment, git_state
from workbench.pipeline.export import (
    NOINPUT_SUFFIX,
    export_html,
    extract_figures,
    list_figures,
    list_tables,
    source_cell_index,
)
from workbench.pipeline.index import (
    ENVIRONMENT,
    MANIFEST,
    render_notebook_summary,
    write_reports_index,
    write_run_index,
)
from workbench.pipeline.params import (
    OUTPUT_DIR_PARAM,
    notebook_parameters,
    split_overrides,
    validate_params,
)
from workbench.pipeline.spec import DEFAULT_KERNEL, Experiment, PipelineSpec, choose_profile
from workbench.record import METRICS_FILE, OUTPUT_DIR_ENV, to_json_value
from workbench.timing import NUM_THREADS_ENV, now, set_threads

MANIFEST_SCHEMA = 1
FALLBACK_KERNEL = "python3"
# a notebook runs in its report folder; this names the folder it came from, for files it keeps beside itself
NOTEBOOK_DIR_ENV = "WORKBENCH_NOTEBOOK_DIR"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class PlannedExperiment:
    """An experiment with everything decided: its parameters, and whether (and why not) it runs."""

    experiment: Experiment
    params: dict[str, Any]  # passed to papermill (spec + command line), without output_dir
    effective_params: dict[str, Any]  # the notebook's literal defaults overlaid with ``params``
    inject_output_dir: bool
    skip_reason: str | None = None

    @property
    def name(self) -> str:
        """The experiment's name."""
        return self.experiment.name


@dataclass
class RunPlan:
    """What ``run_pipeline`` will do; built, and fully validated, before anything runs."""

    spec: PipelineSpec
    profile: str
    kernel: str
    experiments: list[PlannedExperiment]
    overrides: dict[str, Any] = field(default_factory=dict)
    kernel_note: str | None = None


@dataclass
class RunResult:
    """A finished run: where it is, its manifest, and the exit code (1 when any experiment failed)."""

    run_dir: Path
    manifest: dict[str, Any]

    @property
    def failed(self) -> list[str]:
        """Names of the experiments that failed."""
        return [e["name"] for e in self.manifest["experiments"] if e["status"] == "failed"]

    @property
    def exit_code(self) -> int:
        """0 when nothing failed, else 1."""
        return 1 if self.failed else 0


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_run_id(now: datetime | None = None, short_commit: str | None = None) -> str:
    """A sortable run id: UTC time to the second, then the short git commit (``nogit`` outside a repo)."""
    stamp = (now or _utcnow()).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{short_commit or 'nogit'}"


def installed_kernels() -> set[str]:
    """Names of the Jupyter kernels this Python environment can start."""
    from jupyter_client.kernelspec import KernelSpecManager

    return set(KernelSpecManager().find_kernel_specs())


def resolve_kernel(requested: str, available: set[str] | None = None) -> tuple[str, str | None]:
    """The kernel to run with, and a note when it is a fallback.

    The default ``workbench`` kernel falls back to ``python3`` when it is not installed (``make venv``
    installs it); any other name must be installed.
    """
    kernels = installed_kernels() if available is None else available
    if requested in kernels:
        return requested, None
    if requested == DEFAULT_KERNEL and FALLBACK_KERNEL in kernels:
        return FALLBACK_KERNEL, (
            f"kernel {DEFAULT_KERNEL!r} is not installed (make venv installs it); used {FALLBACK_KERNEL!r}"
        )
    raise ConfigError(
        f"Jupyter kernel {requested!r} is not installed; installed kernels: {', '.join(sorted(kernels)) or '(none)'}"
    )


def probe_requirement(name: str) -> str | None:
    """None when this machine meets the requirement ``name``, else the reason it does not."""
    if name == "cuda":
        from workbench.pipeline.spec import cuda_available

        return None if cuda_available() else "requires cuda: torch sees no CUDA device on this machine"
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"requires triton: it is not importable ({exc})"
        return None
    raise ConfigError(f"unknown requirement {name!r}")


def plan_run(
    spec: PipelineSpec,
    *,
    profile: str | None = None,
    only: Sequence[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    kernel: str | None = None,
    probe: Callable[[str], str | None] = probe_requirement,
) -> RunPlan:
    """Decide and validate everything about a run without running anything.

    ``overrides`` are ``--param`` values: a plain ``KEY`` applies to every selected experiment whose notebook
    declares it (and must be declared by at least one), ``experiment.KEY`` to that experiment only.
    """
    chosen_profile = choose_profile(profile)
    selected = spec.select(only)
    if not selected:
        raise ConfigError(f"{spec.path} lists no experiments; nothing to run")
    overrides = dict(overrides or {})
    global_params, scoped = split_overrides(overrides, [e.name for e in selected])

    declared_by: dict[str, dict] = {}
    for exp in selected:
        declared = notebook_parameters(exp.notebook)
        declared_by[exp.name] = declared or {}
        where = f"experiment {exp.name!r} ({exp.notebook.name})"
        for prof in exp.params:  # every profile of the spec, so a typo shows up whichever profile runs
            validate_params(exp.params[prof], declared, where=f"{where}, params.{prof} in {spec.path.name}")
        validate_params(scoped.get(exp.name, {}), declared, where=f"{where}, --param")
    for key in global_params:
        if not any(key in declared for declared in declared_by.values()):
            valid = sorted({n for declared in declared_by.values() for n in declared})
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"--param {key}: no selected experiment declares a parameter {key!r}{hint}; "
                f"declared parameters: {', '.join(valid) or '(none)'}"
            )

    planned = []
    for exp in selected:
        declared = declared_by[exp.name]
        params = exp.params_for(chosen_profile)
        params.update({k: v for k, v in global_params.items() if k in declared})
        params.update(scoped.get(exp.name, {}))
        validate_params(params, declared, where=f"experiment {exp.name!r} ({exp.notebook.name})")
        if OUTPUT_DIR_PARAM in params:
            raise ConfigError(
                f"experiment {exp.name!r}: {OUTPUT_DIR_PARAM!r} is set by the pipeline (the experiment's report "
                "folder); use --out to choose where reports go"
            )
        effective = {p.name: p.default for p in declared.values() if p.has_literal_default}
        effective.update(params)
        effective.pop(OUTPUT_DIR_PARAM, None)
        reasons = [r for r in (probe(req) for req in exp.requires) if r]
        planned.append(
            PlannedExperiment(
                experiment=exp,
                params=params,
                effective_params=effective,
                inject_output_dir=OUTPUT_DIR_PARAM in declared,
                skip_reason="; ".join(reasons) or None,
            )
        )
    kernel_name, note = resolve_kernel(kernel or spec.kernel)
    return RunPlan(spec, chosen_profile, kernel_name, planned, overrides, note)


@contextmanager
def _env_var(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextmanager
def _env_vars(values: Mapping[str, str]) -> Iterator[None]:
    if not values:
        yield
        return
    name, value = next(iter(values.items()))
    rest = dict(list(values.items())[1:])
    with _env_var(name, value), _env_vars(rest):
        yield


def _strip_ansi(lines: Sequence[str] | str) -> str:
    text = "\n".join(lines) if not isinstance(lines, str) else lines
    return _ANSI_RE.sub("", text)


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def execute_experiment(
    planned: PlannedExperiment, run_dir: Path, *, kernel: str, timeout_s: float | None = None
) -> dict[str, Any]:
    """Run one notebook into ``run_dir/<name>/`` and return its manifest entry.

    The entry has ``status`` "ok" or "failed" (with ``error``: cell, name, message, traceback); exports and
    figures are produced for a failed notebook too, since its outputs up to the failure are what one debugs.
    """
    import nbformat
    import papermill
    from papermill.exceptions import PapermillExecutionError

    exp = planned.experiment
    exp_dir = run_dir / exp.name
    exp_dir.mkdir(parents=True, exist_ok=True)
    stem = exp.notebook.stem
    final_nb = exp_dir / f"{stem}.ipynb"
    partial_nb = exp_dir / f"{stem}.partial.ipynb"
    params = dict(planned.params)
    if planned.inject_output_dir:
        params[OUTPUT_DIR_PARAM] = str(exp_dir)
    entry = _base_entry(planned, "ok")
    warnings: list[str] = []
    start = now()
    engine_kwargs = {"execution_timeout": timeout_s} if timeout_s else {}
    try:
        with _env_var(OUTPUT_DIR_ENV, str(exp_dir)), _env_var(NOTEBOOK_DIR_ENV, str(exp.notebook.parent)):
            papermill.execute_notebook(
                str(exp.notebook),
                str(partial_nb),
                parameters=params,
                kernel_name=kernel,
                cwd=str(exp_dir),
                progress_bar=False,
                log_output=False,
                # the kernel listens on loopback only; its start-up warning about unencrypted TCP would otherwise
                # break the report's progress bar once per notebook
                extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
                **engine_kwargs,
            )
    except PapermillExecutionError as exc:
        entry["status"] = "failed"
        entry["error"] = {
            "cell_index": None,  # in the source notebook; set below from papermill's index
            "papermill_cell_index": exc.cell_index,
            "execution_count": exc.exec_count,
            "ename": exc.ename,
            "evalue": _strip_ansi(exc.evalue),
            "traceback": _strip_ansi(exc.traceback),
            "source": exc.source,
        }
    except KeyboardInterrupt:  # the .partial notebook stays, with statuses that say which cells ran
        if partial_nb.exists():
            nb = nbformat.read(partial_nb, as_version=4)
            mark_stopped_cells(nb, "interrupted")
            atomic_write_text(partial_nb, nbformat.writes(nb))
        raise
    except Exception as exc:  # kernel died, timeout, unreadable notebook: recorded, and the run goes on
        entry["status"] = "failed"
        entry["error"] = {
            "cell_index": None,
            "execution_count": None,
            "ename": type(exc).__name__,
            "evalue": _strip_ansi(str(exc)),
            "traceback": _strip_ansi(traceback.format_exc()),
            "source": None,
            "stopped": True,  # papermill's own statuses are to be corrected below
        }

    metrics_path = exp_dir / METRICS_FILE
    if metrics_path.exists():
        import json

        try:
            metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
            if not isinstance(metrics, dict):
                raise ValueError("not a JSON object")
            entry["metrics"] = to_json_value(metrics, "metrics")
            entry["metrics_file"] = _rel(metrics_path, run_dir)
        except (ValueError, TypeError) as exc:
            warnings.append(f"{METRICS_FILE} unreadable: {exc}")
    entry["tables"] = [_rel(p, run_dir) for p in list_tables(exp_dir)]
    if partial_nb.exists():
        nb = nbformat.read(partial_nb, as_version=4)
        nb.metadata.setdefault("papermill", {})["output_path"] = str(final_nb)
        if entry.get("error") and entry["error"].get("papermill_cell_index") is not None:
            entry["error"]["cell_index"] = source_cell_index(nb, entry["error"].pop("papermill_cell_index"))
        if entry.get("error") and entry["error"].get("stopped"):
            running = mark_stopped_cells(nb, entry["error"]["ename"])
            if running is not None:
                entry["error"]["cell_index"] = source_cell_index(nb, running)
        atomic_write_text(final_nb, nbformat.writes(nb))
        partial_nb.unlink()
        entry["notebook"] = _rel(final_nb, run_dir)
        try:
            extract_figures(nb, exp_dir)
            summary = render_notebook_summary(entry)
            html = export_html(nb, exp_dir / f"{stem}.html", title=exp.name, summary_html=summary)
            noinput = export_html(
                nb, exp_dir / f"{stem}{NOINPUT_SUFFIX}", hide_input=True, title=exp.name, summary_html=summary
            )
            entry["html"], entry["html_noinput"] = _rel(html, run_dir), _rel(noinput, run_dir)
        except Exception as exc:  # an export failure is reported, the executed notebook still stands
            warnings.append(f"export failed: {type(exc).__name__}: {exc}")
    if entry.get("error"):
        entry["error"].pop("papermill_cell_index", None)
        entry["error"].pop("stopped", None)
    entry["figures"] = [_rel(p, run_dir) for p in list_figures(exp_dir)]

    entry["duration_s"] = round(now() - start, 3)
    if warnings:
        entry["warnings"] = warnings
    return entry


def mark_stopped_cells(nb: Any, reason: str) -> int | None:
    """Correct papermill's cell statuses in ``nb`` after a run that stopped in a cell without a cell error (the
    kernel died, a timeout, Ctrl-C), and return the index in ``nb.cells`` of the cell that was running (None when
    no cell started).

    papermill's cleanup marks every cell still pending as completed and the running one as completed too; here a
    cell that never started is ``pending`` again, the one that was running is ``failed``, and the notebook's
    ``metadata.papermill.stopped`` records why and how many cells had started.
    """
    started = [i for i, cell in enumerate(nb.cells) if cell.get("metadata", {}).get("papermill", {}).get("start_time")]
    for cell in nb.cells:
        pm = cell.get("metadata", {}).get("papermill")
        if pm is not None and not pm.get("start_time"):
            pm["status"] = "pending"
            pm.pop("end_time", None)
            pm.pop("duration", None)
    running = started[-1] if started else None
    if running is not None:
        pm = nb.cells[running].metadata.papermill
        pm["status"], pm["exception"] = "failed", True
    nb.metadata.setdefault("papermill", {})["stopped"] = {"reason": reason, "cells_started": len(started)}
    return running


def _base_entry(planned: PlannedExperiment, status: str) -> dict[str, Any]:
    """A manifest entry before anything ran: the experiment's identity, nothing produced yet."""
    exp = planned.experiment
    return {
        "name": exp.name,
        "status": status,
        "duration_s": None,
        "notebook": None,
        "html": None,
        "html_noinput": None,
        "metrics": {},
        "metrics_file": None,
        "figures": [],
        "tables": [],
        "params": planned.params,
        "requires": list(exp.requires),
        "description": exp.description,
        "source_notebook": str(exp.notebook),
    }


def _skipped_entry(planned: PlannedExperiment) -> dict[str, Any]:
    return {**_base_entry(planned, "skipped"), "skip_reason": planned.skip_reason, "duration_s": 0.0}


def _interrupted_entry(planned: PlannedExperiment, exc: BaseException) -> dict[str, Any]:
    """The entry of the experiment that was running when the run was interrupted (Ctrl-C, SIGINT, SIGTERM)."""
    what = str(exc) or type(exc).__name__
    return {
        **_base_entry(planned, "failed"),
        "interrupted": True,
        "error": {
            "cell_index": None,
            "execution_count": None,
            "ename": type(exc).__name__,
            "evalue": f"the run was interrupted ({what}) while this experiment ran; its .partial notebook says "
            "which cells ran",
            "traceback": "",
            "source": None,
        },
    }


def _sigterm_as_interrupt() -> Callable[[], None]:
    """From now on SIGTERM raises KeyboardInterrupt, as SIGINT does, so both leave the manifest marked interrupted
    (the default SIGTERM ends the process with nothing written); returns the function that restores the handler.
    A no-op off the main thread, where signal handlers cannot be set."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, before)


def _make_run_dir(out_dir: Path, run_id: str) -> tuple[Path, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    candidate, n = run_id, 1
    while True:
        try:
            (out_dir / candidate).mkdir()
            return out_dir / candidate, candidate
        except FileExistsError:
            n += 1
            candidate = f"{run_id}-{n}"


def run_pipeline(
    plan: RunPlan,
    out_dir: str | Path,
    *,
    progress: bool = True,
    measure_ceilings: bool = True,
    num_threads: int | None = None,
) -> RunResult:
    """Execute a validated ``plan`` into ``<out_dir>/<run-id>/`` and rebuild the indexes.

    ``num_threads``: torch threads for the notebooks (``$WORKBENCH_NUM_THREADS`` and ``$OMP_NUM_THREADS`` of their
    kernels) and for the ceilings measured here at the start and the end. Returns the result whatever the
    experiments did; only an interruption (Ctrl-C) propagates, after the manifest has been left marked incomplete
    and interrupted.
    """
    from tqdm.auto import tqdm

    if num_threads is not None:
        set_threads(num_threads, what="--threads")
        thread_env = {NUM_THREADS_ENV: str(num_threads), "OMP_NUM_THREADS": str(num_threads)}
    else:
        thread_env = {}

    out_path = Path(out_dir).resolve()
    started = _utcnow()
    source_dir = plan.spec.path.resolve().parent  # the checkout the notebooks come from, not the package's
    run_dir, run_id = _make_run_dir(out_path, new_run_id(started, git_state(source_dir).get("short_commit")))
    t0 = now()
    manifest: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "run_id": run_id,
        "complete": False,
        "interrupted": False,
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": None,
        "duration_s": None,
        "profile": plan.profile,
        "kernel": plan.kernel,
        "kernel_note": plan.kernel_note,
        "spec": str(plan.spec.path),
        "overrides": plan.overrides,
        "experiments": [],
        "pending": [p.name for p in plan.experiments],
        "running": None,
        "num_threads": num_threads,
    }
    atomic_write_json(run_dir / MANIFEST, manifest)
    environment = capture_environment(
        profile=plan.profile,
        parameters={p.name: p.effective_params for p in plan.experiments},
        kernel=plan.kernel,
        run_id=run_id,
        measure=measure_ceilings,
        num_threads=num_threads,
        source_dir=source_dir,
    )
    atomic_write_json(run_dir / ENVIRONMENT, environment)
    write_run_index(run_dir, manifest)
    write_reports_index(out_path)  # the run's "all runs" link resolves from the start

    bar = tqdm(plan.experiments, desc="report", unit="notebook", disable=not progress, file=sys.stderr)
    planned: PlannedExperiment | None = None
    restore_sigterm = _sigterm_as_interrupt()
    try:
        for planned in bar:
            bar.set_postfix_str(planned.name)
            manifest["running"] = planned.name
            write_run_index(run_dir, manifest)
            if planned.skip_reason:
                entry = _skipped_entry(planned)
            else:
                with _env_vars(thread_env):
                    entry = execute_experiment(planned, run_dir, kernel=plan.kernel, timeout_s=plan.spec.timeout_s)
            manifest["experiments"].append(entry)
            manifest["pending"].remove(planned.name)
            manifest["running"] = None
            atomic_write_json(run_dir / MANIFEST, manifest)
            write_run_index(run_dir, manifest)
    except BaseException as exc:
        manifest["interrupted"] = True
        if planned is not None and planned.name in manifest["pending"]:  # it was running: failed, interrupted
            manifest["experiments"].append(_interrupted_entry(planned, exc))
            manifest["pending"].remove(planned.name)
        manifest["running"] = None
        atomic_write_json(run_dir / MANIFEST, manifest)
        write_run_index(run_dir, manifest)
        write_reports_index(out_path)
        raise
    finally:
        restore_sigterm()
        bar.close()

    statuses = [e["status"] for e in manifest["experiments"]]
    manifest["counts"] = {s: statuses.count(s) for s in ("ok", "failed", "skipped")}
    manifest["finished_at"] = _utcnow().isoformat(timespec="seconds")
    manifest["duration_s"] = round(now() - t0, 3)
    manifest["complete"] = True
    atomic_write_json(run_dir / ENVIRONMENT, finish_environment(environment, measure=measure_ceilings))
    write_run_index(run_dir, manifest)
    atomic_write_json(run_dir / MANIFEST, manifest)  # last: from here on the run reads as complete
    write_reports_index(out_path)
    return RunResult(run_dir, manifest)
