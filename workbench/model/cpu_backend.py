"""The CPU paged attention backend: attention reads K/V where the pool holds them (``kernels/paged_decode_cpu.py``).

Same protocol as ``TorchAttentionBackend`` (``workbench.model.attention``): no gather, no concatenation, no
dequantized copy of an int8 or fp8 pool, GQA without expanded K/V. Like the torch backend a decode only reads the pool,
so the same function runs eagerly and compiled, and the step's new K/V are written once afterwards by
``KVCache.write`` (``decode_writes_cache = False``). ``CpuAttentionBackend.decode`` and ``forward`` say which entry of
the op (or the torch backend's SDPA) each kind of step and chunk takes.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from workbench.errors import ConfigError
from workbench.hardware import cpu_vendor
from workbench.model.attention import TORCH_BACKEND, AttentionBackend, AttentionMetadata, DecodeMetadata

if TYPE_CHECKING:
    from workbench.kv.cache import KVCache


# A chunk of a ragged step with at most this many new tokens attends row by row through the decode op rather than
# gathering its sequence's K/V for SDPA: a speculative verify (k + 1 tokens) then attends as k + 1 decode rows.
# Chosen to cover verifies of k <= 15, not tuned (a long chunk's SDPA reads each key once for all its queries).
PAGED_MAX_QUERY_LEN = 16


def prompt_op_isas(vendor: str) -> tuple[str, ...]:
    """The op's ISA paths on which whole prompts attend through its prompt entry rather than PyTorch's SDPA, on a CPU
    of ``vendor`` (``workbench.hardware.cpu_vendor``), bench-300m's heads, 25-250-token prompts, 2 threads: on the
    Intel Xeon its AVX-512 path ran at 1.1-1.6x of SDPA and its AVX2 path at 0.69-0.94x; on the AMD EPYC (Zen 4)
    SDPA itself is 2.6-5x slower (6.3 against 1.6 ms at 250 tokens) and both paths beat it (AVX-512 2.7-5.2x, AVX2
    2.2-2.9x)."""
    return ("avx512",) if vendor == "GenuineIntel" else ("avx512", "avx2")


class CpuAttentionBackend:
    """Paged decode with the C++ op of ``kernels/paged_decode_cpu.py`` (``isa``: its code path, default the best;
    ``schedule``: its prefetch schedule, default this CPU's)."""

    name = "cpu"
    gathers = False
    decode_writes_cache = False

    def __init__(self, isa: str | None = None, schedule: str | None = None) -> None:
        from workbench.kernels.paged_decode_cpu import (
            SCHEDULES,
            available,
            build_error,
            default_isa,
            default_schedule,
            paged_decode_cpu_op,
            prompt_attention_cpu_op,
        )

        if not available():
            raise ConfigError(f"attention_backend 'cpu' needs the C++ decode op, which did not build here "
                              f"({build_error()}); use attention_backend 'torch'")  # fmt: skip

        self._decode, self._prompts = paged_decode_cpu_op, prompt_attention_cpu_op
        if schedule is not None and schedule not in SCHEDULES:
            raise ConfigError(f"CPU decode schedule {schedule!r} is not one of {list(SCHEDULES)}")
        self.isa = default_isa() if isa is None else isa
        self.prompt_op = self.isa in prompt_op_isas(cpu_vendor())
        self.schedule = default_schedule() if schedule is None else schedule

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A ragged step's short chunks (at most ``PAGED_MAX_QUERY_LEN`` new tokens: decodes, speculative verifies,
        short chunks) attend through the decode op, one row per new token over its sequence's blocks (the step's K/V
        are in the pool by now: a token at position ``p`` reads keys ``0 .. p``), the way a pure decode attends: all
        of them in one call, also beside a long chunk (a chunked-prefill step's decodes). Longer chunks that are
        their sequence's whole context (fresh prompts, fp32, the step's ``k``/``v`` given) attend through the op's
        prompt entry, all in one call, over the step's K/V as written; the other longer chunks, and every chunk of an
        int8/fp8 pool or of MLA, take the torch backend's SDPA path, one sequence at a time."""
        if not (
            isinstance(k_cache, torch.Tensor)  # a quantized pool's layer is a dequantizing view
            and k_cache.dtype == q.dtype
            and v_cache.shape[-1] == k_cache.shape[-1]
        ):
            return TORCH_BACKEND.forward(q, k_cache, v_cache, meta, scale, k, v)
        if meta.max_query_len <= PAGED_MAX_QUERY_LEN:
            tables, num_keys = meta.token_rows()
            return self._decode(
                q, k_cache, v_cache, tables, num_keys, scale, None, None, None, None, self.isa, self.schedule
            )
        short, tables, num_keys, long = meta.split_chunks(PAGED_MAX_QUERY_LEN)
        out = q.new_empty(q.shape)
        # whole prompts through the prompt entry where it is the faster (prompt_op_isas)
        fast = self.prompt_op and q.dtype == torch.float32 and k is not None and v is not None
        prompts = [i for i in long if fast and meta.query_lens[i] == meta.seq_lens[i]]
        rest = [i for i in long if i not in prompts]
        if rest:
            TORCH_BACKEND.forward(q, k_cache, v_cache, meta, scale, k, v, seqs=rest, out=out)
        if prompts:
            starts = meta.cu_seqlens_q.tolist()
            self._prompts(q, k, v, out, [starts[i] for i in prompts], [meta.query_lens[i] for i in prompts], scale,
                          self.isa)  # fmt: skip
        if short.numel():
            out[short] = self._decode(q[short], k_cache, v_cache, tables, num_keys, scale, None, None, None, None,
                                      self.isa, self.schedule)  # fmt: skip
        return out

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
            self.isa, self.schedule,
        )  # fmt: skip


@functools.cache
def default_backend(device_type: str) -> AttentionBackend:
    """What attends when nobody chooses: on the CPU the paged decode above when its op builds here, else (CUDA, or
    no compiler) ``TORCH_BACKEND``. One instance per process (the backends are stateless)."""
    if device_type != "cpu":
        return TORCH_BACKEND
    from workbench.kernels.paged_decode_cpu import available

    return CpuAttentionBackend() if available() else TORCH_BACKEND
