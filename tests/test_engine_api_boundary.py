"""Outside ``workbench/engine/`` the engine is used through its API only (issue 29): no module reads or mutates an
engine's ``sequences``, ``scheduler`` or ``block_manager``.

An AST scan over workbench/ (as tests/test_import_layers.py): an attribute ``sequences``/``scheduler``/
``block_manager`` taken from an expression that names an engine (``engine.x``, ``self.engine.x``, ``eager.engine.x``)
is a violation. The simulator's own replicas (``rep.scheduler``) are not engines and pass.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERNALS = {"sequences", "scheduler", "block_manager"}


def _names_an_engine(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return "engine" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "engine" in node.attr.lower()
    return False


def violations(source: str) -> list[tuple[int, str]]:
    """(line, text) of every engine-internal attribute access in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS and _names_an_engine(node.value):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_scan_finds_each_kind_of_access():
    source = (
        "engine.sequences.pop(1)\nx = self.engine.scheduler.held\nbm = eager_engine.block_manager\n"
        "rep.scheduler.add(seq)\nengine.step()\n"
    )
    assert violations(source) == [
        (1, "engine.sequences"),
        (2, "self.engine.scheduler"),
        (3, "eager_engine.block_manager"),
    ]


def test_no_module_outside_the_engine_touches_its_internals():
    found = []
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("workbench", "engine"):
            continue
        found += [f"{rel}:{line}: {text}" for line, text in violations(path.read_text())]
    assert not found, (
        "use the Engine API (add_request, step, abort, stats, hold/release, add_prefilled):\n" + "\n".join(found)
    )
