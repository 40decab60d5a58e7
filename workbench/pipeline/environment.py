"""What a report ran on: Python, packages, torch/CUDA/Triton, devices, CPU, measured ceilings, git state.

Every probe is guarded: a missing package or a failing command is recorded as such (with the reason) rather
than stopping the report, because the environment file must exist for every run, including failed ones.
"""

from __future__ import annotations

import importlib
import inspect
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from workbench.record import to_json_value

# distributions whose versions every report records
PACKAGES: tuple[str, ...] = (
    "llm-workbench",
    "torch",
    "triton",
    "transformers",
    "safetensors",
    "numpy",
    "pandas",
    "matplotlib",
    "seaborn",
    "papermill",
    "nbconvert",
    "nbformat",
    "nbclient",
    "ipykernel",
    "jupyter_client",
    "pyyaml",
    "tqdm",
)
REPO_ROOT = Path(__file__).resolve().parents[2]


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution (None when it is not installed)."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _run(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit, short commit, branch and whether tracked files differ from it (``dirty``), of the checkout that
    holds ``repo`` (any folder inside it); ``toplevel`` is that checkout's root."""
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    if commit is None:
        return {"commit": None, "short_commit": None, "dirty": None, "reason": f"no git commit found at {repo}"}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    untracked = _run(["git", "ls-files", "--others", "--exclude-standard"], repo)
    return {
        "toplevel": _run(["git", "rev-parse", "--show-toplevel"], repo),
        "commit": commit,
        "short_commit": commit[:7],
        "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], repo),
        "dirty": None if status is None else bool(status),
        "modified_files": [] if not status else [line[2:].strip() for line in status.splitlines()],
        "untracked_files": 0 if not untracked else len(untracked.splitlines()),
    }


def cpu_model() -> str:
    """The CPU's model name (``workbench.hardware.cpu_model_name``: /proc/cpuinfo, else the platform module)."""
    try:
        from workbench.hardware import cpu_model_name
    except Exception:  # recorded, not fatal: the environment file must exist for every run
        return platform.processor() or platform.machine() or "unknown"
    return cpu_model_name()


def memory_total_bytes() -> int | None:
    """Total RAM in bytes (``workbench.hardware.physical_memory_bytes``), else None."""
    try:
        from workbench.hardware import physical_memory_bytes
    except Exception:
        return None
    return physical_memory_bytes()


def torch_info() -> dict[str, Any]:
    """torch, CUDA, cuDNN and Triton versions and the visible devices."""
    try:
        import torch
    except ImportError as exc:
        return {"available": False, "reason": f"torch is not importable: {exc}"}
    info: dict[str, Any] = {
        "available": True,
        "version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "hip_version": getattr(torch.version, "hip", None),
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": bool(torch.cuda.is_available()),
        "num_threads": torch.get_num_threads(),
        "devices": [],
    }
    try:
        import triton

        info["triton_version"] = triton.__version__
    except ImportError as exc:
        info["triton_version"] = None
        info["triton_reason"] = f"triton is not importable: {exc}"
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append(
                {
                    "index": index,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "total_memory_bytes": int(props.total_memory),
                    "multiprocessors": int(props.multi_processor_count),
                }
            )
        info["device_name"] = info["devices"][0]["name"] if info["devices"] else None
    else:
        info["device_name"] = f"CPU: {cpu_model()}"
    return info


def measured_ceilings() -> dict[str, Any]:
    """``workbench.hardware.measured_spec(refresh=True, cache_dir=None).to_dict()`` (measured now, in this
    process), with ``peak_flops`` and ``mem_bandwidth`` on top; or why it could not be had."""
    try:
        hardware = importlib.import_module("workbench.hardware")
    except Exception as exc:  # missing module, or one that fails to import: recorded, not fatal
        return {"available": False, "reason": f"workbench.hardware is not available: {type(exc).__name__}: {exc}"}
    if not hasattr(hardware, "measured_spec"):
        return {"available": False, "reason": "workbench.hardware has no measured_spec()"}
    try:
        measure = hardware.measured_spec
        # measure the device the notebooks run on (CUDA when there is one), now and in this process: never a
        # file cache written by another process at another time
        params = inspect.signature(measure).parameters
        kwargs: dict[str, Any] = {"device": "auto"} if "device" in params else {}
        if "refresh" in params:
            kwargs.update(refresh=True, cache_dir=None)
        spec = measure(**kwargs)
        values = spec.to_dict() if hasattr(spec, "to_dict") else dict(spec)
    except Exception as exc:  # a failed measurement must not stop the report; it is recorded
        return {"available": False, "reason": f"measured_spec() failed: {type(exc).__name__}: {exc}"}
    return {"available": True, **values}


def seeds_of(parameters: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per experiment, the parameters that are seeds (named ``seed`` or ``*_seed``)."""
    out: dict[str, dict[str, Any]] = {}
    for name, params in parameters.items():
        seeds = {k: v for k, v in params.items() if k == "seed" or k.endswith("_seed")}
        if seeds:
            out[name] = seeds
    return out


def capture_environment(
    *,
    profile: str,
    parameters: Mapping[str, Mapping[str, Any]],
    kernel: str,
    run_id: str,
    measure: bool = True,
    num_threads: int | None = None,
    source_dir: Path | None = None,
) -> dict[str, Any]:
    """The ``environment.json`` of a run, as it stands at the start (``finish_environment`` adds the end).

    ``parameters`` maps each experiment to the values it runs with (notebook defaults merged with the
    spec's and the command line's), so that the seeds and every knob of the run are on record. ``num_threads``
    is the torch thread count the notebooks run with (``workbench report --threads``); the ceilings are
    measured with it (``ceilings_start``), with the load average and CPU jiffies before the run. ``git`` is the
    state of the checkout holding ``source_dir`` (the notebooks' folder; default: the package's); when the
    installed package lives in another checkout, ``package_git`` records that one too.
    """
    from workbench.experiments.hygiene import cpu_times, load_average

    ceilings = measured_ceilings() if measure else {"available": False, "reason": "not measured (--no-ceilings)"}
    git = git_state(source_dir if source_dir is not None else REPO_ROOT)
    package_git = git_state(REPO_ROOT) if source_dir is not None else git
    environment = {
        "run_id": run_id,
        "captured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "profile": profile,
        "kernel": kernel,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "hostname": platform.node(),
        },
        "cpu": {"model": cpu_model(), "logical_cores": os.cpu_count(), "memory_total_bytes": memory_total_bytes()},
        "torch": torch_info(),
        "packages": package_versions(),
        "num_threads": num_threads,
        "measured_ceilings": ceilings,
        "ceilings_start": ceilings,
        "ceilings_end": None,
        "load_average_start": load_average(),
        "load_average_end": None,
        "cpu_times_start": cpu_times(),
        "cpu_steal_share": None,
        "git": git,
        **({"package_git": package_git} if package_git.get("toplevel") != git.get("toplevel") else {}),
        "parameters": {k: dict(v) for k, v in parameters.items()},
        "seeds": seeds_of(parameters),
        "env": {
            k: os.environ[k]
            for k in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")
            if k in os.environ
        },
    }
    return to_json_value(environment, "environment")  # plain JSON: NaN and infinities become null


def finish_environment(environment: dict[str, Any], *, measure: bool = True) -> dict[str, Any]:
    """``environment`` with the end of the run: ``ceilings_end`` (measured again now), ``load_average_end`` and
    ``cpu_steal_share`` (the hypervisor's share of CPU time over the run)."""
    from workbench.experiments.hygiene import cpu_times, load_average, steal_share

    out = dict(environment)
    out["ceilings_end"] = (
        measured_ceilings() if measure else {"available": False, "reason": "not measured (--no-ceilings)"}
    )
    out["load_average_end"] = load_average()
    out["cpu_steal_share"] = steal_share(environment.get("cpu_times_start"), cpu_times())
    out["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return to_json_value(out, "environment")
