"""Workloads: synthetic request streams and loaders for real LLM-serving traces.

A workload is a list of ``Request`` records (arrival time, prompt and output lengths, optional token ids
and prefix-block hash ids) sorted by arrival. The engine and the simulator consume the same records.

Names accepted by ``load_workload``:

- ``azure-code``, ``azure-conv``: the Azure LLM inference traces of 2023 (Splitwise), CSV with columns
  ``TIMESTAMP, ContextTokens, GeneratedTokens``; arrivals are relative to the first row;
- ``mooncake-conversation``, ``mooncake-synthetic``: the Mooncake (FAST'25) traces, JSON lines with
  ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token prompt
  block; equal ids are equal prefix blocks);
- ``poisson:RATE`` and ``gamma:RATE:CV``: synthetic arrivals at RATE requests/s (Gamma inter-arrival times
  with coefficient of variation CV model burstiness; CV = 1 is Poisson), lengths from ``prompt_lens`` and
  ``output_lens`` specs (see ``LengthSpec``);
- a path to a ``.csv`` (Azure format) or ``.jsonl`` (Mooncake format) file.

Every trace file must list its rows in non-decreasing time: a row earlier than the one before it is a
``TraceError`` naming its line (one rule for every command that reads traces; nothing is re-sorted silently).

Token ids. Traces carry lengths, not text. ``prompt_token_ids`` makes ids deterministically from a seed
and a vocabulary size; for requests with ``hash_ids`` each 512-token block's ids depend only on its hash
id, so requests that share hash ids share token blocks and a prefix cache sees the trace's real sharing.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from workbench.config import DATA_DIR
from workbench.errors import TraceError
from workbench.request import Request

TRACES_DIR = DATA_DIR / "traces"
TRACE_FILES = {
    "azure-code": TRACES_DIR / "azure2023" / "code.csv",
    "azure-conv": TRACES_DIR / "azure2023" / "conv.csv",
    "mooncake-conversation": TRACES_DIR / "mooncake" / "conversation_trace.jsonl",
    "mooncake-synthetic": TRACES_DIR / "mooncake" / "synthetic_trace.jsonl",
}
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


# ---- synthetic -------------------------------------------------------------------------------------------
def gamma_arrivals(num_requests: int, rate: float, cv: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) with Gamma inter-arrival gaps of mean ``1/rate`` and coefficient of variation ``cv``.

    Shape ``k = 1/cv**2`` and scale ``1/(rate k)``: ``cv = 1`` is Poisson, larger is burstier.
    """
    if not rate > 0 or not math.isfinite(rate):
        raise TraceError(f"request rate must be a positive number, got {rate!r}")
    if not cv > 0 or not math.isfinite(cv):
        raise TraceError(f"burstiness cv must be a positive number, got {cv!r}")
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=num_requests)
    return np.cumsum(gaps).tolist()


@dataclass(frozen=True)
class LengthSpec:
    """A length distribution, written ``fixed:N``, ``uniform:LO:HI`` (inclusive), ``lognormal:MEDIAN:SIGMA``
    (``MEDIAN * exp(SIGMA * z)`` rounded, at least 1) or ``zipf:A:MAX`` (``P(k) ~ k**-A`` on ``1..MAX``)."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        kinds = {"fixed": 1, "uniform": 2, "lognormal": 2, "zipf": 2}
        parts = str(text).split(":")
        if parts[0] not in kinds or len(parts) - 1 != kinds[parts[0]]:
            raise TraceError(
                f"bad length spec {text!r}; expected fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA or zipf:A:MAX"
            )
        try:
            params = tuple(float(p) for p in parts[1:])
        except ValueError:
            raise TraceError(f"bad length spec {text!r}: parameters must be numbers") from None
        kind = parts[0]
        ok = {
            "fixed": lambda p: p[0] >= 1,
            "uniform": lambda p: 1 <= p[0] <= p[1],
            "lognormal": lambda p: p[0] > 0 and p[1] >= 0,
            "zipf": lambda p: p[0] > 0 and p[1] >= 1,
        }[kind](params)
        if not ok:
            raise TraceError(f"bad length spec {text!r}: parameters out of range")
        return cls(kind, params)

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        p = self.params
        if self.kind == "fixed":
            return [int(p[0])] * n
        if self.kind == "uniform":
            return rng.integers(int(p[0]), int(p[1]) + 1, size=n).tolist()
        if self.kind == "lognormal":
            values = np.rint(p[0] * np.exp(p[1] * rng.standard_normal(n)))
            return np.maximum(values, 1).astype(np.int64).tolist()
        ks = np.arange(1, int(p[1]) + 1, dtype=np.float64)
        weights = ks ** -p[0]
        return (rng.choice(len(ks), size=n, p=weights / weights.sum()) + 1).tolist()


def synthetic_workload(
    num_requests: int,
    rate: float,
    cv: float = 1.0,
    prompt_lens: str | LengthSpec = "uniform:64:1024",
    output_lens: str | LengthSpec = "uniform:16:256",
    seed: int = 0,
) -> list[Request]:
    """Seeded synthetic requests: Gamma(cv) arrivals at ``rate`` requests/s (Poisson for cv = 1)."""
    return list(iter_synthetic(num_requests, rate, cv, prompt_lens, output_lens, seed))


def iter_synthetic(
    num_requests: int,
    rate: float,
    cv: float = 1.0,
    prompt_lens: str | LengthSpec = "uniform:64:1024",
    output_lens: str | LengthSpec = "uniform:16:256",
    seed: int = 0,
) -> Iterator[Request]:
    """``synthetic_workload``'s requests made one at a time, from arrays of their times and lengths (24 bytes a
    request) drawn now."""
    if num_requests < 0:
        raise TraceError(f"num_requests must be >= 0, got {num_requests}")
    rng = np.random.default_rng(seed)
    arrivals = np.asarray(gamma_arrivals(num_requests, rate, cv, rng), dtype=np.float64)
    pspec = prompt_lens if isinstance(prompt_lens, LengthSpec) else LengthSpec.parse(prompt_lens)
    ospec = output_lens if isinstance(output_lens, LengthSpec) else LengthSpec.parse(output_lens)
    prompts = np.asarray(pspec.sample(num_requests, rng), dtype=np.int64)
    outputs = np.asarray(ospec.sample(num_requests, rng), dtype=np.int64)
    return (Request(i, float(arrivals[i]), int(prompts[i]), int(outputs[i])) for i in range(num_requests))


# ---- real traces -----------------------------------------------------------------------------------------
_AZURE_TS = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)$")


def _azure_seconds(text: str) -> tuple[int, float]:
    """(day ordinal, seconds into the day) of an Azure TIMESTAMP such as ``2023-11-16 18:17:03.9799600``."""
    m = _AZURE_TS.match(text.strip())
    if m is None:
        raise ValueError(f"bad TIMESTAMP {text!r}")
    y, mo, d, hh, mm = (int(g) for g in m.groups()[:5])
    sec = float(m.group(6))
    if hh > 23 or mm > 59 or sec >= 60:
        raise ValueError(f"bad TIMESTAMP {text!r}: time of day must be 00:00:00 to 23:59:59.999...")
    try:
        day = date(y, mo, d).toordinal()
    except ValueError as exc:
        raise ValueError(f"bad TIMESTAMP {text!r}: {exc}") from None
    return day, hh * 3600 + mm * 60 + sec


def _check_order(where: str, arrival: float, previous: tuple[float, int] | None, path: Path) -> None:
    """The one ordering rule of every trace file: rows in non-decreasing time, else a TraceError naming the first
    row that is earlier than the one before it."""
    if previous is not None and arrival < previous[0]:
        raise TraceError(
            f"{where}: timestamp is {previous[0] - arrival:.6g} s earlier than line {previous[1]}'s; a trace must be "
            f"sorted by arrival time (sort {path.name} by its timestamp column)"
        )


def _int_field(value: object, name: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise TraceError(f"{where}: {name} must be >= {minimum}, got {number}")
    return number


def iter_azure_csv(path: str | Path) -> Iterator[Request]:
    """The requests of an Azure LLM inference trace CSV, read row by row as they are taken (the file is opened and
    its header checked now); arrival times are seconds after the first row's TIMESTAMP."""
    path = Path(path)
    try:
        handle = path.open(newline="")
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    reader = csv.reader(handle)
    header = next(reader, None)
    if header is None or [h.strip() for h in header[:3]] != list(AZURE_COLUMNS):
        handle.close()
        raise TraceError(f"{path}:1: expected header {','.join(AZURE_COLUMNS)}, got {header!r}")
    return _azure_rows(path, handle, reader, len(header))


def _azure_rows(path: Path, handle: Any, reader: Any, num_fields: int) -> Iterator[Request]:
    with handle:
        first: tuple[int, float] | None = None
        previous: tuple[float, int] | None = None
        count = 0
        for lineno, row in enumerate(reader, start=2):
            where = f"{path}:{lineno}"
            if not row:
                continue
            if len(row) != num_fields:
                raise TraceError(f"{where}: expected {num_fields} fields, got {len(row)}")
            try:
                day, sec = _azure_seconds(row[0])
            except ValueError as exc:
                raise TraceError(f"{where}: {exc}") from None
            if first is None:
                first = (day, sec)
            arrival = (day - first[0]) * 86400 + (sec - first[1])
            _check_order(where, arrival, previous, path)
            previous = (arrival, lineno)
            prompt = _int_field(row[1].strip(), "ContextTokens", where, minimum=1)
            output = _int_field(row[2].strip(), "GeneratedTokens", where)
            yield Request(count, arrival, prompt, output)
            count += 1


def load_azure_csv(path: str | Path) -> list[Request]:
    """Read an Azure LLM inference trace CSV; arrival times are seconds after the first row's TIMESTAMP."""
    return list(iter_azure_csv(path))


def iter_mooncake_jsonl(path: str | Path) -> Iterator[Request]:
    """The requests of a Mooncake trace (JSON lines), read line by line as they are taken (the file is opened now);
    arrival times are seconds after the first line's timestamp (ms)."""
    path = Path(path)
    try:
        handle = path.open()
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    return _mooncake_lines(path, handle)


def _mooncake_lines(path: Path, handle: Any) -> Iterator[Request]:
    first_ms: float | None = None
    previous: tuple[float, int] | None = None
    count = 0
    with handle:
        for lineno, line in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
            if missing:
                raise TraceError(f"{where}: missing key(s) {missing}")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise TraceError(f"{where}: timestamp must be a number of milliseconds, got {ts!r}")
            prompt = _int_field(obj["input_length"], "input_length", where, minimum=1)
            output = _int_field(obj["output_length"], "output_length", where)
            hash_ids = obj.get("hash_ids")
            if hash_ids is not None:
                if not isinstance(hash_ids, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
                ):
                    raise TraceError(f"{where}: hash_ids must be a list of integers")
                if len(hash_ids) != math.ceil(prompt / MOONCAKE_BLOCK_TOKENS):
                    raise TraceError(
                        f"{where}: {len(hash_ids)} hash_ids for input_length {prompt}; expected "
                        f"ceil({prompt} / {MOONCAKE_BLOCK_TOKENS}) = {math.ceil(prompt / MOONCAKE_BLOCK_TOKENS)}"
                    )
            if first_ms is None:
                first_ms = float(ts)
            arrival = (ts - first_ms) / 1000.0
            _check_order(where, arrival, previous, path)
            previous = (arrival, lineno)
            yield Request(count, arrival, prompt, output, hash_ids=hash_ids)
            count += 1


def load_mooncake_jsonl(path: str | Path) -> list[Request]:
    """Read a Mooncake trace (JSON lines); arrival times are seconds after the first line's timestamp (ms)."""
    return list(iter_mooncake_jsonl(path))


def iter_trace_file(path: str | Path) -> Iterator[Request]:
    """An Azure ``.csv`` or a Mooncake ``.jsonl`` file, by suffix, read lazily (``iter_azure_csv``)."""
    path = Path(path)
    if path.suffix == ".csv":
        return iter_azure_csv(path)
    if path.suffix in (".jsonl", ".json"):
        return iter_mooncake_jsonl(path)
    raise TraceError(f"{path}: unknown trace format; expected a .csv (Azure) or .jsonl (Mooncake) file")


def load_trace_file(path: str | Path) -> list[Request]:
    """An Azure ``.csv`` or a Mooncake ``.jsonl`` file, by suffix."""
    return list(iter_trace_file(path))


# ---- transformations -------------------------------------------------------------------------------------
def _time_factor(time_scale: float, rate_scale: float) -> float:
    for name, value in (("time_scale", time_scale), ("rate_scale", rate_scale)):
        if not value > 0 or not math.isfinite(value):
            raise TraceError(f"{name} must be a positive number, got {value!r}")
    return time_scale / rate_scale


def scale_time(requests: list[Request], time_scale: float = 1.0, rate_scale: float = 1.0) -> list[Request]:
    """Arrivals multiplied by ``time_scale`` and divided by ``rate_scale`` (2.0 = twice the request rate)."""
    factor = _time_factor(time_scale, rate_scale)
    if factor == 1.0:
        return list(requests)
    return [replace(r, arrival_time_s=r.arrival_time_s * factor) for r in requests]


def check_max_len(max_len: int) -> None:
    """A TraceError unless ``max_len`` holds one prompt and one output token."""
    if max_len < 2:
        raise TraceError(f"max_len must be >= 2 (one prompt and one output token), got {max_len}")


def clip_request(r: Request, max_len: int) -> Request:
    """``r`` clipped so that prompt + output <= ``max_len``, keeping at least one output token (``r`` itself when
    it fits)."""
    prompt = min(r.prompt_len, max_len - 1)
    output = max(min(r.output_len, max_len - prompt), 1)
    if prompt == r.prompt_len and output == r.output_len:
        return r
    ids = r.prompt_token_ids[:prompt] if r.prompt_token_ids is not None else None
    hashes = r.hash_ids[: math.ceil(prompt / MOONCAKE_BLOCK_TOKENS)] if r.hash_ids is not None else None
    return replace(r, prompt_len=prompt, output_len=output, prompt_token_ids=ids, hash_ids=hashes)


def truncate_to_context(requests: list[Request], max_len: int) -> list[Request]:
    """Clip each request so that prompt + output <= ``max_len``, keeping at least one output token."""
    check_max_len(max_len)
    return [clip_request(r, max_len) for r in requests]


def iter_workload(
    name: str,
    limit: int | None = None,
    time_scale: float = 1.0,
    rate_scale: float = 1.0,
    max_len: int | None = None,
    num_requests: int = 1000,
    prompt_lens: str = "uniform:64:1024",
    output_lens: str = "uniform:16:256",
    seed: int = 0,
) -> Iterator[Request]:
    """``load_workload``'s requests, one at a time: a trace file is read as the requests are taken, so a consumer
    that keeps none holds one row at a time. Its arguments are checked (and a file opened) now, its rows when read.
    """
    if limit is not None and limit < 0:
        raise TraceError(f"limit must be >= 0, got {limit}")
    factor = _time_factor(time_scale, rate_scale)
    if max_len is not None:
        check_max_len(max_len)
    requests: Iterable[Request]
    if name in TRACE_FILES:
        requests = iter_trace_file(TRACE_FILES[name])
    elif name.startswith(("poisson:", "gamma:")):
        parts = name.split(":")
        try:
            rate = float(parts[1])
            cv = float(parts[2]) if parts[0] == "gamma" and len(parts) == 3 else 1.0
        except (ValueError, IndexError):
            raise TraceError(f"bad synthetic workload {name!r}; expected poisson:RATE or gamma:RATE:CV") from None
        if (parts[0] == "poisson" and len(parts) != 2) or (parts[0] == "gamma" and len(parts) != 3):
            raise TraceError(f"bad synthetic workload {name!r}; expected poisson:RATE or gamma:RATE:CV")
        n = num_requests if limit is None else min(limit, num_requests)
        requests = iter_synthetic(n, rate, cv, prompt_lens, output_lens, seed)
    elif Path(name).suffix in (".csv", ".jsonl", ".json") or Path(name).exists():
        requests = iter_trace_file(name)
    else:
        raise TraceError(
            f"unknown trace {name!r}; expected one of {', '.join(TRACE_FILES)}, poisson:RATE, gamma:RATE:CV "
            "or a .csv/.jsonl file"
        )
    return _transformed(requests, limit, factor, max_len)


def _transformed(
    requests: Iterable[Request], limit: int | None, factor: float, max_len: int | None
) -> Iterator[Request]:
    for r in itertools.islice(requests, limit):
        if factor != 1.0:
            r = replace(r, arrival_time_s=r.arrival_time_s * factor)
        yield r if max_len is None else clip_request(r, max_len)


def load_workload(
    name: str,
    limit: int | None = None,
    time_scale: float = 1.0,
    rate_scale: float = 1.0,
    max_len: int | None = None,
    num_requests: int = 1000,
    prompt_lens: str = "uniform:64:1024",
    output_lens: str = "uniform:16:256",
    seed: int = 0,
) -> list[Request]:
    """A workload by name (see the module docstring) or file path, first ``limit`` requests, scaled, clipped.

    ``num_requests``, ``prompt_lens``, ``output_lens`` and ``seed`` apply to the synthetic names only
    (``limit`` caps them too).
    """
    return list(iter_workload(name, limit, time_scale, rate_scale, max_len, num_requests, prompt_lens, output_lens,
                              seed))  # fmt: skip


# ---- token ids and engine sequences ---------------------------------------------------------------------
def _random_ids(seed_words: list[int], n: int, vocab_size: int) -> list[int]:
    return np.random.default_rng(seed_words).integers(0, vocab_size, size=n).tolist()


def prompt_token_ids(request: Request, vocab_size: int, seed: int = 0) -> list[int]:
    """The request's prompt ids: its own if it has them, else deterministic ones from ``seed``.

    With ``hash_ids`` block ``i`` is a function of ``(seed, hash_ids[i])`` only, so equal hash ids give
    equal 512-token blocks; without, the ids are a function of ``(seed, request_id)``.
    """
    if vocab_size < 1:
        raise TraceError(f"vocab_size must be >= 1, got {vocab_size}")
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.hash_ids:
        ids: list[int] = []
        for h in request.hash_ids:
            ids += _random_ids([seed, 1, h], MOONCAKE_BLOCK_TOKENS, vocab_size)
        return ids[: request.prompt_len]
    return _random_ids([seed, 0, request.request_id], request.prompt_len, vocab_size)


# ---- statistics ------------------------------------------------------------------------------------------
def prefix_hit_ratio(requests: list[Request]) -> float | None:
    """Block-level prefix-cache hit ratio with an unlimited cache, in arrival order (None without hash ids).

    A request's hit blocks are the longest prefix of its ``hash_ids`` all seen in earlier requests (prefix
    caching reuses a block only if every block before it is reused too); ratio = hit blocks / all blocks.
    """
    if not any(r.hash_ids for r in requests):
        return None
    seen: set[int] = set()
    hits = total = 0
    for r in sorted(requests, key=lambda r: r.arrival_time_s):
        ids = r.hash_ids or []
        total += len(ids)
        for h in ids:
            if h not in seen:
                break
            hits += 1
        seen.update(ids)
    return hits / total if total else 0.0


def trace_stats(requests: list[Request]) -> dict[str, object]:
    """Number of requests, duration (first to last arrival, s), mean rate (requests / duration), prompt and
    output length percentiles, and the block-level prefix hit ratio (None without hash ids)."""
    n = len(requests)
    arrivals = [r.arrival_time_s for r in requests]
    duration = (max(arrivals) - min(arrivals)) if n else 0.0

    def pct(values: list[int]) -> dict[str, float]:
        if not values:
            return {k: 0.0 for k in ("mean", "p50", "p90", "p99", "max")}
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return {
            "mean": float(arr.mean()),
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "max": float(arr.max()),
        }

    return {
        "num_requests": n,
        "duration_s": float(duration),
        "request_rate": n / duration if duration > 0 else 0.0,
        "prompt_len": pct([r.prompt_len for r in requests]),
        "output_len": pct([r.output_len for r in requests]),
        "prefix_hit_ratio": prefix_hit_ratio(requests),
    }
