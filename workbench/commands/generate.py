"""``workbench generate``: generate tokens for prompts given as token ids.

    workbench generate --model DIR_OR_PRESET --prompt-ids 1,2,3 [--prompt-ids ...] --max-new-tokens N
        [--temperature T --top-k K --top-p P --seed S] [--ignore-eos] [--dtype] [--device] [--json]

Greedy unless a temperature is given. With ``--json``: one object with a list ``requests``, each holding
``prompt_ids``, ``tokens`` (the generated ids), ``ttft_s`` and ``itl_s`` (a list of inter-token latencies).
A preset name gives random weights (seeded by ``--model-seed``); a directory loads a real HF checkpoint.
"""

from __future__ import annotations

import argparse
import json

from workbench.errors import RequestError


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise RequestError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise RequestError("--prompt-ids is empty: a prompt needs at least one token id")
    return ids


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory, preset name or config.json")
    p.add_argument("--dtype", default="fp32", help="fp32 | fp16 | bf16 (default fp32)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--model-seed", type=int, default=0, help="seed of random weights when --model is a preset")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt-ids", action="append", required=True, help="comma-separated token ids; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (per request: seed + request index)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from workbench.device import resolve_device
    from workbench.engine.sequence import SamplingParams
    from workbench.model.checkpoint import load_model
    from workbench.model.generate import generate_static

    prompts = [parse_prompt_ids(t) for t in args.prompt_ids]
    params = [
        SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            seed=None if args.seed is None else args.seed + i,
        )
        for i in range(len(prompts))
    ]
    model = load_model(args.model, dtype=args.dtype, device=resolve_device(args.device), seed=args.model_seed)
    results = generate_static(model, prompts, params)
    if args.json:
        print(json.dumps({"model": str(args.model), "requests": [r.to_dict() for r in results]}))
    else:
        for i, r in enumerate(results):
            itl = sum(r.itl_s) / len(r.itl_s) * 1e3 if r.itl_s else float("nan")
            print(f"[{i}] {r.tokens}  ttft={r.ttft_s * 1e3:.1f} ms  mean itl={itl:.1f} ms  ({r.finish_reason})")
    return 0
