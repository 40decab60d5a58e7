"""Decode steps with static shapes, one per batch size, replayed as CUDA graphs on a GPU.

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels, each a few microseconds of
work. A CUDA graph records a step's kernels once and replays them with one launch. Recording needs every shape
and every pointer fixed, so for each batch size ``B`` this module keeps static input buffers (token ids,
positions, cache slots, block tables padded to the longest sequence the engine allows, sequence lengths, the key
mask) and static metadata that claims the longest length: attention then reads every sequence's block table up
to ``max_blocks`` blocks and masks keys at or beyond the sequence's true length (``seq_lens_t``), the same
arithmetic as the eager path for the keys that count.

Graphs are captured lazily, at the first decode step of each batch size: that step runs eagerly on the static
buffers (which also warms up the kernels), then the graph is recorded (recording executes nothing, so the cache is
not touched) and used from the next step of that size. On the CPU the same static path can run eagerly
(``capture=False``), which is how the tests check it against the eager engine and HF transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.config import ceil_div
from workbench.kv.cache import KVCache
from workbench.model.attention import AttentionMetadata, pad_block_tables, slot_of
from workbench.model.transformer import Transformer

MAX_GATHER_TOKENS = 1 << 16  # torch backend: most (sequence, key) slots a static step may gather per layer


@dataclass
class _StaticStep:
    """The buffers of one batch size, and its graph once recorded."""

    input_ids: torch.Tensor  # (B,) int64
    meta: AttentionMetadata  # tensors below are its fields; Python fields claim the longest length
    key_pos: torch.Tensor  # (max_blocks * block_size,) int64
    logits: torch.Tensor | None = None  # (B, vocab) fp32, written by the graph
    graph: torch.cuda.CUDAGraph | None = None
    steps: int = 0


class DecodeGraphs:
    """Static-shape decode for batch sizes ``1 .. max_batch``; CUDA graphs when ``capture`` (CUDA only)."""

    def __init__(self, model: Transformer, cache: KVCache, max_batch: int, max_model_len: int, capture: bool) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.cache = model, cache
        self.max_batch = max_batch
        self.block_size = cache.block_size
        self.max_blocks = ceil_div(max_model_len, self.block_size)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._static: dict[int, _StaticStep] = {}

    def supports(self, batch: int) -> bool:
        """Whether a decode of ``batch`` sequences takes the static path. The torch backend gathers every
        sequence's K/V up to the longest length, so it is kept to ``MAX_GATHER_TOKENS`` (eager beyond); the
        Triton kernels read only each sequence's own length, so any batch up to ``max_batch`` qualifies."""
        if not 1 <= batch <= self.max_batch:
            return False
        return self.model.attn_backend.name != "torch" or batch * self.max_blocks * self.block_size <= MAX_GATHER_TOKENS

    def _buffers(self, batch: int) -> _StaticStep:
        st = self._static.get(batch)
        if st is not None:
            return st
        dev, nb, bs = self.model.device, self.max_blocks, self.block_size
        block_tables = torch.zeros(batch, nb, dtype=torch.int32, device=dev)  # (B, max_blocks)
        seq_lens_t = torch.ones(batch, dtype=torch.int32, device=dev)  # (B,)
        longest = nb * bs
        meta = AttentionMetadata(
            query_lens=[1] * batch,
            seq_lens=[longest] * batch,  # what Python-side code sizes by: the longest, so shapes never change
            block_size=bs,
            block_tables_list=[[0] * nb for _ in range(batch)],
            positions=torch.zeros(batch, dtype=torch.int64, device=dev),
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            seq_lens_t=seq_lens_t,
            block_tables=block_tables,
            batch_gather=(
                torch.zeros(batch, nb, dtype=torch.int64, device=dev),  # (B, max_blocks) block ids
                torch.zeros(batch, 1, 1, longest, dtype=torch.bool, device=dev),  # (B, 1, 1, max_len) key mask
            ),
        )
        key_pos = torch.arange(longest, device=dev)
        st = self._static[batch] = _StaticStep(torch.zeros(batch, dtype=torch.int64, device=dev), meta, key_pos)
        return st

    def _forward(self, st: _StaticStep) -> torch.Tensor:
        hidden = self.model.forward(st.input_ids, st.meta, self.cache)  # (B, hidden)
        return self.model.compute_logits(hidden)  # (B, vocab)

    @torch.inference_mode()
    def run(self, tokens: list[int], seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step: ``tokens[i]`` at position ``seq_lens[i] - 1`` of a sequence with block table
        ``tables[i]``; returns next-token logits (B, vocab) fp32 (a static buffer when graphs are used)."""
        batch, bs = len(tokens), self.block_size
        st = self._buffers(batch)
        positions = [n - 1 for n in seq_lens]
        slots = [slot_of(t, p, bs) for t, p in zip(tables, positions)]
        padded = pad_block_tables(tables, self.max_blocks)
        meta, dev = st.meta, self.model.device
        # one host-to-device copy per buffer, into the same storage the graph reads
        st.input_ids.copy_(torch.tensor(tokens, dtype=torch.int64), non_blocking=True)
        meta.positions.copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        meta.slot_mapping.copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        meta.seq_lens_t.copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        meta.block_tables.copy_(torch.tensor(padded, dtype=torch.int32), non_blocking=True)
        ids, mask = meta.batch_gather
        ids.copy_(meta.block_tables)
        torch.lt(st.key_pos[None, :], meta.seq_lens_t[:, None], out=mask.view(batch, -1))
        if st.graph is not None:
            st.graph.replay()
            return st.logits
        st.steps += 1
        if not self.capture:
            return self._forward(st)  # eager on the static buffers
        # warm up on a side stream (as torch.cuda.graphs recommends), which is also this step's answer, then record
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            logits = self._forward(st)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            st.logits = self._forward(st)  # recorded, not executed
        st.graph = graph
        return logits
