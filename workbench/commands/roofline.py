"""``workbench roofline``: per-operation FLOPs, bytes and bounds of prefill and decode on a hardware.

With ``--tensor-parallel-size`` / ``--pipeline-parallel-size`` the table is one GPU's (its shard, its stage) and
the communication rows (``tp_all_reduce``, ``lm_head_gather``, ``pp_send``, ``pipeline_bubble``, with
``--disaggregate`` ``kv_transfer``) complete the step's wall time on the whole group; ``--calibration hardware``
(the default) adds the accelerator's kernel floor, efficiencies and per-step overhead (``step_overhead``). A
configuration whose weights and KV do not fit in a GPU's memory is an error naming a size that would fit.
"""

from __future__ import annotations

import argparse
import json
import math

from workbench.commands.sim_args import (
    add_calibration_arguments,
    add_format_arguments,
    add_parallel_arguments,
    calibration_of,
    format_kwargs,
)
from workbench.errors import ConfigError
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
    add_format_arguments(parser)
    add_parallel_arguments(parser, per_phase=True)
    parser.add_argument("--disaggregate", action="store_true",
                        help="prefill and decode on their own groups (--prefill-tp, --decode-tp); the prefill phase "
                        "ends with the KV transfer to the decode group")  # fmt: skip
    add_calibration_arguments(parser)
    parser.add_argument("--ignore-memory", action="store_true",
                        help="price a configuration whose weights and KV do not fit in memory anyway")  # fmt: skip
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
    from workbench.roofline import get_model, kv_transfer_op, phase_report, with_op

    formats = format_kwargs(args)
    if (args.prefill_tp is not None or args.decode_tp is not None) and not args.disaggregate:
        raise ConfigError("--prefill-tp and --decode-tp need --disaggregate (one group runs both phases otherwise)")
    cal = calibration_of(args, args.hardware)
    kw = dict(dtype=formats["dtype"], kv_dtype=formats["kv_cache_dtype"], quantization=formats["quantization"],
              group_size=formats["group_size"], pipeline_parallel_size=args.pipeline_parallel_size,
              calibration=cal, expert_parallel_size=args.expert_parallel_size)  # fmt: skip
    report = phase_report(
        args.model, args.hardware, batch=args.batch, prompt_len=args.prompt_len, context_len=args.context_len,
        tensor_parallel_size=args.tensor_parallel_size, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
        disaggregate=args.disaggregate, check_memory=not args.ignore_memory, **kw,
    )  # fmt: skip
    pm = get_model(args.model, args.hardware, tensor_parallel_size=report["prefill_tp"], **kw)
    dm = get_model(args.model, args.hardware, tensor_parallel_size=report["decode_tp"], **kw)
    prefill = pm.prefill([args.prompt_len] * args.batch)
    if args.disaggregate:
        prefill = with_op(prefill, kv_transfer_op(pm, args.batch * args.prompt_len, dm.shard.num_gpus))
    decode = dm.decode([args.context_len] * args.batch)
    if args.plot:
        from workbench import plots

        plots.use_file_backend()
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 6.5))
        phases = {f"prefill {args.batch}x{args.prompt_len}": prefill, f"decode {args.batch}@{args.context_len}": decode}
        plots.plot_roofline(pm.hw, phases, dtype=pm.act_dtype, ax=ax)
        ax.set_title(f"{pm.cfg.name} on {ax.get_title().removeprefix('Roofline: ')}")
        plots.save_figure(fig, args.plot)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2, allow_nan=False, default=str))
        return 0
    hw = pm.hw
    print(
        f"{pm.cfg.name} ({pm.cfg.attention_kind}, {_count(pm.cfg.num_params())} params) on "
        f"{hw.display_name or hw.name}: weights {pm.dtype}, activations {pm.act_dtype}, KV {pm.kv_dtype}; "
        f"calibration {args.calibration}"
    )
    print(
        f"ceilings: {flops_text(pm.matmul_peak)} ({pm.quantization if pm.quantization == 'fp8' else pm.act_dtype}), "
        f"{bandwidth_text(hw.mem_bandwidth)}; balance point {report['balance_point']:.3g} FLOP/byte"
    )
    for phase, model in (("prefill", pm), ("decode", dm)):
        gib = 2**30
        mem = report["memory"].get(phase)
        fit = f", {mem['free_bytes'] / gib:.1f} GiB free per GPU" if mem else ""
        ep = f" x EP {model.expert_parallel_size}" if model.expert_parallel_size > 1 else ""
        print(f"{phase}: TP {model.tensor_parallel_size} x PP {model.pipeline_parallel_size}{ep} "
              f"({model.shard.num_gpus} GPU(s)), {model.weight_bytes_per_gpu() / gib:.2f} GiB of weights per GPU"
              f"{fit}")  # fmt: skip
    _print_phase(f"prefill: {args.batch} x {args.prompt_len} prompt tokens (per GPU; time: the group's wall time)",
                 prefill)  # fmt: skip
    _print_phase(f"decode: {args.batch} sequences at context {args.context_len}, one token each", decode)
    bound_batch = report["decode_compute_bound_batch"]
    print(
        f"\nTTFT floor {_fmt_time(report['ttft_floor_s']).strip()}, ITL floor "
        f"{_fmt_time(report['itl_floor_s']).strip()}; decode at context {args.context_len} turns compute-bound at "
        + (f"batch {bound_batch}" if bound_batch else "no batch size (KV reads grow as fast as FLOPs)")
    )
    if args.plot:
        print(f"figure: {args.plot}")
    return 0
