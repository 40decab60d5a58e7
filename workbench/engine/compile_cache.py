"""What inductor's on-disk caches did for this process's compilations: where they live and how often they hit.

torch 2.13 keeps two caches across processes, both on by default: the FX graph cache (inductor's generated code and
its compiled library, keyed by the graph, its inputs' metadata and the config; ``torch._inductor.config
.fx_graph_cache``) and the AOT autograd cache in front of it (``torch._functorch.config.enable_autograd_cache``),
both under ``TORCHINDUCTOR_CACHE_DIR`` (by default ``torchinductor_<user>`` in the system's temporary directory). A
second process still traces each graph with dynamo; on a hit it skips AOT autograd's tracing, inductor's lowering
and the C++ compiler. ``bench offline`` reports these counts beside its warm-up seconds, so a slow warm-up says
whether it compiled (misses, bypasses) or only traced (hits). A graph that enters inference mode itself is one the AOT
autograd cache bypasses (the compiled decode step therefore calls the LM head through ``Transformer._logits``, not the
decorated ``compute_logits``; ``tests/test_decode_step.py`` checks the step's graph with the cache's own check).
"""

from __future__ import annotations

# (counter group, counter) of torch._dynamo.utils.counters -> the name reported
CACHE_COUNTERS = {
    ("inductor", "fxgraph_cache_hit"): "fx_graph_hits",
    ("inductor", "fxgraph_cache_miss"): "fx_graph_misses",
    ("inductor", "fxgraph_cache_bypass"): "fx_graph_bypasses",
    ("aot_autograd", "autograd_cache_hit"): "aot_autograd_hits",
    ("aot_autograd", "autograd_cache_miss"): "aot_autograd_misses",
    ("aot_autograd", "autograd_cache_bypass"): "aot_autograd_bypasses",
}


def cache_counts() -> dict[str, int]:
    """This process's hits, misses and bypasses of the FX graph and AOT autograd caches so far."""
    from torch._dynamo.utils import counters

    return {name: int(counters[group][key]) for (group, key), name in CACHE_COUNTERS.items()}


def cache_state(since: dict[str, int] | None = None) -> dict[str, object]:
    """The caches' directory, whether each is on, and the counts since ``since`` (an earlier ``cache_counts()``)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    now = cache_counts()
    before = since or {}
    return {
        "dir": cache_dir(),
        "fx_graph_cache": bool(inductor_config.fx_graph_cache),
        "aot_autograd_cache": bool(functorch_config.enable_autograd_cache),
        **{name: now[name] - before.get(name, 0) for name in now},
    }
