"""Hardware table and measured ceilings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import workbench.hardware as hardware
from workbench.cli import main
from workbench.errors import ConfigError
from workbench.hardware import HardwareSpec, get_hardware, hardware_names, load_table, measure_cpu, measured_spec

NAMES = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4", "l40s", "mi300x", "b200")
# tiny sizes: enough to exercise every code path in well under a second
TINY = {"matmul_n": 64, "bandwidth_bytes": 1 << 20, "repeats": 2, "warmup": 1, "warmup_s": 0.0}


def test_table_has_every_named_part_with_a_source() -> None:
    assert hardware_names() == [*NAMES, "measured"]
    for name in NAMES:
        spec = get_hardware(name)
        assert spec.source.startswith(("NVIDIA", "AMD"))  # a vendor document
        assert {"fp32", "bf16", "fp16"} <= set(spec.peak_flops)
        assert spec.mem_bandwidth > 1e11 and spec.mem_capacity > 16 * 2**30


def test_balance_points_of_h100_and_h200() -> None:
    # H100 SXM: 989.5 TFLOP/s dense bf16 (1,979 with sparsity / 2) over 3.35 TB/s
    h100 = get_hardware("h100-sxm")
    assert h100.peak("bf16") == 989.5e12
    assert h100.balance_point("bf16") == pytest.approx(295, abs=1)
    # H200: same compute, 4.8 TB/s
    assert get_hardware("h200").balance_point("bf16") == pytest.approx(206, abs=1)
    # A100 80GB: 312 / 2.039
    assert get_hardware("a100-80gb").balance_point("fp16") == pytest.approx(153, abs=1)


def test_dense_not_sparse_peaks() -> None:
    # datasheets print "with sparsity" figures twice the dense ones; dense ones are recorded
    assert get_hardware("a100-40gb").peak("bf16") == 312e12
    assert get_hardware("l4").peak("fp8") == 242.5e12
    assert get_hardware("b200").peak("bf16") == 2250e12
    assert get_hardware("mi300x").peak("bf16") == 1307.4e12


def test_peak_fallbacks_and_names() -> None:
    a100 = get_hardware("A100_40GB")
    assert a100.name == "a100-40gb"
    assert a100.peak("fp8") == a100.peak("bf16")  # no fp8 tensor cores: runs at bf16
    assert a100.peak("float16") == 312e12
    assert a100.vector_flops == 19.5e12
    assert get_hardware(a100) is a100


def test_unknown_hardware_lists_the_known_names() -> None:
    with pytest.raises(ConfigError) as exc:
        get_hardware("h300")
    for name in (*NAMES, "measured"):
        assert name in str(exc.value)


def test_spec_validation_and_round_trip() -> None:
    with pytest.raises(ConfigError, match="mem_bandwidth"):
        HardwareSpec(name="x", peak_flops={"fp32": 1.0}, mem_bandwidth=-1, mem_capacity=1, source="s")
    with pytest.raises(ConfigError, match="fp32"):
        HardwareSpec(name="x", peak_flops={"bf16": 1.0}, mem_bandwidth=1, mem_capacity=1, source="s")
    with pytest.raises(ConfigError, match="fp7"):
        HardwareSpec(name="x", peak_flops={"fp32": 1.0, "fp7": 2.0}, mem_bandwidth=1, mem_capacity=1, source="s")
    spec = get_hardware("h200")
    assert HardwareSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_table_loader_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "hw.yaml"
    bad.write_text("x1:\n  peak_tflops: {fp32: 1}\n  mem_bandwidth_tbs: 1\n")
    with pytest.raises(ConfigError, match=r"hw.yaml: x1: missing key"):
        load_table(bad)
    bad.write_text("x1: [1, 2\n")
    with pytest.raises(ConfigError, match="hw.yaml"):
        load_table(bad)
    bad.write_text("x1:\n  peak_tflops: {fp32: fast}\n  mem_bandwidth_tbs: 1\n  mem_capacity_gb: 1\n  source: s\n")
    with pytest.raises(ConfigError, match="x1"):
        load_table(bad)


def test_measured_cpu_spec_is_sane_with_a_tiny_measurement() -> None:
    spec = measure_cpu(**TINY)
    for value in (*spec.peak_flops.values(), spec.mem_bandwidth, spec.mem_capacity, spec.details["copy_bandwidth"]):
        assert math.isfinite(value) and value > 0
    assert spec.name == "measured" and "fp32" in spec.peak_flops
    assert spec.details["bandwidth_bytes"] == 1 << 20
    # the read ceiling is the faster of the two read probes
    probes = (spec.details["read_bandwidth_sum"], spec.details["read_bandwidth_gemv"])
    assert spec.mem_bandwidth == spec.details["read_bandwidth"] == max(probes)
    assert spec.balance_point("fp32") > 0
    # each probe reports its own repeatability: (max - min) / median of its timed calls, the worst of them overall
    spread = spec.details["spread"]
    assert {"matmul_fp32", "read_sum", "read_gemv", "copy"} <= set(spread) and all(v >= 0 for v in spread.values())
    assert spec.details["repeatability"] == max(spread.values())


def test_an_emulated_dtype_is_probed_at_the_small_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 on an ISA without bf16 matrix kernels runs ~100x below fp32: probed at matmul_n it took ~20 s a notebook
    monkeypatch.setattr(hardware, "isa_emulated_dtype_note", lambda dtype: "emulated" if dtype == "bf16" else None)
    spec = measure_cpu(**{**TINY, "matmul_n": hardware.EMULATED_MATMUL_N + 44})
    assert spec.details["matmul_n_by_dtype"] == {
        "fp32": hardware.EMULATED_MATMUL_N + 44,
        "bf16": hardware.EMULATED_MATMUL_N,
    }
    n = hardware.EMULATED_MATMUL_N
    assert spec.peak_flops["bf16"] == pytest.approx(2.0 * n**3 / spec.details["matmul_median_s"]["bf16"])


def test_measured_spec_caches_in_memory_and_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "_MEASURED", {})
    calls = []

    def tiny_measure() -> HardwareSpec:
        calls.append(1)
        return measure_cpu(**TINY)

    monkeypatch.setattr(hardware, "measure_cpu", tiny_measure)
    first = measured_spec("cpu", cache_dir=tmp_path)
    assert measured_spec("cpu", cache_dir=tmp_path) is first  # the session cache
    assert get_hardware("measured-cpu") is first
    files = list(tmp_path.glob("hardware-cpu-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["name"] == "measured"
    monkeypatch.setattr(hardware, "_MEASURED", {})
    assert measured_spec("cpu", cache_dir=tmp_path) == first  # read back from the file, not measured
    assert len(calls) == 1
    measured_spec("cpu", cache_dir=tmp_path, refresh=True)
    assert len(calls) == 2
    # a file written by older probes is measured over
    stale = json.loads(files[0].read_text())
    stale["details"]["probe_version"] = hardware.PROBE_VERSION - 1
    files[0].write_text(json.dumps(stale))
    monkeypatch.setattr(hardware, "_MEASURED", {})
    measured_spec("cpu", cache_dir=tmp_path)
    assert len(calls) == 3
    with pytest.raises(ConfigError, match="device"):
        measured_spec("tpu")


def test_hardware_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "295.4" in out
    assert main(["hardware", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == set(NAMES)
    tiny = measure_cpu(**TINY)
    monkeypatch.setattr(hardware, "measured_spec", lambda device, refresh=False: tiny)
    assert main(["hardware", "--measure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured"]["details"]["matmul_n"] == 64


# ---- the emulated-dtype warning ----------------------------------------------------------------------------------
def test_emulated_dtype_note_thresholds():
    from workbench.hardware import EMULATED_RATIO, emulated_dtype_note

    # issue 15's AMD EPYC: bf16 about 1 GFLOP/s against 170 for fp32
    note = emulated_dtype_note("bf16", 1e9, 170e9)
    assert note is not None and "bf16" in note and "170x slower" in note and "--dtype fp32" in note
    assert emulated_dtype_note("bf16", 3 * 170e9, 170e9) is None  # units (AMX) make it faster than fp32
    assert emulated_dtype_note("fp16", EMULATED_RATIO * 100e9, 100e9) is None  # at the threshold: not emulated
    assert emulated_dtype_note("fp32", 1.0, 100e9) is None  # fp32 is the reference, never emulated


def test_isa_emulated_dtype_note_follows_the_isa_torch_reports(monkeypatch):
    import platform

    import torch

    from workbench.hardware import isa_emulated_dtype_note

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # this project's AMD EPYC
    note = isa_emulated_dtype_note("bfloat16")
    assert note is not None and "bf16" in note and "AVX2" in note and "--dtype fp32" in note
    assert isa_emulated_dtype_note("fp32") is None  # the reference, never emulated
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # oneDNN's bf16 kernels
    assert isa_emulated_dtype_note("bf16") is None
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    assert "fp16" in isa_emulated_dtype_note("fp16")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # ISA names that say nothing about bf16 units
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    assert isa_emulated_dtype_note("bf16") is None


def test_warn_if_emulated_measures_only_reduced_precision_on_a_cpu(capsys, monkeypatch):
    from workbench import hardware

    assert hardware.warn_if_emulated("fp32", "cpu") is None and "fp32" not in hardware._DTYPE_RATES
    assert hardware.warn_if_emulated("bf16", "cuda") is None
    bf16, fp32 = hardware.cpu_matmul_rates("bf16")  # this CPU, measured
    assert bf16 > 0 and fp32 > 0 and hardware.cpu_matmul_rates("bf16") == (bf16, fp32)  # once per process
    # an emulating CPU (rates as issue 15 measured them): one line on stderr, once
    monkeypatch.setitem(hardware._DTYPE_RATES, "fp16", (1e9, 170e9))
    monkeypatch.setattr(hardware, "_WARNED", set())
    assert "emulated" in hardware.warn_if_emulated("fp16", "cpu")
    assert hardware.warn_if_emulated("fp16", "cpu") is not None
    err = capsys.readouterr().err
    assert err.count("warning: fp16 matrix products are emulated") == 1
