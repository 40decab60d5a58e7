"""Memory ledger: where the bytes of a serving engine go (weights, KV per token, the pool; blocks in use, free and
cached for prefix reuse), and what a contiguous per-slot cache would have wasted where a paged one wastes only the
tail of each request's last block (``workbench.kv.sizing.paged_vs_contiguous``). Plain Python; the tensors live in
``workbench/kv/cache.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.config import DEFAULT_GROUP_SIZE, ModelConfig
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.kv.sizing import paged_vs_contiguous
from workbench.request import Sequence


@dataclass
class MemoryLedger:
    """Bytes of weights and of the KV pool of one engine, with the live block counts of its BlockManager."""

    model: ModelConfig
    block_manager: BlockManager
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    max_model_len: int | None = None
    quantization: str | None = None
    group_size: int = DEFAULT_GROUP_SIZE

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes(self.weight_dtype, self.quantization, self.group_size)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype)

    @property
    def block_bytes(self) -> int:
        return self.block_manager.block_size * self.kv_bytes_per_token

    @property
    def pool_bytes(self) -> int:
        return self.block_manager.num_blocks * self.block_bytes

    def snapshot(self, sequences: list[Sequence] | None = None) -> dict[str, Any]:
        """A flat dict of the ledger now; with ``sequences``, also the contiguous-versus-paged waste of the K/V they
        hold (needs ``max_model_len``)."""
        bm = self.block_manager
        out: dict[str, Any] = {
            "model": self.model.name,
            "attention": self.model.attention_kind,
            "weight_dtype": self.weight_dtype,
            "quantization": self.quantization,
            "kv_dtype": self.kv_dtype,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": bm.block_size,
            "num_blocks": bm.num_blocks,
            "block_bytes": self.block_bytes,
            "pool_bytes": self.pool_bytes,
            "total_bytes": self.weight_bytes + self.pool_bytes,
            "blocks_used": bm.num_used_blocks,
            "blocks_free": bm.num_free_blocks,
            "blocks_cached": bm.num_cached_blocks,
            "blocks_evictable": bm.num_evictable_blocks,
            "used_kv_bytes": bm.num_used_blocks * self.block_bytes,
            "prefix_hit_tokens": bm.num_hit_tokens,
        }
        if sequences is not None:
            if self.max_model_len is None:
                raise ConfigError("MemoryLedger.max_model_len is needed to compare with a contiguous cache")
            # K/V positions each holds now (running) or held at its end (finished: all but the last token)
            counts = [
                max(s.num_tokens - 1, 0) if s.is_finished else s.num_computed_tokens
                for s in sequences
                if s.finish_reason != "rejected"
            ]
            waste = paged_vs_contiguous(self.model, counts, bm.block_size, self.max_model_len, self.kv_dtype)
            out["waste"] = waste.to_dict()
        return out
