"""vLLM's half of ``workbench bench vllm``: one vLLM engine kept alive and timed on the workbench's requests, one
trial per command, so that its trials can alternate in time with the workbench's (``workbench.experiments.vs_vllm``
starts it and sends the commands). Run by path with vLLM's own interpreter.

This file runs in vLLM's virtual environment, never in the project's: it imports the standard library, vLLM, and
``workbench.timing`` (the one timer, itself standard library only) from this checkout, whose root it appends to
``sys.path`` after vLLM is imported (so nothing of the project's shadows vLLM's packages). It reads a JSON job
written by ``workbench.experiments.vs_vllm``::

    {"checkpoint": DIR, "max_model_len": N, "max_num_seqs": S, "block_size": B, "enable_prefix_caching": false,
     "token_budget": null, "offline": [[prompt ids, output length], ...], "decode_prompt": [ids],
     "decode_new_tokens": N}

builds the engine, warms it up as ``workbench.bench.bench_offline`` does (the first 4 requests of the offline set,
then the batch-1 prompt for 2 tokens), and writes one JSON line ``{"ready": true, "version": ..., "startup_s": ...}``.
Then it reads commands, one per line on stdin, and answers each with one JSON line:

- ``offline``: the whole offline set given at once: ``{"time_s": wall seconds, "tokens": [[ids], ...]}``;
- ``decode``: the batch-1 decode rate ``(N - 1) / (t(N new tokens) - t(1 new token))`` (``workbench.bench.
  decode_rate``'s formula): ``{"tokens_per_s": rate, "tokens": [N ids]}``;
- ``quit`` or the end of stdin: it exits.

The answers go to the stdout it was started with; everything else that writes to stdout (vLLM's logging) is sent to
stderr, so the protocol carries only answers. An unknown command is answered ``{"error": ...}``.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 VENV/bin/python vllm_worker.py JOB.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(job_path: str) -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol: the stdout this process was started with
    os.dup2(2, 1)  # everything else printed (vLLM's logging) goes to stderr
    sys.stdout = sys.stderr
    with open(job_path) as fh:
        job = json.load(fh)
    from vllm import LLM, SamplingParams

    sys.path.append(str(Path(__file__).resolve().parents[2]))  # after vLLM: the checkout's workbench.timing
    from workbench.timing import now, timed

    t0 = now()
    llm = LLM(
        model=job["checkpoint"],
        skip_tokenizer_init=True,  # token ids in, token ids out: the random checkpoint has no tokenizer of vLLM's
        dtype="float32",
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        block_size=job["block_size"],
        # vLLM v1 caches prompt prefixes by default: a repeat of the offline set would then skip the prefill its
        # previous run did, which the workbench's engine (prefix caching off by default) recomputes
        enable_prefix_caching=job.get("enable_prefix_caching", False),
        seed=0,
        **({"max_num_batched_tokens": job["token_budget"]} if job.get("token_budget") else {}),
    )
    startup_s = now() - t0

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def run(prompts: list[list[int]], lens: list[int]) -> tuple[float, list[list[int]]]:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        seconds, outs = timed(lambda: llm.generate(inputs, [greedy(n) for n in lens], use_tqdm=False))
        return seconds, [list(o.outputs[0].token_ids) for o in outs]

    prompts, lens = [p for p, _ in job["offline"]], [n for _, n in job["offline"]]
    prompt, n = job["decode_prompt"], job["decode_new_tokens"]
    run(prompts[:4], lens[:4])  # warm-up, as workbench.bench.bench_offline does
    run([prompt], [2])
    import vllm

    answers.write(json.dumps({"ready": True, "version": vllm.__version__, "startup_s": startup_s}) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "offline":
            seconds, tokens = run(prompts, lens)
            answer = {"time_s": seconds, "tokens": tokens}
        elif command == "decode":
            t1, _ = run([prompt], [1])
            tn, tokens = run([prompt], [n])
            answer = {"tokens_per_s": (n - 1) / max(tn - t1, 1e-9), "tokens": tokens[0]}
        else:
            answer = {"error": f"unknown command {command!r} (offline, decode, quit)"}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: vllm_worker.py JOB.json  (then commands on stdin: offline, decode, quit)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
