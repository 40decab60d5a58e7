"""``workbench serve``: serve a model over an OpenAI-compatible HTTP API (``workbench.serve.app``).

    workbench serve --model DIR_OR_PRESET [engine options] [--host 127.0.0.1] [--port 8000]
        [--served-model-name NAME] [--threads N] [--drain-timeout S]

``--port 0`` picks a free port; the first line printed is ``{"event": "listening", "host", "port"}``. A checkpoint
directory with a ``tokenizer.json`` serves text prompts and, with a chat template, chat completions; without one
(or a preset, random weights) prompts are lists of token ids. SIGTERM drains and exits 0.
"""

from __future__ import annotations

import argparse

from workbench.commands.generate import add_engine_arguments, add_model_arguments, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (default 30)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import asyncio

    from workbench.errors import ConfigError

    try:
        from workbench.serve.app import build_app, serve
    except ImportError as exc:
        raise ConfigError(
            f"workbench serve needs the serve extra (pip install 'llm-workbench[serve]'): {exc}"
        ) from None
    from workbench.engine.engine import Engine
    from workbench.model.tokenizer import TextCodec, has_tokenizer

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    engine = Engine.from_model(args.model, engine_config_from_args(args), seed=args.model_seed)
    codec = TextCodec.from_dir(args.model) if has_tokenizer(args.model) else None
    app = build_app(engine, codec, args.served_model_name or str(args.model))
    asyncio.run(serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout))
    return 0
