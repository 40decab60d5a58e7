"""Where a batch-1 CPU decode step spends its time, eager against compiled, and why small operations are slow.

    .venv/bin/python scripts/profile_decode_cpu.py [--model bench-300m] [--threads 2] [--steps 10] [--no-compile]

Prints one JSON object:
- ``cold_op_us``: the time of each of 8 consecutive small operations (SiLU of 2816 values) right after a
  matrix-vector product that streamed a 23 MB weight; the first finds its code and data evicted from the caches.
- ``eager_segments_ms``: per decode step, the time of each part of the 24 layers in the eager engine path (timers
  around the model's own methods: norms, the four products, rotary, attention, SiLU x up, residual adds).
- ``step_ms``: median step time of the eager engine, of the compiled one (``EngineConfig.compile_decode``), and of
  a sweep of plain ``nn.Linear`` layers of the model's weight shapes, timed in the same loop.
"""

from __future__ import annotations

import json
import statistics
import time
import types
from collections import defaultdict

import torch
import torch.nn.functional as F

from workbench.bench import LinearSweep, _greedy, bench_engine, load_bench_model, random_prompts, set_threads
from workbench.model.layers import apply_rotary_rolled
from workbench.parsing import make_parser

pc = time.perf_counter


def cold_op_us(reps: int = 40) -> list[float]:
    weight = torch.randn(5632, 1024) * 0.02  # 23 MB: the gate/up matrix of bench-300m
    x, g = torch.randn(1, 1024), torch.randn(1, 2816)
    per_op: list[list[float]] = [[] for _ in range(8)]
    with torch.inference_mode():
        for _ in range(reps):
            F.linear(x, weight)
            t = [pc()]
            for _ in range(8):
                F.silu(g)
                t.append(pc())
            for k in range(8):
                per_op[k].append(t[k + 1] - t[k])
    return [round(statistics.median(v) * 1e6, 2) for v in per_op]


def timed_layer_forward(acc: dict[str, float]):  # noqa: ANN201
    """``DecoderLayer.forward`` with ``Attention.forward`` unrolled (projection, rotary and backend as there),
    the same operations in the same order, with a timer between each part."""

    def forward(self, x, cos, sin_signed, k_cache, v_cache, meta, backend):  # noqa: ANN001, ANN202
        attn, mlp = self.self_attn, self.mlp
        t0 = pc()
        h = self.input_layernorm.forward(x)
        t1 = pc()
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        t2 = pc()
        nh, nkv, d, t = attn.num_heads, attn.num_kv_heads, attn.head_dim, x.shape[0]
        qk = apply_rotary_rolled(qkv[:, : attn.q_size + attn.kv_size].view(t, nh + nkv, d), cos, sin_signed)
        v = qkv[:, attn.q_size + attn.kv_size :].view(t, nkv, d)
        t3 = pc()
        o = backend.forward(qk[:, :nh], qk[:, nh:], v, k_cache, v_cache, meta, attn.scale)
        t4 = pc()
        o = F.linear(o.reshape(t, attn.q_size), attn.o_proj.weight)
        t5 = pc()
        x = x + o
        h = self.post_attention_layernorm.forward(x)
        t6 = pc()
        gate_up = F.linear(h, mlp.gate_up_proj.weight)
        t7 = pc()
        gate, up = gate_up.split(mlp.intermediate_size, dim=-1)
        a = F.silu(gate).mul_(up)
        t8 = pc()
        down = F.linear(a, mlp.down_proj.weight)
        t9 = pc()
        x = x.add_(down)
        t10 = pc()
        marks = [t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10]
        names = ["norm", "qkv_proj", "rotary", "attention", "o_proj", "residual+norm", "gate_up_proj", "silu*up",
                 "down_proj", "residual"]  # fmt: skip
        for name, a0, a1 in zip(names, marks, marks[1:]):
            acc[name] += a1 - a0
        return x

    return forward


def main() -> None:
    p = make_parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench-300m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled engine (no ~35 s compilation)")
    args = p.parse_args()
    threads = set_threads(args.threads)
    model = load_bench_model(args.model)
    cfg = model.config
    out: dict = {"model": args.model, "threads": threads, "cold_op_us": cold_op_us()}

    engines = {"eager": bench_engine(model, 1, 128 + 2 * args.steps + 16)}
    if not args.no_compile:
        engines["compiled"] = bench_engine(model, 1, 128 + 2 * args.steps + 16, compile_decode=True)
    for engine in engines.values():
        engine.add_request(random_prompts(1, 128, cfg.vocab_size)[0], _greedy(2 * args.steps + 8))
        for _ in range(4):  # prefill, then warm-up decodes (the compiled engine compiles in the first)
            engine.step()
    sweep = LinearSweep(cfg, model.dtype, model.device)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.steps):
        for name, engine in engines.items():
            t0 = pc()
            engine.step()
            times[name].append(pc() - t0)
        times["linear_sweep"].append(sweep.run(1))
    out["step_ms"] = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}

    acc: dict[str, float] = defaultdict(float)
    originals = [layer.forward for layer in model.layers]
    for layer in model.layers:
        layer.forward = types.MethodType(timed_layer_forward(acc), layer)
    eager = engines["eager"]
    for _ in range(args.steps):
        eager.step()
    for layer, forward in zip(model.layers, originals):
        layer.forward = forward
    out["eager_segments_ms"] = {k: round(v / args.steps * 1e3, 3) for k, v in acc.items()}
    products = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    out["eager_products_ms"] = round(sum(out["eager_segments_ms"][k] for k in products), 2)
    out["eager_glue_ms"] = round(sum(v for k, v in out["eager_segments_ms"].items() if k not in products), 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
