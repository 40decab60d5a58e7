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
  attention pairs, decode sequences, decode context tokens read, decodes attended one sequence at a time) plus,
  optionally, a token curve (the dense layers' time as a piecewise-linear function of the step's tokens, which
  replaces the constant and per-token term), a constant host gap, and the extra time of a step after an idle wait
  and the wake-up delay before it; fitted by non-negative least squares to step times the real engine measured on
  this machine (``workbench fit-profile``), saved to and loaded from JSON; optionally with the measured residuals
  drawn back in as seeded noise.
- ``TraceCostModel``: replays the start and end times of a measured ``StepLog`` step by step (and checks that
  each simulated step computes what the measured one did), so the simulator reproduces an engine run exactly.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from workbench.config import ModelConfig
from workbench.errors import ConfigError, read_json_file

if TYPE_CHECKING:
    from workbench.engine.metrics import StepLog, StepRecord
    from workbench.engine.scheduler import StepPlan
    from workbench.roofline import RooflineModel

COST_MODELS = ("roofline", "profiled")
FEATURES = ("const", "prefill_tokens", "prefill_seqs", "prefill_pairs", "decode_seqs", "decode_context",
            "decode_looped_seqs")  # fmt: skip
PROFILE_FORMAT = "workbench-profile-v2"
PROFILE_FORMATS = ("workbench-profile-v1", PROFILE_FORMAT)  # v1: no decode_looped_seqs, no batched_decode


class StepStats(NamedTuple):
    """What a step computes, as the cost models see it."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_pairs: int = 0  # causal (query, key) pairs of the prefill chunks
    prefill_context: int = 0  # cached + new tokens whose K/V the prefill chunks read
    decode_seqs: int = 0
    decode_context: int = 0  # sum of the decodes' context lengths (keys read, the new one included)
    decode_max_context: int = 0  # the longest decode context (0: unknown)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def looped_decodes(self, batched_decode: tuple[int, int] | None) -> int:
        """Decode sequences that attend one at a time: all of them unless the step is decode-only with at least
        ``min_seqs`` sequences and ``num_seqs * longest context <= max_key_slots`` (``batched_decode``, the
        engine's rule for one padded gather); 0 when ``batched_decode`` is None (the distinction is not modelled)."""
        if batched_decode is None or not self.decode_seqs:
            return 0
        min_seqs, max_key_slots = batched_decode
        ds = self.decode_seqs
        batched = not self.prefill_tokens and ds >= min_seqs and 0 < ds * self.decode_max_context <= max_key_slots
        return 0 if batched else ds

    def features(self, batched_decode: tuple[int, int] | None = None) -> tuple[float, ...]:
        """The ``FEATURES`` vector of the profiled model."""
        return (1.0, self.prefill_tokens, self.prefill_seqs, self.prefill_pairs, self.decode_seqs, self.decode_context,
                self.looped_decodes(batched_decode))  # fmt: skip


def plan_stats(plan: StepPlan) -> StepStats:
    """``StepStats`` of a scheduler ``StepPlan`` (chunk ``n`` new tokens after ``start`` computed ones)."""
    pt = ps = pp = pc = ds = dc = dm = 0
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
            dm = max(dm, p + n)
    return StepStats(pt, ps, pp, pc, ds, dc, dm)


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
        pt, ps, pp, pc, ds, dc = stats[:6]
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

    ``batched_decode``: the engine's (min_seqs, max_key_slots) rule for attending a decode-only step's sequences in
    one padded gather rather than one at a time (``workbench.model.attention``); the ``decode_looped_seqs`` feature
    counts the decodes of the other steps, which pay a per-sequence, per-layer host overhead. None: not modelled.
    ``token_curve``: (tokens, seconds) knots of a piecewise-linear time in the step's tokens (prefill + decode),
    added to the linear part (``curve_time``); the fit then leaves ``const`` and ``prefill_tokens`` at zero.
    ``idle_step_s``: extra time of a step that starts after the replica idled (no step ended at the clock);
    ``wake_s``: the delay from the arrival to such a step's start (``host_gap_s`` when None). The idle
    rule keeps a short memory of step ends, so a model shared by replicas tells each one's idle waits apart.
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
    batched_decode: tuple[int, int] | None = None
    token_curve: tuple[list[int], list[float]] | None = None
    idle_step_s: float = 0.0
    wake_s: float | None = None
    name = "profiled"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ConfigError(f"profile: unknown feature(s) {unknown}; expected some of {', '.join(FEATURES)}")
        for key, value in self.coefficients.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"profile: coefficient {key!r} must be a finite number, got {value!r}")
        _check_gap(self.host_gap_s)
        if self.batched_decode is not None:
            bd = tuple(self.batched_decode)
            if len(bd) != 2 or not all(isinstance(x, int) and x >= 0 for x in bd):
                raise ConfigError(f"profile: batched_decode must be two integers >= 0 (min_seqs, max_key_slots), "
                                  f"got {self.batched_decode!r}")  # fmt: skip
            self.batched_decode = (int(bd[0]), int(bd[1]))
        if self.token_curve is not None:
            knots, secs = (list(v) for v in self.token_curve)
            ok = len(knots) == len(secs) > 0 and all(isinstance(k, int) and k >= 1 for k in knots)
            ok = ok and all(a < b for a, b in zip(knots, knots[1:]))
            if not ok or not all(isinstance(v, (int, float)) and v >= 0 and math.isfinite(v) for v in secs):
                raise ConfigError("profile: token_curve must be (tokens, seconds): increasing integers >= 1 and as "
                                  f"many finite seconds >= 0; got {self.token_curve!r}")  # fmt: skip
            self.token_curve = (knots, [float(v) for v in secs])
        _check_gap(self.idle_step_s)
        if self.wake_s is not None:
            _check_gap(self.wake_s)
        self._coef = tuple(float(self.coefficients.get(f, 0.0)) for f in FEATURES)
        # idle tracking: a step starts after an idle wait unless its replica's clock stands at a step's end
        self._track_idle = self.wake_s is not None or self.idle_step_s > 0.0
        self._recent_ends: deque[float] = deque(maxlen=256)
        self._after_idle = False
        # the bulk decode path knows only the summed context, not the longest one the looped rule needs
        self._bulk_decode = self.batched_decode is None or self._coef[6] == 0.0
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
                                 list(self.residual_quantiles_s), seed, self.batched_decode,
                                 self.token_curve, self.idle_step_s, self.wake_s)  # fmt: skip

    def start_time(self, now: float) -> float:
        if not self._track_idle:
            return now + self.host_gap_s
        self._after_idle = now not in self._recent_ends  # the replica's clock moved to an arrival: it idled
        if self._after_idle and self.wake_s is not None:
            return now + self.wake_s
        return now + self.host_gap_s

    def end_time(self, start: float, stats: StepStats) -> float:
        end = start + self.step_time(stats)
        if self._track_idle:
            if self._after_idle:
                end += self.idle_step_s
                self._after_idle = False
            self._recent_ends.append(end)
        return end

    def curve_time(self, num_tokens: int) -> float:
        """The token curve at ``num_tokens`` (0 without a curve): linear between knots, the first knot's value
        below it, proportional to the tokens past the last (dense layers at large batches are compute-bound)."""
        if self.token_curve is None or num_tokens <= 0:
            return 0.0
        knots, secs = self.token_curve
        if num_tokens <= knots[0]:
            return secs[0]
        if num_tokens >= knots[-1]:
            return secs[-1] * num_tokens / knots[-1]
        i = bisect.bisect_right(knots, num_tokens)
        f = (num_tokens - knots[i - 1]) / (knots[i] - knots[i - 1])
        return secs[i - 1] + f * (secs[i] - secs[i - 1])

    def _residual(self) -> float:
        """A draw from the residual distribution (linear between the stored quantiles)."""
        q = self.residual_quantiles_s
        u = self._rng.random() * (len(q) - 1)  # type: ignore[union-attr]
        i = int(u)
        return q[i] + (q[i + 1] - q[i]) * (u - i) if i + 1 < len(q) else q[-1]

    def step_time(self, stats: StepStats) -> float:
        c = self._coef
        t = c[0] + c[1] * stats[0] + c[2] * stats[1] + c[3] * stats[2] + c[4] * stats[4] + c[5] * stats[5]
        if c[6]:
            t += c[6] * stats.looped_decodes(self.batched_decode)
        if self.token_curve is not None:
            t += self.curve_time(stats[0] + stats[4])
        if self._rng is not None:
            t = max(t + self._residual(), 0.1 * t)
        return max(0.0, t)

    def decode_run(
        self, now: float, num_seqs: int, context: int, max_steps: int, before: float
    ) -> tuple[list[float], list[float]]:
        if not self._bulk_decode:
            return [], []  # no bulk run: the simulator schedules each step (with its longest context) itself
        c = self._coef
        base = c[0] + (c[4] + c[6]) * num_seqs + self.curve_time(num_seqs)
        per_ctx, gap = c[5], self.host_gap_s
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
        if self._track_idle and ends:
            self._after_idle = False
            self._recent_ends.append(ends[-1])
        return starts, ends

    # ---- persistence ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        bd = self.batched_decode
        return {
            "format": PROFILE_FORMAT,
            "coefficients": {f: float(self.coefficients.get(f, 0.0)) for f in FEATURES},
            "host_gap_s": self.host_gap_s,
            "batched_decode": None if bd is None else {"min_seqs": bd[0], "max_key_slots": bd[1]},
            "token_curve": None if self.token_curve is None else dict(zip(("tokens", "seconds"), self.token_curve)),
            "idle_step_s": self.idle_step_s,
            "wake_s": self.wake_s,
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
        """Read a profile written by ``save`` (v1 or v2; ConfigError naming the file when it is missing or
        malformed)."""
        path = Path(path)
        data = read_json_file(path, "profile file", " (make one with `workbench fit-profile`)")
        if not isinstance(data, dict) or data.get("format") not in PROFILE_FORMATS:
            raise ConfigError(f'{path}: not a workbench profile (expected "format": "{PROFILE_FORMAT}")')
        bd = data.get("batched_decode")
        try:
            batched = None if bd is None else (bd["min_seqs"], bd["max_key_slots"])
        except (TypeError, KeyError):
            raise ConfigError(f'{path}: "batched_decode" must be null or {{"min_seqs": N, "max_key_slots": N}}, '
                              f"got {bd!r}") from None  # fmt: skip
        tc = data.get("token_curve")
        try:
            curve = None if tc is None else (tc["tokens"], tc["seconds"])
        except (TypeError, KeyError):
            raise ConfigError(f'{path}: "token_curve" must be null or {{"tokens": [...], "seconds": [...]}}, '
                              f"got {tc!r}") from None  # fmt: skip
        return cls(dict(data["coefficients"]), float(data.get("host_gap_s", 0.0)), dict(data.get("meta", {})),
                   list(data.get("residual_quantiles_s", [])), None, batched, curve,
                   float(data.get("idle_step_s", 0.0)), data.get("wake_s"))  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.to_dict()}


def _nnls(x: Any, y: Any, free: int = 1) -> Any:
    """Least squares ``min |x c - y|`` with ``c >= 0`` except the first ``free`` columns, exactly: the optimum is
    the unconstrained least-squares solution on its support, so it is the best feasible one over all subsets of
    the constrained columns (2^k small solves; k <= 7 here)."""
    import itertools

    import numpy as np

    k = x.shape[1]
    best_r, best = math.inf, np.zeros(k)
    for size in range(k - free + 1):
        for subset in itertools.combinations(range(free, k), size):
            cols = list(range(free)) + list(subset)
            if not cols:
                continue
            c, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (c[free:] < 0).any():
                continue
            r = float(np.sum((x[:, cols] @ c - y) ** 2))
            if r < best_r:
                best_r, best = r, np.zeros(k)
                best[cols] = c
    return best


def _hat_weights(knots: list[int], num_tokens: Any) -> Any:
    """(len(num_tokens), len(knots)) weights of each knot's value in ``curve_time`` (the hat-function basis)."""
    import numpy as np

    t = np.asarray(num_tokens, dtype=np.float64)
    k = np.asarray(knots, dtype=np.float64)
    w = np.zeros((len(t), len(k)))
    rows = np.arange(len(t))
    w[rows[t <= k[0]], 0] = 1.0
    top = t >= k[-1]
    w[rows[top], len(k) - 1] = t[top] / k[-1]
    mid = (t > k[0]) & ~top
    i = np.searchsorted(k, t[mid], side="right")
    f = (t[mid] - k[i - 1]) / (k[i] - k[i - 1])
    w[rows[mid], i - 1] = 1.0 - f
    w[rows[mid], i] = f
    return w


def token_knots(num_tokens: list[int], dense_until: int = 16, ratio: float = 1.5, min_steps: int = 5) -> list[int]:
    """Knots of a token curve for steps of ``num_tokens`` tokens: every count up to ``dense_until`` (decode batch
    sizes, where a BLAS library switches kernels from one size to the next), then a geometric grid of ``ratio`` up to
    the largest; a knot keeps its own value only where at least ``min_steps`` steps lie between its neighbours."""
    top = max(num_tokens)
    cand = set(range(1, min(dense_until, top) + 1))
    k = float(dense_until)
    while k < top:
        k *= ratio
        cand.add(min(int(round(k)), top))
    knots = sorted(cand)
    while len(knots) > 1:
        counts = [sum(1 for t in num_tokens if (knots[j - 1] if j else 0) < t < (knots[j + 1] if j + 1 < len(knots)
                      else math.inf)) for j in range(len(knots))]  # fmt: skip
        weakest = min(range(len(knots)), key=lambda j: counts[j])
        if counts[weakest] >= min_steps:
            break
        del knots[weakest]
    return knots


def _nnls_active_set(a: Any, b: Any, tol: float = 1e-12) -> Any:
    """``min |a x - b|`` with ``x >= 0`` (Lawson and Hanson's active-set method, exact for a full-rank ``a``)."""
    import numpy as np

    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n):
        if passive.all() or w[~passive].max() <= tol * max(1.0, np.abs(w).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive], *_ = np.linalg.lstsq(a[:, passive], b, rcond=None)
            if (z[passive] > 0).all():
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
        w = a.T @ (b - a @ x)
    return x


# the linear terms beside a token curve (decode_seqs: what a decode costs beyond a prefill token's dense layers)
CURVE_FEATURES = ("prefill_seqs", "prefill_pairs", "decode_seqs", "decode_context", "decode_looped_seqs")


def fit_profile(
    stats: list[StepStats],
    durations_s: list[float],
    gaps_s: list[float] | None = None,
    meta: dict | None = None,
    outlier_ratio: float = 2.0,
    batched_decode: tuple[int, int] | None = None,
    knots: list[int] | None = None,
    after_idle: list[bool] | None = None,
    wakes_s: list[float] | None = None,
    monotone_from: int = 16,
) -> ProfiledCostModel:
    """Non-negative least-squares fit of step time to measured step durations (relative error weighted, so short
    decode steps count as much as long prefills). No coefficient may be negative (but ``const`` in the linear form):
    a step never gets cheaper with more work, and the constraint keeps collinear features from cancelling.

    Without ``knots`` the model is linear in ``FEATURES``. With ``knots`` the constant and the per-token term
    (``const``, ``prefill_tokens``) become a token curve: the time of a step's dense layers as a piecewise-linear
    function of its tokens (prefill + decode), one value per knot (``token_knots``), since a CPU BLAS library is
    not linear in the batch (16 rows can run faster than 12); from the knot ``monotone_from`` on the curve may only
    rise (a prefill of more tokens never computes faster; the fit solves for its non-negative increments there).
    The attention and per-sequence terms ``CURVE_FEATURES`` stay linear.

    Steps measured at more than ``outlier_ratio`` times the first fit's prediction (the process descheduled by
    others on a shared machine) are left out of a second fit. ``host_gap_s`` is the median of ``gaps_s``.
    ``batched_decode``: the engine's padded-gather rule (``ProfiledCostModel``); None: no ``decode_looped_seqs``.
    ``after_idle``: per step, whether the engine idled (slept until an arrival) before it; such steps (cold caches,
    the arrivals' admission) are left out of the fit and their median excess over it is ``idle_step_s``.
    ``wake_s`` is the median of ``wakes_s`` (from an arrival to the step that serves it on an idle engine: the
    sleep's overshoot); None without them."""
    import numpy as np

    if len(stats) != len(durations_s) or not stats:
        raise ConfigError(f"fit_profile needs as many step stats as durations, and some: {len(stats)} vs "
                          f"{len(durations_s)}")  # fmt: skip
    feats = np.asarray([s.features(batched_decode) for s in stats], dtype=np.float64)
    y_all = np.asarray(durations_s, dtype=np.float64)
    if knots is None:
        x_all = feats
        active = [0] + [j for j in range(1, len(FEATURES)) if np.any(x_all[:, j] != 0)]  # const first, free
    else:
        if not knots or any(a >= b for a, b in zip(knots, knots[1:])) or knots[0] < 1:
            raise ConfigError(f"fit_profile: knots must be increasing integers >= 1, got {knots!r}")
        cols = [FEATURES.index(f) for f in CURVE_FEATURES]
        tokens = [s.prefill_tokens + s.decode_seqs for s in stats]
        hats = _hat_weights(knots, tokens)  # (steps, knots)
        rising = next((i for i, k in enumerate(knots) if k >= monotone_from), len(knots))
        # from knot `rising` on, value_j = value_rising + sum of increments up to j: column i sums the hats j >= i
        hats[:, rising:] = np.cumsum(hats[:, rising:][:, ::-1], axis=1)[:, ::-1]
        x_all = np.hstack([feats[:, cols], hats])
        active = [j for j in range(x_all.shape[1]) if np.any(x_all[:, j] != 0)]
    idle = np.zeros(len(stats), dtype=bool)
    if after_idle is not None:
        if len(after_idle) != len(stats):
            raise ConfigError(f"fit_profile: after_idle has {len(after_idle)} entries for {len(stats)} steps")
        idle = np.asarray(after_idle, dtype=bool)
        if idle.all():
            idle[:] = False  # nothing else to fit to

    def solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        w = 1.0 / np.maximum(y, 1e-9)
        coef = np.zeros(x.shape[1])
        if knots is None:
            coef[active] = _nnls(x[:, active] * w[:, None], y * w)
        else:
            coef[active] = _nnls_active_set(x[:, active] * w[:, None], y * w)
        return coef

    # the steps after an idle wait are left out of the fit; their median excess over it is idle_step_s
    busy = ~idle
    x_busy, y_busy = x_all[busy], y_all[busy]
    coef = solve(x_busy, y_busy)
    keep = y_busy <= outlier_ratio * np.maximum(x_busy @ coef, 1e-12)
    if keep.sum() >= x_all.shape[1] and not keep.all():
        coef = solve(x_busy[keep], y_busy[keep])
    step_coef = coef
    idle_step_s = float(np.median(y_all[idle] - x_all[idle] @ coef)) if idle.any() else 0.0
    if knots is None:
        coefficients = {f: float(c) for f, c in zip(FEATURES, step_coef)}
        curve = None
    else:
        coefficients = {f: 0.0 for f in FEATURES}
        coefficients.update({f: float(c) for f, c in zip(CURVE_FEATURES, step_coef)})
        values = np.array(step_coef[len(CURVE_FEATURES) :])
        values[rising:] = np.cumsum(values[rising:])
        curve = (list(knots), [float(v) for v in values])
    fitted = x_all @ coef + idle * max(idle_step_s, 0.0)
    rel = np.abs(fitted - y_all) / y_all
    info = {"method": "nnls" if knots is None else "nnls-token-curve", "num_steps": len(stats),
            "num_idle_steps": int(idle.sum()), "num_outliers": int((~keep).sum()),
            "median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90))}  # fmt: skip
    gap = float(np.median(gaps_s)) if gaps_s else 0.0
    residuals = np.quantile(y_busy - x_busy @ coef, np.linspace(0.0, 1.0, 101)).tolist()
    wake = float(np.median(wakes_s)) if wakes_s else None
    return ProfiledCostModel(coefficients, max(gap, 0.0), {**(meta or {}), "fit": info}, residuals, None,
                             batched_decode, curve, max(idle_step_s, 0.0), wake)  # fmt: skip


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
