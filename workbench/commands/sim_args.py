"""Options shared by ``workbench roofline``, ``simulate`` and ``plan``: number formats, parallelism, calibration.

vLLM's names: ``--dtype`` (activations), ``--quantization`` (weights), ``--group-size`` (int4), ``--kv-cache-dtype``,
``--tensor-parallel-size``, ``--pipeline-parallel-size``, ``--expert-parallel-size`` (MoE); per phase of a disaggregated
pool ``--prefill-tp`` and ``--decode-tp``. ``--calibration hardware`` (the default) prices operations with the
accelerator's calibrated efficiencies, kernel floor and per-step overhead from ``data/hardware/accelerators.yaml``;
``ideal`` is the bare roofline. ``--step-overhead-s`` overrides the per-step host overhead. Plain argparse, nothing
heavy imported.
"""

from __future__ import annotations

import argparse
from typing import Any

from workbench.commands.common import ArgumentContainer
from workbench.errors import ConfigError

ACT_DTYPES = ("bf16", "fp16", "fp32")
CALIBRATIONS = ("hardware", "ideal")


def add_format_arguments(p: ArgumentContainer) -> None:
    """--dtype, --quantization, --group-size, --kv-cache-dtype (its older spelling --kv-dtype warns), generated from
    ``ServingConfig`` with the simulator's defaults (``SimConfig``: a GPU server, bf16)."""
    from workbench.commands.common import FORMAT_FIELDS, add_serving_arguments
    from workbench.sim.cluster import SimConfig

    add_serving_arguments(p, SimConfig, FORMAT_FIELDS)


def add_parallel_arguments(p: ArgumentContainer, per_phase: bool = True) -> None:
    """--tensor-parallel-size, --pipeline-parallel-size and, with ``per_phase``, --prefill-tp / --decode-tp."""
    from workbench.commands.common import add_serving_arguments
    from workbench.sim.cluster import SimConfig

    add_serving_arguments(p, SimConfig, ("tensor_parallel_size",))
    p.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages per replica")
    add_expert_parallel_argument(p)
    if per_phase:
        p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                       help="with --disaggregate: the prefill side's TP (default: --tensor-parallel-size)")  # fmt: skip
        p.add_argument("--decode-tp", type=int, default=None, metavar="N",
                       help="with --disaggregate: the decode side's TP (default: --tensor-parallel-size)")  # fmt: skip


def add_expert_parallel_argument(p: ArgumentContainer) -> None:
    """--expert-parallel-size: a mixture of experts' routed experts split over that many GPUs per stage, attention
    data-parallel over them (DeepSeek-V3's layout; tensor parallel size 1)."""
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="MoE: GPUs per stage splitting the routed experts (attention data-parallel over them, an "
                   "all-to-all per MoE layer; needs --tensor-parallel-size 1)")  # fmt: skip


def add_calibration_arguments(p: ArgumentContainer) -> None:
    """--calibration hardware|ideal, --step-overhead-s."""
    p.add_argument("--calibration", default="hardware", choices=CALIBRATIONS,
                   help="hardware: the accelerator's calibrated efficiencies, kernel floor and step overhead "
                   "(accelerators.yaml); ideal: the bare roofline (default hardware)")  # fmt: skip
    p.add_argument("--step-overhead-s", type=float, default=None,
                   help="host time per step in seconds (default: the calibration's)")  # fmt: skip


def format_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """dtype, quantization, group_size, kv_cache_dtype from the options; an FP8/int8 --dtype is refused here."""
    if str(args.dtype).lower() in ("fp8", "int8", "float8"):
        raise ConfigError(f"--dtype is the activations' ({', '.join(ACT_DTYPES)}), got {args.dtype!r}: FP8 or int8 "
                          "weights are --quantization fp8/int8, an FP8 cache --kv-cache-dtype fp8")  # fmt: skip
    return {"dtype": args.dtype, "quantization": None if args.quantization == "none" else args.quantization,
            "group_size": args.group_size, "kv_cache_dtype": args.kv_cache_dtype}  # fmt: skip


def calibration_of(args: argparse.Namespace, hardware: Any) -> Any:
    """The ``Calibration`` the options ask for on ``hardware`` (a spec or a name)."""
    from workbench.hardware import IDEAL, get_hardware

    cal = IDEAL if args.calibration == "ideal" else get_hardware(hardware).calibration
    if args.step_overhead_s is not None:
        if not args.step_overhead_s >= 0:
            raise ConfigError(f"--step-overhead-s must be >= 0, got {args.step_overhead_s}")
        cal = cal.replace(step_overhead_s=float(args.step_overhead_s))
    return cal
