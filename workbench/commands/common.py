"""Command-line options shared by ``workbench generate``, ``replay`` and ``simulate``, each group written once.

- ``add_serving_arguments``: the options of the shared serving fields, generated from ``ServingConfig``
  (``EngineConfig`` and ``SimConfig``): each field's flag (vLLM's name), deprecated spellings (``add_option``: they
  work and warn), help and default; ``add_scheduler_arguments`` its scheduler and KV-pool part;
  ``serving_config_kwargs`` turns them back into the config's keywords.
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


SCHEDULER_FIELDS = ("policy", "block_size", "num_blocks", "max_num_seqs", "max_model_len", "token_budget",
                    "chunk_size", "enable_prefix_caching")  # fmt: skip
FORMAT_FIELDS = ("dtype", "quantization", "group_size", "kv_cache_dtype")


def warn_deprecated(old: str, new: str) -> None:
    """One line on stderr: ``old`` is a deprecated spelling of ``new`` (kept for one release)."""
    import sys

    print(f"warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


class _Store(argparse._StoreAction):
    """``store``, warning when a deprecated alias (``deprecated_aliases``) was typed."""

    deprecated_aliases: tuple[str, ...] = ()

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if option_string in self.deprecated_aliases:
            warn_deprecated(option_string, self.option_strings[0])
        super().__call__(parser, namespace, values, option_string)


class _StoreTrue(argparse._StoreTrueAction):
    """``store_true``, warning when a deprecated alias (``deprecated_aliases``) was typed."""

    deprecated_aliases: tuple[str, ...] = ()

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if option_string in self.deprecated_aliases:
            warn_deprecated(option_string, self.option_strings[0])
        super().__call__(parser, namespace, values, option_string)


def add_option(p: ArgumentContainer, flag: str, *aliases: str, **kwargs: Any) -> argparse.Action:
    """``p.add_argument(flag, *aliases, ...)`` where each of ``aliases`` is a deprecated spelling that still works
    and warns (``warn_deprecated``); ``action`` may be 'store' (default) or 'store_true'."""
    action = kwargs.pop("action", "store")
    cls = {"store": _Store, "store_true": _StoreTrue}[action]
    if action == "store_true":
        kwargs.setdefault("default", False)
    added = p.add_argument(flag, *aliases, action=cls, **kwargs)
    added.deprecated_aliases = tuple(aliases)  # type: ignore[attr-defined]
    return added


def serving_options(config_cls: type, names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """The command-line options of ``ServingConfig``'s fields (``names``: those only, in the config's order), each
    a dict of ``name`` (the field), ``flag``, ``aliases`` (deprecated), ``help``, ``default`` (``config_cls``'s:
    ``EngineConfig``'s or ``SimConfig``'s), ``type`` and ``argparse`` (extra keywords)."""
    from dataclasses import fields

    from workbench.engine.config import ServingConfig

    defaults = {f.name: f.default for f in fields(config_cls)}
    out = []
    for f in fields(ServingConfig):
        if not f.metadata or (names is not None and f.name not in names):
            continue
        kind = str(f.type)
        typ = bool if kind == "bool" else int if kind.startswith("int") else str
        default = defaults[f.name]
        if f.name == "quantization" and default is None:
            default = "none"
        out.append({"name": f.name, "flag": f.metadata["flag"], "aliases": f.metadata["aliases"],
                    "help": f.metadata["help"], "default": default, "type": typ,
                    "argparse": f.metadata["argparse"]})  # fmt: skip
    return out


def add_serving_arguments(
    p: ArgumentContainer, config_cls: type, names: tuple[str, ...] | None = None, many: bool = False
) -> None:
    """Options of the shared serving fields (``ServingConfig``), generated from the one config: vLLM's flag names,
    deprecated spellings that warn, the help with its unit, and ``config_cls``'s default (``EngineConfig`` for a
    command that runs the engine, ``SimConfig`` for the simulator). ``names``: those fields only. ``many``: each
    takes several values (``bench decode`` compares them in one run); the default is then a one-element list."""
    for o in serving_options(config_cls, names):
        extra = dict(o["argparse"])
        text = o["help"] + (f" ({', '.join(o['aliases'])}: deprecated spelling)" if o["aliases"] else "")
        if o["type"] is bool:
            add_option(p, o["flag"], *o["aliases"], dest=o["name"], action="store_true", help=text)
            continue
        if o["type"] is int:
            extra["type"] = int
            extra.setdefault("metavar", "N")
        if many:
            extra["nargs"] = "+"
        default = [o["default"]] if many else o["default"]
        add_option(p, o["flag"], *o["aliases"], dest=o["name"], default=default, help=text, **extra)


def add_scheduler_arguments(p: ArgumentContainer, config_cls: type) -> None:
    """--policy, --block-size, --num-blocks, --max-num-seqs, --max-model-len, --max-num-batched-tokens,
    --chunk-size, --enable-prefix-caching (on a parser or an argument group), with ``config_cls``'s defaults."""
    add_serving_arguments(p, config_cls, SCHEDULER_FIELDS)


def add_speculative_arguments(p: ArgumentContainer) -> None:
    """--speculative-config (vLLM's JSON; ``workbench.engine.speculative.SpeculativeConfig`` validates it)."""
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4}\', \'{"model": DIR, "num_speculative_tokens": 4}\' or '
                   '\'{"method": "oracle", "acceptance": 0.7, "num_speculative_tokens": 4}\'')  # fmt: skip


def serving_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServingConfig`` keywords of the options ``add_serving_arguments`` added (those present in ``args``)."""
    from dataclasses import fields

    from workbench.engine.config import ServingConfig

    return {f.name: getattr(args, f.name) for f in fields(ServingConfig) if f.metadata and hasattr(args, f.name)}


def add_trace_arguments(
    p: ArgumentContainer, num_requests_default: int, prompt_lens_default: str, output_lens_default: str
) -> None:
    """--trace, --limit, --rate-scale, --time-scale and the synthetic-trace options, with the command's defaults."""
    p.add_argument("--trace", required=True, help="azure-code | azure-conv | mooncake-conversation | "
                   "mooncake-synthetic | poisson:RATE | gamma:RATE:CV | a .csv/.jsonl file")  # fmt: skip
    p.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
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


# (smallest, largest) plausible SLO in seconds per metric: outside, a value was probably typed in the other unit
PLAUSIBLE_SLO_S = {"ttft": (1e-3, 60.0), "tpot": (1e-4, 5.0), "e2el": (1e-3, 3600.0)}


def warn_implausible_slo(flag: str, metric: str, value_s: float, unit: str) -> None:
    """A warning line on stderr when an SLO of ``value_s`` seconds is implausible for ``metric``
    (``PLAUSIBLE_SLO_S``): the unit of the flag (``unit``: 's' or 'ms') was probably mistaken for the other."""
    import sys

    lo, hi = PLAUSIBLE_SLO_S[metric]
    if value_s is None or value_s == 0 or lo <= value_s <= hi:
        return
    if unit == "s":
        fix = f"if you meant {value_s:g} ms, give {value_s / 1e3:g}"
    else:
        fix = f"if you meant {value_s * 1e3:g} s, give {value_s * 1e6:g} (milliseconds)"
    print(f"warning: {flag} is {value_s:g} s, an implausible {metric.upper()} SLO ({flag.split()[0]} takes "
          f"{'seconds' if unit == 's' else 'milliseconds'}); {fix}", file=sys.stderr)  # fmt: skip


def slo_seconds(flag: str, metric: str) -> Any:
    """An argparse ``type`` for an SLO flag in seconds: a float, with ``warn_implausible_slo``'s warning."""

    def parse(text: str) -> float:
        value = float(text)
        warn_implausible_slo(f"{flag} {text}", metric, value, "s")
        return value

    parse.__name__ = "seconds"  # argparse names the type in its error: "invalid seconds value"
    return parse


def add_slo_arguments(p: ArgumentContainer) -> None:
    """--slo-ttft, --slo-tpot, --slo-e2el: the SLOs of goodput, in seconds (an implausible value warns)."""
    for metric, what in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "end-to-end latency")):
        p.add_argument(f"--slo-{metric}", type=slo_seconds(f"--slo-{metric}", metric), default=None, metavar="S",
                       help=f"{what} SLO in seconds, for goodput (default: none)")  # fmt: skip


LATENCY_LABELS = {"ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL", "e2el_s": "E2E latency"}


def reject_beyond_context(requests: list[Any], max_len: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """The requests of a workload that the one request rule (``workbench.request.validate_request``) accepts within
    ``max_len``, and the others as ``add_rejections`` lists them (``request_id``, ``reason``): the capacity planner's
    share of the rule ``replay`` and ``simulate`` apply as they run (a row beyond ``max_model_len`` is rejected and
    counted, never capped). A TraceError when there is no request to run (a header-only csv, an empty jsonl,
    ``--limit 0``): latencies of zero requests are not a result."""
    from workbench.errors import RequestError
    from workbench.request import validate_request

    served, rejected = [], []
    for r in TraceStream(iter(requests)):
        try:
            validate_request(r.prompt_len, r.output_len, max_len)
        except RequestError as exc:
            rejected.append({"request_id": r.request_id, "reason": str(exc)})
            continue
        served.append(r)
    return served, rejected


class TraceStream:
    """The requests of a stream as they are read, unchanged (a row beyond ``max_model_len`` is rejected where it is
    served, never clipped). A TraceError now when the stream has no request."""

    def __init__(self, requests: Iterator[Any]) -> None:
        from workbench.errors import TraceError

        self._first = next(requests, None)
        if self._first is None:
            raise TraceError(
                "the trace has no requests (an empty or header-only file, or --limit 0): give a trace with at least "
                "one request, or a --limit of 1 or more"
            )
        self._rest = requests

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain([self._first], self._rest)


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


def add_rejections(summary: dict[str, Any], rejected: list[dict[str, Any]]) -> None:
    """A serving run's rejected requests in its summary: ``rejected`` (each one's ``request_id`` and ``reason``, in
    the order the run rejected them), ``num_rejected`` and ``first_rejected`` (the first of them, or None), so that a
    trace whose rows exceed ``max_model_len`` says how many and which, instead of being capped."""
    summary["rejected"] = rejected
    summary["num_rejected"] = len(rejected)
    summary["first_rejected"] = rejected[0] if rejected else None


def all_rejected_exit_code(command: str, summary: dict[str, Any]) -> int:
    """1 when a serving run rejected every one of its requests (its latencies would be reported as 0.0); else 0.
    Any rejection is one line on stderr: how many, and the first one's request id and reason."""
    import sys

    rejected = summary.get("rejected") or []
    if not rejected:
        return 0
    first = rejected[0]
    if summary["num_requests"] > 0 and len(rejected) == summary["num_requests"]:
        print(f"workbench {command}: all {len(rejected)} requests were rejected; the first: {first['reason']}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"workbench {command}: {len(rejected)} of {summary['num_requests']} requests rejected (the others were "
          f"served); the first, request {first['request_id']}: {first['reason']}", file=sys.stderr)  # fmt: skip
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
