"""``workbench checkpoint --model NAME --out DIR [--model-seed S] [--dtype D] [--no-tokenizer] [--json]``: a random
HF checkpoint of a preset (config, weights and a byte-level BPE tokenizer trained on ``data/text/``). It prints what it
wrote in one line, or with ``--json`` (as every command that prints results) one JSON object (``checkpoint``,
``preset``, ``params``, ``dtype``, ``tokenizer``).

``--model`` and ``--model-seed`` are the names every command uses for the model and the seed of its random weights;
the older ``--preset`` and ``--seed`` still work, with a warning."""

from __future__ import annotations

import argparse
import json

from workbench.config import ModelConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workbench.commands.common import add_option

    add_option(p, "--model", "--preset", dest="preset", required=True,
               help="model preset name (see data/models; or its hub id) or a config.json path (--preset: deprecated "
               "spelling)")  # fmt: skip
    p.add_argument("--out", required=True, help="output directory (config.json + safetensors)")
    add_option(p, "--model-seed", "--seed", dest="seed", type=int, default=0,
               help="seed of the random weights (--seed: deprecated spelling; default 0)")  # fmt: skip
    p.add_argument("--dtype", default="fp32", help="fp32 | fp16 | bf16 (default fp32)")
    p.add_argument("--no-tokenizer", action="store_true", help="write config and weights only (no tokenizer.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from workbench.commands.common import check_output_dir, write_failed
    from workbench.model.checkpoint import save_random_checkpoint

    check_output_dir(args.out, "--out")
    hf_logging.disable_progress_bar()  # transformers' shard bars say nothing useful for a one-file checkpoint
    cfg = ModelConfig.resolve(args.preset)
    try:
        out = save_random_checkpoint(cfg, args.out, seed=args.seed, dtype=args.dtype, tokenizer=not args.no_tokenizer)
    except OSError as exc:
        raise write_failed("--out", args.out, exc) from None
    summary = {"checkpoint": str(out), "preset": cfg.name, "params": cfg.num_params(), "dtype": args.dtype}
    if args.json:
        print(json.dumps(summary | {"tokenizer": not args.no_tokenizer}))
    else:
        tokenizer = "no tokenizer" if args.no_tokenizer else "a tokenizer"
        print(f"wrote {cfg.name} ({cfg.num_params() / 1e6:.1f}M parameters, {args.dtype}, random weights of seed "
              f"{args.seed}, {tokenizer}) to {out}")  # fmt: skip
    return 0
