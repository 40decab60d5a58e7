"""Triton kernels for attention over the paged KV cache, each beside a plain-PyTorch fp32 reference.

Ops (one file each):
    kv_write                 scatter a step's new K/V rows into the paged pool (``kernels.kv_write``)
    paged_decode_attention   one query per sequence, split-K over the context (``kernels.paged_decode``)
    paged_prefill_attention  ragged query chunks, causal over cached prefix + chunk (``kernels.paged_prefill``)
References of the same ops live in ``kernels.reference``; ``python -m kernels.bench`` measures them on a GPU.
Import an op from its file (``from kernels.paged_decode import paged_decode_attention``).

The cache layout is the engine's (``workbench.kv.cache``): ``(num_blocks, block_size, num_kv_heads, head_dim)``
per layer, a token at position ``p`` in slot ``block_table[p // block_size] * block_size + p % block_size``.

``import kernels`` loads neither torch nor triton: transformers probes a top-level ``kernels`` package for the
unrelated HF "kernels" hub library; the probe must stay cheap and must not find anything that looks like that
library, so this file defines nothing (no ``__version__``).
"""
