"""Hardware specs for the roofline model: a table of accelerators and the measured ceilings of this machine.

A ``HardwareSpec`` is what the roofline model needs of a machine: dense peak FLOP/s per dtype, memory
bandwidth and capacity, and where each figure came from. Two sources:

- the table in ``data/hardware/accelerators.yaml`` (vendor datasheets, dense peaks, one ``source`` per row),
  looked up by the names the command line accepts (``a100-40gb``, ``h100-sxm``, ``h200``, ...);
- ``measured``: this machine, measured. On a CPU: torch matmul peak in fp32 (and bf16 when it runs), memory
  read bandwidth (a sum over a tensor far larger than the caches) and copy bandwidth; on CUDA: bf16/fp32
  matmul and device copy bandwidth with synchronisation. Each figure is the median of timed repetitions
  after a warm-up. The result is cached in memory for the session and, optionally, in a JSON file under
  ``~/.cache/llm-workbench`` keyed by the CPU model or device name, the torch version and the thread count.

This module imports torch only inside the measuring functions, so the table and the roofline model load
without it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.config import DATA_DIR, canonical_dtype
from workbench.errors import ConfigError
from workbench.timing import time_stats

HARDWARE_FILE = DATA_DIR / "hardware" / "accelerators.yaml"
MEASURED = "measured"
CACHE_DIR = Path(os.environ.get("LLM_WORKBENCH_CACHE", Path.home() / ".cache" / "llm-workbench"))
GIB = 1 << 30

# when a spec has no figure for a dtype, the first of these that it has is used instead
PEAK_FALLBACKS: dict[str, tuple[str, ...]] = {
    "fp32": ("fp32",),
    "tf32": ("tf32", "fp32"),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "fp8": ("fp8", "bf16", "fp16", "fp32"),
    "int8": ("int8", "fp8", "bf16", "fp16", "fp32"),
}


# ---- collectives: the analytic costs every room uses (sim.comm compares them with measured profiles) --------
def ring_all_reduce_time(
    num_bytes: float, world_size: int, bandwidth: float, step_latency_s: float = 0.0, base_latency_s: float = 0.0
) -> float:
    """Seconds of a ring all-reduce of ``num_bytes`` over ``world_size`` ranks: a reduce-scatter and an all-gather,
    each ``n - 1`` steps moving ``num_bytes / n`` per link per step, so

        base_latency_s + 2 (n - 1) * step_latency_s + 2 (n - 1) / n * num_bytes / bandwidth

    (``bandwidth``: one direction of one GPU's link, bytes/s; ``base_latency_s``: launching and synchronising the
    collective once; ``step_latency_s``: each of the ring's ``2 (n - 1)`` hops). Zero for a single rank."""
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    if world_size == 1:
        return 0.0
    steps = 2 * (world_size - 1)
    return base_latency_s + steps * step_latency_s + steps / world_size * num_bytes / bandwidth


def ring_all_gather_time(
    num_bytes: float, world_size: int, bandwidth: float, step_latency_s: float = 0.0, base_latency_s: float = 0.0
) -> float:
    """Seconds of a ring all-gather whose result is ``num_bytes`` (each rank contributes ``num_bytes / n``):
    ``base + (n - 1) * step_latency + (n - 1) / n * num_bytes / bandwidth``. Zero for a single rank."""
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    if world_size == 1:
        return 0.0
    steps = world_size - 1
    return base_latency_s + steps * step_latency_s + steps / world_size * num_bytes / bandwidth


def all_to_all_time(num_bytes: float, world_size: int, bandwidth: float, base_latency_s: float = 0.0) -> float:
    """Seconds of an all-to-all in which each of ``world_size`` ranks holds ``num_bytes`` bound for all of them in
    equal parts (an MoE layer's dispatch or combine): ``(n - 1) / n`` of it leaves each rank over its link, every
    rank sending at once through a switch (NVLink / InfiniBand with full bisection):
    ``base_latency_s + (n - 1) / n * num_bytes / bandwidth``. Zero for a single rank."""
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    if world_size == 1:
        return 0.0
    return base_latency_s + (world_size - 1) / world_size * num_bytes / bandwidth


@dataclass(frozen=True)
class Interconnect:
    """The links between the GPUs of one server and between servers, per GPU and per direction (SI units).

    ``intra_node_bandwidth``: NVLink (or PCIe, or AMD Infinity Fabric) bytes/s one GPU can send while receiving as
    much; ``inter_node_bandwidth``: its share of the InfiniBand NICs (one NIC per GPU in DGX/HGX servers);
    ``base_latency_s``: the fixed cost of one collective (launch and synchronisation, what a message of a few bytes
    takes); ``step_latency_s``: each hop of a ring. ``gpus_per_node``: beyond it a group crosses servers.
    """

    name: str
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    base_latency_s: float
    step_latency_s: float
    inter_node_latency_s: float
    gpus_per_node: int
    source: str = ""

    def __post_init__(self) -> None:
        for fname in ("intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, fname)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"interconnect {self.name!r}: {fname} must be a positive number, got {value!r}")
        for fname in ("base_latency_s", "step_latency_s", "inter_node_latency_s"):
            value = getattr(self, fname)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"interconnect {self.name!r}: {fname} must be a number >= 0, got {value!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ConfigError(f"interconnect {self.name!r}: gpus_per_node must be a positive integer")

    def link(self, group_size: int) -> tuple[float, float]:
        """(bandwidth, step latency) of a group of ``group_size`` GPUs: intra-node while it fits in a server."""
        if group_size <= self.gpus_per_node:
            return self.intra_node_bandwidth, self.step_latency_s
        return self.inter_node_bandwidth, self.inter_node_latency_s

    def all_reduce_s(self, num_bytes: float, world_size: int) -> float:
        """A ring all-reduce of ``num_bytes`` over ``world_size`` GPUs (``ring_all_reduce_time``)."""
        bw, lat = self.link(world_size)
        return ring_all_reduce_time(num_bytes, world_size, bw, lat, self.base_latency_s)

    def all_gather_s(self, num_bytes: float, world_size: int) -> float:
        """A ring all-gather whose result is ``num_bytes`` over ``world_size`` GPUs."""
        bw, lat = self.link(world_size)
        return ring_all_gather_time(num_bytes, world_size, bw, lat, self.base_latency_s)

    def all_to_all_s(self, num_bytes: float, world_size: int) -> float:
        """An all-to-all over ``world_size`` GPUs, each holding ``num_bytes`` for all (``all_to_all_time``)."""
        bw, _ = self.link(world_size)
        return all_to_all_time(num_bytes, world_size, bw, self.base_latency_s)

    def send_s(self, num_bytes: float, cross_node: bool = False) -> float:
        """One point-to-point send: ``base_latency + bytes / bandwidth`` (plus the inter-node hop latency across
        servers)."""
        if cross_node:
            return self.base_latency_s + self.inter_node_latency_s + num_bytes / self.inter_node_bandwidth
        return self.base_latency_s + num_bytes / self.intra_node_bandwidth


@dataclass(frozen=True)
class Calibration:
    """How far real kernels stay from the roofline, per operation class (1.0 and 0.0: the ideal roofline).

    - a matrix product over ``M`` rows (tokens; sequences for the LM head) reaches ``max * M / (M + half_tokens)``
      of the matmul peak: a saturating curve, so small products (tile and wave quantisation, the GPU not filled)
      are slow and large ones approach ``max``; separately for the linear layers and for attention, and with
      ``fp8_max`` in place of ``linear_max`` for FP8 products;
    - every operation streams memory at ``memory_efficiency`` of the bandwidth;
    - no kernel takes less than ``kernel_floor_s`` (launch and tail: norms, rotary, SiLU, adds at small token
      counts are this, not their bytes);
    - every kernel pays ``kernel_latency_s`` on top of its compute or streaming time: its fixed cost (launch,
      the ramp-up of its first wave and the tail of its last), the latency term of the latency-bandwidth
      ("alpha-beta", Hockney 1994) model applied to a kernel, so a matrix that streams in a few microseconds (a
      7B layer's projections split over 8 GPUs) is not priced at its bytes alone;
    - ``step_overhead_s``: host time per scheduler step (scheduling, input preparation, sampling) that the
      device does not hide;
    - ``int8_weight_efficiency`` / ``int4_weight_efficiency``: weight-only quantized products stream their weights
      at this share of the memory efficiency (dequantising on the fly costs bandwidth).
    """

    linear_max: float = 1.0
    linear_half_tokens: float = 0.0
    attention_max: float = 1.0
    attention_half_tokens: float = 0.0
    fp8_max: float = 1.0
    memory_efficiency: float = 1.0
    kernel_floor_s: float = 0.0
    kernel_latency_s: float = 0.0
    step_overhead_s: float = 0.0
    int8_weight_efficiency: float = 1.0
    int4_weight_efficiency: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        for fname in ("linear_max", "attention_max", "fp8_max", "memory_efficiency", "int8_weight_efficiency",
                      "int4_weight_efficiency"):  # fmt: skip
            value = getattr(self, fname)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ConfigError(f"calibration {fname} must be in (0, 1], got {value!r}")
        for fname in (
            "linear_half_tokens",
            "attention_half_tokens",
            "kernel_floor_s",
            "kernel_latency_s",
            "step_overhead_s",
        ):
            value = getattr(self, fname)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"calibration {fname} must be a number >= 0, got {value!r}")

    @property
    def is_ideal(self) -> bool:
        """True when every figure is the ideal roofline's (whatever the source says)."""
        return self.replace(source="") == IDEAL

    def replace(self, **changes: Any) -> Calibration:
        from dataclasses import replace

        return replace(self, **changes)

    @staticmethod
    def efficiency(rows: float, top: float, half: float) -> float:
        """``top * rows / (rows + half)``: the share of the peak a product over ``rows`` rows reaches."""
        return top * rows / (rows + half) if rows > 0 else top

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


IDEAL = Calibration()


@dataclass(frozen=True)
class HardwareSpec:
    """The ceilings of one machine, in SI units (FLOP/s, bytes/s, bytes).

    ``peak_flops`` maps a dtype ('fp32', 'tf32', 'bf16', 'fp16', 'fp8', 'int8') to the dense matmul peak;
    'fp32' doubles as the vector (non-matmul) peak used for norms, softmax and elementwise ops.
    ``mem_bandwidth`` is the bandwidth the roofline's memory ceiling uses (datasheet peak, or the measured
    read bandwidth). ``details`` carries extra measured figures (copy bandwidth, sizes, device).
    """

    name: str
    peak_flops: dict[str, float]
    mem_bandwidth: float
    mem_capacity: float
    source: str
    display_name: str = ""
    notes: str = ""
    details: dict[str, Any] = field(default_factory=dict, compare=False)
    interconnect: Interconnect | None = field(default=None, compare=False)
    calibration: Calibration = field(default=IDEAL, compare=False)

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise ConfigError(f"hardware {self.name!r}: peak_flops is empty")
        if "fp32" not in self.peak_flops:
            raise ConfigError(f"hardware {self.name!r}: peak_flops needs an 'fp32' entry (the vector peak)")
        for dtype, value in self.peak_flops.items():
            if dtype not in PEAK_FALLBACKS:
                raise ConfigError(
                    f"hardware {self.name!r}: unknown dtype {dtype!r} in peak_flops; "
                    f"expected one of {sorted(PEAK_FALLBACKS)}"
                )
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"hardware {self.name!r}: peak_flops[{dtype!r}] must be > 0, got {value!r}")
        for fname in ("mem_bandwidth", "mem_capacity"):
            value = getattr(self, fname)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"hardware {self.name!r}: {fname} must be a positive number, got {value!r}")

    def peak(self, dtype: str = "bf16") -> float:
        """Dense matmul peak FLOP/s for ``dtype``, falling back (fp16 <-> bf16, then fp32) when absent."""
        key = "tf32" if str(dtype).lower() == "tf32" else canonical_dtype(dtype)
        for candidate in PEAK_FALLBACKS[key]:
            if candidate in self.peak_flops:
                return float(self.peak_flops[candidate])
        return float(self.peak_flops["fp32"])

    @property
    def vector_flops(self) -> float:
        """Peak FLOP/s of non-matmul work (norms, softmax, elementwise): the fp32 figure."""
        return float(self.peak_flops["fp32"])

    def balance_point(self, dtype: str = "bf16") -> float:
        """Arithmetic intensity (FLOP/byte) where the compute and memory ceilings meet: peak / bandwidth."""
        return self.peak(dtype) / self.mem_bandwidth

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description, in SI units plus the usual TFLOP/s, TB/s and GiB for reading."""
        return {
            "name": self.name,
            "display_name": self.display_name or self.name,
            "peak_flops": {k: float(v) for k, v in self.peak_flops.items()},
            "peak_tflops": {k: round(v / 1e12, 4) for k, v in self.peak_flops.items()},
            "mem_bandwidth": float(self.mem_bandwidth),
            "mem_bandwidth_tbs": round(self.mem_bandwidth / 1e12, 5),
            "mem_capacity": float(self.mem_capacity),
            "mem_capacity_gib": round(self.mem_capacity / GIB, 2),
            "balance_point_bf16": round(self.balance_point("bf16"), 2),
            "source": self.source,
            "notes": self.notes,
            "details": dict(self.details),
            "interconnect": dict(self.interconnect.__dict__) if self.interconnect else None,
            "calibration": self.calibration.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareSpec:
        """Inverse of ``to_dict`` (extra keys ignored)."""
        try:
            return cls(
                name=data["name"],
                peak_flops={k: float(v) for k, v in data["peak_flops"].items()},
                mem_bandwidth=float(data["mem_bandwidth"]),
                mem_capacity=float(data["mem_capacity"]),
                source=data["source"],
                display_name=data.get("display_name", ""),
                notes=data.get("notes", ""),
                details=dict(data.get("details", {})),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"hardware spec dict is missing or has a malformed field: {exc}") from None


# ---- the table -------------------------------------------------------------------------------------------
_TABLE: dict[str, HardwareSpec] | None = None


def load_table(path: str | Path = HARDWARE_FILE) -> dict[str, HardwareSpec]:
    """Read the accelerator table (YAML) into specs keyed by command-line name."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"hardware table not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of hardware names to specs")
    table = {}
    for name, row in raw.items():
        where = f"{path}: {name}"
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a mapping")
        missing = [k for k in ("peak_tflops", "mem_bandwidth_tbs", "mem_capacity_gb", "source") if k not in row]
        if missing:
            raise ConfigError(f"{where}: missing key(s) {missing}")
        if not isinstance(row["peak_tflops"], dict):
            raise ConfigError(f"{where}: peak_tflops must be a mapping of dtype to TFLOP/s")
        try:
            spec = HardwareSpec(
                name=str(name),
                peak_flops={str(k): float(v) * 1e12 for k, v in row["peak_tflops"].items()},
                mem_bandwidth=float(row["mem_bandwidth_tbs"]) * 1e12,
                mem_capacity=float(row["mem_capacity_gb"]) * GIB,
                source=str(row["source"]),
                display_name=str(row.get("display_name", name)),
                notes=str(row.get("notes", "")),
                interconnect=_interconnect(row.get("interconnect"), where),
                calibration=_calibration(row.get("calibration"), where),
            )
        except (TypeError, ValueError, KeyError) as exc:
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{path}: {exc}") from None
            if isinstance(exc, KeyError):
                raise ConfigError(f"{where}: missing key {exc}") from None
            raise ConfigError(f"{where}: non-numeric figure ({exc})") from None
        table[spec.name] = spec
    return table


INTERCONNECT_KEYS = ("name", "intra_node_gbs", "inter_node_gbps", "base_latency_us", "step_latency_us",
                     "inter_node_latency_us", "gpus_per_node", "source")  # fmt: skip
CALIBRATION_KEYS = ("linear_max", "linear_half_tokens", "attention_max", "attention_half_tokens", "fp8_max",
                    "memory_efficiency", "kernel_floor_us", "kernel_latency_us", "step_overhead_us",
                    "int8_weight_efficiency", "int4_weight_efficiency", "source")  # fmt: skip


def _interconnect(row: Any, where: str) -> Interconnect | None:
    """An ``interconnect:`` mapping of the table (GB/s within a server, Gb/s between servers, microseconds)."""
    if row is None:
        return None
    if not isinstance(row, dict) or set(row) - set(INTERCONNECT_KEYS):
        raise ConfigError(f"{where}: interconnect must be a mapping with keys among {', '.join(INTERCONNECT_KEYS)}")
    return Interconnect(
        name=str(row.get("name", "")),
        intra_node_bandwidth=float(row["intra_node_gbs"]) * 1e9,
        inter_node_bandwidth=float(row["inter_node_gbps"]) * 1e9 / 8,
        base_latency_s=float(row.get("base_latency_us", 0.0)) * 1e-6,
        step_latency_s=float(row.get("step_latency_us", 0.0)) * 1e-6,
        inter_node_latency_s=float(row.get("inter_node_latency_us", 0.0)) * 1e-6,
        gpus_per_node=int(row.get("gpus_per_node", 8)),
        source=str(row.get("source", "")),
    )


def _calibration(row: Any, where: str) -> Calibration:
    """A ``calibration:`` mapping of the table (efficiencies, tokens, microseconds); absent: the ideal roofline."""
    if row is None:
        return IDEAL
    if not isinstance(row, dict) or set(row) - set(CALIBRATION_KEYS):
        raise ConfigError(f"{where}: calibration must be a mapping with keys among {', '.join(CALIBRATION_KEYS)}")
    micro = ("kernel_floor_us", "kernel_latency_us", "step_overhead_us")
    values = {k: float(v) for k, v in row.items() if k != "source" and k not in micro}
    return Calibration(
        **values,
        kernel_floor_s=float(row.get("kernel_floor_us", 0.0)) * 1e-6,
        kernel_latency_s=float(row.get("kernel_latency_us", 0.0)) * 1e-6,
        step_overhead_s=float(row.get("step_overhead_us", 0.0)) * 1e-6,
        source=str(row.get("source", "")),
    )


def hardware_names() -> list[str]:
    """Names accepted by ``get_hardware``: the table's, then 'measured'."""
    return [*_table(), MEASURED]


def _table() -> dict[str, HardwareSpec]:
    global _TABLE
    if _TABLE is None:
        _TABLE = load_table()
    return _TABLE


def get_hardware(name: str | HardwareSpec, device: str = "auto") -> HardwareSpec:
    """A spec by name (case-insensitive; '_' and '-' equivalent), 'measured' for this machine, or a spec as is.

    'measured-cpu' measures the CPU, 'measured-cuda' the current CUDA device; plain 'measured' measures
    ``device`` (default 'auto': CUDA when torch sees a GPU, else the CPU).
    """
    if isinstance(name, HardwareSpec):
        return name
    key = str(name).strip().lower().replace("_", "-")
    if key == MEASURED:
        return measured_spec(device)
    if key.startswith(MEASURED + "-"):
        return measured_spec(key.removeprefix(MEASURED + "-"))
    table = _table()
    if key not in table:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}")
    return table[key]


# ---- measured ceilings -------------------------------------------------------------------------------------
_MEASURED: dict[str, HardwareSpec] = {}


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name`` line's value in /proc/cpuinfo (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model_name() -> str:
    """The CPU model string (from /proc/cpuinfo on Linux), or platform.processor() elsewhere."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown-cpu"


def cpu_vendor() -> str:
    """The CPU's vendor string as /proc/cpuinfo gives it (``GenuineIntel``, ``AuthenticAMD``, ...), or "" where
    the OS does not say."""
    return _cpuinfo_field("vendor_id") or ""


def physical_memory_bytes() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say): the one place these facts are read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _physical_memory_bytes() -> float:
    return float(physical_memory_bytes() or GIB)


# a dtype whose CPU matrix products run below this fraction of fp32's is emulated (converted element by element):
# on a 2-core AMD EPYC without bf16 units, bf16 reached about 1 GFLOP/s against 170 for fp32 (issue 15's figures)
EMULATED_RATIO = 0.25
_DTYPE_RATES: dict[str, tuple[float, float]] = {}
_WARNED: set[str] = set()


def cpu_matmul_rates(dtype: str, n: int = 256, repeats: int = 3) -> tuple[float, float]:
    """(FLOP/s of ``dtype``, FLOP/s of fp32) of an ``n`` x ``n`` x ``n`` matrix product on this CPU, best of
    ``repeats`` after one warm-up, measured once per process and dtype (a fraction of a second)."""
    dtype = canonical_dtype(dtype)
    if dtype not in _DTYPE_RATES:
        import torch

        from workbench.device import torch_dtype

        def rate(dt: Any) -> float:
            a = torch.randn(n, n).to(dt)
            b = torch.randn(n, n).to(dt)
            best = time_stats(lambda: torch.mm(a, b), warmup=1, repeats=repeats)["min_s"]
            return 2.0 * n**3 / max(best, 1e-9)

        _DTYPE_RATES[dtype] = (rate(torch_dtype(dtype)), rate(torch.float32))
    return _DTYPE_RATES[dtype]


def emulated_dtype_note(dtype: str, dtype_rate: float, fp32_rate: float) -> str | None:
    """The warning for ``dtype`` when its matrix products run below ``EMULATED_RATIO`` of fp32's, else None."""
    if canonical_dtype(dtype) == "fp32" or dtype_rate >= EMULATED_RATIO * fp32_rate:
        return None
    return (
        f"{canonical_dtype(dtype)} matrix products are emulated on this CPU ({dtype_rate / 1e9:.1f} GFLOP/s against "
        f"{fp32_rate / 1e9:.1f} for fp32, {fp32_rate / max(dtype_rate, 1.0):.0f}x slower): its timings measure the "
        "emulation, not the bytes it saves; use --dtype fp32 here"
    )


# x86 ISAs torch reports (``torch.backends.cpu.get_cpu_capability()``) and those on which its bf16 matrix products
# run oneDNN's kernels (AVX-512: bf16 instructions, AMX, or AVX-512 conversions in registers). Below AVX-512 (AVX2,
# as on this project's AMD EPYC) ATen converts element by element: about 1 GFLOP/s against 170 for fp32 (issue 15).
# fp16 products run oneDNN's kernels only with AMX-FP16 (or AVX512-FP16, which torch does not report).
X86_CPU_CAPABILITIES = ("NO AVX", "DEFAULT", "AVX2", "AVX512")
BF16_NATIVE_CPU_CAPABILITIES = ("AVX512",)


def isa_emulated_dtype_note(dtype: str) -> str | None:
    """Why ``dtype``'s CPU matrix products are emulated on this x86 CPU, decided by the ISA torch reports (no
    timing, so a loaded machine cannot change the answer), or None: fp32, a dtype torch has kernels for here, or a
    CPU that is not x86 (its ISA names say nothing about bf16 units)."""
    import torch

    name = canonical_dtype(dtype)
    capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    if name == "fp32" or not x86 or capability not in X86_CPU_CAPABILITIES:
        return None
    if name == "bf16" and capability in BF16_NATIVE_CPU_CAPABILITIES:
        return None
    if name == "fp16" and capability == "AVX512" and torch.cpu._is_amx_fp16_supported():
        return None
    return (
        f"{name} matrix products are emulated on this CPU (torch reports the ISA {capability}, which has no {name} "
        "matrix kernels in torch): its timings would measure the emulation, not the bytes it saves; use --dtype fp32"
    )


def warn_if_emulated(dtype: str, device: Any) -> str | None:
    """On a CPU, print (once per process and dtype) and return the emulation warning for ``dtype``, else None."""
    if str(getattr(device, "type", device)) != "cpu" or canonical_dtype(dtype) == "fp32":
        return None
    note = emulated_dtype_note(dtype, *cpu_matmul_rates(dtype))
    if note and canonical_dtype(dtype) not in _WARNED:
        import sys

        _WARNED.add(canonical_dtype(dtype))
        print(f"warning: {note}", file=sys.stderr)
    return note


# bumped when the probes change (2: the CPU read ceiling also tries a gemv; 3: warm-up by time, repeatability);
# older caches are stale
PROBE_VERSION = 3
WARMUP_S = 0.2  # seconds each CPU probe runs before it is timed
EMULATED_MATMUL_N = 256  # the CPU matmul probe's size for a dtype this ISA emulates (isa_emulated_dtype_note)
GEMV_PROBE_COLS = 4096  # row length of the matrix-vector read probe (16 KiB rows in fp32)


def measure_cpu(
    matmul_n: int = 1024,
    bandwidth_bytes: int = 256 * 1024 * 1024,
    repeats: int = 5,
    warmup: int = 1,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    warmup_s: float = WARMUP_S,
) -> HardwareSpec:
    """Measure this CPU's matmul peak per dtype and its memory read and copy bandwidth with torch.

    Matmul: (n, n) @ (n, n), 2 n^3 FLOPs; ``n`` is ``matmul_n``, or at most ``EMULATED_MATMUL_N`` for a dtype the
    ISA emulates (``isa_emulated_dtype_note``; ``details["matmul_n_by_dtype"]``).
    Read bandwidth: the faster of two single reads of an fp32 tensor of
    ``bandwidth_bytes`` bytes, ``x.sum()`` and a matrix-vector product over it viewed as rows of
    ``GEMV_PROBE_COLS`` (a decode step's own access pattern; on a 2-core Xeon VM it reads ~30 GB/s where the sum
    reads ~23, and a ceiling below what decode reaches would give an MBU above 1). Copy bandwidth:
    ``y.copy_(x)``, counted as 2 x bytes (read + write). The default 256 MiB is far beyond a core's share of the
    caches; on this class of VM the measured read bandwidth no longer changes between 256 MiB and 1 GiB. A dtype
    whose matmul fails is left out.

    Each probe warms up for ``warmup`` calls and at least ``warmup_s`` seconds before it is timed (issue 28: a
    notebook's start probe read 22-70% below its end probe), and reports its own repeatability:
    ``details["spread"]`` is (max - min) / median of each probe's timed calls, ``details["repeatability"]`` the
    largest of them (a ceiling whose own calls spread by 30% cannot tell a 25% drift apart).
    """
    import torch

    sync = lambda: None  # CPU ops are synchronous
    spread: dict[str, float] = {}

    def probe(name: str, fn: Callable[[], Any]) -> float:
        stats = time_stats(fn, warmup=warmup, repeats=repeats, sync=sync, warmup_s=warmup_s)
        spread[name] = stats["spread"]
        return stats["median_s"]

    peak: dict[str, float] = {}
    matmul_detail: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for dtype in dtypes:
        tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[canonical_dtype(dtype)]
        # an emulated dtype (no matrix kernels for this ISA) runs ~100x below fp32: at matmul_n one call takes
        # seconds and the probe tens of them, for a figure that only says "emulated"
        n = min(matmul_n, EMULATED_MATMUL_N) if isa_emulated_dtype_note(dtype) else matmul_n
        try:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(n, n, generator=gen).to(tdtype)  # (n, n)
            b = torch.randn(n, n, generator=gen).to(tdtype)  # (n, n)
            t = probe(f"matmul_{canonical_dtype(dtype)}", lambda a=a, b=b: torch.mm(a, b))
        except RuntimeError:
            continue
        peak[canonical_dtype(dtype)] = 2.0 * n**3 / t
        matmul_detail[canonical_dtype(dtype)] = t
        sizes[canonical_dtype(dtype)] = n
    if "fp32" not in peak:
        raise ConfigError("could not measure an fp32 matmul on this CPU")
    numel = max(1, bandwidth_bytes // 4)
    x = torch.ones(numel, dtype=torch.float32)  # (numel,)
    y = torch.empty_like(x)  # (numel,)
    nbytes = numel * 4
    t_sum = probe("read_sum", lambda x=x: x.sum())
    cols = min(GEMV_PROBE_COLS, numel)
    rows, vec = x[: numel - numel % cols].view(-1, cols), torch.ones(cols, dtype=torch.float32)
    t_gemv = probe("read_gemv", lambda rows=rows, vec=vec: torch.mv(rows, vec))
    gemv_bw = rows.numel() * 4 / t_gemv
    t_copy = probe("copy", lambda x=x, y=y: y.copy_(x))
    del x, y, rows
    read_bw = max(nbytes / t_sum, gemv_bw)
    copy_bw = 2 * nbytes / t_copy
    cpu = cpu_model_name()
    return HardwareSpec(
        name=MEASURED,
        peak_flops=peak,
        mem_bandwidth=read_bw,
        mem_capacity=_physical_memory_bytes(),
        source=f"measured on this machine ({cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads)",
        display_name=f"measured CPU: {cpu}",
        notes="mem_bandwidth is the read bandwidth of a large tensor (best of a sum and a gemv); copy in details",
        details={
            "device": "cpu",
            "device_name": cpu,
            "torch_version": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "matmul_n": matmul_n,
            "matmul_n_by_dtype": sizes,
            "matmul_median_s": matmul_detail,
            "bandwidth_bytes": nbytes,
            "read_bandwidth": read_bw,
            "read_bandwidth_sum": nbytes / t_sum,
            "read_bandwidth_gemv": gemv_bw,
            "copy_bandwidth": copy_bw,
            "repeats": repeats,
            "warmup_s": warmup_s,
            "spread": spread,
            "repeatability": max(spread.values()),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "probe_version": PROBE_VERSION,
        },
    )


def measure_cuda(
    matmul_n: int = 8192,
    bandwidth_bytes: int = 1024 * 1024 * 1024,
    repeats: int = 10,
    warmup: int = 3,
    device: str = "cuda",
) -> HardwareSpec:
    """Measure the CUDA device's bf16 (and fp32) matmul peak and its device-to-device copy bandwidth.

    Timed with CUDA events around each call (``workbench.timing``), after warm-up; medians, with each probe's
    spread as on the CPU. Copy counts read + write (2 x bytes).
    The device's copy bandwidth is the memory ceiling (a copy is the simplest kernel that streams memory).
    """
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("measure_cuda: no CUDA device is available")
    dev = torch.device(device)

    spread: dict[str, float] = {}

    def cuda_median(name: str, fn: Callable[[], Any]) -> float:
        stats = time_stats(fn, dev, warmup=warmup, repeats=repeats, events=True)
        spread[name] = stats["spread"]
        return stats["median_s"]

    peak: dict[str, float] = {}
    matmul_detail: dict[str, float] = {}
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, not tf32
    try:
        for dtype, tdtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            a = torch.randn(matmul_n, matmul_n, device=dev, dtype=tdtype)  # (n, n)
            b = torch.randn(matmul_n, matmul_n, device=dev, dtype=tdtype)  # (n, n)
            t = cuda_median(f"matmul_{dtype}", lambda a=a, b=b: torch.mm(a, b))
            peak[dtype] = 2.0 * matmul_n**3 / t
            matmul_detail[dtype] = t
            del a, b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    numel = max(1, bandwidth_bytes // 2)
    x = torch.ones(numel, device=dev, dtype=torch.bfloat16)  # (numel,)
    y = torch.empty_like(x)  # (numel,)
    nbytes = numel * 2
    t_copy = cuda_median("copy", lambda x=x, y=y: y.copy_(x))
    t_read = cuda_median("read_sum", lambda x=x: x.sum())
    del x, y
    props = torch.cuda.get_device_properties(dev)
    copy_bw = 2 * nbytes / t_copy
    return HardwareSpec(
        name=MEASURED,
        peak_flops=peak,
        mem_bandwidth=copy_bw,
        mem_capacity=float(props.total_memory),
        source=f"measured on this machine ({props.name}, torch {torch.__version__})",
        display_name=f"measured CUDA: {props.name}",
        notes="mem_bandwidth is the device copy bandwidth (read + write); read bandwidth of a sum in details",
        details={
            "device": "cuda",
            "device_name": props.name,
            "torch_version": torch.__version__,
            "matmul_n": matmul_n,
            "matmul_median_s": matmul_detail,
            "bandwidth_bytes": nbytes,
            "read_bandwidth": nbytes / t_read,
            "copy_bandwidth": copy_bw,
            "repeats": repeats,
            "spread": spread,
            "repeatability": max(spread.values()),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "probe_version": PROBE_VERSION,
        },
    )


def _machine_key(device: str) -> str:
    """Cache key: device kind, CPU model or GPU name, torch version, thread count."""
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"{cpu_model_name()}-{torch.get_num_threads()}t"
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"{device}-{name}-torch{torch.__version__}").strip("-").lower()


def measured_spec(
    device: str = "cpu",
    *,
    refresh: bool = False,
    cache_dir: str | Path | None = CACHE_DIR,
    **measure_kwargs: Any,
) -> HardwareSpec:
    """This machine's measured ceilings as a ``HardwareSpec`` named 'measured' (``device``: cpu, cuda, auto).

    Measured once per session and device (later calls return the same object); with ``cache_dir`` (the
    default ``~/.cache/llm-workbench``, or ``$LLM_WORKBENCH_CACHE``) a JSON file per machine is read before
    measuring and written after. ``refresh=True`` measures again. ``measure_kwargs`` go to ``measure_cpu``
    or ``measure_cuda`` (sizes, repetitions); a call with them neither reads nor writes the file cache.
    """
    device = str(device).lower()
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"measured_spec: device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"device 'cuda' requested but torch {torch.__version__} sees no CUDA device; measure the CPU "
                "(--device cpu) or use 'auto'"
            )
    custom = bool(measure_kwargs)
    if not refresh and not custom and device in _MEASURED:
        return _MEASURED[device]
    cache_file = Path(cache_dir) / f"hardware-{_machine_key(device)}.json" if cache_dir is not None else None
    if cache_file is not None and not refresh and not custom and cache_file.exists():
        try:
            spec = HardwareSpec.from_dict(json.loads(cache_file.read_text()))
            if spec.details.get("probe_version") == PROBE_VERSION:  # older probes are measured over
                _MEASURED[device] = spec
                return spec
        except (json.JSONDecodeError, ConfigError, OSError):
            pass  # a corrupt cache is measured over
    spec = measure_cuda(**measure_kwargs) if device == "cuda" else measure_cpu(**measure_kwargs)
    if not custom:
        _MEASURED[device] = spec
        if cache_file is not None:
            try:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                cache_file.write_text(json.dumps(spec.to_dict(), indent=2))
            except OSError:
                pass  # the cache is optional
    return spec


__all__ = [
    "Calibration",
    "IDEAL",
    "Interconnect",
    "ring_all_reduce_time",
    "ring_all_gather_time",
    "HardwareSpec",
    "HARDWARE_FILE",
    "MEASURED",
    "load_table",
    "hardware_names",
    "get_hardware",
    "measure_cpu",
    "measure_cuda",
    "measured_spec",
    "cpu_model_name",
    "physical_memory_bytes",
]
