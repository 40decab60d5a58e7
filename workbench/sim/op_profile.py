"""``OpProfileCostModel``: a step's time as the sum of the model's operations, each interpolated from a profile of
that operation measured on its own (``workbench profile-ops``), plus a per-step overhead fitted to the real engine.

This is the approach of Vidur (Agrawal et al., MLSys 2024): profile every operation of one layer against the number
of tokens it processes (and attention against prompt or context length) once per machine, and predict any batch by
summing the operations it runs. The profile file (``OP_PROFILE_FORMAT``, JSON) holds, per operation, the measured
medians (with min and max) at a grid of sizes:

- dense operations over a step's tokens ``T`` (prefill tokens + decodes): ``rmsnorm`` (twice a layer, once more
  for the final norm), ``qkv_proj``, ``rotary``, ``kv_write`` (a ragged step writes each layer's K/V),
  ``o_proj``, ``residual_add`` (twice a layer), ``gate_up_proj``, ``activation`` (SiLU(gate) * up),
  ``down_proj``; once a step: ``embedding`` and ``rotary_table`` (the cos/sin of the step's positions);
- over the rows that are sampled ``R`` (the step's sequences): ``lm_head`` and ``sample``; a pure decode's
  ``decode_kv_write`` (all layers' new K/V written at once after the step) over its batch;
- attention, per layer: ``attention_prefill`` over the prompt length ``L`` of one causal sequence, looked up by
  its (query, key) pairs ``L (L + 1) / 2``, a chunk counting ``attended_pairs``; a step's prefills are priced as
  ``prefill_seqs`` sequences of the mean pairs (exact while the time is linear in the pairs between two grid
  points); ``attention_decode`` over (batch, context) for a pure decode attended in one padded gather (the
  engine's rule, ``max_key_slots``), at the step's longest context, which is what the gather pads to;
  ``attention_decode_looped`` over context for a decode attended alone (in a step with prefills, or too long to
  gather), at the mean context.

Interpolation is piecewise linear between the measured sizes. Outside them, one rule for every operation: below
the smallest size the time is the smallest size's (a kernel never gets cheaper than its smallest call: the
per-kernel floor); above the largest it continues the last segment's slope, never falling (large operations are
compute- or bandwidth-bound, so linear in their size). Two-dimensional tables interpolate along context at each
measured batch size, then along batch size, with the same rule on each axis.

The per-step overhead is what the summed operations miss on this machine, fitted once per profile by non-negative
least squares against real engine steps (``workbench.sim.op_timing.fit_overhead``): a share of the summed
operations (``ops_scale``: the same operations run slower inside a forward pass, whose weight streams evict the
caches the isolated timings keep warm), a constant per step and per sequence for each kind of step (the
scheduler, the metadata tensors, the Python between layers; ``decode_step_s``, ``decode_seq_s`` for a pure
decode, ``ragged_step_s``, ``ragged_seq_s`` otherwise), a per-token term, and a time per packed product
the step runs (``packed_call_s``, for a profile with packed linears: ``packed_products``, which records the layers
really packed; a model whose weights are all below ``PACKED_MIN_WEIGHT`` has none, and no such term). A packed
product costs more inside a forward pass than timed alone, by more than a plain one: on the 2-core AMD EPYC (AVX2, torch
2.13, tiny-gqa, load 5) a packed QKV projection at 4 rows took 47 us alone, an RMSNorm 31 us, the two in a row
117 us (+39 us), against +12 us with the plain product at 3 rows; fitted to the engine's steps the term came out
at 40 us a product, and the steps of 4 to 6 decodes, priced 15-19% low without it, 12-13% low with it (the
projections switch to the packed product at ``PACKED_MIN_ROWS`` rows, so every step of that many tokens or more pays it
on all of them). Most of that extra comes with other processes on the cores: the same machine at load 1.1-1.5
fitted 1.4 us a product (the steps of 4 decodes then 0.53 ms above those of 3, the summed operations 0.42 ms).
The gap between steps, the extra
time of a step after an idle wait and the wake-up delay are measured from the same run, as ``ProfiledCostModel``
models them (this class extends it). Every term is non-negative: an engine step does at least the work of its
operations (on a loaded machine a fit with free signs found a negative total share of the operations, which no
step can have). The model imports no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError, read_json_file
from workbench.sim.profiled import ProfiledCostModel
from workbench.sim.stats import StepStats

OP_PROFILE_FORMAT = "workbench-op-profile-v1"

# per-layer dense operations over the step's tokens, and how many times a layer runs each
LAYER_OPS = {"rmsnorm": 2, "qkv_proj": 1, "rotary": 1, "o_proj": 1, "residual_add": 2, "gate_up_proj": 1,
             "activation": 1, "down_proj": 1}  # fmt: skip
TOKEN_OPS = (*LAYER_OPS, "kv_write", "embedding", "rotary_table")  # x: the step's tokens
ROW_OPS = ("lm_head", "sample", "decode_kv_write")  # x: sampled rows (decode_kv_write: a pure decode's batch)
LENGTH_OPS = ("attention_prefill", "attention_decode_looped")  # x: prompt length, context length
OPS_1D = (*TOKEN_OPS, *ROW_OPS, *LENGTH_OPS)
OPS_2D = ("attention_decode",)  # x: (batch, context)
OP_X = {**{op: "tokens" for op in TOKEN_OPS}, **{op: "rows" for op in ROW_OPS}, "attention_prefill": "prompt_len",
        "attention_decode_looped": "context", "attention_decode": "batch,context"}  # fmt: skip
OVERHEAD_FEATURES = ("ops_scale", "decode_step_s", "ragged_step_s", "decode_seq_s", "ragged_seq_s", "token_s",
                     "packed_call_s")  # fmt: skip
NUM_FREE_OVERHEAD = 0  # no term may be negative (see the module docstring)


def interp1(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points; below ``xs[0]``: ``ys[0]``; above ``xs[-1]``: the last
    segment's slope continued (0 if that slope is negative, or with one point)."""
    if x <= xs[0]:
        return ys[0]
    n = len(xs)
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if n > 1 else 0.0
        return ys[-1] + max(slope, 0.0) * (x - xs[-1])
    lo, hi = 0, n - 1
    while hi - lo > 1:  # xs[lo] < x < xs[hi]
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    f = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + f * (ys[hi] - ys[lo])


def interp2(rows: list[float], cols: list[float], table: list[list[float]], r: float, c: float) -> float:
    """``table[i][j]`` measured at ``(rows[i], cols[j])``: ``interp1`` along ``cols`` in every row, then along
    ``rows`` (the same extrapolation rule on each axis)."""
    return interp1(rows, [interp1(cols, line, c) for line in table], r)


def prefill_pairs(prompt_len: float) -> float:
    """Causal (query, key) pairs of one whole prompt of ``prompt_len`` tokens."""
    return prompt_len * (prompt_len + 1) / 2


def _numbers(value: Any, what: str, positive: bool = False) -> list[float]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{what} must be a non-empty list of numbers, got {value!r}")
    out = []
    for v in value:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if not ok or (positive and v <= 0):
            bound = "> 0" if positive else ">= 0"
            raise ConfigError(f"{what} must hold finite numbers {bound}, got {v!r}")
        out.append(float(v))
    return out


def _grid(value: Any, what: str) -> list[float]:
    xs = _numbers(value, what, positive=True)
    if any(a >= b for a, b in zip(xs, xs[1:])):
        raise ConfigError(f"{what} must be strictly increasing, got {value!r}")
    return xs


@dataclass
class OpTable:
    """One operation's measured medians: over ``xs`` (1-D) or over ``xs`` x ``cols`` (2-D, ``medians[i][j]``)."""

    xs: list[float]
    medians: list[Any]
    cols: list[float] | None = None

    def at(self, x: float, col: float | None = None) -> float:
        if self.cols is None:
            return interp1(self.xs, self.medians, x)
        return interp2(self.xs, self.cols, self.medians, x, 0.0 if col is None else col)


def parse_op(name: str, entry: Any, where: str) -> OpTable:
    """An ``OpTable`` from a profile's ``ops[name]`` entry; ConfigError naming ``where`` and the field if wrong."""
    what = f"{where}: ops.{name}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{what} must be an object with the measured sizes and median_s, got {entry!r}")
    if name in OPS_2D:
        for key in ("batch_sizes", "contexts", "median_s"):
            if key not in entry:
                raise ConfigError(f'{what} has no "{key}"')
        rows = _grid(entry["batch_sizes"], f"{what}.batch_sizes")
        cols = _grid(entry["contexts"], f"{what}.contexts")
        table = entry["median_s"]
        if not isinstance(table, list) or len(table) != len(rows):
            raise ConfigError(f"{what}.median_s must have one row per batch size ({len(rows)})")
        medians = []
        for i, line in enumerate(table):
            vals = _numbers(line, f"{what}.median_s[{i}]")
            if len(vals) != len(cols):
                raise ConfigError(f"{what}.median_s[{i}] has {len(vals)} values for {len(cols)} contexts")
            medians.append(vals)
        return OpTable(rows, medians, cols)
    for key in ("values", "median_s"):
        if key not in entry:
            raise ConfigError(f'{what} has no "{key}"')
    xs = _grid(entry["values"], f"{what}.values")
    medians = _numbers(entry["median_s"], f"{what}.median_s")
    if len(medians) != len(xs):
        raise ConfigError(f"{what}.median_s has {len(medians)} values for {len(xs)} sizes")
    if name == "attention_prefill":
        xs = [prefill_pairs(x) for x in xs]  # looked up by (query, key) pairs
    return OpTable(xs, medians)


def parse_packed_products(value: Any, where: str) -> tuple[int, int | None, int, bool] | None:
    """A profile's ``packed_products`` (``{"min_rows", "max_rows", "per_layer", "head"}``, written by profile-ops
    when it timed packed linears; absent or null: none) as ``OpProfileCostModel.packed_products``; ConfigError
    naming ``where`` if malformed. ``max_rows`` null: one call at any row count (the blocked op, profiles written
    since 2026-12-06); an integer: the most rows one call took (oneDNN's packed products, profiles written before)."""
    if value is None:
        return None
    keys = ("min_rows", "max_rows", "per_layer", "head")
    if not isinstance(value, dict) or set(value) != set(keys):
        raise ConfigError(f'{where}: "packed_products" must be null or an object of {", ".join(keys)}, got {value!r}')
    lo, hi, per_layer, head = (value[k] for k in keys)
    counts = (lo, lo if hi is None else hi, per_layer)
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in counts) or not 1 <= lo <= counts[1]:
        raise ConfigError(f'{where}: "packed_products" needs integers 1 <= min_rows <= max_rows (or null) and '
                          f"per_layer >= 0, got {value!r}")  # fmt: skip
    if not isinstance(head, bool):
        raise ConfigError(f'{where}: "packed_products.head" must be true or false, got {head!r}')
    return lo, hi, per_layer, head


@dataclass
class OpProfileCostModel(ProfiledCostModel):
    """Step time = the sum of the step's operations (``op_times``) + the fitted overhead (``overhead_time``).

    ``ops``: one ``OpTable`` per operation of ``OPS_1D`` and ``OPS_2D``; ``num_layers``: the profiled model's;
    ``max_key_slots``: the engine's padded-gather limit for a pure decode (batch x longest context); ``overhead``:
    coefficients of ``OVERHEAD_FEATURES`` (missing ones 0); ``packed_products``: where the profiled model's linears were
    packed, ``(min_rows, max_rows, per_layer, head)``: the fewest rows the engine packs, the most in one call (None:
    any), the packed products of a layer and whether the LM head is one (None: no packed products). The clock's host
    gap, idle-step excess and wake-up delay are ``ProfiledCostModel``'s; its linear coefficients stay empty.
    """

    ops: dict[str, OpTable] = field(default_factory=dict)
    num_layers: int = 1
    max_key_slots: int = 1 << 16
    packed_products: tuple[int, int | None, int, bool] | None = None
    overhead: dict[str, float] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)  # the profile file's content, for to_dict
    name = "op-profile"

    def __post_init__(self) -> None:
        super().__post_init__()
        missing = [op for op in (*OPS_1D, *OPS_2D) if op not in self.ops]
        if missing:
            raise ConfigError(f"op profile: no measurement of {', '.join(missing)}")
        unknown = sorted(set(self.overhead) - set(OVERHEAD_FEATURES))
        if unknown:
            raise ConfigError(f"op profile: unknown overhead term(s) {unknown}; expected some of "
                              f"{', '.join(OVERHEAD_FEATURES)}")  # fmt: skip
        for key, value in self.overhead.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"op profile: overhead {key!r} must be a finite number, got {value!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ConfigError(f"op profile: num_layers must be a positive integer, got {self.num_layers!r}")
        self._over = tuple(float(self.overhead.get(f, 0.0)) for f in OVERHEAD_FEATURES)

    # ---- the model ------------------------------------------------------------------------------------------
    def is_batched_decode(self, stats: StepStats) -> bool:
        """Whether the engine attends this step in one padded gather (a pure decode within ``max_key_slots``)."""
        return stats.looped_decodes((1, self.max_key_slots)) == 0 and stats.decode_seqs > 0

    def op_times(self, stats: StepStats) -> dict[str, float]:
        """Seconds of each operation in this step (every layer together), from the profile alone."""
        t = stats.prefill_tokens + stats.decode_seqs
        if t <= 0:
            return {}
        ops, nl = self.ops, self.num_layers
        out = {op: nl * count * ops[op].at(t) for op, count in LAYER_OPS.items()}
        out["rmsnorm"] += ops["rmsnorm"].at(t)  # the final norm
        out["embedding"] = ops["embedding"].at(t)
        out["rotary_table"] = ops["rotary_table"].at(t)
        rows = stats.prefill_seqs + stats.decode_seqs + stats.spec_tokens  # a verify's logits: k + 1 rows
        out["lm_head"] = ops["lm_head"].at(rows)
        out["sample"] = ops["sample"].at(rows)
        ds = stats.decode_seqs
        if self.is_batched_decode(stats):
            context = stats.decode_max_context or stats.decode_context / ds
            out["attention_decode"] = nl * ops["attention_decode"].at(ds, context)
            out["decode_kv_write"] = ops["decode_kv_write"].at(ds)
            return out
        out["kv_write"] = nl * ops["kv_write"].at(t)
        if stats.prefill_seqs:
            mean_pairs = stats.prefill_pairs / stats.prefill_seqs
            out["attention_prefill"] = nl * stats.prefill_seqs * ops["attention_prefill"].at(mean_pairs)
        if ds:
            out["attention_decode_looped"] = nl * ds * ops["attention_decode_looped"].at(stats.decode_context / ds)
        return out

    def packed_calls(self, stats: StepStats) -> int:
        """The packed calls this step makes (``packed_products``): every layer's packed projections when its
        token count is ``min_rows`` or more, the LM head when its sampled rows are, each one call, or, in a profile of
        oneDNN's packed products (an integer ``max_rows``), two above ``max_rows`` rows unless a multiple of it; 0 for
        a profile of plain linears."""
        if self.packed_products is None:
            return 0
        lo, hi, per_layer, head = self.packed_products
        t = stats.prefill_tokens + stats.decode_seqs
        rows = stats.prefill_seqs + stats.decode_seqs + stats.spec_tokens  # the LM head's rows, as in op_times

        def calls(n: int) -> int:  # oneDNN's slices: a multiple of max_rows in one call, the rest in another
            return 0 if n < lo else 1 if hi is None or n <= hi else 1 + (n % hi != 0)

        return per_layer * self.num_layers * calls(t) + (calls(rows) if head else 0)

    def overhead_features(self, stats: StepStats, ops_s: float) -> tuple[float, ...]:
        """The ``OVERHEAD_FEATURES`` of a step whose summed operations take ``ops_s``."""
        t = stats.prefill_tokens + stats.decode_seqs
        seqs = stats.prefill_seqs + stats.decode_seqs
        packed = float(self.packed_calls(stats))
        if self.is_batched_decode(stats):
            return (ops_s, 1.0, 0.0, float(seqs), 0.0, float(t), packed)
        return (ops_s, 0.0, 1.0, 0.0, float(seqs), float(t), packed)

    def overhead_time(self, stats: StepStats, ops_s: float) -> float:
        return sum(c * f for c, f in zip(self._over, self.overhead_features(stats, ops_s)))

    def step_time(self, stats: StepStats) -> float:
        if stats.verify_seqs:
            stats = stats.verifies_as_decodes()  # a verify costs what a decode of its k + 1 rows costs
        ops_s = sum(self.op_times(stats).values())
        if ops_s <= 0.0:
            return 0.0
        t = ops_s + self.overhead_time(stats, ops_s)
        if self._rng is not None:
            t += self._residual()
        return max(t, 0.1 * ops_s)  # a negative fitted constant or residual never makes a step nearly free

    def decode_run(
        self, now: float, num_seqs: int, context: int, max_steps: int, before: float
    ) -> tuple[list[float], list[float]]:
        return [], []  # a pure decode is priced at its longest context, which a bulk run does not know

    # ---- persistence ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dict(self.source)

    def describe(self) -> dict[str, Any]:
        over = self.source.get("overhead") or {}
        return {"name": self.name, "model": self.meta.get("model"), "machine": self.meta.get("machine"),
                "num_layers": self.num_layers, "host_gap_s": self.host_gap_s, "overhead": over}  # fmt: skip

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.source, indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, where: str = "op profile") -> OpProfileCostModel:
        """The model of a profile's content (``OP_PROFILE_FORMAT``); ConfigError naming ``where`` and what is wrong."""
        if not isinstance(data, dict) or data.get("format") != OP_PROFILE_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ConfigError(f'{where}: not an op profile (expected "format": "{OP_PROFILE_FORMAT}", got {got!r}; '
                              "make one with `workbench profile-ops`)")  # fmt: skip
        for key in ("model", "num_layers", "ops"):
            if key not in data:
                raise ConfigError(f'{where}: no "{key}"')
        raw = data["ops"]
        if not isinstance(raw, dict):
            raise ConfigError(f'{where}: "ops" must be an object of operations, got {type(raw).__name__}')
        missing = [op for op in (*OPS_1D, *OPS_2D) if op not in raw]
        if missing:
            raise ConfigError(f'{where}: no measurement of {", ".join(missing)} in "ops"')
        ops = {name: parse_op(name, raw[name], where) for name in (*OPS_1D, *OPS_2D)}
        nl = data["num_layers"]
        if not isinstance(nl, int) or isinstance(nl, bool) or nl < 1:
            raise ConfigError(f'{where}: "num_layers" must be a positive integer, got {nl!r}')
        over = data.get("overhead") or {}
        if not isinstance(over, dict):
            raise ConfigError(f'{where}: "overhead" must be null or an object, got {over!r}')
        coef = over.get("coefficients", {})
        if not isinstance(coef, dict):
            raise ConfigError(f'{where}: "overhead.coefficients" must be an object, got {coef!r}')
        gaps = {}
        for key in ("host_gap_s", "idle_step_s", "wake_s"):
            value = over.get(key, None if key == "wake_s" else 0.0)
            if value is not None and (not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0)):
                raise ConfigError(f'{where}: "overhead.{key}" must be a number >= 0, got {value!r}')
            gaps[key] = value
        residuals = over.get("residual_quantiles_s", [])
        if not isinstance(residuals, list) or not all(isinstance(v, (int, float)) for v in residuals):
            raise ConfigError(f'{where}: "overhead.residual_quantiles_s" must be a list of numbers')
        machine = data.get("machine") or {}  # machine_identity(): cpu, cpu_count, cpu_capability (older: name)
        meta = {"model": data["model"], "machine": machine.get("cpu") or machine.get("name") or "unknown machine",
                "cpu_count": machine.get("cpu_count"), "cpu_capability": machine.get("cpu_capability"),
                "device": data.get("device"), "dtype": data.get("dtype"), "threads": data.get("threads")}  # fmt: skip
        packed = parse_packed_products(data.get("packed_products"), where)
        try:
            return cls({}, float(gaps["host_gap_s"]), meta, list(residuals), idle_step_s=float(gaps["idle_step_s"]),
                       wake_s=gaps["wake_s"], ops=ops, num_layers=nl, overhead=dict(coef), source=data,
                       max_key_slots=int(data.get("max_key_slots", 1 << 16)), packed_products=packed)  # fmt: skip
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> OpProfileCostModel:
        """Read a profile file written by ``workbench profile-ops`` (ConfigError naming the file and the problem)."""
        path = Path(path)
        data = read_json_file(path, "op profile file", " (make one with `workbench profile-ops`)")
        return cls.from_dict(data, str(path))


def fit_overhead(
    cost: OpProfileCostModel,
    stats: list[StepStats],
    durations_s: list[float],
    gaps_s: list[float] | None = None,
    after_idle: list[bool] | None = None,
    wakes_s: list[float] | None = None,
    outlier_ratio: float = 2.0,
) -> dict[str, Any]:
    """Fit the per-step overhead of ``cost`` (``OVERHEAD_FEATURES``) to measured engine steps: least squares of
    (measured - summed operations) on the features, weighted by 1 / measured (relative error, so short decode
    steps count as much as long prefills), every coefficient non-negative; steps
    more than ``outlier_ratio`` times the first fit's prediction (the process descheduled) are left out of a second
    fit, and so are the steps after an idle wait, whose median excess is ``idle_step_s``. ``host_gap_s`` and
    ``wake_s`` are the medians of ``gaps_s`` and ``wakes_s``; ``residual_quantiles_s`` are those of (measured -
    fitted) over every busy step, the outliers included (the noise a loaded machine adds). Returns the profile's
    ``overhead`` section, with the fit's quality before (operations alone) and after."""
    import numpy as np

    from workbench.sim.fit import nnls

    if len(stats) != len(durations_s) or not stats:
        raise ConfigError(f"fit_overhead needs as many step stats as durations, and some: {len(stats)} vs "
                          f"{len(durations_s)}")  # fmt: skip
    base = OpProfileCostModel({}, ops=cost.ops, num_layers=cost.num_layers, max_key_slots=cost.max_key_slots,
                              packed_products=cost.packed_products)  # fmt: skip
    ops_s = np.array([sum(base.op_times(s).values()) for s in stats])
    x = np.array([base.overhead_features(s, o) for s, o in zip(stats, ops_s)])
    y = np.asarray(durations_s, dtype=np.float64)
    idle = np.zeros(len(stats), dtype=bool) if after_idle is None else np.asarray(after_idle, dtype=bool)
    if idle.all():
        idle[:] = False
    busy = ~idle
    active = [j for j in range(x.shape[1]) if np.any(x[busy, j] != 0)]
    free = [j for j in active if j < NUM_FREE_OVERHEAD]
    order = free + [j for j in active if j >= NUM_FREE_OVERHEAD]

    def solve(mask: np.ndarray) -> np.ndarray:
        w = 1.0 / np.maximum(y[mask], 1e-9)
        coef = np.zeros(x.shape[1])
        a = x[mask][:, order] * w[:, None]
        coef[order] = nnls(a, (y[mask] - ops_s[mask]) * w, free=len(free))
        return coef

    coef = solve(busy)
    pred = ops_s + x @ coef
    keep = busy & (y <= outlier_ratio * np.maximum(pred, 1e-12))
    if keep.sum() >= len(order) and keep.sum() < busy.sum():
        coef = solve(keep)
        pred = ops_s + x @ coef
    else:
        keep = busy
    pred = np.maximum(pred, 0.1 * ops_s)
    idle_step_s = float(np.median(y[idle] - pred[idle])) if idle.any() else 0.0
    signed_ops = (ops_s[busy] - y[busy]) / y[busy]  # the summed operations against each busy step
    rel_ops = np.abs(signed_ops)
    rel_fit = np.abs(pred[busy] - y[busy]) / y[busy]
    return {
        "coefficients": {f: float(c) for f, c in zip(OVERHEAD_FEATURES, coef)},
        "host_gap_s": float(np.median(gaps_s)) if gaps_s else 0.0,
        "idle_step_s": max(idle_step_s, 0.0),
        "wake_s": float(np.median(wakes_s)) if wakes_s else None,
        # over every busy step, the outliers too: a step descheduled by another process is part of the noise
        "residual_quantiles_s": np.quantile(y[busy] - pred[busy], np.linspace(0.0, 1.0, 101)).tolist(),
        "fit": {
            "method": "nnls-relative",
            "num_steps": len(stats),
            "num_idle_steps": int(idle.sum()),
            "num_outliers": int(busy.sum() - keep.sum()),
            "ops_only_median_rel_error": float(np.median(rel_ops)),
            "ops_only_mean_signed_rel_error": float(np.mean(signed_ops)),
            "ops_only_signed_rel_error_sd": float(np.std(signed_ops, ddof=1)) if len(signed_ops) > 1 else None,
            "median_rel_error": float(np.median(rel_fit)),
            "p90_rel_error": float(np.percentile(rel_fit, 90)),
        },  # fmt: skip
    }
