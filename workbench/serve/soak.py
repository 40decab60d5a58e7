"""Soak: many requests through the engine, in process or through ``workbench serve``, checking that nothing leaks.

``workbench bench soak`` (``workbench.commands.bench_soak``) is the command; a benchmark, not a test.

**In process** (``soak_engine``). One seeded workload (``make_workload``): prompt and output lengths uniform in
[1, ``max_prompt_len``] and [1, ``max_output_len``], a Poisson number of new requests joining before every engine
step (so requests arrive while others run), and ``abort_fraction`` of them marked to be aborted once they have a
random number of their output tokens (before their first token, mid-decode, or after a preemption).

1. Reference: the workload without aborts and without speculation, on a pool that holds every request at once (no
   preemption). Its peak of blocks in use is the workload's need.
2. Soak: the same workload with the aborts (and ``--speculative-config``, if given) on a pool of ``pool_fraction``
   x that need (at least one longest request). After every step and every abort the block manager's invariants are
   checked against the block tables of every live request (``Engine.check_invariants``: reference counts, free
   lists, no block twice); at the end every block must be free again and the engine must hold no request
   (``Engine.request_state``: every per-request store empty), and every request that was not aborted must have the
   reference's greedy tokens (speculation included: greedy output with a proposer equals greedy output without).

The engine is driven through its API only (``add_request``, ``step``, ``abort``, ``stats``); its step log is
bounded as a server's is. The resident set size (VmRSS) is read after the first tenth of the requests has joined
(warm-up) and at the end.

**Through the server** (``soak_server``). ``workbench serve`` in a child process on 127.0.0.1
(``workbench.serve.launch.ServerProcess``); the requests go in ``num_samples`` rounds of streaming completions
(token-id prompts, greedy, EOS ignored, at most ``max_concurrency`` in flight), a marked fraction of them dropped by
their client after the first token (the server aborts them). The first round is the warm-up, the first
``warm_up_fraction`` (10%) of the requests; the rest go in ``num_samples`` equal rounds. After each round the server
process's RSS is read from ``/proc/PID/status`` (the report's ``samples``: the RSS series against the requests
sent). RSS is flat when no reading after the warm-up is more than ``1 + rss_tolerance`` x the one at its end; the
report also fits the growth per 1,000 requests over the second half of the readings, which tells a leak (a line
that keeps rising) from caches filling (steps that level off). At the end the server must report no request running
or waiting, no KV block in use and no per-request entry in its engine (``workbench:engine_request_entries``).

What held memory before (issue 29; tiny-gqa, 10,000 requests: 685 -> 823 MiB, +20%): oneDNN's primitives, one per
(matrix, token count) shape of the packed linears, ~0.6 MiB each, kept in two 1,024-entry caches; the products then
ran at 45 padded row counts, and since 2026-12-06 run through the blocked op of ``kernels/linear_cpu.py``, which
keeps no per-shape state. Not the allocator: jemalloc grew as glibc did
and glibc's free-but-held bytes stayed at 1-2 MiB (``mallinfo2``), and the engine with unpacked linears read the
same RSS from the 400th request to the 2,000th.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from workbench.errors import ConfigError
from workbench.serve.benchmark import sse_chunks
from workbench.timing import now

STEP_LOG_STEPS = 1024  # the soak bounds the engine's step log as a server does (async_engine.STEP_LOG_STEPS)


def rss_kib(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A memory figure (``VmRSS``, ``VmHWM``) of process ``pid`` from ``/proc/PID/status``, in KiB (0 where /proc
    or the process is missing)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


@dataclass
class Workload:
    """Requests (prompt ids, output length), how many join before each step, abort marks (index -> output
    tokens it has when its abort comes)."""

    requests: list[tuple[list[int], int]]
    joins: list[int]
    aborts: dict[int, int]


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's method; ``mean`` small)."""
    k, p, limit = 0, rng.random(), math.exp(-mean)
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def make_workload(
    num_requests: int,
    vocab_size: int,
    max_prompt_len: int,
    max_output_len: int,
    arrival_rate: float = 0.15,
    abort_fraction: float = 0.1,
    seed: int = 0,
) -> Workload:
    """The seeded workload of the module docstring; ``arrival_rate``: mean requests joining before each step."""
    if num_requests < 1 or max_prompt_len < 1 or max_output_len < 1:
        raise ConfigError("soak: the number of requests and the longest prompt and output must be >= 1, got "
                          f"{num_requests}, {max_prompt_len}, {max_output_len}")  # fmt: skip
    if not 0.0 <= abort_fraction <= 1.0:
        raise ConfigError(f"soak: --abort-fraction must be in [0, 1], got {abort_fraction}")
    if not arrival_rate > 0:
        raise ConfigError(f"soak: --arrival-rate must be > 0, got {arrival_rate}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, max_prompt_len))]
        requests.append((prompt, rng.randint(1, max_output_len)))
    joins, left = [], num_requests
    while left > 0:
        k = min(_poisson(rng, arrival_rate), left)
        joins.append(k)
        left -= k
    marked = rng.sample(range(num_requests), int(round(abort_fraction * num_requests)))
    return Workload(requests, joins, {i: rng.randrange(requests[i][1]) for i in marked})


# ---- in process ------------------------------------------------------------------------------------------------
def run_workload(model: Any, config: Any, workload: Workload, with_aborts: bool, check: bool) -> dict[str, Any]:
    """Serve ``workload`` on ``Engine(model, config)`` through the engine API; tokens and finish reason per request
    index, counts, the pool and request state at the end, and RSS figures."""
    from workbench.engine.engine import Engine
    from workbench.request import SamplingParams

    engine = Engine(model, config)
    engine.new_step_log(max_steps=STEP_LOG_STEPS)
    requests, joins = workload.requests, workload.joins
    aborts = workload.aborts if with_aborts else {}
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    index_of: dict[int, int] = {}
    abort_after: dict[int, int] = {}  # request id -> abort once it has this many output tokens
    num_out: dict[int, int] = {}  # request id -> output tokens reported so far
    rng = random.Random(len(requests))
    step = nxt = peak_used = preemptions = checks = waiting_sum = 0
    abort_states: dict[str, int] = {}
    rss_warm = 0

    def record(out: Any, reason: str) -> None:
        nonlocal preemptions
        i = index_of.pop(out.request_id)
        tokens[i], reasons[i] = out.result.tokens, reason
        preemptions += out.result.num_preemptions
        num_out.pop(out.request_id, None)
        abort_after.pop(out.request_id, None)  # finished before its abort came

    t0 = now()
    while nxt < len(requests) or engine.has_unfinished():
        for _ in range(joins[step] if step < len(joins) else 0):
            prompt, out_len = requests[nxt]
            rid = engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
            index_of[rid] = nxt
            if nxt in aborts:
                abort_after[rid] = aborts[nxt]
            nxt += 1
            if nxt == max(len(requests) // 10, 1):
                rss_warm = rss_kib()
        due = [rid for rid, k in abort_after.items() if num_out.get(rid, 0) >= k]
        if due and rng.random() < 0.5:
            due = due[:1]  # not all at once: some wait a step or more past their mark
        for rid in due:
            del abort_after[rid]
            out = engine.abort(rid)
            if out is None:
                continue
            state = "before its first token" if out.num_output_tokens == 0 else "mid-decode"
            state += ", after a preemption" if out.result.num_preemptions else ""
            abort_states[state] = abort_states.get(state, 0) + 1
            record(out, "abort")
            if check:
                engine.check_invariants()
                checks += 1
        for out in engine.step():
            if out.finished:
                record(out, out.finish_reason)
            else:
                num_out[out.request_id] = out.num_output_tokens
        if check:
            engine.check_invariants()
            checks += 1
        stats = engine.stats()
        peak_used = max(peak_used, stats["num_used_blocks"])
        waiting_sum += stats["num_waiting"]
        step += 1
    wall = now() - t0
    engine.check_invariants()
    stats = engine.stats()
    return {
        "tokens": tokens,
        "reasons": reasons,
        "num_aborts": sum(abort_states.values()),
        "abort_states": abort_states,
        "num_preemptions": preemptions,
        "peak_used_blocks": peak_used,
        "leaked_blocks": stats["num_used_blocks"],
        "num_blocks": stats["num_blocks"],
        "request_state": engine.request_state(),
        "invariant_checks": checks,
        "num_steps": step,
        "mean_waiting": waiting_sum / max(step, 1),
        "wall_s": wall,
        "rss_warm_kib": rss_warm,
        "rss_end_kib": rss_kib(),
        "step_log_entries": len(engine.step_log),
        "speculative": engine.speculative_stats(),
    }


def soak_engine(
    model: Any,
    workload: Workload,
    pool_fraction: float = 0.3,
    speculative_config: Any = None,
    max_num_seqs: int = 16,
    block_size: int = 16,
    policy: str = "continuous",
) -> dict[str, Any]:
    """The in-process soak of the module docstring; the report's ``ok`` is true when no block leaked, the engine
    holds no request and every unaborted request has the reference's tokens."""
    from workbench.config import ceil_div
    from workbench.engine.config import EngineConfig

    if not 0.0 < pool_fraction <= 1.0:
        raise ConfigError(f"soak: --pool-fraction must be in (0, 1], got {pool_fraction}")
    max_len = max(len(p) + n for p, n in workload.requests) + 1
    longest = ceil_div(max_len, block_size)
    common = {"policy": policy, "block_size": block_size, "max_num_seqs": max_num_seqs, "max_model_len": max_len}
    rss_start = rss_kib()
    ref = run_workload(model, EngineConfig(**common, num_blocks=max_num_seqs * longest), workload, False, False)
    need = ref["peak_used_blocks"]
    num_blocks = max(longest, round(pool_fraction * need))
    config = EngineConfig(**common, num_blocks=num_blocks, speculative_config=speculative_config)
    soak = run_workload(model, config, workload, True, True)
    unaborted = [i for i, r in soak["reasons"].items() if r != "abort"]
    matching = sum(soak["tokens"][i] == ref["tokens"][i] for i in unaborted)
    held = {k: v for k, v in soak["request_state"].items() if v}
    warm, end = soak["rss_warm_kib"], soak["rss_end_kib"]
    out = {
        "mode": "engine",
        "requests": len(workload.requests),
        "served": sum(r == "length" for r in soak["reasons"].values()),
        "aborted": soak["num_aborts"],
        "marked_for_abort": len(workload.aborts),
        "aborted_while": soak["abort_states"],
        "rejected": sum(r == "rejected" for r in soak["reasons"].values()),
        "preemptions": soak["num_preemptions"],
        "reference_preemptions": ref["num_preemptions"],
        "blocks_leaked": soak["leaked_blocks"],
        "free_blocks_at_end": soak["num_blocks"] - soak["leaked_blocks"],
        "pool_blocks": num_blocks,
        "need_blocks": need,
        "invariant_checks": soak["invariant_checks"],
        "requests_held_at_end": held,
        "unaborted_tokens_match": f"{matching}/{len(unaborted)}",
        "soak_steps": soak["num_steps"],
        "mean_waiting": round(soak["mean_waiting"], 1),
        "step_log_entries": soak["step_log_entries"],
        "soak_wall_s": round(soak["wall_s"], 1),
        "reference_wall_s": round(ref["wall_s"], 1),
        "rss_mib": {
            "start": _mib(rss_start),
            "warm_up": _mib(warm),
            "end": _mib(end),
            "peak": _mib(rss_kib("self", "VmHWM")),
        },  # fmt: skip
        "rss_growth_after_warm_up": round(end / warm - 1, 4) if warm else None,
        "speculative_config": None if config.speculative_config is None else vars(config.speculative_config),
        "speculative": soak["speculative"],
        "loadavg": _loadavg(),
    }
    out["ok"] = out["blocks_leaked"] == 0 and not held and matching == len(unaborted)
    return out


# ---- through the server ----------------------------------------------------------------------------------------
def growth_per_1000(samples: list[dict[str, Any]]) -> float | None:
    """The least-squares slope of ``rss_mib`` against ``requests`` over ``samples``, in MiB per 1,000 requests (None
    for fewer than two readings)."""
    if len(samples) < 2:
        return None
    xs = [s["requests"] for s in samples]
    ys = [s["rss_mib"] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return round(1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 2) if sxx else None


def metric_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The value of each sample ``name`` in Prometheus text, summed over its labels (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


SERVER_GAUGES = (
    "workbench:num_requests_running",
    "workbench:num_requests_waiting",
    "workbench:kv_blocks_used",
    "workbench:engine_request_entries",
)


async def _stream_one(session: Any, url: str, model: str, prompt: list[int], max_tokens: int, drop: bool) -> str:
    """One streaming completion; with ``drop`` the client goes away after the first token. 'ok', 'dropped' or the
    error."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
               "ignore_eos": True}  # fmt: skip
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                return f"HTTP {resp.status}: {(await resp.text())[:200]}"
            async for chunk in sse_chunks(resp):
                if chunk is None:
                    return "ok"
                if "error" in chunk:
                    return f"error: {json.dumps(chunk)[:200]}"
                if drop:
                    resp.close()  # the connection goes: the server aborts the request
                    return "dropped"
            return "stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001  (any client failure is a failed request of the report)
        return f"{type(exc).__name__}: {exc}"


async def _round(base_url: str, model: str, requests: list[tuple[list[int], int, bool]], max_concurrency: int,
                 timeout_s: float) -> list[str]:  # fmt: skip
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def one(prompt: list[int], max_tokens: int, drop: bool) -> str:
            async with limit:
                return await _stream_one(session, base_url + "/v1/completions", model, prompt, max_tokens, drop)

        return await asyncio.gather(*(one(*r) for r in requests))


async def _scrape(base_url: str) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(base_url + "/metrics") as resp:
            return metric_values(await resp.text(), SERVER_GAUGES)


def soak_server(
    base_url: str,
    pid: int,
    model: str,
    workload: Workload,
    max_concurrency: int = 16,
    num_samples: int = 10,
    rss_tolerance: float = 0.10,
    round_timeout_s: float = 3600.0,
    settle_s: float = 10.0,
    warm_up_fraction: float = 0.10,
) -> dict[str, Any]:
    """The server soak of the module docstring against a running ``workbench serve`` at ``base_url`` (process
    ``pid``); ``workload``'s abort marks are the requests whose client goes away after the first token."""
    if num_samples < 1:
        raise ConfigError(f"soak: --rss-samples must be >= 1 (readings after the warm-up), got {num_samples}")
    if max_concurrency < 1:
        raise ConfigError(f"soak: --max-concurrency must be >= 1, got {max_concurrency}")
    if not 0.0 < warm_up_fraction < 1.0:
        raise ConfigError(f"soak: the warm-up fraction must be in (0, 1), got {warm_up_fraction}")
    reqs = [(p, n, i in workload.aborts) for i, (p, n) in enumerate(workload.requests)]
    warm_n = min(max(1, round(warm_up_fraction * len(reqs))), len(reqs) - num_samples)
    if warm_n < 1:
        raise ConfigError(f"soak: {len(reqs)} requests cannot make a warm-up round and {num_samples} after it")
    bounds = [0] + [warm_n + round((len(reqs) - warm_n) * r / num_samples) for r in range(num_samples + 1)]
    rss_start = rss_kib(pid)
    samples: list[dict[str, Any]] = []
    outcomes: dict[str, int] = {}
    t0 = now()
    for r in range(num_samples + 1):
        chunk = reqs[bounds[r] : bounds[r + 1]]
        for result in asyncio.run(_round(base_url, model, chunk, max_concurrency, round_timeout_s)):
            key = result if result in ("ok", "dropped") else "failed"
            outcomes[key] = outcomes.get(key, 0) + 1
            if key == "failed" and "first_error" not in outcomes:
                outcomes["first_error"] = result  # type: ignore[assignment]
        samples.append({"requests": bounds[r + 1], "s": round(now() - t0, 1), "rss_mib": _mib(rss_kib(pid))})
    wall = now() - t0
    # a dropped client's abort reaches the engine at its next step: wait (bounded) for the server to go idle
    deadline = now() + settle_s
    gauges = asyncio.run(_scrape(base_url))
    while any(gauges.values()) and now() < deadline:
        time.sleep(0.2)
        gauges = asyncio.run(_scrape(base_url))
    warm = samples[0]["rss_mib"]
    later = [s["rss_mib"] for s in samples[1:]]
    growth = max(later) / warm - 1 if warm else None
    out = {
        "mode": "server",
        "requests": len(reqs),
        "completed": outcomes.get("ok", 0),
        "dropped_by_client": outcomes.get("dropped", 0),
        "failed": outcomes.get("failed", 0),
        "first_error": outcomes.get("first_error"),
        "max_concurrency": max_concurrency,
        "wall_s": round(wall, 1),
        "requests_per_s": round(len(reqs) / wall, 2) if wall else None,
        "rss_mib": {
            "start": _mib(rss_start),
            "warm_up": warm,
            "end": samples[-1]["rss_mib"],
            "max_after_warm_up": max(later),
            "peak": _mib(rss_kib(pid, "VmHWM")),
        },  # fmt: skip
        "warm_up_requests": warm_n,
        "rss_growth_after_warm_up": None if growth is None else round(growth, 4),
        "rss_tolerance": rss_tolerance,
        "rss_flat": growth is not None and growth <= rss_tolerance,
        "rss_mib_per_1000_requests_late": growth_per_1000(samples[len(samples) // 2 :]),
        "samples": samples,
        "at_end": {name.split(":", 1)[1]: value for name, value in gauges.items()},
        "loadavg": _loadavg(),
    }
    out["ok"] = out["failed"] == 0 and out["rss_flat"] and not any(gauges.values())
    return out
