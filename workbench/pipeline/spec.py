"""The pipeline spec: which notebooks make up a report, with which parameters on which profile.

The spec is a YAML file (``notebooks/pipeline.yaml``)::

    kernel: workbench          # optional; Jupyter kernel name (python3 is used if 'workbench' is not installed)
    timeout_s: 1800            # optional; per-cell execution limit in seconds (none by default)
    experiments:
      - name: prefill_vs_decode            # letters, digits, '_' and '-'; unique; names the output folder
        notebook: 01_prefill_vs_decode.ipynb   # relative to the spec file
        description: TTFT and ITL, on a roofline   # optional, shown in the run index
        requires: [cuda]                   # optional; see REQUIREMENTS
        params:                            # optional; per profile, JSON values only
          smoke: {num_prompts: 2}
          cpu: {num_prompts: 16}
          gpu: {num_prompts: 256}

A profile missing from ``params`` runs the notebook with its own defaults. Every parameter name is checked
against the notebook's ``parameters`` cell when the pipeline plans a run (see ``workbench.pipeline.params``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError

PROFILES: tuple[str, ...] = ("smoke", "cpu", "gpu")
# requirement -> what it means; probed by workbench.pipeline.runner.probe_requirements
REQUIREMENTS: dict[str, str] = {
    "cuda": "a CUDA device visible to torch",
    "triton": "the triton package importable",
}
DEFAULT_KERNEL = "workbench"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_SPEC_KEYS = {"kernel", "timeout_s", "experiments"}
_EXPERIMENT_KEYS = {"name", "notebook", "description", "requires", "params"}


@dataclass(frozen=True)
class Experiment:
    """One notebook of the pipeline: its name, file, per-profile parameters and requirements."""

    name: str
    notebook: Path
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    description: str = ""

    def params_for(self, profile: str) -> dict[str, Any]:
        """The spec's parameters for ``profile`` (a copy; empty when the spec gives none)."""
        return dict(self.params.get(profile, {}))


@dataclass(frozen=True)
class PipelineSpec:
    """A parsed, validated pipeline spec."""

    path: Path
    experiments: tuple[Experiment, ...]
    kernel: str = DEFAULT_KERNEL
    timeout_s: float | None = None

    def names(self) -> list[str]:
        """The experiment names, in spec order."""
        return [e.name for e in self.experiments]

    def select(self, only: Sequence[str] | None = None) -> list[Experiment]:
        """The experiments named in ``only`` (spec order), or all of them when ``only`` is empty or None."""
        if not only:
            return list(self.experiments)
        unknown = [n for n in only if n not in self.names()]
        if unknown:
            raise ConfigError(
                f"--only: no experiment named {', '.join(map(repr, unknown))} in {self.path}; "
                f"experiments: {', '.join(self.names()) or '(none)'}"
            )
        wanted = set(only)
        return [e for e in self.experiments if e.name in wanted]


def _where(path: Path, index: int | None = None, name: str | None = None) -> str:
    if index is None:
        return str(path)
    label = f"experiments[{index}]" + (f" ({name!r})" if name else "")
    return f"{path}: {label}"


def _check_json_value(value: Any, where: str) -> None:
    """Parameters travel as JSON; reject YAML values JSON cannot hold (dates, sets, non-string keys)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, float) and value != value:
            raise ConfigError(f"{where}: NaN is not a JSON value")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}: key {key!r} is not a string (parameters must be JSON)")
            _check_json_value(item, f"{where}.{key}")
        return
    raise ConfigError(f"{where}: {value!r} ({type(value).__name__}) is not a JSON value")


def _parse_experiment(raw: Any, index: int, spec_path: Path) -> Experiment:
    where = _where(spec_path, index)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: an experiment must be a mapping with 'name' and 'notebook'")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"{where}: 'name' must be a string of letters, digits, '_' and '-' (it names a folder), got {name!r}"
        )
    where = _where(spec_path, index, name)
    unknown = sorted(set(raw) - _EXPERIMENT_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_EXPERIMENT_KEYS)}")
    notebook = raw.get("notebook")
    if not isinstance(notebook, str) or not notebook.endswith(".ipynb"):
        raise ConfigError(f"{where}: 'notebook' must be a path to an .ipynb file, got {notebook!r}")
    notebook_path = (spec_path.parent / notebook).resolve()
    if not notebook_path.is_file():
        raise ConfigError(f"{where}: notebook {notebook_path} does not exist")

    requires = raw.get("requires") or []
    if isinstance(requires, str):
        requires = [requires]
    if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
        raise ConfigError(f"{where}: 'requires' must be a list of names, got {requires!r}")
    bad = [r for r in requires if r not in REQUIREMENTS]
    if bad:
        raise ConfigError(f"{where}: unknown requirement(s) {bad}; known: {sorted(REQUIREMENTS)}")

    params_raw = raw.get("params") or {}
    if not isinstance(params_raw, Mapping):
        raise ConfigError(f"{where}: 'params' must map a profile ({', '.join(PROFILES)}) to parameters")
    params: dict[str, dict[str, Any]] = {}
    for profile, values in params_raw.items():
        if profile not in PROFILES:
            raise ConfigError(f"{where}: params: unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")
        values = values or {}
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: params.{profile} must be a mapping of parameter names to values")
        _check_json_value(dict(values), f"{where}: params.{profile}")
        params[profile] = dict(values)

    description = raw.get("description") or ""
    if not isinstance(description, str):
        raise ConfigError(f"{where}: 'description' must be a string")
    return Experiment(name, notebook_path, params, tuple(requires), description.strip())


def parse_spec(data: Any, path: str | Path) -> PipelineSpec:
    """Validate the already-loaded YAML document ``data`` of the spec file ``path``."""
    spec_path = Path(path).resolve()
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{spec_path}: the spec must be a mapping with an 'experiments' list")
    unknown = sorted(set(data) - _SPEC_KEYS)
    if unknown:
        raise ConfigError(f"{spec_path}: unknown key(s) {unknown}; allowed: {sorted(_SPEC_KEYS)}")
    kernel = data.get("kernel") or DEFAULT_KERNEL
    if not isinstance(kernel, str):
        raise ConfigError(f"{spec_path}: 'kernel' must be a kernel name, got {kernel!r}")
    timeout_s = data.get("timeout_s")
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0
    ):
        raise ConfigError(f"{spec_path}: 'timeout_s' must be a positive number of seconds, got {timeout_s!r}")
    raw_experiments = data.get("experiments") or []
    if not isinstance(raw_experiments, list):
        raise ConfigError(f"{spec_path}: 'experiments' must be a list")
    experiments = [_parse_experiment(raw, i, spec_path) for i, raw in enumerate(raw_experiments)]
    seen: set[str] = set()
    for e in experiments:
        if e.name in seen:
            raise ConfigError(f"{spec_path}: experiment name {e.name!r} appears twice; names must be unique")
        seen.add(e.name)
    return PipelineSpec(spec_path, tuple(experiments), kernel, None if timeout_s is None else float(timeout_s))


def load_spec(path: str | Path) -> PipelineSpec:
    """Read and validate a pipeline spec YAML file."""
    import yaml

    spec_path = Path(path)
    if not spec_path.is_file():
        raise ConfigError(f"pipeline spec {spec_path} does not exist")
    try:
        data = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{spec_path}: not valid YAML: {exc}") from exc
    return parse_spec(data, spec_path)


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; torch is imported here, lazily, and its absence means no."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def choose_profile(requested: str | None, has_cuda: Callable[[], bool] | None = None) -> str:
    """The profile to run: ``requested`` if given (validated), else ``gpu`` with CUDA and ``cpu`` without.

    ``has_cuda`` defaults to ``cuda_available`` (which imports torch only when it is called).
    """
    if requested is not None:
        if requested not in PROFILES:
            raise ConfigError(f"unknown profile {requested!r}; profiles: {', '.join(PROFILES)}")
        return requested
    probe = cuda_available if has_cuda is None else has_cuda
    return "gpu" if probe() else "cpu"
