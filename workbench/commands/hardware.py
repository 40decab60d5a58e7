"""``workbench hardware``: the accelerator table, and with ``--measure`` this machine's measured ceilings."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``workbench hardware``."""
    parser.add_argument("--measure", action="store_true", help="measure this machine's ceilings (a few seconds)")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="device to measure (default: auto)"
    )
    parser.add_argument(
        "--cached", action="store_true", help="with --measure: reuse the cached measurement if there is one"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    """Print the table (and the measured row)."""
    from workbench.hardware import get_hardware, hardware_names, measured_spec

    specs = [get_hardware(name) for name in hardware_names() if name != "measured"]
    if args.measure:
        specs.append(measured_spec(args.device, refresh=not args.cached))
    if args.json:
        print(json.dumps({spec.name: spec.to_dict() for spec in specs}, indent=2))
        return 0
    header = f"{'name':<10} {'fp32':>7} {'bf16':>8} {'fp8':>8} {'TB/s':>7} {'GiB':>6} {'balance':>8}  description"
    print(header)
    print(f"{'':<10} {'TFLOP/s':>7} {'TFLOP/s':>8} {'TFLOP/s':>8} {'':>7} {'':>6} {'bf16':>8}")
    for spec in specs:
        tf = {k: v / 1e12 for k, v in spec.peak_flops.items()}
        fp8 = f"{tf['fp8']:8.1f}" if "fp8" in tf else f"{'-':>8}"
        bf16 = f"{tf['bf16']:8.1f}" if "bf16" in tf else f"{'-':>8}"
        print(
            f"{spec.name:<10} {tf['fp32']:7.1f} {bf16} {fp8} {spec.mem_bandwidth / 1e12:7.3f} "
            f"{spec.mem_capacity / 2**30:6.0f} {spec.balance_point('bf16'):8.1f}  {spec.display_name}"
        )
    if args.measure:
        spec = specs[-1]
        d = spec.details
        print(
            f"\nmeasured: {spec.source}\n  matmul peak "
            + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in spec.peak_flops.items())
            + f"; read {d.get('read_bandwidth', 0) / 1e9:.2f} GB/s, copy {d.get('copy_bandwidth', 0) / 1e9:.2f} GB/s"
            + f" ({d.get('bandwidth_bytes', 0) / 2**20:.0f} MiB tensors); roofline memory ceiling "
            f"{spec.mem_bandwidth / 1e9:.2f} GB/s"
        )
    print(
        "\nFigures are dense peaks from vendor datasheets; sources: workbench hardware --json, "
        "data/hardware/accelerators.yaml"
    )
    return 0
