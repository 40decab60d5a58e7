"""Measure every operation of a model on this machine (``workbench profile-ops``) into an op profile, and fit the
per-step overhead of ``OpProfileCostModel`` to the real engine's steps.

``profile_ops`` times the model's own layers (``workbench.model``: the projections' ``nn.Linear`` modules, the
layers' ``RMSNorm``, ``apply_rotary_rolled``, the ``RotaryEmbedding``, ``KVCache.write``, the engine's attention
backend, the LM head and the ``Sampler``), each at a grid of sizes, with ``workbench.timing.time_stats`` (warm-up,
then the median of the repeats, with min and max). The per-layer operations cycle through the model's layers from
one call to the next, so every call reads another layer's weights, as a forward pass does, rather than weights left
in the cache by the call before. The activation is timed as ``SwiGLU.forward`` computes it, ``silu(gate) * up``.
``measure_overhead`` then replays the fit-profile training workloads (``workbench.sim.measure``) on the engine and
fits what the summed operations miss (``workbench.sim.op_profile.fit_overhead``).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

from workbench.config import ModelConfig, ceil_div
from workbench.errors import ConfigError
from workbench.sim.op_profile import OP_PROFILE_FORMAT, OP_X, OPS_1D, OPS_2D, OpProfileCostModel, fit_overhead
from workbench.timing import time_stats

TOKEN_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
ROW_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PROMPT_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
CONTEXT_GRID = (1, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
BATCH_GRID = (1, 2, 4, 8, 16, 32)
CACHE_BYTES = 256 * 1024**2  # the attention pool's budget: as many layers (up to 4) to cycle through as fit in it


def default_grids(cfg: ModelConfig, max_tokens: int = 2048, max_rows: int = 64) -> dict[str, list[int]]:
    """The sizes measured by default: tokens and prompt lengths up to ``max_tokens`` (and the model's positions),
    sampled rows up to ``max_rows``, contexts up to the same limit, decode batches 1 to 32."""
    top = min(max_tokens, cfg.max_position_embeddings)
    return {
        "tokens": [t for t in TOKEN_GRID if t <= max_tokens] or [max_tokens],
        "rows": [r for r in ROW_GRID if r <= max_rows] or [max_rows],
        "prompt_lens": [p for p in PROMPT_GRID if p <= top] or [top],
        "contexts": [c for c in CONTEXT_GRID if c <= top] or [top],
        "batch_sizes": list(BATCH_GRID),
    }


def _point(fn: Callable[[], Any], device: Any, warmup: int, max_repeats: int, target_s: float) -> dict[str, float]:
    """Time ``fn``: ``warmup`` calls, then min(max_repeats, max(3, target_s / one call's time)) timed calls."""
    first = time_stats(fn, device, warmup=warmup, repeats=1)["median_s"]
    repeats = int(min(max_repeats, max(3, target_s / max(first, 1e-9))))
    stats = time_stats(fn, device, warmup=0, repeats=repeats)
    return {"median_s": stats["median_s"], "min_s": stats["min_s"], "max_s": stats["max_s"], "repeats": repeats}


def _combine(passes: list[dict[str, float]]) -> dict[str, float]:
    """One point over several passes: the median of the passes' medians, the min and max of all calls."""
    from workbench.timing import median

    return {"median_s": median([p["median_s"] for p in passes]), "min_s": min(p["min_s"] for p in passes),
            "max_s": max(p["max_s"] for p in passes), "repeats": sum(p["repeats"] for p in passes)}  # fmt: skip


def _series(values: list[int], points: list[dict[str, float]]) -> dict[str, Any]:
    return {"values": list(values), **{k: [p[k] for p in points] for k in ("median_s", "min_s", "max_s", "repeats")}}


def profile_ops(
    model: str = "tiny-gqa",
    device: str = "cpu",
    dtype: str = "fp32",
    attention_backend: str = "auto",
    grids: dict[str, list[int]] | None = None,
    max_tokens: int = 2048,
    warmup: int = 2,
    max_repeats: int = 15,
    target_s: float = 0.05,
    seed: int = 0,
    progress: bool = True,
    passes: int = 3,
    packed_linears: bool = True,
) -> dict[str, Any]:
    """Time every operation of ``model`` (a preset or config.json; random weights) on ``device``: the content of an
    op profile file (``OP_PROFILE_FORMAT``) without its overhead and machine facts (``workbench profile-ops`` adds
    them). ``grids``: sizes per axis (``default_grids``). ``passes``: sweeps over every point, interleaved (each
    point once per pass); a point's median is the median of its passes' medians. ``packed_linears``: time the linear
    layers (projections and LM head) as an engine with ``EngineConfig.packed_linears`` runs them (packed weights
    from ``PACKED_MIN_ROWS`` rows on, ``workbench.model.packed``, where the device and dtype allow it and for the
    weights of at least ``PACKED_MIN_WEIGHT`` elements only); the profile records whether any was packed (and, if so,
    ``packed_products``: the row range and the packed products of a layer and of the LM head, as packed, which the
    overhead fit prices per product; none for a model of small matrices), and ``measure_overhead`` runs its engine
    the same way. ``attention_backend``: an ``EngineConfig.attention_backend`` name, resolved as the engine resolves
    it (``make_backend``: 'auto' is the paged C++ decode on a CPU where its op builds, else torch); the profile
    records the backend timed (its ``name``: 'cpu', 'torch' or 'triton'), which its overhead fit's engine then runs."""
    import torch
    import torch.nn.functional as F

    from workbench.device import resolve_device, synchronize, torch_dtype
    from workbench.engine.runner import make_backend
    from workbench.kv.cache import KVCache
    from workbench.model.attention import MAX_GATHER_KEY_SLOTS, build_decode_metadata, build_metadata
    from workbench.model.checkpoint import load_model
    from workbench.model.layers import apply_rotary_rolled, signed_sin
    from workbench.model.packed import PACKED_MIN_ROWS, PackedLinear, count_packed, pack_linears
    from workbench.model.sampler import Sampler
    from workbench.request import SamplingParams

    dev = resolve_device(device)
    tdtype = torch_dtype(dtype)
    net = load_model(model, dtype=tdtype, device=dev, seed=seed)
    if packed_linears:  # as the engine runs them (Engine.__init__): only the weights worth packing
        pack_linears(net)
    packed = count_packed(net) > 0
    packed_products = None
    if packed:  # what OpProfileCostModel.packed_calls counts: the packed products of a layer (0 when only the LM
        # head is), and the LM head
        per_layer = count_packed(net.layers[0])
        head = isinstance(getattr(net, "lm_head", None), PackedLinear)
        packed_products = {"min_rows": PACKED_MIN_ROWS, "max_rows": None, "per_layer": per_layer, "head": head}
    cfg = net.config
    g = {**default_grids(cfg, max_tokens), **(grids or {})}
    for axis, values in g.items():
        if not values or any(not isinstance(v, int) or v < 1 for v in values) or sorted(set(values)) != list(values):
            raise ConfigError(f"profile-ops: the {axis} grid must be increasing integers >= 1, got {values!r}")
    backend = make_backend(attention_backend, dev.type)
    nl, nh, nkv, d = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = list(net.layers)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=tdtype)

    turn = [0]

    def next_layer() -> int:  # per-layer operations read another layer's weights at every call
        turn[0] = (turn[0] + 1) % nl
        return turn[0]

    # the pool the attention and KV writes use: up to 4 layers within CACHE_BYTES, cycled like the weights
    bs = 16
    top_tokens = max(g["tokens"][-1], g["prompt_lens"][-1], g["contexts"][-1])
    decode_blocks = g["batch_sizes"][-1] * ceil_div(g["contexts"][-1], bs)
    num_blocks = max(ceil_div(top_tokens, bs), decode_blocks) + 1
    per_layer = 2 * num_blocks * bs * nkv * d * tdtype.itemsize
    cache_layers = max(1, min(nl, 4, CACHE_BYTES // max(per_layer, 1)))
    cache = KVCache(cfg.with_overrides(num_layers=cache_layers), num_blocks, bs, tdtype, dev)
    rows_top = g["rows"][-1]
    all_layers_cache = KVCache(cfg, ceil_div(rows_top, bs) + 1, bs, tdtype, dev)  # a pure decode's one write
    sampler = Sampler()
    greedy = SamplingParams()

    ops: dict[str, Any] = {}
    jobs: list[tuple[Any, list[int], list[Callable[[], Any]]]] = []  # (key, sizes, one timed function per size)

    def measure(name: str, values: list[int], make: Callable[[int], Callable[[], Any]]) -> None:
        jobs.append((name, list(values), [make(v) for v in values]))

    with torch.inference_mode():
        hidden, inter = cfg.hidden_size, cfg.intermediate_size

        def linear(attr: Callable[[Any], Any], width: int) -> Callable[[int], Callable[[], Any]]:
            def make(t: int) -> Callable[[], Any]:
                x = randn(t, width)
                return lambda: attr(layers[next_layer()])(x)

            return make

        measure("qkv_proj", g["tokens"], linear(lambda lay: lay.self_attn.qkv_proj, hidden))
        measure("o_proj", g["tokens"], linear(lambda lay: lay.self_attn.o_proj, cfg.q_size))
        measure("gate_up_proj", g["tokens"], linear(lambda lay: lay.mlp.gate_up_proj, hidden))
        measure("down_proj", g["tokens"], linear(lambda lay: lay.mlp.down_proj, inter))

        def make_norm(t: int) -> Callable[[], Any]:
            x = randn(t, hidden)
            return lambda: layers[next_layer()].input_layernorm.forward(x)

        measure("rmsnorm", g["tokens"], make_norm)

        def make_add(t: int) -> Callable[[], Any]:
            x, o = randn(t, hidden), randn(t, hidden)
            return lambda: x + o  # the residual add of DecoderLayer.forward

        measure("residual_add", g["tokens"], make_add)

        def make_act(t: int) -> Callable[[], Any]:
            gate, up = randn(t, 2 * inter).split(inter, dim=-1)
            return lambda: F.silu(gate).mul_(up)  # SwiGLU.forward's activation

        measure("activation", g["tokens"], make_act)

        def tables(t: int) -> tuple[Any, Any]:
            cos, sin = net.rotary(torch.arange(t, device=dev), tdtype)
            return cos, signed_sin(sin)

        def make_rotary(t: int) -> Callable[[], Any]:
            qk = randn(t, nh + 2 * nkv, d)[:, : nh + nkv]  # Q and K columns of the fused QKV output
            cos, sin_signed = tables(t)
            return lambda: apply_rotary_rolled(qk, cos, sin_signed)

        measure("rotary", g["tokens"], make_rotary)

        def make_table(t: int) -> Callable[[], Any]:
            pos = torch.arange(t, device=dev)
            return lambda: signed_sin(net.rotary(pos, tdtype)[1])

        measure("rotary_table", g["tokens"], make_table)

        def make_embed(t: int) -> Callable[[], Any]:
            ids = torch.randint(0, cfg.vocab_size, (t,), generator=gen).to(dev)
            return lambda: net.embed_tokens(ids)

        measure("embedding", g["tokens"], make_embed)

        def make_write(t: int) -> Callable[[], Any]:
            slots = torch.arange(t, device=dev)
            k, v = randn(t, nkv, d), randn(t, nkv, d)

            def run() -> None:
                cache.write(slots, k, v, layer=next_layer() % cache_layers)

            return run

        measure("kv_write", g["tokens"], make_write)

        def make_head(r: int) -> Callable[[], Any]:
            h = randn(r, hidden)
            return lambda: net.compute_logits(h)

        measure("lm_head", g["rows"], make_head)

        def make_sample(r: int) -> Callable[[], Any]:
            logits = torch.randn(r, cfg.vocab_size, generator=gen).to(dev)
            params, ids = [greedy] * r, list(range(r))
            return lambda: sampler(logits, params, ids)

        measure("sample", g["rows"], make_sample)

        def make_decode_write(b: int) -> Callable[[], Any]:
            slots = torch.arange(b, device=dev)
            ks, vs = [randn(b, nkv, d) for _ in range(nl)], [randn(b, nkv, d) for _ in range(nl)]
            return lambda: all_layers_cache.write(slots, torch.stack(ks), torch.stack(vs))  # as decode_step does

        measure("decode_kv_write", g["rows"], make_decode_write)

        def blocks(n: int, first: int = 0) -> list[int]:
            return list(range(first, first + ceil_div(n, bs)))

        def make_prefill(length: int) -> Callable[[], Any]:
            meta = build_metadata([length], [length], [blocks(length)], bs, dev)
            q = randn(length, nh, d)

            def run() -> Any:
                i = next_layer() % cache_layers
                return backend.forward(q, cache.k[i], cache.v[i], meta, net.layers[0].self_attn.scale)

            return run

        measure("attention_prefill", g["prompt_lens"], make_prefill)

        def make_looped(context: int) -> Callable[[], Any]:
            meta = build_metadata([1], [context], [blocks(context)], bs, dev)
            q = randn(1, nh, d)

            def run() -> Any:
                i = next_layer() % cache_layers
                return backend.forward(q, cache.k[i], cache.v[i], meta, net.layers[0].self_attn.scale)

            return run

        measure("attention_decode_looped", g["contexts"], make_looped)

        for b in g["batch_sizes"]:

            def make_decode(c: int, b: int = b) -> Callable[[], Any]:
                per = ceil_div(c, bs)
                meta = build_decode_metadata([c] * b, [blocks(c, i * per) for i in range(b)], bs, dev)
                q, k, v = randn(b, nh, d), randn(b, nkv, d), randn(b, nkv, d)

                def run() -> Any:
                    i = next_layer() % cache_layers
                    return backend.decode(i, q, k, v, cache, meta, net.layers[0].self_attn.scale)

                return run

            jobs.append((("attention_decode", b), list(g["contexts"]), [make_decode(c) for c in g["contexts"]]))

        # every pass times every point once; a point's median is the median of its passes' medians, so a burst
        # of load from other processes during one pass moves one of them, not the profile
        results: dict[Any, list[list[dict[str, float]]]] = {key: [[] for _ in fns] for key, _, fns in jobs}
        bar = None
        if progress:
            from tqdm import tqdm

            total = passes * sum(len(fns) for _, _, fns in jobs)
            bar = tqdm(total=total, desc=f"profile-ops {model}", unit="point", leave=False)
        for n in range(passes):
            for key, values, fns in jobs:
                for i, (v, fn) in enumerate(zip(values, fns)):
                    if bar is not None:
                        bar.set_postfix_str(f"pass {n + 1}/{passes} {key} {v}")
                    results[key][i].append(_point(fn, dev, warmup, max_repeats, target_s))
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        combined = {key: [_combine(p) for p in points] for key, points in results.items()}
        table: dict[str, list[list[float]]] = {"median_s": [], "min_s": [], "max_s": []}
        for key, values, _ in jobs:
            if isinstance(key, tuple):
                for stat in table:
                    table[stat].append([p[stat] for p in combined[key]])
            else:
                ops[key] = {"x": OP_X[key], **_series(values, combined[key])}
        ops["attention_decode"] = {"x": "batch,context", "batch_sizes": list(g["batch_sizes"]),
                                   "contexts": list(g["contexts"]), **table}  # fmt: skip
        synchronize(dev)
    missing = [op for op in (*OPS_1D, *OPS_2D) if op not in ops]
    if missing:  # a programming error, not a user's: every operation of the cost model must be measured
        raise RuntimeError(f"profile-ops measured no {missing}")
    return {
        "format": OP_PROFILE_FORMAT,
        "model": model,
        "num_layers": nl,
        "model_shape": cfg.summary(),
        "device": str(dev),
        "dtype": dtype,
        "attention_backend": backend.name,
        "packed_linears": packed,
        "packed_products": packed_products,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "max_key_slots": MAX_GATHER_KEY_SLOTS if backend.gathers else 2**62,
        "timing": {
            "warmup": warmup,
            "max_repeats": max_repeats,
            "target_s": target_s,
            "min_repeats": 3,
            "passes": passes,
            "cache_layers": cache_layers,
        },  # fmt: skip
        "ops": ops,
        "overhead": None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def overhead_engine_configs(
    profile: dict[str, Any],
    policies: tuple[str, ...] = ("continuous", "chunked"),
    max_num_seqs: int = 16,
    max_model_len: int = 256,
) -> list[Any]:
    """The engines whose steps an op profile's overhead is fitted on, one ``EngineConfig`` per policy (chunked: a
    budget of half the context): the profile's device and dtype, its attention backend, and its linear layers packed
    as its operations were timed (``packed_linears``; a profile without the key was timed with plain layers)."""
    from workbench.device import resolve_device
    from workbench.engine.config import EngineConfig

    dev = resolve_device(profile["device"])
    return [EngineConfig(policy=policy, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         dtype=profile["dtype"], device=str(dev),
                         token_budget=max_model_len // 2 if policy == "chunked" else None,
                         attention_backend=profile.get("attention_backend", "torch"),
                         packed_linears=bool(profile.get("packed_linears", False)))
            for policy in policies]  # fmt: skip


def measure_training_steps(
    profile: dict[str, Any],
    policies: tuple[str, ...] = ("continuous", "chunked"),
    num_requests: int = 24,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    seed: int = 1000,
) -> tuple[Any, list[Any]]:
    """(``StepSamples``, engine configs): the fit-profile training workloads of ``seed`` replayed on the real engine
    (same model, device and dtype as ``profile``; ``overhead_engine_configs``) under each policy."""
    from workbench.device import resolve_device, torch_dtype
    from workbench.model.checkpoint import load_model
    from workbench.sim.measure import StepSamples, measure_training_policy

    dev = resolve_device(profile["device"])
    net = load_model(profile["model"], dtype=torch_dtype(profile["dtype"]), device=dev, seed=0)
    samples = StepSamples()
    configs = overhead_engine_configs(profile, policies, max_num_seqs, max_model_len)
    for cfg in configs:
        samples.extend(measure_training_policy(net, cfg, num_requests, seed))  # shapes built, as profile-ops' are
    return samples, configs


def measure_overhead(
    profile: dict[str, Any],
    policies: tuple[str, ...] = ("continuous", "chunked"),
    num_requests: int = 24,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    seed: int = 1000,
) -> dict[str, Any]:
    """Replay the fit-profile training workloads on the real engine (``measure_training_steps``) and fit the
    per-step overhead (``overhead_from_samples``); returns the profile's ``overhead`` section."""
    samples, configs = measure_training_steps(profile, policies, num_requests, max_num_seqs, max_model_len, seed)
    return overhead_from_samples(profile, samples, configs, seed)


def overhead_from_samples(profile: dict[str, Any], samples: Any, configs: list[Any], seed: int = 1000) -> dict:
    """The op profile's ``overhead`` section fitted (``fit_overhead``) to measured engine steps (``StepSamples`` of
    the engines ``configs``, replaying the training workloads of ``seed``): by ``measure_overhead``, or by the
    fidelity check from the workloads it measures between its runs (``workbench.sim.measure.InterleavedTraining``)."""
    cost = OpProfileCostModel.from_dict(profile)
    over = fit_overhead(cost, samples.stats, samples.durations_s, samples.gaps_s, samples.after_idle,
                        samples.wakes_s)  # fmt: skip
    over["fit"]["engine_configs"] = [{"policy": c.policy, "max_num_seqs": c.max_num_seqs,
                                      "max_model_len": c.max_model_len, "token_budget": c.token_budget}
                                     for c in configs]  # fmt: skip
    over["fit"]["workload_seed"] = seed
    return over


def check_grid_arg(values: list[int] | None, name: str) -> list[int] | None:
    """A grid given on the command line: sorted, unique, positive (ConfigError otherwise)."""
    if values is None:
        return None
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"--{name} needs positive integers, got {values!r}")
    return sorted(set(values))
