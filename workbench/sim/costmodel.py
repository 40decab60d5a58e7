"""Cost models: how long one scheduler step takes, behind one interface, so the simulator never touches a device.

A step is reduced to ``StepStats``: prefill tokens, prefill sequences, the (query, key) pairs and context tokens
of the prefill chunks, decode sequences and the context tokens the decodes read (a decode at context length L
attends to L keys, the new one included, as in ``workbench.roofline``). A ``CostModel`` turns that into a
duration and owns the clock's advance across a step:

- ``start_time(now)``: when the next step starts if the replica is free at ``now`` (``now + host_gap_s``: the
  host work between two steps, such as the engine's update and admission);
- ``end_time(start, stats)``: when a step that starts at ``start`` ends (``start + step_time(stats)``);
- ``decode_run(now, num_seqs, context, max_steps, before)``: start and end times of a run of identical
  pure-decode steps (the context read grows by ``num_seqs`` a step), for the simulator's bulk fast path.

Models:

- ``RooflineCostModel``: ``workbench.roofline``'s prediction for a model on a hardware spec, divided by an
  optional efficiency per phase (a mixed step blends them in proportion to each phase's own roofline time).
  Pure decode runs use an exact piecewise-linear form of the roofline in the context length (cached per
  batch size), evaluated in O(log ops) per step; ``step_time`` is the reference it is tested against.
- ``ProfiledCostModel``: linear in ``FEATURES`` (a constant, prefill tokens, prefill sequences, prefill
  attention pairs, decode sequences, decode context tokens read) plus a constant host gap, fitted by least
  squares to step times the real engine measured on this machine (``workbench fit-profile``), saved to and
  loaded from JSON; optionally with the measured residuals drawn back in as seeded noise.
- ``TraceCostModel``: replays the start and end times of a measured ``StepLog`` step by step (and checks that
  each simulated step computes what the measured one did), so the simulator reproduces an engine run exactly.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from workbench.config import ModelConfig
from workbench.errors import ConfigError

if TYPE_CHECKING:
    from workbench.engine.metrics import StepLog, StepRecord
    from workbench.engine.scheduler import StepPlan
    from workbench.roofline import RooflineModel

COST_MODELS = ("roofline", "profiled")
FEATURES = ("const", "prefill_tokens", "prefill_seqs", "prefill_pairs", "decode_seqs", "decode_context")
PROFILE_FORMAT = "workbench-profile-v1"


class StepStats(NamedTuple):
    """What a step computes, as the cost models see it."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_pairs: int = 0  # causal (query, key) pairs of the prefill chunks
    prefill_context: int = 0  # cached + new tokens whose K/V the prefill chunks read
    decode_seqs: int = 0
    decode_context: int = 0  # sum of the decodes' context lengths (keys read, the new one included)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def features(self) -> tuple[float, ...]:
        """The ``FEATURES`` vector of the profiled model."""
        return (1.0, self.prefill_tokens, self.prefill_seqs, self.prefill_pairs, self.decode_seqs, self.decode_context)


def plan_stats(plan: StepPlan) -> StepStats:
    """``StepStats`` of a scheduler ``StepPlan`` (chunk ``n`` new tokens after ``start`` computed ones)."""
    pt = ps = pp = pc = ds = dc = 0
    for c in plan.chunks:
        n, p = c.num_new_tokens, c.start
        if c.is_prefill:
            pt += n
            ps += 1
            pp += n * p + n * (n + 1) // 2
            pc += n + p
        else:
            ds += n
            dc += p + n
    return StepStats(pt, ps, pp, pc, ds, dc)


def decode_stats(num_seqs: int, context: int) -> StepStats:
    """A pure-decode step of ``num_seqs`` sequences reading ``context`` tokens in all."""
    return StepStats(0, 0, 0, 0, num_seqs, context)


class CostModel:
    """Base class: subclasses give ``step_time``; ``host_gap_s`` is the idle host time between two steps."""

    name = "cost"
    host_gap_s: float = 0.0

    def step_time(self, stats: StepStats) -> float:
        """Seconds the device spends on a step."""
        raise NotImplementedError

    def start_time(self, now: float) -> float:
        """When the next step starts if the replica became free at ``now``."""
        return now + self.host_gap_s

    def end_time(self, start: float, stats: StepStats) -> float:
        """When a step that starts at ``start`` ends."""
        return start + self.step_time(stats)

    def decode_run(
        self, now: float, num_seqs: int, context: int, max_steps: int, before: float
    ) -> tuple[list[float], list[float]]:
        """(starts, ends) of up to ``max_steps`` consecutive pure-decode steps, the first reading ``context``
        tokens, each starting strictly before ``before`` (a step starting at an arrival must admit it first)."""
        starts: list[float] = []
        ends: list[float] = []
        t = now
        for _ in range(max_steps):
            s = self.start_time(t)
            if s >= before:
                break
            t = self.end_time(s, decode_stats(num_seqs, context))
            starts.append(s)
            ends.append(t)
            context += num_seqs
        return starts, ends

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (name and parameters) for reports."""
        return {"name": self.name, "host_gap_s": self.host_gap_s}


# ---- roofline --------------------------------------------------------------------------------------------
class RooflineCostModel(CostModel):
    """The roofline prediction of ``workbench.roofline`` divided by a per-phase efficiency (1.0: the floor)."""

    name = "roofline"

    def __init__(
        self,
        model: ModelConfig | str,
        hardware: Any,
        dtype: str = "bf16",
        prefill_efficiency: float = 1.0,
        decode_efficiency: float = 1.0,
        host_gap_s: float = 0.0,
    ) -> None:
        from workbench.roofline import get_model

        for fname, value in (("prefill_efficiency", prefill_efficiency), ("decode_efficiency", decode_efficiency)):
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ConfigError(f"{fname} must be in (0, 1], got {value!r}")
        _check_gap(host_gap_s)
        self.roofline: RooflineModel = get_model(model, hardware, dtype=dtype)
        self.prefill_efficiency = float(prefill_efficiency)
        self.decode_efficiency = float(decode_efficiency)
        self.host_gap_s = float(host_gap_s)
        self._segments: dict[int, tuple[list[float], list[float], list[float]]] = {}

    def step_time(self, stats: StepStats) -> float:
        pt, ps, pp, pc, ds, dc = stats
        time_from_stats = self.roofline.time_from_stats
        t = time_from_stats(pt + ds, ps + ds, pp + dc, pc + dc)
        ep, ed = self.prefill_efficiency, self.decode_efficiency
        if ep == 1.0 and ed == 1.0:
            return t
        if not ds:
            return t / ep
        if not pt:
            return t / ed
        tp, td = time_from_stats(pt, ps, pp, pc), time_from_stats(ds, ds, dc, dc)
        return t * (tp / ep + td / ed) / (tp + td)

    def _decode_segments(self, n: int) -> tuple[list[float], list[float], list[float]]:
        """The roofline time of a decode step of ``n`` sequences as a piecewise-linear function of the context
        C (pairs = context = C): per op ``max(a_c + b_c C, a_m + b_m C)``; returns (breakpoints, alpha, beta)
        with ``time = alpha[i] + beta[i] * C`` for ``C`` in segment ``i = bisect(breakpoints, C)``."""
        seg = self._segments.get(n)
        if seg is not None:
            return seg
        lines = []
        breaks: set[float] = set()
        for fc, bc in self.roofline._fast:
            a_c, b_c = (fc[1] + fc[2]) * n, fc[3]
            a_m, b_m = bc[0] + (bc[1] + bc[2]) * n, bc[4]
            lines.append((a_c, b_c, a_m, b_m))
            if b_c != b_m:
                x = (a_m - a_c) / (b_c - b_m)
                if x > 0:
                    breaks.add(x)
        points = sorted(breaks)
        alphas, betas = [], []
        for i in range(len(points) + 1):
            lo = points[i - 1] if i > 0 else 0.0
            hi = points[i] if i < len(points) else 2.0 * lo + 1.0
            mid = (lo + hi) / 2
            alpha = beta = 0.0
            for a_c, b_c, a_m, b_m in lines:
                if a_c + b_c * mid > a_m + b_m * mid:
                    alpha, beta = alpha + a_c, beta + b_c
                else:
                    alpha, beta = alpha + a_m, beta + b_m
            alphas.append(alpha / self.decode_efficiency)
            betas.append(beta / self.decode_efficiency)
        seg = self._segments[n] = (points, alphas, betas)
        return seg

    def decode_time(self, num_seqs: int, context: int) -> float:
        """The fast path's time of one pure-decode step (equal to ``step_time`` up to rounding)."""
        points, alphas, betas = self._decode_segments(num_seqs)
        i = bisect.bisect_right(points, context)
        return alphas[i] + betas[i] * context

    def decode_run(
        self, now: float, num_seqs: int, context: int, max_steps: int, before: float
    ) -> tuple[list[float], list[float]]:
        points, alphas, betas = self._decode_segments(num_seqs)
        gap = self.host_gap_s
        starts: list[float] = []
        ends: list[float] = []
        t = now
        i = bisect.bisect_right(points, context)
        limit = points[i] if i < len(points) else math.inf
        for _ in range(max_steps):
            s = t + gap
            if s >= before:
                break
            while context >= limit:
                i += 1
                limit = points[i] if i < len(points) else math.inf
            t = s + alphas[i] + betas[i] * context
            starts.append(s)
            ends.append(t)
            context += num_seqs
        return starts, ends

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.roofline.cfg.name,
            "hardware": self.roofline.hw.name,
            "dtype": self.roofline.dtype,
            "prefill_efficiency": self.prefill_efficiency,
            "decode_efficiency": self.decode_efficiency,
            "host_gap_s": self.host_gap_s,
        }


def _check_gap(host_gap_s: float) -> None:
    if not isinstance(host_gap_s, (int, float)) or not (host_gap_s >= 0 and math.isfinite(host_gap_s)):
        raise ConfigError(f"host_gap_s must be a number >= 0, got {host_gap_s!r}")


# ---- profiled --------------------------------------------------------------------------------------------
@dataclass
class ProfiledCostModel(CostModel):
    """``step_time = sum(coefficients[f] * feature f)`` over ``FEATURES``, plus ``host_gap_s`` between steps.

    ``meta`` records where the profile came from (machine, model, engine settings, fit quality).
    ``residual_quantiles_s``: quantiles of (measured - fitted) step time over the measured steps. With
    ``noise_seed`` set, each step adds a residual drawn from them (seeded, so a run is reproducible): the host's
    interruptions on a shared machine come back into the simulated tail. Without it the model is deterministic.
    """

    coefficients: dict[str, float]
    host_gap_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    residual_quantiles_s: list[float] = field(default_factory=list)
    noise_seed: int | None = None
    name = "profiled"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ConfigError(f"profile: unknown feature(s) {unknown}; expected some of {', '.join(FEATURES)}")
        for key, value in self.coefficients.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"profile: coefficient {key!r} must be a finite number, got {value!r}")
        _check_gap(self.host_gap_s)
        self._coef = tuple(float(self.coefficients.get(f, 0.0)) for f in FEATURES)
        self.residual_quantiles_s = sorted(float(x) for x in self.residual_quantiles_s)
        self._rng = None
        if self.noise_seed is not None:
            if len(self.residual_quantiles_s) < 2:
                raise ConfigError("profile: noise_seed needs residual_quantiles_s (at least two quantiles)")
            import random

            self._rng = random.Random(self.noise_seed)

    def with_noise(self, seed: int | None) -> ProfiledCostModel:
        """A copy that draws residual noise with ``seed`` (None: deterministic)."""
        return ProfiledCostModel(dict(self.coefficients), self.host_gap_s, dict(self.meta),
                                 list(self.residual_quantiles_s), seed)  # fmt: skip

    def _residual(self) -> float:
        """A draw from the residual distribution (linear between the stored quantiles)."""
        q = self.residual_quantiles_s
        u = self._rng.random() * (len(q) - 1)  # type: ignore[union-attr]
        i = int(u)
        return q[i] + (q[i + 1] - q[i]) * (u - i) if i + 1 < len(q) else q[-1]

    def step_time(self, stats: StepStats) -> float:
        c = self._coef
        t = c[0] + c[1] * stats[0] + c[2] * stats[1] + c[3] * stats[2] + c[4] * stats[4] + c[5] * stats[5]
        if self._rng is not None:
            t = max(t + self._residual(), 0.1 * t)
        return max(0.0, t)

    def decode_run(
        self, now: float, num_seqs: int, context: int, max_steps: int, before: float
    ) -> tuple[list[float], list[float]]:
        c = self._coef
        base, per_ctx, gap = c[0] + c[4] * num_seqs, c[5], self.host_gap_s
        starts: list[float] = []
        ends: list[float] = []
        t = now
        for _ in range(max_steps):
            s = t + gap
            if s >= before:
                break
            d = base + per_ctx * context
            if self._rng is not None:
                d = max(d + self._residual(), 0.1 * d)
            t = s + (d if d > 0.0 else 0.0)
            starts.append(s)
            ends.append(t)
            context += num_seqs
        return starts, ends

    # ---- persistence ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "coefficients": {f: float(self.coefficients.get(f, 0.0)) for f in FEATURES},
            "host_gap_s": self.host_gap_s,
            "residual_quantiles_s": self.residual_quantiles_s,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ProfiledCostModel:
        """Read a profile written by ``save`` (ConfigError naming the file when it is missing or malformed)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"profile file not found: {path} (make one with `workbench fit-profile`)") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ConfigError(f'{path}: not a workbench profile (expected "format": "{PROFILE_FORMAT}")')
        return cls(dict(data["coefficients"]), float(data.get("host_gap_s", 0.0)), dict(data.get("meta", {})),
                   list(data.get("residual_quantiles_s", [])))  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.to_dict()}


def fit_profile(
    stats: list[StepStats],
    durations_s: list[float],
    gaps_s: list[float] | None = None,
    meta: dict | None = None,
    outlier_ratio: float = 2.0,
) -> ProfiledCostModel:
    """Least-squares fit of ``FEATURES`` to measured step durations (relative error weighted, so short decode
    steps count as much as long prefills); coefficients that come out negative are dropped and the rest refitted
    (a step never gets cheaper with more work). Steps measured at more than ``outlier_ratio`` times the first
    fit's prediction (the process descheduled by others on a shared machine) are left out of a second fit.
    ``host_gap_s`` is the median of ``gaps_s``."""
    import numpy as np

    if len(stats) != len(durations_s) or not stats:
        raise ConfigError(f"fit_profile needs as many step stats as durations, and some: {len(stats)} vs "
                          f"{len(durations_s)}")  # fmt: skip
    x_all = np.asarray([s.features() for s in stats], dtype=np.float64)
    y_all = np.asarray(durations_s, dtype=np.float64)

    def solve(x: np.ndarray, y: np.ndarray) -> tuple[list[int], np.ndarray]:
        w = 1.0 / np.maximum(y, 1e-9)
        active = [j for j in range(len(FEATURES)) if np.any(x[:, j] != 0)]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            negative = [a for a, c in zip(active, coef) if c < 0 and FEATURES[a] != "const"]
            if not negative:
                return active, coef
            active = [a for a in active if a not in negative]

    active, coef = solve(x_all, y_all)
    keep = y_all <= outlier_ratio * np.maximum(x_all[:, active] @ coef, 1e-12)
    if keep.sum() >= len(FEATURES) and not keep.all():
        active, coef = solve(x_all[keep], y_all[keep])
    coefficients = {f: 0.0 for f in FEATURES}
    for a, c in zip(active, coef):
        coefficients[FEATURES[a]] = float(c)
    rel = np.abs(x_all[:, active] @ coef - y_all) / y_all
    info = {"num_steps": len(stats), "num_outliers": int((~keep).sum()), "median_rel_error": float(np.median(rel)),
            "p90_rel_error": float(np.percentile(rel, 90))}  # fmt: skip
    gap = float(np.median(gaps_s)) if gaps_s else 0.0
    residuals = np.quantile(y_all - x_all[:, active] @ coef, np.linspace(0.0, 1.0, 101)).tolist()
    return ProfiledCostModel(coefficients, max(gap, 0.0), {**(meta or {}), "fit": info}, residuals)


# ---- trace -----------------------------------------------------------------------------------------------
class TraceCostModel(CostModel):
    """Replays a measured run: the i-th non-empty step starts and ends when the engine's i-th logged step did.

    Step i starts at ``max(now, start_i)`` and ends at ``end_i`` (absolute times, so no rounding creeps in);
    each step's prefill and decode token counts must match the log's, else the simulation has diverged from
    the engine's scheduling and a RuntimeError says where.
    """

    name = "trace"

    def __init__(self, step_log: StepLog | list[StepRecord]) -> None:
        steps = step_log.steps if hasattr(step_log, "steps") else step_log
        self.steps = list(steps)
        self.index = 0

    def _current(self) -> StepRecord:
        if self.index >= len(self.steps):
            raise RuntimeError(f"trace cost model: the simulation runs more steps than the {len(self.steps)} logged")
        return self.steps[self.index]

    def start_time(self, now: float) -> float:
        if self.index >= len(self.steps):
            return now
        return max(now, self.steps[self.index].start_s)

    def end_time(self, start: float, stats: StepStats) -> float:
        rec = self._current()
        if rec.num_prefill_tokens != stats.prefill_tokens or rec.num_decode_tokens != stats.decode_seqs:
            raise RuntimeError(
                f"trace cost model: step {self.index} computes {stats.prefill_tokens} prefill + {stats.decode_seqs} "
                f"decode tokens but the engine's computed {rec.num_prefill_tokens} + {rec.num_decode_tokens}"
            )
        self.index += 1
        return rec.end_s

    def step_time(self, stats: StepStats) -> float:
        rec = self._current()
        return rec.end_s - rec.start_s


def make_cost_model(
    name: str,
    model: ModelConfig | str,
    hardware: str = "h100-sxm",
    dtype: str = "bf16",
    profile: str | Path | None = None,
    prefill_efficiency: float = 1.0,
    decode_efficiency: float = 1.0,
    noise_seed: int | None = None,
) -> CostModel:
    """A cost model by name: ``roofline`` (model on hardware) or ``profiled`` (a profile file; ``noise_seed``
    draws its measured residuals into each step)."""
    if name == "roofline":
        return RooflineCostModel(model, hardware, dtype, prefill_efficiency, decode_efficiency)
    if name == "profiled":
        if profile is None:
            raise ConfigError("cost model 'profiled' needs a profile file (--profile PATH)")
        return ProfiledCostModel.load(profile).with_noise(noise_seed)
    raise ConfigError(f"unknown cost model {name!r}; expected one of {', '.join(COST_MODELS)}")
