"""Measurements behind the experiments: prefill and decode step times of a model on this machine, and their place
on the roofline. Notebooks call these and plot; tests run them on tiny models.

A decode step at KV length L is timed by setting each slot's cached length to L - 1 and running ``decode``: the
work (weights read once, L keys and values read per sequence) does not depend on the cached values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workbench.errors import ConfigError
from workbench.hardware import HardwareSpec
from workbench.model.transformer import Transformer
from workbench.roofline import get_model
from workbench.timing import median_time, random_prompts


def measure_prefill(
    model: Transformer, prompt_lens: Sequence[int], batch: int = 1, warmup: int = 1, repeats: int = 3
) -> list[dict[str, Any]]:
    """Median time of prefilling ``batch`` prompts of each length (the TTFT of a request that waits for nothing)."""
    rows = []
    for n in prompt_lens:
        cache = model.new_cache(batch, n)
        prompts = random_prompts(batch, n, model.config.vocab_size)
        slots = list(range(batch))
        t = median_time(lambda: model.prefill(prompts, cache, slots), model.device, warmup, repeats)  # noqa: B023
        rows.append({"phase": "prefill", "batch": batch, "prompt_len": n, "context_len": n, "time_s": t})
    return rows


def measure_decode(
    model: Transformer, batch_sizes: Sequence[int], kv_lens: Sequence[int], warmup: int = 1, repeats: int = 3
) -> list[dict[str, Any]]:
    """Median time of one decode step for each (batch size, KV length): every sequence reads ``kv_len`` positions."""
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

            t = median_time(step, model.device, warmup, repeats)
            rows.append({"phase": "decode", "batch": b, "prompt_len": 0, "context_len": kv_len, "time_s": t})
    return rows


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
        out.append(
            {
                **r,
                "flops": cost.flops,
                "bytes": cost.bytes,
                "intensity": cost.intensity,
                "predicted_s": cost.time_s,
                "predicted_bound": cost.bound,
                "achieved_flops_per_s": u.achieved_flops_per_s,
                "achieved_bytes_per_s": u.achieved_bytes_per_s,
                "mfu": u.mfu,
                "mbu": u.mbu,
                "tokens_per_s": (r["batch"] * (r["prompt_len"] if r["phase"] == "prefill" else 1)) / r["time_s"],
            }
        )
    return out


def measure_decode_paged(
    model: Transformer, batch: int, kv_lens: Sequence[int], block_size: int, warmup: int = 1, repeats: int = 3
) -> list[dict[str, Any]]:
    """Median decode-step time when each sequence's KV lives in scattered ``block_size``-token blocks of a pool."""
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

        t = median_time(step, model.device, warmup, repeats)
        rows.append({"phase": "decode", "batch": batch, "prompt_len": 0, "context_len": kv_len, "time_s": t})
    return rows
