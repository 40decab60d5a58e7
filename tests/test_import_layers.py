"""The library's layers (README, "Layout"): no module imports from a layer above its own."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bottom to top; a module may import from its own layer or below
LAYERS = {
    1: ("config", "errors", "device", "request", "timing", "atomic", "parsing"),
    2: ("kv", "model", "roofline", "hardware"),
    3: ("engine", "dist", "workloads", "bench"),  # dist: the engine starts its own tensor-parallel ranks
    4: ("sim", "serve"),
    5: ("experiments", "plots", "record", "pipeline", "commands", "cli"),
}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "kernels":
        return 2
    if parts[0] != "workbench" or len(parts) < 2:
        return None
    return LAYER_OF.get(parts[1])


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return found


def test_every_library_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in (ROOT / "workbench").iterdir()}
    tops -= {"__init__", "__pycache__", "py"}
    assert tops - set(LAYER_OF) == set()


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for path in sorted([*(ROOT / "workbench").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        own = _layer(module)
        if own is None:
            continue
        for target, line in _imports(path):
            layer = _layer(target)
            if layer is not None and layer > own:
                upward.append(f"{module}:{line} (layer {own}) imports {target} (layer {layer})")
    assert upward == []
