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


def _balance(value: float) -> str:
    """A balance point with a readable precision: 295.4 on a GPU, 0.0312 on a CPU's bf16 (not 0.0)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def run(args: argparse.Namespace) -> int:
    """Print the table (and the measured row)."""
    from workbench.hardware import get_hardware, hardware_names, measured_spec

    specs = [get_hardware(name) for name in hardware_names() if name != "measured"]
    if args.measure:
        specs.append(measured_spec(args.device, refresh=not args.cached))
    if args.json:
        print(json.dumps({spec.name: spec.to_dict() for spec in specs}, indent=2))
        return 0
    from workbench.commands.roofline import bandwidth_text, flops_text

    header = (
        f"{'name':<10} {'fp32':>14} {'bf16':>14} {'fp8':>14} {'memory':>11} {'GiB':>6} {'balance':>12}  description"
    )
    print(header)
    print(f"{'':<10} {'':>14} {'':>14} {'':>14} {'read':>11} {'':>6} {'FLOP/B bf16':>12}")
    for spec in specs:
        cols = [f"{flops_text(spec.peak_flops[k]):>14}" if k in spec.peak_flops else f"{'-':>14}"
                for k in ("fp32", "bf16", "fp8")]  # fmt: skip
        print(
            f"{spec.name:<10} {' '.join(cols)} {bandwidth_text(spec.mem_bandwidth):>11} "
            f"{spec.mem_capacity / 2**30:6.0f} {_balance(spec.balance_point('bf16')):>12}  {spec.display_name}"
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
