"""The engine's compiled steps against its eager ones, interleaved (``workbench bench compiled``).

Over the engine of ``workbench bench offline`` (``workbench.bench.bench_engine``, packed linears on) and its one KV
pool:

- ``decode_steps``: per batch size, one pure decode step at ``context`` tokens per sequence through an eager and a
  compiled decode executor (``workbench.engine.decode_step``) and, with ``mm``, a compiled one on a second copy of
  the model without packed linears (inductor multiplies with ``aten.mm``); the executors in turn (ABAB...),
  ``repeats`` x 5 steps each: median ms and each one's largest logit difference from eager.
- ``prefill_steps``: per token count, one ragged step of that many new tokens over four fresh prompts, eager and
  compiled (``workbench.engine.prefill_step``) in turn, ``repeats`` x 3 steps each: medians, the ratio, the largest
  difference of the hidden states.
- ``offline_decode``: the offline set, the engine's decode executor eager and compiled in turn, ``repeats`` times
  each: median wall time, the ratio, whether the tokens are the same (greedy) and the graphs compiled while timed
  (0: every bucket was compiled before).
- ``offline_prefill``: per policy, the offline set with the ragged-step executor eager and compiled in turn: median
  wall time and the model's seconds in prefill-only, mixed and pure-decode steps (``ModelRunner.time_model``).

``compile=False`` builds the "compiled" arm eagerly too: an A/A run of the same harness (identical tokens, zero
differences), without inductor's minutes of compilation. Every time goes through ``workbench.timing``.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.bench import bench_engine, load_bench_model, run_engine_offline, step_kind
from workbench.engine.decode_step import DecodeStep
from workbench.engine.engine import Engine
from workbench.engine.prefill_step import PrefillStep, num_compiled_graphs
from workbench.model.transformer import Transformer
from workbench.timing import median, timed


def decode_executors(
    model: Transformer, engine: Engine, batches: list[int], compile: bool = True, mm_model: str | None = None
) -> tuple[dict[str, tuple[DecodeStep, Engine]], dict[str, Any]]:
    """The decode executors compared, by name (each with the engine whose pool it uses), and their start-up:
    ``buckets``, ``compile_s`` per bucket and ``startup_s``; with ``mm_model`` (the model's preset or checkpoint,
    loaded again: the engine packs its own model's linears) also ``compiled mm`` and its ``mm_compile_s``,
    ``mm_startup_s``."""
    cfg = engine.config
    n, max_len, mode = cfg.max_num_seqs, cfg.max_model_len, "compile" if compile else "eager"
    eager = DecodeStep(model, engine.cache, engine.backend, "eager", n, max_len)
    compiled = DecodeStep(model, engine.cache, engine.backend, mode, n, max_len)
    startup_s, compile_s = timed(compiled.warmup)
    info: dict[str, Any] = {"buckets": compiled.buckets, "compile_s": compile_s, "startup_s": startup_s}
    executors = {"eager": (eager, engine), "compiled": (compiled, engine)}
    if mm_model is not None:
        plain = load_bench_model(mm_model, "fp32", "cpu")
        plain_engine = bench_engine(plain, n, max_len, packed_linears=False)
        step = DecodeStep(plain, plain_engine.cache, plain_engine.backend, mode, n, max_len)
        info["mm_startup_s"], info["mm_compile_s"] = timed(lambda: step.warmup(batches))
        executors["compiled mm"] = (step, plain_engine)
    return executors, info


@torch.inference_mode()
def decode_steps(
    executors: dict[str, tuple[DecodeStep, Engine]], batches: list[int], context: int, repeats: int
) -> dict[int, dict[str, Any]]:
    """Per batch size: ``padded_to`` (the compiled bucket), ``<name>_ms`` medians and ``<name>_max_logit_diff``
    against eager; sequence i owns blocks [i * per_seq, (i + 1) * per_seq) of each pool."""
    eager_step, engine = executors["eager"]
    bs, vocab = engine.cache.block_size, eager_step.model.config.vocab_size
    per_seq = -(-context // bs)
    out: dict[int, dict[str, Any]] = {}
    for b in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        seq_lens, tokens = [context] * b, [(7 * i + 3) % vocab for i in range(b)]
        times: dict[str, list[float]] = {k: [] for k in executors}
        logits: dict[str, torch.Tensor] = {}
        for _ in range(repeats):
            for name, (step, _) in executors.items():
                for _ in range(5):
                    t, logits[name] = timed(lambda step=step: step.run(tokens, seq_lens, tables))  # noqa: B023
                    times[name].append(t)
        out[b] = {
            "padded_to": executors["compiled"][0].padded_batch(b),
            **{f"{name}_ms": 1e3 * median(t) for name, t in times.items()},
            **{f"{name}_max_logit_diff": float((logits[name] - logits["eager"]).abs().max()) for name in executors},
        }
    return out


def offline_decode(
    model: Transformer, engine: Engine, executors: dict[str, tuple[DecodeStep, Engine]],
    requests: list[tuple[list[int], int]], repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """The offline set with the engine's decode executor eager and compiled in turn (``repeats`` each)."""
    n = engine.config.max_num_seqs
    run_engine_offline(model, requests[:4], n, engine)  # warm-up
    graphs_before = num_compiled_graphs()
    walls: dict[str, list[float]] = {"eager": [], "compiled": []}
    tokens_of: dict[str, list] = {}
    for _ in range(repeats):
        for name in walls:
            engine.runner.decode = engine.decode = executors[name][0]
            t, tokens_of[name] = run_engine_offline(model, requests, n, engine)
            walls[name].append(t)
    engine.runner.decode = engine.decode = executors["eager"][0]
    out_tokens = sum(k for _, k in requests)
    return {
        "output_tokens": out_tokens,
        "eager_times_s": walls["eager"],
        "compiled_times_s": walls["compiled"],
        "eager_tok_s": out_tokens / median(walls["eager"]),
        "compiled_tok_s": out_tokens / median(walls["compiled"]),
        "speedup": median(walls["eager"]) / median(walls["compiled"]),
        "identical_tokens": tokens_of["eager"] == tokens_of["compiled"],
        "graphs_compiled_during_timing": num_compiled_graphs() - graphs_before,
    }


def prefill_executors(engine: Engine, compile: bool = True) -> tuple[dict[str, PrefillStep], dict[str, Any]]:
    """The engine's own ragged-step executor (eager) and a compiled one over the same pool, every token-count range
    compiled first: (executors, ``{"warmup_s", "compile_s"}``)."""
    compiled = PrefillStep(engine.model, engine.cache, engine.backend, compile=compile)
    warmup_s, compile_s = timed(lambda: compiled.warmup(engine.token_budget))
    return {"eager": PrefillStep(engine.model, engine.cache, engine.backend, compile=False), "compiled": compiled}, {
        "warmup_s": warmup_s,
        "compile_s": compile_s,
    }


@torch.inference_mode()
def prefill_steps(steps: dict[str, PrefillStep], token_counts: list[int], repeats: int) -> list[dict[str, Any]]:
    """Per token count n: one ragged step of n new tokens over four fresh prompts (n // 4 each, the remainder on the
    first), eager and compiled in turn: ``eager_ms``, ``compiled_ms``, ``speedup``, ``max_abs_diff``."""
    from workbench.model.attention import build_metadata

    step0 = steps["eager"]
    bs, vocab = step0.cache.block_size, step0.model.config.vocab_size
    rows = []
    for n in token_counts:
        lens = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
        lens = [q for q in lens if q > 0]
        tables, first = [], 0
        for q in lens:
            tables.append(list(range(first, first + -(-q // bs))))
            first += len(tables[-1])
        meta = build_metadata(lens, lens, tables, bs)
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {name: [] for name in steps}
        hidden: dict[str, torch.Tensor] = {}
        for _ in range(repeats):
            for name, step in steps.items():
                for _ in range(3):
                    t, hidden[name] = timed(lambda step=step: step.run(ids, meta))  # noqa: B023
                    times[name].append(t)
        row = {"tokens": n, **{f"{k}_ms": median(v) * 1e3 for k, v in times.items()}}
        row["speedup"] = row["eager_ms"] / row["compiled_ms"]
        row["max_abs_diff"] = float((hidden["eager"] - hidden["compiled"]).abs().max())
        rows.append(row)
    return rows


def offline_prefill(
    model: Transformer, engine: Engine, steps: dict[str, PrefillStep], requests: list[tuple[list[int], int]],
    repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """The offline set with the ragged-step executor eager and compiled in turn: per arm the medians of ``wall_s``
    and of the model's seconds in ``prefill``, ``mixed`` and ``decode`` steps (and every run), ``speedup_wall`` and
    ``identical_tokens``."""
    n = engine.config.max_num_seqs
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
    tokens: dict[str, list] = {}
    engine.runner.time_model = True
    for step in steps.values():  # warm-up of each (a few requests)
        engine.runner.prefill = step
        run_engine_offline(model, requests[:4], n, engine)
    try:
        for _ in range(repeats):
            for name, step in steps.items():
                engine.runner.prefill = step
                by_kind = {"prefill": 0.0, "mixed": 0.0, "decode": 0.0}

                def record(plan: Any, rec: Any, by_kind: dict = by_kind) -> None:
                    # pure decodes of any batch size together
                    kind = step_kind(rec.num_prefill_tokens, rec.num_decode_tokens).split()[0]
                    by_kind[kind] += engine.runner.last_model_s

                engine.on_step = record
                wall, tokens[name] = run_engine_offline(model, requests, n, engine)
                runs[name].append({"wall_s": wall, **{f"{k}_model_s": v for k, v in by_kind.items()}})
    finally:
        engine.on_step, engine.runner.time_model = None, False
    summary: dict[str, Any] = {
        name: {key: median([r[key] for r in rs]) for key in rs[0]} | {"runs": rs} for name, rs in runs.items()
    }
    summary["speedup_wall"] = summary["eager"]["wall_s"] / summary["compiled"]["wall_s"]
    summary["identical_tokens"] = tokens["eager"] == tokens["compiled"]
    return summary
