"""``workbench generate``: generate tokens for prompts given as token ids or text, through the serving engine.

    workbench generate --model DIR_OR_PRESET --prompt-ids 1,2,3 [--prompt-ids ...] [--prompt TEXT ...]
        --max-new-tokens N
        [--temperature T --top-k K --top-p P --seed S] [--ignore-eos] [--dtype] [--device] [--json]
        [--policy P] [--cache paged|contiguous] [--block-size B] [--num-blocks N] [--max-num-seqs S]
        [--max-num-batched-tokens T] [--chunk-size C] [--enable-prefix-caching] [--attention-backend torch|triton]
        [--compile-decode] [--tensor-parallel-size N]
        [--disaggregate P:D [--threads-per-engine N] [--prefill-tp N] [--decode-tp M]]
        [--speculative-config JSON]

Greedy unless a temperature is given. With ``--json``: one object with a list ``requests``, each holding
``prompt_ids``, ``tokens`` (the generated ids), ``ttft_s`` and ``itl_s`` (a list of inter-token latencies), plus
``finish_reason`` and, for a rejected request, ``reject_reason``; with ``--speculative-config`` (vLLM's JSON, also on
replay and serve; ``workbench.engine.speculative``) the object also holds ``speculative``: acceptance rate, mean
accepted length and per-position acceptance. ``--prompt TEXT`` (repeatable; served after the
``--prompt-ids`` prompts) needs a checkpoint directory with a tokenizer (``tokenizer.json``); whenever the model has
one, each request also carries ``text``, the decoded output (special tokens skipped). A rejected request does not
stop the others; the exit code is then 1. A preset name gives random weights (seeded by ``--model-seed``); a
directory loads a real HF checkpoint.
"""

from __future__ import annotations

import argparse
import json

from workbench.commands.common import (
    ArgumentContainer,
    add_serving_arguments,
    add_speculative_arguments,
    check_parallel_layout,
    serving_config_kwargs,
)
from workbench.errors import ConfigError, RequestError


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise RequestError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise RequestError("--prompt-ids is empty: a prompt needs at least one token id")
    return ids


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="checkpoint directory, preset name (or its hub id, e.g. meta-llama/Llama-3.1-8B) or "
                   "config.json")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--model-seed", type=int, default=0, help="seed of random weights when --model is a preset")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    from workbench.engine.config import EngineConfig

    add_serving_arguments(g, EngineConfig)  # the shared fields, from the one config (vLLM's names)
    g.add_argument("--cache", default="paged", choices=("paged", "contiguous"), help="KV-cache layout")
    g.add_argument("--attention-backend", default="torch", choices=("torch", "triton"))
    g.add_argument("--compile-decode", action="store_true",
                   help="CPU: pure-decode steps as torch.compile'd graphs, one per batch bucket (1, 2, 4, 8, 16, 24, "
                   "32, ...; each compiles at its first decode step; replay compiles all first)")  # fmt: skip
    g.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="serve through P prefill and D decode engine processes, the KV sent between them "
                   "(workbench.cluster.disagg; default: one colocated engine)")  # fmt: skip
    g.add_argument("--threads-per-engine", type=int, default=1,
                   help="with --disaggregate: torch threads of each engine process (default 1)")  # fmt: skip
    g.add_argument("--prefill-tp", type=int, default=None,
                   help="with --disaggregate: the prefill pool's tensor-parallel size per engine (default "
                   "--tensor-parallel-size; as in simulate --disaggregate)")  # fmt: skip
    g.add_argument("--decode-tp", type=int, default=None,
                   help="with --disaggregate: the decode pool's tensor-parallel size per engine (default "
                   "--tensor-parallel-size)")  # fmt: skip
    g.add_argument("--max-processes", type=int, default=None,
                   help="most worker processes a tensor-parallel or disaggregated layout may start (default: the "
                   "CPU cores of this machine); a larger layout is refused before anything starts")  # fmt: skip
    add_speculative_arguments(g)


def add_quantization_arguments(p: ArgumentContainer, many: bool = False) -> None:
    """--quantization, --group-size, --kv-cache-dtype, generated from ``ServingConfig`` with the engine's defaults.
    ``many``: each takes several values (``bench decode`` compares them in one run)."""
    from workbench.engine.config import EngineConfig

    add_serving_arguments(p, EngineConfig, ("quantization", "group_size", "kv_cache_dtype"), many=many)


def engine_config_from_args(args: argparse.Namespace):  # noqa: ANN201  (EngineConfig)
    from workbench.engine.config import EngineConfig

    check_parallel_layout(args, count_processes=False)
    if (getattr(args, "prefill_tp", None) or getattr(args, "decode_tp", None)) and not args.disaggregate:
        raise ConfigError("--prefill-tp and --decode-tp need --disaggregate (one engine runs both phases otherwise)")
    return EngineConfig(
        **serving_config_kwargs(args),
        cache=args.cache,
        attention_backend=args.attention_backend,
        compile_decode=args.compile_decode,
        device=args.device,
        speculative_config=getattr(args, "speculative_config", None),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids; repeatable")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (needs a tokenizer); repeatable")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per prompt (vLLM's max_tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed in [0, 2**64) (per request: seed + request index, modulo 2**64; default: none, "
                   "unseeded)")  # fmt: skip
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import sys

    from workbench.engine.engine import Engine
    from workbench.errors import CheckpointError
    from workbench.model.tokenizer import TextCodec, has_tokenizer
    from workbench.request import SEED_LIMIT, SamplingParams

    if not args.prompt_ids and not args.prompt:
        raise RequestError("give at least one prompt: --prompt-ids 1,2,3 or --prompt TEXT")
    check_parallel_layout(args)
    codec = TextCodec.from_dir(args.model) if has_tokenizer(args.model) else None
    if args.prompt and codec is None:
        raise CheckpointError(
            f"--prompt needs a tokenizer, and {args.model} has none (no tokenizer.json); pass --prompt-ids instead"
        )
    prompts = [parse_prompt_ids(t) for t in args.prompt_ids] + [codec.encode(t) for t in args.prompt]
    if args.seed is not None:
        SamplingParams(seed=args.seed)  # validates --seed itself before per-request seeds wrap around 2**64
    params = [
        SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            seed=None if args.seed is None else (args.seed + i) % SEED_LIMIT,  # a valid seed for every request
        )
        for i in range(len(prompts))
    ]
    from workbench.device import resolve_device
    from workbench.hardware import warn_if_emulated

    warn_if_emulated(args.dtype, resolve_device(args.device))  # a line on stderr where bf16/fp16 is emulated
    if args.disaggregate:
        from workbench.cluster.disagg import disagg_config_from_args, run_disaggregated

        cfg = disagg_config_from_args(args, engine_config_from_args(args))
        requests = [(p, sp, 0.0) for p, sp in zip(prompts, params)]
        results, extra = run_disaggregated(args.model, requests, cfg, seed=args.model_seed, online=False).requests, {}
    else:
        engine = Engine.from_model(args.model, engine_config_from_args(args), seed=args.model_seed)
        run = engine.generate(prompts, params)
        results, extra = run.requests, run.extra  # extra: the speculative decoding counters, when on
        engine.shutdown()
    if args.json:
        dicts = [r.to_dict() for r in results]
        if codec is not None:
            for d, r in zip(dicts, results):
                d["text"] = codec.decode(r.tokens)
        print(json.dumps({"model": str(args.model), "requests": dicts, **extra}))
    else:
        for i, r in enumerate(results):
            if r.finish_reason == "rejected":
                continue
            itl = sum(r.itl_s) / len(r.itl_s) * 1e3 if r.itl_s else float("nan")
            text = "" if codec is None else f"  {codec.decode(r.tokens)!r}"
            print(f"[{i}] {r.tokens}{text}  ttft={r.ttft_s * 1e3:.1f} ms  mean itl={itl:.1f} ms  ({r.finish_reason})")
    rejected = [(i, r.reject_reason) for i, r in enumerate(results) if r.finish_reason == "rejected"]
    for i, reason in rejected:
        print(f"workbench generate: request {i} rejected: {reason}", file=sys.stderr)
    return 1 if rejected else 0
