"""The Triton attention backend: the engine's paged attention through the kernels of ``kernels/``.

Same protocol as ``TorchAttentionBackend`` (``workbench.model.attention``): a ragged step (prefill, chunked
prefill, prefix hits, mixed prefill/decode batches) attends with ``paged_prefill_attention`` over K/V the model has
already written; a pure decode writes the new K/V first (``KVCache.write``: the kernel reads them from the pool),
then attends with ``paged_decode_attention`` (split-K over the context). An MLA pool (``KVCache.latent_dim``) decodes
with ``paged_mla_decode_attention`` and runs its ragged steps through the torch path (no MLA prefill kernel yet).
Runs on CUDA, or on the CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set before ``kernels`` is
imported; slow, for tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workbench.kv.cache import DequantView
from workbench.model.attention import TORCH_BACKEND, AttentionMetadata, DecodeMetadata

if TYPE_CHECKING:
    from workbench.kv.cache import KVCache


class TritonAttentionBackend:
    """Paged attention with Triton kernels; ``num_splits`` fixes decode's split-K (None: a heuristic)."""

    name = "triton"
    gathers = False
    decode_writes_cache = True

    def __init__(self, num_splits: int | None = None) -> None:
        # imported here so that the workbench does not pay for (or require) triton until this backend is used
        from workbench.kernels.paged_decode import paged_decode_attention, paged_mla_decode_attention
        from workbench.kernels.paged_prefill import paged_prefill_attention

        self._decode = paged_decode_attention
        self._decode_mla = paged_mla_decode_attention
        self._prefill = paged_prefill_attention
        self.num_splits = num_splits

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim), rotary applied
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), one layer, step's K/V written
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """Attend each query to its sequence's context (the kernel handles any mix of query lengths; it reads every
        key from the pool, so the step's ``k``/``v`` serve only the torch path).

        A quantized pool (``DequantView`` layers) attends through the torch path: the prefill kernel has no
        dequantizing variant (prefill reads each cached byte once per chunk and is compute-bound anyway)."""
        if isinstance(k_cache, DequantView) or v_cache.shape != k_cache.shape:  # quantized, or MLA's latent V
            return TORCH_BACKEND.forward(q, k_cache, v_cache, meta, scale, k, v)
        return self._prefill(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, meta.cu_seqlens_q, meta.max_query_len, scale=scale
        )

    def decode(
        self,
        layer: int,
        q: torch.Tensor,  # (B, num_heads, head_dim)
        k: torch.Tensor,  # (B, num_kv_heads, head_dim)
        v: torch.Tensor,
        cache: KVCache,
        meta: DecodeMetadata,
        scale: float,
    ) -> torch.Tensor:  # (B, num_heads, head_dim)
        """Write the new K/V at their slots, then one query per sequence over its whole paged context."""
        cache.write(meta.slot_mapping, k, v, layer=layer)
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        if cache.latent_dim is not None:  # MLA: one [latent, rope] entry per token, V its latent part
            return self._decode_mla(q, k_cache, meta.block_tables, meta.seq_lens, cache.latent_dim, scale,
                                    num_splits=self.num_splits, max_seq_len=meta.max_seq_len)  # fmt: skip
        scales = {}
        if cache.quantized:  # the dequantizing variant of the kernel: int8 with per-token scales, fp8 with one
            scales = {"k_scale": cache.k_scale[layer], "v_scale": cache.v_scale[layer]}
            if cache.kv_cache_dtype == "fp8":
                scales = {name: t.reshape(1) for name, t in scales.items()}
        return self._decode(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale=scale, num_splits=self.num_splits,
            max_seq_len=meta.max_seq_len, **scales,
        )  # fmt: skip
