"""Record a notebook's key results: a JSON sidecar the pipeline collects, plus a displayed output.

In a notebook::

    from workbench import record
    record.set_output_dir(output_dir)          # from the parameters cell; the pipeline injects it
    record.record("decode_step_s", 0.0123)     # one value
    record.record({"mbu": 0.61, "mfu": 0.38})  # several at once
    record.result("decode_tokens_per_s", 68.6, unit="tok/s", low=62.3, high=77.3, batch=32, context_len=128)
    record.figure(fig, "roofline")             # figures/roofline.png, shown inline once
    record.table(df, "decode_sweep")           # tables/decode_sweep.csv, shown inline
    record.save()                              # the key-results table; writes metrics.json

Values must be JSON: numbers, strings, booleans, None, lists and string-keyed dicts of them. numpy and torch
scalars and arrays are converted with ``.item()`` / ``.tolist()``; NaN and infinities become None (JSON has
no such numbers). Every ``record`` rewrites the sidecar atomically, so a notebook that fails half-way still
leaves what it had recorded. Without an output folder (``set_output_dir`` not called and the
``WORKBENCH_OUTPUT_DIR`` environment variable unset, as when a notebook is opened by hand) nothing is written
to disk; the values are still displayed.

This module imports nothing from the notebook stack at import time (IPython and matplotlib are only used
when present), and nothing from ``workbench.pipeline``; its files are written by ``workbench.atomic``.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.atomic import atomic_write_bytes

METRICS_FILE = "metrics.json"
FIGURES_DIR = "figures"
TABLES_DIR = "tables"
# the fields of a structured key result (``result``): a report shows its unit, its spread and its conditions
RESULT_KEYS = ("value", "unit", "low", "high", "conditions")
OUTPUT_DIR_ENV = "WORKBENCH_OUTPUT_DIR"
# metadata key on the displayed copy of a saved figure, so the pipeline does not extract it a second time
FIGURE_METADATA_KEY = "workbench_figure"

_MISSING = object()
_metrics: dict[str, Any] = {}
_output_dir: Path | None = None
_FIGURE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def set_output_dir(path: str | os.PathLike[str] | None) -> Path | None:
    """Use ``path`` for the sidecar and figures (None: fall back to ``$WORKBENCH_OUTPUT_DIR``, else no files).

    Returns the folder now in use.
    """
    global _output_dir
    _output_dir = None if path is None or str(path) == "" else Path(path)
    return output_dir()


def output_dir() -> Path | None:
    """The folder the sidecar and figures go to, or None when results are only displayed."""
    if _output_dir is not None:
        return _output_dir
    env = os.environ.get(OUTPUT_DIR_ENV)
    return Path(env) if env else None


def reset() -> None:
    """Forget every recorded value and the output folder (a fresh notebook run)."""
    global _output_dir
    _metrics.clear()
    _output_dir = None


def recorded() -> dict[str, Any]:
    """A copy of the values recorded so far, in recording order."""
    return dict(_metrics)


def to_json_value(value: Any, name: str = "value") -> Any:
    """``value`` as plain JSON data; TypeError naming ``name`` when it has no JSON form."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"record: {name}: key {key!r} is not a string; JSON objects need string keys")
            out[key] = to_json_value(item, f"{name}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [to_json_value(item, f"{name}[{i}]") for i, item in enumerate(value)]
    # numpy / torch scalars and arrays, without importing either
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return to_json_value(value.item(), name)
    if hasattr(value, "tolist"):
        return to_json_value(value.tolist(), name)
    raise TypeError(f"record: {name}: {type(value).__name__} {value!r} is not JSON (numbers, strings, lists, dicts)")


def _write_atomic(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data)


def _write_sidecar() -> Path | None:
    folder = output_dir()
    if folder is None:
        return None
    path = folder / METRICS_FILE
    _write_atomic(path, (json.dumps(_metrics, indent=2, allow_nan=False) + "\n").encode("utf-8"))
    return path


def format_value(value: Any) -> str:
    """A key result for a table, one format for every row: 4 significant digits (thousands separated),
    scientific notation only below 0.001 or from a million on; lists and dicts as short JSON."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.4g}"
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, str):
        return value
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


_format = format_value


# (name pattern, unit): the first pattern found among a key's underscore-separated words names its unit
_UNIT_RULES = (
    (("flops", "per", "s"), "FLOP/s"),
    (("bytes", "per", "s"), "B/s"),
    (("tokens", "per", "s"), "tok/s"),
    (("flop", "per", "byte"), "FLOP/B"),
    (("speedup",), "×"),
    (("ratio",), "×"),
    (("gain",), "×"),
    (("bytes", "per", "token"), "B"),
    (("gbps",), "Gbit/s"),
    (("ms",), "ms"),
    (("us",), "µs"),
    (("s",), "s"),
    (("bytes",), "B"),
    (("flops",), "FLOP"),
)
_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_SCALED_UNITS = ("FLOP/s", "B/s", "B", "FLOP")


def _contains(words: Sequence[str], pattern: Sequence[str]) -> bool:
    n = len(pattern)
    return any(tuple(words[i : i + n]) == tuple(pattern) for i in range(len(words) - n + 1))


def unit_of(name: str) -> str:
    """The unit a key result's name gives it by the workbench's naming (``ttft_ms`` ms, ``kv_bytes`` B,
    ``measured_peak_flops_per_s`` FLOP/s, ``speedup`` ×); '' when its name says none."""
    words = name.lower().split("_")
    for pattern, unit in _UNIT_RULES:
        if pattern == ("s",):
            if words[-1] == "s":
                return unit
        elif _contains(words, pattern):
            return unit
    return ""


def format_quantity(value: Any, unit: str = "") -> str:
    """``value`` in ``unit`` for a table: FLOP/s, B/s, B and FLOP scaled to k, M, G, T (5.874e10 FLOP/s reads
    58.74 GFLOP/s); other units and bare values as ``record.format_value``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and unit in _SCALED_UNITS:
        for scale, prefix in _SI:
            if abs(value) >= scale:
                return f"{value / scale:,.4g} {prefix}{unit}"
        return f"{format_value(float(value))} {unit}"
    text = format_value(value)
    if not unit or not isinstance(value, (int, float)) or isinstance(value, bool):
        return text
    return f"{text}{unit}" if unit == "×" else f"{text} {unit}"


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (a bool, a string, NaN, a missing value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _conditions_text(conditions: Any) -> str:
    if not isinstance(conditions, Mapping):
        return ""
    return ", ".join(f"{k.replace('_', ' ')} {format_value(v)}" for k, v in conditions.items())


def result_row(key: str, value: Any, experiment: str = "") -> dict[str, Any]:
    """One key result as a table row: ``value_text`` with its unit, ``spread_text`` ('62.3 .. 77.3') and
    ``conditions_text`` ('batch 32, context 128') where the record has them; ``value``, ``unit``, ``low``, ``high``
    and ``conditions`` for a CSV."""
    structured = isinstance(value, Mapping) and "value" in value and set(value) <= set(RESULT_KEYS)
    if structured:
        unit = str(value.get("unit") or unit_of(key))
        raw, low, high = value.get("value"), value.get("low"), value.get("high")
        conditions = value.get("conditions") if isinstance(value.get("conditions"), Mapping) else {}
    else:
        unit, raw, low, high, conditions = unit_of(key), value, None, None, {}
    shown_unit = unit if number(raw) is not None else ""
    spread = ""
    if number(low) is not None and number(high) is not None:
        if shown_unit in _SCALED_UNITS:  # each end with its own prefix
            spread = f"{format_quantity(low, shown_unit)} .. {format_quantity(high, shown_unit)}"
        else:
            spread = f"{format_value(low)} .. {format_value(high)} {shown_unit}".rstrip()
    return {
        "experiment": experiment,
        "key": key,
        "value": raw,
        "unit": shown_unit,
        "low": low,
        "high": high,
        "conditions": dict(conditions),
        "value_text": format_quantity(raw, shown_unit),
        "spread_text": spread,
        "conditions_text": _conditions_text(conditions),
    }


def _shown(key: str, value: Any) -> str:
    """A key result as one line of text: value and unit, spread, conditions."""
    row = result_row(key, value)
    text = row["value_text"] + (f" [{row['spread_text']}]" if row["spread_text"] else "")
    return text + (f" ({row['conditions_text']})" if row["conditions_text"] else "")


def _display_table(values: Mapping[str, Any], title: str | None = None) -> None:
    lines = [f"{title}:"] if title else []
    width = max((len(k) for k in values), default=0)
    lines += [f"  {key:<{width}} = {_shown(key, val)}" for key, val in values.items()]
    plain = "\n".join(lines) if title else "\n".join(line.strip() for line in lines)
    rows = "".join(
        f"<tr><td><code>{html.escape(k)}</code></td><td>{html.escape(_shown(k, v))}</td></tr>"
        for k, v in values.items()
    )
    caption = f"<caption style='text-align:left'><b>{html.escape(title)}</b></caption>" if title else ""
    rich = f"<table class='workbench-record'>{caption}{rows}</table>"
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(plain)
        return
    if get_ipython() is None:
        print(plain)
        return
    display({"text/plain": plain, "text/html": rich}, raw=True)


def record(name_or_dict: str | Mapping[str, Any], value: Any = _MISSING, *, show: bool = True) -> dict[str, Any]:
    """Record one key result (``record("ttft_s", 0.2)``) or several (``record({"a": 1, "b": 2})``).

    A name recorded again is overwritten. The values are displayed (unless ``show=False``) and the sidecar
    ``metrics.json`` is rewritten when an output folder is set. Returns the values just recorded.
    """
    if isinstance(name_or_dict, Mapping):
        if value is not _MISSING:
            raise TypeError("record: pass either a dict of results or a name and a value, not both")
        items = dict(name_or_dict)
    elif isinstance(name_or_dict, str):
        if value is _MISSING:
            raise TypeError(f"record({name_or_dict!r}): missing the value")
        items = {name_or_dict: value}
    else:
        raise TypeError(f"record: expected a name (str) or a dict, got {type(name_or_dict).__name__}")
    converted = {}
    for key, item in items.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"record: result names must be non-empty strings, got {key!r}")
        converted[key] = to_json_value(item, key)
    _metrics.update(converted)
    _write_sidecar()
    if show:
        _display_table(converted)
    return converted


def result(
    name: str,
    value: Any,
    *,
    unit: str | None = None,
    low: Any = None,
    high: Any = None,
    show: bool = True,
    **conditions: Any,
) -> dict[str, Any]:
    """Record one key result with what a reader needs to use it: its ``unit``, its spread (``low``..``high``, e.g.
    the min and max of the repeats) and the ``conditions`` it was measured at (``batch=32, context_len=128``).
    Stored as ``{"value", "unit", "low", "high", "conditions"}`` (the fields given) and displayed unless
    ``show=False``; returns that."""
    if (low is None) != (high is None):
        raise TypeError(f"record.result({name!r}): give both low and high (the spread), or neither")
    entry: dict[str, Any] = {"value": value}
    if unit is not None:
        entry["unit"] = str(unit)
    if low is not None:
        entry["low"], entry["high"] = low, high
    if conditions:
        entry["conditions"] = conditions
    return record(name, entry, show=show)[name]


def table(df: Any, name: str, *, show: bool = True) -> Path | None:
    """Save a table (a pandas DataFrame) as ``<output_dir>/tables/<name>.csv`` for a reader to download, and
    display it (unless ``show=False``). Returns the CSV's path (None without an output folder)."""
    if not isinstance(name, str) or not _FIGURE_NAME_RE.match(name):
        raise ValueError(f"record.table: name {name!r} must be letters, digits, '_', '-' or '.'")
    if not hasattr(df, "to_csv"):
        raise TypeError(f"record.table({name!r}): expected a pandas DataFrame, got {type(df).__name__}")
    folder = output_dir()
    path = None
    if folder is not None:
        path = folder / TABLES_DIR / f"{name}.csv"
        _write_atomic(path, df.to_csv(index=False).encode("utf-8"))
    if show:
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            get_ipython = None
        if get_ipython is not None and get_ipython() is not None:
            display(df)
        else:
            print(df.to_string(index=False))
    return path


def figure_path(name: str) -> Path | None:
    """Where ``figure(fig, name)`` writes its PNG (None without an output folder)."""
    folder = output_dir()
    return None if folder is None else folder / FIGURES_DIR / f"{name}.png"


def figure(fig: Any, name: str, *, dpi: int = 150, close: bool = True) -> None:
    """Save the matplotlib figure ``fig`` as ``<output_dir>/figures/<name>.png`` and display that image once.

    The figure is closed afterwards (``close=True``) so that the inline backend does not show it a second
    time. Returns None, so that a figure call ending a notebook cell echoes nothing; ``figure_path(name)``
    says where the PNG went.
    """
    if not isinstance(name, str) or not _FIGURE_NAME_RE.match(name):
        raise ValueError(f"record.figure: name {name!r} must be letters, digits, '_', '-' or '.'")
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    png = buffer.getvalue()
    folder = output_dir()
    path = None
    if folder is not None:
        path = folder / FIGURES_DIR / f"{name}.png"
        _write_atomic(path, png)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Image(data=png, format="png"), metadata={FIGURE_METADATA_KEY: name})
        if close:
            try:
                import matplotlib.pyplot as plt

                plt.close(fig)
            except ImportError:
                pass
    return None


# structured entries of metrics.json, shown by ``conclude`` rather than in the key-results table
STRUCTURED_KEYS = ("claims", "anomalies", "hygiene")


def conclude(claims: list[Mapping[str, Any]], anomalies: list[Mapping[str, Any]] = ()) -> str:  # type: ignore[assignment]
    """Record the experiment's ``claims`` (after ``apply_anomalies``) and ``anomalies`` in metrics.json, and return
    the conclusion as Markdown: the anomalies, then each claim with its one verdict and numbers. A claim keeps
    ``verdict`` (confirmed | not_confirmed | inconclusive) and carries ``ratio``, ``ci_low``, ``ci_high``,
    ``rounds``, ``margin``, ``confidence`` (and, decided in paired rounds, ``control``) in its ``evidence``, or
    ``no_ratio`` saying why it has none; its line shows the ratio with its interval next to the verdict."""
    from workbench.experiments.claims import apply_anomalies, claims_markdown

    final = apply_anomalies(claims, list(anomalies))
    record({"claims": final, "anomalies": list(anomalies)}, show=False)
    return claims_markdown(final, list(anomalies))


def save(title: str = "Key results") -> None:
    """Display every recorded scalar value as one table (claims, anomalies and hygiene are left to ``conclude``)
    and write the sidecar. Returns None, so that a cell ending in ``save()`` echoes nothing."""
    _write_sidecar()
    _display_table({k: v for k, v in _metrics.items() if k not in STRUCTURED_KEYS}, title)
