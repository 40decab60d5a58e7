"""The one ragged-step executor: ``Transformer.forward`` (prefill, chunks, prefill mixed with decodes) eagerly, or
as one compiled graph a step.

A ragged step's time is mostly its large matrix products; ~8% (``torch.profiler`` on ``bench-300m``, fp32, 2 CPU
threads, a 320-token step) is ~40 small operations per layer between them, each a pass over (tokens, hidden) in
memory. ``compile=True`` (``EngineConfig.compile_prefill``, CPU) compiles the whole step, embedding to final norm,
with inductor and its C++ wrapper, so each layer's glue fuses into a few loops, with each layer's attention one
opaque operator, ``workbench::ragged_attend`` (as vLLM's compiled model calls its attention): the operator writes
the step's K/V into the pool and attends through the engine's backend, which it finds outside the graph (the
step in flight, set around the call), so the pool, the block tables and the sequences' lengths are no graph
inputs: nothing about them reaches a guard, and inductor copies no pool (a write into a graph input's view
would make it copy). The step thus costs one compiled call instead of one eager pass through every layer's
Python.

The token count is a dynamic dimension. The ranges are what the graph is guarded on: dynamo specialises a count of 1,
and, in a model with a packed linear (``count_packed``: only weights of ``PACKED_MIN_WEIGHT`` elements or more are), its
first row count (``PACKED_MIN_ROWS``) splits the rest, so at most three graphs: 1, 2-3 and 4 or more tokens where
packing starts at 4 rows (Intel CPUs), two (1, 2 or more) where it starts at 1 or nothing is packed
(``warmup_token_counts`` holds one count of each). A range compiles at its first step, or all of them in ``warmup`` (on
a scratch cache: the engine's pool is not written); ``compile_s`` keeps the seconds of each step that compiled. Inductor
caches compiled code on disk (``workbench.engine.compile_cache``).
"""

from __future__ import annotations

import threading

import torch

from workbench.config import ceil_div
from workbench.device import graph_op, inductor_compile
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model.attention import AttentionBackend, AttentionMetadata, build_metadata
from workbench.model.packed import PACKED_MIN_ROWS, count_packed
from workbench.model.transformer import Attend, Transformer, ragged_attention
from workbench.timing import now


def warmup_token_counts(model: Transformer) -> tuple[int, ...]:
    """One token count of each range the compiled graphs of ``model`` are guarded on: 1 and 2, and the packed
    products' first row count (``PACKED_MIN_ROWS``) when ``model`` holds a packed linear."""
    return tuple(sorted({1, 2, PACKED_MIN_ROWS})) if count_packed(model) else (1, 2)


def num_compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (every caller of ``torch.compile`` counts)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _InFlight(threading.local):
    """The attention of each thread's compiled ragged step in flight (``PrefillStep._forward`` sets it)."""

    attend: list[Attend]

    def __init__(self) -> None:
        self.attend = []


_IN_FLIGHT = _InFlight()


def _attend_in_flight(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``ragged_attend``'s body: layer ``layer``'s attention in this thread's step in flight."""
    return _IN_FLIGHT.attend[-1](layer, q, k, v, scale)


ragged_attend = graph_op(
    "workbench::ragged_attend",
    "(int layer, Tensor q, Tensor k, Tensor v, float scale) -> Tensor",  # the order of an ``Attend``
    _attend_in_flight,
    lambda layer, q, k, v, scale: q.new_empty(q.shape[0], q.shape[1], v.shape[2]),  # dv < d for MLA's latent
)


def _ragged_body(model: Transformer, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the compiled ragged step traces: the whole model up to the final norm, attention the opaque op."""
    return model._layers(input_ids, positions, ragged_attend)[0]


class PrefillStep:
    """Ragged steps through ``Transformer.forward``, eagerly or (``compile``) as one compiled graph a step."""

    def __init__(self, model: Transformer, cache: KVCache, backend: AttentionBackend, compile: bool) -> None:
        if compile and model.device.type != "cpu":
            raise ConfigError(f"compile_prefill is for the CPU (the model is on {model.device}); turn it off")
        self.model, self.cache, self.backend, self.compiled = model, cache, backend, compile
        self.steps = 0  # ragged steps served
        self.compile_s: dict[int, float] = {}  # compile mode: token count of each step that compiled -> its seconds
        self._graph = inductor_compile(_ragged_body, fullgraph=True, options={"cpp_wrapper": True}) if compile else None

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One ragged step: writes its K/V into the cache and returns the hidden states after the final norm,
        (num_tokens, hidden). A step that compiles a graph is timed into ``compile_s``."""
        self.steps += 1
        return self._forward(input_ids, meta, self.cache)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        if self._graph is None:
            return self.model.forward(input_ids, meta, cache, self.backend)
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)  # the token count is dynamic from the first compilation on
        torch._dynamo.maybe_mark_dynamic(meta.positions, 0)
        graphs, t0 = num_compiled_graphs(), now()
        _IN_FLIGHT.attend.append(ragged_attention(meta, cache, self.backend))
        try:
            with torch.inference_mode():
                hidden = self._graph(self.model, input_ids, meta.positions)
        finally:
            _IN_FLIGHT.attend.pop()
        if num_compiled_graphs() > graphs:
            self.compile_s[int(input_ids.shape[0])] = now() - t0
        return hidden

    def warmup(self, max_tokens: int | None = None) -> dict[int, float]:
        """Compile the graphs of every range (compile mode; nothing to do eagerly): one step of each of
        ``warmup_token_counts(model)`` tokens (those up to ``max_tokens``, the most a step schedules), one sequence on a
        scratch cache of its own. Returns ``compile_s``."""
        if self._graph is None:
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
