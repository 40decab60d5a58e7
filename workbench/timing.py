"""The one way to time things: the clock, synchronised wall times with their spread, CUDA-event times, and the
prompt ids the benchmarks feed.

``now()`` is the clock (monotonic; ``time.perf_counter``): every interval, deadline and timestamp the workbench
measures reads it, and ``unix_time()`` is the calendar for timestamps that leave the process (an API's
``created`` field). ``time_stats(fn, device)`` runs ``fn`` ``warmup`` times (and for at least ``warmup_s``
seconds), then ``repeats`` times, each timed on the wall clock with the device synchronised before reading it, or
with CUDA events around each call (``events=True``), and gives the min, median and max of the runs and their
relative spread (``median_time``: the median alone; ``sync`` instead of ``device`` for code that must not import
torch, as ``workbench.hardware`` measuring a CPU); ``timed`` times one call and returns its value; ``spread_row``
is the one shape of a table row's timing (``time_s`` median, ``time_min_s``, ``time_max_s``); ``set_threads`` is
the one setter of torch's intra-op threads (``using_threads`` sets them for a block). Every benchmark,
experiment and ceiling probe of the workbench goes through these; ``tests/test_timing.py`` fails on a raw clock
anywhere else (the Triton kernels' own benchmark uses ``triton.testing.do_bench``, which times on the GPU with
events). ``random_prompts`` is the one maker of random prompts. Imports no torch at module level (CUDA events and
the thread setter import it when called).
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from workbench.errors import ConfigError

NUM_THREADS_ENV = "WORKBENCH_NUM_THREADS"  # the pipeline's thread count for the notebooks it runs


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
    *,
    warmup_s: float = 0.0,
    events: bool = False,
) -> dict[str, Any]:
    """Wall times of ``fn()`` over ``repeats`` synchronised runs after ``warmup`` runs (continued until
    ``warmup_s`` seconds have passed: a CPU's clock and a thread pool take a while to come up to speed):
    ``min_s``, ``median_s``, ``max_s``, every ``times_s`` (tables and plots show the spread, not the median alone)
    and ``spread`` = (max - min) / median, the runs' own repeatability.

    ``events=True`` times each run with a pair of CUDA events on ``device`` (a CUDA device) instead of the host
    clock: the GPU's own time of the work, without the launch latency of the host."""
    if repeats < 1 or warmup < 0 or warmup_s < 0:
        raise ConfigError(f"need repeats >= 1, warmup >= 0 and warmup_s >= 0, got {repeats}, {warmup}, {warmup_s}")
    if events and getattr(device, "type", str(device)).split(":")[0] != "cuda":
        raise ConfigError(f"CUDA-event timing needs a CUDA device, got {device!r}; time on the host clock instead")
    sync = _sync_for(device, sync)
    start = now()
    done = 0
    while done < warmup or (warmup_s > 0 and now() - start < warmup_s):
        fn()
        sync()
        done += 1
    sync()
    times = _event_times(fn, device, repeats) if events else [timed(fn, sync=sync)[0] for _ in range(repeats)]
    mid = median(times)
    return {"min_s": min(times), "median_s": mid, "max_s": max(times), "times_s": times,
            "spread": (max(times) - min(times)) / mid if mid > 0 else 0.0}  # fmt: skip


def _event_times(fn: Callable[[], Any], device: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` between two CUDA events recorded on ``device``'s stream."""
    import torch

    dev = torch.device(device)
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize(dev)
        times.append(begin.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return times


def median_time(
    fn: Callable[[], Any],
    device: Any = None,
    warmup: int = 1,
    repeats: int = 3,
    sync: Callable[[], None] | None = None,
) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs, synchronised."""
    return time_stats(fn, device, warmup, repeats, sync)["median_s"]


def spread_row(times_s: Sequence[float], name: str = "time") -> dict[str, float]:
    """A table row's timing from some measured seconds: ``<name>_s`` (the median), ``<name>_min_s`` and
    ``<name>_max_s`` (the spread the plots draw as error bars)."""
    return {f"{name}_s": median(times_s), f"{name}_min_s": float(min(times_s)), f"{name}_max_s": float(max(times_s))}


def now() -> float:
    """Seconds on the monotonic clock every timing here reads (``time.perf_counter``, CLOCK_MONOTONIC on Linux:
    one clock for every process of a machine): for intervals, time budgets, deadlines and timestamps that must be
    comparable with the timings."""
    return time.perf_counter()


def unix_time() -> float:
    """Seconds since the Unix epoch (the calendar, not a clock to measure with): for timestamps that leave the
    process, such as an API response's ``created`` field."""
    return time.time()


def timed(fn: Callable[[], Any], device: Any = None, sync: Callable[[], None] | None = None) -> tuple[float, Any]:
    """(seconds, value) of one synchronised call of ``fn`` (``sync`` instead of ``device``: a synchronisation of
    one's own)."""
    sync = _sync_for(device, sync)
    sync()
    t0 = now()
    value = fn()
    sync()
    return now() - t0, value


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(
    num_threads: int | None = None, otherwise: Literal["all", "keep"] = "all", what: str = "num_threads"
) -> int:
    """Set torch's intra-op threads and return the count in use: ``num_threads``, else ``$WORKBENCH_NUM_THREADS``
    when set, else every usable core (``otherwise="all"``, a benchmark's default) or as they are (``"keep"``, an
    experiment inside a pipeline run). ConfigError naming ``what`` (the flag a user typed) for a count below 1."""
    import torch

    if num_threads is None and os.environ.get(NUM_THREADS_ENV):
        value = os.environ[NUM_THREADS_ENV]
        try:
            num_threads = int(value)
        except ValueError:
            raise ConfigError(f"${NUM_THREADS_ENV} must be a positive integer, got {value!r}") from None
        what = f"${NUM_THREADS_ENV}"
    if num_threads is None and otherwise == "all":
        num_threads = usable_cores()
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int):
            raise ConfigError(f"{what} must be a positive integer, got {num_threads!r}")
        if num_threads < 1:
            raise ConfigError(f"{what} must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


@contextlib.contextmanager
def using_threads(num_threads: int) -> Iterator[int]:
    """Run a block with ``num_threads`` intra-op threads (``set_threads``), then restore the count before it."""
    import torch

    before = torch.get_num_threads()
    try:
        yield set_threads(num_threads)
    finally:
        torch.set_num_threads(before)


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from [3, vocab) (clear of the usual special ids)."""
    rng = random.Random(seed)
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]
