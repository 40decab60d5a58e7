"""The HTML pages of a report: ``<run>/index.html`` for one run and ``reports/index.html`` across runs.

Rendered with jinja2 from ``templates/`` (autoescaped: every value from a manifest is escaped), with an inline
stylesheet and relative links, so a report folder can be copied or zipped and still opens anywhere. The run page
opens with every claim of the run in one table (one verdict label each, beside its ratio, interval, rounds, margin
and A/A control: ``workbench.pipeline.summary``), downloadable with the key results as ``claims.csv`` and
``key_results.csv``; then each experiment shows its claims, the anomalies its sanity checks flagged, its key
results (value with unit, spread and conditions), its tables as CSV and its figures at a readable size; the
experiment running now is shown as running, the others not yet run as pending. ``render_notebook_summary`` is the
same summary for the top of a notebook's own page, with the parameters it ran with. With more than one run under
``reports/``, ``compare.html`` puts their claims and key results side by side, a column per run.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from workbench.atomic import atomic_write_text
from workbench.pipeline.summary import VERDICT_TEXT, claim_rows, claims_csv, result_rows, results_csv
from workbench.record import format_value

MANIFEST = "manifest.json"
ENVIRONMENT = "environment.json"
INDEX = "index.html"
COMPARE = "compare.html"
CLAIMS_CSV = "claims.csv"
RESULTS_CSV = "key_results.csv"
TEMPLATES = Path(__file__).parent / "templates"


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _render(template: str, **context: Any) -> str:
    return _environment().get_template(template).render(**context)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def verdict_counts(metrics: dict[str, Any] | None) -> str:
    """'2 confirmed, 1 not confirmed' from an experiment's claims ('' without claims)."""
    claims = (metrics or {}).get("claims") or []
    counts: dict[str, int] = {}
    for c in claims:
        if isinstance(c, dict):
            counts[c.get("verdict", "?")] = counts.get(c.get("verdict", "?"), 0) + 1
    return ", ".join(f"{n} {VERDICT_TEXT.get(v, v)}" for v, n in counts.items())


def _experiment_context(exp: dict[str, Any]) -> dict[str, Any]:
    metrics = exp.get("metrics") or {}
    error = exp.get("error")
    if error:
        where = f" in cell {error['cell_index']}" if error.get("cell_index") is not None else ""
        if error.get("execution_count") is not None:
            where += f" (In [{error['execution_count']}])"
        error = {**error, "where": where, "traceback": error.get("traceback", "")}
    links = [
        (exp.get(key), text)
        for key, text in (
            ("html", "report (HTML)"),
            ("html_noinput", "report without code"),
            ("notebook", "executed notebook"),
            ("metrics_file", "metrics JSON"),
        )
        if exp.get(key)
    ]
    name = str(exp.get("name", "?"))
    return {
        "name": name,
        "status": str(exp.get("status", "?")),
        "description": exp.get("description"),
        "duration": f"{exp['duration_s']:.1f} s" if isinstance(exp.get("duration_s"), (int, float)) else "",
        "links": links,
        "skip_reason": exp.get("skip_reason"),
        "error": error,
        "claims": claim_rows(metrics, name),
        "anomalies": [a for a in metrics.get("anomalies") or [] if isinstance(a, dict)],
        "metrics": result_rows(metrics, name),
        "tables": exp.get("tables") or [],
        "figures": exp.get("figures") or [],
    }


def _facts(manifest: dict[str, Any], env: dict[str, Any]) -> list[tuple[str, str]]:
    torch = env.get("torch", {}) if isinstance(env.get("torch"), dict) else {}
    git = env.get("git", {}) if isinstance(env.get("git"), dict) else {}

    def ceilings(key: str) -> str | None:
        c = env.get(key)
        if not isinstance(c, dict) or not c.get("available"):
            return None if c is None else f"not measured ({(c or {}).get('reason', '?')})"
        flops = (c.get("peak_flops") or {}).get("fp32")
        bw = c.get("mem_bandwidth")
        parts = [
            f"{flops / 1e9:,.1f} GFLOP/s fp32 matmul" if flops else None,
            f"{bw / 1e9:,.1f} GB/s read" if bw else None,
        ]
        return ", ".join(p for p in parts if p)

    def load(key: str) -> str | None:
        v = env.get(key)
        return " / ".join(f"{x:.2f}" for x in v) + " (1 / 5 / 15 min)" if isinstance(v, list) else None

    versions = f"{torch.get('version')} / {torch.get('cuda_version')} / {torch.get('triton_version')}"
    steal = env.get("cpu_steal_share")
    facts = [
        ("profile", manifest.get("profile")),
        ("started", manifest.get("started_at")),
        ("finished", manifest.get("finished_at") or "not finished"),
        ("git commit", (git.get("commit") or "unknown") + (" (dirty tree)" if git.get("dirty") else "")),
        ("device", torch.get("device_name")),
        ("torch / CUDA / Triton", versions),
        ("torch threads", env.get("num_threads")),
        ("ceilings at the start", ceilings("ceilings_start")),
        ("ceilings at the end", ceilings("ceilings_end")),
        ("load average at the start", load("load_average_start")),
        ("load average at the end", load("load_average_end")),
        ("CPU steal during the run", f"{steal:.1%}" if isinstance(steal, float) else None),
        ("python", (env.get("python") or {}).get("version")),
        ("kernel", manifest.get("kernel")),
    ]  # fmt: skip
    return [(k, str(v)) for k, v in facts if v is not None]


def render_run_index(manifest: dict[str, Any], environment: dict[str, Any] | None = None) -> str:
    """The HTML summary of one run, from its manifest (and environment, when there is one)."""
    experiments = manifest.get("experiments", [])
    counts = {s: sum(1 for e in experiments if e.get("status") == s) for s in ("ok", "failed", "skipped")}
    rows = [
        {
            "name": str(e.get("name")),
            "anchor": True,
            "status": str(e.get("status")),
            "duration": f"{e['duration_s']:.1f} s" if isinstance(e.get("duration_s"), (int, float)) else "",
            "verdicts": verdict_counts(e.get("metrics")),
            "num_anomalies": len((e.get("metrics") or {}).get("anomalies") or []),
        }
        for e in experiments
    ]
    running = manifest.get("running")
    for name in manifest.get("pending") or []:
        status = "running" if name == running and not manifest.get("interrupted") else "pending"
        rows.append(
            {"name": str(name), "anchor": False, "status": status, "duration": "", "verdicts": "", "num_anomalies": 0}
        )
    if manifest.get("complete"):
        state = ""
    elif manifest.get("interrupted"):
        state = "interrupted"
    else:
        state = f"running {running}" if running else "incomplete: still running or stopped"
    run_id = str(manifest.get("run_id", "?"))
    contexts = [_experiment_context(e) for e in experiments]
    all_claims = [c for e in contexts for c in e["claims"]]
    return _render(
        "run_index.html.j2",
        title=f"workbench run {run_id}",
        run_id=run_id,
        state=state,
        counts=counts,
        facts=_facts(manifest, environment or {}),
        rows=rows,
        experiments=contexts,
        all_claims=all_claims,
        verdict_summary=verdict_counts({"claims": all_claims}),
        claims_csv=CLAIMS_CSV,
        results_csv=RESULTS_CSV,
    )


def run_tables(manifest: dict[str, Any]) -> tuple[str, str]:
    """(claims.csv, key_results.csv) of a run: every claim and every key result of its experiments, one row each
    with the experiment's name (the columns of ``summary.CLAIM_COLUMNS`` and ``RESULT_COLUMNS``)."""
    claims, results = [], []
    for e in manifest.get("experiments", []):
        name, metrics = str(e.get("name", "?")), e.get("metrics") or {}
        claims += claim_rows(metrics, name)
        results += result_rows(metrics, name)
    return claims_csv(claims), results_csv(results)


def render_notebook_summary(entry: dict[str, Any], metrics: dict[str, Any] | None = None) -> str:
    """The summary at the top of an experiment's own page (HTML, with and without code): its claims (one verdict
    label each, with ratio, interval, rounds, margin, A/A control and what would decide an inconclusive one), its
    key results (unit, spread, conditions), the parameters it ran with and links to its tables as CSV.
    ``entry``: its manifest entry (``name``, ``params``, ``tables``, relative to the run folder); ``metrics``: its
    metrics.json (default: the entry's)."""
    name = str(entry.get("name", "?"))
    metrics = entry.get("metrics") if metrics is None else metrics
    params = entry.get("params") if isinstance(entry.get("params"), dict) else {}
    prefix = f"{name}/"
    tables = [(t.removeprefix(prefix), t.rsplit("/", 1)[-1]) for t in entry.get("tables") or []]
    return _render(
        "notebook_summary.html.j2",
        title=name,
        claims=claim_rows(metrics, name),
        results=result_rows(metrics, name),
        params=[(k, format_value(v)) for k, v in params.items()],
        tables=tables,
    )


def write_run_index(run_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Write ``<run_dir>/index.html`` from ``manifest`` (and the run's environment.json, if present)."""
    run_path = Path(run_dir)
    environment = _read_json(run_path / ENVIRONMENT)
    claims, results = run_tables(manifest)
    atomic_write_text(run_path / CLAIMS_CSV, claims)
    atomic_write_text(run_path / RESULTS_CSV, results)
    return atomic_write_text(run_path / INDEX, render_run_index(manifest, environment))


def list_runs(reports_dir: str | Path) -> list[tuple[Path, dict[str, Any] | None]]:
    """Every run folder (one that holds, or was meant to hold, a manifest), newest first by run id."""
    root = Path(reports_dir)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists()]
    return [(p, _read_json(p / MANIFEST)) for p in sorted(runs, key=lambda p: p.name, reverse=True)]


def render_comparison(runs: list[tuple[str, dict[str, Any], dict[str, Any] | None]]) -> str:
    """Runs side by side, a column each (``runs``: (name, manifest, environment or None), newest first): the
    machine, commit and profile of each, then every claim (its verdict and ratio in each run) and every key result
    (its value and spread in each run), in the order they first appear."""
    columns = []
    claims: dict[tuple[str, str], list[Any]] = {}
    results: dict[tuple[str, str], list[Any]] = {}
    for i, (name, manifest, env) in enumerate(runs):
        env = env or {}
        torch = env.get("torch") if isinstance(env.get("torch"), dict) else {}
        cpu = env.get("cpu") if isinstance(env.get("cpu"), dict) else {}
        git = env.get("git") if isinstance(env.get("git"), dict) else {}
        commit = str(git.get("commit") or "unknown")[:12] + (" (dirty)" if git.get("dirty") else "")
        threads = env.get("num_threads")
        columns.append({
            "name": name,
            "machine": str(torch.get("device_name") or cpu.get("model") or "unknown"),
            "cpu": str(cpu.get("model") or "unknown") + (f", {threads} thread(s)" if threads else ""),
            "commit": commit,
            "profile": str(manifest.get("profile")),
            "started": str(manifest.get("started_at")),
        })  # fmt: skip
        for e in manifest.get("experiments", []):
            exp, metrics = str(e.get("name", "?")), e.get("metrics") or {}
            for c in claim_rows(metrics, exp):
                claims.setdefault((exp, c["claim"]), [None] * len(runs))[i] = c
            for r in result_rows(metrics, exp):
                results.setdefault((exp, r["key"]), [None] * len(runs))[i] = r
    header = [("machine", "machine"), ("CPU", "cpu"), ("commit", "commit"), ("profile", "profile"),
              ("started (UTC)", "started")]  # fmt: skip
    return _render(
        "compare.html.j2",
        title="Workbench runs compared",
        runs=columns,
        header=header,
        claims=[{"experiment": e, "claim": c, "cells": cells} for (e, c), cells in claims.items()],
        results=[{"experiment": e, "key": k, "cells": cells} for (e, k), cells in results.items()],
    )


def write_reports_index(reports_dir: str | Path) -> Path:
    """Rebuild ``<reports_dir>/index.html``: one row per run, newest first, incomplete runs marked; with more
    than one readable run, ``compare.html`` beside it (``render_comparison``)."""
    root = Path(reports_dir)
    runs = []
    readable = [(p.name, m, _read_json(p / ENVIRONMENT)) for p, m in list_runs(root) if m is not None]
    compare = None
    if len(readable) > 1:
        atomic_write_text(root / COMPARE, render_comparison(readable))
        compare = COMPARE
    for run_path, manifest in list_runs(root):
        if manifest is None:
            runs.append({"name": run_path.name, "unreadable": True})
            continue
        exps = manifest.get("experiments", [])
        verdicts: dict[str, int] = {}
        for e in exps:
            for c in (e.get("metrics") or {}).get("claims") or []:
                if isinstance(c, dict):
                    verdicts[c.get("verdict", "?")] = verdicts.get(c.get("verdict", "?"), 0) + 1
        runs.append(
            {
                "name": run_path.name,
                "unreadable": False,
                "profile": str(manifest.get("profile")),
                "started": str(manifest.get("started_at")),
                "complete": bool(manifest.get("complete")),
                "counts": {s: sum(1 for e in exps if e.get("status") == s) for s in ("ok", "failed", "skipped")},
                "verdicts": ", ".join(f"{n} {VERDICT_TEXT.get(v, v)}" for v, n in verdicts.items()),
                "failed": [str(e.get("name")) for e in exps if e.get("status") == "failed"],
            }
        )
    page = _render("reports_index.html.j2", title="Workbench reports", runs=runs, compare=compare)
    return atomic_write_text(root / INDEX, page)
