"""The analytical tables of notebook 02: KV bytes and sequences that fit per attention variant, and the memory a
contiguous per-slot cache wastes against paged blocks on a trace's lengths. Pure arithmetic over model shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.config import ModelConfig
from workbench.hardware import HardwareSpec
from workbench.kv.sizing import attention_variants, max_concurrent_sequences, paged_vs_contiguous


def capacity_by_variant(
    cfg: ModelConfig, hw: HardwareSpec, seq_len: int, kv_dtype: str = "bf16", dtype: str = "bf16"
) -> list[dict]:
    """Per variant of ``cfg`` (MHA, GQA when it has one, MQA): ``kind``, ``num_kv_heads``, ``bytes_per_token``,
    ``ratio_to_mha``, ``bytes_per_seq`` and ``max_seqs`` (sequences of ``seq_len`` tokens of ``kv_dtype`` KV that fit
    in ``hw``'s memory after the weights in ``dtype``), keyed by kind rather than by position."""
    rows = []
    for v in attention_variants(cfg, kv_dtype=kv_dtype):
        variant = cfg.with_overrides(num_kv_heads=v["num_kv_heads"])
        cap = max_concurrent_sequences(variant, hw.mem_capacity, seq_len, dtype=dtype, kv_dtype=kv_dtype)
        rows.append(
            {
                "kind": v["kind"],
                "num_kv_heads": v["num_kv_heads"],
                "bytes_per_token": v["bytes_per_token"],
                "ratio_to_mha": v["ratio_to_mha"],
                "bytes_per_seq": cap.bytes_per_seq,
                "max_seqs": cap.max_seqs,
            }
        )
    return rows


def waste_by_block_size(
    cfg: ModelConfig, lengths: Sequence[int], block_sizes: Sequence[int], max_len: int, kv_dtype: str = "bf16"
) -> list[dict[str, Any]]:
    """Per block size: the share of reserved KV memory holding no token, contiguous ``max_len`` slots against
    paged blocks, and the bytes each reserves, for sequences of ``lengths`` tokens."""
    rows = []
    for bs in block_sizes:
        cmp = paged_vs_contiguous(cfg, list(lengths), block_size=bs, max_len=max_len, kv_dtype=kv_dtype)
        rows.append(
            {
                "block_size": bs,
                "contiguous waste": cmp.contiguous_waste,
                "paged waste": cmp.paged_waste,
                "contiguous GiB": cmp.contiguous_bytes / 2**30,
                "paged GiB": cmp.paged_bytes / 2**30,
            }
        )
    return rows
