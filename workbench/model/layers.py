"""The small layers of a Llama-family decoder: RMSNorm, rotary position embeddings (with llama3 scaling), SwiGLU.

Numerics follow the published models (and so Hugging Face transformers): RMSNorm normalises in fp32 and casts back
before the weight; rotary angles are computed in fp32 from integer positions and cast to the activation dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (Zhang & Sennrich, 2019)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.rms_norm without a weight is x * rsqrt(mean(x^2) + eps) in one kernel, bit for bit the
        # three-op formula; the weight multiplies after the cast back, as in the published models
        normed = torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)  # always a fresh tensor
        if normed.dtype == self.weight.dtype:
            return normed.mul_(self.weight)  # in place on our own tensor: no second (T, hidden) allocation
        return self.weight * normed


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), i < d/2, with Llama 3.1's frequency-dependent scaling when configured.

    llama3 scaling (Meta, Llama 3.1 release): wavelengths longer than original_context / low_freq_factor are
    divided by `factor`; wavelengths shorter than original_context / high_freq_factor are kept; in between the
    two are blended linearly in original_context / wavelength.
    """
    dim = cfg.rotary_dim  # the head, or MLA's decoupled rope part
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (d/2,)
    scaling = cfg.rope_scaling
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original / low  # low frequencies: fully interpolated
    short_wave = wavelen < original / high  # high frequencies: untouched
    blend = (original / wavelen - low) / (high - low)  # 0 at the long end, 1 at the short end
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    mid = ~long_wave & ~short_wave
    return torch.where(mid, (1 - blend) * inv_freq / factor + blend * inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of position * inv_freq for the given positions; applied with the rotate-half convention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (T,) int -> cos, sin: (T, 1, head_dim), broadcast over heads
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by the position's angle. x: (T, heads, d); cos, sin: (T, 1, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, for ``apply_rotary_rolled``. sin: (T, 1, d) -> (T, 1, d)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` in fewer kernels, bit for bit: rotate_half(x) * sin == roll(x, d/2) * signed_sin(sin).

    x: (T, heads, d) (any strides); cos, sin_signed: (T, 1, d). Negation is exact, so the products and the
    sum are the same floating-point operations as the reference.
    """
    # the same two products and one sum, written into tensors this function allocated (fewer allocations)
    return (x * cos).add_(torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(sin_signed))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer, 2020), with gate and up fused into one matrix product."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum over ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate_size, dim=-1)  # nn.Linear or model.quant's
        out = self.down_proj.forward(F.silu(gate).mul_(up))  # row-parallel under TP
        return out if self.reduce is None else self.reduce(out)
