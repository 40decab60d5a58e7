"""Where a batch-1 decode step's time goes (``workbench bench decode-parts``; the offline set's steps by kind are
``workbench bench offline --breakdown``, ``workbench.bench.offline_breakdown``).

``decode_parts``: a batch-1 decode step of the engine taken apart: each part of the decoder layers (norms, the
  four products, rotary, attention, SiLU x up, residual adds) timed in the eager path, the step's median in the
  eager and the compiled engine and of a sweep of plain ``nn.Linear`` layers of the model's shapes, in the same
  loop; and ``cold_op_us``, the time of each of 8 consecutive small operations (SiLU of ``intermediate_size``
  values) right after a matrix-vector product that streamed the gate/up weight: the first finds its code and data
  evicted from the caches.

Every time goes through ``workbench.timing``.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from workbench.bench import LinearSweep, bench_engine
from workbench.model.layers import apply_rotary_rolled
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams
from workbench.timing import median, now, random_prompts, timed


@torch.inference_mode()
def cold_op_us(hidden_size: int, intermediate_size: int, reps: int = 40, seed: int = 0) -> list[float]:
    """Median microseconds of each of 8 consecutive SiLUs of ``intermediate_size`` values right after a
    matrix-vector product with a (2 * intermediate, hidden) weight (the gate/up matrix)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(2 * intermediate_size, hidden_size, generator=gen) * 0.02
    x, g = torch.randn(1, hidden_size, generator=gen), torch.randn(1, intermediate_size, generator=gen)
    per_op: list[list[float]] = [[] for _ in range(8)]
    for _ in range(reps):
        F.linear(x, weight)
        marks = [now()]
        for _ in range(8):
            F.silu(g)
            marks.append(now())
        for k in range(8):
            per_op[k].append(marks[k + 1] - marks[k])
    return [round(median(v) * 1e6, 2) for v in per_op]


PARTS = ("norm", "qkv_proj", "rotary", "attention", "o_proj", "residual+norm", "gate_up_proj", "silu*up", "down_proj",
         "residual")  # fmt: skip
PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def timed_layer_forward(acc: dict[str, float]) -> Any:
    """``DecoderLayer.forward`` of a Llama-family layer (``check_llama_layers``) unrolled: ``pre_attention``,
    ``attend`` and ``post_attention``'s operations in the same order, through the same modules (the engine's packed
    or quantized linears included), with a clock reading between each part (summed into ``acc`` by ``PARTS``)."""

    def forward(self: Any, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, attend: Any, layer: int,
                parts: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        attn, mlp = self.self_attn, self.mlp
        marks = [now()]
        h = self.input_layernorm.forward(x)
        marks.append(now())
        qkv = attn.qkv_proj.forward(h)  # (T, q_size + 2 kv_size)
        marks.append(now())
        t, nh, nkv, d = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        qk = apply_rotary_rolled(qkv[:, : attn.q_size + attn.kv_size].view(t, nh + nkv, d), cos, sin_signed)
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, attn.q_size + attn.kv_size :].view(t, nkv, d)
        marks.append(now())
        o = attend(layer, q, k, v, attn.scale)  # (T, heads, d)
        marks.append(now())
        o = attn.o_proj.forward(o.reshape(t, attn.q_size))
        marks.append(now())
        x = x + o
        h = self.post_attention_layernorm.forward(x)
        marks.append(now())
        gate, up = mlp.gate_up_proj.forward(h).split(mlp.intermediate_size, dim=-1)
        marks.append(now())
        a = F.silu(gate).mul_(up)
        marks.append(now())
        down = mlp.down_proj.forward(a)
        marks.append(now())
        x = x.add_(down)
        marks.append(now())
        for name, a0, a1 in zip(PARTS, marks, marks[1:]):
            acc[name] += a1 - a0
        return x, k, v

    return forward


def check_llama_layers(model: Transformer) -> None:
    """ConfigError unless every layer is the plain Llama block ``timed_layer_forward`` unrolls (multi-head attention
    without q/k norms, a SwiGLU MLP, one process)."""
    from workbench.errors import ConfigError
    from workbench.model.layers import SwiGLU
    from workbench.model.transformer import Attention

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        plain = isinstance(attn, Attention) and attn.q_norm is None and attn.reduce is None
        if not (plain and isinstance(mlp, SwiGLU) and mlp.reduce is None):
            raise ConfigError(f"{model.config.name}: bench decode-parts takes apart a Llama-family layer (no MLA, MoE, "
                              "q/k norm or tensor parallelism)")  # fmt: skip


def decode_parts(model: Transformer, steps: int = 8, compile_decode: bool = True, seed: int = 0) -> dict[str, Any]:
    """A batch-1 decode at a 128-token prompt: ``step_ms`` (medians of the eager engine's step, the compiled one's
    unless ``compile_decode`` is off, and of ``linear_sweep``, in the same loop), ``eager_parts_ms`` (per part of
    every layer together, per step, in the eager path), ``eager_products_ms``, ``eager_glue_ms`` and
    ``cold_op_us``."""
    check_llama_layers(model)
    cfg = model.config
    max_len = 128 + 2 * steps + 16
    engines = {"eager": bench_engine(model, 1, max_len)}
    if compile_decode:
        engines["compiled"] = bench_engine(model, 1, max_len, compile_decode=True)
    prompt = random_prompts(1, min(128, cfg.max_position_embeddings - 2 * steps - 16), cfg.vocab_size, seed)[0]
    for engine in engines.values():
        engine.add_request(prompt, SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True))
        for _ in range(4):  # prefill, then warm-up decodes (the compiled engine compiles in the first)
            engine.step()
    sweep = LinearSweep(cfg, model.dtype, model.device, seed=seed)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        for name, engine in engines.items():
            times[name].append(timed(engine.step)[0])
        times["linear_sweep"].append(sweep.run(1))
    out: dict[str, Any] = {"step_ms": {k: median(v) * 1e3 for k, v in times.items()}}
    acc: dict[str, float] = defaultdict(float)
    originals = [layer.forward for layer in model.layers]
    try:
        for layer in model.layers:
            layer.forward = types.MethodType(timed_layer_forward(acc), layer)
        for _ in range(steps):
            engines["eager"].step()
    finally:
        for layer, forward in zip(model.layers, originals):
            layer.forward = forward
    parts = {k: acc[k] / steps * 1e3 for k in PARTS}
    out["eager_parts_ms"] = parts
    out["eager_products_ms"] = sum(parts[k] for k in PRODUCTS)
    out["eager_glue_ms"] = sum(v for k, v in parts.items() if k not in PRODUCTS)
    out["cold_op_us"] = cold_op_us(cfg.hidden_size, cfg.intermediate_size, seed=seed)
    return out
