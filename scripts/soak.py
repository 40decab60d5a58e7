"""Soak: many requests of random lengths through the engine under KV pressure, with aborts, against a reference.

    .venv/bin/python scripts/soak.py [--requests 10000] [--pool-fraction 0.3] [--abort-fraction 0.1] [--seed 0]
        [--model tiny-gqa] [--max-num-seqs 16] [--max-model-len 128] [--block-size 16] [--threads 1] [--json]

A benchmark, not a test. One workload (seeded): prompt and output lengths uniform in [1, max_model_len / 2], a
Poisson number of new requests joining before every engine step (so requests arrive while others run), and a
random tenth of them marked to be aborted once they have a random number of their output tokens (while waiting,
admitted, mid-decode, or queued again after a preemption).

1. Reference: the workload, without aborts, on an engine whose pool holds every request at once (no preemption).
   Its peak of blocks in use is the workload's need.
2. Soak: the same workload with the aborts on a pool of ``pool_fraction`` x that need (at least one longest
   request). After every abort the block manager's invariants are checked against the block tables of every live
   request (reference counts, free lists, no block twice); at the end every block must be free again.

Prints served, aborted, rejected, preemptions, blocks leaked, how many unaborted requests' greedy tokens equal the
reference's (all must), and the resident set size (VmRSS) after the first tenth of the requests and at the end,
with the process peak (VmHWM). The engine forgets a request once it has returned its final output (``step``,
``abort``), so memory stays bounded; the soak reads the live requests' state (``engine.sequences``) only to say
when each abort came. ``--json`` prints one object instead of lines.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams


def rss_kib(field: str = "VmRSS") -> int:
    """A memory figure of this process from /proc/self/status, in KiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def make_workload(args: argparse.Namespace) -> tuple[list[tuple[list[int], int]], list[int], dict[int, int]]:
    """Requests (prompt ids, output length), how many join before each step, and abort delays (request -> steps)."""
    rng = random.Random(args.seed)
    half = args.max_model_len // 2
    vocab = ModelConfig.from_name(args.model).vocab_size
    requests = []
    for _ in range(args.requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, half))]
        requests.append((prompt, rng.randint(1, half)))
    joins, left = [], args.requests
    while left > 0:
        # Poisson arrivals (Knuth's method) at a mean that keeps about max_num_seqs requests in flight
        k, p, limit = 0, rng.random(), pow(2.718281828459045, -args.arrival_rate)
        while p > limit:
            k += 1
            p *= rng.random()
        k = min(k, left)
        joins.append(k)
        left -= k
    aborted = rng.sample(range(args.requests), int(round(args.abort_fraction * args.requests)))
    # an abort comes once the request has k output tokens, k uniform in [0, output length): k = 0 as soon as it
    # has arrived (queued, or admitted and prefilling), later ones mid-decode, or queued again after a preemption
    return requests, joins, {i: rng.randrange(requests[i][1]) for i in aborted}


def run(
    model: Transformer,
    config: EngineConfig,
    requests: list[tuple[list[int], int]],
    joins: list[int],
    aborts: dict[int, int],
    check: bool,
) -> dict:
    """Serve the workload; returns tokens per request index, counts and memory figures."""
    engine = Engine(model, config)
    bm = engine.block_manager
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    index_of: dict[int, int] = {}
    abort_after: dict[int, int] = {}  # request id -> abort once it has this many output tokens
    rng = random.Random(len(requests))
    step, nxt, peak_used, num_aborts = 0, 0, 0, 0
    rss_early = 0
    preemptions = 0
    abort_states: dict[str | None, int] = {}
    waiting_sum = 0

    def drain(finished) -> None:
        nonlocal preemptions
        for out in finished:
            i = index_of.pop(out.request_id)
            tokens[i], reasons[i] = out.result.tokens, out.finish_reason
            preemptions += out.result.num_preemptions

    t0 = time.perf_counter()
    while nxt < len(requests) or engine.has_unfinished():
        for _ in range(joins[step] if step < len(joins) else 0):
            prompt, out_len = requests[nxt]
            rid = engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
            index_of[rid] = nxt
            if nxt in aborts:
                abort_after[rid] = aborts[nxt]
            nxt += 1
            if nxt == len(requests) // 10:
                rss_early = rss_kib()
        due = [rid for rid, k in abort_after.items() if engine.sequences[rid].num_output_tokens >= k]
        if due and rng.random() < 0.5:
            due = due[:1]  # not all at once: some wait a step or more past their mark
        for rid in due:
            del abort_after[rid]
            seq = engine.sequences.get(rid)
            state = None
            if seq is not None and not seq.is_finished:
                state = "waiting" if seq.status.value == "waiting" else "prefill" if seq.is_prefill else "decode"
                state += ", after a preemption" if seq.num_preemptions else ""
            if seq is not None and engine.abort(rid):
                abort_states[state] = abort_states.get(state, 0) + 1
                num_aborts += 1
                preemptions += seq.num_preemptions
                i = index_of.pop(rid)
                tokens[i], reasons[i] = list(seq.output_token_ids), "abort"
                if check:
                    bm.check_invariants([s.block_table for s in engine.scheduler.running])
        finished = [out for out in engine.step() if out.finished]
        for out in finished:
            abort_after.pop(out.request_id, None)  # finished before its abort came
        drain(finished)
        peak_used = max(peak_used, bm.num_used_blocks)
        waiting_sum += engine.stats()["num_waiting"]
        step += 1
    wall = time.perf_counter() - t0
    bm.check_invariants([])
    return {
        "tokens": tokens,
        "reasons": reasons,
        "mean_waiting": waiting_sum / max(step, 1),
        "num_aborts": num_aborts,
        "abort_states": abort_states,
        "num_preemptions": preemptions,
        "peak_used_blocks": peak_used,
        "leaked_blocks": bm.num_used_blocks,
        "num_blocks": bm.num_blocks,
        "num_steps": step,
        "wall_s": wall,
        "rss_early_kib": rss_early,
        "rss_end_kib": rss_kib(),
        "step_log_entries": len(engine.step_log),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--pool-fraction", type=float, default=0.3, help="soak pool / the reference's peak of blocks used")
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--arrival-rate", type=float, default=0.15, help="mean requests joining before each step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny-gqa", help="preset (random weights)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", default="continuous")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = Transformer.from_config(ModelConfig.from_name(args.model), seed=args.seed)
    requests, joins, aborts = make_workload(args)
    rss_start = rss_kib()
    longest = -(-args.max_model_len // args.block_size)
    big = EngineConfig(policy=args.policy, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, num_blocks=args.max_num_seqs * longest)  # fmt: skip
    ref = run(model, big, requests, joins, {}, check=False)
    need = ref["peak_used_blocks"]
    num_blocks = max(longest, round(args.pool_fraction * need))
    small = EngineConfig(policy=args.policy, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         max_model_len=args.max_model_len, num_blocks=num_blocks)  # fmt: skip
    soak = run(model, small, requests, joins, aborts, check=True)
    unaborted = [i for i, r in soak["reasons"].items() if r != "abort"]
    matching = sum(soak["tokens"][i] == ref["tokens"][i] for i in unaborted)
    out = {
        "requests": args.requests,
        "served": sum(r == "length" for r in soak["reasons"].values()),
        "aborted": soak["num_aborts"],
        "marked_for_abort": len(aborts),
        "aborted_while": soak["abort_states"],
        "rejected": sum(r == "rejected" for r in soak["reasons"].values()),
        "preemptions": soak["num_preemptions"],
        "reference_preemptions": ref["num_preemptions"],
        "blocks_leaked": soak["leaked_blocks"],
        "unaborted_tokens_match": f"{matching}/{len(unaborted)}",
        "need_blocks": need,
        "pool_blocks": num_blocks,
        "pool_share_of_need": num_blocks / need if need else None,
        "soak_steps": soak["num_steps"],
        "mean_waiting": round(soak["mean_waiting"], 1),
        "soak_wall_s": round(soak["wall_s"], 1),
        "reference_wall_s": round(ref["wall_s"], 1),
        "rss_mib": {
            "start": round(rss_start / 1024, 1),
            "after_first_tenth": round(soak["rss_early_kib"] / 1024, 1),
            "end": round(soak["rss_end_kib"] / 1024, 1),
            "peak": round(rss_kib("VmHWM") / 1024, 1),
        },
        "step_log_entries": soak["step_log_entries"],
        "loadavg": open("/proc/loadavg").read().split()[:3] if sys.platform.startswith("linux") else None,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:24s} {value}")
    ok = out["blocks_leaked"] == 0 and matching == len(unaborted)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
