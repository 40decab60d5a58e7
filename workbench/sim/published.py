"""Published GPU measurements (``data/validation/published_gpu.yaml``) and what the roofline cost model predicts
for each: the calibration's evidence and its held-out error.

A row is one batch-1 figure from a cited source: ``ttft_s`` (the prefill of ``prompt_len`` tokens up to the first
token), ``decode_s`` (one decode step at ``context_len``) or ``e2e_s`` (the prefill of ``prompt_len`` and
``output_len - 1`` decode steps after it: a whole request). ``predict`` prices a row with ``RooflineModel`` on the
row's hardware, formats and tensor-parallel size: every step is the roofline's wall time of the group (each kernel
its compute or streaming time plus a fixed latency), with the host time of the stack that launched it (a batch-1
request waits for the host between its steps), on the hardware as the row's source ran it (``Stack``: its serving
stack's host time per kernel launched, per request and per collective, and its setup's bandwidth and CUDA graphs
where the source states them). ``error_table`` compares them; ``fit`` chooses each accelerator's calibration (one
kernel latency and one GEMM efficiency shared by all; the memory efficiency fixed, see ``FIT_GRID``) and each
source's stack overheads from the calibration rows by a coarse grid search (coordinate descent on the mean absolute
relative error plus a quarter of the worst: ``fit_loss``), for ``workbench bench gpu-costs``;
``leave_one_source_out`` prices each source with a fit on the others alone. The collectives' own latencies are not
fitted: they are NCCL's tuning model, in ``accelerators.yaml``.
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


@dataclass(frozen=True)
class Stack:
    """What one source's serving stack and setup add to the hardware, all of it properties of the software or the
    machine that measured its rows, not of the GPU model: ``per_kernel_s`` host time per kernel of a step that the
    GPU waits for (a runtime without CUDA graphs launches each kernel from the host and synchronises each step: its
    host time grows with the kernels a step runs, ``RooflineModel.num_kernels``, so a 70B model's 80 layers cost
    2.5 times a 7B's 32), ``per_request_s`` a fixed cost
    once per whole request (server, tokeniser; whole-request rows only), ``per_collective_s`` what the stack adds
    to each tensor-parallel collective above the interconnect's own latency (a collective called through a plugin
    and launched from the host, against one captured in a CUDA graph), and ``mem_bandwidth`` the published setup's
    peak memory bandwidth (bytes/s) where it is not the datasheet's (a power-limited part; None: the datasheet).

    ``cuda_graphs``: the source states that its stack replays each step as a captured CUDA graph (gpt-fast's
    ``torch.compile(mode="reduce-overhead")``). The host then launches one graph per step instead of each kernel
    and each collective, so the stack adds no host time per step or per collective (NVIDIA, "Getting Started with
    CUDA Graphs", 2019: a graph launch submits the whole sequence of kernels at once; PyTorch, "Accelerating PyTorch
    with CUDA Graphs", 2021). Those overheads are then 0 and not fitted, as a stated bandwidth is not.

    ``per_kernel_by_hardware``: (accelerator, seconds) pairs where the host time per kernel differs by the system
    the source ran each accelerator in (a DGX A100's host CPU is not a DGX H100's: the host time is the host's, not
    the GPU's); ``kernel_s(hardware)`` reads it, ``per_kernel_s`` elsewhere."""

    per_kernel_s: float = 0.0
    per_request_s: float = 0.0
    per_collective_s: float = 0.0
    mem_bandwidth: float | None = None
    cuda_graphs: bool = False
    per_kernel_by_hardware: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        host = self.per_kernel_s or self.per_collective_s or any(v for _, v in self.per_kernel_by_hardware)
        if self.cuda_graphs and host:
            raise ConfigError("a stack that replays CUDA graphs launches no kernel from the host: its per-kernel and "
                              "per-collective overheads must be 0")  # fmt: skip

    def kernel_s(self, hardware: str) -> float:
        """The host time per kernel launched on the system that holds ``hardware``."""
        return dict(self.per_kernel_by_hardware).get(hardware, self.per_kernel_s)

    def apply(self, spec: HardwareSpec) -> HardwareSpec:
        """``spec`` as this setup runs it: its bandwidth, and its collectives' added latency."""
        from dataclasses import replace

        if self.mem_bandwidth is not None:
            spec = replace(spec, mem_bandwidth=self.mem_bandwidth)
        if self.per_collective_s and spec.interconnect is not None:
            ic = spec.interconnect
            spec = replace(spec, interconnect=replace(ic, base_latency_s=ic.base_latency_s + self.per_collective_s))
        return spec


def load_stack_overheads(path: str | Path = PUBLISHED_FILE) -> dict[str, Stack]:
    """Per source, its ``Stack`` (the table's ``sources``: ``host_us_per_kernel`` per kernel launched, one figure or
    one per accelerator, ``request_overhead_ms`` per request and ``collective_overhead_us`` per collective, fitted
    with the calibration, see ``fit``; ``mem_bandwidth_tbs`` and ``cuda_graphs`` where the source states them)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    out = {}
    for k, v in (data.get("sources") or {}).items():
        bw = v.get("mem_bandwidth_tbs")
        step = v.get("host_us_per_kernel", 0.0)
        by_hw = tuple(sorted((str(hw), float(us) * 1e-6) for hw, us in step.items())) if isinstance(step, dict) else ()
        per_kernel = _median([x for _, x in by_hw]) if by_hw else float(step) * 1e-6  # elsewhere: its typical host
        out[str(k)] = Stack(per_kernel_s=per_kernel, per_kernel_by_hardware=by_hw,
                            per_request_s=float(v.get("request_overhead_ms", 0.0)) * 1e-3,
                            per_collective_s=float(v.get("collective_overhead_us", 0.0)) * 1e-6,
                            mem_bandwidth=None if bw is None else float(bw) * 1e12,
                            cuda_graphs=bool(v.get("cuda_graphs", False)))  # fmt: skip
    return out


def informed_fields(rows: list[PublishedRow], stack: Stack) -> tuple[str, ...]:
    """The stack overheads (``STACK_FIELDS``) that a source's ``rows`` can determine: the host time per kernel and per
    collective unless its stack replays CUDA graphs (then both are 0), the latter only with rows at TP > 1, and the
    cost per request only with whole-request rows."""
    out = []
    if not stack.cuda_graphs:
        out.append("per_kernel_s")
    if any(r.metric == "e2e_s" for r in rows):
        out.append("per_request_s")
    if not stack.cuda_graphs and any(r.tp > 1 for r in rows):
        out.append("per_collective_s")
    return tuple(out)


def _values(stack: Stack, name: str) -> list[float]:
    """A stack's figures of one overhead: its host time per kernel on each system it ran, when it has several."""
    if name == "per_kernel_s" and stack.per_kernel_by_hardware:
        return [v for _, v in stack.per_kernel_by_hardware]
    return [getattr(stack, name)]


def typical_stack(stacks: dict[str, Stack], informed: dict[str, tuple[str, ...]], setup: Stack | None = None) -> Stack:
    """A serving stack no row has measured, priced as a typical one: each overhead the median of the ``stacks``
    whose rows determined it (``informed``, per source: ``informed_fields``), 0 where none did; ``setup``: what the
    new source states of itself (its bandwidth, CUDA graphs: then no per-kernel and per-collective overheads)."""
    from dataclasses import replace

    setup = setup or Stack()
    values = {}
    for name in STACK_FIELDS:
        if setup.cuda_graphs and name != "per_request_s":
            continue
        seen = [v for src in stacks if name in informed.get(src, ()) for v in _values(stacks[src], name)]
        values[name] = _median(seen) if seen else 0.0
    return replace(setup, per_kernel_by_hardware=(), **values)


def predict(row: PublishedRow, calibration: Calibration | str | None = "hardware", hw: Any = None) -> float:
    """Seconds the roofline cost model predicts for ``row`` (see the module docstring)."""
    model = _model(row, calibration, hw)
    if row.metric == "decode_s":
        return model.decode([max(1, row.context_len)], detailed=False).time_s
    ttft = model.prefill([row.prompt_len], detailed=False).time_s
    if row.metric == "ttft_s":
        return ttft
    return ttft + sum(model.decode([row.prompt_len + i], detailed=False).time_s for i in range(1, row.output_len))


def _model(row: PublishedRow, calibration: Calibration | str | None, hw: Any = None) -> RooflineModel:
    spec = get_hardware(hw if hw is not None else row.hardware)
    return RooflineModel(
        _cfg(row.model), spec, dtype=row.dtype, kv_dtype=row.kv_cache_dtype, quantization=row.quantization,
        group_size=row.group_size, tensor_parallel_size=row.tp, calibration=calibration,
    )  # fmt: skip


_CFGS: dict[str, Any] = {}
_KERNELS: dict[tuple[str, int], int] = {}


def _num_kernels(row: PublishedRow) -> int:
    """Kernels one GPU runs in a step of ``row``'s model at its TP (``RooflineModel.num_kernels``: the count does
    not depend on the formats or the calibration)."""
    key = (row.model, row.tp)
    if key not in _KERNELS:
        _KERNELS[key] = _model(row, None, row.hardware).num_kernels
    return _KERNELS[key]


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
    stack_overheads: dict[str, Stack] | None = None,
) -> list[dict[str, Any]]:
    """Per row: its figures and ``error`` = predicted / measured - 1 (negative: the model is optimistic).

    ``stack_overheads``: per source, its ``Stack``: the serving stack's host time per kernel, what it adds once to a
    whole request (whole-request rows only) and to each collective, and the setup's bandwidth, on top of the
    hardware calibration: properties of the software and the machine that measured the row, not of the GPU
    (``fit`` chooses the overheads on the calibration rows)."""
    out = []
    for row in rows:
        stack = (stack_overheads or {}).get(row.source, Stack())
        spec = stack.apply((hw or {}).get(row.hardware) or get_hardware(row.hardware))
        host = num_steps(row) * _num_kernels(row) * stack.kernel_s(row.hardware)
        predicted = predict(row, calibration, spec) + host
        if row.metric == "e2e_s":
            predicted += stack.per_request_s
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


def fit_loss(table: list[dict[str, Any]]) -> float:
    """What ``fit`` minimises over a table's rows: the mean absolute relative error plus ``MAX_WEIGHT`` times the
    largest."""
    errs = [abs(r["error"]) for r in table]
    if not errs:
        raise ConfigError("no rows to fit on")
    return sum(errs) / len(errs) + MAX_WEIGHT * max(errs)


# the grid of ``fit``: one axis per calibration field. The interconnects' own latencies are not fitted: they are
# NCCL's published tuning model (accelerators.yaml cites it); what a stack adds to each collective is (``Stack``).
# Held to physical ranges, since a free parameter that the rows cannot pin takes up what another source's stack
# does (leave_one_source_out showed it): memory_efficiency is fixed at 0.9, the share of the datasheet bandwidth a
# streaming kernel sustains on HBM parts (fitted, it fell to 0.7 on A100 to absorb the NeMo A100 rows' host time,
# and priced every other A100 source 20-40% slow); a kernel's fixed latency is 1 to 3 us (launch and tail; the
# gpt-fast TP 1-8 rows alone give 2-2.5 us); linear_half_tokens at most 64 rows, one tensor-core tile (beyond, a
# batch-1 product would be priced as compute-bound, which a GEMV is not) and at least 16, the rows of one
# tensor-core instruction tile (mma m16n8k16: a product of fewer rows pays for the tile's; 0 would price a 1-row
# product at the full peak). linear_max is one figure for every accelerator, like the kernel latency: the share of
# its dense peak a GEMM library's kernels sustain (cuBLAS/CUTLASS tiles), which only bf16/fp16 prefills pin, and the
# table has those on A100 alone: per accelerator, the H100's drifted to whatever the fit's path left it at (0.5 to
# 0.9 moved the loss by 2%) and an A100 curve fitted without one source's prefills rose to the datasheet peak.
FIT_GRID: dict[str, tuple[float, ...]] = {
    "memory_efficiency": (0.9,),
    "linear_max": (0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    "linear_half_tokens": (16.0, 32.0, 64.0),
    "fp8_max": (0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7),
    "kernel_latency_s": (1e-6, 1.5e-6, 2e-6, 2.5e-6, 3e-6),
    "int8_weight_efficiency": (0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    "int4_weight_efficiency": (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
}
HOST_PER_KERNEL_GRID = (0.0, 0.5e-6, 1e-6, 1.5e-6, 2e-6, 2.5e-6, 3e-6, 4e-6, 5e-6, 6e-6, 7e-6, 8e-6, 10e-6)
# the fit's loss: mean absolute error + this x the largest. Not the median: it is blind to every row above it, so a
# source's rows could sit at -25% at no cost while a parameter they alone determine (a stack's host time, an
# accelerator's prefill curve) took any value, and the source left out next inherited it
MAX_WEIGHT = 0.25
REQUEST_OVERHEAD_GRID = (0.0, 5e-3, 10e-3, 20e-3, 30e-3, 40e-3, 50e-3, 60e-3, 80e-3)
COLLECTIVE_OVERHEAD_GRID = (0.0, 2e-6, 4e-6, 6e-6, 8e-6, 10e-6, 12e-6, 16e-6, 20e-6, 24e-6, 32e-6)
CALIBRATION_FIELDS = ("memory_efficiency", "linear_max", "linear_half_tokens", "fp8_max", "kernel_latency_s",
                      "int8_weight_efficiency", "int4_weight_efficiency")  # fmt: skip
STACK_FIELDS = ("per_kernel_s", "per_request_s", "per_collective_s")
SHARED_FIELDS = ("kernel_latency_s", "linear_max")


def _spec(base: HardwareSpec, point: dict[str, float]) -> HardwareSpec:
    from dataclasses import replace

    values = {k: point[k] for k in CALIBRATION_FIELDS}
    cal = Calibration(**values, attention_max=point["linear_max"], attention_half_tokens=point["linear_half_tokens"],
                      source="fitted by workbench.sim.published.fit")  # fmt: skip
    return replace(base, calibration=cal)


def fit(
    rows: list[PublishedRow], rounds: int = 3, setups: dict[str, Stack] | None = None
) -> tuple[dict[str, HardwareSpec], dict[str, Stack], float]:
    """Every accelerator's calibration and every source's stack overheads (per kernel, per request, per
    collective; the host time per kernel once per accelerator the source ran), chosen together on the calibration
    rows: coordinate descent over ``FIT_GRID`` and the stack grids, minimising ``fit_loss`` (the mean absolute
    relative error plus ``MAX_WEIGHT`` times the largest). Attention shares the linear layers' curve; the hardware's own
    ``step_overhead_s`` is left at 0 (the stacks carry it). ``setups``: each source's published setup kept as given
    (its ``mem_bandwidth`` and ``cuda_graphs``; default: the table's). Returns (specs by accelerator, stacks by
    source, loss)."""
    from dataclasses import replace

    mine = [r for r in rows if r.split == "calibration"]
    if not mine:
        raise ConfigError("no calibration rows")
    setups = load_stack_overheads() if setups is None else setups
    hws = sorted({r.hardware for r in mine})
    bases = {hw: get_hardware(hw) for hw in hws}
    start = {"memory_efficiency": 0.9, "linear_max": 0.7, "linear_half_tokens": 32.0, "fp8_max": 0.5,
             "kernel_latency_s": 2e-6, "int8_weight_efficiency": 1.0, "int4_weight_efficiency": 1.0}  # fmt: skip
    points = {hw: dict(start) for hw in hws}
    stacks = {src: Stack(mem_bandwidth=setups.get(src, Stack()).mem_bandwidth)
              for src in sorted({r.source for r in mine})}  # fmt: skip
    stacks = {src: replace(stack, cuda_graphs=setups.get(src, Stack()).cuda_graphs) for src, stack in stacks.items()}
    full = {"per_kernel_s": HOST_PER_KERNEL_GRID, "per_request_s": REQUEST_OVERHEAD_GRID,
            "per_collective_s": COLLECTIVE_OVERHEAD_GRID}  # fmt: skip
    hardware_of = {src: sorted({r.hardware for r in mine if r.source == src}) for src in stacks}
    grids = {}
    for src in stacks:
        informed = informed_fields([r for r in mine if r.source == src], stacks[src])
        grids[src] = {name: full[name] if name in informed else (0.0,) for name in STACK_FIELDS}

    def loss(points: dict[str, dict[str, float]], stacks: dict[str, Stack]) -> float:
        specs = {hw: _spec(bases[hw], points[hw]) for hw in hws}
        return fit_loss(error_table(mine, "hardware", specs, stacks))

    best = loss(points, stacks)
    # a kernel's least time (launch and tail) is the CUDA runtime's and the GPU front end's, one figure for every
    # accelerator: per accelerator, it and a per-step overhead are the same thing at batch 1 and cannot be told apart
    axes = [((hw,), name) for hw, name in itertools.product(hws, FIT_GRID) if name not in SHARED_FIELDS]
    axes += [(tuple(hws), name) for name in SHARED_FIELDS]
    for _round in range(rounds):
        for group, name in axes:
            for value in FIT_GRID[name]:
                trial = {**points, **{hw: {**points[hw], name: value} for hw in group}}
                trial_loss = loss(trial, stacks)
                if trial_loss < best - 1e-12:
                    best, points = trial_loss, trial
        for src, name in itertools.product(list(stacks), STACK_FIELDS):
            for target in hardware_of[src] if name == "per_kernel_s" else [None]:
                for value in grids[src][name]:
                    if target is None:
                        changed = replace(stacks[src], **{name: value})
                    else:  # the host time per kernel of this source's system holding ``target``
                        by_hw = {**dict(stacks[src].per_kernel_by_hardware), target: value}
                        changed = replace(stacks[src], per_kernel_by_hardware=tuple(sorted(by_hw.items())))
                    trial_stacks = {**stacks, src: changed}
                    trial_loss = loss(points, trial_stacks)
                    if trial_loss < best - 1e-12:
                        best, stacks = trial_loss, trial_stacks
    # on an accelerator a source's rows never ran, its host is priced as its typical one: the median of its systems'
    stacks = {src: replace(st, per_kernel_s=_median([v for _, v in st.per_kernel_by_hardware]))
              if st.per_kernel_by_hardware else st for src, st in stacks.items()}  # fmt: skip
    return {hw: _spec(bases[hw], points[hw]) for hw in hws}, stacks, best


def leave_one_source_out(
    rows: list[PublishedRow], rounds: int = 2, setups: dict[str, Stack] | None = None
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Each source's rows priced by a calibration fitted on every *other* source's rows (both splits), so each
    error is an error on a source the fit never saw: the generalisation error of the cost model, not its fit.

    The left-out source keeps what its own publication states of its setup (``setups``: its bandwidth, whether its
    stack replays CUDA graphs) and gets, as its stack's host overheads, ``typical_stack``: each the median of the
    fitted sources whose rows determined it (a new serving stack is priced as a typical one: its overheads are
    unknown before it is measured). An accelerator the other sources never ran keeps
    ``accelerators.yaml``'s calibration. Returns (the error table of every row, each with ``left_out`` = its
    source, and ``summarize_errors`` of it)."""
    from dataclasses import replace

    setups = load_stack_overheads() if setups is None else setups
    sources = sorted({r.source for r in rows})
    if len(sources) < 2:
        raise ConfigError(f"leave-one-source-out needs rows from two sources or more, got {sources}")
    table: list[dict[str, Any]] = []
    for left in sources:
        seen = [replace(r, split="calibration") for r in rows if r.source != left]
        specs, stacks, _ = fit(seen, rounds=rounds, setups=setups)
        informed = {src: informed_fields([r for r in seen if r.source == src], stacks[src]) for src in stacks}
        stack = typical_stack(stacks, informed, setups.get(left, Stack()))
        mine = [r for r in rows if r.source == left]
        for entry in error_table(mine, "hardware", specs, {left: stack}):
            table.append({**entry, "left_out": left})
    return table, summarize_errors(table)


def _median(values: list[float]) -> float:
    xs = sorted(values)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


__all__ = [
    "PUBLISHED_FILE",
    "PublishedRow",
    "Stack",
    "error_table",
    "fit",
    "fit_loss",
    "informed_fields",
    "leave_one_source_out",
    "load_published",
    "predict",
    "summarize_errors",
    "typical_stack",
]


def validation_report(ideal: bool = False, fit_now: bool = False, path: str | Path = PUBLISHED_FILE) -> dict[str, Any]:
    """The cost model against the published rows (``workbench bench gpu-costs``): ``rows`` (``error_table``),
    ``summary`` per split (``summarize_errors``), the serving ``stacks`` used, ``fitted`` (with ``fit_now``: each
    accelerator's calibration chosen now on the calibration rows, and the fit's ``loss``) and ``calibration`` (what
    priced the rows: ideal, fitted now, or each accelerator's source in accelerators.yaml). ``ideal``: the bare
    roofline, each source's published setup (its bandwidth) kept."""
    import dataclasses

    rows = load_published(path)
    stacks = load_stack_overheads(path)
    if ideal:
        stacks = {k: dataclasses.replace(v, per_kernel_s=0.0, per_request_s=0.0, per_collective_s=0.0,
                                         per_kernel_by_hardware=())
                  for k, v in stacks.items()}  # fmt: skip
    specs, fitted = None, {}
    if fit_now:
        specs, stacks, loss = fit(rows)
        fitted = {hw: {"calibration": {k: v for k, v in spec.calibration.to_dict().items() if k != "source"}}
                  for hw, spec in specs.items()}  # fmt: skip
        fitted["loss"] = loss
    table = error_table(rows, None if ideal else "hardware", specs, stacks)
    summary = {
        split: summarize_errors([r for r in table if r["split"] == split]) for split in ("calibration", "held_out")
    }
    sources = {hw: get_hardware(hw).calibration.source for hw in sorted({r.hardware for r in rows})}
    return {"rows": table, "summary": summary, "stacks": {k: dataclasses.asdict(v) for k, v in stacks.items()},
            "fitted": fitted, "calibration": "ideal" if ideal else "fitted now" if fit_now else sources}  # fmt: skip
