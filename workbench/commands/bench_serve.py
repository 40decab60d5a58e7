"""``workbench bench serve``: load an OpenAI-compatible server the way ``vllm bench serve`` does.

    workbench bench serve --base-url http://127.0.0.1:8000 --model M [--endpoint /v1/completions]
        [--dataset-name random|sharegpt|trace] [--dataset-path PATH_OR_TRACE] [--num-prompts N]
        [--random-input-len 1024 --random-output-len 128 --random-range-ratio 0.0 --random-vocab-size 256]
        [--request-rate inf] [--burstiness 1.0] [--max-concurrency C] [--goodput ttft:MS tpot:MS e2el:MS]
        [--percentile-metrics ttft,tpot,itl] [--metric-percentiles 99] [--ignore-eos] [--seed 0]
        [--save-result] [--result-dir DIR] [--result-filename NAME]

Flags, defaults and result keys follow vLLM's (``workbench.serve.benchmark``); ``--random-vocab-size`` (token-id
prompts need no tokenizer) and the ``trace`` dataset (``--dataset-path azure-conv``) are ours. The summary is
printed as vLLM prints it; ``--save-result`` writes the JSON (``--json`` prints it instead).
"""

from __future__ import annotations

import argparse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench serve`` options (the shared ``--model``, ``--seed`` and ``--json`` are ``bench``'s own)."""
    g = p.add_argument_group("serve (vllm bench serve's flags)")
    g.add_argument("--backend", default="openai", choices=("openai", "openai-chat", "vllm"),
                   help="request format: completions (openai, vllm) or chat (openai-chat)")  # fmt: skip
    g.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="server host, when no --base-url")
    g.add_argument("--port", type=int, default=8000, help="server port, when no --base-url")
    g.add_argument("--endpoint", default=None, help="default /v1/completions (/v1/chat/completions for openai-chat)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (sharegpt lengths; with a chat endpoint, random ids decoded to text)",
    )
    g.add_argument("--dataset-name", default="random", choices=("random", "sharegpt", "trace"))
    g.add_argument("--dataset-path", default=None, help="sharegpt: a ShareGPT JSON file; trace: a trace name/file")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="random: output tokens")
    g.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="random: lengths drawn in [len*(1-r), len*(1+r)]"
    )
    g.add_argument("--random-vocab-size", type=int, default=256, help="random prompt ids are drawn below this")
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs in milliseconds (vLLM's unit), NAME in ttft, tpot, e2el, e.g. ttft:500 tpot:50 "
                   "(default: none)")  # fmt: skip
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="comma-separated: ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly the output lengths")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", default=None, help="directory of the result file (default .)")
    g.add_argument("--result-filename", default=None, help="default: vLLM's {backend}-{rate}qps-{model}-{date}.json")


def check_reachable(base_url: str, timeout_s: float = 5.0) -> None:
    """ConfigError naming the connection error when nothing accepts a TCP connection at ``base_url``'s host and port
    (a server that is not running, a wrong port): one line, before any request is sent."""
    import socket
    from urllib.parse import urlsplit

    from workbench.errors import ConfigError

    url = urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"--base-url must be http://HOST:PORT or https://HOST:PORT, got {base_url!r}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ConfigError(
            f"cannot connect to the server at {base_url} ({type(exc).__name__}: {reason}); start one (workbench "
            "serve --model ... --port PORT) or point --base-url / --host / --port at it"
        ) from None


def run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from pathlib import Path

    from workbench.errors import ConfigError
    from workbench.serve import benchmark as b

    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in selected if m not in b.PERCENTILE_METRICS]
    if bad:
        raise ConfigError(f"--percentile-metrics: unknown {bad}; choose from {', '.join(b.PERCENTILE_METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ConfigError(
            f"--metric-percentiles must be comma-separated numbers, got {args.metric_percentiles!r}"
        ) from None
    if not all(0 < p <= 100 for p in percentiles):
        raise ConfigError(f"--metric-percentiles must be in (0, 100], got {args.metric_percentiles}")
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ConfigError("--num-prompts and --max-concurrency must be >= 1")
    goodput = b.parse_goodput(args.goodput)
    from workbench.commands.common import warn_implausible_slo

    for name, ms in goodput.items():
        warn_implausible_slo(f"--goodput {name}:{ms:g}", name, ms / 1e3, "ms")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    if "chat" in endpoint and args.dataset_name != "sharegpt" and args.tokenizer is None:  # ids, not text
        raise ConfigError(
            "a chat endpoint needs text prompts: pass --tokenizer DIR to decode the random ids into text, or "
            "use --dataset-name sharegpt"
        )
    check_reachable(base_url)  # after every check of the arguments, before any request
    if args.dataset_name == "random":
        reqs = b.random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.random_vocab_size, args.seed)  # fmt: skip
    elif args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ConfigError("--dataset-name sharegpt needs --dataset-path FILE.json")
        reqs = b.sharegpt_requests(args.dataset_path, args.num_prompts, args.tokenizer, args.sharegpt_output_len,
                                   args.seed)  # fmt: skip
    else:
        if not args.dataset_path:
            raise ConfigError("--dataset-name trace needs --dataset-path (a trace name such as azure-conv, or a file)")
        max_len = asyncio.run(b.server_max_model_len(base_url, args.model))
        reqs, left_out = b.trace_requests(args.dataset_path, args.num_prompts, max_len, args.random_vocab_size,
                                          args.seed)  # fmt: skip
        if left_out:
            import sys

            print(f"workbench bench serve: {left_out} rows of {args.dataset_path} exceed the server's max_model_len "
                  f"{max_len} and were left out (never clipped); sending the next {len(reqs)} that fit",
                  file=sys.stderr)  # fmt: skip
    if "chat" in endpoint and not all(isinstance(r.prompt, str) for r in reqs):
        reqs = b.decode_prompts(reqs, args.tokenizer)
    outputs, duration = asyncio.run(b.run_benchmark(
        base_url, endpoint, args.model, reqs, args.request_rate, args.burstiness, args.max_concurrency, args.seed,
        args.ignore_eos))  # fmt: skip
    result = b.header(args) | b.compute_result(outputs, duration, selected, percentiles, goodput)
    if args.json:
        print(json.dumps(result))
    else:
        b.print_result(result, selected, percentiles)
    if args.save_result:
        name = args.result_filename or b.result_filename(
            args.backend, args.request_rate, args.max_concurrency, args.model, result["date"]
        )
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
        if not args.json:
            print(f"result written to {path}")
    if result["completed"] == 0:
        import sys

        first = b.first_errors(result["errors"], 1)
        reason = first[0][0] if first else "no request completed"
        print(f"workbench bench serve: every request failed; the first error: {reason}", file=sys.stderr)
    return 0 if result["completed"] == len(reqs) else 1
