"""ModelRunner: the only place that turns a ``StepPlan`` into tensors, runs the model and samples.

For each scheduled chunk (a prefill chunk of n tokens or one decode token) it lays the chunk's tokens into one flat
batch, computes positions and cache slots from the sequence's block table, runs ``Transformer.forward`` once for the
whole mixed step, and samples a token for every chunk that ends at its sequence's last token.
"""

from __future__ import annotations

import time

import torch

from workbench.device import synchronize
from workbench.engine.compiled_decode import CompiledDecode
from workbench.engine.decode_graphs import DecodeGraphs
from workbench.engine.sampler import Sampler
from workbench.engine.scheduler import StepPlan
from workbench.kv.cache import KVCache
from workbench.model.attention import AttentionMetadata, build_metadata
from workbench.model.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.sampler = Sampler()
        # when set, each execute() records the model's share of it (forward + LM head, synchronised) in
        # last_model_s: what is left of a step's time is engine overhead (scheduling, tensors, sampling)
        self.time_model = False
        self.last_model_s = 0.0
        self.decode_graphs: DecodeGraphs | None = None  # static-shape decode (CUDA graphs on a GPU)
        self.compiled_decode: CompiledDecode | None = None  # torch.compile'd decode (EngineConfig.compile_decode)

    def setup_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool | None = None) -> None:
        """Serve pure-decode steps of up to ``max_batch`` sequences through ``DecodeGraphs``.

        ``capture`` (default: on CUDA) records CUDA graphs; ``False`` runs the same static-shape path eagerly.
        """
        capture = self.model.device.type == "cuda" if capture is None else capture
        self.decode_graphs = DecodeGraphs(self.model, self.cache, max_batch, max_model_len, capture)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionMetadata]:
        """Flat input ids (num_tokens,) and the step's attention metadata."""
        ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_new_tokens
            ids.extend(seq.token_slice(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
        meta = build_metadata(query_lens, seq_lens, tables, self.cache.block_size, self.model.device)
        return torch.tensor(ids, dtype=torch.long, device=self.model.device), meta

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run one step; returns the sampled token of every chunk that samples, by sequence id."""
        if plan.is_empty:
            return {}
        if all(c.num_new_tokens == 1 and c.samples for c in plan.chunks):  # a pure decode: a static path?
            for static in (self.compiled_decode, self.decode_graphs):
                if static is not None and static.supports(len(plan.chunks)):
                    return self._execute_static_decode(plan, static)
        input_ids, meta = self.prepare(plan)
        if self.time_model:
            synchronize(self.model.device)
            t0 = time.perf_counter()
        hidden = self.model.forward(input_ids, meta, self.cache)  # (num_tokens, hidden)
        rows = [i for i, c in enumerate(plan.chunks) if c.samples]
        if not rows:
            if self.time_model:
                synchronize(self.model.device)
                self.last_model_s = time.perf_counter() - t0
            return {}
        last = meta.last_token_indices[rows] if len(rows) < len(plan.chunks) else meta.last_token_indices
        logits = self.model.compute_logits(hidden[last])  # (num_sampling, vocab), fp32
        if self.time_model:
            synchronize(self.model.device)
            self.last_model_s = time.perf_counter() - t0
        seqs = [plan.chunks[i].seq for i in rows]
        tokens = self.sampler(logits, [s.sampling for s in seqs], [s.seq_id for s in seqs])
        return {s.seq_id: t for s, t in zip(seqs, tokens)}

    def _execute_static_decode(self, plan: StepPlan, graphs: DecodeGraphs | CompiledDecode) -> dict[int, int]:
        """A pure-decode step (every chunk one token, every chunk samples) through CUDA graphs or the compiled
        step: both take the tokens, sequence lengths and block tables, write the cache and return the logits."""
        tokens, seq_lens, tables = [], [], []
        for chunk in plan.chunks:
            seq, start = chunk.seq, chunk.start
            tokens.append(seq.token_at(start))
            seq_lens.append(start + 1)
            tables.append(seq.block_table)
        if self.time_model:
            synchronize(self.model.device)
            t0 = time.perf_counter()
        logits = graphs.run(tokens, seq_lens, tables)  # (num_seqs, vocab) fp32
        if self.time_model:
            synchronize(self.model.device)
            self.last_model_s = time.perf_counter() - t0
        seqs = [c.seq for c in plan.chunks]
        sampled = self.sampler(logits, [s.sampling for s in seqs], [s.seq_id for s in seqs])
        return {s.seq_id: t for s, t in zip(seqs, sampled)}

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)
