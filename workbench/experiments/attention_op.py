"""The CPU paged decode attention alone (``workbench bench attention``): KV bytes read per second, per code path.

One decode step's attention for every layer of a model, nothing else: ``batch`` sequences of ``context`` cached
tokens each, in a pool of the model's shape (KV heads, head size, its layers: each layer's pool is its own memory,
so a step streams the whole KV from DRAM, as in the engine), through ``CpuAttentionBackend.decode``, the engine's
own call (the new token's K/V as the last key, the quantized pool's scales). Every code path the CPU runs
(``supported_isas``: default, avx2, avx512) is timed in interleaved rounds, the order reversed every other round,
and reported as the median of its rounds, with the KV bytes the step reads (``ModelConfig.kv_bytes_per_token``,
int8 scales included) per second. Blocks in order (as a fresh engine hands them out) or ``scattered`` (a seeded
permutation of the pool, as after churn).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from workbench.config import ModelConfig, ceil_div
from workbench.errors import ConfigError
from workbench.timing import now

BLOCK_SIZE = 16


def decode_attention_sweep(
    cfg: ModelConfig,
    batch: int,
    context: int,
    kv_dtypes: list[str],
    repeats: int,
    seed: int = 0,
    scattered: bool = False,
) -> list[dict[str, Any]]:
    """Rows of (``kv_cache_dtype``, ``isa``, ``schedule``): ``median_ms``/``min_ms``/``max_ms`` of one step's attention
    over all layers, ``gb_per_s`` (KV bytes read at the median), ``time_vs_best`` (median over the fastest path's, same
    KV dtype). Every code path runs this CPU's schedule (``default_schedule``), the best path the other
    schedule too; all of them alternate, round by round."""
    from workbench.kernels.paged_decode_cpu import SCHEDULES, default_schedule, supported_isas
    from workbench.kv.cache import KVCache
    from workbench.model.attention import build_decode_metadata
    from workbench.model.cpu_backend import CpuAttentionBackend

    if cfg.is_mla:
        raise ConfigError(f"{cfg.name} is an MLA model: its pool is a latent, which the CPU decode op does not read")
    if batch < 1 or context < 1 or repeats < 1:
        raise ConfigError(
            f"need batch (--batch), context (--prompt-len) and repeats >= 1, got {batch}, {context}, {repeats}"
        )
    isas = supported_isas()
    if not isas:
        raise ConfigError("the CPU decode op did not build here (workbench.kernels.paged_decode_cpu.build_error())")
    gen = torch.Generator().manual_seed(seed)
    per_seq = ceil_div(context + 1, BLOCK_SIZE)
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks, generator=gen) if scattered else torch.arange(num_blocks)
    tables = order.view(batch, per_seq).tolist()
    meta = build_decode_metadata([context + 1] * batch, tables, BLOCK_SIZE)
    L, n_kv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(batch, cfg.num_heads, d, generator=gen)
    k_new, v_new = torch.randn(batch, n_kv, d, generator=gen), torch.randn(batch, n_kv, d, generator=gen)
    scale = d**-0.5
    mine = default_schedule()
    paths = [(isa, mine) for isa in isas] + [(isas[-1], s) for s in SCHEDULES if s != mine]
    backends = {path: CpuAttentionBackend(*path) for path in paths}

    def step(backend: CpuAttentionBackend, cache: KVCache) -> float:
        t0 = now()
        for layer in range(L):
            backend.decode(layer, q, k_new, v_new, cache, meta, scale)
        return now() - t0

    rows = []
    for kv_dtype in kv_dtypes:
        cache = KVCache(cfg, num_blocks, BLOCK_SIZE, kv_cache_dtype=kv_dtype)
        slots = torch.arange(num_blocks * BLOCK_SIZE)
        for layer in range(L):  # one layer at a time: a model's whole KV in fp32 at once may not fit beside it
            shape = (len(slots), n_kv, d)
            cache.write(slots, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), layer=layer)
        for backend in backends.values():
            step(backend, cache)  # warm-up
        times: dict[tuple[str, str], list[float]] = {path: [] for path in paths}
        for r in range(repeats):
            for path in paths if r % 2 == 0 else paths[::-1]:
                times[path].append(step(backends[path], cache))
        kv_bytes = batch * context * cfg.kv_bytes_per_token("fp32" if kv_dtype == "auto" else kv_dtype)
        best = min(statistics.median(t) for t in times.values())
        for (isa, schedule), t in times.items():
            med = statistics.median(t)
            rows.append({"kv_cache_dtype": kv_dtype, "batch": batch, "context": context, "isa": isa,
                         "schedule": schedule, "median_ms": med * 1e3, "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3,
                         "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / med / 1e9,
                         "time_vs_best": med / best})  # fmt: skip
        del cache  # this dtype's pools go before the next dtype's are made
    return rows
