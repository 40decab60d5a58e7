"""Communication costs: a measured collective profile, and the analytic ring all-reduce it is compared with.

The analytic collectives the roofline and the simulator price (ring all-reduce and all-gather, point-to-point
sends over an accelerator's ``Interconnect``) live in ``workbench.hardware`` (layer 2, below the roofline); this
module measures and fits real ones against them.

A ``CollectiveProfile`` is what ``workbench bench allreduce`` measures on a machine: the median time of one
all-reduce against its message size, for one backend and world size. ``time_s(num_bytes)`` interpolates between
the measured sizes (log-log, the curve is close to a power law between neighbours) and extrapolates past them with
the latency-bandwidth ("alpha-beta") fit ``latency_s + num_bytes / bandwidth_bytes_per_s``.

Conventions, as in NCCL's tests: the *algorithm* bandwidth is ``bytes / time``; the *bus* bandwidth of a ring
all-reduce is that times ``2 (n - 1) / n``, since a ring moves each byte ``2 (n - 1) / n`` times over the slowest
link, so it compares directly with a link's datasheet figure.

Torch-free: the simulator reads profiles without torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.atomic import atomic_write_text
from workbench.errors import ConfigError, read_json_file
from workbench.hardware import ring_all_reduce_time
from workbench.timing import median

PROFILE_KIND = "collective-profile"


def ring_all_reduce_s(num_bytes: float, world_size: int, link_bandwidth: float, link_latency_s: float = 0.0) -> float:
    """Time of a ring all-reduce of ``num_bytes`` over ``world_size`` ranks: a reduce-scatter and an all-gather,
    each ``n - 1`` steps moving ``num_bytes / n`` per link per step (bandwidth term ``2 (n-1)/n * bytes / bw``,
    latency term ``2 (n-1) * latency``). Zero for a single rank. The one formula is
    ``workbench.hardware.ring_all_reduce_time`` (which the roofline prices TP all-reduces with); this is it without
    the fixed per-collective term."""
    return ring_all_reduce_time(num_bytes, world_size, link_bandwidth, link_latency_s)


def bus_bandwidth(num_bytes: float, seconds: float, world_size: int) -> float:
    """The bus bandwidth (bytes/s) of an all-reduce of ``num_bytes`` that took ``seconds`` (NCCL tests' busbw)."""
    return num_bytes / seconds * 2 * (world_size - 1) / world_size


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``time = latency + bytes / bandwidth`` through ``(bytes, seconds)`` points, each weighted by
    ``1 / seconds`` so that small and large messages count alike (relative error). Returns ``(latency_s,
    bandwidth_bytes_per_s)``; the latency is clipped at zero."""
    if len(points) < 2:
        raise ConfigError("a latency-bandwidth fit needs at least two message sizes")
    # weighted normal equations of t = a + b x with weights w = 1 / t^2 (relative residuals)
    sw = swx = swxx = swt = swxt = 0.0
    for x, t in points:
        w = 1.0 / (t * t)
        sw, swx, swxx, swt, swxt = sw + w, swx + w * x, swxx + w * x * x, swt + w * t, swxt + w * x * t
    det = sw * swxx - swx * swx
    slope = (sw * swxt - swx * swt) / det
    latency = (swt - slope * swx) / sw
    if latency < 0:  # refit through the origin
        latency, slope = 0.0, swxt / swxx
    return latency, 1.0 / slope


@dataclass(frozen=True)
class CollectiveProfile:
    """Measured times of one collective on one machine, with their spread and the alpha-beta fit."""

    collective: str  # "all_reduce"
    backend: str  # "gloo" | "nccl"
    world_size: int
    machine: str  # CPU model or GPU name
    num_bytes: tuple[int, ...]  # message sizes, increasing
    median_s: tuple[float, ...]
    min_s: tuple[float, ...]
    max_s: tuple[float, ...]
    latency_s: float
    bandwidth_bytes_per_s: float  # algorithm bandwidth of the fit
    details: dict[str, Any]

    def __post_init__(self) -> None:
        sizes = list(self.num_bytes)
        if len(sizes) < 2 or sizes != sorted(set(sizes)) or sizes[0] <= 0:
            raise ConfigError("a collective profile needs two or more distinct, increasing, positive message sizes")
        if not len(self.median_s) == len(self.min_s) == len(self.max_s) == len(sizes):
            raise ConfigError("a collective profile needs one median, min and max time per message size")
        if any(not t > 0 for t in self.median_s):
            raise ConfigError("a collective profile's times must be positive")

    @classmethod
    def from_samples(
        cls, collective: str, backend: str, world_size: int, machine: str, samples: dict[int, list[float]], **details
    ) -> CollectiveProfile:
        """A profile from repeated timings per message size (the median is the figure; min and max its spread)."""
        sizes = sorted(samples)
        med = tuple(median(samples[n]) for n in sizes)
        latency, bandwidth = fit_latency_bandwidth(list(zip(sizes, med)))
        return cls(
            collective,
            backend,
            world_size,
            machine,
            tuple(sizes),
            med,
            tuple(min(samples[n]) for n in sizes),
            tuple(max(samples[n]) for n in sizes),
            latency,
            bandwidth,
            dict(details),
        )

    def time_s(self, num_bytes: float) -> float:
        """Predicted seconds for one collective of ``num_bytes``: log-log interpolation inside the measured
        range, the alpha-beta fit outside it."""
        if num_bytes <= 0:
            return 0.0
        sizes, times = self.num_bytes, self.median_s
        if num_bytes < sizes[0] or num_bytes > sizes[-1]:
            return self.latency_s + num_bytes / self.bandwidth_bytes_per_s
        for i in range(1, len(sizes)):
            if num_bytes <= sizes[i]:
                lo, hi = i - 1, i
                break
        frac = (math.log(num_bytes) - math.log(sizes[lo])) / (math.log(sizes[hi]) - math.log(sizes[lo]))
        return math.exp(math.log(times[lo]) + frac * (math.log(times[hi]) - math.log(times[lo])))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PROFILE_KIND,
            "collective": self.collective,
            "backend": self.backend,
            "world_size": self.world_size,
            "machine": self.machine,
            "latency_s": self.latency_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "points": [
                {
                    "num_bytes": n,
                    "median_s": m,
                    "min_s": lo,
                    "max_s": hi,
                    "bus_bandwidth_bytes_per_s": bus_bandwidth(n, m, self.world_size),
                }
                for n, m, lo, hi in zip(self.num_bytes, self.median_s, self.min_s, self.max_s)
            ],
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "profile") -> CollectiveProfile:
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise ConfigError(f'{source}: not a collective profile (expected "kind": "{PROFILE_KIND}")')
        try:
            points = data["points"]
            return cls(
                str(data["collective"]),
                str(data["backend"]),
                int(data["world_size"]),
                str(data["machine"]),
                tuple(int(p["num_bytes"]) for p in points),
                tuple(float(p["median_s"]) for p in points),
                tuple(float(p["min_s"]) for p in points),
                tuple(float(p["max_s"]) for p in points),
                float(data["latency_s"]),
                float(data["bandwidth_bytes_per_s"]),
                dict(data.get("details", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: malformed collective profile ({type(exc).__name__}: {exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> CollectiveProfile:
        return cls.from_dict(read_json_file(path, "collective profile"), source=str(path))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
