"""Predicted (roofline with this machine's measured ceilings) versus measured step times of ``bench-300m``.

Measures the CPU's ceilings (``workbench.hardware.measured_spec``: fp32 matmul peak, read bandwidth), then
times prefill and decode steps of the ``bench-300m`` preset in fp32 with random weights, and prints one JSON
object: per case the predicted time, the measured median, their ratio (measured / predicted), and the MFU
and MBU of the measured step (bytes include KV and activations). The ratio is a reported number, never an
assertion: it says how far this machine's kernels are from its own ceilings.

    .venv/bin/python scripts/bench_roofline_cpu.py [--repeats 5] [--cached] [--out result.json]

On a machine shared with other work both the ceilings and the steps slow down, not necessarily alike; the
ceilings are therefore measured in the same run as the steps unless ``--cached`` is given.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from workbench.config import ModelConfig
from workbench.hardware import measured_spec
from workbench.model import Transformer
from workbench.parsing import make_parser
from workbench.roofline import RooflineModel, StepCost

PRESET = "bench-300m"
# (batch, prompt_len) for prefill; (batch, context_len) for decode
PREFILL_CASES = [(1, 128), (4, 64)]
DECODE_CASES = [(1, 128), (8, 128)]


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()  # (batch, length)


def time_prefill(model: Transformer, batch: int, prompt_len: int, repeats: int) -> list[float]:
    """Wall times of whole-prompt prefills into fresh slots (one warm-up first)."""
    cache = model.new_cache(max_batch=batch, max_len=prompt_len + 1)
    prompts = random_prompts(batch, prompt_len, model.config.vocab_size, seed=1)
    slots = list(range(batch))
    times = []
    for i in range(repeats + 1):
        cache.lengths[:] = [0] * len(cache.lengths)  # fresh slots: nothing cached
        t0 = time.perf_counter()
        model.prefill(prompts, cache, slots)
        elapsed = time.perf_counter() - t0
        if i > 0:
            times.append(elapsed)
    return times


def time_decode(model: Transformer, batch: int, context_len: int, repeats: int) -> tuple[list[float], list[int]]:
    """Wall times of consecutive decode steps; the first step attends to ``context_len`` keys.
    Returns the times and the context length of each timed step."""
    warmup = 2
    cache = model.new_cache(max_batch=batch, max_len=context_len + warmup + repeats + 1)
    prompts = random_prompts(batch, context_len - 1, model.config.vocab_size, seed=2)
    slots = list(range(batch))
    model.prefill(prompts, cache, slots)
    tokens = [1] * batch
    times, contexts = [], []
    for i in range(warmup + repeats):
        ctx = context_len + i
        t0 = time.perf_counter()
        logits = model.decode(tokens, cache, slots)  # (batch, vocab)
        elapsed = time.perf_counter() - t0
        tokens = logits.argmax(dim=-1).tolist()
        if i >= warmup:
            times.append(elapsed)
            contexts.append(ctx)
    return times, contexts


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per case (median reported)")
    parser.add_argument(
        "--cached", action="store_true", help="reuse cached ceilings instead of measuring them in this run"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    hw = measured_spec("cpu", refresh=not args.cached)  # ceilings and steps measured in the same run
    cfg = ModelConfig.from_name(PRESET)
    model = Transformer.from_config(cfg, dtype=torch.float32, device="cpu", seed=0)
    roof = RooflineModel(cfg, hw, dtype="fp32")
    result: dict = {
        "preset": PRESET,
        "dtype": "fp32",
        "torch_threads": torch.get_num_threads(),
        "hardware": hw.to_dict(),
        "cases": [],
    }
    for batch, prompt_len in PREFILL_CASES:
        times = time_prefill(model, batch, prompt_len, args.repeats)
        cost = roof.prefill([prompt_len] * batch, detailed=False)
        result["cases"].append(_case("prefill", batch, prompt_len, cost, times, roof))
    for batch, context_len in DECODE_CASES:
        times, contexts = time_decode(model, batch, context_len, args.repeats)
        median_ctx = int(statistics.median(contexts))
        cost = roof.decode([median_ctx] * batch, detailed=False)
        result["cases"].append(_case("decode", batch, median_ctx, cost, times, roof))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


def _case(phase: str, batch: int, length: int, cost: StepCost, times: list[float], roof: RooflineModel) -> dict:
    measured = statistics.median(times)
    util = roof.utilization(cost, measured)
    return {
        "phase": phase,
        "batch": batch,
        "prompt_len" if phase == "prefill" else "context_len": length,
        "predicted_s": cost.time_s,
        "measured_median_s": measured,
        "measured_s": times,
        "ratio_measured_over_predicted": measured / cost.time_s,
        "predicted_bound": cost.bound,
        "flops": cost.flops,
        "bytes": cost.bytes,
        "intensity": cost.intensity,
        "mfu": util.mfu,
        "mbu": util.mbu,
        "achieved_gflops": util.achieved_flops_per_s / 1e9,
        "achieved_gbs": util.achieved_bytes_per_s / 1e9,
    }


if __name__ == "__main__":
    sys.exit(main())
