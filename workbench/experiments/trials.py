"""Paired, interleaved rounds: the trial harness that decides a timing claim with a confidence interval.

A comparison has two arms, A (the baseline) and B (the treatment): batch 1 against batch 32, static against
continuous batching, unchunked against chunked prefill. ``run_rounds`` runs them in rounds; each round runs every
arm once, in ABBA order (alternating AB and BA, so that a machine whose speed drifts linearly favours neither arm
over a pair of rounds) or in a seeded random order, after ``warmup`` unrecorded rounds. An arm is a callable
``arm(round_index) -> float`` that runs one trial and returns its unit of analysis (a trial's median step time, its
tokens per second, its p99 ITL over enough samples), or a mapping of several such figures of which ``metric``
names the one the rounds are decided on (``Comparison.on`` decides another from the same rounds); the caller makes
each round's workload from the round index (the same seeded workload for every arm within a round). An A/A
control, when asked for, runs A a second time in every round, so the noise floor is measured in the same rounds as
the effect.

The statistic is the paired log-ratio per round, log(B / A); its mean with a Student-t confidence interval gives
"B/A = 0.87 [0.82, 0.92], 12 rounds" (``Comparison``). A ``DecisionRule`` is stated before the rounds run: the
claimed direction (B ``higher`` or ``lower`` than A), a margin delta and a confidence. With L = log(1 + delta):
- the whole interval beyond +L in the claimed direction: *confirmed*;
- the whole interval beyond L the other way: *not_confirmed* (``opposite``);
- the whole interval inside (-L, +L): *not_confirmed* (``equivalent``: no effect as large as the margin);
- otherwise the whole interval below +L in the claimed direction: *not_confirmed* (``short of the margin``: the
  interval excludes the claimed effect, though it reaches beyond -L);
- otherwise more rounds, up to ``max_rounds`` or the time budget, then *inconclusive* with the interval.
The interval is looked at after ``min_rounds`` rounds and then each time the count doubles; each look uses
confidence 1 - (1 - confidence) / looks (Bonferroni), so stopping early cannot raise the chance of a false verdict
above 1 - confidence. ``min_rounds`` may be as low as ``MIN_ROUNDS`` (4: a t interval on 3 degrees of freedom,
with exact quantiles): that first look's interval is wide (at 95% over three looks, t = 4.9 against 3.2 at 6
rounds), so it decides only an effect far from its margin, and a claim near it goes on to 8 rounds and beyond.
A figure with no sampling spread (an analytic model's, a deterministic simulation's) needs no rounds:
``decide_exact`` applies the same rule to its single point. The A/A control *fails* when its interval lies wholly
beyond +-L (the same arm "differs from itself" by more than the margin): the rounds were not comparable to within
the margin. A failed control voids a paired claim (*inconclusive*, ``control_failed``) unless the claim is decided
even with its margin widened by the control's deviation (the far end of the A/A interval, D = max |log A/A|):
an interval beyond L + D in the claimed direction stays *confirmed* (or beyond it the other way, ``opposite``),
since a difference as large as the same arm's against itself cannot account for it (a 7x batching gain is not
voided by a 12% A/A offset); an ``equivalent`` or ``short of the margin`` verdict is always voided (the arms'
noise floor exceeds the margin it would rest on).

References: Kalibera & Jones, "Rigorous benchmarking in reasonable time" (ISMM 2013) for ratio statistics with
intervals; Abedi & Brecht (ICPE 2017) for randomized multiple interleaved trials on cloud machines.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import ConfigError
from workbench.timing import now

CONFIRMED, NOT_CONFIRMED, INCONCLUSIVE = "confirmed", "not_confirmed", "inconclusive"
DIRECTIONS = ("higher", "lower")
ORDERS = ("abba", "random")
# the pre-registered margins of the workbench's claims: a throughput (tokens/s) must move by more than 5%, a latency
# (a TTFT, a p99 ITL, a stall: noisier, tail figures) by more than 10%
THROUGHPUT_MARGIN = 0.05
LATENCY_MARGIN = 0.10
MIN_ROUNDS = 4  # the fewest rounds a t interval is taken on (3 degrees of freedom); the first look's is wide


def _t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with an integer ``df`` >= 1, exactly (Abramowitz & Stegun 26.7.3)."""
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:
        total, term = 0.0, c
        for k in range(1, (df - 1) // 2 + 1):  # cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ... up to cos^(df-2)
            total += term
            term *= c * c * (2 * k) / (2 * k + 1)
        return 2 / math.pi * (theta + s * total)
    total, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):  # 1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2)
        total += term
        term *= c * c * (2 * k - 1) / (2 * k)
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` >= 3 degrees of freedom (no scipy here): for ``df`` < 5 the
    exact distribution (``_t_central``) inverted by bisection; from 5 on the Cornish-Fisher expansion around the
    normal quantile (Abramowitz & Stegun 26.7.5), within 0.5% of the tables up to p = 0.9995."""
    if df < 3:
        raise ConfigError(f"a t interval needs at least 4 rounds (df >= 3), got df {df}")
    if not 0.5 <= p < 1.0:
        raise ConfigError(f"t_quantile takes p in [0.5, 1), got {p}")
    if df < 5:
        target, lo, hi = 2 * p - 1, 0.0, 1.0
        while _t_central(hi, df) < target:
            hi *= 2
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _t_central(mid, df) < target else (lo, mid)
        return (lo + hi) / 2
    z = statistics.NormalDist().inv_cdf(p)
    n = float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / n + g2 / n**2 + g3 / n**3 + g4 / n**4


@dataclass(frozen=True)
class DecisionRule:
    """What a claim says before its rounds run: B is ``higher`` or ``lower`` than A by more than ``margin``
    (relative), decided at ``confidence``."""

    direction: str
    margin: float = 0.05
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if not 0.0 < self.margin < 1.0:
            raise ConfigError(f"margin must be in (0, 1), got {self.margin}")
        if not 0.5 < self.confidence < 1.0:
            raise ConfigError(f"confidence must be in (0.5, 1), got {self.confidence}")


def log_ratio_interval(log_ratios: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """(mean, low, high) of the per-round log-ratios: the mean with its two-sided Student-t interval."""
    n = len(log_ratios)
    mean = statistics.fmean(log_ratios)
    half = t_quantile(0.5 + confidence / 2, n - 1) * statistics.stdev(log_ratios) / math.sqrt(n)
    return mean, mean - half, mean + half


def decide(low: float, high: float, rule: DecisionRule) -> tuple[str, str]:
    """(verdict, reason) of a log-ratio interval [low, high] under ``rule`` (the module docstring's table)."""
    return _decide_at(low, high, rule.direction, math.log1p(rule.margin))


def control_deviation(control: Mapping[str, Any]) -> float:
    """D, how far an A/A control's interval reaches from 1 in log-ratio: max(|log ci_low|, |log ci_high|)."""
    return max(abs(math.log(control["ci_low"])), abs(math.log(control["ci_high"])))


def _despite_failed_control(low: float, high: float, direction: str, bound: float, deviation: float) -> tuple[str, str]:
    """(verdict, reason) of a log-ratio interval when an A/A control failed: decided at the bound widened by the
    control's ``deviation``; only a directional verdict (confirmed, opposite) stands, anything else is voided."""
    verdict, reason = _decide_at(low, high, direction, bound + deviation)
    if verdict == CONFIRMED or reason == "opposite":
        return verdict, reason
    return INCONCLUSIVE, "control_failed: the A/A interval lies beyond the margin"


def _decide_at(low: float, high: float, direction: str, bound: float) -> tuple[str, str]:
    """``decide`` with the margin given as its log-ratio bound L."""
    sign = 1.0 if direction == "higher" else -1.0
    lo, hi = sorted((sign * low, sign * high))  # the claimed direction made positive
    if lo > bound:
        return CONFIRMED, "beyond the margin in the claimed direction"
    if hi < -bound:
        return NOT_CONFIRMED, "opposite"
    if -bound < lo and hi < bound:
        return NOT_CONFIRMED, "equivalent"
    if hi < bound:
        return NOT_CONFIRMED, "short of the margin"
    return INCONCLUSIVE, "the interval straddles the margin"


def decide_exact(value_a: float, value_b: float, rule: DecisionRule) -> tuple[str, str]:
    """(verdict, reason) of B against A when both are exact figures (an analytic model's or a deterministic
    simulation's: no sampling spread, so the interval is the single point B / A): ``decide`` on that point, compared
    in ratio space so that a figure exactly on the margin is not beyond it. Such a figure is always decided:
    *confirmed* when B is beyond A x (1 + margin) in the claimed direction, else *not_confirmed*, ``opposite`` when
    beyond it the other way, ``equivalent`` otherwise. Zero is allowed (a goodput of nothing): B > 0 against A = 0 is
    beyond any margin upwards, both 0 are equivalent."""
    if value_a < 0 or value_b < 0 or math.isnan(value_a) or math.isnan(value_b):
        raise ConfigError(f"exact figures must be >= 0 to compare, got A {value_a}, B {value_b}")
    grow = 1.0 + rule.margin
    up, down = value_b > value_a * grow, value_b * grow < value_a
    if rule.direction == "lower":
        up, down = down, up
    if up:
        return CONFIRMED, "beyond the margin in the claimed direction"
    if down:
        return NOT_CONFIRMED, "opposite"
    return NOT_CONFIRMED, "equivalent"


@dataclass
class Comparison:
    """The outcome of paired rounds: B/A with its interval, the rounds' values and the verdict."""

    arms: tuple[str, str]
    rule: DecisionRule
    ratio: float
    ci_low: float
    ci_high: float
    rounds: int
    verdict: str
    reason: str
    values: dict[str, list[float]] = field(default_factory=dict)
    control: dict[str, Any] | None = None
    look_confidence: float | None = None
    records: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def on(self, metric: str, rule: DecisionRule) -> Comparison:
        """Another figure of the same rounds (arms that returned mappings) decided under ``rule``, at the
        confidence of the look that stopped the rounds (no new look is taken, so no further correction)."""
        if not self.records:
            raise ConfigError("Comparison.on needs arms that return a mapping of figures")
        missing = [name for name, recs in self.records.items() if any(metric not in r for r in recs)]
        if missing:
            raise ConfigError(f"figure {metric!r} is missing from the trials of {missing}")
        values = {name: [float(r[metric]) for r in recs] for name, recs in self.records.items()}
        return _conclude(self.arms, rule, values, self.look_confidence or rule.confidence, self.rounds, self.records)

    def evidence(self) -> dict[str, Any]:
        """The claim's ``evidence`` keys: ratio, ci_low, ci_high, rounds, margin, confidence, control."""
        return {
            "arms": list(self.arms),
            "ratio": self.ratio,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "rounds": self.rounds,
            "margin": self.rule.margin,
            "confidence": self.rule.confidence,
            "direction": self.rule.direction,
            "reason": self.reason,
            "control": self.control,
            "values": {k: [float(f"{x:.6g}") for x in v] for k, v in self.values.items()},
        }

    def row(self) -> dict[str, Any]:
        """One table row: the arms, B/A with its interval, rounds, margin, the A/A ratio and interval, verdict."""
        c = self.control or {}
        return {
            "A": self.arms[0], "B": self.arms[1], "B/A": self.ratio, "CI low": self.ci_low, "CI high": self.ci_high,
            "rounds": self.rounds, "claimed": f"{self.rule.direction} by > {self.rule.margin:.0%}",
            "A/A": c.get("ratio"), "A/A low": c.get("ci_low"), "A/A high": c.get("ci_high"), "verdict": self.verdict,
        }  # fmt: skip

    def summary(self) -> str:
        """'B/A = 0.87 [0.82, 0.92], 12 rounds' with the arms' names."""
        a, b = self.arms
        return f"{b}/{a} = {self.ratio:.3g} [{self.ci_low:.3g}, {self.ci_high:.3g}], {self.rounds} rounds"


@dataclass(frozen=True)
class Rounds:
    """How many paired rounds a trial may take: at least ``min_rounds`` (>= ``MIN_ROUNDS``), at most
    ``max_rounds``, stopping early once the rule decides (Bonferroni-corrected looks) or once ``budget_s`` wall
    seconds are spent; ``warmup`` unrecorded rounds first; an A/A ``control`` in every round unless False. A profile
    sizes these to its time budget (notebooks/pipeline.yaml)."""

    min_rounds: int = 6
    max_rounds: int = 12
    budget_s: float | None = None
    warmup: int = 1
    control: bool = True
    order: str = "abba"
    seed: int = 0

    def __post_init__(self) -> None:
        if not MIN_ROUNDS <= self.min_rounds <= self.max_rounds:
            raise ConfigError(
                f"need {MIN_ROUNDS} <= min_rounds <= max_rounds, got {self.min_rounds}, {self.max_rounds}"
            )
        if self.budget_s is not None and not self.budget_s > 0:
            raise ConfigError(f"budget_s must be > 0 (or None), got {self.budget_s}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")

    def run(
        self, arms: Mapping[str, Callable[[int], Any]], rule: DecisionRule, metric: str | None = None,
        control_arm: Callable[[int], Any] | None = None,
    ) -> Comparison:  # fmt: skip
        """``run_rounds`` of ``arms`` under ``rule`` with these settings (returns its ``Comparison``); the A/A
        control runs ``control_arm`` (a second instance of A, for arms with state such as an engine whose
        sequences grow) when given, else A itself."""
        control = (control_arm or True) if self.control else False
        return run_rounds(
            arms, rule, min_rounds=self.min_rounds, max_rounds=self.max_rounds, warmup=self.warmup, order=self.order,
            control=control, budget_s=self.budget_s, seed=self.seed, metric=metric,
        )  # fmt: skip

    @property
    def max_trials(self) -> int:
        """The most trials one arm can run (warm-up included)."""
        return self.warmup + self.max_rounds


def _round_order(names: list[str], index: int, order: str, rng: random.Random) -> list[str]:
    if order == "abba":
        return names if index % 2 == 0 else names[::-1]
    shuffled = list(names)
    rng.shuffle(shuffled)
    return shuffled


def _looks(min_rounds: int, max_rounds: int) -> list[int]:
    looks, n = [], min_rounds
    while n < max_rounds:
        looks.append(n)
        n *= 2
    return [*looks, max_rounds]


def compare(
    values_a: Sequence[float], values_b: Sequence[float], rule: DecisionRule, confidence: float | None = None
) -> tuple[float, float, float, str, str]:
    """(ratio, ci_low, ci_high, verdict, reason) of paired per-round values of B against A, at ``confidence``
    (the rule's when None)."""
    if len(values_a) != len(values_b):
        raise ConfigError(f"paired rounds need as many A as B values, got {len(values_a)} and {len(values_b)}")
    if any(v <= 0 for v in (*values_a, *values_b)):
        raise ConfigError("trial values must be positive (times, rates) for a log-ratio")
    logs = [math.log(b / a) for a, b in zip(values_a, values_b)]
    mean, low, high = log_ratio_interval(logs, rule.confidence if confidence is None else confidence)
    verdict, reason = decide(low, high, rule)
    return math.exp(mean), math.exp(low), math.exp(high), verdict, reason


def contrast(first: Comparison, second: Comparison, rule: DecisionRule) -> tuple[float, float, float, str, str]:
    """(ratio, ci_low, ci_high, verdict, reason) of ``first``'s effect against ``second``'s: the ratio of their B/A
    ratios (e.g. speculation's speed-up at batch 1 over its speed-up at batch 8), with a Welch t interval over the
    two sets of per-round log-ratios (each set paired within its own rounds; the two comparisons ran at different
    times, so their rounds are not paired with each other; Welch-Satterthwaite degrees of freedom, rounded down), at
    the higher of the two comparisons' look confidences, decided under ``rule``. A failed A/A control of either
    widens the margin by its deviation, as in ``run_rounds``: only a directional verdict beyond that stands."""
    logs = []
    for c in (first, second):
        (a, b) = c.arms
        if len(c.values.get(a, ())) < MIN_ROUNDS or len(c.values[a]) != len(c.values.get(b, ())):
            raise ConfigError(f"contrast needs at least {MIN_ROUNDS} paired rounds of each comparison, got "
                              f"{ {k: len(v) for k, v in c.values.items()} }")  # fmt: skip
        logs.append([math.log(vb / va) for va, vb in zip(c.values[a], c.values[b])])
    (m1, m2), (n1, n2) = (statistics.fmean(x) for x in logs), (len(x) for x in logs)
    w1, w2 = statistics.variance(logs[0]) / n1, statistics.variance(logs[1]) / n2
    se = math.sqrt(w1 + w2)
    df = n1 + n2 - 2
    if se > 0:  # Welch-Satterthwaite, rounded down (the 1e-9 keeps an exact integer from rounding below itself)
        df = max(MIN_ROUNDS - 1, int((w1 + w2) ** 2 / (w1**2 / (n1 - 1) + w2**2 / (n2 - 1)) + 1e-9))
    confidence = max(c.look_confidence or rule.confidence for c in (first, second))
    half = t_quantile(0.5 + confidence / 2, df) * se
    mean = m1 - m2
    bound = math.log1p(rule.margin)
    failed = [c.control for c in (first, second) if c.control and c.control["failed"]]
    if failed:
        deviation = max(control_deviation(c) for c in failed)
        verdict, reason = _despite_failed_control(mean - half, mean + half, rule.direction, bound, deviation)
    else:
        verdict, reason = _decide_at(mean - half, mean + half, rule.direction, bound)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), verdict, reason


def run_rounds(
    arms: Mapping[str, Callable[[int], Any]],
    rule: DecisionRule,
    *,
    min_rounds: int = 6,
    max_rounds: int = 24,
    warmup: int = 1,
    order: str = "abba",
    control: bool | Callable[[int], float] = True,
    budget_s: float | None = None,
    seed: int = 0,
    clock: Callable[[], float] = now,
    metric: str | None = None,
) -> Comparison:
    """Run two arms (the first is A, the second B) in paired rounds until ``rule`` decides or ``max_rounds`` or
    ``budget_s`` (wall seconds on ``clock``, checked between rounds) is spent. The A/A control runs A again in every
    round when ``control`` is True, or the callable given (a second instance of A: a fresh engine, another process);
    it is named A's name + " (A/A)"."""
    if len(arms) != 2:
        raise ConfigError(f"a comparison has two arms (A, B), got {len(arms)}: {list(arms)}")
    if order not in ORDERS:
        raise ConfigError(f"order must be one of {ORDERS}, got {order!r}")
    if not MIN_ROUNDS <= min_rounds <= max_rounds:
        raise ConfigError(f"need {MIN_ROUNDS} <= min_rounds <= max_rounds, got {min_rounds}, {max_rounds}")
    (name_a, fn_a), (name_b, fn_b) = arms.items()
    name_c = f"{name_a} (A/A)"
    fn_c = control if callable(control) else fn_a
    runners = {name_a: fn_a, name_b: fn_b, **({name_c: fn_c} if control is not False else {})}
    rng = random.Random(seed)
    for w in range(warmup):
        for name in _round_order(list(runners), w, order, rng):
            runners[name](-1 - w)
    values: dict[str, list[float]] = {name: [] for name in runners}
    records: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    looks = _looks(min_rounds, max_rounds)
    look_confidence = 1 - (1 - rule.confidence) / len(looks)
    start = clock()
    index = 0
    while True:
        for name in _round_order(list(runners), index, order, rng):
            out = runners[name](index)
            if isinstance(out, Mapping):
                if metric is None or metric not in out:
                    raise ConfigError(f"arm {name!r} returned figures {sorted(out)}; name the one to decide on "
                                      f"with metric= (got {metric!r})")  # fmt: skip
                records[name].append({k: float(v) for k, v in out.items()})
                out = out[metric]
            values[name].append(float(out))
        index += 1
        out_of_time = budget_s is not None and clock() - start >= budget_s
        if index in looks or (out_of_time and index >= min_rounds):
            verdict = compare(values[name_a], values[name_b], rule, look_confidence)[3]
            if verdict != INCONCLUSIVE or index >= max_rounds or out_of_time:
                break
    kept = records if all(len(r) == index for r in records.values()) else {}
    return _conclude((name_a, name_b), rule, values, look_confidence, index, kept)


def _conclude(
    arms: tuple[str, str],
    rule: DecisionRule,
    values: dict[str, list[float]],
    look_confidence: float,
    rounds: int,
    records: dict[str, list[dict[str, float]]],
) -> Comparison:
    """The Comparison of the rounds' ``values`` (A, B and, when present, A's control A/A) at ``look_confidence``."""
    name_a, name_b = arms
    name_c = f"{name_a} (A/A)"
    ratio, low, high, verdict, reason = compare(values[name_a], values[name_b], rule, look_confidence)
    control_record = None
    if name_c in values:
        c_ratio, c_low, c_high, _, _ = compare(values[name_a], values[name_c], rule, look_confidence)
        bound = math.log1p(rule.margin)
        failed = math.log(c_low) > bound or math.log(c_high) < -bound
        control_record = {"ratio": c_ratio, "ci_low": c_low, "ci_high": c_high, "failed": failed}
        if failed:
            deviation = control_deviation(control_record)
            control_record["deviation"] = math.expm1(deviation)
            verdict, reason = _despite_failed_control(math.log(low), math.log(high), rule.direction, bound, deviation)
    return Comparison(
        arms=(name_a, name_b),
        rule=rule,
        ratio=ratio,
        ci_low=low,
        ci_high=high,
        rounds=rounds,
        verdict=verdict,
        reason=reason,
        values=values,
        control=control_record,
        look_confidence=look_confidence,
        records=records,
    )
