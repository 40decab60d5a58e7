"""One measurement layer: ``workbench.timing`` is the only module that reads a clock (or records CUDA events),
and its spread is what a hand computation gives.

The scan walks the syntax tree of every module of workbench/, kernels/ and scripts/, as tests/test_import_layers.py
does for imports: a ``time.perf_counter()`` (or any other clock of the ``time`` module, under any alias, or imported
by name), a ``torch.cuda.Event``, or a raw ``torch.set_num_threads`` anywhere but workbench/timing.py fails it.
"""

import ast
from pathlib import Path

import pytest

from workbench import timing
from workbench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TIMER = ROOT / "workbench" / "timing.py"
# the clocks of the time module (time.time too: a measurement on the calendar jumps when the clock is set)
CLOCKS = {
    "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "process_time_ns",
    "thread_time", "thread_time_ns", "time", "time_ns", "clock_gettime", "clock_gettime_ns",
}  # fmt: skip


def raw_clocks(source: str) -> list[tuple[int, str]]:
    """(line, what) for every raw clock read, CUDA event or thread setting in ``source``."""
    tree = ast.parse(source)
    time_names = {"time"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            time_names |= {alias.asname or alias.name for alias in node.names if alias.name == "time"}
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [(node.lineno, f"from time import {a.name}") for a in node.names if a.name in CLOCKS]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in CLOCKS and isinstance(node.value, ast.Name) and node.value.id in time_names:
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif node.attr == "Event" and isinstance(node.value, ast.Attribute) and node.value.attr == "cuda":
            found.append((node.lineno, "cuda.Event"))
        elif node.attr == "elapsed_time":
            found.append((node.lineno, ".elapsed_time"))
        elif node.attr == "set_num_threads":
            found.append((node.lineno, ".set_num_threads"))
    return sorted(found)


def test_the_scan_finds_every_kind_of_raw_clock() -> None:
    source = (
        "import time\nimport time as clock\nfrom time import perf_counter, sleep\nimport torch\n"
        "a = time.perf_counter()\nb = clock.monotonic()\nc = time.time()\ntime.sleep(1)\nd = time.strftime('%Y')\n"
        "e = torch.cuda.Event(enable_timing=True)\nf = e.elapsed_time(e)\ntorch.set_num_threads(2)\n"
    )
    assert [line for line, _ in raw_clocks(source)] == [3, 5, 6, 7, 10, 11, 12]  # one per read, in line order
    assert "time.sleep" not in str(raw_clocks(source)) and "strftime" not in str(raw_clocks(source))


def test_no_module_but_timing_reads_a_clock() -> None:
    offenders = []
    for path in sorted(p for d in ("workbench", "kernels", "scripts") for p in (ROOT / d).rglob("*.py")):
        if path == TIMER:
            continue
        offenders += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in raw_clocks(path.read_text())]
    advice = "time with workbench.timing (now, timed, time_stats) and set threads with timing.set_threads:\n"
    assert not offenders, advice + "\n".join(offenders)
    assert raw_clocks(TIMER.read_text()), "the timer itself reads the clock"


class FakeClock:
    """A clock that reads the given instants in turn."""

    def __init__(self, instants: list[float]) -> None:
        self.instants = iter(instants)

    def __call__(self) -> float:
        return next(self.instants)


def test_time_stats_spread_from_a_fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    # start of the warm-up, then (t0, t1) per timed run: runs of 2, 4 and 3 seconds
    monkeypatch.setattr(timing, "now", FakeClock([0.0, 10.0, 12.0, 20.0, 24.0, 30.0, 33.0]))
    stats = timing.time_stats(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5
    assert stats["times_s"] == [2.0, 4.0, 3.0]
    assert (stats["min_s"], stats["median_s"], stats["max_s"]) == (2.0, 3.0, 4.0)
    assert stats["spread"] == pytest.approx((4.0 - 2.0) / 3.0)


def test_warmup_by_time_runs_until_the_time_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    # warm-up starts at 0; checks at 0.1, 0.3 (< 0.5) and 0.6 (done) after 1, 2, 3 calls; then one timed run of 1 s
    monkeypatch.setattr(timing, "now", FakeClock([0.0, 0.1, 0.3, 0.6, 5.0, 6.0]))
    stats = timing.time_stats(lambda: calls.append(1), warmup=1, repeats=1, warmup_s=0.5)
    assert len(calls) == 4 and stats["times_s"] == [1.0] and stats["spread"] == 0.0


def test_spread_row_is_median_min_max() -> None:
    assert timing.spread_row([0.3, 0.1, 0.2, 0.5]) == {"time_s": 0.25, "time_min_s": 0.1, "time_max_s": 0.5}
    assert timing.spread_row([2.0], name="ttft") == {"ttft_s": 2.0, "ttft_min_s": 2.0, "ttft_max_s": 2.0}
    with pytest.raises(ConfigError, match="no measurements"):
        timing.spread_row([])


def test_bad_timing_arguments_are_refused() -> None:
    with pytest.raises(ConfigError, match="repeats >= 1"):
        timing.time_stats(lambda: None, repeats=0)
    with pytest.raises(ConfigError, match="warmup_s >= 0"):
        timing.time_stats(lambda: None, warmup_s=-1.0)
    with pytest.raises(ConfigError, match="CUDA-event timing needs a CUDA device"):
        timing.time_stats(lambda: None, device="cpu", warmup=0, events=True)


@pytest.fixture
def restore_threads():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_set_threads_takes_the_argument_then_the_environment_then_the_default(monkeypatch, restore_threads) -> None:
    monkeypatch.delenv(timing.NUM_THREADS_ENV, raising=False)
    assert timing.set_threads(1) == 1
    assert timing.set_threads(None, otherwise="keep") == 1  # left as it was
    assert timing.set_threads(None) == timing.usable_cores()  # a benchmark's default: every usable core
    monkeypatch.setenv(timing.NUM_THREADS_ENV, "1")
    assert timing.set_threads(None) == 1 and timing.set_threads(None, otherwise="keep") == 1
    import torch

    with timing.using_threads(2) as inside:
        assert inside == torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1  # restored


def test_bad_thread_counts_name_where_they_came_from(monkeypatch, restore_threads) -> None:
    monkeypatch.setenv(timing.NUM_THREADS_ENV, "zero")
    with pytest.raises(ConfigError, match="WORKBENCH_NUM_THREADS must be a positive integer, got 'zero'"):
        timing.set_threads(otherwise="keep")
    monkeypatch.setenv(timing.NUM_THREADS_ENV, "0")
    with pytest.raises(ConfigError, match=r"\$WORKBENCH_NUM_THREADS must be >= 1, got 0"):
        timing.set_threads()
    with pytest.raises(ConfigError, match="--threads must be >= 1, got 0"):
        timing.set_threads(0, what="--threads")
    with pytest.raises(ConfigError, match="num_threads must be a positive integer, got 1.5"):
        timing.set_threads(1.5)  # type: ignore[arg-type]
