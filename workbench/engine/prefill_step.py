"""The one ragged-step executor: ``Transformer.forward`` (prefill, chunks, prefill mixed with decodes) eagerly, or
with every layer's work around its attention compiled.

A ragged step's time is mostly its large matrix products; ~8% (``torch.profiler`` on ``bench-300m``, fp32, 2 CPU
threads, a 320-token step) is ~40 small operations per layer between them, each a pass over (tokens, hidden) in
memory. ``compile=True`` (``EngineConfig.compile_prefill``, CPU) compiles the two parts of a layer,
``DecoderLayer.pre_attention`` (norm, QKV projection, rotary) and ``post_attention`` (O projection, residual, norm,
SwiGLU, residual), with inductor and its C++ wrapper, so each part's glue fuses into a few loops. Attention stays
eager between them: its cache write and its loop over the step's sequences are ragged, and a write into the pool
inside a graph makes inductor copy the pool.

The token count is a dynamic dimension and the layer is an argument (dynamo inlines the module, so its weights are
graph inputs): one pair of graphs serves every layer and every token count of a range. The ranges are what the
graphs are guarded on: dynamo specialises a count of 1, and, in a model with a packed linear (``count_packed``:
only weights of ``PACKED_MIN_WEIGHT`` elements or more are), its row range (``PACKED_MIN_ROWS`` to
``PACKED_MAX_ROWS``) splits the rest, so at most four pairs: 1, 2-3, 4-256 and 257 or more tokens, two (1, 2 or
more) without one (``warmup_token_counts`` holds one count of each). A range compiles at its first step, or all
of them in ``warmup`` (on a scratch cache: the engine's pool is not written); ``compile_s`` keeps the seconds of
each step that compiled. Inductor caches compiled code on disk (``workbench.engine.compile_cache``).
"""

from __future__ import annotations

import torch

from workbench.config import ceil_div
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model.attention import AttentionBackend, AttentionMetadata, build_metadata
from workbench.model.packed import PACKED_MAX_ROWS, PACKED_MIN_ROWS, count_packed
from workbench.model.transformer import DecoderLayer, LayerParts, Transformer
from workbench.timing import now


def warmup_token_counts(model: Transformer) -> tuple[int, ...]:
    """One token count of each range the compiled graphs of ``model`` are guarded on: 1 and 2, and the packed row
    range's two ends (``PACKED_MIN_ROWS``, ``PACKED_MAX_ROWS + 1``) when ``model`` holds a packed linear."""
    return (1, 2, PACKED_MIN_ROWS, PACKED_MAX_ROWS + 1) if count_packed(model) else (1, 2)


def num_compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (every caller of ``torch.compile`` counts)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class PrefillStep:
    """Ragged steps through ``Transformer.forward``, eagerly or (``compile``) with each layer's two parts compiled."""

    def __init__(self, model: Transformer, cache: KVCache, backend: AttentionBackend, compile: bool) -> None:
        if compile and model.device.type != "cpu":
            raise ConfigError(f"compile_prefill is for the CPU (the model is on {model.device}); turn it off")
        self.model, self.cache, self.backend, self.compiled = model, cache, backend, compile
        self.steps = 0  # ragged steps served
        self.compile_s: dict[int, float] = {}  # compile mode: token count of each step that compiled -> its seconds
        self.parts: LayerParts | None = None
        if compile:
            import torch._dynamo as dynamo  # imported when used: it costs a second at import

            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)  # ranges, models in a process
            options = {"cpp_wrapper": True}
            self._pre = torch.compile(DecoderLayer.pre_attention, fullgraph=True, dynamic=False, options=options)
            self._post = torch.compile(DecoderLayer.post_attention, fullgraph=True, dynamic=False, options=options)
            self.parts = LayerParts(self._call_pre, self._call_post)

    def _call_pre(
        self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for t in (x, cos, sin_signed):  # the token count is dynamic from the first compilation on
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return self._pre(layer, x, cos, sin_signed)

    def _call_post(self, layer: DecoderLayer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(o, 0)
        return self._post(layer, x, o)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One ragged step: writes its K/V into the cache and returns the hidden states after the final norm,
        (num_tokens, hidden). A step that compiles a graph is timed into ``compile_s``."""
        self.steps += 1
        return self._forward(input_ids, meta, self.cache)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        if self.parts is None:
            return self.model.forward(input_ids, meta, cache, self.backend)
        graphs, t0 = num_compiled_graphs(), now()
        hidden = self.model.forward(input_ids, meta, cache, self.backend, self.parts)
        if num_compiled_graphs() > graphs:
            self.compile_s[int(input_ids.shape[0])] = now() - t0
        return hidden

    def warmup(self, max_tokens: int | None = None) -> dict[int, float]:
        """Compile the graphs of every range (compile mode; nothing to do eagerly): one step of each of
        ``warmup_token_counts(model)`` tokens (those up to ``max_tokens``, the most a step schedules), one sequence on a
        scratch cache of its own. Returns ``compile_s``."""
        if self.parts is None:
            return {}
        cfg, bs, dev = self.model.config, self.cache.block_size, self.model.device
        for n in warmup_token_counts(self.model):
            if max_tokens is not None and n > max_tokens:
                continue
            blocks = ceil_div(n, bs)
            kv_dtype = self.cache.kv_cache_dtype if self.cache.quantized else "auto"
            scratch = KVCache(cfg, blocks, bs, dtype=self.cache.dtype, device=dev, kv_cache_dtype=kv_dtype)
            meta = build_metadata([n], [n], [list(range(blocks))], bs, dev)
            self._forward(torch.zeros(n, dtype=torch.int64, device=dev), meta, scratch)
        return dict(self.compile_s)
