"""Fitting ``ProfiledCostModel`` to measured steps: one non-negative least-squares solver, the token-curve basis.

``nnls`` is Lawson and Hanson's active-set method (the one solver of the simulator; scipy's ``nnls`` is the same
algorithm, but scipy is not a dependency here); unconstrained columns (the linear form's constant) are split into
a non-negative pair.
"""

from __future__ import annotations

import math
from typing import Any

from workbench.errors import ConfigError
from workbench.sim.profiled import ProfiledCostModel
from workbench.sim.stats import FEATURES, StepStats


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


def _segments(knots: list[int], breaks: tuple[int, ...]) -> list[tuple[int, int]]:
    """Index ranges [a, b) of ``knots`` between consecutive ``breaks`` (a break starts the segment of the knots at
    and above it)."""
    starts = sorted({0} | {i for i, k in enumerate(knots) if k in set(breaks) or
                           any(knots[i - 1] < b <= k for b in breaks if i)})  # fmt: skip
    return [(a, b) for a, b in zip(starts, starts[1:] + [len(knots)])]


def _curve_values(increments: Any, segments: list[tuple[int, int]]) -> Any:
    """The knots' values from a segment's first value and its increments (``fit_profile``'s parameterisation)."""
    import numpy as np

    values = np.array(increments, dtype=np.float64)
    for a, b in segments:
        values[a:b] = np.cumsum(values[a:b])
    return values


# the coefficients physics says are positive: attention work and the looped decodes' per-sequence host overhead
POSITIVE_FEATURES = ("prefill_pairs", "decode_context", "decode_looped_seqs")
MAX_CLASS_BIAS = 0.10  # a kind of step the fit prices more than 10% off (median signed error): a warning


def step_kind(stats: StepStats) -> str:
    """ "decode" (decodes only), "prefill" (prefill chunks only) or "mixed"."""
    if not stats.prefill_tokens:
        return "decode"
    return "mixed" if stats.decode_seqs else "prefill"


def fit_quality(
    all_stats: list[StepStats],
    measured_s: Any,
    fitted_s: Any,
    coefficients: dict[str, float],
    batched_decode: tuple[int, int] | None,
    fitted_stats: list[StepStats],
    keep: Any,
) -> list[str]:
    """Warnings about a fit (empty: none): a kind of step (``step_kind``) whose median signed error exceeds
    ``MAX_CLASS_BIAS`` (the fit would price that kind of step systematically off, as a simulated policy that runs
    many of them), and a ``POSITIVE_FEATURES`` coefficient at its bound 0 although its feature varies in the steps
    (its cost then sits in other terms, which carry it only as far as the training steps' mix does)."""
    import numpy as np

    steps = [s for s, k in zip(fitted_stats, keep) if k]
    warnings = []
    rel = (np.asarray(fitted_s) - np.asarray(measured_s)) / np.asarray(measured_s)
    for kind in ("decode", "prefill", "mixed"):
        mask = np.asarray([step_kind(s) == kind for s in steps], dtype=bool)
        if mask.sum() >= 5:
            bias = float(np.median(rel[mask]))
            if abs(bias) > MAX_CLASS_BIAS:
                warnings.append(f"{kind} steps ({int(mask.sum())}) fitted {100 * bias:+.1f}% off (median)")
    for name in POSITIVE_FEATURES:
        j = FEATURES.index(name)
        varies = len({s.features(batched_decode)[j] for s in all_stats}) > 1
        if varies and coefficients.get(name, 0.0) <= 0.0:
            warnings.append(f"{name} fitted at its bound 0 although the steps vary in it: its cost sits in other "
                            "terms (collinear features; measure steps that vary it alone)")  # fmt: skip
    return warnings


def nnls(a: Any, b: Any, free: int = 0, tol: float = 1e-12) -> Any:
    """``min |a x - b|`` with ``x[free:] >= 0`` (the first ``free`` columns unconstrained, each split into a
    non-negative pair ``x+ - x-``): Lawson and Hanson's active-set method, exact for a full-rank ``a``."""
    import numpy as np

    if free:
        x = nnls(np.hstack([a[:, :free], -a[:, :free], a[:, free:]]), b, 0, tol)
        return np.concatenate([x[:free] - x[free : 2 * free], x[2 * free :]])
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
    kernel_breaks: tuple[int, ...] = (),
    bootstrap: int = 50,
    seed: int = 0,
) -> ProfiledCostModel:
    """Non-negative least-squares fit of step time to measured step durations (relative error weighted, so short
    decode steps count as much as long prefills). No coefficient may be negative (but ``const`` in the linear form):
    a step never gets cheaper with more work, and the constraint keeps collinear features from cancelling.

    Without ``knots`` the model is linear in ``FEATURES``. With ``knots`` the constant and the per-token term
    (``const``, ``prefill_tokens``) become a token curve: the time of a step's dense layers as a piecewise-linear
    function of its tokens (prefill + decode), one value per knot (``token_knots``), since a CPU BLAS library is
    not linear in the batch. The curve may only rise (more rows never compute faster on one kernel: the fit solves
    for a non-negative first value and non-negative increments) except at ``kernel_breaks``, the token counts where
    the engine switches to another kernel (the CPU engine's packed linears from ``PACKED_MIN_ROWS`` rows on, in a
    model with weights large enough to pack: on an EPYC 3 rows on the plain path took 3x as long as 4 packed ones
    when every weight was packed); each break starts a new rising segment.
    The attention and per-sequence terms ``CURVE_FEATURES`` stay linear.

    ``bootstrap``: refits on that many resamples (with replacement, ``seed``) of the fitted steps; ``fit`` in the
    meta then holds each coefficient's (and each knot's) 5th, 50th and 95th percentile (``coefficient_ci``,
    ``token_curve_ci``). ``fit_quality`` checks the fit and its ``warnings`` are kept in ``fit``.

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
        segments = _segments(knots, kernel_breaks)
        # within a segment [a, b), value_j = value_a + the increments up to j: column i sums the hats a <= i <= j < b
        for a, b in segments:
            hats[:, a:b] = np.cumsum(hats[:, a:b][:, ::-1], axis=1)[:, ::-1]
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
        # the linear form's constant (column 0) may be negative; the token curve has no free column
        coef[active] = nnls(x[:, active] * w[:, None], y * w, free=1 if knots is None else 0)
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
        values = _curve_values(step_coef[len(CURVE_FEATURES) :], segments)
        curve = (list(knots), [float(v) for v in values])
    fitted = x_all @ coef + idle * max(idle_step_s, 0.0)
    rel = np.abs(fitted - y_all) / y_all
    info = {"method": "nnls" if knots is None else "nnls-token-curve", "num_steps": len(stats),
            "num_idle_steps": int(idle.sum()), "num_outliers": int((~keep).sum()),
            "median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90))}  # fmt: skip
    fitted_rows = np.flatnonzero(busy)[keep]
    if bootstrap > 0 and len(fitted_rows) > 1:
        rng = np.random.default_rng(seed)
        draws = []
        for _ in range(bootstrap):
            pick = rng.choice(fitted_rows, size=len(fitted_rows), replace=True)
            draws.append(solve(x_all[pick], y_all[pick]))
        d = np.asarray(draws)
        q = np.percentile(d, [5.0, 50.0, 95.0], axis=0)  # (3, columns)
        names = list(FEATURES) if knots is None else list(CURVE_FEATURES)
        info["bootstrap"] = bootstrap
        info["coefficient_ci"] = {f: [float(v) for v in q[:, j]] for j, f in enumerate(names)}
        if knots is not None:
            curves = np.asarray([_curve_values(c[len(CURVE_FEATURES) :], segments) for c in d])
            info["token_curve_ci"] = np.percentile(curves, [5.0, 50.0, 95.0], axis=0).T.tolist()
    info["warnings"] = fit_quality(stats, y_all[busy][keep], fitted[busy][keep], coefficients, batched_decode,
                                   [s for s, b in zip(stats, busy) if b], keep)  # fmt: skip
    gap = float(np.median(gaps_s)) if gaps_s else 0.0
    residuals = np.quantile(y_busy - x_busy @ coef, np.linspace(0.0, 1.0, 101)).tolist()
    wake = float(np.median(wakes_s)) if wakes_s else None
    return ProfiledCostModel(coefficients, max(gap, 0.0), {**(meta or {}), "fit": info}, residuals, None,
                             batched_decode, curve, max(idle_step_s, 0.0), wake)  # fmt: skip
