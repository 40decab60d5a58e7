"""Memory ledger: where the bytes of a serving engine go, and what a contiguous cache would have wasted.

- weights: ``ModelConfig.num_params() * bytes(dtype)``;
- KV per token: ``2 (K and V) * num_layers * num_kv_heads * head_dim * bytes(kv_dtype)``, so GQA and MQA
  shrink it by ``num_heads / num_kv_heads`` against MHA;
- the pool: ``num_blocks * block_size * kv_bytes_per_token``; blocks in use, free, and cached (prefix
  blocks kept for reuse, a subset of used + free);
- waste: a contiguous per-slot cache (a static cache, as HF's) reserves ``max_model_len`` positions per
  request however long it turns out, so it wastes ``max_model_len - tokens``; a paged cache only wastes the
  unused tail of each request's last block, ``ceil(tokens / block_size) * block_size - tokens`` (internal
  fragmentation; blocks reserved ahead for a prompt are not counted as waste here).

Plain Python; the tensors themselves live in ``workbench/kv/cache.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workbench.config import ModelConfig, ceil_div, dtype_bytes
from workbench.engine.sequence import Sequence
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager


def num_blocks_for_budget(model: ModelConfig, budget_bytes: int, block_size: int, kv_dtype: str = "bf16") -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``budget_bytes``."""
    if budget_bytes <= 0:
        raise ConfigError(f"KV memory budget must be > 0 bytes, got {budget_bytes}")
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    block_bytes = block_size * model.kv_bytes_per_token(kv_dtype)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"KV memory budget of {budget_bytes} bytes holds no block of {block_size} tokens ({block_bytes} bytes)"
        )
    return int(num_blocks)


@dataclass(frozen=True)
class CacheWaste:
    """Reserved and wasted KV positions of the same requests under a contiguous and a paged cache."""

    num_requests: int
    num_tokens: int  # positions actually holding K/V, summed over requests
    contiguous_reserved: int  # max_model_len per request
    paged_reserved: int  # whole blocks per request
    kv_bytes_per_token: int

    @property
    def contiguous_waste(self) -> int:
        return self.contiguous_reserved - self.num_tokens

    @property
    def paged_waste(self) -> int:
        return self.paged_reserved - self.num_tokens

    @property
    def contiguous_waste_fraction(self) -> float:
        return self.contiguous_waste / self.contiguous_reserved if self.contiguous_reserved else 0.0

    @property
    def paged_waste_fraction(self) -> float:
        return self.paged_waste / self.paged_reserved if self.paged_reserved else 0.0

    def as_dict(self) -> dict[str, Any]:
        b = self.kv_bytes_per_token
        return dict(
            asdict(self),
            contiguous_waste=self.contiguous_waste,
            paged_waste=self.paged_waste,
            contiguous_waste_bytes=self.contiguous_waste * b,
            paged_waste_bytes=self.paged_waste * b,
            contiguous_waste_fraction=self.contiguous_waste_fraction,
            paged_waste_fraction=self.paged_waste_fraction,
        )


def cache_waste(
    token_counts: list[int], max_model_len: int, block_size: int, kv_bytes_per_token: int = 1
) -> CacheWaste:
    """Compare caches for requests holding ``token_counts`` K/V positions each (each <= max_model_len)."""
    for n in token_counts:
        if n > max_model_len:
            raise ConfigError(f"a request holds {n} tokens, more than max_model_len ({max_model_len})")
    return CacheWaste(
        num_requests=len(token_counts),
        num_tokens=sum(token_counts),
        contiguous_reserved=max_model_len * len(token_counts),
        paged_reserved=sum(ceil_div(n, block_size) * block_size for n in token_counts),
        kv_bytes_per_token=kv_bytes_per_token,
    )


def kv_tokens_held(seq: Sequence) -> int:
    """K/V positions a sequence holds now (running) or held at its end (finished: all but the last token)."""
    if seq.is_finished:
        return max(seq.num_tokens - 1, 0) if seq.finish_reason != "rejected" else 0
    return seq.num_computed_tokens


@dataclass
class MemoryLedger:
    """Bytes of weights and of the KV pool of one engine, with the live block counts of its BlockManager."""

    model: ModelConfig
    block_manager: BlockManager
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    max_model_len: int | None = None

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes(self.weight_dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype)

    @property
    def block_bytes(self) -> int:
        return self.block_manager.block_size * self.kv_bytes_per_token

    @property
    def pool_bytes(self) -> int:
        return self.block_manager.num_blocks * self.block_bytes

    def waste(self, sequences: list[Sequence]) -> CacheWaste:
        """Contiguous-versus-paged waste for these sequences (needs ``max_model_len``)."""
        if self.max_model_len is None:
            raise ConfigError("MemoryLedger.max_model_len is needed to compare with a contiguous cache")
        counts = [kv_tokens_held(s) for s in sequences if s.finish_reason != "rejected"]
        return cache_waste(counts, self.max_model_len, self.block_manager.block_size, self.kv_bytes_per_token)

    def snapshot(self, sequences: list[Sequence] | None = None) -> dict[str, Any]:
        """A flat dict of the ledger now; with ``sequences``, also the contiguous-versus-paged waste."""
        bm = self.block_manager
        out: dict[str, Any] = {
            "model": self.model.name,
            "attention": self.model.attention_kind,
            "weight_dtype": self.weight_dtype,
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
            out["waste"] = self.waste(sequences).as_dict()
        return out


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "bf16") -> int:
    """``2 * num_layers * num_kv_heads * head_dim * bytes(kv_dtype)`` (K and V, all layers)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes(kv_dtype)
