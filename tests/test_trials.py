"""The trial harness (workbench/experiments/trials.py) on a synthetic machine with a virtual clock: a true effect
under drift and noise is confirmed, no effect is (almost) never confirmed, a small effect is called equivalent, and a
failed A/A control voids a verdict it could account for. Pure Python: no engine, no wall time."""

import math
import random

import pytest

from workbench.errors import ConfigError
from workbench.experiments.trials import (
    CONFIRMED,
    INCONCLUSIVE,
    NOT_CONFIRMED,
    Comparison,
    DecisionRule,
    compare,
    contrast,
    decide,
    decide_exact,
    run_rounds,
    t_quantile,
)


class SyntheticMachine:
    """Every trial costs one virtual second; the machine's speed drifts linearly by ``drift`` over ``span`` trials
    (50%: the last trials of the span take 1.5x as long), and each trial carries lognormal noise of ``noise``."""

    def __init__(self, seed: int, drift: float = 0.5, noise: float = 0.15, span: int = 300):
        self.rng = random.Random(seed)
        self.drift, self.noise, self.span = drift, noise, span
        self.t = 0.0

    def clock(self) -> float:
        return self.t

    def arm(self, true_time_s: float):
        def run(_round: int) -> float:
            slow = 1.0 + self.drift * min(self.t / self.span, 1.0)
            self.t += 1.0
            return true_time_s * slow * math.exp(self.rng.gauss(0.0, self.noise))

        return run


# Student-t quantiles from the printed tables (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2)
T_TABLE = [
    (0.975, 5, 2.571),
    (0.975, 10, 2.228),
    (0.975, 30, 2.042),
    (0.995, 10, 3.169),
    (0.999, 5, 5.893),
    (0.975, 3, 3.182),
    (0.975, 4, 2.776),
    (0.995, 3, 5.841),
    (0.995, 4, 4.604),
    (0.999, 3, 10.215),
    (0.9995, 4, 8.610),
]


@pytest.mark.parametrize("p, df, expected", T_TABLE)
def test_t_quantile_matches_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, rel=5e-3)


def test_t_quantile_refuses_fewer_than_three_degrees_of_freedom():
    with pytest.raises(ConfigError, match="at least 4 rounds"):
        t_quantile(0.975, 2)


def test_a_large_effect_is_decided_at_a_first_look_of_four_rounds():
    m = SyntheticMachine(3, noise=0.05)
    c = run_rounds({"unchunked": m.arm(1.0), "chunked": m.arm(0.5)}, DecisionRule("lower", 0.1), min_rounds=4,
                   max_rounds=12, clock=m.clock)  # fmt: skip
    assert c.verdict == CONFIRMED and c.rounds == 4 and c.look_confidence == pytest.approx(1 - 0.05 / 3)


def test_decide_by_hand():
    higher = DecisionRule("higher", margin=0.05)
    L = math.log(1.05)
    assert decide(L + 0.01, L + 0.2, higher) == (CONFIRMED, "beyond the margin in the claimed direction")
    assert decide(-0.3, -L - 0.01, higher) == (NOT_CONFIRMED, "opposite")
    assert decide(-L + 0.01, L - 0.01, higher) == (NOT_CONFIRMED, "equivalent")
    assert decide(0.0, L + 0.1, higher)[0] == INCONCLUSIVE
    assert decide(-L - 0.05, L - 0.01, higher) == (NOT_CONFIRMED, "short of the margin")  # reaches past -L, not +L
    assert decide(-L - 0.05, L + 0.01, higher)[0] == INCONCLUSIVE
    lower = DecisionRule("lower", margin=0.05)
    assert decide(-0.3, -L - 0.01, lower)[0] == CONFIRMED
    assert decide(L + 0.01, 0.3, lower) == (NOT_CONFIRMED, "opposite")
    assert decide(-L + 0.01, L + 0.05, lower) == (NOT_CONFIRMED, "short of the margin")


def test_exact_figures_are_always_decided():
    # an analytic or deterministic figure has no spread: the interval is one point, so never "inconclusive"
    higher, lower = DecisionRule("higher", margin=0.10), DecisionRule("lower", margin=0.10)
    assert decide_exact(4.0, 4.41, higher) == (CONFIRMED, "beyond the margin in the claimed direction")  # +10.25%
    assert decide_exact(4.0, 4.39, higher) == (NOT_CONFIRMED, "equivalent")  # +9.75%
    assert decide_exact(4.0, 3.0, higher) == (NOT_CONFIRMED, "opposite")
    assert decide_exact(4.0, 3.0, lower)[0] == CONFIRMED  # 3/4 < 1/1.1
    assert decide_exact(4.0, 3.7, lower) == (NOT_CONFIRMED, "equivalent")  # 0.925 > 1/1.1 = 0.909
    assert decide_exact(0.0, 0.5, higher)[0] == CONFIRMED and decide_exact(0.5, 0.0, higher)[1] == "opposite"
    assert decide_exact(0.0, 0.0, higher) == (NOT_CONFIRMED, "equivalent")
    # exactly on the margin is not beyond it (log(1.1 / 1.0) exceeds log1p(0.1) by one rounding step)
    assert decide_exact(1.0, 1.1, higher) == (NOT_CONFIRMED, "equivalent")
    assert decide_exact(1.1, 1.0, lower) == (NOT_CONFIRMED, "equivalent")
    with pytest.raises(ConfigError, match="must be >= 0"):
        decide_exact(-1.0, 1.0, higher)


def test_compare_by_hand():
    # log-ratios log(2) each round up to a spread: B/A = 2 exactly in the middle
    a = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    b = [2.0 * math.exp(d) for d in (0.01, -0.01, 0.02, -0.02, 0.0, 0.0)]
    ratio, low, high, verdict, _ = compare(a, b, DecisionRule("higher"))
    sd = math.sqrt((2 * 0.01**2 + 2 * 0.02**2) / 5)
    half = 2.571 * sd / math.sqrt(6)
    assert ratio == pytest.approx(2.0)
    assert math.log(high / ratio) == pytest.approx(half, rel=5e-3)
    assert math.log(ratio / low) == pytest.approx(half, rel=5e-3)
    assert verdict == CONFIRMED


def _run(machine: SyntheticMachine, effect: float, rule: DecisionRule, **kw):
    # B's time is A's divided by ``effect``: a claim "B is faster" is a claim that B's rate (1/time) is higher
    time_a, time_b = machine.arm(1.0), machine.arm(1.0 / effect)
    rate_arms = {"A": lambda i: 1.0 / time_a(i), "B": lambda i: 1.0 / time_b(i)}
    return run_rounds(rate_arms, rule, clock=machine.clock, **kw)


@pytest.mark.parametrize("seed", range(10))
def test_a_ten_percent_effect_under_drift_and_noise_is_confirmed(seed):
    c = _run(SyntheticMachine(seed), 1.10, DecisionRule("higher", margin=0.05), max_rounds=400, seed=seed)
    assert c.verdict == CONFIRMED, c.summary()
    assert c.ci_low > 1.05 and c.ci_low < 1.10 < c.ci_high
    assert c.control is not None and not c.control["failed"]


def test_no_effect_under_drift_is_confirmed_at_most_five_percent_of_the_time():
    confirmed = 0
    for seed in range(200):
        c = _run(SyntheticMachine(1000 + seed), 1.0, DecisionRule("higher", margin=0.05), max_rounds=96, seed=seed)
        confirmed += c.verdict == CONFIRMED
    assert confirmed <= 10  # 5% of 200


def test_a_first_look_at_four_rounds_keeps_the_false_verdicts_under_five_percent():
    # the A/A case with the smallest first look: a wide t interval on 3 degrees of freedom, then 8 and 16 rounds
    wrong = 0
    for seed in range(200):
        c = _run(SyntheticMachine(2000 + seed), 1.0, DecisionRule("higher", margin=0.05), min_rounds=4,
                 max_rounds=16, seed=seed)  # fmt: skip
        wrong += c.verdict == CONFIRMED
    assert wrong <= 10  # 5% of 200


def test_a_two_percent_effect_with_a_five_percent_margin_is_equivalent():
    c = _run(SyntheticMachine(7, noise=0.03), 1.02, DecisionRule("higher", margin=0.05), max_rounds=200)
    assert (c.verdict, c.reason) == (NOT_CONFIRMED, "equivalent"), c.summary()


def test_a_lower_claim_on_times():
    m = SyntheticMachine(3, noise=0.05)
    c = run_rounds({"unchunked": m.arm(1.0), "chunked": m.arm(0.5)}, DecisionRule("lower", 0.1), clock=m.clock)
    assert c.verdict == CONFIRMED and c.ratio == pytest.approx(0.5, rel=0.05)
    assert c.rounds == 6  # decided at the first look
    assert len(c.values["unchunked"]) == len(c.values["chunked"]) == len(c.values["unchunked (A/A)"]) == 6


def test_a_failed_control_voids_an_effect_it_could_account_for():
    m = SyntheticMachine(5, noise=0.02, drift=0.0)
    # the second instance of A is 30% slower: A and A were not comparable to within 30%, and B is only 20% faster
    c = run_rounds({"A": m.arm(1.0), "B": m.arm(0.8)}, DecisionRule("lower", 0.05), control=m.arm(1.3), clock=m.clock)
    assert c.control["failed"] and c.control["ratio"] == pytest.approx(1.3, rel=0.05)
    assert c.verdict == INCONCLUSIVE and c.reason.startswith("control_failed")


def test_a_failed_control_keeps_an_effect_beyond_the_margin_plus_its_deviation():
    m = SyntheticMachine(5, noise=0.02, drift=0.0)
    # the same 30% A/A offset, and B takes half A's time: log 2 = 0.69 > log 1.05 + log 1.3 + noise = 0.32
    c = run_rounds({"A": m.arm(1.0), "B": m.arm(0.5)}, DecisionRule("lower", 0.05), control=m.arm(1.3), clock=m.clock)
    assert c.control["failed"] and c.control["deviation"] == pytest.approx(0.3, abs=0.05)
    assert c.verdict == CONFIRMED and c.ratio == pytest.approx(0.5, rel=0.05)
    # an "equivalent" verdict rests on a noise floor below the margin, which the failed control denies
    c = run_rounds({"A": m.arm(1.0), "B": m.arm(1.0)}, DecisionRule("lower", 0.05), control=m.arm(1.3), clock=m.clock)
    assert c.verdict == INCONCLUSIVE and c.reason.startswith("control_failed")


def _comparison(log_ratios, control=None):
    """A finished comparison whose rounds have the given B/A log-ratios (A = 1 in every round)."""
    values = {"A": [1.0] * len(log_ratios), "B": [math.exp(x) for x in log_ratios]}
    ratio = math.exp(sum(log_ratios) / len(log_ratios))
    rule = DecisionRule("higher", 0.05)
    return Comparison(("A", "B"), rule, ratio, 0.0, 0.0, len(log_ratios), CONFIRMED, "", values, control, 0.95)


def test_contrast_of_two_effects_by_hand():
    # log-ratios 0.5, 0.6, 0.4, 0.5 against 0.1, 0.2, 0.0, 0.1: difference 0.4, each variance 0.02/3, standard error
    # sqrt(2 x 0.02/3/4) = 0.05774, Welch-Satterthwaite df = 6 exactly, t(0.975, 6) = 2.447 (tables): 0.4 +- 0.1413
    first, second = _comparison([0.5, 0.6, 0.4, 0.5]), _comparison([0.1, 0.2, 0.0, 0.1])
    ratio, low, high, verdict, reason = contrast(first, second, DecisionRule("higher", 0.05))
    assert ratio == pytest.approx(math.exp(0.4))
    assert math.log(low) == pytest.approx(0.2587, abs=0.002) and math.log(high) == pytest.approx(0.5413, abs=0.002)
    assert verdict == CONFIRMED
    assert contrast(second, first, DecisionRule("higher", 0.05))[3:] == (NOT_CONFIRMED, "opposite")
    # a failed A/A control of 1.2-1.3 widens the margin to log 1.05 + log 1.3 = 0.311, above the lower end 0.259
    failed = {"ratio": 1.25, "ci_low": 1.2, "ci_high": 1.3, "failed": True}
    out = contrast(_comparison([0.5, 0.6, 0.4, 0.5], failed), second, DecisionRule("higher", 0.05))
    assert out[3] == INCONCLUSIVE and out[4].startswith("control_failed")
    with pytest.raises(ConfigError, match="at least 4 paired rounds"):
        contrast(_comparison([0.5, 0.6, 0.4]), second, DecisionRule("higher", 0.05))


def test_the_budget_stops_the_rounds():
    m = SyntheticMachine(11, noise=0.15)
    # three trials a round, one virtual second each: a 30-second budget ends after 10 rounds, undecided
    c = _run(m, 1.03, DecisionRule("higher", margin=0.05), max_rounds=400, budget_s=30.0, warmup=0)
    assert c.rounds == 10 and c.verdict == INCONCLUSIVE


def test_abba_order_alternates_and_warmup_is_not_recorded():
    calls: list[tuple[str, int]] = []
    arms = {name: (lambda n: lambda i: calls.append((n, i)) or 1.0 + 0.01 * (i % 3))(name) for name in ("A", "B")}
    c = run_rounds(arms, DecisionRule("higher"), min_rounds=6, max_rounds=6, warmup=1, control=False)
    assert calls[:2] == [("A", -1), ("B", -1)]
    assert [n for n, _ in calls[2:6]] == ["A", "B", "B", "A"]
    assert c.rounds == 6 and c.control is None


@pytest.mark.parametrize(
    "kwargs",
    [{"min_rounds": 3}, {"min_rounds": 10, "max_rounds": 8}, {"order": "zigzag"}],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        run_rounds({"A": lambda i: 1.0, "B": lambda i: 1.0}, DecisionRule("higher"), **kwargs)


def test_bad_rules_are_refused():
    for bad in ({"direction": "up"}, {"direction": "higher", "margin": 0.0}, {"direction": "lower", "confidence": 1}):
        with pytest.raises(ConfigError):
            DecisionRule(**bad)
    with pytest.raises(ConfigError):
        compare([1.0, 2.0], [1.0], DecisionRule("higher"))
