"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) with prefill and decode as separate entry points.

    prefill(prompts)  : every prompt token goes through the model at once (large matrix products), K/V of the whole
                        prompt are written to the cache, and the last position's logits give the first token.
    decode(tokens)    : one new token per sequence; each step re-reads every weight and the sequence's whole cache.

These two, over a contiguous cache, wrap the engine's entry points over a paged cache: ``forward`` (a ragged step)
and ``decode_step`` (a pure decode), whose metadata ``workbench.model.attention`` describes. The attention backend
is an argument of both: it belongs to the caller, not to the model. MHA, GQA and MQA are one code path (only
``num_kv_heads`` differs); Q/K/V and gate/up projections are fused into single matrix products.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from workbench.config import ModelConfig
from workbench.errors import RequestError
from workbench.kv.cache import ContiguousKVCache, KVCache
from workbench.model.attention import (
    TORCH_BACKEND,
    AttentionBackend,
    AttentionMetadata,
    DecodeMetadata,
    build_decode_metadata,
    build_metadata,
)
from workbench.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary_rolled, signed_sin
from workbench.model.mla import MLAttention
from workbench.model.moe import MoE
from workbench.request import validate_request

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(layer, q (T, heads, d), k (T, kv_heads, d), v, scale) -> attention output (T, heads, d)."""


def ragged_attention(meta: AttentionMetadata, cache: KVCache, backend: AttentionBackend) -> Attend:
    """A ragged step's attention: layer ``i`` writes the step's K/V into ``cache``, then attends through
    ``backend.forward``."""
    k_layers, v_layers = cache.layer_views()  # one view per layer (dequantizing ones for int8/fp8)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        cache.write(meta.slot_mapping, k, v, layer=i)
        return backend.forward(q, k_layers[i], v_layers[i], meta, scale, k, v)

    return attend


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum over ranks
        # Qwen3: one RMSNorm over head_dim shared by every query head, one by every key head, before rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(
        self,
        x: torch.Tensor,  # (T, hidden), normed
        cos: torch.Tensor,  # (T, 1, head_dim)
        sin_signed: torch.Tensor,  # (T, 1, head_dim): layers.signed_sin(sin)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q (T, heads, d) and K (T, kv_heads, d) with rotary applied, and V (T, kv_heads, d)."""
        t, nh, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # (T, q_size + 2 kv_size); nn.Linear or a quantized linear (model.quant)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, nh + nkv, d)
        if self.q_norm is not None:  # per head, before rotary (Qwen3)
            qk = torch.cat((self.q_norm.forward(qk[:, :nh]), self.k_norm.forward(qk[:, nh:])), dim=1)
        # rotary on Q and K together: their columns are adjacent, so one set of kernels serves both
        qk = apply_rotary_rolled(qk, cos, sin_signed)
        return qk[:, :nh], qk[:, nh:], qkv[:, self.q_size + self.kv_size :].view(t, nkv, d)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output (T, heads, d) projected back to (T, hidden) (summed over ranks under TP)."""
        out = self.o_proj.forward(o.reshape(o.shape[0], self.q_size))  # row-parallel under TP
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    """One pre-norm block, in two parts around its attention: ``pre_attention`` (norm, QKV, rotary) and
    ``post_attention`` (O projection, residual, norm, MLP, residual). ``forward`` runs both with ``attend`` between;
    the compiled ragged step (``workbench.engine.prefill_step``) traces both with attention an opaque operator."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # MLA (model.mla) presents the same project/output/scale as Attention; an MoE (model.moe) the same forward
        self.self_attn = MLAttention(cfg) if cfg.is_mla else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def pre_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> q (T, heads, d), k (T, kv_heads, d), v (T, kv_heads, d)."""
        # submodules' forward is called directly: nn.Module.__call__ costs more than a decode's small ops
        return self.self_attn.project(self.input_layernorm.forward(x), cos, sin_signed)

    def post_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) and the attention output o (T, heads, d) -> the layer's output (T, hidden)."""
        x = x + self.self_attn.output(o)
        return x.add_(self.mlp.forward(self.post_attention_layernorm.forward(x)))  # x: this function's own tensor

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        attend: Attend,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output (T, hidden), this step's K (T, kv_heads, d), V): ``attend`` writes or keeps the K/V."""
        q, k, v = self.pre_attention(x, cos, sin_signed)
        o = attend(layer, q, k, v, self.self_attn.scale)  # (T, heads, d)
        return self.post_attention(x, o), k, v


class Transformer(nn.Module):
    """Decoder-only transformer. Attention goes through the backend its caller passes (torch SDPA by default)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        init_std: float = 0.02,
    ) -> Transformer:
        """Random weights (normal(0, init_std), norms at 1), as a fresh HF model would have; deterministic in seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device="cpu")
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, init_std, generator=gen)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.zero_()  # as a fresh HF DeepSeek-V3 router has it
        model.rotary = RotaryEmbedding(cfg)  # buffers are not parameters: rebuild after to_empty
        return model.to(device=device, dtype=dtype).eval()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, max_batch: int, max_len: int) -> ContiguousKVCache:
        """A contiguous per-slot cache in the model's dtype and device."""
        return ContiguousKVCache(self.config, max_batch, max_len, dtype=self.dtype, device=self.device)

    # ---- the two entry points over a paged cache: a ragged step, and a pure decode --------------------------------
    def _layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Embed, every layer with ``attend`` as its attention, final norm: (hidden (T, hidden), K and V per layer).
        What the compiled ragged step traces (``workbench.engine.prefill_step``), with its attention an operator."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary(positions, x.dtype)  # once per step, shared by every layer
        sin_signed = signed_sin(sin)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer.forward(x, cos, sin_signed, attend, i)
            ks.append(k)
            vs.append(v)
        return self.norm.forward(x), ks, vs

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        backend: AttentionBackend = TORCH_BACKEND,
    ) -> torch.Tensor:
        """A ragged step (prefill, chunks, mixed): each layer writes its K/V into ``cache``, then attends.
        Hidden states after the final norm for every new token; input_ids: (T,) -> (T, hidden). (The engine's
        compiled ragged step, ``workbench.engine.prefill_step``, runs the same layers with the same attention.)"""
        return self._layers(input_ids, meta.positions, ragged_attention(meta, cache, backend))[0]

    def decode_step(
        self,
        input_ids: torch.Tensor,  # (B,) one new token per sequence
        meta: DecodeMetadata,
        cache: KVCache,
        backend: AttentionBackend = TORCH_BACKEND,
        write: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The one pure-decode step: next-token logits (B, vocab) fp32 and every layer's new K and V,
        (layers, B, kv_heads, head_dim) each.

        The torch backend only reads the cache during the step (each token attends to its gathered cached keys
        and then its own new key); ``write`` then stores the new K/V with ``KVCache.write``. ``write=False``
        leaves that to the caller: the compiled step (``workbench.engine.decode_step``) is a function that writes
        nothing, since a write into a view of a graph input makes inductor copy the whole pool.
        """

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            return backend.decode(i, q, k, v, cache, meta, scale)

        hidden, ks, vs = self._layers(input_ids, meta.positions, attend)
        k_new, v_new = torch.stack(ks), torch.stack(vs)
        if write and not backend.decode_writes_cache:
            cache.write(meta.slot_mapping, k_new, v_new)
        return self._logits(hidden), k_new, v_new  # the caller holds inference mode (compiled: outside the graph)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, returned in fp32. hidden: (N, hidden) -> (N, vocab)."""
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` without entering inference mode: what a compiled step traces (a graph that enters
        inference mode is one AOT autograd's cache bypasses, so every new process would trace it again)."""
        return self.lm_head(hidden).float()

    # ---- the two phases over a contiguous cache ---------------------------------------------------------------
    def prefill(
        self,
        prompts: list[list[int]],
        cache: ContiguousKVCache,
        slots: list[int],
        backend: AttentionBackend = TORCH_BACKEND,
    ) -> torch.Tensor:
        """Run whole prompts into cache slots; return each prompt's last-position logits, (num_seqs, vocab) fp32."""
        cache.check_slots(slots)
        if len(prompts) != len(slots):
            raise RequestError(f"{len(prompts)} prompts but {len(slots)} slots")
        for p in prompts:
            validate_request(p, 0, cache.max_len, self.config.vocab_size)
        lens = [len(p) for p in prompts]
        meta = build_metadata(lens, lens, [[s] for s in slots], cache.block_size, self.device)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        hidden = self.forward(ids, meta, cache, backend)
        for s, n in zip(slots, lens):
            cache.lengths[s] = n
        return self.compute_logits(hidden[meta.last_token_indices])

    @torch.inference_mode()
    def decode(
        self,
        tokens: list[int],
        cache: ContiguousKVCache,
        slots: list[int],
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """One new token per slot, attending to the slot's whole cache; return next-token logits (num_seqs, vocab).
        ``backend`` None: ``workbench.model.cpu_backend.default_backend`` (the paged C++ decode on the CPU)."""
        if backend is None:
            from workbench.model.cpu_backend import default_backend

            backend = default_backend(self.device.type)
        cache.check_slots(slots)
        if len(tokens) != len(slots):
            raise RequestError(f"{len(tokens)} tokens but {len(slots)} slots")
        seq_lens = [cache.lengths[s] + 1 for s in slots]
        for s, n in zip(slots, seq_lens):
            if cache.lengths[s] == 0:
                raise RequestError(f"slot {s} has no prefilled context; call prefill first")
            if n > cache.max_len:
                raise RequestError(f"slot {s} is full ({cache.max_len} tokens)")
        meta = build_decode_metadata(seq_lens, [[s] for s in slots], cache.block_size, self.device)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        logits = self.decode_step(ids, meta, cache, backend)[0]
        for s, n in zip(slots, seq_lens):
            cache.lengths[s] = n
        return logits
