"""The notebook pipeline: spec and parameter validation, atomic writes, the record helper, and one end-to-end
``workbench report`` run of tests/data/pipeline_test.yaml (two tiny notebooks, one failing on purpose, and
one experiment that needs CUDA), shared by the end-to-end assertions because kernel start-up is slow."""

from __future__ import annotations

import html
import importlib.metadata
import json
import math
import platform
import re
import sys
import time
import types
from pathlib import Path

import pytest

from workbench import cli, record
from workbench.atomic import atomic_open, atomic_write_json, atomic_write_text
from workbench.errors import ConfigError
from workbench.pipeline import runner
from workbench.pipeline import spec as spec_mod
from workbench.pipeline.environment import capture_environment, measured_ceilings
from workbench.pipeline.params import notebook_parameters, parse_param, parse_params
from workbench.pipeline.spec import choose_profile, load_spec, parse_spec

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent
TEST_SPEC = DATA / "pipeline_test.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cuda() -> bool:
    return spec_mod.cuda_available()


def _text_of(page: str) -> str:
    """The text of an HTML page: tags removed (syntax highlighting splits code into spans), entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def _leftovers(root: Path) -> list[Path]:
    """Temporary files of atomic writes or of an unfinished papermill run."""
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".partial.ipynb")]


# ---------------------------------------------------------------- end to end (one run, many assertions)


@pytest.fixture(scope="module")
def report_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("reports")
    argv = ["report", "--spec", str(TEST_SPEC), "--profile", "smoke", "--out", str(out)]
    argv += ["--param", 'label="cli"', "--no-progress", "--no-ceilings"]
    code = cli.main(argv)
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    run_dir = runs[0]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {
        "code": code,
        "out": out,
        "run_dir": run_dir,
        "manifest": manifest,
        "by_name": {e["name"]: e for e in manifest["experiments"]},
    }


def test_report_exits_nonzero_when_an_experiment_failed(report_run: dict) -> None:
    assert report_run["code"] == 1


def test_manifest_contract(report_run: dict) -> None:
    manifest = report_run["manifest"]
    assert manifest["complete"] is True and manifest["interrupted"] is False
    assert manifest["profile"] == "smoke"
    assert manifest["pending"] == []
    assert [e["name"] for e in manifest["experiments"]] == ["tiny", "broken", "needs_cuda"]
    for entry in manifest["experiments"]:
        for key in ("name", "status", "duration_s", "notebook", "html", "metrics"):
            assert key in entry, (entry["name"], key)
        assert entry["status"] in ("ok", "failed", "skipped")
        assert isinstance(entry["duration_s"], float) and entry["duration_s"] >= 0.0
        assert ("error" in entry) == (entry["status"] == "failed")
    assert report_run["by_name"]["tiny"]["status"] == "ok"
    assert report_run["by_name"]["broken"]["status"] == "failed"
    assert manifest["counts"]["failed"] == 1
    # the run id starts with a sortable UTC timestamp and ends with the short commit (or 'nogit')
    stamp, _, commit = manifest["run_id"].partition("-")
    assert len(stamp) == 16 and stamp[8] == "T" and stamp.endswith("Z") and commit
    assert report_run["run_dir"].name == manifest["run_id"]


def test_ok_experiment_outputs(report_run: dict) -> None:
    run_dir, entry = report_run["run_dir"], report_run["by_name"]["tiny"]
    metrics = dict(entry["metrics"])
    assert json.loads((run_dir / entry["metrics_file"]).read_text()) == metrics
    # the notebook ran in its own report folder, and was told where it came from
    assert Path(metrics.pop("cwd")).resolve() == (run_dir / "tiny").resolve()
    assert Path(metrics.pop("notebook_dir")).resolve() == (DATA / "notebooks").resolve()
    # smoke params n=4 from the spec, label from --param: sum of i*i for i < 4 is 0 + 1 + 4 + 9 = 14
    assert metrics == {"sum_of_squares": 14, "n": 4, "label": "cli", "seed": 0}
    assert entry["params"] == {"n": 4, "label": "cli"}

    executed = json.loads((run_dir / entry["notebook"]).read_text())
    code_cells = [c for c in executed["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code_cells)
    injected = [c for c in code_cells if "injected-parameters" in c["metadata"].get("tags", [])]
    assert len(injected) == 1
    assert "label = " in "".join(injected[0]["source"]) and str(run_dir / "tiny") in "".join(injected[0]["source"])

    full = (run_dir / entry["html"]).read_text()
    bare = (run_dir / entry["html_noinput"]).read_text()
    assert "data:image/png;base64," in full and "data:image/png;base64," in bare  # images embedded
    assert "squares = [i * i for i in range(n)]" in _text_of(full)
    assert "range(n)" not in _text_of(bare)  # inputs hidden
    # both pages open with the experiment's summary: its key results and the parameters it ran with
    for page in (full, bare):
        summary = page[page.index('<div class="workbench-summary">') :]
        summary = summary[: summary.index("</div>")]
        assert "&lt;" not in summary and "<code>sum_of_squares</code>" in summary  # HTML, not escaped text
        params = summary[summary.index("Parameters of this run") :]
        assert "<code>label</code>" in params and "cli" in params
    assert entry["tables"] == []

    # one figure saved by record.figure, one inline image extracted by the pipeline (source cell 4)
    assert entry["figures"] == ["tiny/figures/cell04-1.png", "tiny/figures/squares.png"]
    for rel in entry["figures"]:
        assert (run_dir / rel).read_bytes().startswith(PNG_MAGIC)


def test_failed_experiment_is_recorded_and_others_ran(report_run: dict) -> None:
    run_dir, entry = report_run["run_dir"], report_run["by_name"]["broken"]
    error = entry["error"]
    assert error["cell_index"] == 3  # cells: parameters, markdown, record, the division
    assert error["ename"] == "ZeroDivisionError"
    assert "division by zero" in error["evalue"]
    assert "1 / divisor" in error["traceback"] and "\x1b[" not in error["traceback"]
    assert error["source"] == "ratio = 1 / divisor"
    # what it recorded before failing is kept, and its executed notebook and HTML are there to debug with
    assert entry["metrics"] == {"before_failure": 1}
    assert (run_dir / entry["notebook"]).is_file() and (run_dir / entry["html"]).is_file()
    # the experiment before it succeeded and the one after it was still considered
    assert report_run["by_name"]["tiny"]["status"] == "ok"
    assert "needs_cuda" in report_run["by_name"]


def test_unmet_requirement_is_skipped_not_failed(report_run: dict) -> None:
    entry = report_run["by_name"]["needs_cuda"]
    if _cuda():
        assert entry["status"] == "ok" and entry["metrics"]["sum_of_squares"] == 1  # n=2: 0 + 1
    else:
        assert entry["status"] == "skipped"
        assert "cuda" in entry["skip_reason"]
        assert not (report_run["run_dir"] / "needs_cuda").exists()


def test_environment_json(report_run: dict) -> None:
    env = json.loads((report_run["run_dir"] / "environment.json").read_text())
    assert env["run_id"] == report_run["manifest"]["run_id"]
    assert env["profile"] == "smoke"
    assert env["python"]["version"] == platform.python_version()
    assert env["packages"]["papermill"] == importlib.metadata.version("papermill")
    assert env["torch"]["version"] == importlib.import_module("torch").__version__
    assert env["cpu"]["model"]
    assert set(env["git"]) >= {"commit", "dirty"}
    # notebook defaults overlaid with the spec's and the command line's values
    assert env["parameters"]["tiny"] == {"n": 4, "label": "cli", "seed": 0}
    assert env["parameters"]["broken"] == {"divisor": 0}
    assert env["seeds"]["tiny"] == {"seed": 0}
    assert env["measured_ceilings"]["available"] is False and env["measured_ceilings"]["reason"]


def test_run_and_cross_run_indexes(report_run: dict) -> None:
    run_dir, out = report_run["run_dir"], report_run["out"]
    page = (run_dir / "index.html").read_text()
    for needle in ("tiny", "broken", "needs_cuda", "ZeroDivisionError", "tiny/tiny.html", "tiny/figures/squares.png"):
        assert needle in page
    top = (out / "index.html").read_text()
    assert f"{run_dir.name}/index.html" in top and "complete" in top
    results = (run_dir / "key_results.csv").read_text().splitlines()
    assert results[0] == "experiment,key,value,unit,low,high,conditions" and "tiny,sum_of_squares,14,,,," in results
    assert (run_dir / "claims.csv").read_text().startswith("experiment,claim,verdict,ratio,")
    assert _leftovers(out) == []


# ---------------------------------------------------------------- errors before anything runs


def test_bad_parameter_name_fails_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "reports"
    code = cli.main(["report", "--spec", str(TEST_SPEC), "--profile", "smoke", "--out", str(out), "--param", "nn=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "'nn'" in err and "did you mean 'n'" in err and "declared parameters" in err and "label" in err
    assert not out.exists()


def test_scoped_parameter_typo_names_the_notebook_and_suggests(tmp_path: Path) -> None:
    spec = load_spec(TEST_SPEC)
    with pytest.raises(
        ConfigError, match=r"unknown parameter 'lable'.*did you mean 'label'.*label, n, output_dir, seed"
    ):
        runner.plan_run(spec, profile="smoke", overrides={"tiny.lable": "x"}, probe=lambda r: None)
    with pytest.raises(ConfigError, match=r"'tinny' is not a selected experiment"):
        runner.plan_run(spec, profile="smoke", overrides={"tinny.n": 3}, probe=lambda r: None)


def test_output_dir_belongs_to_the_pipeline() -> None:
    spec = load_spec(TEST_SPEC)
    with pytest.raises(ConfigError, match=r"'output_dir' is set by the pipeline"):
        runner.plan_run(spec, profile="smoke", overrides={"output_dir": "/tmp/x"}, probe=lambda r: None)


def test_parameter_type_must_match_a_literal_default() -> None:
    spec = load_spec(TEST_SPEC)
    with pytest.raises(ConfigError, match=r"'n' = 'four' is a str, but its default 4 is a int"):
        runner.plan_run(spec, profile="smoke", overrides={"n": "four"}, probe=lambda r: None)


def test_spec_typo_in_another_profile_is_caught(tmp_path: Path) -> None:
    (tmp_path / "nb.ipynb").write_text((DATA / "notebooks" / "tiny.ipynb").read_text())
    data = {"experiments": [{"name": "a", "notebook": "nb.ipynb", "params": {"gpu": {"m": 1}}}]}
    spec = parse_spec(data, tmp_path / "spec.yaml")
    with pytest.raises(ConfigError, match=r"params.gpu.*unknown parameter 'm'"):
        runner.plan_run(spec, profile="smoke", probe=lambda r: None)


def test_only_selects_and_rejects_unknown_names() -> None:
    spec = load_spec(TEST_SPEC)
    plan = runner.plan_run(spec, profile="smoke", only=["broken"], probe=lambda r: None)
    assert [p.name for p in plan.experiments] == ["broken"]
    with pytest.raises(ConfigError, match=r"no experiment named 'nope'.*tiny, broken, needs_cuda"):
        runner.plan_run(spec, profile="smoke", only=["nope"], probe=lambda r: None)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"experiments": [{"name": "a b", "notebook": "nb.ipynb"}]}, r"'name' must be"),
        ({"experiments": [{"name": "a", "notebook": "missing.ipynb"}]}, r"missing.ipynb does not exist"),
        ({"experiments": [{"name": "a", "notebook": "nb.ipynb", "requires": ["tpu"]}]}, r"unknown requirement.*tpu"),
        ({"experiments": [{"name": "a", "notebook": "nb.ipynb", "params": {"huge": {}}}]}, r"unknown profile 'huge'"),
        ({"experiments": [{"name": "a", "notebook": "nb.ipynb", "param": {}}]}, r"unknown key\(s\) \['param'\]"),
        ({"experiments": [{"name": "a", "notebook": "nb.ipynb"}] * 2}, r"'a' appears twice"),
        ({"experiment": []}, r"unknown key\(s\) \['experiment'\]"),
        ({"timeout_s": -1, "experiments": []}, r"timeout_s"),
        (
            {"experiments": [{"name": "a", "notebook": "nb.ipynb", "params": {"cpu": {"when": {1, 2}}}}]},
            r"params.cpu.when.*not a JSON value",
        ),
    ],
)
def test_spec_validation_names_the_problem(tmp_path: Path, data: dict, message: str) -> None:
    (tmp_path / "nb.ipynb").write_text((DATA / "notebooks" / "tiny.ipynb").read_text())
    with pytest.raises(ConfigError, match=message):
        parse_spec(data, tmp_path / "spec.yaml")


def test_empty_spec_has_nothing_to_run(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("experiments: []\n")
    with pytest.raises(ConfigError, match="lists no experiments"):
        runner.plan_run(load_spec(path), profile="smoke")


def test_repository_spec_parses() -> None:
    spec = load_spec(Path(__file__).parents[1] / "notebooks" / "pipeline.yaml")
    assert spec.kernel == "workbench"
    # every profile's parameters are names the notebooks declare, with types matching their defaults
    for profile in ("smoke", "cpu", "gpu"):
        plan = runner.plan_run(spec, profile=profile, probe=lambda r: None)
        assert [p.name for p in plan.experiments] == [
            "prefill_vs_decode", "kv_cache_variants", "batching", "chunked_prefill", "disaggregation",
            "parallelism_and_capacity", "simulator_validation", "decode_levers", "speculative_decoding",
        ]  # fmt: skip


# ---------------------------------------------------------------- profile, parameters, kernel


def test_profile_from_hardware() -> None:
    assert choose_profile(None, has_cuda=lambda: True) == "gpu"
    assert choose_profile(None, has_cuda=lambda: False) == "cpu"
    assert choose_profile("smoke", has_cuda=lambda: True) == "smoke"
    with pytest.raises(ConfigError, match="unknown profile 'fast'; profiles: smoke, cpu, gpu"):
        choose_profile("fast")


def test_plan_uses_the_chosen_profiles_params(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_spec(TEST_SPEC)
    monkeypatch.setattr(spec_mod, "cuda_available", lambda: False)
    plan = runner.plan_run(spec, probe=lambda r: None)
    assert plan.profile == "cpu"
    tiny = plan.experiments[0]
    assert tiny.params == {"n": 5}
    assert tiny.effective_params == {"n": 5, "label": "default", "seed": 0}
    assert tiny.inject_output_dir
    monkeypatch.setattr(spec_mod, "cuda_available", lambda: True)
    plan = runner.plan_run(spec, probe=lambda r: None)
    assert plan.profile == "gpu" and plan.experiments[0].params == {}  # no gpu params: notebook defaults


def test_requirement_probe_marks_skip_reason() -> None:
    spec = load_spec(TEST_SPEC)
    plan = runner.plan_run(spec, profile="smoke", probe=lambda r: f"no {r} here")
    assert [p.skip_reason for p in plan.experiments] == [None, None, "no cuda here"]


def test_parse_param_values() -> None:
    assert parse_param("n=8") == ("n", 8)
    assert parse_param("dtype=bf16") == ("dtype", "bf16")
    assert parse_param("xs=[1, 2]") == ("xs", [1, 2])
    assert parse_param("flag=true") == ("flag", True)
    assert parse_param('s="8"') == ("s", "8")
    assert parse_param("expr=a=b") == ("expr", "a=b")
    assert parse_params(["n=1", "n=2"]) == {"n": 2}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_param("n")
    with pytest.raises(ConfigError, match="not a finite number"):
        parse_param("x=NaN")


def test_notebook_parameters_cell_is_read() -> None:
    params = notebook_parameters(DATA / "notebooks" / "tiny.ipynb")
    assert {name: p.default for name, p in params.items()} == {
        "n": 4,
        "label": "default",
        "seed": 0,
        "output_dir": None,
    }


def test_a_parameter_papermill_cannot_read_is_an_error(tmp_path: Path) -> None:
    # papermill's line parser skips "x = None  # ... (y = False)": the parameter could then not be overridden
    source = "n = 4\nop_profile = None  # a file; None: measured now (or the stored one, measure = False)\n"
    cell = {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": source, "outputs": [],
            "execution_count": None}  # fmt: skip
    path = tmp_path / "p.ipynb"
    meta = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    path.write_text(json.dumps({"cells": [cell], "metadata": meta, "nbformat": 4, "nbformat_minor": 5}))
    with pytest.raises(ConfigError, match=r"cannot read the parameter\(s\) op_profile \(line 2\)"):
        notebook_parameters(path)


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")), ids=lambda p: p.name[:2])
def test_every_parameter_of_the_experiment_notebooks_is_read(path: Path) -> None:
    assert notebook_parameters(path)  # raises on a parameter papermill would skip


def test_notebook_without_parameters_cell(tmp_path: Path) -> None:
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": "x = 1", "outputs": []}], "metadata": {}}
    path = tmp_path / "plain.ipynb"
    path.write_text(json.dumps(nb))
    assert notebook_parameters(path) is None
    data = {"experiments": [{"name": "p", "notebook": "plain.ipynb", "params": {"cpu": {"x": 2}}}]}
    with pytest.raises(ConfigError, match="no cell tagged 'parameters'"):
        runner.plan_run(parse_spec(data, tmp_path / "s.yaml"), profile="cpu", probe=lambda r: None)


def test_kernel_falls_back_only_from_the_default() -> None:
    assert runner.resolve_kernel("workbench", {"workbench", "python3"}) == ("workbench", None)
    name, note = runner.resolve_kernel("workbench", {"python3"})
    assert name == "python3" and "not installed" in note
    with pytest.raises(ConfigError, match="kernel 'julia' is not installed; installed kernels: python3"):
        runner.resolve_kernel("julia", {"python3"})


def test_run_id_is_sortable() -> None:
    from datetime import datetime, timezone

    early = runner.new_run_id(datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc), "abc1234")
    late = runner.new_run_id(datetime(2025, 1, 10, 0, 0, 0, tzinfo=timezone.utc), None)
    assert early == "20250102T030405Z-abc1234" and late == "20250110T000000Z-nogit"
    assert sorted([late, early]) == [early, late]


# ---------------------------------------------------------------- atomic writes and interruption


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert _leftovers(tmp_path) == []


def test_failed_atomic_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    atomic_write_text(path, "old\n")
    with pytest.raises(TypeError):
        atomic_write_json(path, {"x": object()})
    with pytest.raises(RuntimeError), atomic_open(path) as handle:
        handle.write("half of a new")
        raise RuntimeError("interrupted mid-write")
    assert path.read_text() == "old\n"
    assert _leftovers(tmp_path) == []


def test_sigterm_marks_the_running_experiment_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal

    spec = load_spec(TEST_SPEC)
    plan = runner.plan_run(spec, profile="smoke", kernel="python3", probe=lambda r: None)

    def fake_execute(planned, run_dir, *, kernel, timeout_s=None):
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` does while a notebook runs
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.setattr(runner, "execute_experiment", fake_execute)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        runner.run_pipeline(plan, tmp_path, progress=False, measure_ceilings=False)
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["interrupted"] is True and manifest["complete"] is False
    assert [(e["name"], e["status"], e["interrupted"]) for e in manifest["experiments"]] == [("tiny", "failed", True)]
    assert "SIGTERM" in manifest["experiments"][0]["error"]["evalue"]


def test_interrupted_run_reads_as_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_spec(TEST_SPEC)
    plan = runner.plan_run(spec, profile="smoke", kernel="python3", probe=lambda r: None)
    calls = []

    def fake_execute(planned, run_dir, *, kernel, timeout_s=None):
        calls.append(planned.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {
            "name": planned.name,
            "status": "ok",
            "duration_s": 0.5,
            "notebook": None,
            "html": None,
            "metrics": {"x": 1},
        }

    monkeypatch.setattr(runner, "execute_experiment", fake_execute)
    with pytest.raises(KeyboardInterrupt):
        runner.run_pipeline(plan, tmp_path, progress=False, measure_ceilings=False)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["interrupted"] is True
    # the experiment that was running is failed and interrupted, not left pending
    assert [(e["name"], e["status"], e.get("interrupted")) for e in manifest["experiments"]] == [
        ("tiny", "ok", None), ("broken", "failed", True)]  # fmt: skip
    assert manifest["experiments"][1]["error"]["ename"] == "KeyboardInterrupt"
    assert manifest["pending"] == ["needs_cuda"]
    assert "interrupted" in (run_dir / "index.html").read_text()
    assert "incomplete" in (tmp_path / "index.html").read_text()
    assert (run_dir / "environment.json").is_file()
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------- environment and the record helper


def test_measured_ceilings_fallback_and_success(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "workbench.hardware", None)  # import fails
    missing = measured_ceilings()
    assert missing["available"] is False and "workbench.hardware is not available" in missing["reason"]

    class Spec:
        def to_dict(self) -> dict:
            return {"peak_tflops": 1.5, "bandwidth_gbps": 20.0}

    fake = types.ModuleType("workbench.hardware")
    fake.measured_spec = Spec
    monkeypatch.setitem(sys.modules, "workbench.hardware", fake)
    assert measured_ceilings() == {"available": True, "peak_tflops": 1.5, "bandwidth_gbps": 20.0}

    def broken() -> None:
        raise RuntimeError("no timer")

    fake.measured_spec = broken
    assert measured_ceilings() == {"available": False, "reason": "measured_spec() failed: RuntimeError: no timer"}

    def by_device(device: str = "cpu") -> Spec:
        assert device == "auto"  # the device the notebooks run on, not the CPU by default
        return Spec()

    fake.measured_spec = by_device
    assert measured_ceilings()["peak_tflops"] == 1.5


def test_capture_environment_records_seeds_and_parameters() -> None:
    env = capture_environment(
        profile="cpu",
        parameters={"a": {"seed": 3, "data_seed": 4, "n": 1}, "b": {"n": 2}},
        kernel="k",
        run_id="r",
        measure=False,
    )
    assert env["seeds"] == {"a": {"seed": 3, "data_seed": 4}}
    assert env["parameters"]["b"] == {"n": 2}
    assert env["measured_ceilings"]["available"] is False
    json.dumps(env, allow_nan=False)  # all of it is JSON


def test_capture_environment_records_the_openmp_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # the thread count and whether OpenMP's waiting threads spin both change the timings a report holds
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = capture_environment(profile="cpu", parameters={}, kernel="k", run_id="r", measure=False)
    assert env["env"]["OMP_NUM_THREADS"] == "3" and env["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "CUDA_VISIBLE_DEVICES" not in env["env"]
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert "OMP_WAIT_POLICY" not in capture_environment(profile="cpu", parameters={}, kernel="k", run_id="r",
                                                        measure=False)["env"]  # fmt: skip


@pytest.fixture
def clean_record(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(record.OUTPUT_DIR_ENV, raising=False)
    record.reset()
    yield record
    record.reset()


def test_record_writes_sidecar_and_displays(clean_record, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    np = pytest.importorskip("numpy")
    clean_record.set_output_dir(tmp_path)
    clean_record.record("ttft_s", np.float32(0.25))
    clean_record.record({"tokens": np.int64(7), "lengths": np.arange(3), "bad": math.nan})
    assert json.loads((tmp_path / "metrics.json").read_text()) == {
        "ttft_s": 0.25,
        "tokens": 7,
        "lengths": [0, 1, 2],
        "bad": None,
    }
    assert "ttft_s = 0.25" in capsys.readouterr().out
    assert clean_record.save() is None and (tmp_path / "metrics.json").is_file()
    assert "Key results" in capsys.readouterr().out


def test_record_without_output_dir_writes_nothing(clean_record, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    clean_record.record("x", 1, show=False)
    assert clean_record.save() is None and list(tmp_path.iterdir()) == []
    monkeypatch.setenv(record.OUTPUT_DIR_ENV, str(tmp_path / "env"))
    clean_record.record("y", 2, show=False)
    assert json.loads((tmp_path / "env" / "metrics.json").read_text()) == {"x": 1, "y": 2}


def test_record_rejects_non_json(clean_record) -> None:
    with pytest.raises(TypeError, match="record: when: set"):
        clean_record.record("when", {1, 2})
    with pytest.raises(TypeError, match="missing the value"):
        clean_record.record("x")
    with pytest.raises(TypeError, match="key 1 is not a string"):
        clean_record.record("d", {1: 2})
