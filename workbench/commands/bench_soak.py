"""``workbench bench soak``: many requests through the engine (or ``--server``: through ``workbench serve``) with
aborts, checking that no KV block leaks, that the engine holds no finished request and that memory stays flat.

    workbench bench soak [--model tiny-gqa] [--num-requests 2000] [--abort-fraction 0.1] [--pool-fraction 0.3]
        [--speculative-config JSON] [--max-prompt-len 64] [--max-output-len 64] [--arrival-rate 0.15]
        [--max-num-seqs N] [--block-size 16] [--policy continuous] [--threads 1] [--seed 0] [--json]
    workbench bench soak --server [--num-requests 10000] [--max-concurrency 16] [--rss-samples 10]
        [--rss-tolerance 0.1] [--speculative-config JSON] ...

What is checked and reported: ``workbench.serve.soak``. Exit 0 when every check passed, 1 otherwise; ``--json``
prints the report as one object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench soak`` options; an option another mode already declared on ``p`` (the parser of every mode's
    defaults) is kept as it is."""
    from workbench.commands.common import add_serving_arguments, add_speculative_arguments
    from workbench.engine.config import EngineConfig

    def add(flag: str, **kwargs: Any) -> None:
        if flag not in p._option_string_actions:
            p.add_argument(flag, **kwargs)

    add("--num-requests", type=int, default=2000, help="requests of the soak (default 2000)")
    add("--abort-fraction", type=float, default=0.1,
        help="share of requests aborted once they have a random number of their tokens (--server: their client "
        "goes away after the first token) (default 0.1)")  # fmt: skip
    add(
        "--pool-fraction",
        type=float,
        default=0.3,
        help="in process: the soak's KV pool over the reference run's peak of blocks in use (default 0.3)",
    )
    add(
        "--arrival-rate",
        type=float,
        default=0.15,
        help="in process: mean requests joining before each engine step (default 0.15)",
    )
    add("--max-prompt-len", type=int, default=64, help="prompt lengths uniform in [1, this] (default 64)")
    add("--max-output-len", type=int, default=64, help="output lengths uniform in [1, this] (default 64)")
    add("--threads", type=int, default=1, help="torch intra-op threads of the engine (default 1)")
    if "--speculative-config" not in p._option_string_actions:
        add_speculative_arguments(p)
    names = tuple(n for n in ("policy", "block_size", "max_num_seqs") if n not in {a.dest for a in p._actions})
    add_serving_arguments(p, EngineConfig, names)
    add("--server", action="store_true", help="through workbench serve on 127.0.0.1, its RSS sampled")
    add("--max-concurrency", type=int, default=16, help="--server: requests in flight at most (default 16)")
    add(
        "--rss-samples",
        type=int,
        default=10,
        help="--server: rounds of requests after the warm-up (the first 10%% of the requests), the server's RSS read "
        "after each (default 10)",
    )
    add("--rss-tolerance", type=float, default=0.10,
        help="--server: RSS is flat when no reading after the warm-up is more than 1 + this x the one at its end "
        "(default 0.10)")  # fmt: skip


def run_soak(args: argparse.Namespace) -> int:
    """Run the soak of ``args``; print the report; 0 when every check passed."""
    from workbench.config import ModelConfig
    from workbench.engine.speculative import SpeculativeConfig
    from workbench.serve import soak

    spec = SpeculativeConfig.parse(args.speculative_config)  # a bad JSON fails before anything starts
    vocab = ModelConfig.resolve(args.model).vocab_size
    workload = soak.make_workload(args.num_requests, vocab, args.max_prompt_len, args.max_output_len,
                                  args.arrival_rate, args.abort_fraction, args.seed)  # fmt: skip
    if args.server:
        out = _run_server(args, workload)
    else:
        from workbench.model.checkpoint import load_model
        from workbench.timing import set_threads

        set_threads(args.threads, what="--threads")
        model = load_model(args.model, seed=args.seed)
        out = soak.soak_engine(model, workload, args.pool_fraction, spec, args.max_num_seqs, args.block_size,
                               args.policy)  # fmt: skip
    out = {"bench": "soak", "model": args.model, "num_threads": args.threads, **out}
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:26s} {value}")
    return 0 if out["ok"] else 1


def _run_server(args: argparse.Namespace, workload: Any) -> dict[str, Any]:
    from workbench.serve.launch import ServerProcess
    from workbench.serve.soak import soak_server

    max_len = args.max_prompt_len + args.max_output_len + 1
    argv = ["--model", args.model, "--model-seed", str(args.seed), "--served-model-name", "soak",
            "--max-model-len", str(max_len), "--max-num-seqs", str(args.max_num_seqs), "--block-size",
            str(args.block_size), "--policy", args.policy, "--threads", str(args.threads)]  # fmt: skip
    if args.speculative_config is not None:
        argv += ["--speculative-config", args.speculative_config]
    with ServerProcess(argv) as server:
        out = soak_server(server.base_url, server.proc.pid, "soak", workload, args.max_concurrency, args.rss_samples,
                          args.rss_tolerance)  # fmt: skip
    return {**out, "speculative_config": args.speculative_config}
