"""The Triton attention backend: the engine's paged attention through the kernels of ``kernels/``.

Same protocol as ``TorchAttentionBackend`` (``workbench.model.attention``): write the step's new K/V into the
cache with ``kv_write``, then attend with ``paged_decode_attention`` when every sequence decodes one token
(split-K over the context) or ``paged_prefill_attention`` otherwise (prefill, chunked prefill, prefix hits and
mixed prefill/decode batches). Runs on CUDA, or on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``
set before ``kernels`` is imported; slow, for tests).
"""

from __future__ import annotations

import torch

from workbench.model.attention import AttentionMetadata


class TritonAttentionBackend:
    """Paged attention with Triton kernels; ``num_splits`` fixes decode's split-K (None: a heuristic)."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        # imported here so that the workbench does not pay for (or require) triton until this backend is used
        from kernels.kv_write import kv_write
        from kernels.paged_decode import paged_decode_attention
        from kernels.paged_prefill import paged_prefill_attention

        self._kv_write = kv_write
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention
        self.num_splits = num_splits

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim), rotary applied
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), rotary applied
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), one layer
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """Write K/V for the step's tokens into their slots, then attend each query to its sequence's context."""
        self._kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:  # one query per sequence: token i of the batch is sequence i
            return self._decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens_t,
                scale=scale,
                num_splits=self.num_splits,
                max_seq_len=meta.max_seq_len,
            )
        return self._prefill(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens_t,
            meta.cu_seqlens_q,
            meta.max_query_len,
            scale=scale,
        )
