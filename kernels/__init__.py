"""Triton kernels for attention over the paged KV cache, each beside a plain-PyTorch fp32 reference.

Ops (one file each):
    kv_write                 scatter a step's new K/V rows into the paged pool (``kernels.kv_write``)
    paged_decode_attention   one query per sequence, split-K over the context (``kernels.paged_decode``)
    paged_prefill_attention  ragged query chunks, causal over cached prefix + chunk (``kernels.paged_prefill``)
References of the same ops live in ``kernels.reference``; ``python -m kernels.bench`` measures them on a GPU.

The cache layout is the engine's (``workbench.kv.cache``): ``(num_blocks, block_size, num_kv_heads, head_dim)``
per layer, a token at position ``p`` in slot ``block_table[p // block_size] * block_size + p % block_size``.

This package is imported lazily: ``import kernels`` loads neither torch nor triton (transformers probes a
top-level ``kernels`` package for the unrelated HF "kernels" hub library; the probe must stay cheap and must
not find anything that looks like that library, so no ``__version__`` is defined here).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "kv_write": "kernels.kv_write",
    "paged_decode_attention": "kernels.paged_decode",
    "paged_prefill_attention": "kernels.paged_prefill",
    "kv_write_reference": "kernels.reference",
    "paged_decode_attention_reference": "kernels.reference",
    "paged_prefill_attention_reference": "kernels.reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


class _Package(types.ModuleType):
    """Keeps ``kernels.kv_write`` the function after the submodule of the same name is imported.

    Importing ``kernels.kv_write`` would otherwise bind the submodule over the package attribute; the module
    stays reachable through ``sys.modules`` and ``from kernels.kv_write import kv_write``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
