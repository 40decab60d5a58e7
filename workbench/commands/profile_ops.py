"""``workbench profile-ops``: time every operation of a model on this machine into an op profile.

    workbench profile-ops --model PRESET [--out data/profiles/op-MODEL-MACHINE.json] [--device auto|cpu|cuda]
        [--dtype fp32] [--attention-backend auto|cpu|torch|triton] [--threads N] [--max-tokens N] [--tokens ...]
        [--prompt-lens ...] [--contexts ...] [--batch-sizes ...] [--max-repeats N] [--no-packed-linears]
        [--no-overhead] [--overhead-requests N] [--json]

Times the model's own layers (``workbench.sim.op_timing.profile_ops``): the QKV, O, gate/up and down projections,
RMSNorm, rotary, the SiLU * up activation, the residual add and the KV write over the step's tokens; embedding and
the rotary table once a step; the LM head, the sampler and a pure decode's KV write over the sampled rows; attention
over prompt length (prefill), over context (a decode attended alone) and over batch x context (a pure decode in one
gather), through the attention backend the engine runs (``--attention-backend``, the engine's
``EngineConfig.attention_backend`` names; ``auto``, the default, resolved as the engine resolves it: the paged C++
decode on a CPU where its op builds, else torch; the profile records the backend it timed). Each point is a median
over repeats after warm-up, with min and max, in each of ``--passes`` sweeps over all points; the profile keeps the
median of the passes' medians (a burst of load from another process moves one pass, not the profile). The linear
layers are timed as the engine runs them: with packed weights where they are large enough to pay
(``EngineConfig.packed_linears``, the default, and ``PACKED_MIN_WEIGHT``; ``--no-packed-linears`` for an engine
without them). Then, unless ``--no-overhead``, it replays short workloads on
the real engine and fits the per-step overhead the summed operations miss (``workbench.sim.op_profile``). The file
records the machine (``workbench.hardware``), torch's thread count and the load average at the start and the end.
Use it with ``workbench simulate --cost-model op-profile --profile FILE``.
"""

from __future__ import annotations

import argparse
import json

from workbench.timing import set_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workbench.engine.config import ATTENTION_BACKENDS

    p.add_argument("--model", default="tiny-gqa", help="preset or config.json, random weights (default tiny-gqa)")
    p.add_argument("--out", default=None, help="profile file (default data/profiles/op-<model>-<machine>.json)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="the engine's attention backend to time (default auto: as the engine resolves it, the paged "
                   "C++ decode on a CPU where it builds, else torch)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as fit-profile)")
    p.add_argument("--max-tokens", type=int, default=2048, help="largest token count, prompt and context measured")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts of the dense operations")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="sampled rows of the LM head and sampler")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="prompt lengths of prefill attention")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths of decode attention")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="batch sizes of decode attention")
    p.add_argument("--passes", type=int, default=3,
                   help="sweeps over every point, interleaved (median of the passes' medians)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2, help="warm-up calls per point")
    p.add_argument("--max-repeats", type=int, default=15, help="timed calls per point at most (at least 3)")
    p.add_argument("--target-ms", type=float, default=50.0, help="aim of the timed calls' total per point, ms")
    p.add_argument("--no-packed-linears", action="store_true",
                   help="time plain linear layers, for an engine run with packed_linears off (default: packed, as "
                   "the engine runs them)")  # fmt: skip
    p.add_argument("--no-overhead", action="store_true", help="skip the engine runs that fit the per-step overhead")
    p.add_argument("--overhead-requests", type=int, default=24, help="requests per workload of the overhead fit")
    p.add_argument("--max-num-seqs", type=int, default=16, help="engine setting of the overhead fit")
    p.add_argument("--max-model-len", type=int, default=256, help="engine setting of the overhead fit")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def run(args: argparse.Namespace) -> int:
    from workbench.commands.common import check_output_file
    from workbench.errors import ConfigError
    from workbench.sim.measure import default_op_profile_path

    counts = ("threads", "passes", "max_tokens", "max_repeats", "overhead_requests", "max_num_seqs", "max_model_len")
    for name in counts:
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.warmup < 0 or not args.target_ms > 0:
        raise ConfigError(f"--warmup must be >= 0 and --target-ms > 0, got {args.warmup}, {args.target_ms}")

    import os

    import torch

    from workbench.atomic import atomic_write_text
    from workbench.config import ModelConfig
    from workbench.device import resolve_device
    from workbench.experiments.hygiene import cpu_times, load_average, steal_share
    from workbench.hardware import cpu_model_name, physical_memory_bytes
    from workbench.sim.op_profile import OpProfileCostModel
    from workbench.sim.op_timing import check_grid_arg, measure_overhead, profile_ops

    cfg = ModelConfig.resolve(args.model)
    dev = resolve_device(args.device)
    machine = {"name": cpu_model_name() if dev.type == "cpu" else torch.cuda.get_device_name(dev),
               "cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
               "memory_bytes": physical_memory_bytes(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
    out = args.out or default_op_profile_path(cfg.name, machine["name"])
    check_output_file(out, "--out")
    grids = {key: check_grid_arg(getattr(args, key), key.replace("_", "-"))
             for key in ("tokens", "rows", "prompt_lens", "contexts", "batch_sizes")}  # fmt: skip
    set_threads(args.threads, what="--threads")
    load_start, times_start = load_average(), cpu_times()
    profile = profile_ops(
        args.model, str(dev), args.dtype, args.attention_backend, {k: v for k, v in grids.items() if v},
        args.max_tokens, args.warmup, args.max_repeats, args.target_ms / 1e3, args.seed, not args.no_progress,
        args.passes, not args.no_packed_linears,
    )  # fmt: skip
    profile["model"] = cfg.name
    if not args.no_overhead:
        profile["overhead"] = measure_overhead(
            profile, num_requests=args.overhead_requests, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
        )  # fmt: skip
    profile["machine"] = machine
    profile["load_average_start"], profile["load_average_end"] = load_start, load_average()
    profile["cpu_steal_share"] = steal_share(times_start, cpu_times())
    OpProfileCostModel.from_dict(profile, "the new profile")  # what simulate will read back
    atomic_write_text(out, json.dumps(profile, indent=1) + "\n")
    if args.json:
        print(json.dumps({**profile, "path": out}))
        return 0
    print(f"op profile written to {out}: {cfg.name} on {machine['name']} ({dev}, {args.dtype}, "
          f"{profile['attention_backend']} attention, {profile['threads']} thread(s)), load average {load_start} -> "
          f"{profile['load_average_end']}")  # fmt: skip
    for name, entry in profile["ops"].items():
        if "values" in entry:
            first, last = entry["median_s"][0], entry["median_s"][-1]
            print(f"  {name:24s} {entry['x']:>10s} {entry['values'][0]}..{entry['values'][-1]}: "
                  f"{first * 1e6:9.1f} .. {last * 1e6:11.1f} us")  # fmt: skip
        else:
            print(f"  {name:24s} batch {entry['batch_sizes'][0]}..{entry['batch_sizes'][-1]} x context "
                  f"{entry['contexts'][0]}..{entry['contexts'][-1]}: {entry['median_s'][0][0] * 1e6:.1f} .. "
                  f"{entry['median_s'][-1][-1] * 1e6:.1f} us")  # fmt: skip
    over = profile["overhead"]
    if over:
        fit = over["fit"]
        coef = ", ".join(f"{k} {v:.3g}" for k, v in over["coefficients"].items())
        print(f"  overhead: {coef}; host gap {over['host_gap_s'] * 1e3:.3f} ms")
        print(f"  over {fit['num_steps']} engine steps: summed operations alone off by "
              f"{100 * fit['ops_only_median_rel_error']:.1f}% (median), with the overhead "
              f"{100 * fit['median_rel_error']:.1f}% (median), {100 * fit['p90_rel_error']:.1f}% (p90)")  # fmt: skip
    return 0
