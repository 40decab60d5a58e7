"""``workbench bench serve``: an asynchronous load client for any OpenAI-compatible server, with the conventions of
vLLM's ``vllm bench serve`` (its flags, its metric definitions and its result JSON keys), so that figures taken of
this engine line up with figures taken of vLLM by vLLM's own client.

Each request streams (``stream_options.include_usage``); its TTFT is the time from sending to the first chunk with
text, each later chunk adds an inter-token latency (ITL) gap, E2E latency ends at the last chunk, TPOT is
``(E2E - TTFT) / (output tokens - 1)`` and output tokens come from the server's ``usage``. Arrivals: all at once with
``--request-rate inf``, else gaps drawn from a gamma distribution of shape ``--burstiness`` and mean
``1 / request_rate`` (burstiness 1 = Poisson), seeded by ``--seed``; ``--max-concurrency`` caps requests in flight.
Goodput (``--goodput ttft:MS tpot:MS e2el:MS``) counts the requests that meet every SLO given, per second.

Datasets: ``random`` (prompt lengths uniform in ``input_len * [1 - r, 1 + r]``, ids uniform below
``--random-vocab-size``, sent as token-id prompts; output lengths likewise), ``sharegpt`` (a ShareGPT JSON file:
first human turn as the prompt text; prompt and reply lengths counted with ``--tokenizer``) and ``trace`` (a
workbench trace such as ``azure-conv``: its prompt and output lengths, token-id prompts; rows beyond the server's
``max_model_len``, read from ``/v1/models``, are left out and counted, never clipped).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from workbench.errors import ConfigError
from workbench.timing import now

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestOutput:
    """One request as the client saw it (seconds on the client's clock)."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


# ---- datasets --------------------------------------------------------------------------------------------
def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[BenchRequest]:  # fmt: skip
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    ins, outs = lengths(input_len), lengths(output_len)
    return [BenchRequest(rng.integers(0, vocab_size, size=int(n)).tolist(), int(n), int(m)) for n, m in zip(ins, outs)]


def decode_prompts(reqs: list[BenchRequest], tokenizer_dir: str) -> list[BenchRequest]:
    """Token-id prompts as text, for a chat endpoint (as vLLM's random dataset does): each prompt's ids decoded by
    the tokenizer, special tokens left out, its length counted again on the decoded text (decoding and encoding
    again need not give back the same ids)."""
    from workbench.model.tokenizer import TextCodec

    codec = TextCodec.from_dir(tokenizer_dir)
    special = set(codec.hf.all_special_ids)
    out = []
    for r in reqs:
        assert isinstance(r.prompt, list)
        text = codec.hf.decode([t for t in r.prompt if t not in special and t < len(codec.hf)])
        if not text:
            text = codec.hf.decode([t for t in range(len(codec.hf)) if t not in special][:1])
        out.append(BenchRequest(text, len(codec.encode(text)), r.output_len))
    return out


def sharegpt_requests(path: str, num: int, tokenizer_dir: str | None, output_len: int | None,
                      seed: int) -> list[BenchRequest]:  # fmt: skip
    if tokenizer_dir is None:
        raise ConfigError("--dataset-name sharegpt needs --tokenizer DIR to count prompt and reply tokens")
    from workbench.model.tokenizer import TextCodec

    codec = TextCodec.from_dir(tokenizer_dir)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--dataset-path {path}: not a readable ShareGPT JSON file ({exc})") from None
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations", [])) >= 2]
    order = np.random.default_rng(seed).permutation(len(convs))
    out: list[BenchRequest] = []
    for i in order:
        prompt, reply = convs[i][0].get("value", ""), convs[i][1].get("value", "")
        if not prompt:
            continue
        n_out = output_len if output_len is not None else len(codec.encode(reply)) if reply else 0
        if n_out < 1:
            continue
        out.append(BenchRequest(prompt, len(codec.encode(prompt)), n_out))
        if len(out) == num:
            break
    if len(out) < num:
        raise ConfigError(f"--dataset-path {path}: only {len(out)} usable conversations, --num-prompts is {num}")
    return out


def trace_requests(
    name: str, num: int, max_model_len: int | None, vocab_size: int, seed: int
) -> tuple[list[BenchRequest], int]:
    """The first ``num`` rows of trace ``name`` that the server can serve, as they are (token-id prompts), and how
    many rows before them were left out: a row whose prompt + output exceeds the server's ``max_model_len`` would be
    rejected there (the one request rule, ``workbench.request.validate_request``), so it is not sent, and never
    clipped (vLLM's ShareGPT sampling leaves such conversations out too)."""
    from workbench.request import fits_context
    from workbench.workloads import iter_workload, prompt_token_ids

    reqs, left_out = [], 0
    for r in iter_workload(name, num_requests=num, seed=seed):
        if max_model_len is not None and not fits_context(r.prompt_len, r.output_len, max_model_len):
            left_out += 1
            continue
        reqs.append(r)
        if len(reqs) == num:
            break
    if len(reqs) < num:
        within = f" within the server's max_model_len {max_model_len} ({left_out} longer left out)" if left_out else ""
        raise ConfigError(f"trace {name}: {len(reqs)} requests{within}, --num-prompts is {num}")
    return [BenchRequest(prompt_token_ids(r, vocab_size, seed), r.prompt_len, r.output_len) for r in reqs], left_out


# ---- one request -----------------------------------------------------------------------------------------
async def send_request(session: Any, url: str, model: str, req: BenchRequest, chat: bool, ignore_eos: bool,
                       extra: dict[str, Any] | None = None) -> RequestOutput:  # fmt: skip
    """POST one streaming request and time its chunks."""
    import aiohttp

    payload: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
    payload |= extra or {}
    out = RequestOutput(prompt_len=req.prompt_len)
    start = last = now()
    out.start_time = start
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for chunk in sse_chunks(resp):
                if chunk is None:
                    break
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    return out
                if chunk.get("choices"):
                    c = chunk["choices"][0]
                    delta = c.get("delta") or {}
                    if chat and "role" in delta and not delta.get("content") and c.get("finish_reason") is None:
                        continue  # the role-only first chat chunk carries no token
                    t = now()
                    if out.ttft == 0.0:
                        out.ttft = t - start
                    else:
                        out.itl.append(t - last)
                    last = t
                    out.generated_text += (delta.get("content") if chat else c.get("text")) or ""
                if chunk.get("usage"):
                    out.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
        out.latency = last - start
        out.success = out.ttft > 0.0
        if not out.success:
            out.error = "no token received"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def sse_chunks(resp: Any) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON chunks of an OpenAI-style server-sent event stream (``aiohttp`` response), in order; ``None`` for
    ``data: [DONE]``, after which the stream ends. Lines that are not ``data:`` lines are skipped."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


# ---- the run ---------------------------------------------------------------------------------------------
def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive sends: 0 for an infinite rate, else gamma(shape=burstiness, mean=1/rate)."""
    if request_rate <= 0 or burstiness <= 0:
        raise ConfigError(f"--request-rate and --burstiness must be > 0, got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num).tolist()


async def run_benchmark(base_url: str, endpoint: str, model: str, requests: list[BenchRequest], request_rate: float,
                        burstiness: float, max_concurrency: int | None, seed: int, ignore_eos: bool,
                        timeout_s: float = 600.0) -> tuple[list[RequestOutput], float]:  # fmt: skip
    """Send every request on its schedule; returns the outputs (in request order) and the run's duration (s).
    With ``OPENAI_API_KEY`` in the environment, every request carries it as ``Authorization: Bearer``."""
    import aiohttp

    chat = "chat" in endpoint
    gaps = arrival_gaps(len(requests), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    conn = aiohttp.TCPConnector(limit=0)
    key = os.environ.get("OPENAI_API_KEY")  # as vLLM's client: the server's --api-key
    headers = {"Authorization": f"Bearer {key}"} if key else None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, headers=headers) as session:

        async def one(req: BenchRequest) -> RequestOutput:
            if limit is None:
                return await send_request(session, base_url + endpoint, model, req, chat, ignore_eos)
            async with limit:
                return await send_request(session, base_url + endpoint, model, req, chat, ignore_eos)

        start = now()
        tasks = []
        for req, gap in zip(requests, gaps):
            tasks.append(asyncio.create_task(one(req)))
            if gap > 0:
                await asyncio.sleep(gap)
        outputs = await asyncio.gather(*tasks)
        return list(outputs), now() - start


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS:
            raise ConfigError(f"--goodput {item!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ConfigError(f"--goodput {item!r}: expected NAME:MILLISECONDS") from None
        if slos[name] < 0:
            raise ConfigError(f"--goodput {item!r}: the SLO must be >= 0 ms")
    return slos


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def compute_result(outputs: list[RequestOutput], duration: float, selected: list[str], percentiles: list[float],
                   goodput: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """The metrics of ``vllm bench serve``'s result JSON (same keys, same units: seconds for the per-request lists
    and ``duration``, milliseconds for the statistics)."""
    done = [o for o in outputs if o.success]
    out_lens = [o.output_tokens for o in done]
    ttfts = [o.ttft for o in done]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    itls = [g for o in done for g in o.itl]
    e2els = [o.latency for o in done]
    good = 0
    for o in done:
        tpot = (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0
        values = {"ttft": o.ttft, "tpot": tpot, "e2el": o.latency}
        good += all(values[k] * 1e3 <= slo for k, slo in goodput.items())
    total_in, total_out = sum(o.prompt_len for o in done), sum(out_lens)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    result |= _peaks(done, duration)
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in selected:
        values = np.asarray(series[name] or [0.0]) * 1e3
        result[f"mean_{name}_ms"] = float(values.mean())
        result[f"median_{name}_ms"] = float(np.median(values))
        result[f"std_{name}_ms"] = float(values.std())
        for p in percentiles:
            result[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return result


def _peaks(done: list[RequestOutput], duration: float) -> dict[str, float]:
    """Peak output tokens per second (1 s bins of token arrival times) and peak requests in flight."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(o.start_time for o in done)
    bins = np.zeros(int(math.ceil(duration)) + 1)
    events: list[tuple[float, int]] = []
    for o in done:
        t = o.start_time + o.ttft
        times = [t] + [t := t + g for g in o.itl]
        for x in times:
            bins[int(x - t0)] += 1
        events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    running = peak = 0
    for _, d in sorted(events):
        running += d
        peak = max(peak, running)
    return {"max_output_tokens_per_s": float(bins.max()), "max_concurrent_requests": peak}


def print_result(result: dict[str, Any], selected: list[str], percentiles: list[float], max_errors: int = 3) -> None:
    """The summary table, in vLLM's layout; below it, when requests failed, the first ``max_errors`` distinct
    errors and how many requests each failed."""
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Benchmark duration (s):", result["duration"]), ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", result["request_throughput"]),
            ("Output token throughput (tok/s):", result["output_throughput"]),
            ("Total Token throughput (tok/s):", result["total_token_throughput"])]  # fmt: skip
    if result["request_goodput"] is not None:
        rows.insert(6, ("Request goodput (req/s):", result["request_goodput"]))
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    for label, value in rows:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
    for m in selected:
        print("{s:{c}^{n}}".format(s=names[m], n=50, c="-"))
        for stat in ("mean", "median"):
            print(f"{stat.capitalize() + ' ' + names[m] + ' (ms):':<40} {result[f'{stat}_{m}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{'P' + _p_word(p) + ' ' + names[m] + ' (ms):':<40} {result[f'p{_p_word(p)}_{m}_ms']:<10.2f}")
    print("=" * 50)
    for error, count in first_errors(result["errors"], max_errors):
        print(f"failed ({count} request{'s' if count > 1 else ''}): {error}")


def first_errors(errors: list[str], num: int) -> list[tuple[str, int]]:
    """The first ``num`` distinct non-empty errors, in the order they first occur, with how often each occurred."""
    counts: dict[str, int] = {}
    for e in errors:
        if e:
            counts[e] = counts.get(e, 0) + 1
    return list(counts.items())[:num]


async def server_max_model_len(base_url: str, model: str) -> int | None:
    """``max_model_len`` of ``model`` from ``GET /v1/models`` (vLLM and this server report it), or None."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(base_url + "/v1/models") as resp:
                cards = (await resp.json()).get("data", [])
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot reach {base_url}/v1/models: {exc}") from None
    for card in cards:
        if card.get("id") == model:
            return card.get("max_model_len")
    return None


def result_filename(backend: str, request_rate: float, max_concurrency: int | None, model: str, date: str) -> str:
    """vLLM's default file name: ``{backend}-{rate}qps[-concurrency{C}]-{model}-{date}.json``."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{backend}-{request_rate}qps{conc}-{Path(model).name}-{date}.json"


def header(args: Any) -> dict[str, Any]:
    """The run's description keys of vLLM's result JSON."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": args.model,
        "tokenizer_id": args.tokenizer or args.model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
