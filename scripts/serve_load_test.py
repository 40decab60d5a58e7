"""Loopback load test of ``workbench serve``, and ``bench serve``'s percentiles against the server's own histograms.

    PYTHONPATH=. .venv/bin/python scripts/serve_load_test.py [--clients 64] [--disconnect-share 0.1]
        [--max-tokens 32] [--bench-prompts 64] [--out result.json]

1. Load: one server (a tiny-gqa checkpoint with its tokenizer, written to a temporary directory), ``--clients``
   streaming requests at once, each with its own token-id prompt; every tenth one (``--disconnect-share``) closes
   its connection after its third chunk. The others must return exactly the tokens the engine produces for the
   same prompt offline, one prompt at a time (``Engine.generate``, the same checkpoint and threads). The server's
   pool (160 blocks of 16 tokens) is smaller than the 64 requests need at once, so some are preempted and
   recomputed on the way. Then the server must hold no KV block and run no request, and its abort count must equal
   the disconnects.
2. Measurement: ``workbench.serve.benchmark`` (the client of ``workbench bench serve``) sends ``--bench-prompts``
   random prompts at ``--request-rate`` with ``--max-concurrency``; its TTFT and ITL percentiles are set beside the
   quantiles of the server's ``/metrics`` histograms over the same requests (difference of two scrapes).

Bounded: a fixed request count, every wait with a timeout, the server always stopped. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request

import aiohttp

from workbench.serve.benchmark import BenchRequest, compute_result, random_requests, run_benchmark
from workbench.serve.launch import ServerProcess
from workbench.serve.prom import bucket_delta, histogram_buckets, histogram_quantile

ENGINE_ARGS = ["--block-size", "16", "--num-blocks", "160", "--max-num-seqs", "64", "--threads", "1"]


def scrape(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def sample(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                     disconnect_after: int | None) -> dict:  # fmt: skip
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    tokens: list[int] = []
    chunks = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {await resp.text()}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            tokens += choice.get("token_ids") or []
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                resp.close()  # drop the connection mid-stream
                return {"disconnected": True, "tokens": tokens}
    return {"disconnected": False, "tokens": tokens}


async def load(base_url: str, prompts: list[list[int]], max_tokens: int, every: int) -> tuple[list[dict], float]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[
            stream_one(session, base_url + "/v1/completions", p, max_tokens, 3 if every and i % every == every - 1
                       else None)
            for i, p in enumerate(prompts)
        ])  # fmt: skip
        return list(outs), time.perf_counter() - t0


def reference_tokens(ckpt: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    from workbench.engine.config import EngineConfig
    from workbench.engine.engine import Engine
    from workbench.request import SamplingParams

    torch.set_num_threads(1)
    engine = Engine.from_model(ckpt, EngineConfig(block_size=16, num_blocks=1024, max_num_seqs=64))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [engine.generate([p], sp).requests[0].tokens for p in prompts]


def wait_idle(base_url: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(base_url)
        idle = sample(text, "workbench:kv_blocks_used") == 0 and sample(text, "workbench:num_requests_running") == 0
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--bench-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=32.0)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()

    from workbench.model.checkpoint import save_random_checkpoint

    tmp = tempfile.mkdtemp(prefix="serve-load-")
    ckpt = str(save_random_checkpoint("tiny-gqa", os.path.join(tmp, "tiny-gqa"), seed=0))
    every = round(1 / args.disconnect_share) if args.disconnect_share > 0 else 0
    prompts = [r.prompt for r in random_requests(args.clients, args.prompt_len, 1, 0.5, 256, seed=1)]
    report: dict = {"loadavg_before": open("/proc/loadavg").read().split()[:3]}
    with ServerProcess(["--model", ckpt, "--served-model-name", "tiny", *ENGINE_ARGS]) as server:
        outs, wall = asyncio.run(load(server.base_url, prompts, args.max_tokens, every))
        after_load = wait_idle(server.base_url)
        ref = reference_tokens(ckpt, prompts, args.max_tokens)
        completed = [(o, r) for o, r in zip(outs, ref) if not o.get("disconnected") and "error" not in o]
        disconnected = sum(bool(o.get("disconnected")) for o in outs)
        report["load"] = {
            "clients": args.clients,
            "disconnected": disconnected,
            "completed": len(completed),
            "errors": [o["error"] for o in outs if "error" in o],
            "completed_with_reference_tokens": sum(o["tokens"] == r for o, r in completed),
            "wall_s": wall,
            "output_tokens_per_s": sum(len(o["tokens"]) for o, _ in completed) / wall,
            "server_aborts": sample(after_load, "workbench:request_success_total", 'finished_reason="abort"'),
            "kv_blocks_used_after": sample(after_load, "workbench:kv_blocks_used"),
            "num_requests_running_after": sample(after_load, "workbench:num_requests_running"),
            "preemptions": sample(after_load, "workbench:num_preemptions_total"),
        }

        before = scrape(server.base_url)
        reqs: list[BenchRequest] = random_requests(args.bench_prompts, 32, args.max_tokens, 0.5, 256, seed=2)
        outputs, duration = asyncio.run(run_benchmark(
            server.base_url, "/v1/completions", "tiny", reqs, args.request_rate, 1.0, args.max_concurrency, 0, True
        ))  # fmt: skip
        after = wait_idle(server.base_url)
        result = compute_result(outputs, duration, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99], {})
        compare = {}
        for metric, name in (("ttft", "workbench:time_to_first_token_seconds"),
                             ("itl", "workbench:inter_token_latency_seconds")):  # fmt: skip
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
    report["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    load_ok = (report["load"]["completed_with_reference_tokens"] == report["load"]["completed"]
               and report["load"]["kv_blocks_used_after"] == 0 and not report["load"]["errors"]
               and report["load"]["server_aborts"] == report["load"]["disconnected"])  # fmt: skip
    return 0 if load_ok else 1


if __name__ == "__main__":
    sys.exit(main())
