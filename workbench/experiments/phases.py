"""Measurements behind the experiments: prefill and decode step times of a model on this machine, and their place
on the roofline. Notebooks call these and plot; tests run them on tiny models.

A decode step at KV length L is timed by setting each slot's cached length to L - 1 and running ``decode``: the
work (weights read once, L keys and values read per sequence) does not depend on the cached values.

``decode_arm`` and ``prefill_arm`` are the same measurements as arms of paired rounds (``trials.run_rounds``);
``batching_trial``, ``prefill_trial`` and ``kv_heads_trial`` run them against each other for the claims of
notebooks 01, 02 and 03.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from workbench.errors import ConfigError
from workbench.experiments.trials import LATENCY_MARGIN, THROUGHPUT_MARGIN, Comparison, DecisionRule, Rounds
from workbench.hardware import HardwareSpec
from workbench.model.transformer import Transformer
from workbench.roofline import get_model
from workbench.timing import random_prompts, spread_row, time_stats


def time_row(fn: Callable[[], Any], device: torch.device, warmup: int = 1, repeats: int = 3) -> dict[str, float]:
    """A table row's timing of ``fn()``: ``time_s`` (median), ``time_min_s`` and ``time_max_s`` (the spread)."""
    return spread_row(time_stats(fn, device, warmup, repeats)["times_s"])


def measure_prefill(
    model: Transformer, prompt_lens: Sequence[int], batch: int = 1, warmup: int = 1, repeats: int = 3
) -> list[dict[str, Any]]:
    """Time (median, min, max) of prefilling ``batch`` prompts of each length (the TTFT of a request that waits for
    nothing)."""
    rows = []
    for n in prompt_lens:
        cache = model.new_cache(batch, n)
        prompts = random_prompts(batch, n, model.config.vocab_size)
        slots = list(range(batch))
        t = time_row(lambda: model.prefill(prompts, cache, slots), model.device, warmup, repeats)  # noqa: B023
        rows.append({"phase": "prefill", "batch": batch, "prompt_len": n, "context_len": n, **t})
    return rows


def measure_decode(
    model: Transformer, batch_sizes: Sequence[int], kv_lens: Sequence[int], warmup: int = 1, repeats: int = 3
) -> list[dict[str, Any]]:
    """Time (median, min, max) of one decode step for each (batch size, KV length): every sequence reads ``kv_len``
    positions."""
    rows = []
    for kv_len in kv_lens:
        if kv_len < 1 or kv_len > model.config.max_position_embeddings:
            raise ConfigError(f"kv_len {kv_len} outside [1, {model.config.max_position_embeddings}]")
        for b in batch_sizes:
            cache = model.new_cache(b, kv_len)
            slots = list(range(b))
            tokens = [1] * b

            def step() -> None:
                for s in slots:  # noqa: B023
                    cache.lengths[s] = kv_len - 1  # noqa: B023
                model.decode(tokens, cache, slots)  # noqa: B023

            t = time_row(step, model.device, warmup, repeats)
            rows.append({"phase": "decode", "batch": b, "prompt_len": 0, "context_len": kv_len, **t})
    return rows


def decode_arm(model: Transformer, batch: int, kv_len: int, steps: int = 3) -> Callable[[int], float]:
    """An arm of paired rounds: one trial takes ``steps`` decode steps of ``batch`` sequences at KV length
    ``kv_len`` and returns tokens/s of the median step (its cache is allocated once, here)."""
    if kv_len < 1 or kv_len > model.config.max_position_embeddings:
        raise ConfigError(f"kv_len {kv_len} outside [1, {model.config.max_position_embeddings}]")
    if batch < 1 or steps < 1:
        raise ConfigError(f"need batch >= 1 and steps >= 1, got {batch}, {steps}")
    cache = model.new_cache(batch, kv_len)
    slots, tokens = list(range(batch)), [1] * batch

    def step() -> None:
        for s in slots:
            cache.lengths[s] = kv_len - 1
        model.decode(tokens, cache, slots)

    def trial(_round: int) -> float:
        return batch / time_stats(step, model.device, 0, steps)["median_s"]

    return trial


def prefill_arm(model: Transformer, prompt_len: int, seed: int = 0, steps: int = 1) -> Callable[[int], float]:
    """An arm of paired rounds: one trial prefills a fresh random prompt of ``prompt_len`` tokens (seeded by the
    round, so both arms of a round see prompts from the same seed) ``steps`` times and returns the median time in
    seconds (several steps keep a millisecond prefill of a tiny model clear of the scheduler's time slices)."""
    if steps < 1:
        raise ConfigError(f"need steps >= 1, got {steps}")
    cache = model.new_cache(1, prompt_len)

    def trial(index: int) -> float:
        prompts = random_prompts(1, prompt_len, model.config.vocab_size, seed + 1 + index)
        return time_stats(lambda: model.prefill(prompts, cache, [0]), model.device, 0, steps)["median_s"]

    return trial


def batching_trial(
    model: Transformer, batch_small: int, batch_large: int, kv_len: int, rounds: Rounds, steps: int = 3
) -> Comparison:
    """Decode tokens/s at ``batch_large`` (B) against ``batch_small`` (A) at KV length ``kv_len``, paired rounds:
    the claim "batching raises decode throughput" by more than ``THROUGHPUT_MARGIN``."""
    arms = {f"batch {batch_small}": decode_arm(model, batch_small, kv_len, steps),
            f"batch {batch_large}": decode_arm(model, batch_large, kv_len, steps)}  # fmt: skip
    return rounds.run(arms, DecisionRule("higher", THROUGHPUT_MARGIN))


def prefill_trial(
    model: Transformer, short_len: int, long_len: int, rounds: Rounds, margin: float = LATENCY_MARGIN,
    steps: int = 1,
) -> Comparison:  # fmt: skip
    """Prefill time of a ``long_len``-token prompt (B) against a ``short_len``-token one (A), paired rounds (a
    trial: the median of ``steps`` prefills): the claim "prefill sets TTFT" (the longer prompt takes longer by more
    than ``margin``)."""
    arms = {f"{short_len} tokens": prefill_arm(model, short_len, rounds.seed, steps),
            f"{long_len} tokens": prefill_arm(model, long_len, rounds.seed, steps)}  # fmt: skip
    return rounds.run(arms, DecisionRule("higher", margin))


def kv_heads_trial(
    models: Mapping[str, Transformer], batch: int, kv_len: int, rounds: Rounds, steps: int = 3
) -> Comparison:
    """Decode tokens/s of the variant with the fewest KV heads (B) against the one with the most (A), ``batch``
    sequences at KV length ``kv_len``, paired rounds: the claim "fewer KV heads make a decode step faster" (B higher
    by more than ``THROUGHPUT_MARGIN``). ``models`` maps a label (MHA, GQA, MQA) to a model of that variant."""
    ordered = sorted(models.items(), key=lambda kv: -kv[1].config.num_kv_heads)
    if len(ordered) < 2 or ordered[0][1].config.num_kv_heads == ordered[-1][1].config.num_kv_heads:
        heads = {k: m.config.num_kv_heads for k, m in ordered}
        raise ConfigError(f"kv_heads_trial needs models with different numbers of KV heads, got {heads}")
    (most, a), (fewest, b) = ordered[0], ordered[-1]
    arms = {most: decode_arm(a, batch, kv_len, steps), fewest: decode_arm(b, batch, kv_len, steps)}
    return rounds.run(arms, DecisionRule("higher", THROUGHPUT_MARGIN))


def add_roofline(rows: list[dict[str, Any]], model: Transformer, hw: HardwareSpec, dtype: str) -> list[dict[str, Any]]:
    """Each measured row with the roofline's FLOPs, bytes, intensity, predicted time, and the achieved MFU and MBU."""
    rm = get_model(model.config, hw, dtype=dtype)
    out = []
    for r in rows:
        if r["phase"] == "prefill":
            cost = rm.prefill([r["prompt_len"]] * r["batch"], detailed=False)
        else:
            cost = rm.decode([r["context_len"]] * r["batch"], detailed=False)
        u = rm.utilization(cost, r["time_s"])
        tokens = r["batch"] * (r["prompt_len"] if r["phase"] == "prefill" else 1)
        spread = {}
        if "time_min_s" in r and "time_max_s" in r:  # the spread of the timing, carried to throughput
            spread = {"tokens_per_s_min": tokens / r["time_max_s"], "tokens_per_s_max": tokens / r["time_min_s"]}
        out.append(
            {
                **r,
                "flops": cost.flops,
                "bytes": cost.bytes,
                "read_bytes": cost.weight_bytes + cost.kv_bytes,  # what MBU counts
                "intensity": cost.intensity,
                "predicted_s": cost.time_s,
                "predicted_bound": cost.bound,
                "achieved_flops_per_s": u.achieved_flops_per_s,
                "achieved_bytes_per_s": u.achieved_bytes_per_s,
                "mfu": u.mfu,
                "mbu": u.mbu,
                "tokens_per_s": tokens / r["time_s"],
                **spread,
            }
        )
    return out


def measure_decode_paged(
    model: Transformer, batch: int, kv_lens: Sequence[int], block_size: int, warmup: int = 1, repeats: int = 3
) -> list[dict[str, Any]]:
    """Decode-step time (median, min, max) when each sequence's KV lives in scattered ``block_size``-token blocks of
    a pool."""
    from workbench.kv.cache import KVCache
    from workbench.model.attention import build_metadata

    rows = []
    for kv_len in kv_lens:
        per_seq = -(-kv_len // block_size)
        num_blocks = batch * per_seq
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(kv_len)).tolist()
        tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        cache = KVCache(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device)
        ids = torch.ones(batch, dtype=torch.long, device=model.device)

        def step() -> None:
            meta = build_metadata([1] * batch, [kv_len] * batch, tables, block_size, model.device)  # noqa: B023
            model.compute_logits(model.forward(ids, meta, cache))  # noqa: B023

        t = time_row(step, model.device, warmup, repeats)
        rows.append({"phase": "decode", "batch": batch, "prompt_len": 0, "context_len": kv_len, **t})
    return rows


TIMING_COLUMNS = {
    "time_min_s": "min (ms)",
    "time_s": "median (ms)",
    "time_max_s": "max (ms)",
    "predicted_s": "roofline (ms)",
}


def timing_table(rows: Sequence[dict[str, Any]], keys: Sequence[str] = ("phase", "batch", "prompt_len", "context_len")):
    """Measured rows as a table for reading: the identifying ``keys``, the step time's min / median / max and the
    roofline's prediction in ms, arithmetic intensity, MFU, MBU and tokens/s, each column named with its unit."""
    import pandas as pd

    df = pd.DataFrame(rows)
    out = df[[k for k in keys if k in df]].copy()
    for key, label in TIMING_COLUMNS.items():
        if key in df:
            out[label] = (df[key] * 1e3).round(2)
    extra = {"intensity": ("FLOP/byte", 2), "mfu": ("MFU", 3), "mbu": ("MBU", 3), "tokens_per_s": ("tokens/s", 1)}
    for key, (label, digits) in extra.items():
        if key in df:
            out[label] = df[key].round(digits)
    return out


# (batch, prompt_len) of the prefills and (batch, context_len) of the decodes ``roofline_cases`` times
ROOFLINE_PREFILL_CASES = ((1, 128), (4, 64))
ROOFLINE_DECODE_CASES = ((1, 128), (8, 128))


def roofline_cases(
    model: Transformer,
    hw: HardwareSpec,
    dtype: str,
    repeats: int = 5,
    prefill_cases: Sequence[tuple[int, int]] = ROOFLINE_PREFILL_CASES,
    decode_cases: Sequence[tuple[int, int]] = ROOFLINE_DECODE_CASES,
) -> list[dict[str, Any]]:
    """Predicted (the roofline at ``hw``'s ceilings) against measured step times (``workbench bench roofline``): each
    case's ``add_roofline`` row with ``ratio_measured_over_predicted``, how far this machine's kernels are from its
    own ceilings (a reported number, never an assertion)."""
    rows = []
    for batch, prompt_len in prefill_cases:
        rows += measure_prefill(model, [prompt_len], batch=batch, repeats=repeats)
    for batch, context_len in decode_cases:
        rows += measure_decode(model, [batch], [context_len], warmup=2, repeats=repeats)
    return [dict(r, ratio_measured_over_predicted=r["time_s"] / r["predicted_s"])
            for r in add_roofline(rows, model, hw, dtype)]  # fmt: skip
