"""The weight kernels alone: one sweep of a model's linear layers (qkv, o, gate_up, down per layer, and an untied
LM head) in fp32, bf16, int8 (``aten._weight_int8pack_mm``) and int4 (``aten._weight_int4pack_mm_for_cpu``),
interleaved (A, B, C, D, A, B, ...), at each batch size: median sweep time, bytes read per sweep, GB/s, and
the speed-up over fp32. Says whether the packed operators turn fewer bytes into speed on this CPU, before any
engine is involved.

    .venv/bin/python scripts/bench_quant_ops.py [--model bench-300m] [--threads 2] [--batch 1 32] [--repeats 10]

Prints one JSON object (``rows``: scheme, batch, sweep_ms, bytes, gb_per_s, speedup; ``load_average``).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from torch import nn

from workbench.bench import linear_shapes, set_threads
from workbench.config import ModelConfig
from workbench.model.quant import Int4Linear, Int8Linear
from workbench.parsing import make_parser


def _layers(cfg: ModelConfig, scheme: str, group_size: int) -> list[nn.Module]:
    gen = torch.Generator().manual_seed(0)
    shapes = linear_shapes(cfg)
    if cfg.tie_word_embeddings:
        shapes = shapes[:-1]  # a tied head stays unquantized: the sweep measures only what the scheme changes
    out: list[nn.Module] = []
    for fan_in, fan_out in shapes:
        lin = nn.Linear(fan_in, fan_out, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02, generator=gen)
        if scheme == "bf16":
            out.append(lin.to(torch.bfloat16))
        elif scheme == "int8":
            out.append(Int8Linear(lin))
        elif scheme == "int4":
            out.append(Int4Linear(lin, group_size))
        else:
            out.append(lin)
    return out


def _bytes(layers: list[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in layers for t in [*m.parameters(), *m.buffers()])


@torch.inference_mode()
def main() -> None:
    p = make_parser(description=__doc__)
    p.add_argument("--model", default="bench-300m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--schemes", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    args = p.parse_args()
    set_threads(args.threads)
    cfg = ModelConfig.resolve(args.model)
    sweeps = {s: _layers(cfg, s, args.group_size) for s in args.schemes}
    rows = []
    for batch in args.batch:
        xs = {s: {} for s in sweeps}
        times: dict[str, list[float]] = {s: [] for s in sweeps}
        for i in range(args.repeats + 2):
            for s, layers in sweeps.items():
                dtype = torch.bfloat16 if s == "bf16" else torch.float32
                t0 = time.perf_counter()
                for m in layers:
                    n = m.in_features
                    if n not in xs[s]:
                        xs[s][n] = torch.randn(batch, n).to(dtype)
                    m(xs[s][n])
                if i >= 2:
                    times[s].append(time.perf_counter() - t0)
        base = None
        for s, layers in sweeps.items():
            t = statistics.median(times[s])
            moved = _bytes(layers)
            base = base or t
            rows.append({"scheme": s, "batch": batch, "sweep_ms": t * 1e3, "sweep_min_ms": min(times[s]) * 1e3,
                         "bytes": moved, "gb_per_s": moved / t / 1e9, "speedup": base / t})  # fmt: skip
    print(json.dumps({"model": cfg.name, "threads": args.threads, "rows": rows, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
