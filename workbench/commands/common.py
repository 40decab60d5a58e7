"""Command-line options shared by ``workbench generate``, ``replay`` and ``simulate``, each group written once.

- ``add_scheduler_arguments``: the scheduler and KV-pool options of ``ServingConfig`` (``EngineConfig`` and
  ``SimConfig``); ``serving_config_kwargs`` turns them back into that config's keywords.
- ``add_trace_arguments``: which trace to serve and how to scale or synthesise it (``load_workload``).
- ``add_slo_arguments``: the SLOs that decide goodput.
- ``print_serving_metrics``: the latency and throughput lines of a serving summary's ``metrics``.
- ``all_rejected_exit_code``, ``check_output_file``, ``check_output_dir``: exit codes and output paths checked
  before any work starts.

Plain argparse: a command imports this module at its top, so it imports nothing heavy.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError

ArgumentContainer = argparse.ArgumentParser | argparse._ArgumentGroup


def progress_bar(total: int | None = None, desc: str = "", unit: str = "it", items: Any = None) -> Any:
    """A tqdm bar on stderr (stdout keeps the table or the JSON), shown only when stderr is a terminal.

    Over ``items`` when given (iterate the bar), else a bar of ``total`` steps to ``update``; close it when done.
    """
    import sys

    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, disable=not sys.stderr.isatty())


def add_scheduler_arguments(p: ArgumentContainer, max_num_seqs_default: int) -> None:
    """--policy, --block-size, --num-blocks, --max-num-seqs, --max-model-len, --token-budget, --chunk-size,
    --prefix-caching (on a parser or an argument group)."""
    from workbench.engine.scheduler import POLICIES

    p.add_argument("--policy", default="continuous", choices=POLICIES, help="scheduling policy (default continuous)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (paged; default: derived)")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs_default, help="most sequences in one step")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default min(model, 4096))")
    p.add_argument("--token-budget", type=int, default=None, help="new tokens per step (max_num_batched_tokens)")
    p.add_argument("--chunk-size", type=int, default=None, help="largest prefill chunk (policy chunked)")
    p.add_argument("--prefix-caching", action="store_true", help="reuse cached KV blocks of shared prefixes")


def serving_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServingConfig`` keywords given by ``add_scheduler_arguments``'s options."""
    return {
        "policy": args.policy,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "token_budget": args.token_budget,
        "chunk_size": args.chunk_size,
        "enable_prefix_caching": args.prefix_caching,
    }


def add_trace_arguments(
    p: ArgumentContainer, num_requests_default: int, prompt_lens_default: str, output_lens_default: str
) -> None:
    """--trace, --limit, --rate-scale, --time-scale and the synthetic-trace options, with the command's defaults."""
    p.add_argument("--trace", required=True, help="azure-code | azure-conv | mooncake-conversation | "
                   "mooncake-synthetic | poisson:RATE | gamma:RATE:CV | a .csv/.jsonl file")  # fmt: skip
    p.add_argument("--limit", type=int, default=None, help="first N requests")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the request rate (compress time)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply inter-arrival times")
    p.add_argument(
        "--num-requests", type=int, default=num_requests_default, help="synthetic traces: number of requests"
    )
    spec = "fixed:N | uniform:LO:HI (inclusive) | lognormal:MEDIAN:SIGMA | zipf:A:MAX"
    p.add_argument("--prompt-lens", default=prompt_lens_default, metavar="SPEC",
                   help=f"synthetic traces: prompt length distribution, {spec}")  # fmt: skip
    p.add_argument("--output-lens", default=output_lens_default, metavar="SPEC",
                   help=f"synthetic traces: output length distribution, {spec}")  # fmt: skip
    p.add_argument("--trace-seed", type=int, default=0, help="seed of synthetic arrivals, lengths and prompt ids")


def add_slo_arguments(p: ArgumentContainer) -> None:
    """--slo-ttft, --slo-tpot, --slo-e2el: the SLOs of goodput, in seconds."""
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds (goodput)")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds (goodput)")
    p.add_argument("--slo-e2el", type=float, default=None, help="end-to-end latency SLO in seconds (goodput)")


LATENCY_LABELS = {"ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL", "e2el_s": "E2E latency"}


def clip_to_context(requests: list[Any], max_len: int) -> tuple[list[Any], int]:
    """``truncate_to_context(requests, max_len)`` and how many requests it shortened (to be reported, not hidden).

    A TraceError when there is no request to run (a header-only csv, an empty jsonl, ``--limit 0``): latencies of
    zero requests are not a result."""
    stream = ClippedStream(iter(requests), max_len)
    return list(stream), stream.num_clipped


class ClippedStream:
    """The requests of a stream clipped to ``max_len`` as they are read (``workbench.workloads.clip_request``), and
    ``num_clipped``, how many that shortened so far. A TraceError now when the stream has no request (as
    ``clip_to_context``)."""

    def __init__(self, requests: Iterator[Any], max_len: int) -> None:
        from workbench.errors import TraceError
        from workbench.workloads import check_max_len

        check_max_len(max_len)
        self.max_len = max_len
        self.num_clipped = 0
        self._first = next(requests, None)
        if self._first is None:
            raise TraceError(
                "the trace has no requests (an empty or header-only file, or --limit 0): give a trace with at least "
                "one request, or a --limit of 1 or more"
            )
        self._rest = requests

    def __iter__(self) -> Iterator[Any]:
        from workbench.workloads import clip_request

        for r in itertools.chain([self._first], self._rest):
            clipped = clip_request(r, self.max_len)
            self.num_clipped += clipped is not r
            yield clipped


def print_serving_metrics(m: dict[str, Any]) -> None:
    """Latency statistics (ms), throughput and goodput of a summary's ``metrics``, as replay and simulate print them."""
    for key, label in LATENCY_LABELS.items():
        s = m[key]
        print(f"  {label + ' (ms)':16s} mean {s['mean'] * 1e3:9.2f}  median {s['median'] * 1e3:9.2f}  "
              f"p99 {s['p99'] * 1e3:9.2f}")  # fmt: skip
    total = m.get("total_token_throughput")
    total_text = f", {total:.1f} total (prompt + output) tok/s" if total is not None else ""
    print(f"  throughput {m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} output tok/s{total_text}")
    if m.get("goodput") is None:
        print("  goodput and SLO attainment: n/a (no SLO given; --slo-ttft, --slo-tpot, --slo-e2el)")
    else:
        slos = ", ".join(f"{k.removesuffix('_s').upper()} <= {v:g} s" for k, v in (m.get("slos") or {}).items() if v)
        print(f"  goodput {m['goodput']:.2f} req/s, {m['slo_attainment']:.1f}% of requests within SLOs ({slos})")


def all_rejected_exit_code(command: str, summary: dict[str, Any]) -> int:
    """1, with one line on stderr, when a serving run rejected every one of its requests (its latencies would be
    reported as 0.0); else 0."""
    import sys

    rejected = summary.get("rejected") or []
    if summary["num_requests"] > 0 and len(rejected) == summary["num_requests"]:
        print(f"workbench {command}: all {len(rejected)} requests were rejected; the first: {rejected[0]['reason']}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def check_output_file(path: str | Path | None, option: str) -> None:
    """ConfigError, before any work, unless ``path`` can be written as a file: its folder exists and is writable,
    and ``path`` is not a folder."""
    if path is None:
        return
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder; give a file name inside it")
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: folder {parent} does not exist; create it first or choose another path")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{option} {path}: not writable here; choose a path you can write")


def check_parallel_layout(args: Any, count_processes: bool = True) -> None:
    """ConfigError before any process starts, unless the layout of ``--tensor-parallel-size``, ``--disaggregate P:D``,
    ``--prefill-tp`` and ``--decode-tp`` can run: every size >= 1, every tensor-parallel size splits the model's
    heads, and (``count_processes``) the ranks it starts fit ``--max-processes`` (default: this machine's CPU
    cores; each rank needs a core to make progress, so more only thrash and leak on a failure)."""
    from workbench.config import ModelConfig, parse_disaggregate
    from workbench.model.sharding import check_tensor_parallel_size

    tp = args.tensor_parallel_size
    sizes = {"--tensor-parallel-size": tp}
    for flag, name in (("--prefill-tp", "prefill_tp"), ("--decode-tp", "decode_tp")):
        if getattr(args, name, None) is not None:
            sizes[flag] = getattr(args, name)
    for flag, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if getattr(args, "threads_per_engine", 1) < 1:
        raise ConfigError(f"--threads-per-engine must be >= 1, got {args.threads_per_engine}")
    ranks, what = tp, f"--tensor-parallel-size {tp}"
    if getattr(args, "disaggregate", None):
        num_p, num_d = parse_disaggregate(args.disaggregate)
        ptp, dtp = sizes.get("--prefill-tp", tp), sizes.get("--decode-tp", tp)
        ranks = num_p * ptp + num_d * dtp
        what = f"--disaggregate {args.disaggregate} ({num_p} x {ptp} prefill + {num_d} x {dtp} decode ranks)"
    cfg = ModelConfig.resolve(args.model)
    for flag, value in sizes.items():
        if value > 1:
            try:
                check_tensor_parallel_size(cfg, value)
            except ConfigError as exc:
                raise ConfigError(f"{flag} {value}: {exc}") from None
    if not count_processes:
        return
    from workbench.dist.group import launched_by_torchrun

    cores = os.cpu_count() or 1
    limit = getattr(args, "max_processes", None) or cores
    if ranks > limit and not launched_by_torchrun():
        raise ConfigError(
            f"{what} starts {ranks} processes, more than the limit of {limit} (--max-processes; default: the "
            f"{cores} CPU cores of this machine): choose a smaller layout"
        )


def write_failed(option: str, path: str | Path, exc: BaseException) -> ConfigError:
    """The error of an output that passed ``check_output_file``/``check_output_dir`` but could not be written (a
    full disk, a name taken by a folder, a figure format matplotlib does not know)."""
    reason = getattr(exc, "strerror", None) or str(exc)
    return ConfigError(f"{option} {path}: cannot be written ({reason}); choose another path")


def check_output_dir(path: str | Path, option: str) -> None:
    """ConfigError, before any work, unless ``path`` is (or can be created as) a writable folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} exists and is not a folder; give a folder (new or existing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: {existing} is not writable; choose a folder you can write")
