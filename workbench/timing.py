"""The one way to time things: synchronised wall times with their spread, and the prompt ids the benchmarks feed.

``time_stats(fn, device)`` runs ``fn`` ``warmup`` times, then ``repeats`` times, each timed on the wall clock with
the device synchronised before reading it, and gives the min, median and max of the runs (``median_time``: the
median alone; ``sync`` instead of ``device`` for code that must not import torch, as ``workbench.hardware``
measuring a CPU); ``timed`` times one call and returns its value. Every benchmark, experiment and ceiling probe of
the workbench goes through these (the Triton kernels' own benchmark uses ``triton.testing.do_bench``, which times
on the GPU with events). ``random_prompts`` is the one maker of random prompts. Imports no torch.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from workbench.errors import ConfigError


def _sync_for(device: Any, sync: Callable[[], None] | None) -> Callable[[], None]:
    if sync is not None:
        return sync
    if device is None:
        return lambda: None
    from workbench.device import synchronize

    return lambda: synchronize(device)


def median(values: Sequence[float]) -> float:
    """The median of some measurements; ConfigError when there are none."""
    if not values:
        raise ConfigError("no measurements to take a median of")
    return float(statistics.median(values))


def time_stats(
    fn: Callable[[], Any],
    device: Any = None,
    warmup: int = 1,
    repeats: int = 3,
    sync: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Wall times of ``fn()`` over ``repeats`` synchronised runs after ``warmup`` runs: ``min_s``, ``median_s``,
    ``max_s`` and every ``times_s`` (tables and plots show the spread, not the median alone)."""
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    sync = _sync_for(device, sync)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"min_s": min(times), "median_s": median(times), "max_s": max(times), "times_s": times}


def median_time(
    fn: Callable[[], Any],
    device: Any = None,
    warmup: int = 1,
    repeats: int = 3,
    sync: Callable[[], None] | None = None,
) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs, synchronised."""
    return time_stats(fn, device, warmup, repeats, sync)["median_s"]


def now() -> float:
    """Seconds on the monotonic clock every timing here reads (``time.perf_counter``): for time budgets and
    timestamps that must be comparable with the timings."""
    return time.perf_counter()


def timed(fn: Callable[[], Any], device: Any = None) -> tuple[float, Any]:
    """(seconds, value) of one synchronised call of ``fn``."""
    sync = _sync_for(device, None)
    sync()
    t0 = time.perf_counter()
    value = fn()
    sync()
    return time.perf_counter() - t0, value


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from [3, vocab) (clear of the usual special ids)."""
    rng = random.Random(seed)
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]
