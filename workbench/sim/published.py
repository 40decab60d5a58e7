"""Published GPU measurements (``data/validation/published_gpu.yaml``) and what the roofline cost model predicts
for each: the calibration's evidence and its held-out error.

A row is one batch-1 figure from a cited source: ``ttft_s`` (the prefill of ``prompt_len`` tokens up to the first
token), ``decode_s`` (one decode step at ``context_len``) or ``e2e_s`` (the prefill of ``prompt_len`` and
``output_len - 1`` decode steps after it: a whole request). ``predict`` prices a row with ``RooflineModel`` on the
row's hardware, formats and tensor-parallel size: every step is the roofline's wall time of the group, its step
overhead included (a batch-1 request waits for the host between its steps). ``error_table`` compares them;
``fit`` chooses each accelerator's calibration and each source's serving-stack overhead per step from the
calibration rows by a coarse grid search (coordinate descent on the median absolute relative error plus a tenth of
the worst), for ``scripts/validate_gpu_costs.py``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.config import DATA_DIR, DEFAULT_GROUP_SIZE
from workbench.errors import ConfigError
from workbench.hardware import Calibration, HardwareSpec, get_hardware
from workbench.roofline import RooflineModel

PUBLISHED_FILE = DATA_DIR / "validation" / "published_gpu.yaml"
METRICS = ("ttft_s", "decode_s", "e2e_s")
SPLITS = ("calibration", "held_out")
UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


@dataclass(frozen=True)
class PublishedRow:
    """One published batch-1 measurement; ``measured_s`` in seconds (a tok/s figure is its inverse)."""

    id: str
    source: str
    model: str
    hardware: str
    metric: str
    measured_s: float
    split: str
    tp: int = 1
    dtype: str = "bf16"
    quantization: str | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    kv_cache_dtype: str = "auto"
    prompt_len: int = 0
    context_len: int = 0
    output_len: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> PublishedRow:
        where = f"published row {row.get('id', '?')!r}"
        try:
            value, unit = float(row["value"]), str(row["unit"])
            if unit == "tok/s":
                measured = 1.0 / value
            elif unit in UNITS:
                measured = value * UNITS[unit]
            else:
                raise ConfigError(f"{where}: unit must be tok/s, {', '.join(UNITS)}; got {unit!r}")
            out = cls(id=str(row["id"]), source=str(row["source"]), model=str(row["model"]),
                      hardware=str(row["hardware"]), metric=str(row["metric"]), measured_s=measured,
                      split=str(row["split"]), tp=int(row.get("tp", 1)), dtype=str(row.get("dtype", "bf16")),
                      quantization=row.get("quantization"), group_size=int(row.get("group_size", DEFAULT_GROUP_SIZE)),
                      kv_cache_dtype=str(row.get("kv_cache_dtype", "auto")), prompt_len=int(row.get("prompt_len", 0)),
                      context_len=int(row.get("context_len", 0)), output_len=int(row.get("output_len", 0)))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{where}: missing or malformed field ({type(exc).__name__}: {exc})") from None
        if out.metric not in METRICS or out.split not in SPLITS:
            raise ConfigError(f"{where}: metric must be one of {METRICS} and split one of {SPLITS}")
        return out


def load_published(path: str | Path = PUBLISHED_FILE) -> list[PublishedRow]:
    """The rows of the published-measurements table."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the published measurements ({exc})") from None
    rows = [PublishedRow.from_dict(r) for r in (data or {}).get("rows", [])]
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: row ids must be unique")
    return rows


def load_stack_overheads(path: str | Path = PUBLISHED_FILE) -> dict[str, tuple[float, float]]:
    """Per source, its serving stack's (host overhead per step, fixed cost per request) in seconds
    (``stack_overhead_us`` and ``request_overhead_ms`` of the table's ``sources``; fitted with the calibration,
    see ``fit``)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    return {str(k): (float(v.get("stack_overhead_us", 0.0)) * 1e-6, float(v.get("request_overhead_ms", 0.0)) * 1e-3)
            for k, v in (data.get("sources") or {}).items()}  # fmt: skip


def predict(row: PublishedRow, calibration: Calibration | str | None = "hardware", hw: Any = None) -> float:
    """Seconds the roofline cost model predicts for ``row`` (see the module docstring)."""
    spec = get_hardware(hw if hw is not None else row.hardware)
    model = RooflineModel(
        _cfg(row.model), spec, dtype=row.dtype, kv_dtype=row.kv_cache_dtype, quantization=row.quantization,
        group_size=row.group_size, tensor_parallel_size=row.tp, calibration=calibration,
    )  # fmt: skip
    if row.metric == "decode_s":
        return model.decode([max(1, row.context_len)], detailed=False).time_s
    ttft = model.prefill([row.prompt_len], detailed=False).time_s
    if row.metric == "ttft_s":
        return ttft
    return ttft + sum(model.decode([row.prompt_len + i], detailed=False).time_s for i in range(1, row.output_len))


_CFGS: dict[str, Any] = {}


def _cfg(name: str) -> Any:
    from workbench.config import ModelConfig

    if name not in _CFGS:
        _CFGS[name] = ModelConfig.resolve(name)
    return _CFGS[name]


def num_steps(row: PublishedRow) -> int:
    """Scheduler steps a row's figure spans: one for a first token or a decode step, ``output_len`` for a request
    (its prefill and ``output_len - 1`` decodes)."""
    return max(1, row.output_len) if row.metric == "e2e_s" else 1


def error_table(
    rows: list[PublishedRow],
    calibration: Calibration | str | None = "hardware",
    hw: dict[str, HardwareSpec] | None = None,
    stack_overheads: dict[str, tuple[float, float]] | None = None,
) -> list[dict[str, Any]]:
    """Per row: its figures and ``error`` = predicted / measured - 1 (negative: the model is optimistic).

    ``stack_overheads``: per source, (host seconds per step, seconds per request) of that source's serving stack:
    its scheduler and runtime between steps, and what it adds once to a whole request (server, tokeniser, client;
    whole-request rows only), on top of the hardware calibration: properties of the software that measured the row,
    not of the GPU (``fit`` chooses them on the calibration rows)."""
    out = []
    for row in rows:
        spec = (hw or {}).get(row.hardware)
        per_step, per_request = (stack_overheads or {}).get(row.source, (0.0, 0.0))
        predicted = predict(row, calibration, spec) + num_steps(row) * per_step
        if row.metric == "e2e_s":
            predicted += per_request
        out.append({"id": row.id, "source": row.source, "split": row.split, "metric": row.metric,
                    "model": row.model, "hardware": row.hardware, "tp": row.tp,
                    "format": row.quantization or row.dtype, "measured_s": row.measured_s,
                    "predicted_s": predicted, "error": predicted / row.measured_s - 1.0})  # fmt: skip
    return out


def summarize_errors(table: list[dict[str, Any]]) -> dict[str, float]:
    """Median and largest absolute relative error of a table's rows (NaN when empty)."""
    errs = sorted(abs(r["error"]) for r in table)
    if not errs:
        return {"n": 0, "median_abs_error": math.nan, "max_abs_error": math.nan}
    mid = len(errs) // 2
    median = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
    return {"n": len(errs), "median_abs_error": median, "max_abs_error": errs[-1]}


# the grid of ``fit``: one axis per calibration field and the interconnect's per-collective latency
FIT_GRID: dict[str, tuple[float, ...]] = {
    "memory_efficiency": (0.7, 0.75, 0.8, 0.85, 0.9, 0.95),
    "linear_max": (0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    "linear_half_tokens": (0.0, 16.0, 32.0, 64.0, 128.0, 256.0),
    "fp8_max": (0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7),
    "kernel_floor_s": (0.0, 1e-6, 2e-6, 3e-6, 4e-6, 5e-6, 6e-6, 8e-6),
    "int8_weight_efficiency": (0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    "int4_weight_efficiency": (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    "base_latency_s": (2e-6, 4e-6, 6e-6, 8e-6, 12e-6, 16e-6, 24e-6),
}
STACK_OVERHEAD_GRID = (0.0, 1e-4, 2e-4, 4e-4, 8e-4, 1.2e-3, 1.6e-3, 2.4e-3, 3.2e-3, 4.8e-3)
MAX_WEIGHT = 0.25  # the fit's loss: median absolute error + this x the largest
REQUEST_OVERHEAD_GRID = (0.0, 5e-3, 10e-3, 20e-3, 30e-3, 40e-3, 50e-3, 60e-3, 80e-3)
CALIBRATION_FIELDS = ("memory_efficiency", "linear_max", "linear_half_tokens", "fp8_max", "kernel_floor_s",
                      "int8_weight_efficiency", "int4_weight_efficiency")  # fmt: skip


def _spec(base: HardwareSpec, point: dict[str, float]) -> HardwareSpec:
    from dataclasses import replace

    values = {k: point[k] for k in CALIBRATION_FIELDS}
    cal = Calibration(**values, attention_max=point["linear_max"], attention_half_tokens=point["linear_half_tokens"],
                      source="fitted by workbench.sim.published.fit")  # fmt: skip
    if base.interconnect is None:
        return replace(base, calibration=cal)
    return replace(
        base, calibration=cal, interconnect=replace(base.interconnect, base_latency_s=point["base_latency_s"])
    )


def fit(
    rows: list[PublishedRow], rounds: int = 3
) -> tuple[dict[str, HardwareSpec], dict[str, tuple[float, float]], float]:
    """Every accelerator's calibration (and its interconnect's per-collective latency) and every source's stack
    overhead per step, chosen together on the calibration rows: coordinate descent over ``FIT_GRID`` and
    ``STACK_OVERHEAD_GRID``, minimising the median absolute relative error plus ``MAX_WEIGHT`` times the largest.
    Attention shares the linear layers' curve; the hardware's own ``step_overhead_s`` is left at 0 (the stacks
    carry it).
    Returns (specs by accelerator, stack overheads by source, loss)."""
    mine = [r for r in rows if r.split == "calibration"]
    if not mine:
        raise ConfigError("no calibration rows")
    hws = sorted({r.hardware for r in mine})
    bases = {hw: get_hardware(hw) for hw in hws}
    start = {"memory_efficiency": 0.8, "linear_max": 0.7, "linear_half_tokens": 32.0, "fp8_max": 0.5,
             "kernel_floor_s": 2e-6, "int8_weight_efficiency": 1.0, "int4_weight_efficiency": 1.0,
             "base_latency_s": 8e-6}  # fmt: skip
    points = {hw: dict(start) for hw in hws}
    # what a few rows per accelerator can tell apart: the compute curve per accelerator; memory, kernel floor,
    # quantized streaming and collective latency shared by all (the decode rows that pin them are the A100's)
    shared = ("base_latency_s",)
    stacks = {src: (0.0, 0.0) for src in sorted({r.source for r in mine})}
    whole = {r.source for r in mine if r.metric == "e2e_s"}

    def loss(points: dict[str, dict[str, float]], stacks: dict[str, tuple[float, float]]) -> float:
        specs = {hw: _spec(bases[hw], points[hw]) for hw in hws}
        s = summarize_errors(error_table(mine, "hardware", specs, stacks))
        return s["median_abs_error"] + MAX_WEIGHT * s["max_abs_error"]

    best = loss(points, stacks)
    for _round in range(rounds):
        axes = [((hw,), name) for hw, name in itertools.product(hws, FIT_GRID) if name not in shared]
        axes += [(tuple(hws), name) for name in shared]
        for group, name in axes:
            for value in FIT_GRID[name]:
                trial = {**points, **{hw: {**points[hw], name: value} for hw in group}}
                trial_loss = loss(trial, stacks)
                if trial_loss < best - 1e-12:
                    best, points = trial_loss, trial
        for src in list(stacks):
            for which, grid in enumerate((STACK_OVERHEAD_GRID, REQUEST_OVERHEAD_GRID if src in whole else (0.0,))):
                for value in grid:
                    pair = list(stacks[src])
                    pair[which] = value
                    trial_stacks = {**stacks, src: (pair[0], pair[1])}
                    trial_loss = loss(points, trial_stacks)
                    if trial_loss < best - 1e-12:
                        best, stacks = trial_loss, trial_stacks
    return {hw: _spec(bases[hw], points[hw]) for hw in hws}, stacks, best


__all__ = [
    "PUBLISHED_FILE",
    "PublishedRow",
    "error_table",
    "fit",
    "load_published",
    "predict",
    "summarize_errors",
]
