"""The tensor side of the KV cache: one preallocated pool of blocks per layer.

Layout (the kernels' input, vLLM/flash-attention convention):

    k[layer], v[layer]: (num_blocks, block_size, num_kv_heads, head_dim)

``slot_mapping`` lists the slot of every new token of a step (``block_table[p // block_size] * block_size +
p % block_size`` for position ``p``); which blocks a sequence owns is decided by the torch-free ``BlockManager``.

Multi-head latent attention (``workbench.model.mla``) stores one entry per token and layer, ``[latent, rotary key]``,
as a single "KV head" of ``k``; ``v`` is a view of its first ``kv_lora_rank`` values, so ``write`` stores K only.

The *contiguous* cache of a static-batching framework (gpt-fast, HF's static cache) is the same pool with
``block_size = max_len`` and one block per batch slot; ``ContiguousKVCache`` adds the per-slot lengths.
"""

from __future__ import annotations

import torch

from workbench.config import ModelConfig, check_positive_ints, resolve_kv_cache_dtype
from workbench.errors import ConfigError

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., head_dim) float -> (q int8 (..., head_dim), scale fp32 (...)): one symmetric scale per token and head,
    ``scale = max |x| / 127`` over the head's values (an all-zero head gets scale 1, q 0)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return torch.round(xf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_kv_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn of ``x / scale``, saturated at +-448 (a value beyond the range is clipped, not inf)."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes (uint8): CPU indexing and ``index_copy_`` have no float8 kernels; others as given."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _unbits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if dtype == torch.float8_e4m3fn else t


class DequantView:
    """One layer of a quantized pool that indexes like the plain ``(num_blocks, block_size, kv_heads, head_dim)``
    tensor: ``view[idx]`` dequantizes only the rows it selects, into the activation dtype."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, per_token: bool) -> None:
        self.data, self.scale, self.dtype, self.per_token = data, scale, dtype, per_token
        self.shape = data.shape

    def __getitem__(self, idx: object) -> torch.Tensor:
        rows = _unbits(as_bits(self.data)[idx], self.data.dtype).float()
        scale = self.scale[idx][..., None] if self.per_token else self.scale
        return (rows * scale).to(self.dtype)


class KVCache:
    """Preallocated K and V pools for all layers. Size follows the number of KV heads (MHA > GQA > MQA)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str | None = "auto",
    ) -> None:
        self.num_layers = cfg.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        check_positive_ints(self, ("num_blocks", "block_size"))
        self.num_kv_heads, self.head_dim = cfg.cache_entry  # MLA: (1, kv_lora_rank + qk_rope_head_dim)
        self.latent_dim = cfg.kv_lora_rank if cfg.is_mla else None  # MLA: V is k[..., :latent_dim]
        self.dtype = dtype  # what attention reads: the activation dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, str(dtype))  # what the pool stores
        self.bytes_per_token = cfg.kv_bytes_per_token(self.kv_cache_dtype)  # K and V of one token, all layers
        self.quantized = self.kv_cache_dtype in ("int8", "fp8")
        if self.quantized and cfg.is_mla:
            raise ConfigError(f"{cfg.name}: a quantized KV cache of an MLA model is not implemented; use auto")
        storage = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(self.kv_cache_dtype, dtype)
        shape = (cfg.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=storage, device=device)  # (L, num_blocks, block_size, kv_heads, head_dim)
        self.v = self.k[..., : self.latent_dim] if cfg.is_mla else torch.zeros(shape, dtype=storage, device=device)
        # int8: one fp32 scale per (token, KV head), (L, num_blocks, block_size, kv_heads); fp8: one per layer, (L,),
        # 1.0 as in vLLM when a checkpoint brings no calibrated scales (the values are saturated at +-448)
        scale_shape = {"int8": shape[:-1], "fp8": shape[:1]}.get(self.kv_cache_dtype)
        self.k_scale = None if scale_shape is None else torch.ones(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = None if self.k_scale is None else torch.ones_like(self.k_scale)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int | None = None) -> None:
        """The one writer of the pool: row ``t`` of ``k``/``v`` goes to slot ``slot_mapping[t]`` (int64, (T,)).

        With ``layer``, ``k`` and ``v`` are that layer's ``(T, kv_heads, head_dim)``; without, every layer's
        ``(layers, T, kv_heads, head_dim)`` at once (what the compiled decode step returns). Used by the prefill
        path, both attention backends and every decode mode; ``workbench.kernels.kv_write`` is the same op as a kernel.
        A quantized pool quantizes here: int8 with a scale per token and head (written beside the values), fp8
        with the layer's scale.
        """
        rows = (self.num_kv_heads, self.head_dim)
        dim = 1 if layer is None else 0  # the slot dimension of flat(...)

        def flat(pool: torch.Tensor, *row: int) -> torch.Tensor:  # (layers, slots, *row), or (slots, *row) of layer
            return pool.view(self.num_layers, -1, *row) if layer is None else pool[layer].view(-1, *row)

        if self.latent_dim is not None:  # MLA: k is the whole entry, v its first latent_dim values (already in k)
            flat(self.k, *rows).index_copy_(dim, slot_mapping, k)
            return
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.kv_cache_dtype == "int8":
                x, s = quantize_kv_int8(x)
                flat(scales, self.num_kv_heads).index_copy_(dim, slot_mapping, s)
            elif self.kv_cache_dtype == "fp8":
                x = quantize_kv_fp8(x, scales.view(-1, 1, 1, 1) if layer is None else scales[layer])
            flat(as_bits(pool), *rows).index_copy_(dim, slot_mapping, as_bits(x))

    def layer_views(self) -> tuple[list, list]:
        """Per layer, what a ragged step's attention indexes: the pool's own views, or ``DequantView``s."""
        if not self.quantized:
            return list(self.k.unbind(0)), list(self.v.unbind(0))
        per_token = self.kv_cache_dtype == "int8"
        views = tuple(
            [DequantView(pool[i], scales[i], self.dtype, per_token) for i in range(self.num_layers)]
            for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale))
        )
        return views[0], views[1]

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What reading ``k``, ``v`` back after ``write`` gives (identity for a plain pool): a decode that attends to
        its own new key before writing it sees the same value as one that writes first."""
        if not self.quantized:
            return k, v
        out = []
        for x, scales in ((k, self.k_scale), (v, self.v_scale)):
            if self.kv_cache_dtype == "int8":
                q, s = quantize_kv_int8(x)
                out.append((q.float() * s[..., None]).to(self.dtype))
            else:
                out.append((quantize_kv_fp8(x, scales[layer]).float() * scales[layer]).to(self.dtype))
        return out[0], out[1]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (any shape of slot ids) in one layer, dequantized: (*slots.shape, kv_heads, d)."""
        rows = (self.num_kv_heads, self.head_dim)
        if self.latent_dim is not None:  # MLA: V is the latent part of the entry
            entry = self.k[layer].view(-1, *rows)[slots]
            return entry, entry[..., : self.latent_dim]
        if not self.quantized:
            return self.k[layer].view(-1, *rows)[slots], self.v[layer].view(-1, *rows)[slots]
        k, v = (_unbits(as_bits(pool[layer]).view(-1, *rows)[slots], pool.dtype) for pool in (self.k, self.v))
        if self.kv_cache_dtype == "int8":
            ks = self.k_scale[layer].view(-1, self.num_kv_heads)[slots][..., None]
            vs = self.v_scale[layer].view(-1, self.num_kv_heads)[slots][..., None]
        else:
            ks, vs = self.k_scale[layer], self.v_scale[layer]
        return (k.float() * ks).to(self.dtype), (v.float() * vs).to(self.dtype)


class ContiguousKVCache(KVCache):
    """A static per-slot cache: ``max_batch`` slots of ``max_len`` tokens, with each slot's current length."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str | None = "auto",
    ) -> None:
        if max_len > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_len {max_len} exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})"
            )
        super().__init__(cfg, num_blocks=max_batch, block_size=max_len, dtype=dtype, device=device,
                         kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        self.max_batch = max_batch
        self.max_len = max_len
        self.lengths = [0] * max_batch  # tokens cached per slot

    def check_slots(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ConfigError(f"slots must be distinct, got {slots}")
        for s in slots:
            if not 0 <= s < self.max_batch:
                raise ConfigError(f"slot {s} out of range [0, {self.max_batch})")
