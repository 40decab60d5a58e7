"""The one pure-decode executor: ``Transformer.decode_step`` run eagerly, through ``torch.compile``, or as CUDA graphs.

A pure decode (every scheduled sequence adds one token and samples) is the step a serving engine repeats most,
and the one whose cost is launches and small operations rather than arithmetic. ``DecodeStep`` runs it in one of
three modes over the same model function and the same ``DecodeMetadata`` builder:

- ``eager``: the metadata of this step (cached-key width padded to ``KEY_PAD``), the model's decode step, and the
  cache write (``KVCache.write``).
- ``compile`` (CPU): the model's decode step compiled by inductor with its C++ wrapper, one graph per bucket of
  ``compile_buckets`` with the key width dynamic. A batch is padded to its bucket with copies of its first row,
  whose results are dropped (only the real rows' logits are returned and only their new K/V written), so every pure
  decode runs a compiled graph however its batch size moves. Why (``torch.profiler`` on ``bench-300m``, fp32, 2 CPU
  threads): a batch-1 step is ~100 matrix-vector products with ~20 small eager operations per layer between them,
  each slowed 10x by the weight stream evicting its code and data (~10 of the step's ~57 ms); compiled, a layer's
  glue fuses into a few loops. The compiled function writes nothing (a write into a view of a graph input makes
  inductor copy the whole pool); the step's new K/V are written after it. A bucket compiles at its first decode, or
  all at once in ``warmup`` (as vLLM captures its graphs at start-up); ``compile_s`` keeps the seconds each took.
- ``graph`` (CUDA; ``capture=False`` runs the same static path eagerly, which is how the CPU tests check it):
  a batch is padded to the next bucket of ``batch_buckets`` (1, 2, 4, 8, 16, ...) by repeating its first row,
  whose K/V the padding rows compute again and write to the same slot. All buckets share one set of static input
  buffers sized for the largest (views of its first rows), with the key width and the kernels' ``max_seq_len`` at
  the longest the engine allows, so every shape and pointer is fixed. A bucket's first step runs eagerly on a
  side stream (which also warms the kernels), then its graph is recorded and replayed from the next step on.

``supports`` says whether a step takes this path; the one limit is ``MAX_GATHER_KEY_SLOTS`` for a backend that
gathers the cached keys (torch). Steps it refuses go through the ragged ``Transformer.forward``.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from workbench.config import ceil_div
from workbench.device import inductor_compile
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model.attention import (
    KEY_PAD,
    MAX_GATHER_KEY_SLOTS,
    AttentionBackend,
    DecodeMetadata,
    build_decode_metadata,
    decode_key_width,
)
from workbench.model.transformer import Transformer
from workbench.timing import now

DECODE_MODES = ("eager", "compile", "graph")


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured at: 1, 2, 4, 8, 16, ... and ``max_batch`` itself."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def compile_buckets(max_batch: int) -> list[int]:
    """The batch sizes the compiled step is built for: 1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, ... (from 16 on,
    each at most 1.5x the one before, so a padded batch computes at most half as many rows again), and
    ``max_batch`` itself."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        top = sizes[-1]
        sizes.append(2 * top if top < 16 else top + (top // 2 if top & (top - 1) == 0 else top // 3))
    return [b for b in sizes if b < max_batch] + [max_batch]


def _pad_rows(
    tokens: list[int], seq_lens: list[int], tables: list[list[int]], n: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """A decode batch padded to ``n`` rows with copies of its first row (a bucket of the compiled or graph step)."""
    pad = n - len(tokens)
    return tokens + tokens[:1] * pad, seq_lens + seq_lens[:1] * pad, tables + tables[:1] * pad


def _rows(meta: DecodeMetadata, n: int) -> DecodeMetadata:
    """A view of the first ``n`` rows of every tensor of ``meta``."""
    return replace(meta, **{f.name: getattr(meta, f.name)[:n] for f in fields(meta) if f.name != "max_seq_len"})


class DecodeStep:
    """Pure-decode steps of ``1 .. max_batch`` sequences in one ``mode`` of ``DECODE_MODES``."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        backend: AttentionBackend,
        mode: str,
        max_batch: int,
        max_model_len: int,
        capture: bool | None = None,
    ) -> None:
        if mode not in DECODE_MODES:
            raise ConfigError(f"decode mode must be one of {DECODE_MODES}, got {mode!r}")
        on_cuda = model.device.type == "cuda"
        if mode == "compile" and on_cuda:
            raise ConfigError("compile_decode is for the CPU: on CUDA, decode steps replay CUDA graphs")
        self.capture = mode == "graph" and (on_cuda if capture is None else capture)
        if self.capture and not on_cuda:
            raise ConfigError("CUDA graphs need the model on a CUDA device")
        self.model, self.cache, self.backend, self.mode = model, cache, backend, mode
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.steps = 0  # decode steps served
        self.compile_s: dict[int, float] = {}  # compile mode: seconds of each bucket's first (compiling) call
        # graph mode: bucket -> its CUDA graph and the (bucket, vocab) fp32 logits each replay writes
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buckets = batch_buckets(max_batch) if mode == "graph" else compile_buckets(max_batch)
        if mode == "compile":
            self._compiled = inductor_compile(model.decode_step, fullgraph=True, options={"cpp_wrapper": True})
        if mode == "graph":
            self.width = decode_key_width(max_model_len - 1)  # cached-key columns of every static step
            n, dev = self.buckets[-1], model.device
            one = build_decode_metadata([1], [[0]], cache.block_size, dev, self.width, max_model_len)
            self._meta = DecodeMetadata(  # the one set of static buffers, (largest bucket, ...) each
                **{f.name: one_f.expand(n, *one_f.shape[1:]).clone() for f in fields(one)
                   if f.name != "max_seq_len" for one_f in [getattr(one, f.name)]},
                max_seq_len=max_model_len,
            )  # fmt: skip
            self._ids = torch.zeros(n, dtype=torch.int64, device=dev)
            self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def padded_batch(self, batch: int) -> int:
        """The rows a step of ``batch`` sequences computes: its bucket (compile, graph modes), or itself (eager)."""
        return batch if self.mode == "eager" else next(b for b in self.buckets if b >= batch)

    @property
    def compiled_sizes(self) -> set[int]:
        """The buckets compiled so far (compile mode)."""
        return set(self.compile_s)

    def supports(self, seq_lens: list[int]) -> bool:
        """Whether a pure decode of sequences with these lengths (cached + new) takes this executor."""
        batch = len(seq_lens)
        if not 1 <= batch <= self.max_batch:
            return False
        if not self.backend.gathers:
            return True
        width = self.width if self.mode == "graph" else decode_key_width(max(seq_lens) - 1)
        return self.padded_batch(batch) * width <= MAX_GATHER_KEY_SLOTS

    @torch.inference_mode()
    def run(self, tokens: list[int], seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step: ``tokens[i]`` at position ``seq_lens[i] - 1`` of a sequence with block table
        ``tables[i]``; writes the new K/V into the cache and returns next-token logits (B, vocab) fp32."""
        self.steps += 1
        dev, bs = self.model.device, self.cache.block_size
        if self.mode == "graph":
            return self._run_static(tokens, seq_lens, tables)
        if self.mode == "eager":
            meta = build_decode_metadata(seq_lens, tables, bs, dev)
            ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
            return self.model.decode_step(ids, meta, self.cache, self.backend)[0]
        batch = len(tokens)
        tokens, seq_lens, tables = _pad_rows(tokens, seq_lens, tables, self.padded_batch(batch))  # dropped below
        meta = build_decode_metadata(seq_lens, tables, bs, dev)
        logits, k_new, v_new = self._call_compiled(torch.tensor(tokens, dtype=torch.int64, device=dev), meta)
        # the real rows only: a padding row's K/V would land in row 0's slot
        self.cache.write(meta.slot_mapping[:batch], k_new[:, :batch], v_new[:, :batch])
        return logits[:batch]

    def _call_compiled(self, ids: torch.Tensor, meta: DecodeMetadata) -> tuple[torch.Tensor, ...]:
        """The compiled step on a bucket-sized batch (writes nothing); a bucket's first call compiles, and is timed."""
        torch._dynamo.mark_dynamic(meta.key_slots, 1)
        torch._dynamo.mark_dynamic(meta.key_mask, 3)
        torch._dynamo.maybe_mark_dynamic(meta.block_tables, 1)  # read by a paged backend (cpu): grows with context
        n = ids.shape[0]
        first = n not in self.compile_s
        t0 = now()
        out = self._compiled(ids, meta, self.cache, self.backend, write=False)
        if first:
            self.compile_s[n] = now() - t0
        return out

    @torch.inference_mode()
    def warmup(self, batches: list[int] | None = None) -> dict[int, float]:
        """Compile every bucket not compiled yet (or those of ``batches``; compile mode, nothing to do in the others),
        on dummy rows that read block 0 of the pool and write nothing. Returns ``compile_s``: seconds per bucket."""
        if self.mode != "compile":
            return {}
        bs, dev = self.cache.block_size, self.model.device
        for n in self.buckets if batches is None else sorted({self.padded_batch(b) for b in batches}):
            if n not in self.compile_s:  # KEY_PAD + 1 tokens each: KEY_PAD cached keys, the step's width
                meta = build_decode_metadata([KEY_PAD + 1] * n, [[0] * ceil_div(KEY_PAD + 1, bs)] * n, bs, dev)
                self._call_compiled(torch.zeros(n, dtype=torch.int64, device=dev), meta)
        return dict(self.compile_s)

    def _run_static(self, tokens: list[int], seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        batch = len(tokens)
        n = self.padded_batch(batch)
        # the padding rows repeat row 0: same token, position and slot, so the same K/V written again
        tokens, seq_lens, tables = _pad_rows(tokens, seq_lens, tables, n)
        meta, ids = _rows(self._meta, n), self._ids[:n]
        # one host-to-device copy per buffer, into the storage the graphs read
        meta.copy_(build_decode_metadata(seq_lens, tables, self.cache.block_size, ids.device, self.width,
                                         self.max_model_len))  # fmt: skip
        ids.copy_(torch.tensor(tokens, dtype=torch.int64), non_blocking=True)
        if n in self._graphs:
            graph, logits = self._graphs[n]
            graph.replay()
            return logits[:batch]
        if not self.capture:
            return self.model.decode_step(ids, meta, self.cache, self.backend)[0][:batch]
        # warm up on a side stream (as torch.cuda.graphs recommends), which is also this step's answer, then record
        dev = ids.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            logits = self.model.decode_step(ids, meta, self.cache, self.backend)[0]
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            recorded = self.model.decode_step(ids, meta, self.cache, self.backend)[0]  # recorded, not executed
        self._graphs[n] = (g, recorded)
        return logits[:batch]

    @property
    def num_graphs(self) -> int:
        """CUDA graphs recorded so far (0 unless capturing)."""
        return len(self._graphs)
