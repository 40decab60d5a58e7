"""``ProfiledCostModel``: step time linear in ``FEATURES`` (plus an optional token curve), fitted to the real
engine's steps on this machine (``workbench.sim.fit.fit_profile``, ``workbench fit-profile``), saved to and
loaded from JSON.

The features: a constant, prefill tokens, prefill sequences, prefill attention pairs, decode sequences, decode
context tokens read, decodes attended one sequence at a time. The token curve (the dense layers' time as a
piecewise-linear function of the step's tokens) replaces the constant and per-token term; a constant host gap,
the extra time of a step after an idle wait and the wake-up delay before it complete the model; the measured
residuals can be drawn back in as seeded noise.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError, read_json_file
from workbench.sim.stats import FEATURES, CostModel, StepStats, check_gap

PROFILE_FORMAT = "workbench-profile-v2"
PROFILE_FORMATS = ("workbench-profile-v1", PROFILE_FORMAT)  # v1: no decode_looped_seqs, no batched_decode


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
    ``wake_quantiles_s``: quantiles of the measured wake-up delays; with ``noise_seed`` set each wake is drawn from
    them (its own seeded stream, so the steps' residual draws stay those of a model without them), as a real
    engine's wake has a tail that a constant ``wake_s`` (their median) leaves out; without quantiles, or without
    a seed, every wake is ``wake_s``.
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
    wake_quantiles_s: list[float] = field(default_factory=list)
    name = "profiled"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ConfigError(f"profile: unknown feature(s) {unknown}; expected some of {', '.join(FEATURES)}")
        for key, value in self.coefficients.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"profile: coefficient {key!r} must be a finite number, got {value!r}")
        check_gap(self.host_gap_s)
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
        check_gap(self.idle_step_s, "idle_step_s")
        if self.wake_s is not None:
            check_gap(self.wake_s, "wake_s")
        for w in self.wake_quantiles_s:
            check_gap(w, "profile: each of wake_quantiles_s")
        self.wake_quantiles_s = sorted(float(w) for w in self.wake_quantiles_s)
        if self.wake_quantiles_s and self.wake_s is None:
            raise ConfigError("profile: wake_quantiles_s needs wake_s (the median wake-up delay)")
        self._coef = tuple(float(self.coefficients.get(f, 0.0)) for f in FEATURES)
        # idle tracking: a step starts after an idle wait unless its replica's clock stands at a step's end
        self._track_idle = self.wake_s is not None or self.idle_step_s > 0.0
        self._recent_ends: deque[float] = deque(maxlen=256)
        self._after_idle = False
        # the bulk decode path knows only the summed context, not the longest one the looped rule needs
        self._bulk_decode = self.batched_decode is None or self._coef[6] == 0.0
        self.residual_quantiles_s = sorted(float(x) for x in self.residual_quantiles_s)
        self._rng = self._wake_rng = None
        if self.noise_seed is not None:
            if len(self.residual_quantiles_s) < 2:
                raise ConfigError("profile: noise_seed needs residual_quantiles_s (at least two quantiles)")
            import random

            self._rng = random.Random(self.noise_seed)
            if len(self.wake_quantiles_s) >= 2:
                self._wake_rng = random.Random(f"wake {self.noise_seed}")

    def with_noise(self, seed: int | None) -> ProfiledCostModel:
        """A fresh copy (of this class, its own noise and idle state) that draws its noise with ``seed`` (None:
        deterministic)."""
        return dataclasses.replace(self, noise_seed=seed, coefficients=dict(self.coefficients), meta=dict(self.meta))

    def start_time(self, now: float) -> float:
        if not self._track_idle:
            return now + self.host_gap_s
        self._after_idle = now not in self._recent_ends  # the replica's clock moved to an arrival: it idled
        if self._after_idle and self.wake_s is not None:
            if self._wake_rng is not None:
                return now + _draw(self.wake_quantiles_s, self._wake_rng.random())
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
        """A draw from the residual distribution (its uniform kept as ``last_noise_u``)."""
        u = self.last_noise_u = self._rng.random()  # type: ignore[union-attr]
        return _draw(self.residual_quantiles_s, u)

    def step_time(self, stats: StepStats) -> float:
        if stats.verify_seqs:
            stats = stats.verifies_as_decodes()  # a verify costs what a decode of its k + 1 rows costs
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
            "wake_quantiles_s": self.wake_quantiles_s,
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
                   float(data.get("idle_step_s", 0.0)), data.get("wake_s"),
                   list(data.get("wake_quantiles_s") or []))  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.to_dict()}


def _draw(quantiles: list[float], u: float) -> float:
    """The value at ``u`` in [0, 1) of a distribution given by sorted, equally spaced ``quantiles`` (linear between
    them)."""
    x = u * (len(quantiles) - 1)
    i = int(x)
    return quantiles[i] + (quantiles[i + 1] - quantiles[i]) * (x - i) if i + 1 < len(quantiles) else quantiles[-1]
