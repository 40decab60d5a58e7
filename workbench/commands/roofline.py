"""``workbench roofline``: per-operation FLOPs, bytes and bounds of prefill and decode on a hardware."""

from __future__ import annotations

import argparse
import json
import math

from workbench.roofline import StepCost


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``workbench roofline`` (a contract: other rooms and notebooks use these names)."""
    parser.add_argument("--model", required=True, help="preset name, config.json or checkpoint directory")
    parser.add_argument("--hardware", default="h100-sxm", help="hardware name, or 'measured' (default: h100-sxm)")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the batch (default: 1)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill: prompt tokens per sequence")
    parser.add_argument(
        "--context-len", type=int, default=512, help="decode: context length per sequence (keys attended)"
    )
    parser.add_argument("--dtype", default="bf16", help="weights and activations: bf16, fp16 or fp32")
    parser.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: the activation dtype)")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="also draw both phases' operations on the roofline into FILE (.png, .svg)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object (keys prefill, decode)")


def _count(n: float) -> str:
    """A parameter count in the unit that reads: 135.0M, 8.03B, 512.0K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def flops_text(flops_per_s: float) -> str:
    """FLOP/s in the unit that reads (GFLOP/s for a CPU, TFLOP/s for a GPU)."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.4g} TFLOP/s"
    return f"{flops_per_s / 1e9:.4g} GFLOP/s"


def bandwidth_text(bytes_per_s: float) -> str:
    """Bytes/s in the unit that reads (GB/s below 1 TB/s)."""
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.4g} TB/s"
    return f"{bytes_per_s / 1e9:.4g} GB/s"


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:8.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:7.3f} ms"
    return f"{seconds * 1e6:7.2f} us"


def _print_phase(title: str, cost: StepCost) -> None:
    print(f"\n{title}")
    print(f"  {'op':<14} {'GFLOP':>11} {'MB':>11} {'FLOP/B':>9} {'bound':>8} {'time':>11} {'share':>6}")
    for op in cost.ops or ():
        inten = "inf" if math.isinf(op.intensity) else f"{op.intensity:9.2f}"
        share = op.time_s / cost.time_s * 100 if cost.time_s else 0.0
        print(
            f"  {op.name:<14} {op.flops / 1e9:11.3f} {op.bytes / 1e6:11.3f} {inten:>9} {op.bound:>8} "
            f"{_fmt_time(op.time_s):>11} {share:5.1f}%"
        )
    kinds = cost.bytes_by_kind()
    print(
        f"  {'total':<14} {cost.flops / 1e9:11.3f} {cost.bytes / 1e6:11.3f} {cost.intensity:9.2f} "
        f"{cost.bound:>8} {_fmt_time(cost.time_s):>11}"
    )
    print("  bytes: " + ", ".join(f"{k} {v / 1e6:.1f} MB ({v / cost.bytes * 100:.0f}%)" for k, v in kinds.items()))


def run(args: argparse.Namespace) -> int:
    """Print the per-operation tables and phase summaries, or the JSON object."""
    from workbench.roofline import get_model, phase_report

    report = phase_report(
        args.model,
        args.hardware,
        batch=args.batch,
        prompt_len=args.prompt_len,
        context_len=args.context_len,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
    )
    model = get_model(args.model, args.hardware, dtype=args.dtype, kv_dtype=args.kv_dtype)
    if args.plot:
        from workbench import plots

        plots.use_file_backend()
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 6.5))
        phases = {
            f"prefill {args.batch}x{args.prompt_len}": model.prefill([args.prompt_len] * args.batch),
            f"decode {args.batch}@{args.context_len}": model.decode([args.context_len] * args.batch),
        }
        plots.plot_roofline(model.hw, phases, dtype=model.act_dtype, ax=ax)
        ax.set_title(f"{model.cfg.name} on {ax.get_title().removeprefix('Roofline: ')}")
        plots.save_figure(fig, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False, default=str))
        return 0
    hw = model.hw
    print(
        f"{model.cfg.name} ({model.cfg.attention_kind}, {_count(model.cfg.num_params())} params) on "
        f"{hw.display_name or hw.name}: weights {model.dtype}, activations {model.act_dtype}, KV {model.kv_dtype}"
    )
    print(
        f"ceilings: {flops_text(model.matmul_peak)} ({model.act_dtype}), "
        f"{bandwidth_text(hw.mem_bandwidth)}; balance point {report['balance_point']:.3g} FLOP/byte"
    )
    _print_phase(
        f"prefill: {args.batch} x {args.prompt_len} prompt tokens",
        model.prefill([args.prompt_len] * args.batch),
    )
    _print_phase(
        f"decode: {args.batch} sequences at context {args.context_len}, one token each",
        model.decode([args.context_len] * args.batch),
    )
    bound_batch = report["decode_compute_bound_batch"]
    print(
        f"\nTTFT floor {_fmt_time(report['ttft_floor_s']).strip()}, ITL floor "
        f"{_fmt_time(report['itl_floor_s']).strip()}; decode at context {args.context_len} turns compute-bound at "
        + (f"batch {bound_batch}" if bound_batch else "no batch size (KV reads grow as fast as FLOPs)")
    )
    if args.plot:
        print(f"figure: {args.plot}")
    return 0
