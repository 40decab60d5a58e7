"""The nbval set-up of the experiment notebooks.

``make test`` runs nbval in lax mode on ``notebooks/``: only cells marked ``# NBVAL_CHECK_OUTPUT`` are
compared with their stored outputs, after ``notebooks/nbval_sanitize.cfg`` has rewritten paths, addresses
and timestamps. nbval skips the comparison of a cell that was never run, so a notebook saved without outputs
would pass silently; the contract below makes that a failure: every committed notebook carries the outputs
of a full run, and at least one checked cell. The last test runs nbval itself on a fixture: a stored output
that differs only in paths and addresses passes (the sanitize file), a changed number fails, and a cleared
notebook passes nbval, which is what the contract is for.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SANITIZE = NOTEBOOKS / "nbval_sanitize.cfg"
FIXTURES = Path(__file__).parent / "data" / "notebooks"
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"


def committed_notebooks() -> list[Path]:
    """The experiment notebooks under notebooks/ (checkpoints excluded)."""
    return sorted(p for p in NOTEBOOKS.glob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def stored_output_problems(nb: dict[str, Any]) -> list[str]:
    """Why ``nb`` (notebook JSON) does not carry the outputs of a full run; empty when it does."""
    problems = []
    code = [(i, c) for i, c in enumerate(nb.get("cells", [])) if c.get("cell_type") == "code" and _source(c).strip()]
    if not code:
        return ["no code cells"]
    unexecuted = [i for i, c in code if c.get("execution_count") is None]
    if unexecuted:
        problems.append(f"code cells never executed (no stored run): {unexecuted}")
    checked = [(i, c) for i, c in code if CHECK_MARK in _source(c)]
    if not checked:
        problems.append(f"no cell marked {CHECK_MARK}: nbval --nbval-lax would check nothing")
    problems += [
        f"cell {i} is marked {CHECK_MARK} but has no stored output" for i, c in checked if not c.get("outputs")
    ]
    problems += [
        f"cell {i} stores an error: {o.get('ename')}: {o.get('evalue')}"
        for i, c in code
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    return problems


def test_the_experiment_notebooks_are_there() -> None:
    # an empty notebooks/ would make nbval and the contract below check nothing
    assert committed_notebooks(), "no experiment notebooks under notebooks/"


@pytest.mark.parametrize("path", committed_notebooks(), ids=lambda p: p.name)
def test_committed_notebook_carries_its_outputs(path: Path) -> None:
    problems = stored_output_problems(json.loads(path.read_text(encoding="utf-8")))
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems) + " (run it and save it with outputs)"


def test_output_check_catches_a_notebook_without_outputs() -> None:
    executed = json.loads((FIXTURES / "nbval_fixture.ipynb").read_text())
    assert stored_output_problems(executed) == []
    problems = stored_output_problems(_clear_outputs(executed))
    assert any("never executed" in p for p in problems)
    assert any("cell 1 is marked" in p for p in problems)
    # a never-run notebook with no checked cell (the pipeline fixture) fails on both counts
    assert len(stored_output_problems(json.loads((FIXTURES / "tiny.ipynb").read_text()))) == 2


def _sanitize(text: str) -> str:
    from nbval.plugin import get_sanitize_patterns

    for regex, replace in get_sanitize_patterns(SANITIZE.read_text()):
        text = re.sub(regex, replace, text)
    return text


def test_sanitize_rewrites_machine_specific_text_only() -> None:
    assert _sanitize("cwd /tmp/pytest-of-a/x/nb") == _sanitize("cwd /work/main/notebooks") == "cwd PATH"
    assert _sanitize("<object at 0x7f3a2b1c0d20>") == _sanitize("<object at 0x55aa00112233>")
    assert _sanitize("run 20250102T030405Z-abc1234 at 2025-01-02T03:04:05+00:00") == "run RUN-ID at TIMESTAMP"
    # numbers and units a checked cell is about stay as they are
    for kept in ("KV bytes per token: 131072", "12.5 GB/s, 3/4 of tokens/s", "0x10", "ratio 1/2", "MHA 4096 MiB"):
        assert _sanitize(kept) == kept


def _clear_outputs(nb: dict[str, Any]) -> dict[str, Any]:
    nb = copy.deepcopy(nb)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def test_nbval_checks_marked_cells_and_the_output_contract_covers_what_it_skips(tmp_path: Path) -> None:
    # The fixture was run in tests/data/notebooks: its checked cell's output holds that path and an address,
    # both different here (the sanitize file makes them equal); its unchecked cell prints a clock.
    stored = json.loads((FIXTURES / "nbval_fixture.ipynb").read_text())
    wrong = copy.deepcopy(stored)
    output = wrong["cells"][1]["outputs"][0]
    output["text"] = "".join(output["text"]).replace("131072", "131073")  # 2 * 32 * 8 * 128 * 2 = 131072
    files = {"good": stored, "wrong": wrong, "cleared": _clear_outputs(stored)}
    for name, nb in files.items():
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(nb))
    args = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--nbval-lax"]
    args += ["--nbval-current-env", "--nbval-sanitize-with", str(SANITIZE), "--rootdir", str(tmp_path)]
    args += [f"{name}.ipynb" for name in files]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    log = done.stdout + done.stderr
    assert "PASSED good.ipynb::Cell 0" in log, log
    assert "FAILED wrong.ipynb::Cell 0" in log, log
    # nbval skips the comparison of a cell that was never run, so a cleared notebook passes nbval...
    assert "PASSED cleared.ipynb::Cell 0" in log, log
    # ...which is why the stored-output contract above exists: it fails that notebook
    assert stored_output_problems(files["cleared"]) and not stored_output_problems(files["good"])
