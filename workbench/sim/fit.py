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
