"""Loopback load test of ``workbench serve``, and ``bench serve``'s percentiles against the server's own histograms
(``workbench bench serve-load``).

1. Load: one server (a tiny-gqa checkpoint with its tokenizer, written to a temporary directory), ``clients``
   streaming requests at once, each with its own token-id prompt; every ``1 / disconnect_share``-th one closes its
   connection after its third chunk. The others must return exactly the tokens the engine produces for the same
   prompt offline, one prompt at a time (``Engine.generate``, the same checkpoint and threads). The server's pool
   (``num_blocks`` blocks of 16 tokens; 160 by default) is smaller than 64 requests need at once, so some are
   preempted and recomputed on the way. Then the server must hold no KV block and run no request, and its abort
   count must equal the disconnects (``load_ok``).
2. Measurement: ``workbench.serve.benchmark`` (the client of ``workbench bench serve``) sends ``bench_prompts``
   random prompts at ``request_rate`` with ``max_concurrency``; its TTFT and ITL percentiles are set beside the
   quantiles of the server's ``/metrics`` histograms over the same requests (difference of two scrapes).

Bounded: a fixed request count, every wait with a timeout, the server always stopped.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

from workbench.experiments.hygiene import load_average
from workbench.serve.benchmark import sse_chunks
from workbench.serve.prom import (
    LATENCY_HISTOGRAMS,
    bucket_delta,
    histogram_buckets,
    histogram_quantile,
    metric_total,
    scrape,
)
from workbench.timing import now

BLOCK_SIZE = 16


async def stream_one(session: Any, url: str, prompt: list[int], max_tokens: int, disconnect_after: int | None) -> dict:
    """One streaming completion of ``prompt`` (greedy, exactly ``max_tokens``): its token ids, or the error, or
    ``disconnected`` after ``disconnect_after`` chunks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    tokens: list[int] = []
    chunks = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {await resp.text()}"}
        async for chunk in sse_chunks(resp):
            if chunk is None:
                break
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                resp.close()  # drop the connection mid-stream
                return {"disconnected": True, "tokens": tokens}
    return {"disconnected": False, "tokens": tokens}


async def load(base_url: str, prompts: list[list[int]], max_tokens: int, every: int) -> tuple[list[dict], float]:
    """Every prompt streamed at once (every ``every``-th client disconnects after 3 chunks): (results, wall s)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = now()
        outs = await asyncio.gather(*[
            stream_one(session, base_url + "/v1/completions", p, max_tokens,
                       3 if every and i % every == every - 1 else None)
            for i, p in enumerate(prompts)
        ])  # fmt: skip
        return list(outs), now() - t0


def reference_tokens(ckpt: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens for each prompt alone (one thread, a pool that never preempts)."""
    from workbench.engine.config import EngineConfig
    from workbench.engine.engine import Engine
    from workbench.request import SamplingParams
    from workbench.timing import set_threads

    set_threads(1)
    engine = Engine.from_model(ckpt, EngineConfig(block_size=BLOCK_SIZE, num_blocks=1024, max_num_seqs=64))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [engine.generate([p], sp).requests[0].tokens for p in prompts]


def wait_idle(base_url: str, timeout_s: float = 30.0) -> str:
    """The server's metrics once it holds no KV block and runs no request (or after ``timeout_s``)."""
    deadline = now() + timeout_s
    while True:
        text = scrape(base_url)
        idle = metric_total(text, "workbench:kv_blocks_used") == 0
        if (idle and metric_total(text, "workbench:num_requests_running") == 0) or now() > deadline:
            return text
        time.sleep(0.05)


def serve_load(
    clients: int = 64, disconnect_share: float = 0.1, max_tokens: int = 32, prompt_len: int = 24,
    bench_prompts: int = 64, request_rate: float = 32.0, max_concurrency: int = 16, num_blocks: int = 160,
) -> dict[str, Any]:  # fmt: skip
    """The load test and the measurement (module docstring): ``load`` (counts, reference-token matches, what the
    server holds after), ``load_ok``, ``bench_serve`` and ``client_vs_server_metrics``."""
    from workbench.model.checkpoint import save_random_checkpoint
    from workbench.serve.benchmark import compute_result, random_requests, run_benchmark
    from workbench.serve.launch import ServerProcess

    tmp = tempfile.TemporaryDirectory(prefix="serve-load-")
    ckpt = str(save_random_checkpoint("tiny-gqa", os.path.join(tmp.name, "tiny-gqa"), seed=0))
    every = round(1 / disconnect_share) if disconnect_share > 0 else 0
    prompts = [r.prompt for r in random_requests(clients, prompt_len, 1, 0.5, 256, seed=1)]
    report: dict[str, Any] = {"load_average_before": load_average()}
    engine_args = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks), "--max-num-seqs", "64",
                   "--threads", "1"]  # fmt: skip
    with ServerProcess(["--model", ckpt, "--served-model-name", "tiny", *engine_args]) as server:
        outs, wall = asyncio.run(load(server.base_url, prompts, max_tokens, every))
        after_load = wait_idle(server.base_url)
        ref = reference_tokens(ckpt, prompts, max_tokens)
        completed = [(o, r) for o, r in zip(outs, ref) if not o.get("disconnected") and "error" not in o]
        report["load"] = {
            "clients": clients,
            "disconnected": sum(bool(o.get("disconnected")) for o in outs),
            "completed": len(completed),
            "errors": [o["error"] for o in outs if "error" in o],
            "completed_with_reference_tokens": sum(o["tokens"] == r for o, r in completed),
            "wall_s": wall,
            "output_tokens_per_s": sum(len(o["tokens"]) for o, _ in completed) / wall,
            "server_aborts": metric_total(after_load, "workbench:request_success_total", 'finished_reason="abort"'),
            "kv_blocks_used_after": metric_total(after_load, "workbench:kv_blocks_used"),
            "num_requests_running_after": metric_total(after_load, "workbench:num_requests_running"),
            "preemptions": metric_total(after_load, "workbench:num_preemptions_total"),
        }
        before = scrape(server.base_url)
        reqs = random_requests(bench_prompts, 32, max_tokens, 0.5, 256, seed=2)
        outputs, duration = asyncio.run(run_benchmark(
            server.base_url, "/v1/completions", "tiny", reqs, request_rate, 1.0, max_concurrency, 0, True
        ))  # fmt: skip
        after = wait_idle(server.base_url)
        result = compute_result(outputs, duration, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99], {})
        compare: dict[str, Any] = {}
        for metric, name in LATENCY_HISTOGRAMS.items():
            delta = bucket_delta(histogram_buckets(after, name), histogram_buckets(before, name))
            for p in (50, 90, 99):
                client_ms = result[f"p{p}_{metric}_ms"]
                server_ms = histogram_quantile(p / 100, delta) * 1e3
                ratio = client_ms / server_ms if server_ms else None
                compare[f"p{p}_{metric}_ms"] = {"client": client_ms, "server_histogram": server_ms, "ratio": ratio}
            n_client = len(result["itls"]) if metric == "ttft" else sum(len(x) for x in result["itls"])
            compare[f"{metric}_count"] = {"client": n_client, "server": delta[-1][1]}
        keys = ("completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms")
        report["bench_serve"] = {k: result[k] for k in keys}
        report["client_vs_server_metrics"] = compare
        report["server_exit_code"] = server.terminate(timeout_s=30)
    tmp.cleanup()
    report["load_average_after"] = load_average()
    got = report["load"]
    report["load_ok"] = (got["completed_with_reference_tokens"] == got["completed"] and got["kv_blocks_used_after"] == 0
                         and not got["errors"] and got["server_aborts"] == got["disconnected"])  # fmt: skip
    return report
