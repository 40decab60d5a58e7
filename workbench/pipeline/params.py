"""Notebook parameters: read a notebook's ``parameters`` cell, parse ``--param`` values, validate names.

Only names (and, where the default is a plain literal, JSON types) are checked, so that a typo such as
``--param num_promts=8`` stops the run before anything executes, with the list of valid names.
"""

from __future__ import annotations

import ast
import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError, read_json_file

PARAMETERS_TAG = "parameters"
OUTPUT_DIR_PARAM = "output_dir"
_NO_DEFAULT = object()


@dataclass(frozen=True)
class NotebookParameter:
    """One assignment of a notebook's ``parameters`` cell."""

    name: str
    default: Any  # the literal value, or None when the default is not a literal (see ``has_literal_default``)
    has_literal_default: bool
    annotation: str | None = None


def _cell_source(cell: Mapping[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def read_notebook_json(path: str | Path) -> dict[str, Any]:
    """Load an .ipynb file as plain JSON, with a ConfigError naming the file when it is not one."""
    nb_path = Path(path)
    nb = read_json_file(nb_path, "notebook")
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ConfigError(f"notebook {nb_path} has no 'cells' list; is it an .ipynb file?")
    return nb


def notebook_parameters(path: str | Path) -> dict[str, NotebookParameter] | None:
    """The parameters declared in the cell tagged ``parameters`` of the notebook at ``path``.

    Read by ``papermill.inspect_notebook`` (the parser papermill itself injects parameters with). Returns None when
    no cell carries the tag. Each assignment (``x = 1`` or ``x: int = 1``) is a parameter; a value that is not a
    Python literal (``device = torch.device("cpu")``) is kept as a name without a checkable type.
    """
    import papermill

    nb_path = Path(path)
    nb = read_notebook_json(nb_path)
    tagged = [
        (i, c)
        for i, c in enumerate(nb["cells"])
        if c.get("cell_type") == "code" and PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])
    ]
    if not tagged:
        return None
    index, cell = tagged[0]
    try:
        tree = ast.parse(_cell_source(cell))  # papermill's line parser would skip what it cannot read
    except SyntaxError as exc:
        raise ConfigError(
            f"notebook {nb_path}: the parameters cell (cell {index}) is not valid Python: line {exc.lineno}: {exc.msg}"
        ) from exc
    found: dict[str, NotebookParameter] = {}
    for name, info in papermill.inspect_notebook(str(nb_path)).items():
        try:
            default, literal = ast.literal_eval(info["default"]), True
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            default, literal = None, False
        annotation = info.get("inferred_type_name")
        found[name] = NotebookParameter(name, default, literal, None if annotation in (None, "None") else annotation)
    assigned = {
        (node.targets[0] if isinstance(node, ast.Assign) else node.target).id: node.lineno
        for node in tree.body
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name))
        or (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name))
    }
    unread = sorted((line, name) for name, line in assigned.items() if name not in found)
    if unread:  # papermill skips a line it cannot parse (e.g. an '=' in its comment): it could not be overridden
        lines = ", ".join(f"{name} (line {line})" for line, name in unread)
        raise ConfigError(
            f"notebook {nb_path}: papermill cannot read the parameter(s) {lines} of the parameters cell (cell "
            f"{index}); an '=' in a comment after the value is the usual cause: reword the comment"
        )
    return found


def parse_param(text: str) -> tuple[str, Any]:
    """Parse one ``KEY=VALUE`` of ``--param``: VALUE as JSON, or as a plain string when it is not JSON."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--param {text!r}: expected KEY=VALUE (VALUE in JSON, e.g. n=8, dtype=bf16, xs=[1,2])")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise ConfigError(f"--param {text!r}: {raw} is not a finite number")
    return key, value


def parse_params(items: Iterable[str] | None) -> dict[str, Any]:
    """Parse every ``KEY=VALUE`` (later ones win). KEY may be ``experiment.name`` to target one experiment."""
    result: dict[str, Any] = {}
    for text in items or ():
        key, value = parse_param(text)
        result[key] = value
    return result


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


def _type_ok(default_kind: str, value_kind: str) -> bool:
    if default_kind in ("null", value_kind):
        return True
    return default_kind == "float" and value_kind == "int"


def validate_params(params: Mapping[str, Any], declared: Mapping[str, NotebookParameter] | None, *, where: str) -> None:
    """Raise ConfigError unless every name in ``params`` is declared (and JSON-type compatible with a literal
    default). ``where`` names the experiment and notebook in the message."""
    if not params:
        return
    if declared is None:
        raise ConfigError(
            f"{where}: the notebook has no cell tagged '{PARAMETERS_TAG}', so it takes no parameters; "
            f"got {', '.join(sorted(params))}"
        )
    valid = sorted(declared)
    for name, value in params.items():
        if name not in declared:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{where}: unknown parameter {name!r}{hint}; the notebook's parameters cell declares: "
                f"{', '.join(valid) or '(nothing)'}"
            )
        param = declared[name]
        if param.has_literal_default:
            default_kind, value_kind = _json_kind(param.default), _json_kind(value)
            if not _type_ok(default_kind, value_kind):
                raise ConfigError(
                    f"{where}: parameter {name!r} = {value!r} is a {value_kind}, but its default "
                    f"{param.default!r} is a {default_kind}"
                )


def split_overrides(
    overrides: Mapping[str, Any], experiment_names: Sequence[str]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Split ``--param`` values into global ones and ``experiment.name`` scoped ones."""
    global_params: dict[str, Any] = {}
    scoped: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        prefix, dot, rest = key.partition(".")
        if dot and prefix in experiment_names and rest:
            scoped.setdefault(prefix, {})[rest] = value
        elif dot:
            raise ConfigError(
                f"--param {key}: {prefix!r} is not a selected experiment; "
                f"experiments: {', '.join(experiment_names) or '(none)'}"
            )
        else:
            global_params[key] = value
    return global_params, scoped
