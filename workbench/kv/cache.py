"""The tensor side of the KV cache: one preallocated pool of blocks per layer.

Layout (the kernels' input, vLLM/flash-attention convention):

    k[layer], v[layer]: (num_blocks, block_size, num_kv_heads, head_dim)

A token at position p of a sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``;
``slot_mapping`` lists that slot for every new token of a step. Which blocks a sequence owns is decided by the
torch-free ``BlockManager``; this module only holds the memory.

The *contiguous* cache of a static-batching framework (gpt-fast, HF's static cache) is the same pool with
``block_size = max_len`` and one block per batch slot: sequence ``i`` owns block ``i`` and its tokens are a plain
slice ``k[layer][i, :len]``. ``ContiguousKVCache`` adds the per-slot lengths that ``Transformer.prefill`` and
``Transformer.decode`` need.
"""

from __future__ import annotations

import torch

from workbench.config import ModelConfig
from workbench.errors import ConfigError


class KVCache:
    """Preallocated K and V pools for all layers. Size follows the number of KV heads (MHA > GQA > MQA)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.num_layers = cfg.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.dtype = dtype
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, num_blocks, block_size, kv_heads, head_dim)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers: 2 * layers * kv_heads * head_dim * element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int | None = None) -> None:
        """The one writer of the pool: row ``t`` of ``k``/``v`` goes to slot ``slot_mapping[t]`` (int64, (T,)).

        With ``layer``, ``k`` and ``v`` are that layer's ``(T, kv_heads, head_dim)``; without, every layer's
        ``(layers, T, kv_heads, head_dim)`` at once (what the compiled decode step returns). Used by the prefill
        path, both attention backends and every decode mode; ``kernels.kv_write`` is the same op as a kernel.
        """
        rows = (self.num_kv_heads, self.head_dim)
        if layer is None:
            self.k.view(self.num_layers, -1, *rows).index_copy_(1, slot_mapping, k)
            self.v.view(self.num_layers, -1, *rows).index_copy_(1, slot_mapping, v)
        else:
            self.k[layer].view(-1, *rows).index_copy_(0, slot_mapping, k)
            self.v[layer].view(-1, *rows).index_copy_(0, slot_mapping, v)


class ContiguousKVCache(KVCache):
    """A static per-slot cache: ``max_batch`` slots of ``max_len`` tokens, with each slot's current length."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_len > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_len {max_len} exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})"
            )
        super().__init__(cfg, num_blocks=max_batch, block_size=max_len, dtype=dtype, device=device)
        self.max_batch = max_batch
        self.max_len = max_len
        self.lengths = [0] * max_batch  # tokens cached per slot

    def check_slots(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ConfigError(f"slots must be distinct, got {slots}")
        for s in slots:
            if not 0 <= s < self.max_batch:
                raise ConfigError(f"slot {s} out of range [0, {self.max_batch})")
