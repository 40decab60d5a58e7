"""The weight matrices alone: a model's linear layers multiplied in turn under different layouts and formats, on the
CPU, timed interleaved (``workbench bench linear`` and ``bench quant-ops``).

- ``linear_layouts``: plain ``F.linear`` against packed weights (the blocked op of ``kernels/linear_cpu.py``,
  ``workbench.model.packed``) per row count, one step's worth of matrices (each distinct shape of
  ``workbench.bench.linear_shapes`` once), and the product as the engine runs it (``PackedLinear``: packed from
  ``PACKED_MIN_ROWS`` rows on, plain below it and for a weight below ``PACKED_MIN_WEIGHT``), the three alternated,
  best of ``repeats``: where ``packed_speedup`` is above 1 the packed layout pays, which is where ``PACKED_MIN_ROWS``
  should start on the machine at hand; matrices that lose at every row count should lie below ``PACKED_MIN_WEIGHT``
  elements (they stay plain); ``engine_vs_best`` is what the engine's choice costs against the faster layout.
- ``gemm_peak``: the faster of the two at 512 rows, in FLOP/s: the fp32 compute ceiling of a prefill on this CPU that
  ``workbench bench vllm`` divides the offline set's FLOPs by.
- ``quant_sweep``: one sweep of every matrix of the model (qkv, o, gate_up, down per layer, and the LM head) in each
  scheme of ``fp32 | bf16 | int8 | int4`` (``workbench.model.quant``), the schemes interleaved (A, B, C, D, A, ...),
  per batch size: per kind of matrix the median ms and GB/s, the decoder layers' sweep, the head, and the speed-up
  over the first scheme with the head kept in it (a tied head left unquantized) or in the scheme.

Every time goes through ``workbench.timing``; FLOPs are ``2 * rows * in * out`` per matrix and bytes every
parameter and buffer of a layer (a quantized layer's scales included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workbench.bench import linear_shapes
from workbench.config import DEFAULT_GROUP_SIZE, ModelConfig
from workbench.errors import ConfigError
from workbench.timing import median, timed

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
QUANT_SCHEMES = ("fp32", "bf16", "int8", "int4")
KINDS = ("qkv", "o", "gate_up", "down")  # the matrices of a layer, in linear_shapes' order


def _check_packing() -> None:
    from workbench.kernels import linear_cpu

    if not linear_cpu.available():
        raise ConfigError(f"the blocked linear op did not build here ({linear_cpu.build_error()}): no packed layout")


def linear_flops(cfg: ModelConfig, rows: int) -> float:
    """FLOPs of one product of ``rows`` rows by each distinct weight shape of ``cfg`` (what ``linear_layouts``
    times)."""
    return sum(2.0 * rows * i * o for i, o in sorted(set(linear_shapes(cfg))))


@torch.inference_mode()
def linear_layouts(cfg: ModelConfig, rows_list: list[int], repeats: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Per row count: the best seconds of the plain, the packed and the engine's product (``PackedLinear``) of every
    distinct weight shape, their GFLOP/s, ``packed_speedup`` (plain / packed time), ``engine_rows`` (the rows the
    engine's packed product runs; None where it runs plain) and ``engine_vs_best`` (the faster layout's time / the
    engine's), the three alternated ``repeats`` times."""
    from workbench.kernels import linear_cpu
    from workbench.model.packed import PACKED_MIN_ROWS, PackedLinear, worth_packing

    _check_packing()
    if not rows_list or any(r < 1 for r in rows_list) or repeats < 1:
        raise ConfigError(f"need row counts >= 1 and repeats >= 1, got {rows_list} and {repeats}")
    shapes = sorted(set(linear_shapes(cfg)))
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for i, o in shapes]
    packed = [linear_cpu.pack(w) for w in weights]
    # the op as the engine calls it (PackedLinear), its ISA checked once here rather than in every timed call
    isa = linear_cpu.ISAS[linear_cpu.default_isa()]
    op = torch.ops.workbench_linear.blocked_linear.default
    engine: list[nn.Module] = []  # each weight as the engine holds it (packed copy only where pack_linears makes one)
    for w in weights:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")  # no weights of its own: given w
        lin.weight = nn.Parameter(w, requires_grad=False)
        engine.append(PackedLinear.wrap(lin) if worth_packing(w.shape[1], w.shape[0]) else lin)
    any_packed = any(isinstance(m, PackedLinear) for m in engine)
    out = []
    for rows in rows_list:
        xs = {i: torch.randn(rows, i, generator=gen) for i, _ in shapes}
        runs = {
            "plain": lambda xs=xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
            "packed": lambda xs=xs: [op(xs[w.shape[1]], p, None, w.shape[0], isa) for w, p in zip(weights, packed)],
            "engine": lambda xs=xs: [lin(xs[lin.in_features]) for lin in engine],
        }  # fmt: skip
        for run in runs.values():  # warm-up
            run()
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(repeats):
            for name, run in runs.items():
                best[name] = min(best[name], timed(run)[0])
        flops = linear_flops(cfg, rows)
        in_range = any_packed and rows >= PACKED_MIN_ROWS
        out.append({"rows": rows, "flops": flops, "plain_s": best["plain"], "packed_s": best["packed"],
                    "engine_s": best["engine"], "plain_gflops": flops / best["plain"] / 1e9,
                    "packed_gflops": flops / best["packed"] / 1e9, "engine_gflops": flops / best["engine"] / 1e9,
                    "packed_speedup": best["plain"] / best["packed"],
                    "engine_rows": rows if in_range else None,
                    "engine_vs_best": min(best["plain"], best["packed"]) / best["engine"]})  # fmt: skip
    return out


def gemm_peak(cfg: ModelConfig, rows: int = 512, repeats: int = 5) -> float:
    """FLOP/s of the model's own weight matrices multiplied by ``rows`` rows in fp32, the faster layout's best of
    ``repeats`` (``linear_layouts``): the compute ceiling of a prefill on this CPU."""
    row = linear_layouts(cfg, [rows], repeats)[0]
    return row["flops"] / min(row["plain_s"], row["packed_s"])


def _layers(cfg: ModelConfig, scheme: str, group_size: int, seed: int) -> list[tuple[str, nn.Module]]:
    """(kind, layer) of every matrix of the model in ``scheme``, random weights (seeded)."""
    from workbench.model.quant import Int4Linear, Int8Linear

    gen = torch.Generator().manual_seed(seed)
    kinds = [*KINDS * cfg.num_layers, "head"]
    out: list[tuple[str, nn.Module]] = []
    for kind, (fan_in, fan_out) in zip(kinds, linear_shapes(cfg)):
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


def module_bytes(m: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``m`` (what one product reads of it)."""
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


@torch.inference_mode()
def quant_sweep(
    cfg: ModelConfig,
    schemes: list[str],
    batches: list[int],
    repeats: int = 3,
    group_size: int = DEFAULT_GROUP_SIZE,
    warmup: int = 2,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per (batch, scheme): per kind ``<kind>_ms`` and ``<kind>_gb_per_s`` (medians of ``repeats`` sweeps after
    ``warmup``, the schemes interleaved), ``layers_ms``, ``layers_bytes``, ``layers_gb_per_s``, ``head_ms``,
    ``speedup_head_fp32`` and ``speedup_head_quantized`` over the first scheme."""
    bad = [s for s in schemes if s not in QUANT_SCHEMES]
    if bad or not schemes:
        raise ConfigError(f"schemes must be among {QUANT_SCHEMES}, got {schemes}")
    if repeats < 1 or warmup < 0 or not batches or any(b < 1 for b in batches):
        raise ConfigError(f"need batches >= 1, repeats >= 1 and warmup >= 0, got {batches}, {repeats}, {warmup}")
    for s in schemes:
        if s in ("int8", "int4"):
            cfg.check_quantization(s, group_size)
    sweeps = {s: _layers(cfg, s, group_size, seed) for s in schemes}
    rows: list[dict[str, Any]] = []
    for batch in batches:
        xs: dict[tuple[str, int], torch.Tensor] = {}
        times: dict[str, dict[str, list[float]]] = {s: {k: [] for k in (*KINDS, "head")} for s in sweeps}
        for i in range(warmup + repeats):  # the warm-up sweeps compile the fused loops
            for s, layers in sweeps.items():
                dtype = torch.bfloat16 if s == "bf16" else torch.float32
                spent = dict.fromkeys(times[s], 0.0)
                for kind, m in layers:
                    x = xs.setdefault((s, m.in_features), torch.randn(batch, m.in_features).to(dtype))
                    spent[kind] += timed(lambda m=m, x=x: m(x))[0]
                if i >= warmup:
                    for kind, t in spent.items():
                        times[s][kind].append(t)
        first = len(rows)
        for s, layers in sweeps.items():
            row: dict[str, Any] = {"scheme": s, "batch": batch}
            for kind in times[s]:
                t = median(times[s][kind])
                moved = sum(module_bytes(m) for k, m in layers if k == kind)
                row[f"{kind}_ms"], row[f"{kind}_bytes"], row[f"{kind}_gb_per_s"] = t * 1e3, moved, moved / t / 1e9
            row["layers_ms"] = sum(row[f"{k}_ms"] for k in KINDS)
            row["layers_bytes"] = sum(row[f"{k}_bytes"] for k in KINDS)
            row["layers_gb_per_s"] = row["layers_bytes"] / row["layers_ms"] / 1e6
            rows.append(row)
        base = rows[first]
        total = base["layers_ms"] + base["head_ms"]
        for r in rows[first:]:
            r["speedup_head_fp32"] = total / (r["layers_ms"] + base["head_ms"])  # a tied head kept unquantized
            r["speedup_head_quantized"] = total / (r["layers_ms"] + r["head_ms"])  # a quantized copy of it
    return rows
