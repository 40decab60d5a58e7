"""The HTML pages of a report: ``<run>/index.html`` for one run and ``reports/index.html`` across runs.

Plain HTML with an inline stylesheet and relative links, so a report folder can be copied or zipped and
still opens anywhere. Every value from a manifest is escaped.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from workbench.pipeline.atomic import atomic_write_text

MANIFEST = "manifest.json"
ENVIRONMENT = "environment.json"
INDEX = "index.html"
MAX_METRICS_SHOWN = 16

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem;color:#222;max-width:80rem}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ddd;padding:.25rem .6rem;text-align:left;
vertical-align:top}th{background:#f4f4f4}
.ok{color:#0a7d24;font-weight:600}.failed{color:#b00020;font-weight:600}.skipped{color:#8a6d00;font-weight:600}
.incomplete{color:#b00020;font-weight:600}.muted{color:#666}
.experiment{border:1px solid #ddd;border-radius:6px;padding:.5rem 1rem;margin:1rem 0}
.thumbs img{max-width:280px;max-height:200px;border:1px solid #ccc;margin:.25rem}
pre{background:#f8f8f8;padding:.5rem;overflow-x:auto;font-size:.85rem}
code{font-size:.9rem}
"""


def _page(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _link(href: str | None, text: str) -> str:
    return f"<a href='{escape(href, quote=True)}'>{escape(text)}</a>" if href else ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _run_state(manifest: dict[str, Any]) -> str:
    if manifest.get("complete"):
        return ""
    reason = "interrupted" if manifest.get("interrupted") else "incomplete: still running or stopped"
    return f" <span class='incomplete'>({escape(reason)})</span>"


def _experiment_section(exp: dict[str, Any]) -> str:
    status = str(exp.get("status", "?"))
    name = str(exp.get("name", "?"))
    parts = [
        f"<div class='experiment' id='{escape(name, quote=True)}'>",
        f"<h2>{escape(name)} <span class='{escape(status, quote=True)}'>{escape(status)}</span></h2>",
    ]
    if exp.get("description"):
        parts.append(f"<p>{escape(str(exp['description']))}</p>")
    links = [
        _link(exp.get("html"), "report (HTML)"),
        _link(exp.get("html_noinput"), "report without code"),
        _link(exp.get("notebook"), "executed notebook"),
        _link(exp.get("metrics_file"), "metrics JSON"),
    ]
    meta = f"duration {exp['duration_s']:.1f} s" if isinstance(exp.get("duration_s"), (int, float)) else ""
    parts.append(f"<p>{' · '.join(x for x in [meta, *links] if x)}</p>")
    if exp.get("skip_reason"):
        parts.append(f"<p class='muted'>Skipped: {escape(str(exp['skip_reason']))}</p>")
    error = exp.get("error")
    if error:
        cell = error.get("cell_index")
        where = f" in cell {cell}" if cell is not None else ""
        if error.get("execution_count") is not None:
            where += f" (In [{error['execution_count']}])"
        parts.append(
            f"<p class='failed'>{escape(str(error.get('ename')))}{escape(where)}: "
            f"{escape(str(error.get('evalue')))}</p>"
            f"<details><summary>traceback</summary><pre>{escape(str(error.get('traceback', '')))}</pre></details>"
        )
    metrics = exp.get("metrics") or {}
    if metrics:
        items = list(metrics.items())
        rows = "".join(
            f"<tr><td><code>{escape(str(k))}</code></td><td>{escape(_fmt(v))}</td></tr>"
            for k, v in items[:MAX_METRICS_SHOWN]
        )
        more = f"<p class='muted'>and {len(items) - MAX_METRICS_SHOWN} more in the metrics JSON</p>"
        parts.append(
            f"<table><tr><th>key result</th><th>value</th></tr>{rows}</table>"
            + (more if len(items) > MAX_METRICS_SHOWN else "")
        )
    figures = exp.get("figures") or []
    if figures:
        thumbs = "".join(
            f"<a href='{escape(f, quote=True)}'><img src='{escape(f, quote=True)}' alt='{escape(f, quote=True)}'></a>"
            for f in figures
        )
        parts.append(f"<div class='thumbs'>{thumbs}</div>")
    parts.append("</div>")
    return "\n".join(parts)


def render_run_index(manifest: dict[str, Any], environment: dict[str, Any] | None = None) -> str:
    """The HTML summary of one run, from its manifest (and environment, when there is one)."""
    run_id = str(manifest.get("run_id", "?"))
    experiments = manifest.get("experiments", [])
    counts = {s: sum(1 for e in experiments if e.get("status") == s) for s in ("ok", "failed", "skipped")}
    env = environment or {}
    torch = env.get("torch", {}) if isinstance(env.get("torch"), dict) else {}
    git = env.get("git", {}) if isinstance(env.get("git"), dict) else {}
    facts = [
        ("profile", manifest.get("profile")),
        ("started", manifest.get("started_at")),
        ("finished", manifest.get("finished_at") or "not finished"),
        ("git commit", (git.get("commit") or "unknown") + (" (dirty tree)" if git.get("dirty") else "")),
        ("device", torch.get("device_name")),
        (
            "torch / CUDA / Triton",
            f"{torch.get('version')} / {torch.get('cuda_version')} / {torch.get('triton_version')}",
        ),
        ("python", (env.get("python") or {}).get("version")),
        ("kernel", manifest.get("kernel")),
    ]
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in facts if v is not None)
    summary_rows = "".join(
        f"<tr><td><a href='#{escape(str(e.get('name')), quote=True)}'>{escape(str(e.get('name')))}</a></td>"
        f"<td class='{escape(str(e.get('status')), quote=True)}'>{escape(str(e.get('status')))}</td>"
        f"<td>{e['duration_s']:.1f} s</td></tr>"
        if isinstance(e.get("duration_s"), (int, float))
        else f"<tr><td>{escape(str(e.get('name')))}</td><td>{escape(str(e.get('status')))}</td><td></td></tr>"
        for e in experiments
    )
    pending = manifest.get("pending") or []
    pending_html = f"<p class='incomplete'>Not run: {escape(', '.join(map(str, pending)))}</p>" if pending else ""
    body = (
        f"<p><a href='../{INDEX}'>all runs</a></p>"
        f"<h1>Run {escape(run_id)}{_run_state(manifest)}</h1>"
        f"<p>{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped · "
        f"<a href='{ENVIRONMENT}'>environment.json</a> · <a href='{MANIFEST}'>manifest.json</a></p>"
        f"<table>{rows}</table>"
        f"<table><tr><th>experiment</th><th>status</th><th>duration</th></tr>{summary_rows}</table>"
        f"{pending_html}" + "\n".join(_experiment_section(e) for e in experiments)
    )
    return _page(f"workbench run {run_id}", body)


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
    rows = []
    for run_path, manifest in list_runs(root):
        name = escape(run_path.name)
        if manifest is None:
            rows.append(f"<tr><td>{name}</td><td colspan='5' class='incomplete'>unreadable manifest</td></tr>")
            continue
        exps = manifest.get("experiments", [])
        counts = {s: sum(1 for e in exps if e.get("status") == s) for s in ("ok", "failed", "skipped")}
        state = (
            "<span class='ok'>complete</span>"
            if manifest.get("complete")
            else "<span class='incomplete'>incomplete</span>"
        )
        rows.append(
            f"<tr><td><a href='{escape(run_path.name, quote=True)}/{INDEX}'>{name}</a></td>"
            f"<td>{escape(str(manifest.get('profile')))}</td>"
            f"<td>{escape(str(manifest.get('started_at')))}</td>"
            f"<td>{state}</td>"
            f"<td>{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped</td>"
            f"<td>{escape(', '.join(str(e.get('name')) for e in exps if e.get('status') == 'failed'))}</td></tr>"
        )
    table = (
        "<table><tr><th>run</th><th>profile</th><th>started (UTC)</th><th>state</th><th>experiments</th>"
        "<th>failed</th></tr>" + "".join(rows) + "</table>"
        if rows
        else "<p class='muted'>No runs yet. Run <code>make report</code>.</p>"
    )
    body = f"<h1>Workbench reports</h1><p class='muted'>Newest first.</p>{table}"
    return atomic_write_text(root / INDEX, _page("Workbench reports", body))
