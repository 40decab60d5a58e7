"""Pure-decode steps through ``torch.compile``: one graph per batch size, with the context length dynamic.

Why (measured with per-segment timers and ``torch.profiler`` on ``bench-300m``, fp32, 2 CPU threads): a batch-1
decode step is ~100 matrix-vector products, which stream the weights at the bandwidth a plain ``nn.Linear``
reaches, and ~20 small eager operations per layer between them (norms, rotary, attention, residual adds, SiLU).
Each small operation that runs right after a weight stream finds its code and data evicted from the caches and
costs 10-60 us instead of 2-5 us, so the eager step spent ~10 of its ~57 ms between the products. Compiled by
inductor with its C++ wrapper, the step is one call into generated C++: the glue of a layer fuses into a few
loops, the products go to the same BLAS, and no Python runs between them.

The compiled function is ``Transformer.decode_gathered``, which reads the KV pool and writes nothing (inductor
would copy the whole pool for a write into a view of it); this class lays out the step's inputs, calls it, and
writes the new K/V at the tokens' slots with one ``index_copy_`` for K and one for V. The number of cached keys
``C`` is padded to a multiple of ``KEY_PAD`` and marked dynamic, so one compilation per batch size serves every
context length. Compilation happens at the first decode step of each batch size (~35 s for ``bench-300m`` on two
cores, a few seconds for the tiny presets; inductor caches the result on disk for later processes).
"""

from __future__ import annotations

import torch

from workbench.config import ceil_div
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model.attention import pad_block_tables, slot_of
from workbench.model.transformer import Transformer

KEY_PAD = 16  # cached-key columns are padded to a multiple of this (so C is never 1, which dynamo specialises)
MAX_BATCH_SIZES = 8  # distinct batch sizes compiled per engine; other pure-decode steps run eagerly


class CompiledDecode:
    """Pure-decode steps of ``1 .. max_batch`` sequences through one compiled graph per batch size."""

    def __init__(self, model: Transformer, cache: KVCache, max_batch: int) -> None:
        if model.device.type == "cuda":
            raise ConfigError("compile_decode is for the CPU: on CUDA, decode steps replay CUDA graphs")
        import torch._dynamo

        self.model, self.cache, self.max_batch = model, cache, max_batch
        # every batch size (and every model in a process) is a recompilation of the same code object
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._fn = torch.compile(model.decode_gathered, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
        self.batch_sizes: set[int] = set()  # compiled so far

    def supports(self, batch: int) -> bool:
        if not 1 <= batch <= self.max_batch:
            return False
        return batch in self.batch_sizes or len(self.batch_sizes) < MAX_BATCH_SIZES

    @torch.inference_mode()
    def run(self, tokens: list[int], seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step: ``tokens[i]`` at position ``seq_lens[i] - 1`` of a sequence with block table
        ``tables[i]``; writes the new K/V into the cache and returns next-token logits (B, vocab) fp32."""
        batch, bs, dev = len(tokens), self.cache.block_size, self.model.device
        cached = [n - 1 for n in seq_lens]  # keys already in the cache = the new token's position
        width = KEY_PAD * ceil_div(max(max(cached), 1), KEY_PAD)  # C, padded
        table = torch.tensor(pad_block_tables(tables, ceil_div(width, bs)), device=dev)  # (B, blocks) int64
        pos = torch.tensor(cached, device=dev)  # (B,) int64
        j = torch.arange(width, device=dev)
        key_slots = table[:, j // bs] * bs + j % bs  # (B, C); past a sequence's length: some block's slot, masked
        key_mask = torch.ones(batch, 1, 1, width + 1, dtype=torch.bool, device=dev)
        torch.lt(j[None, :], pos[:, None], out=key_mask[:, 0, 0, :width])  # the last column (new key) stays True
        torch._dynamo.mark_dynamic(key_slots, 1)
        torch._dynamo.mark_dynamic(key_mask, 3)
        ids = torch.tensor(tokens, device=dev)
        logits, k_new, v_new = self._fn(ids, pos, key_slots, key_mask, self.cache.k, self.cache.v)
        self.batch_sizes.add(batch)
        new_slots = torch.tensor([slot_of(t, p, bs) for t, p in zip(tables, cached)], device=dev)
        n_layers, kv_heads, head_dim = self.cache.num_layers, self.cache.num_kv_heads, self.cache.head_dim
        self.cache.k.view(n_layers, -1, kv_heads, head_dim).index_copy_(1, new_slots, k_new)
        self.cache.v.view(n_layers, -1, kv_heads, head_dim).index_copy_(1, new_slots, v_new)
        return logits
