"""``workbench serve``: serve a model over an OpenAI-compatible HTTP API (``workbench.serve.app``).

    workbench serve --model DIR_OR_PRESET [engine options] [--host 127.0.0.1] [--port 8000]
        [--served-model-name NAME] [--threads N] [--drain-timeout S] [--api-key KEY] [--api-key-all-routes]
        [--max-body-bytes N] [--max-prompt-bytes-per-token N] [--header-timeout S] [--body-timeout S] [--seed S]

``--port 0`` picks a free port; the first line printed is ``{"event": "listening", "host", "port"}``. A checkpoint
directory with a ``tokenizer.json`` serves text prompts and, with a chat template, chat completions; without one
(or a preset, random weights) prompts are lists of token ids. SIGTERM drains and exits 0. The port is bound before
the model loads: a busy port or a bad host is a one-line error and exit 2. The API key comes from ``--api-key``, else
the environment variable ``WORKBENCH_API_KEY``, else ``VLLM_API_KEY`` (vLLM's name, so the same environment serves
both).
"""

from __future__ import annotations

import argparse
import os

from workbench.commands.generate import add_engine_arguments, add_model_arguments, engine_config_from_args
from workbench.timing import set_threads

API_KEY_ENV = ("WORKBENCH_API_KEY", "VLLM_API_KEY")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: all usable cores, as workbench bench)")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (default 30)")  # fmt: skip
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the /v1 routes (default: $WORKBENCH_API_KEY, else "
        "$VLLM_API_KEY, else no key: anyone who can reach the port can generate)",
    )
    p.add_argument(
        "--api-key-all-routes",
        action="store_true",
        help="with an API key, protect /health and /metrics too (default: they stay open)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body, bytes (default: 8 x max_model_len x the bytes per token, within "
        "[1 MiB, 16 MiB]); larger is a 413",
    )
    p.add_argument(
        "--max-prompt-bytes-per-token",
        type=int,
        default=None,
        help="text longer than max_model_len x this many bytes is refused before tokenizing (default: "
        "the tokenizer's longest token, in UTF-8 bytes)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a new connection may take to send its request's headers before it is closed (default 30)",
    )
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive before a 408 (default 30)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed in [0, 2**64) of the requests that give none: request i, in arrival "
                        "order, samples with seed + i, modulo 2**64 (generate --seed's rule; default: none, "
                        "unseeded)")  # fmt: skip


def api_key_from(args: argparse.Namespace) -> str | None:
    """``--api-key``, else the first of ``API_KEY_ENV`` that is set and not empty."""
    if args.api_key is not None:
        return args.api_key
    return next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from workbench.errors import ConfigError
    from workbench.request import SamplingParams

    try:
        from workbench.serve.app import ServerLimits, bind, build_app, serve
    except ImportError as exc:
        raise ConfigError(
            f"workbench serve needs the serve extra (pip install 'llm-workbench[serve]'): {exc}"
        ) from None
    from workbench.engine.engine import Engine
    from workbench.model.tokenizer import TextCodec, has_tokenizer

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    for flag, value in (("--max-body-bytes", args.max_body_bytes),
                        ("--max-prompt-bytes-per-token", args.max_prompt_bytes_per_token)):  # fmt: skip
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0 seconds, got {value}")
    if args.disaggregate or args.prefill_tp or args.decode_tp or args.threads_per_engine != 1:
        raise ConfigError(
            "workbench serve runs one colocated engine: --disaggregate, --prefill-tp, --decode-tp and "
            "--threads-per-engine are not supported here (use workbench generate or replay for disaggregation)"
        )
    api_key = api_key_from(args)
    if api_key is not None and (api_key == "" or api_key != api_key.strip()):
        raise ConfigError("the API key must be non-empty and without surrounding whitespace")
    limits = ServerLimits(
        max_bytes_per_token=args.max_prompt_bytes_per_token, max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, api_key=api_key,
        api_key_all_routes=args.api_key_all_routes, seed=args.seed,
    )  # fmt: skip
    if args.seed is not None:
        SamplingParams(seed=args.seed)  # --seed itself in [0, 2**64), before the model loads
    try:  # before the model loads: a busy port or a bad host fails at once
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    set_threads(args.threads, what="--threads")  # the one rule of bench and serve: all usable cores unless --threads
    try:
        engine = Engine.from_model(args.model, engine_config_from_args(args), seed=args.model_seed)
        codec = TextCodec.from_dir(args.model) if has_tokenizer(args.model) else None
        app = build_app(engine, codec, args.served_model_name or str(args.model), limits)
        asyncio.run(serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout, sock=sock))
    finally:
        sock.close()
    return 0
