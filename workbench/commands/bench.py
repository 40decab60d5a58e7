"""``workbench bench``: the engine's speed against this machine's ceilings and against HF transformers.

    workbench bench decode  [--model PRESET_OR_PATH] [--dtype fp32] [--batch 1 8 32] [--prompt-len 128] [--json]
                            [--quantization none int8 int4] [--group-size 128] [--kv-cache-dtype auto int8]
    workbench bench prefill [--model ...] [--prompt-len 128 512 1024] [--json]
    workbench bench offline [--model ...] [--num-requests 64] [--context 256] [--max-num-seqs 32] [--json]
                            [--policy continuous] [--max-num-batched-tokens N] [--enable-prefix-caching]
                            [--breakdown [--top-ops 12]]
    workbench bench hf      [--model ...] [--prompt-len 32] [--new-tokens 32] [--no-offline] [--json]
    workbench bench serve   --base-url URL --model NAME [vllm bench serve's flags]   (workbench.commands.bench_serve)
    workbench bench linear | quant-ops | attention | compiled | decode-parts | roofline | allreduce | gpu-costs
                    | simulator | op-steps | vllm | serve-load    (one part of the stack on its own:
                    workbench.commands.bench_tools)
    workbench bench soak    [--model tiny-gqa] [--num-requests 2000] [--abort-fraction 0.1] [--speculative-config JSON]
                            [--server]   (workbench.commands.bench_soak: no leaked block, no finished request held)
    workbench bench speculative [--speculative-config JSON] [--batch 1 2 4 8] [--cost-model profiled] [--json]
                            (workbench.commands.bench_speculative: measured speed-up against the simulator's)

``--model`` defaults to the CPU benchmark preset ``bench-300m`` (random weights, ~300M parameters); a directory
loads a real checkpoint. ``--threads`` sets torch's intra-op threads (default: every usable core) and is
reported. With ``--json`` one object is printed: ``results`` holds one row per batch size (decode: ``tokens_per_s``,
``mbu``, ``gemv_ratio``, ``overhead_share``) or prompt length (prefill: ``mfu``); ``offline`` its tokens/s;
``hf`` holds ``decode`` and ``offline``, each with ``ours_tokens_per_s``, ``hf_tokens_per_s``, ``ratio`` and
``identical_tokens``; ``offline --breakdown`` adds ``breakdown``, the set once more by kind of step
(``workbench.bench.offline_breakdown``). The machine's ceilings (``workbench.hardware.measured_spec``) are measured
again at the start of each run, so that MBU and MFU divide by figures taken under the same load
(``--cached-ceilings`` reuses the cached ones). See ``workbench.bench`` for what is measured and how.

``bench decode`` with several ``--quantization`` / ``--group-size`` / ``--kv-cache-dtype`` values compares the schemes
in one run (``workbench.experiments.levers``): their decode steps interleaved, ``results`` one row per scheme and
batch (``tokens_per_s``, ``bytes_per_step``, ``achieved_bytes_per_s``, ``mbu``, ``speedup`` and ``bytes_ratio`` over
the first scheme), ``accuracy`` (cosine, KL, top-1 agreement of logits against the unquantized model) and
``kv_capacity`` (sequences of the run's context that fit the default KV budget).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from workbench.commands import bench_tools as tools

KINDS = ("decode", "prefill", "offline", "hf", "serve", "soak", "speculative", *tools.TOOL_HELP)
MODE_HELP = {
    "decode": "decode steps per batch size: tokens/s, MBU, the matrix-vector share (several --quantization "
    "values: compared in one run)",
    "prefill": "prefill per prompt length: time and MFU",
    "offline": "an offline request set through the engine: output tokens/s (vLLM: bench throughput)",
    "hf": "our engine against HF transformers on the same prompts",
    "serve": "load an OpenAI-compatible server the way vllm bench serve does",
    "soak": "many requests with aborts through the engine (or --server: workbench serve): no leaked block, no "
    "finished request held, flat memory",
    "speculative": "speculative decoding's speed-up against batch size, measured beside the simulator's prediction",
    **tools.TOOL_HELP,  # one part of the stack on its own (workbench.commands.bench_tools)
}
ALIASES = {"throughput": "offline"}  # vLLM's name of the offline benchmark
ENGINE_MODES = ("decode", "prefill", "offline", "hf", "speculative")


def _mode_options(p: argparse.ArgumentParser, kind: str | None) -> None:
    """The options of ``bench kind`` (``kind`` None: every mode's, for their defaults). Each option belongs to the
    modes that read it; a flag of another mode is an unrecognized argument there (with a hint at its mode)."""
    from workbench.commands.common import add_serving_arguments
    from workbench.engine.config import EngineConfig

    def owns(*kinds: str) -> bool:
        return kind is None or kind in kinds

    if kind not in tools.NO_MODEL:
        p.add_argument("--model", default="tiny-gqa" if kind == "soak" else "bench-300m",
                       help="preset name, config.json or checkpoint directory")  # fmt: skip
    if owns(*ENGINE_MODES):
        add_serving_arguments(p, EngineConfig, ("dtype",))
        p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    if owns(*ENGINE_MODES, *tools.uses("threads")):
        p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all usable cores)")
    if owns("decode", "speculative", *tools.uses("batch")):
        p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8] if kind == "speculative" else [1, 8, 32],
                       help="decode batch sizes")  # fmt: skip
    if owns("decode"):
        p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="shard the model over N processes, --threads each; rows add the all-reduce share of a "
                       "step and its bandwidth")  # fmt: skip
        p.add_argument("--max-processes", type=int, default=None,
                       help="most worker processes --tensor-parallel-size may start (default: the CPU cores of this "
                       "machine)")  # fmt: skip
    if owns("decode", "prefill", "hf", "speculative", *tools.uses("prompt_len")):
        p.add_argument("--prompt-len", type=int, nargs="+", default=None,
                       help="prompt lengths in tokens (default: prefill 128 512 1024; decode and compiled 128; hf, "
                       "vllm and speculative 32; serve-load 24)")  # fmt: skip
    if owns("decode", *tools.uses("steps")):
        p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    if owns("decode", "prefill", "offline", *tools.uses("warmup")):
        p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps or runs")
    if owns("prefill", "offline", "hf", "speculative", *tools.uses("repeats")):
        p.add_argument("--repeats", type=int, default=6 if kind == "vllm" else 3,
                       help="timed repetitions (speculative: interleaved rounds; vllm: paired rounds, at least 4, "
                       "default 6)")  # fmt: skip
    if owns("hf", *tools.uses("new_tokens")):
        p.add_argument("--new-tokens", type=int, default=32,
                       help="tokens generated per request (hf, vllm: of the batch-1 decode)")  # fmt: skip
    if owns("offline", "hf", *tools.uses("offline_set")):
        p.add_argument("--num-requests", type=int, default=64, help="offline set size")
        p.add_argument("--context", type=int, default=256, help="offline set: longest prompt + output, in tokens")
        add_serving_arguments(p, EngineConfig, ("max_num_seqs",))  # also HF's static batch size
    if owns("hf", *tools.uses("no_offline")):
        p.add_argument("--no-offline", action="store_true", help="skip the offline set (hf: batch-1 decode only)")
    if owns("offline"):
        p.add_argument("--breakdown", action="store_true",
                       help="then the set once more by kind of step: model time, engine overhead, time between steps "
                       "(workbench.bench.offline_breakdown)")  # fmt: skip
        p.add_argument(
            "--top-ops",
            type=int,
            default=12,
            help="with --breakdown: the operators of a torch.profiler run listed (0: no profiler run)",
        )
    if owns("decode"):
        p.add_argument(
            "--attention-backend",
            default="auto",
            choices=("auto", "torch", "triton", "cpu"),
            help="backend (auto: the paged C++ decode 'cpu' on the CPU where it builds, else torch)",
        )
    if owns("decode", "offline", "hf", *tools.uses("compile_decode")):
        p.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                       help="the engine's torch.compile'd decode step (default: on for the CPU with the torch or cpu "
                       "backend; compiled before the timing, once per batch bucket)")  # fmt: skip
    if owns("offline", *tools.uses("compile_prefill")):
        p.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="the engine's compiled prefill and mixed steps (default: as --compile-decode; compiled "
                       "before the timing, once per token-count range)")  # fmt: skip
    if kind not in tools.NO_MODEL:
        p.add_argument("--seed", type=int, default=0, help="seed of random weights, prompts and the request draw")
    if owns("decode", "prefill", "offline", *tools.uses("cached_ceilings")):
        p.add_argument("--cached-ceilings", action="store_true",
                       help="reuse this machine's cached ceilings instead of measuring them again in this "
                       "run")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    if owns("decode", "prefill", "offline"):
        add_serving_arguments(p, EngineConfig, ("quantization", "group_size"), many=True)
    if owns("decode", *tools.uses("kv_cache_dtype")):
        add_serving_arguments(p, EngineConfig, ("kv_cache_dtype",), many=True)
    if owns("decode"):
        p.add_argument("--accuracy-prompts", type=int, default=4,
                       help="with several schemes: random prompts of --prompt-len tokens whose logits are compared "
                       "with the unquantized model's (0 skips the accuracy check)")  # fmt: skip
    if owns("serve"):
        from workbench.commands.bench_serve import add_serve_arguments

        add_serve_arguments(p)  # a client of an OpenAI-compatible server (vLLM's flags)
    tools.add_tool_options(p, owns)
    if owns("soak"):
        from workbench.commands.bench_soak import add_soak_arguments

        add_soak_arguments(p)  # after every other mode's: the options they share keep their declaration
    if owns("speculative"):
        from workbench.commands.bench_speculative import add_speculative_bench_arguments

        add_speculative_bench_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One parser per mode (``bench decode --help`` lists decode's options only); the options a mode does not own
    keep their defaults in its namespace, so ``run`` reads every one."""
    from workbench.parsing import PARSER_OPTIONS, make_parser

    everything = make_parser()
    _mode_options(everything, None)
    defaults = {a.dest: a.default for a in everything._actions if a.dest != "help"}
    sub = p.add_subparsers(dest="kind", metavar="MODE", required=True)
    for kind, text in MODE_HELP.items():
        aliases = [a for a, k in ALIASES.items() if k == kind]
        mode = sub.add_parser(kind, aliases=aliases, help=text, description=text, **PARSER_OPTIONS)  # type: ignore[arg-type]
        _mode_options(mode, kind)
        own = {a.dest for a in mode._actions}
        mode.set_defaults(**{k: v for k, v in defaults.items() if k not in own})


def mode_of_option(flag: str) -> list[str]:
    """The ``bench`` modes that take option ``flag`` (for the hint of an unrecognized argument)."""
    from workbench.parsing import make_parser

    modes = []
    for kind in KINDS:
        parser = make_parser()
        _mode_options(parser, kind)
        if flag in parser._option_string_actions:
            modes.append(kind)
    return modes


def _progress(items: list[Any], desc: str, unit: str) -> Any:
    from workbench.commands.common import progress_bar

    return progress_bar(desc=desc, unit=unit, items=items)


def _machine(hw: Any, threads: int, device: Any) -> dict[str, Any]:
    from workbench.roofline import read_bandwidth

    return {
        "device": str(device),
        "device_name": hw.details.get("device_name", hw.display_name),
        "num_threads": threads,
        "read_bandwidth": read_bandwidth(hw),
        "peak_flops": dict(hw.peak_flops),
    }


def run(args: argparse.Namespace) -> int:
    args.kind = ALIASES.get(args.kind, args.kind)
    if args.kind in tools.TOOL_HELP:
        return tools.run_tool(args)
    if args.kind == "serve":
        from workbench.commands.bench_serve import run_serve

        return run_serve(args)
    if args.kind == "soak":
        from workbench.commands.bench_soak import run_soak

        return run_soak(args)
    if args.kind == "speculative":
        from workbench.commands.bench_speculative import run_speculative

        return run_speculative(args)
    from workbench import bench
    from workbench.device import resolve_device
    from workbench.hardware import measured_spec, warn_if_emulated
    from workbench.runtime import runtime_state
    from workbench.timing import set_threads

    threads = set_threads(args.threads, what="--threads")
    device = resolve_device(args.device)
    emulated = warn_if_emulated(args.dtype, device)
    compile_decode = args.compile_decode
    compilable = device.type == "cpu" and args.attention_backend != "triton"
    if compile_decode is None:  # CUDA replays CUDA graphs instead; the Triton backend is not compiled
        compile_decode = compilable
    # the decode arms: under tensor parallelism, unless one was asked for, eager and compiled side by side
    decode_arms = [False, True] if args.tensor_parallel_size > 1 and args.compile_decode is None and compilable else [
        compile_decode]  # fmt: skip
    out: dict[str, Any] = {"bench": args.kind, "model": args.model, "dtype": args.dtype, "num_threads": threads}
    if emulated:
        out["warning"] = emulated
    schemes = _schemes(args)
    _check_schemes(args, schemes)
    _check_lengths(args, any(decode_arms))
    if args.kind == "hf":
        out |= bench.bench_hf(
            args.model, args.dtype, str(device), prompt_len=(args.prompt_len or [32])[0],
            new_tokens=args.new_tokens, repeats=args.repeats, num_requests=args.num_requests, context=args.context,
            max_num_seqs=args.max_num_seqs, seed=args.seed, offline=not args.no_offline,
            compile_decode=compile_decode,
        )  # fmt: skip
    else:
        # ceilings measured in the same run as the benchmark (a shared machine drifts), unless asked otherwise
        hw = measured_spec(device.type, refresh=not args.cached_ceilings)
        out["machine"] = _machine(hw, threads, device)
        workers = None
        if args.tensor_parallel_size > 1:
            if args.kind != "decode":
                from workbench.errors import ConfigError

                raise ConfigError("--tensor-parallel-size applies to bench decode only")
            from workbench.engine.executor import start_workers

            q, g = (args.quantization or ["none"])[0], (args.group_size or [128])[0]
            workers = start_workers(args.model, args.tensor_parallel_size, args.dtype, str(device), args.seed, threads,
                                    None if q == "none" else q, g)  # fmt: skip
            model = workers.worker.model
            out["tensor_parallel_size"] = args.tensor_parallel_size
        elif schemes is None:
            q, g = (args.quantization or ["none"])[0], (args.group_size or [128])[0]
            model = bench.load_bench_model(args.model, args.dtype, str(device), args.seed, q, g)
        if schemes is not None:
            out |= compare_schemes(args, schemes, hw, str(device), compile_decode)
        elif args.kind == "decode":
            # one batch size at a time, so that the progress bar moves (the first step of each compiles: ~30 s)
            note = ", compiling its decode step" if any(decode_arms) else ""
            out["results"] = []
            sweep = bench.LinearSweep(model.config, model.dtype, model.device, seed=args.seed)  # built once
            for batch in _progress(args.batch, f"decode{note}", "batch"):
                for arm in decode_arms:  # one batch's arms one after the other: their ratio drifts least
                    out["results"] += bench.bench_decode(
                        model,
                        [batch],
                        (args.prompt_len or [128])[0],
                        args.steps,
                        args.warmup,
                        hw,
                        sweep=sweep,
                        seed=args.seed,
                        attention_backend=args.attention_backend,
                        compile_decode=arm,
                        workers=workers,
                        kv_cache_dtype=(args.kv_cache_dtype or ["auto"])[0],
                    )
            if workers is not None:
                workers.shutdown()
        elif args.kind == "prefill":
            out["results"] = []
            for n in _progress(args.prompt_len or [128, 512, 1024], "prefill", "prompt"):
                out["results"] += bench.bench_prefill(model, [n], args.repeats, args.warmup, hw, seed=args.seed)
        else:
            compile_prefill = compile_decode if args.compile_prefill is None else args.compile_prefill
            if args.top_ops < 0:
                from workbench.errors import ConfigError

                raise ConfigError(f"--top-ops must be >= 0 (0: no profiler run), got {args.top_ops}")
            out["offline"] = bench.bench_offline(
                model, args.num_requests, args.context, args.max_num_seqs, args.repeats, seed=args.seed,
                compile_decode=compile_decode, compile_prefill=compile_prefill,
                breakdown_top_ops=args.top_ops if args.breakdown else None,
                engine_options={"policy": args.policy, "token_budget": args.token_budget,
                                "enable_prefix_caching": args.enable_prefix_caching},
            )  # fmt: skip
    out["runtime"] = runtime_state()  # after the runs: allocator, OpenMP, the malloc settings an engine applied
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out))
    return 0


def _schemes(args: argparse.Namespace) -> list | None:
    """The schemes ``bench decode`` compares in one run, or None for a single one (the plain decode benchmark)."""
    from workbench.experiments.levers import make_schemes

    schemes = make_schemes(args.quantization or ["none"], args.group_size or [128], args.kv_cache_dtype or ["auto"],
                           [args.dtype])  # fmt: skip
    return schemes if len(schemes) > 1 else None


def _check_schemes(args: argparse.Namespace, schemes: list | None) -> None:
    """ConfigError, before anything loads, for quantization flags a kind of benchmark does not take."""
    from workbench.errors import ConfigError

    plain = (args.quantization or ["none"]) == ["none"] and (args.kv_cache_dtype or ["auto"]) == ["auto"]
    if args.kind in ("hf", "serve") and not plain:
        raise ConfigError(f"bench {args.kind} runs unquantized; --quantization and --kv-cache-dtype apply to "
                          "decode, prefill and offline")  # fmt: skip
    if args.kind in ("prefill", "offline") and (args.kv_cache_dtype or ["auto"]) != ["auto"]:
        raise ConfigError(f"--kv-cache-dtype applies to bench decode; bench {args.kind} takes --quantization")
    from workbench.commands.common import check_parallel_layout

    if args.kind in ("decode", "prefill", "offline"):
        check_parallel_layout(args)  # before any rank starts: sizes >= 1, the head split, the process count
    if args.accuracy_prompts < 0:
        raise ConfigError(f"--accuracy-prompts must be >= 0 (0 skips the accuracy check), got {args.accuracy_prompts}")
    if schemes is not None and args.kind != "decode":
        raise ConfigError("several --quantization / --group-size / --kv-cache-dtype values are compared by "
                          "bench decode only; give one value each")  # fmt: skip
    if schemes is not None and args.tensor_parallel_size > 1:
        raise ConfigError("comparing quantization schemes runs on one process; drop --tensor-parallel-size")


def _check_lengths(args: argparse.Namespace, compiled: bool) -> None:
    """ConfigError, before the ceilings are measured or a weight loads, for requests beyond the model's positions
    (``workbench.bench.check_bench_lengths``: each benchmark sizes the engine's max_model_len to its requests)."""
    from workbench.bench import check_bench_lengths
    from workbench.config import ModelConfig

    cfg = ModelConfig.resolve(args.model)
    if args.kind == "decode":
        warmup = max(args.warmup, 1) if compiled else args.warmup  # the first compiled step is a warm-up one
        check_bench_lengths(cfg, "decode", args.prompt_len or [128], warmup, args.steps)
    elif args.kind == "prefill":
        check_bench_lengths(cfg, "prefill", args.prompt_len or [128, 512, 1024])
    elif args.kind == "offline":
        check_bench_lengths(cfg, "offline", [], context=args.context)
    elif args.kind == "hf":
        check_bench_lengths(cfg, "hf", (args.prompt_len or [32])[:1], new_tokens=args.new_tokens,
                            context=None if args.no_offline else args.context)  # fmt: skip


def compare_schemes(args: argparse.Namespace, schemes: list, hw: Any, device: str, compile_decode: bool) -> dict:
    """Decode of every scheme interleaved in one run, the accuracy of each against the unquantized model, and the
    sequences of the run's context that fit the default KV budget under each KV dtype."""
    from workbench.engine.config import DEFAULT_KV_BUDGET_BYTES
    from workbench.experiments import levers
    from workbench.timing import random_prompts

    prompt_len = (args.prompt_len or [128])[0]
    models = levers.load_scheme_models(args.model, schemes, device, args.seed)
    ref_scheme = levers.Scheme(args.dtype)
    reference = models.get(ref_scheme.weights_key)
    if reference is None:
        reference = levers.load_scheme_models(args.model, [ref_scheme], device, args.seed)[ref_scheme.weights_key]
    rows = []
    for batch in _progress(args.batch, "decode, schemes interleaved", "batch"):
        rows += levers.decode_schemes(models, schemes, [batch], prompt_len, hw, args.steps, args.warmup, args.seed,
                                      compile_decode)  # fmt: skip
    cfg = reference.config
    prompts = random_prompts(args.accuracy_prompts, min(prompt_len, 256), cfg.vocab_size, args.seed + 1)
    kv_dtypes = list(dict.fromkeys(s.kv_cache_dtype for s in schemes))
    return {
        "schemes": [s.label for s in schemes],
        "results": rows,
        "accuracy": levers.accuracy_schemes(reference, models, schemes, prompts) if prompts else [],
        "kv_capacity": levers.kv_capacity(
            cfg, args.dtype, kv_dtypes, prompt_len + args.warmup + args.steps + 2, DEFAULT_KV_BUDGET_BYTES
        ),  # fmt: skip
    }


def format_table(out: dict[str, Any]) -> str:
    """A plain-text table of a bench result (the JSON's figures, rounded, in readable units)."""
    machine = out.get("machine", {}).get("device_name")
    on = f" on {machine}" if machine else ""
    head = f"workbench bench {out['bench']}: model {out['model']} {out['dtype']}{on}, {out['num_threads']} threads"
    lines = [head]
    if out["bench"] == "decode" and "schemes" in out:
        lines.append(f"{'scheme':>16} {'batch':>5} {'context':>7} {'step ms':>9} {'tok/s':>8} {'MB/step':>8} "
                     f"{'GB/s':>6} {'mbu':>5} {'speedup':>7} {'fewer bytes':>11}")  # fmt: skip
        for r in out["results"]:
            lines.append(
                f"{r['scheme']:>16} {r['batch']:>5} {r['context_len']:>7} {r['time_s'] * 1e3:>9.2f} "
                f"{r['tokens_per_s']:>8.1f} {r['bytes_per_step'] / 1e6:>8.1f} {r['achieved_bytes_per_s'] / 1e9:>6.2f} "
                f"{r['mbu']:>5.2f} {r['speedup']:>6.2f}x {r['bytes_ratio']:>10.2f}x"
            )
        if not out["accuracy"]:
            lines.append("accuracy against the unquantized model: not measured (--accuracy-prompts 0)")
        else:
            lines.append("accuracy against the unquantized model (logits at every position of the prompts):")
        for a in out["accuracy"]:
            lines.append(f"{a['scheme']:>16}  cosine {a['cosine']:.5f}  KL {a['kl']:.2e} nats  top-1 agreement "
                         f"{a['top1_agreement']:.1%} of {a['num_positions']} positions")  # fmt: skip
        for c in out["kv_capacity"]:
            lines.append(f"KV {c['kv_cache_dtype']:>5}: {c['bytes_per_token']} B/token, {c['sequences_that_fit']} "
                         f"sequences of {c['context_len']} tokens fit {c['budget_bytes'] / 2**30:.0f} GiB")  # fmt: skip
    elif out["bench"] == "decode":
        lines.append(
            f"{'batch':>5} {'decode':>8} {'step ms':>9} {'out tok/s':>9} {'GB/s':>7} {'mbu':>6} {'gemv_ratio':>10} "
            f"{'overhead':>8}"
        )
        for r in out["results"]:
            lines.append(
                f"{r['batch']:>5} {'compiled' if r['compiled_decode'] else 'eager':>8} {r['step_s'] * 1e3:>9.2f} "
                f"{r['tokens_per_s']:>9.1f} {r['achieved_bytes_per_s'] / 1e9:>7.2f} {r['mbu']:>6.2f} "
                f"{r['gemv_ratio']:>10.3f} {r['overhead_share']:>8.1%}"
            )
            if "all_reduce_share" in r:
                bw = r["all_reduce_bytes_per_s"] or 0.0
                lines.append(
                    f"      TP={r['tensor_parallel_size']}: {r['all_reduces_per_step']:.0f} all-reduces per step, "
                    f"{r['all_reduce_share']:.1%} of the step, {bw / 1e9:.2f} GB/s"
                )
    elif out["bench"] == "prefill":
        lines.append(f"{'prompt':>6} {'ms':>9} {'GFLOP/s':>9} {'mfu':>6}")
        for r in out["results"]:
            gflops = r["achieved_flops_per_s"] / 1e9
            lines.append(f"{r['prompt_len']:>6} {r['time_s'] * 1e3:>9.1f} {gflops:>9.1f} {r['mfu']:>6.2f}")
    elif out["bench"] == "offline":
        o = out["offline"]
        lines.append(
            f"{o['num_requests']} requests, {o['output_tokens']} output tokens in {o['time_s']:.2f} s: "
            f"{o['output_tokens_per_s']:.1f} output tok/s, {o['total_tokens_per_s']:.1f} total tok/s "
            f"(policy {o['policy']}, {o['token_budget']} tokens a step)"
        )
        if o.get("compile_s"):
            lines.append("decode compiled first (not timed): " + _compile_note(o["compile_s"]))
        if o.get("prefill_compile_s"):
            lines.append("prefill compiled first (not timed): " + _compile_note(o["prefill_compile_s"], "tokens="))
        if "warmup_s" in o:
            c = o["compile_cache"]
            lines.append(f"warm-up before the first timed request: {o['warmup_s']:.0f} s; inductor's caches "
                         f"({c['dir']}): FX graph {c['fx_graph_hits']} hits / {c['fx_graph_misses']} misses / "
                         f"{c['fx_graph_bypasses']} bypasses, AOT autograd {c['aot_autograd_hits']} / "
                         f"{c['aot_autograd_misses']} / {c['aot_autograd_bypasses']}")  # fmt: skip
        if "breakdown" in o:
            lines += _breakdown_lines(o["breakdown"])
    else:
        for key in ("decode", "offline"):
            if key in out:
                r = out[key]
                lines.append(
                    f"{key:>8}: ours {r['ours_tokens_per_s']:.1f} output tok/s, transformers "
                    f"{r['hf_tokens_per_s']:.1f} output tok/s, ratio {r['ratio']:.2f}, identical tokens: "
                    f"{r['identical_tokens']}"
                )
                if r.get("compile_s"):
                    lines.append(f"{'':>8}  decode compiled first (not timed): " + _compile_note(r["compile_s"]))
    return "\n".join(lines)


def _breakdown_lines(b: dict[str, Any]) -> list[str]:
    lines = [f"once more by kind of step: {b['steps']} steps in {b['wall_s']:.2f} s",
             f"{'step kind':14s} {'steps':>6s} {'wall s':>8s} {'share':>6s} {'model s':>8s} "
             f"{'overhead s':>10s}"]  # fmt: skip
    for kind, v in b["by_kind"].items():
        lines.append(f"{kind:14s} {v['steps']:6d} {v['wall_s']:8.2f} {100 * v['share']:5.1f}% {v['model_s']:8.2f} "
                     f"{v['overhead_s']:10.2f}")  # fmt: skip
    lines.append(
        f"{'between steps':14s} {'':6s} {b['between_steps_s']:8.2f} {100 * b['between_steps_s'] / b['wall_s']:5.1f}%"
    )
    lines += [f"  {op['op']:40s} {100 * op['self_share']:5.1f}% of CPU self time, {op['calls']} calls"
              for op in b.get("profiler_top_ops", [])]  # fmt: skip
    return lines


def _compile_note(compile_s: dict[int, float], key: str = "b=") -> str:
    return f"{sum(compile_s.values()):.0f} s (" + ", ".join(f"{key}{b} {t:.0f} s" for b, t in compile_s.items()) + ")"
