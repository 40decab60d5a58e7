"""The CPU paged attention backend: decode reads K/V where the pool holds them (``kernels.paged_decode_cpu``).

Same protocol as ``TorchAttentionBackend`` (``workbench.model.attention``). A pure decode calls the C++ op over
the block tables, with the step's new K/V (as the pool will hold them, ``KVCache.round_trip``) as each row's last
key: no gather, no concatenation, no dequantized copy of an int8 or fp8 pool, GQA without expanded K/V. Like the
torch backend it only reads the pool during the step, so the same function runs eagerly and compiled, and the
step's new K/V are written once afterwards by ``KVCache.write`` (``decode_writes_cache = False``). A ragged step
(prefill, chunks, mixed batches) attends through the torch backend's SDPA path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workbench.errors import ConfigError
from workbench.model.attention import TORCH_BACKEND, AttentionBackend, AttentionMetadata, DecodeMetadata

if TYPE_CHECKING:
    from workbench.kv.cache import KVCache


class CpuAttentionBackend:
    """Paged decode with the C++ op of ``kernels.paged_decode_cpu`` (``isa``: its code path, default the best)."""

    name = "cpu"
    gathers = False
    decode_writes_cache = False

    def __init__(self, isa: str | None = None) -> None:
        from kernels.paged_decode_cpu import available, build_error, default_isa, paged_decode_cpu_op

        if not available():
            raise ConfigError(f"attention_backend 'cpu' needs the C++ decode op, which did not build here "
                              f"({build_error()}); use attention_backend 'torch'")  # fmt: skip

        self._decode = paged_decode_cpu_op
        self.isa = default_isa() if isa is None else isa

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return TORCH_BACKEND.forward(q, k_cache, v_cache, meta, scale)

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
        """Row ``b`` attends to its ``positions[b]`` cached keys through its block table, then to its new key. An
        MLA pool (V a narrower view of the latent entry, ``model.mla``) takes the torch path: the op reads V rows of
        K's width."""
        if v.shape[-1] != k.shape[-1]:
            return TORCH_BACKEND.decode(layer, q, k, v, cache, meta, scale)
        k, v = cache.round_trip(layer, k, v)
        k_scale, v_scale = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else (None, None)
        return self._decode(
            q, cache.k[layer], cache.v[layer], meta.block_tables, meta.positions, scale, k_scale, v_scale, k, v,
            self.isa,
        )  # fmt: skip


_DEFAULT: dict[str, object] = {}


def default_backend(device_type: str) -> AttentionBackend:
    """What attends when nobody chooses: on the CPU the paged decode above when its op builds here, else (CUDA, or
    no compiler) ``TORCH_BACKEND``. One instance per process (the backends are stateless)."""
    if device_type != "cpu":
        return TORCH_BACKEND
    if "cpu" not in _DEFAULT:
        from kernels.paged_decode_cpu import available

        _DEFAULT["cpu"] = CpuAttentionBackend() if available() else TORCH_BACKEND
    return _DEFAULT["cpu"]  # type: ignore[return-value]
