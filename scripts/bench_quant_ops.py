"""The weight kernels alone: one sweep of a model's matrices (qkv, o, gate_up, down per layer, and the LM head) in
fp32, bf16, int8 and int4 (``workbench.model.quant``: on the CPU its fused dequantize-reduce loops compiled by
inductor for few rows, or the GEMM of the dequantized weight for many), interleaved (A, B, C, D, A, B, ...), at
each batch size. Per scheme and kind of matrix: median time per sweep, bytes read, GB/s; per scheme the sweep of
the decoder layers, the LM head in that scheme, and the speed-up over fp32 with the head in fp32 (what a tied
head costs today) or in the scheme (what a quantized copy of it would cost). The sweep is ~1.2 GB in fp32 for
``bench-300m``, larger than any cache, so every matrix streams from memory as in a decode step.

    .venv/bin/python scripts/bench_quant_ops.py [--model bench-300m] [--threads 2] [--batch 1 32] [--repeats 10]

Prints one JSON object (``rows``: scheme, batch, per-kind ms and GB/s, layers_ms, head_ms, speedup with either
head; ``load_average`` before and after).
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

KINDS = ("qkv", "o", "gate_up", "down")


def _layers(cfg: ModelConfig, scheme: str, group_size: int) -> list[tuple[str, nn.Module]]:
    gen = torch.Generator().manual_seed(0)
    shapes = linear_shapes(cfg)
    kinds = [*KINDS * cfg.num_layers, "head"]
    out: list[tuple[str, nn.Module]] = []
    for kind, (fan_in, fan_out) in zip(kinds, shapes):
        lin = nn.Linear(fan_in, fan_out, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02, generator=gen)
        if scheme == "bf16":
            out.append((kind, lin.to(torch.bfloat16)))
        elif scheme == "int8":
            out.append((kind, Int8Linear(lin)))
        elif scheme == "int4":
            out.append((kind, Int4Linear(lin, group_size)))
        else:
            out.append((kind, lin))
    return out


def _bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


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
    load_before = os.getloadavg()
    set_threads(args.threads)
    cfg = ModelConfig.resolve(args.model)
    sweeps = {s: _layers(cfg, s, args.group_size) for s in args.schemes}
    rows = []
    for batch in args.batch:
        xs: dict[tuple[str, int], torch.Tensor] = {}
        times = {s: {k: [] for k in (*KINDS, "head")} for s in sweeps}
        for i in range(args.repeats + 2):  # the first two sweeps warm up (and compile the fused loops)
            for s, layers in sweeps.items():
                dtype = torch.bfloat16 if s == "bf16" else torch.float32
                spent = dict.fromkeys(times[s], 0.0)
                for kind, m in layers:
                    n = m.in_features
                    x = xs.setdefault((s, n), torch.randn(batch, n).to(dtype))
                    t0 = time.perf_counter()
                    m(x)
                    spent[kind] += time.perf_counter() - t0
                if i >= 2:
                    for kind, t in spent.items():
                        times[s][kind].append(t)
        for s, layers in sweeps.items():
            row: dict = {"scheme": s, "batch": batch}
            for kind in times[s]:
                moved = sum(_bytes(m) for k, m in layers if k == kind)
                t = statistics.median(times[s][kind])
                row[f"{kind}_ms"], row[f"{kind}_gb_per_s"] = t * 1e3, moved / t / 1e9
            row["layers_ms"] = sum(row[f"{k}_ms"] for k in KINDS)
            row["layers_bytes"] = sum(_bytes(m) for k, m in layers if k != "head")
            row["layers_gb_per_s"] = row["layers_bytes"] / row["layers_ms"] / 1e6
            row["head_ms"] = row["head_ms"]
            rows.append(row)
        base = next(r for r in rows if r["batch"] == batch and r["scheme"] == args.schemes[0])
        for r in rows:
            if r["batch"] == batch:
                total = base["layers_ms"] + base["head_ms"]
                r["speedup_head_fp32"] = total / (r["layers_ms"] + base["head_ms"])  # a tied head kept unquantized
                r["speedup_head_quantized"] = total / (r["layers_ms"] + r["head_ms"])  # a quantized copy of it
    print(json.dumps({"model": cfg.name, "threads": args.threads, "rows": rows,
                      "load_average": [load_before, os.getloadavg()]}))  # fmt: skip


if __name__ == "__main__":
    main()
