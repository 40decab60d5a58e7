"""Measure one ``workbench serve`` with two clients, interleaved: ours (``workbench bench serve``) and guidellm.

    .venv/bin/python -m workbench.experiments.serve_clients --guidellm /tmp/guidellm-venv/bin/guidellm \\
        [--rounds 2] [--num-prompts 64] [--concurrency 16] [--input-len 32] [--output-len 32] [--out FILE]

A cross-check of our client, not a benchmark of the engine. guidellm is not a dependency of the workbench: install
it in a virtual environment of its own (``python3 -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install
guidellm``). Both clients send the same shape of work (``--num-prompts`` requests, ``--concurrency`` in flight,
prompts of ``--input-len`` tokens, exactly ``--output-len`` output tokens) to one server (a tiny-gqa checkpoint
with its tokenizer, written to a temporary directory; guidellm reads that tokenizer to make its synthetic prompts),
in the order ours, guidellm, ours, guidellm, ...; around each run the server's ``/metrics`` is scraped, so every
client figure sits beside the server's own histogram quantiles over exactly the same requests
(``workbench.serve.prom.server_quantiles``). Definitions differ: our ITL is every gap between chunks (vLLM's);
guidellm's ITL is each request's mean gap, (last - first token) / (tokens - 1), weighted by its gaps, which is what
vLLM calls TPOT. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from workbench.experiments.hygiene import load_average
from workbench.parsing import make_parser
from workbench.serve.prom import scrape, server_quantiles

PERCENTILES = (50, 90, 99)


def ours(base_url: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Our client's figures (``workbench.serve.benchmark``) for one round."""
    from workbench.serve.benchmark import compute_result, random_requests, run_benchmark

    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, 256, seed)
    outputs, duration = asyncio.run(
        run_benchmark(base_url, "/v1/completions", "tiny", reqs, float("inf"), 1.0, args.concurrency, seed, True)
    )
    r = compute_result(outputs, duration, ["ttft", "tpot", "itl"], list(PERCENTILES), {})
    keys = [f"p{p}_{m}_ms" for m in ("ttft", "itl", "tpot") for p in PERCENTILES]
    return {"completed": r["completed"], "output_throughput": r["output_throughput"]} | {k: r[k] for k in keys}


def guidellm(exe: str, base_url: str, tokenizer_dir: str, args: argparse.Namespace, out_path: str) -> dict[str, Any]:
    """guidellm's figures for one round (its JSON output read back)."""
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={base_url},model=tiny,request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={args.concurrency}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
           "--constraint", f"kind=max_requests,count={args.num_prompts}",
           "--output", f"kind=json,path={out_path}", "--disable-console"]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)
    with open(out_path) as fh:
        m = json.load(fh)["benchmarks"][0]["metrics"]
    out = {"completed": m["time_to_first_token_ms"]["successful"]["count"],
           "output_throughput": m["output_tokens_per_second"]["successful"]["mean"]}  # fmt: skip
    for key, name in (("ttft", "time_to_first_token_ms"), ("itl_per_request_mean", "inter_token_latency_ms")):
        pct = m[name]["successful"]["percentiles"]
        out |= {f"p{p}_{key}_ms": pct[f"p{p}"] for p in PERCENTILES}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(description=__doc__.split("\n")[0])
    ap.add_argument("--guidellm", required=True, help="path of the guidellm executable (its own venv)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both clients")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens")
    ap.add_argument("--out", default=None, help="also write the JSON here (default: none)")
    args = ap.parse_args(argv)

    from workbench.model.checkpoint import save_random_checkpoint
    from workbench.serve.launch import ServerProcess

    runs = []
    with tempfile.TemporaryDirectory(prefix="serve-clients-") as tmp:
        ckpt = str(save_random_checkpoint("tiny-gqa", os.path.join(tmp, "tiny-gqa"), seed=0))
        engine = ["--block-size", "16", "--num-blocks", "1024", "--max-num-seqs", "64", "--threads", "1"]
        with ServerProcess(["--model", ckpt, "--served-model-name", "tiny", *engine]) as server:
            for i in range(args.rounds):
                for client in ("workbench bench serve", "guidellm"):
                    load = load_average()
                    before = scrape(server.base_url)
                    if client == "guidellm":
                        got = guidellm(args.guidellm, server.base_url, ckpt, args, os.path.join(tmp, f"g{i}.json"))
                    else:
                        got = ours(server.base_url, args, seed=i)
                    runs.append({"client": client, "round": i, "load_average": load, "client_figures": got,
                                 "server_histograms": server_quantiles(before, scrape(server.base_url),
                                                                       PERCENTILES)})  # fmt: skip
            exit_code = server.terminate(timeout_s=30)
    text = json.dumps({"runs": runs, "server_exit_code": exit_code}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
