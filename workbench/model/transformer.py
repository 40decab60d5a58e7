"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) with prefill and decode as separate entry points.

    prefill(prompts)  : every prompt token goes through the model at once (large matrix products), K/V of the whole
                        prompt are written to the cache, and the last position's logits give the first token.
    decode(tokens)    : one new token per sequence; each step re-reads every weight and the sequence's whole cache.

Both are thin wrappers over ``forward``, which takes a flat ragged batch of new tokens and its ``AttentionMetadata``
(so the engine can also mix prefill chunks and decodes in one step). MHA, GQA and MQA are one code path: only
``num_kv_heads`` differs. Q/K/V and gate/up projections are fused into single matrix products (fewer, larger GEMMs);
``workbench.model.checkpoint`` maps HF tensors onto them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig
from workbench.errors import RequestError
from workbench.kv.cache import ContiguousKVCache, KVCache
from workbench.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    build_metadata,
    gathered_decode_attention,
)
from workbench.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary_rolled, signed_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum over ranks

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,  # (T, 1, head_dim)
        sin_signed: torch.Tensor,  # (T, 1, head_dim): layers.signed_sin(sin)
        k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin_signed)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)  # (T, heads, d)
        out = F.linear(o.reshape(x.shape[0], self.q_size), self.o_proj.weight)  # row-parallel under TP
        return out if self.reduce is None else self.reduce(out)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q (T, heads, d) and K (T, kv_heads, d) with rotary applied, and V (T, kv_heads, d)."""
        t, nh, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)  # (T, q_size + 2 kv_size)
        # rotary on Q and K together: their columns are adjacent, so one set of kernels serves both
        qk = apply_rotary_rolled(qkv[:, : self.q_size + self.kv_size].view(t, nh + nkv, d), cos, sin_signed)
        v = qkv[:, self.q_size + self.kv_size :].view(t, nkv, d)
        return qk[:, :nh], qk[:, nh:], v

    def decode_gathered(
        self,
        x: torch.Tensor,  # (B, hidden): one new token per sequence
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        k_slots: torch.Tensor,  # (num_slots, kv_heads, head_dim): this layer's pool, flat
        v_slots: torch.Tensor,
        key_slots: torch.Tensor,  # (B, C) int64
        key_mask: torch.Tensor,  # (B, 1, 1, C + 1) bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode attention that reads the cache and writes nothing: (output (B, hidden), new K, new V)."""
        q, k, v = self.project(x, cos, sin_signed)
        o = gathered_decode_attention(q, k, v, k_slots, v_slots, key_slots, key_mask, self.scale)
        return F.linear(o.reshape(x.shape[0], self.q_size), self.o_proj.weight), k, v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin_signed, k_cache, v_cache, meta, backend) -> torch.Tensor:  # noqa: ANN001
        # submodules' forward is called directly: nn.Module.__call__ costs more than a decode's small ops
        x = x + self.self_attn.forward(
            self.input_layernorm.forward(x), cos, sin_signed, k_cache, v_cache, meta, backend
        )
        return x.add_(self.mlp.forward(self.post_attention_layernorm.forward(x)))  # x: this layer's own tensor

    def decode_gathered(self, x, cos, sin_signed, k_slots, v_slots, key_slots, key_mask):  # noqa: ANN001, ANN201
        """``forward`` for a pure decode through ``Attention.decode_gathered``: (x, new K, new V)."""
        o, k, v = self.self_attn.decode_gathered(
            self.input_layernorm.forward(x), cos, sin_signed, k_slots, v_slots, key_slots, key_mask
        )
        x = x + o
        return x.add_(self.mlp.forward(self.post_attention_layernorm.forward(x))), k, v


class Transformer(nn.Module):
    """Decoder-only transformer. ``attn_backend`` may be swapped (torch SDPA by default, or Triton)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        self.attn_backend: AttentionBackend = TorchAttentionBackend()

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

    # ---- the one forward over a flat ragged batch ------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """Hidden states after the final norm for every new token. input_ids: (T,) -> (T, hidden)."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary(meta.positions, x.dtype)  # once per step, shared by every layer
        sin_signed = signed_sin(sin)
        k_layers, v_layers = cache.k.unbind(0), cache.v.unbind(0)  # one view per layer, made once per step
        for layer, k_cache, v_cache in zip(self.layers, k_layers, v_layers):
            x = layer.forward(x, cos, sin_signed, k_cache, v_cache, meta, self.attn_backend)
        return self.norm(x)

    def decode_gathered(
        self,
        input_ids: torch.Tensor,  # (B,) one new token per sequence
        positions: torch.Tensor,  # (B,) int64: each token's position (its sequence's cached length)
        key_slots: torch.Tensor,  # (B, C) int64: pool slot of each cached key position, padded past the length
        key_mask: torch.Tensor,  # (B, 1, 1, C + 1) bool: cached keys to attend to, then the new token's (True)
        k_pool: torch.Tensor,  # (layers, num_blocks, block_size, kv_heads, head_dim): KVCache.k
        v_pool: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A pure-decode step as a function of its inputs: next-token logits (B, vocab) fp32 and every layer's
        new K and V, (layers, B, kv_heads, head_dim) each, for the caller to write at the tokens' slots.

        It reads the pool and writes nothing, so ``torch.compile`` takes it as one graph without copying the
        pool (a write into a view of a graph input makes inductor copy the whole base). Each token attends to
        its cached keys gathered through ``key_slots`` (masked by ``key_mask``) followed by its own new key:
        the same scores and values as ``forward`` with a write first, the new key last instead of in place.
        """
        n_layers = self.config.num_layers
        k_flat = k_pool.view(n_layers, -1, *k_pool.shape[3:])  # (layers, num_slots, kv_heads, d)
        v_flat = v_pool.view(n_layers, -1, *v_pool.shape[3:])
        x = self.embed_tokens(input_ids)  # (B, hidden)
        cos, sin = self.rotary(positions, x.dtype)
        sin_signed = signed_sin(sin)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer.decode_gathered(x, cos, sin_signed, k_flat[i], v_flat[i], key_slots, key_mask)
            new_k.append(k)
            new_v.append(v)
        return self.compute_logits(self.norm.forward(x)), torch.stack(new_k), torch.stack(new_v)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, returned in fp32. hidden: (N, hidden) -> (N, vocab)."""
        return self.lm_head(hidden).float()

    # ---- the two phases over a contiguous cache ---------------------------------------------------------------
    def check_prompt(self, prompt: list[int], max_len: int) -> None:
        """Raise RequestError for an empty prompt, an id outside the vocabulary, or a prompt longer than max_len."""
        if len(prompt) == 0:
            raise RequestError("empty prompt: at least one token id is needed")
        if len(prompt) > max_len:
            raise RequestError(f"prompt of {len(prompt)} tokens is longer than the maximum of {max_len}")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")

    def prefill(self, prompts: list[list[int]], cache: ContiguousKVCache, slots: list[int]) -> torch.Tensor:
        """Run whole prompts into cache slots; return each prompt's last-position logits, (num_seqs, vocab) fp32."""
        cache.check_slots(slots)
        if len(prompts) != len(slots):
            raise RequestError(f"{len(prompts)} prompts but {len(slots)} slots")
        for p in prompts:
            self.check_prompt(p, cache.max_len)
        lens = [len(p) for p in prompts]
        meta = build_metadata(lens, lens, [[s] for s in slots], cache.block_size, self.device)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        hidden = self.forward(ids, meta, cache)
        for s, n in zip(slots, lens):
            cache.lengths[s] = n
        return self.compute_logits(hidden[meta.last_token_indices])

    def decode(self, tokens: list[int], cache: ContiguousKVCache, slots: list[int]) -> torch.Tensor:
        """One new token per slot, attending to the slot's whole cache; return next-token logits (num_seqs, vocab)."""
        cache.check_slots(slots)
        if len(tokens) != len(slots):
            raise RequestError(f"{len(tokens)} tokens but {len(slots)} slots")
        seq_lens = [cache.lengths[s] + 1 for s in slots]
        for s, n in zip(slots, seq_lens):
            if cache.lengths[s] == 0:
                raise RequestError(f"slot {s} has no prefilled context; call prefill first")
            if n > cache.max_len:
                raise RequestError(f"slot {s} is full ({cache.max_len} tokens)")
        meta = build_metadata([1] * len(slots), seq_lens, [[s] for s in slots], cache.block_size, self.device)
        hidden = self.forward(torch.tensor(tokens, dtype=torch.long, device=self.device), meta, cache)
        for s, n in zip(slots, seq_lens):
            cache.lengths[s] = n
        return self.compute_logits(hidden)
