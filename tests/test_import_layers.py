"""The library's layers (README, "Layout"): no module imports from a layer above its own, and no import cycle.

Every import counts, the ones inside functions too (a deferred import is still a dependency): a cycle through a
function-level import is a cycle all the same.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bottom to top; a module may import from its own layer or below ("kernels" is workbench.kernels, whose files are the
# top-level kernels/ directory)
LAYERS = (
    ("config", "errors", "device", "request", "timing", "atomic", "parsing", "runtime"),
    ("hardware", "roofline"),
    ("kernels",),  # Triton kernels: their benchmark prices its work with the roofline; the model calls them
    ("kv", "model"),
    ("dist",),  # the process-group layer: ranks, spawn/torchrun, timeouts, collectives, the KV transport
    ("engine", "workloads", "bench"),  # the engine starts its tensor-parallel ranks through dist/
    ("cluster",),  # engines joined by dist/: prefill/decode disaggregation
    ("sim", "serve"),
    ("experiments", "plots", "record", "pipeline", "commands", "cli"),
)
LAYER_OF = {name: layer for layer, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    """Every module of workbench/ and kernels/, by dotted name (a package by its own name; kernels/x.py is
    ``workbench.kernels.x``)."""
    found = {}
    for path in sorted([*(ROOT / "workbench").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":
            parts.insert(0, "workbench")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str | None:
    """The layered unit of ``module``: ``workbench``'s top-level module or package (``kernels`` among them)."""
    parts = module.split(".")
    if parts[0] != "workbench" or len(parts) < 2:
        return None
    return parts[1]


def _resolve(target: str) -> str | None:
    """The module of ours that importing ``target`` loads (``workbench.x.y.name`` -> ``workbench.x.y``)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module of ours, line) for every import in ``path``, at any depth (functions included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            module = _resolve(name)
            if module is not None:
                found.append((module, node.lineno))
    return found


EDGES = {module: _imports(path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a three-node ring plus a tail is one cycle; a chain is none."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_every_library_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in (ROOT / "workbench").iterdir()}
    tops -= {"__init__", "__pycache__", "py"}
    assert tops - set(LAYER_OF) == set()
    assert all(_unit(module) in LAYER_OF for module in MODULES if module != "workbench")


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for module, imports in EDGES.items():
        own = LAYER_OF.get(_unit(module) or "")
        if own is None:
            continue
        for target, line in imports:
            layer = LAYER_OF.get(_unit(target) or "")
            if layer is not None and layer > own:
                upward.append(f"{module}:{line} (layer {own}) imports {target} (layer {layer})")
    assert upward == []


def test_no_import_cycle_between_modules():
    graph = {module: {target for target, _ in imports if target != module} for module, imports in EDGES.items()}
    assert _cycles(graph) == []


def test_no_import_cycle_between_packages():
    """Packages of one layer may import each other one way only (e.g. engine/ <-> dist/ was a cycle)."""
    graph: dict[str, set[str]] = {}
    for module, imports in EDGES.items():
        unit = _unit(module)
        if unit is None:
            continue
        graph.setdefault(unit, set()).update(
            target_unit for target, _ in imports if (target_unit := _unit(target)) not in (None, unit)
        )
    assert _cycles(graph) == []
