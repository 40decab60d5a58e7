"""The worker group over torch.distributed (gloo, 2 ranks): calls, collectives, faults, and the comm profile.

Spawned ranks are slow to start on 2 cores, so one healthy group serves every test that leaves it healthy; each
fault test breaks a group of its own on purpose.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from workbench.dist.group import DistConfig, WorkerError, WorkerGroup, _init, free_port
from workbench.errors import ConfigError
from workbench.model.sharding import all_reduce
from workbench.sim.comm import CollectiveProfile, bus_bandwidth, fit_latency_bandwidth, ring_all_reduce_s


class ProbeWorker:
    """A rank's worker for these tests (importable by spawned ranks: they import this module)."""

    def __init__(self, rank: int, world_size: int, fault: str = "") -> None:
        self.rank, self.world_size, self.fault = rank, world_size, fault

    def rank_sum(self, scale: float) -> list[float]:
        # rank r contributes scale * (r + 1) in every element: the sum over 2 ranks is 3 * scale
        return all_reduce(torch.full((4,), scale * (self.rank + 1))).tolist()

    def whoami(self) -> tuple[int, int, str]:
        return self.rank, dist.get_world_size(), dist.get_backend()

    def misbehave(self) -> list[float]:
        if self.rank == 1 and self.fault == "raise":
            raise ValueError("shard 1 is corrupt")
        if self.rank == 1 and self.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 1 and self.fault == "hang":
            time.sleep(3600)
        return self.rank_sum(1.0)


@pytest.mark.parametrize(
    "fault, timeout_s, expected",
    [
        ("raise", 30, r"rank 1 raised in misbehave\(\): ValueError: shard 1 is corrupt"),
        ("die", 30, r"rank 1 .*exited with code -9"),
        ("hang", 3, r"timeout"),
    ],
)
def test_a_failing_worker_makes_the_driver_raise_within_a_bounded_time(fault, timeout_s, expected):
    # these run before the shared healthy group below starts: one group per process
    started = time.monotonic()
    g = WorkerGroup(DistConfig(2, backend="gloo", timeout_s=timeout_s), ProbeWorker, (fault,))
    try:
        assert g.call("rank_sum", 1.0) == [3.0] * 4  # healthy until the fault
        with pytest.raises(WorkerError, match=expected) as caught:
            g.call("misbehave")
        if fault == "raise":  # the one-line message, and the worker's traceback beside it
            assert "\n" not in str(caught.value)
            assert 'raise ValueError("shard 1 is corrupt")' in caught.value.remote_traceback
        assert time.monotonic() - started < timeout_s + 30
        assert not any(p.is_alive() for p in g._workers.processes), "no orphan worker is left"
        with pytest.raises(WorkerError, match="shut down"):
            g.call("rank_sum", 1.0)
    finally:
        g.shutdown()
    assert not dist.is_initialized()


def _late_rank(url: str, delay_s: float, timeout_s: float) -> None:
    time.sleep(delay_s)  # a rank that is slow to start, as a spawned one is on a busy machine
    _init("gloo", url, 1, 2, timeout_s)
    x = torch.full((2,), 2.0)
    dist.all_reduce(x)
    dist.destroy_process_group()


def test_a_rank_later_than_the_collective_timeout_still_joins():
    # the collective timeout (2 s) is shorter than rank 1's start (4 s): the rendezvous must wait for it anyway,
    # while a collective on its own keeps the short timeout (the hang case above)
    url = f"tcp://127.0.0.1:{free_port()}"
    late = multiprocessing.get_context("spawn").Process(target=_late_rank, args=(url, 4.0, 2.0))
    late.start()
    try:
        _init("gloo", url, 0, 2, 2.0)
        x = torch.full((2,), 1.0)
        dist.all_reduce(x)
        assert x.tolist() == [3.0, 3.0]
        dist.destroy_process_group()
        late.join(30)
        assert late.exitcode == 0
    finally:
        if late.is_alive():
            late.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def group():
    with WorkerGroup(DistConfig(2, backend="gloo", timeout_s=30), ProbeWorker) as g:
        yield g


def test_a_call_runs_on_every_rank_and_the_all_reduce_sums_them(group):
    assert group.call("whoami") == (0, 2, "gloo")
    assert group.call("rank_sum", 2.0) == [6.0, 6.0, 6.0, 6.0]  # 2 * 1 + 2 * 2
    assert group.call("rank_sum", -0.5) == [-1.5] * 4


def test_a_second_group_in_the_same_process_is_refused(group):
    with pytest.raises(ConfigError, match="already running"):
        WorkerGroup(DistConfig(2, backend="gloo"), ProbeWorker)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "backend": "mpi"}, "backend"),
        ({"world_size": 2, "timeout_s": 0}, "timeout_s"),
        ({"world_size": 2, "init_method": "127.0.0.1:29500"}, "init_method"),
        ({"world_size": 2, "init_method": "tcp://127.0.0.1:port"}, "init_method"),
        ({"world_size": 2, "init_method": "file:///tmp/x"}, "init_method"),
    ],
)
def test_bad_configs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        DistConfig(**kwargs)


def test_ring_all_reduce_time_by_hand():
    # 2 ranks, 1 MB, 10 GB/s, 5 us per step: 2 steps of latency + (2 * 1 / 2) * 1e6 / 1e10 s
    assert ring_all_reduce_s(1e6, 2, 1e10, 5e-6) == pytest.approx(2 * 5e-6 + 1e-4)
    # 8 ranks: 14 steps, 14/8 of the bytes over each link
    assert ring_all_reduce_s(8e6, 8, 1e10, 1e-6) == pytest.approx(14e-6 + 14 / 8 * 8e6 / 1e10)
    assert ring_all_reduce_s(1e6, 1, 1e10, 5e-6) == 0.0
    assert bus_bandwidth(1e6, 1e-3, 4) == pytest.approx(1e9 * 2 * 3 / 4)


def test_the_latency_bandwidth_fit_recovers_a_known_line():
    latency, bandwidth = 50e-6, 2e9
    points = [(n, latency + n / bandwidth) for n in (4, 1024, 1 << 20, 16 << 20)]
    fit_latency, fit_bandwidth = fit_latency_bandwidth(points)
    assert fit_latency == pytest.approx(latency, rel=1e-9)
    assert fit_bandwidth == pytest.approx(bandwidth, rel=1e-9)


def test_a_profile_interpolates_log_log_between_sizes_and_round_trips(tmp_path):
    samples = {1000: [1e-4, 2e-4, 1.5e-4], 4000: [4e-4, 5e-4, 6e-4]}  # medians 1.5e-4 and 5e-4
    profile = CollectiveProfile.from_samples("all_reduce", "gloo", 2, "test cpu", samples)
    assert profile.median_s == (1.5e-4, 5e-4)
    assert profile.min_s == (1e-4, 4e-4) and profile.max_s == (2e-4, 6e-4)
    # half-way in log(bytes) is the geometric mean of the two times
    assert profile.time_s(2000) == pytest.approx((1.5e-4 * 5e-4) ** 0.5)
    assert profile.time_s(1000) == pytest.approx(1.5e-4)
    # outside the measured sizes: the alpha-beta line through the two points
    slope = (5e-4 - 1.5e-4) / 3000
    assert profile.time_s(8000) == pytest.approx(1.5e-4 - 1000 * slope + 8000 * slope)
    profile.save(tmp_path / "p.json")
    assert CollectiveProfile.load(tmp_path / "p.json") == profile


def test_a_malformed_profile_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "collective-profile", "points": []}')
    with pytest.raises(ConfigError, match="bad.json"):
        CollectiveProfile.load(bad)
    bad.write_text('{"kind": "something else"}')
    with pytest.raises(ConfigError, match="not a collective profile"):
        CollectiveProfile.load(bad)
