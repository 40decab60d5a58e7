"""The HTML pages of a report: ``<run>/index.html`` for one run and ``reports/index.html`` across runs.

Rendered with jinja2 from ``templates/`` (autoescaped: every value from a manifest is escaped), with an inline
stylesheet and relative links, so a report folder can be copied or zipped and still opens anywhere. Each
experiment shows its claims with their verdicts, the anomalies its sanity checks flagged, every scalar key result
and its figures at a readable size; the experiment running now is shown as running, the others not yet run as
pending.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from workbench.atomic import atomic_write_text
from workbench.record import format_value

MANIFEST = "manifest.json"
ENVIRONMENT = "environment.json"
INDEX = "index.html"
TEMPLATES = Path(__file__).parent / "templates"
# structured entries of metrics.json, shown as claims / anomalies rather than as key results
STRUCTURED_KEYS = ("claims", "anomalies", "hygiene")
VERDICT_TEXT = {"confirmed": "confirmed", "not_confirmed": "not confirmed", "inconclusive": "inconclusive"}


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
    claims = [
        {
            **c,
            "verdict_text": VERDICT_TEXT.get(c.get("verdict"), str(c.get("verdict"))),
            "from_numbers_text": VERDICT_TEXT.get(c.get("verdict_from_numbers"), ""),
            "detail": c.get("detail", ""),
        }
        for c in metrics.get("claims") or []
        if isinstance(c, dict)
    ]
    return {
        "name": str(exp.get("name", "?")),
        "status": str(exp.get("status", "?")),
        "description": exp.get("description"),
        "duration": f"{exp['duration_s']:.1f} s" if isinstance(exp.get("duration_s"), (int, float)) else "",
        "links": links,
        "skip_reason": exp.get("skip_reason"),
        "error": error,
        "claims": claims,
        "anomalies": [a for a in metrics.get("anomalies") or [] if isinstance(a, dict)],
        "metrics": [(k, format_value(v)) for k, v in metrics.items() if k not in STRUCTURED_KEYS],
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
    return _render(
        "run_index.html.j2",
        title=f"workbench run {run_id}",
        run_id=run_id,
        state=state,
        counts=counts,
        facts=_facts(manifest, environment or {}),
        rows=rows,
        experiments=[_experiment_context(e) for e in experiments],
    )


def write_run_index(run_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Write ``<run_dir>/index.html`` from ``manifest`` (and the run's environment.json, if present)."""
    run_path = Path(run_dir)
    environment = _read_json(run_path / ENVIRONMENT)
    return atomic_write_text(run_path / INDEX, render_run_index(manifest, environment))


def list_runs(reports_dir: str | Path) -> list[tuple[Path, dict[str, Any] | None]]:
    """Every run folder (one that holds, or was meant to hold, a manifest), newest first by run id."""
    root = Path(reports_dir)
    if not root.is_dir():
        return []
    runs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists()]
    return [(p, _read_json(p / MANIFEST)) for p in sorted(runs, key=lambda p: p.name, reverse=True)]


def write_reports_index(reports_dir: str | Path) -> Path:
    """Rebuild ``<reports_dir>/index.html``: one row per run, newest first, incomplete runs marked."""
    root = Path(reports_dir)
    runs = []
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
    return atomic_write_text(root / INDEX, _render("reports_index.html.j2", title="Workbench reports", runs=runs))
