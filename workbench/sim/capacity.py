"""Capacity search and configuration sweeps on top of the simulator.

``capacity_search`` finds, by bisection, the highest request rate at which a configuration keeps its SLO
attainment (or its goodput as a fraction of its request throughput) at or above a target. It assumes the metric
falls as the rate rises (true of a queue fed faster; noise in a synthetic workload can break it, so the
workload for each rate should come from the same seed). ``rate_scaled`` stretches a trace to a given mean
rate; ``sweep`` runs a function over named configurations with a progress bar.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workbench.errors import ConfigError
from workbench.workloads import Request, scale_time

CAPACITY_METRICS = ("slo_attainment", "goodput")
T = TypeVar("T")


@dataclass
class CapacityResult:
    """The highest rate found to meet the target (0.0 if even ``lo`` fails) and every rate evaluated."""

    rate: float
    metric: str
    target: float
    evaluations: list[tuple[float, float, bool]] = field(default_factory=list)  # (rate, value, meets)

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "metric": self.metric, "target": self.target,
                "evaluations": [list(e) for e in self.evaluations]}  # fmt: skip


def meets_target(summary: dict[str, Any], rate: float, metric: str, target: float) -> tuple[float, bool]:
    """(value, meets) of a ``summarize`` object: SLO attainment in % against ``target`` in %, or goodput over
    request throughput (the share of completed requests/s that meet every SLO) against ``target`` as a fraction."""
    m = summary["metrics"]
    if m.get("goodput") is None:
        raise ConfigError("a capacity search needs at least one SLO (slo_ttft_s, slo_tpot_s or slo_e2el_s)")
    if metric == "slo_attainment":
        value = float(m["slo_attainment"])
    elif metric == "goodput":
        value = float(m["goodput"]) / m["request_throughput"] if m["request_throughput"] > 0 else 0.0
    else:
        raise ConfigError(f"capacity metric must be one of {', '.join(CAPACITY_METRICS)}; got {metric!r}")
    return value, value >= target


def capacity_search(
    evaluate: Callable[[float], dict[str, Any]],
    target: float,
    metric: str = "slo_attainment",
    lo: float = 0.1,
    hi: float = 10.0,
    rel_tol: float = 0.01,
    max_evaluations: int = 40,
) -> CapacityResult:
    """Bisection for the highest rate whose ``evaluate(rate)`` summary meets ``target``.

    ``hi`` is doubled while it still meets the target (up to ``max_evaluations``); stops when the bracket is
    narrower than ``rel_tol`` of its upper end. Returns the largest rate seen to meet the target.
    """
    if metric not in CAPACITY_METRICS:
        raise ConfigError(f"capacity metric must be one of {', '.join(CAPACITY_METRICS)}; got {metric!r}")
    for name, value in (("lo", lo), ("hi", hi), ("rel_tol", rel_tol)):
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be a positive number, got {value!r}")
    if lo >= hi:
        raise ConfigError(f"lo ({lo}) must be below hi ({hi})")
    result = CapacityResult(0.0, metric, target)

    def check(rate: float) -> bool:
        value, ok = meets_target(evaluate(rate), rate, metric, target)
        result.evaluations.append((rate, value, ok))
        if ok:
            result.rate = max(result.rate, rate)
        return ok

    if not check(lo):
        return result
    while check(hi):
        if len(result.evaluations) >= max_evaluations:
            return result
        lo, hi = hi, hi * 2
    while hi - lo > rel_tol * hi and len(result.evaluations) < max_evaluations:
        mid = (lo + hi) / 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    return result


def mean_rate(requests: list[Request]) -> float:
    """Requests per second between the first and the last arrival."""
    if len(requests) < 2:
        raise ConfigError("a rate needs at least two requests")
    times = [r.arrival_time_s for r in requests]
    span = max(times) - min(times)
    if span <= 0:
        raise ConfigError("all requests arrive at once: the workload has no rate to scale")
    return (len(requests) - 1) / span


def rate_scaled(requests: list[Request], rate: float) -> list[Request]:
    """The workload with its arrivals stretched or compressed to a mean of ``rate`` requests/s."""
    if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
        raise ConfigError(f"rate must be a positive number of requests/s, got {rate!r}")
    return scale_time(requests, rate_scale=rate / mean_rate(requests))


def sweep(
    configs: dict[str, Any] | Iterable[tuple[str, Any]],
    run: Callable[[Any], T],
    progress: bool = True,
) -> dict[str, T]:
    """``{name: run(config)}`` over named configurations, with a tqdm progress bar on stderr."""
    items = list(configs.items() if isinstance(configs, dict) else configs)
    out: dict[str, T] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="sweep", unit="config", file=sys.stderr)
    try:
        for name, config in items:
            if bar is not None:
                bar.set_postfix_str(str(name))
            out[name] = run(config)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return out
