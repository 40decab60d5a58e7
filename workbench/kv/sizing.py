"""KV-cache calculator, in pure Python: bytes per token of a model and of its MHA, GQA and MQA counterparts
(``attention_variants``), the one KV-pool planner (``plan_num_blocks``, through which the engine, the simulator and
``max_concurrent_sequences`` size their pools), how many sequences fit in a memory budget, and the memory of a set
of requests under a contiguous (per-slot maximum length) versus a paged cache (``paged_vs_contiguous``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workbench.config import ModelConfig, ceil_div, dtype_bytes
from workbench.errors import ConfigError


def _default_gqa_kv_heads(num_heads: int) -> int | None:
    """A GQA counterpart for a model that is not GQA: 8 KV heads (the Llama-2/3 choice) when that is a proper
    grouping, else the largest proper divisor of num_heads that is above 1; None if there is none."""
    if num_heads % 8 == 0 and 1 < 8 < num_heads:
        return 8
    divisors = [d for d in range(2, num_heads) if num_heads % d == 0]
    return max(divisors) if divisors else None


def attention_variants(
    cfg: ModelConfig, kv_dtype: str = "bf16", gqa_kv_heads: int | None = None
) -> list[dict[str, Any]]:
    """KV bytes per token of the model's MHA, GQA and MQA counterparts (rows: kind, num_kv_heads,
    bytes_per_token, ratio_to_mha, is_model). The GQA row uses the model's own KV heads when it is GQA, else
    ``gqa_kv_heads`` (default 8 where that divides the heads); it is omitted when no grouping exists. An MLA model's
    own row (kind 'MLA', one latent + rope entry per token and layer) comes last; its counterparts cache K
    (``qk_nope + qk_rope``) and V (``v_head_dim``) per KV head."""
    nh = cfg.num_heads
    if gqa_kv_heads is None:
        gqa_kv_heads = cfg.num_kv_heads if cfg.attention_kind == "GQA" else _default_gqa_kv_heads(nh)
    elif not cfg.is_mla and not (1 < gqa_kv_heads < nh and nh % gqa_kv_heads == 0):
        raise ConfigError(
            f"gqa_kv_heads must divide num_heads ({nh}) and lie strictly between 1 and it, got {gqa_kv_heads}"
        )

    def per_token(kv_heads: int) -> int:
        if cfg.is_mla:
            return cfg.num_layers * kv_heads * (cfg.head_dim + cfg.v_head_dim) * dtype_bytes(kv_dtype)
        return cfg.with_overrides(num_kv_heads=kv_heads).kv_bytes_per_token(kv_dtype)

    kinds = (("MHA", nh), ("GQA", gqa_kv_heads), ("MQA", 1))
    sizes = [(kind, h, per_token(h)) for kind, h in kinds if h is not None]
    if cfg.is_mla:
        sizes.append(("MLA", None, cfg.kv_bytes_per_token(kv_dtype)))
    mha = sizes[0][2]
    return [
        {
            "kind": kind,
            "num_kv_heads": h,
            "bytes_per_token": b,
            "ratio_to_mha": b / mha,
            "is_model": kind == "MLA" if cfg.is_mla else h == cfg.num_kv_heads,
        }
        for kind, h, b in sizes
    ]


def plan_num_blocks(
    model: ModelConfig,
    block_size: int,
    kv_dtype: str,
    budget_bytes: float,
    wanted_tokens: int | None = None,
) -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``budget_bytes``: ``budget // (block_size *
    kv_bytes_per_token)``, at most the blocks ``wanted_tokens`` need when given. Raises ``ConfigError`` when not
    even one block fits."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    block_bytes = block_size * model.kv_bytes_per_token(kv_dtype)
    num_blocks = int(max(0.0, budget_bytes) // block_bytes)
    if num_blocks < 1:
        raise ConfigError(
            f"a KV memory budget of {int(budget_bytes)} bytes holds no block of {block_size} tokens "
            f"({block_bytes} bytes)"
        )
    return num_blocks if wanted_tokens is None else min(num_blocks, ceil_div(wanted_tokens, block_size))


@dataclass(frozen=True)
class CapacityResult:
    """How many sequences of ``seq_len`` tokens fit in ``memory_bytes``."""

    max_seqs: int
    memory_bytes: float
    weight_bytes: float
    reserve_bytes: float
    kv_budget_bytes: float
    bytes_per_seq: float
    seq_len: int
    block_size: int | None


def max_concurrent_sequences(
    cfg: ModelConfig,
    memory_bytes: float,
    seq_len: int,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    block_size: int | None = None,
    reserve_bytes: float = 0.0,
) -> CapacityResult:
    """Largest number of sequences of ``seq_len`` tokens whose KV cache fits after the weights.

    ``kv_budget = memory_bytes - weight_bytes(dtype) - reserve_bytes``; each sequence needs ``seq_len`` tokens
    of KV (contiguous), or ``ceil(seq_len / block_size)`` whole blocks when ``block_size`` is given (paged).
    Zero when the weights alone do not fit.
    """
    if seq_len < 1:
        raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
    if block_size is not None and block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    if memory_bytes <= 0 or reserve_bytes < 0:
        raise ConfigError(f"memory_bytes must be > 0 and reserve_bytes >= 0, got {memory_bytes}, {reserve_bytes}")
    weights = cfg.weight_bytes(dtype)
    budget = memory_bytes - weights - reserve_bytes
    tokens = seq_len if block_size is None else ceil_div(seq_len, block_size) * block_size
    per_seq = tokens * cfg.kv_bytes_per_token(kv_dtype or dtype)
    try:  # a sequence's whole reservation as one "block": how many fit is the pool planner's answer
        max_seqs = plan_num_blocks(cfg, tokens, kv_dtype or dtype, budget)
    except ConfigError:
        max_seqs = 0
    return CapacityResult(
        max_seqs=max_seqs,
        memory_bytes=float(memory_bytes),
        weight_bytes=float(weights),
        reserve_bytes=float(reserve_bytes),
        kv_budget_bytes=float(max(0.0, budget)),
        bytes_per_seq=float(per_seq),
        seq_len=seq_len,
        block_size=block_size,
    )


@dataclass(frozen=True)
class PagingComparison:
    """Memory of a set of requests under a contiguous (per-slot max length) and a paged cache."""

    num_requests: int
    used_tokens: int  # sum of lengths: what the sequences actually hold
    contiguous_tokens: int  # num_requests * max_len
    paged_tokens: int  # sum of ceil(len / block_size) * block_size
    bytes_per_token: int
    block_size: int
    max_len: int

    @property
    def used_bytes(self) -> int:
        return self.used_tokens * self.bytes_per_token

    @property
    def contiguous_bytes(self) -> int:
        return self.contiguous_tokens * self.bytes_per_token

    @property
    def paged_bytes(self) -> int:
        return self.paged_tokens * self.bytes_per_token

    @property
    def contiguous_waste(self) -> float:
        """Fraction of the contiguous cache that holds no token."""
        return 1.0 - self.used_tokens / self.contiguous_tokens if self.contiguous_tokens else 0.0

    @property
    def paged_waste(self) -> float:
        """Fraction of the paged cache that holds no token (the tails of last blocks)."""
        return 1.0 - self.used_tokens / self.paged_tokens if self.paged_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.update(
            used_bytes=self.used_bytes,
            contiguous_bytes=self.contiguous_bytes,
            paged_bytes=self.paged_bytes,
            contiguous_waste=self.contiguous_waste,
            paged_waste=self.paged_waste,
        )
        return out


def paged_vs_contiguous(
    cfg: ModelConfig,
    request_lengths: Sequence[int],
    block_size: int = 16,
    max_len: int | None = None,
    kv_dtype: str = "bf16",
) -> PagingComparison:
    """KV memory of ``request_lengths`` (tokens held per request, prompt plus output) when each slot of a
    contiguous cache reserves ``max_len`` tokens (default: the longest request) versus a paged cache of
    ``block_size``-token blocks."""
    lengths = [int(n) for n in request_lengths]
    if any(n < 0 for n in lengths):
        raise ConfigError("request lengths must be >= 0")
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    longest = max(lengths, default=0)
    if max_len is None:
        max_len = longest
    elif max_len < longest:
        raise ConfigError(f"max_len ({max_len}) is shorter than the longest request ({longest})")
    return PagingComparison(
        num_requests=len(lengths),
        used_tokens=sum(lengths),
        contiguous_tokens=len(lengths) * max_len,
        paged_tokens=sum(ceil_div(n, block_size) * block_size for n in lengths),
        bytes_per_token=cfg.kv_bytes_per_token(kv_dtype),
        block_size=block_size,
        max_len=max_len,
    )
