"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3), naive and absorbed.

Per token, with ``r = kv_lora_rank``, ``dr = qk_rope_head_dim``, ``dn = qk_nope_head_dim``, ``dv = v_head_dim``:

    c      = RMSNorm(W_DKV x)[:r]              the compressed latent (r values), shared by every head
    k_rope = RoPE(W_DKV x)[r:]                 one rotary key (dr values), shared by every head
    q      = W_UQ RMSNorm(W_DQ x)               per head dn + dr (or a full-rank q_proj when q_lora_rank is None)
    k_h    = [W_UK_h c, k_rope],  v_h = W_UV_h c     (W_UK, W_UV: the rows of kv_b_proj)

Only ``[c, k_rope]`` is cached: ``r + dr`` values per token and layer (576 for DeepSeek-V3) instead of
``heads * (dn + dr + dv)``.

- ``naive``: decompress every cached latent into per-head K and V, then ordinary attention (what a prefill does
  once; compute grows with the context times the heads).
- absorbed (``project`` / ``output``, what the paged model runs): ``q_h . k_h = (W_UK_h^T q_nope_h) . c +
  q_rope_h . k_rope``, so each head's query is moved into the latent space (``r + dr`` wide) and attends to the
  cache as is, as multi-query attention with one KV "head" whose V is the latent itself (the first ``r``
  values of the entry); the output ``o_h = W_UV_h (sum_j p_j c_j)`` is decompressed after attention. The
  backends see an MQA of head size ``r + dr`` (V: ``r``), softmax scale ``(dn + dr)^-0.5``.

``rope_interleave`` (HF DeepSeek checkpoints) rotates interleaved pairs; the loader permutes those rows of
``q_b_proj`` and ``kv_a_proj_with_mqa`` into rotate-half order (``deinterleave_rows``), which leaves every score
unchanged, so one rotary convention serves all models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.model.layers import RMSNorm, apply_rotary_rolled


class MLAttention(nn.Module):
    """MLA with HF DeepSeek's parameter names; ``project``/``output`` mirror ``transformer.Attention``'s."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.rope_scaling is not None:
            raise ConfigError(
                f"{cfg.name}: rope_scaling {cfg.rope_scaling.get('rope_type', cfg.rope_scaling.get('type'))!r} "
                "is not implemented for MLA models (yarn); the preset serves the ledger and the roofline"
            )
        if cfg.attention_bias:
            raise ConfigError(f"{cfg.name}: MLA with attention_bias is not implemented")
        self.num_heads, h = cfg.num_heads, cfg.hidden_size
        self.r, self.dr, self.dn, self.dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        self.q_lora_rank = cfg.q_lora_rank
        qd = self.dn + self.dr
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qd, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * qd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.r + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r, self.num_heads * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.dv, h, bias=False)
        self.scale = qd**-0.5
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # no tensor parallelism for MLA yet

    # ---- the pieces both forms share -----------------------------------------------------------------------------
    def _query(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope (T, heads, dn), q_rope (T, heads, dr) rotated)."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], self.num_heads, self.dn + self.dr)
        return q[..., : self.dn], apply_rotary_rolled(q[..., self.dn :], cos, sin_signed)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """The cache entry of each token: [c (r), k_rope (dr)], (T, 1, r + dr)."""
        kv = self.kv_a_proj_with_mqa(x)  # (T, r + dr)
        c = self.kv_a_layernorm(kv[:, : self.r])
        k_rope = apply_rotary_rolled(kv[:, None, self.r :], cos, sin_signed)  # (T, 1, dr)
        return torch.cat((c[:, None], k_rope), dim=-1)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's rows per head: W_UK (heads, dn, r) and W_UV (heads, dv, r)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.r)
        return w[:, : self.dn], w[:, self.dn :]

    # ---- absorbed form: what the paged model runs ---------------------------------------------------------------
    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden) normed -> q (T, heads, r + dr) in the latent space, k (T, 1, r + dr) (the cache entry) and
        v (T, 1, r) (its latent part): an MQA whose one KV head is the latent."""
        q_nope, q_rope = self._query(x, cos, sin_signed)
        w_uk, _ = self._w_uk_uv()
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # W_UK absorbed into the query
        k = self.latent(x, cos, sin_signed)
        return torch.cat((q_latent, q_rope), dim=-1), k, k[..., : self.r]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output in the latent space (T, heads, r) -> (T, hidden): W_UV per head, then o_proj."""
        _, w_uv = self._w_uk_uv()
        out = self.o_proj(torch.einsum("thr,hvr->thv", o, w_uv).reshape(o.shape[0], -1))
        return out if self.reduce is None else self.reduce(out)

    # ---- naive form: the reference -------------------------------------------------------------------------------
    def naive(
        self,
        x: torch.Tensor,  # (T, hidden) normed: the new tokens of one sequence
        cos: torch.Tensor,  # (T, 1, dr)
        sin_signed: torch.Tensor,
        cached: torch.Tensor | None = None,  # (S0, 1, r + dr): the entries of the S0 earlier tokens
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of one sequence's new tokens over its cached latents and their own, with K and V
        decompressed per head: (output (T, hidden), the new tokens' cache entries (T, 1, r + dr))."""
        q_nope, q_rope = self._query(x, cos, sin_signed)
        entry = self.latent(x, cos, sin_signed)
        entries = entry if cached is None else torch.cat((cached, entry))  # (S, 1, r + dr)
        kv = self.kv_b_proj(entries[:, 0, : self.r]).view(-1, self.num_heads, self.dn + self.dv)
        k = torch.cat((kv[..., : self.dn], entries[:, :, self.r :].expand(-1, self.num_heads, -1)), dim=-1)
        v = kv[..., self.dn :]  # (S, heads, dv)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (T, heads, dn + dr)
        t, s = q.shape[0], k.shape[0]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]  # (T, S): query i at position s - t + i
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=self.scale
        )  # (heads, T, dv)
        return self.o_proj(o.transpose(0, 1).reshape(t, -1)), entry


def deinterleave_rows(w: torch.Tensor, heads: int, head_dim: int, rope_dim: int) -> torch.Tensor:
    """``w`` (heads * head_dim, in) with each head's last ``rope_dim`` rows as interleaved pairs (x0, x1), (x2, x3)
    -> the same rows in rotate-half order (x0, x2, ..., x1, x3, ...): HF DeepSeek's ``rope_interleave``."""
    w = w.view(heads, head_dim, -1)
    rope = w[:, head_dim - rope_dim :]
    order = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    return torch.cat((w[:, : head_dim - rope_dim], rope[:, order]), dim=1).reshape(heads * head_dim, -1)


# ---- HF checkpoints (DeepSeek-V3 names, which are ours) --------------------------------------------------------
def hf_mla_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes of one layer's MLA."""
    p, h, nh = f"model.layers.{layer}.self_attn.", cfg.hidden_size, cfg.num_heads
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        p + "kv_a_proj_with_mqa.weight": (r + dr, h),
        p + "kv_a_layernorm.weight": (r,),
        p + "kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
        p + "o_proj.weight": (h, nh * cfg.v_head_dim),
    }
    if cfg.q_lora_rank is None:
        shapes[p + "q_proj.weight"] = (nh * cfg.head_dim, h)
    else:
        shapes |= {p + "q_a_proj.weight": (cfg.q_lora_rank, h), p + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                   p + "q_b_proj.weight": (nh * cfg.head_dim, cfg.q_lora_rank)}  # fmt: skip
    return shapes


def mla_state(cfg: ModelConfig, layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ``layers.{layer}.self_attn.*`` parameters from the checkpoint's, rotary rows de-interleaved when the
    checkpoint interleaves them (``rope_interleave``)."""
    p, o = f"model.layers.{layer}.self_attn.", f"layers.{layer}.self_attn."
    state = {o + name.removeprefix(p): tensors[name] for name in hf_mla_shapes(cfg, layer)}
    if cfg.rope_interleave:
        q = o + ("q_proj.weight" if cfg.q_lora_rank is None else "q_b_proj.weight")
        state[q] = deinterleave_rows(state[q], cfg.num_heads, cfg.head_dim, cfg.qk_rope_head_dim)
        kv = o + "kv_a_proj_with_mqa.weight"
        state[kv] = deinterleave_rows(state[kv], 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim)
    return state
