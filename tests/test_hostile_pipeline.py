"""Pipeline provenance when things go wrong (issue 14): the git state of the notebooks' own checkout, a kernel that
dies after some cells, and a Ctrl-C whose .partial notebook must say which cells never ran."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import nbformat
import pytest

from workbench.pipeline import runner
from workbench.pipeline.environment import capture_environment
from workbench.pipeline.spec import load_spec

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def write_notebook(path: Path, sources: list[str]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 0", metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(src) for src in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def write_spec(folder: Path, notebook: str) -> Path:
    spec = folder / "pipeline.yaml"
    spec.write_text(f"kernel: python3\ntimeout_s: 60\nexperiments:\n  - name: exp\n    notebook: {notebook}\n")
    return spec


def test_environment_records_the_notebooks_checkout_and_its_modified_notebook(tmp_path: Path) -> None:
    repo = tmp_path / "checkout"
    repo.mkdir()
    write_notebook(repo / "nb.ipynb", ["y = 1"])
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*GIT, "-C", str(repo), "add", "nb.ipynb"], check=True)
    subprocess.run([*GIT, "-C", str(repo), "commit", "-q", "-m", "nb"], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    env = capture_environment(profile="smoke", parameters={}, kernel="python3", run_id="r", measure=False,
                              source_dir=repo)  # fmt: skip
    assert env["git"]["commit"] == head.strip() and env["git"]["dirty"] is False
    write_notebook(repo / "nb.ipynb", ["y = 2"])  # the notebook is modified after its commit
    env = capture_environment(profile="smoke", parameters={}, kernel="python3", run_id="r", measure=False,
                              source_dir=repo)  # fmt: skip
    assert env["git"]["dirty"] is True and env["git"]["modified_files"] == ["nb.ipynb"]
    assert Path(env["git"]["toplevel"]).resolve() == repo.resolve()
    assert "package_git" in env  # the installed package's checkout is another one, recorded beside it


def run_one(tmp_path: Path, sources: list[str]) -> tuple[dict, Path]:
    write_notebook(tmp_path / "nb.ipynb", sources)
    plan = runner.plan_run(load_spec(write_spec(tmp_path, "nb.ipynb")), profile="smoke", kernel="python3",
                           probe=lambda r: None)  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return runner.execute_experiment(plan.experiments[0], run_dir, kernel=plan.kernel), run_dir


def statuses(nb) -> list[str]:
    return [c.metadata.papermill["status"] for c in nb.cells]


def test_kernel_death_is_recorded_in_the_cell_where_it_died(tmp_path: Path) -> None:
    # source cells: 0 parameters, 1-5 run, 6 kills the kernel, 7 never runs
    entry, run_dir = run_one(tmp_path, [f"a{i} = {i}" for i in range(5)] + ["import os; os._exit(1)", "b = 1"])
    assert entry["status"] == "failed"
    assert entry["error"]["cell_index"] == 6, entry["error"]
    nb = nbformat.read(run_dir / entry["notebook"], as_version=4)
    assert statuses(nb) == ["completed"] * 6 + ["failed", "pending"]  # no parameters given: nothing injected
    assert nb.metadata.papermill["stopped"]["cells_started"] == 7


def test_ctrl_c_leaves_a_partial_notebook_that_says_which_cells_never_ran(tmp_path, monkeypatch) -> None:
    from papermill.clientwrap import PapermillNotebookClient

    original = PapermillNotebookClient.execute_cell

    def interrupted(self, cell, index, **kwargs):
        if index == 4:  # Ctrl-C while the fourth cell after the parameters cell runs
            raise KeyboardInterrupt
        return original(self, cell, index, **kwargs)

    monkeypatch.setattr(PapermillNotebookClient, "execute_cell", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_one(tmp_path, [f"a{i} = {i}" for i in range(8)])
    (partial,) = (tmp_path / "run").rglob("*.partial.ipynb")
    nb = nbformat.read(partial, as_version=4)
    assert statuses(nb) == ["completed"] * 4 + ["failed"] + ["pending"] * 4
    assert nb.metadata.papermill["stopped"] == {"reason": "interrupted", "cells_started": 5}
    assert json.loads(nbformat.writes(nb))  # still a valid notebook
