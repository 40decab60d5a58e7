"""Serving experiments on the real engine: policies on the same workload, and a long prompt among running decodes.

Every function builds fresh engines over one loaded model (weights are shared; each engine has its own KV pool, sized
to the requests it serves: ``pool_for``), so the policies being compared see identical requests and identical weights.

The claims compare them in paired rounds (``workbench.experiments.trials``): ``policy_trial`` replays, each round,
the same slice of requests with arrivals drawn afresh from the round's seed (``reseed_arrivals``; in order of prompt
length when a long prompt must land among running decodes) under two configurations; ``long_prompt_trial`` runs
the long-prompt scenario under two configurations with the round's seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine, RunResult
from workbench.engine.metrics import requests_to_dataframe
from workbench.errors import ConfigError
from workbench.experiments.trials import LATENCY_MARGIN, Comparison, DecisionRule, Rounds
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams
from workbench.workloads import Request, gamma_arrivals

SUMMARY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2el_s")
LONG_PROMPT_TOKENS = 4  # output tokens of the long prompt of ``long_prompt_among_decodes``


def metrics_row(label: str, summary: Mapping[str, Any], num_steps: int) -> dict[str, Any]:
    """One flat row of a contract summary (``summarize``'s JSON): medians and p99s in ms, throughputs, goodput,
    SLO attainment, finished requests, steps and duration."""
    m = summary["metrics"]
    row: dict[str, Any] = {"label": label}
    for key in SUMMARY_KEYS:
        name = key.removesuffix("_s")
        row[f"{name}_median_ms"] = m[key]["median"] * 1e3
        row[f"{name}_p99_ms"] = m[key]["p99"] * 1e3
    row.update(
        request_throughput=m["request_throughput"],
        output_throughput=m["output_throughput"],
        goodput=m["goodput"],
        slo_attainment=m["slo_attainment"],
        num_finished=summary["num_finished"],
        num_preemptions=summary["num_preemptions"],
        num_steps=num_steps,
        duration_s=summary["duration_s"],
    )
    return row


def summary_row(label: str, result: RunResult, **slos: float | None) -> dict[str, Any]:
    """``metrics_row`` of an engine run."""
    return metrics_row(label, result.summary(**slos), len(result.step_log))


def pool_for(config: EngineConfig, model: Transformer, token_counts: Sequence[int]) -> EngineConfig:
    """``config`` with a KV pool of the blocks that requests of ``token_counts`` tokens each (prompt + output) need
    all at once, over the admission watermark (``blocks_over_watermark``), when ``config`` leaves the pool to its
    default (paged, no ``num_blocks``, no ``kv_cache_bytes``) and that default is larger; else ``config`` itself.
    Every request is admitted and runs as in the default pool (none waits for blocks, none is preempted), while an
    engine zero-fills its pool when built: the default (``max_num_seqs`` x ``max_model_len`` tokens, up to
    ``DEFAULT_KV_BUDGET_BYTES``) is GiBs for a model of SmolLM2-135M's KV at a context of 2,048, filled again by
    every trial of a paired round for scenarios that hold a few MiB."""
    from workbench.config import ceil_div
    from workbench.engine.scheduler import blocks_over_watermark

    if (
        config.cache != "paged"
        or config.num_blocks is not None
        or config.kv_cache_bytes is not None
        or not token_counts
    ):
        return config
    per_seq = max(ceil_div(int(n), config.block_size) for n in token_counts)
    needed = blocks_over_watermark(len(token_counts), per_seq)
    default, _ = config.cache_shape(model.config)
    return replace(config, num_blocks=needed) if needed < default else config


def engine_for(model: Transformer, config: EngineConfig, source: str | None = None, seed: int = 0) -> Engine:
    """An engine with ``config`` on ``model``; with ``config.tensor_parallel_size > 1``, an engine on that many ranks,
    each loading its shard of ``source`` (the checkpoint directory or preset ``model`` was loaded from; default: the
    preset named by its config, with ``seed``, which gives the same weights). Call ``shutdown()`` when done."""
    if config.tensor_parallel_size == 1:
        return Engine(model, config)
    return Engine.from_model(source or model.config.name, config, seed=seed)


def compare_policies(
    model: Transformer,
    configs: Mapping[str, EngineConfig],
    requests: Sequence[Request],
    slos: Mapping[str, float | None] | None = None,
    source: str | None = None,
    seed: int = 0,
) -> tuple[pd.DataFrame, dict[str, RunResult]]:
    """Replay the same workload in real time under each configuration; one summary row per label. A configuration
    with ``tensor_parallel_size > 1`` runs on that many ranks (``engine_for``: ``source`` and ``seed``)."""
    rows, results = [], {}
    for label, cfg in configs.items():
        engine = engine_for(model, pool_for(cfg, model, [r.prompt_len + r.output_len for r in requests]), source, seed)
        try:
            result = engine.replay(list(requests))
        finally:
            engine.shutdown()
        results[label] = result
        rows.append(summary_row(label, result, **(slos or {})))
    return pd.DataFrame(rows), results


def long_prompt_among_decodes(
    model: Transformer,
    config: EngineConfig,
    num_decodes: int = 4,
    decode_prompt_len: int = 16,
    decode_output_len: int = 48,
    long_prompt_len: int = 512,
    inject_after_steps: int = 8,
    seed: int = 0,
    source: str | None = None,
) -> dict[str, Any]:
    """Start ``num_decodes`` short requests, let them decode, then a ``long_prompt_len`` prompt arrives.

    Returns the step log (DataFrame), the per-request table, the TTFT of the long prompt, and the inter-token
    latencies of the running decodes while it was being prefilled (the stall that chunking removes). A ``config``
    with ``tensor_parallel_size > 1`` runs on that many ranks (``engine_for``).
    """
    import torch

    tokens = [decode_prompt_len + decode_output_len] * num_decodes + [long_prompt_len + LONG_PROMPT_TOKENS]
    engine = engine_for(model, pool_for(config, model, tokens), source)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    decode_params = SamplingParams(max_tokens=decode_output_len, ignore_eos=True)
    short_ids = [
        engine.add_request(torch.randint(0, vocab, (decode_prompt_len,), generator=g).tolist(), decode_params)
        for _ in range(num_decodes)
    ]
    finished = {}
    for _ in range(inject_after_steps):
        finished.update((o.request_id, o.result) for o in engine.step() if o.finished)
    long_id = engine.add_request(
        torch.randint(0, vocab, (long_prompt_len,), generator=g).tolist(),
        SamplingParams(max_tokens=LONG_PROMPT_TOKENS, ignore_eos=True),
    )
    while engine.has_unfinished():
        finished.update((o.request_id, o.result) for o in engine.step() if o.finished)
    engine.shutdown()
    long_seq = finished[long_id]
    shorts = [finished[i] for i in short_ids]
    # gaps between decode tokens that straddle the long prompt's arrival .. first token
    window = (long_seq.arrival_time, long_seq.first_token_time)
    stall_itls = [
        b - a for s in shorts for a, b in zip(s.token_times, s.token_times[1:]) if b > window[0] and a < window[1]
    ]
    all_itls = [b - a for s in shorts for a, b in zip(s.token_times, s.token_times[1:])]
    steps = engine.step_log.to_dataframe()
    return {
        "steps": steps,
        "requests": requests_to_dataframe([*shorts, long_seq]),
        "long_ttft_s": long_seq.first_token_time - long_seq.arrival_time,
        "stall_itl_max_s": max(stall_itls) if stall_itls else 0.0,
        "itl_p99_s": float(pd.Series(all_itls).quantile(0.99)) if all_itls else 0.0,
        "itl_median_s": float(pd.Series(all_itls).median()) if all_itls else 0.0,
        "max_step_s": float(steps.duration_s.max()),
    }


def scale_lengths(requests: Sequence[Request], factor: float, max_len: int) -> list[Request]:
    """Prompt and output lengths multiplied by ``factor`` (at least 1 token each), then clipped to ``max_len``.

    Lets a CPU serve a real trace's *shape* (arrivals unchanged, lengths in proportion) at a size it can afford;
    plain clipping instead would cut the outputs of long prompts to a single token.
    """
    from dataclasses import replace

    from workbench.errors import TraceError
    from workbench.workloads import truncate_to_context

    if not factor > 0:
        raise TraceError(f"length scale factor must be > 0, got {factor}")
    scaled = [
        replace(r, prompt_len=max(1, round(r.prompt_len * factor)), output_len=max(1, round(r.output_len * factor)),
                prompt_token_ids=None, hash_ids=None)
        for r in requests
    ]  # fmt: skip
    return truncate_to_context(scaled, max_len)


def budget_sweep(
    model: Transformer,
    config_for_budget: Any,
    budgets: Sequence[int],
    **scenario: Any,
) -> pd.DataFrame:
    """``long_prompt_among_decodes`` under the chunked scheduler for each token budget (``config_for_budget(b)``
    gives the engine config): one row per budget with ``itl_p99_ms``, ``stall_ms`` and ``long_ttft_ms``."""
    rows = []
    for budget in budgets:
        run = long_prompt_among_decodes(model, config_for_budget(budget), **scenario)
        rows.append(
            {
                "token_budget": budget,
                "itl_p99_ms": run["itl_p99_s"] * 1e3,
                "stall_ms": run["stall_itl_max_s"] * 1e3,
                "long_ttft_ms": run["long_ttft_s"] * 1e3,
            }
        )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- paired rounds


def reseed_arrivals(
    requests: Sequence[Request], seed: int, rate: float | None = None, shortest_first: bool = False
) -> list[Request]:
    """The same requests (lengths, ids) with Poisson arrivals drawn from ``seed`` at ``rate`` requests/s (default:
    the slice's own mean rate), starting at its first arrival: one round's workload of a serving trial. The requests
    take the drawn arrival times in the slice's order, or, with ``shortest_first``, in order of prompt length
    (shortest first, ties in the slice's order): every prompt then arrives after all the shorter ones, so in every
    round a long prompt comes while the most requests are decoding (the interference a chunked scheduler removes),
    not only when the draw happens to put it there; the gaps are the same draws either way (the wall clock decides
    how many are still decoding, so this makes the overlap likely, not certain). A slice whose requests all arrive
    at once (an offline batch) is returned unchanged."""
    if rate is not None and not rate > 0:
        raise ConfigError(f"arrival rate must be > 0 requests/s (or None: the slice's own), got {rate}")
    reqs = sorted(requests, key=lambda r: r.arrival_time_s)
    if len(reqs) < 2 or reqs[-1].arrival_time_s <= reqs[0].arrival_time_s:
        return list(reqs)
    if rate is None:
        rate = (len(reqs) - 1) / (reqs[-1].arrival_time_s - reqs[0].arrival_time_s)
    gaps = gamma_arrivals(len(reqs) - 1, rate, 1.0, np.random.default_rng([abs(seed), 1 if seed < 0 else 0]))
    times = [reqs[0].arrival_time_s] + [reqs[0].arrival_time_s + g for g in gaps]
    order = sorted(reqs, key=lambda r: r.prompt_len) if shortest_first else reqs
    return [replace(r, arrival_time_s=t) for r, t in zip(order, times)]


def serving_arm(
    model: Transformer,
    config: EngineConfig,
    requests: Sequence[Request],
    slos: Mapping[str, float | None] | None = None,
    seed: int = 0,
    rate: float | None = None,
    shortest_first: bool = False,
) -> Callable[[int], dict[str, float]]:
    """An arm of paired rounds: one trial replays ``requests`` with the round's arrivals (``reseed_arrivals`` with
    ``seed`` + round, at ``rate``, ``shortest_first``) on a fresh engine of ``config`` and returns ``summary_row``'s
    numbers (ms, tokens/s)."""

    config = pool_for(config, model, [r.prompt_len + r.output_len for r in requests])

    def trial(index: int) -> dict[str, float]:
        engine = engine_for(model, config)
        try:
            result = engine.replay(reseed_arrivals(requests, seed + index, rate, shortest_first))
        finally:
            engine.shutdown()
        row = summary_row("", result, **(slos or {}))
        return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and v is not None}

    return trial


def policy_trial(
    model: Transformer,
    configs: Mapping[str, EngineConfig],
    requests: Sequence[Request],
    rounds: Rounds,
    metric: str = "ttft_p99_ms",
    direction: str = "lower",
    margin: float = LATENCY_MARGIN,
    slos: Mapping[str, float | None] | None = None,
    rate: float | None = None,
    shortest_first: bool = False,
) -> Comparison:
    """Two configurations (A, B: ``configs`` in order) serving the same slice of ``requests``, paired rounds with
    fresh arrivals per round (at ``rate`` requests/s, default the slice's own mean rate; in order of prompt length
    with ``shortest_first``: ``reseed_arrivals``), decided on ``metric`` (a ``summary_row`` key) being ``direction``
    for B by more than ``margin``; ``Comparison.on`` reads the rounds' other figures.

    A slice whose arrivals are dense against the engine's speed arrives whole before the first step ends on a slow
    (busy) machine, and the policies then serve the same single batch: give a ``rate`` at which the requests arrive
    while earlier ones are still being served. A claim about what a long prompt does to running decodes (a p99 ITL
    under chunked prefill) needs it to arrive among them in every round: ``shortest_first``."""
    arms = {
        label: serving_arm(model, cfg, requests, slos, rounds.seed, rate, shortest_first)
        for label, cfg in configs.items()
    }
    return rounds.run(arms, DecisionRule(direction, margin), metric=metric)


def long_prompt_arm(model: Transformer, config: EngineConfig, **scenario: Any) -> Callable[[int], dict[str, float]]:
    """An arm of paired rounds: one trial runs ``long_prompt_among_decodes`` under ``config`` with the round's seed
    (``scenario``'s ``seed`` + round: fresh prompts, the same for both arms of a round) and returns ``stall_ms``
    (the worst decode ITL while the long prompt prefilled), ``long_ttft_ms`` and ``itl_p99_ms``."""
    base_seed = int(scenario.pop("seed", 0))

    def trial(index: int) -> dict[str, float]:
        run = long_prompt_among_decodes(model, config, seed=abs(base_seed + index), **scenario)
        return {
            "stall_ms": run["stall_itl_max_s"] * 1e3,
            "long_ttft_ms": run["long_ttft_s"] * 1e3,
            "itl_p99_ms": run["itl_p99_s"] * 1e3,
        }

    return trial


def long_prompt_trial(
    model: Transformer, configs: Mapping[str, EngineConfig], rounds: Rounds, margin: float = LATENCY_MARGIN,
    metric: str = "stall_ms", direction: str = "lower", **scenario: Any,
) -> Comparison:  # fmt: skip
    """The long-prompt scenario under two configurations (A: one-step prefill, B: chunked), paired rounds,
    decided on ``metric`` (default the stall: B lower by more than ``margin``; or ``long_ttft_ms``, "higher": the
    TTFT price, the smaller effect, so that the rounds go on until it is decided too); ``.on(...)`` decides the
    other figures from the same rounds."""
    arms = {label: long_prompt_arm(model, cfg, **scenario) for label, cfg in configs.items()}
    return rounds.run(arms, DecisionRule(direction, margin), metric=metric)


def round_medians(comparison: Comparison, control: bool = False) -> list[dict[str, Any]]:
    """One row per arm of a serving trial (``policy_trial``): ``label`` and the median over its rounds of every
    figure its trials returned (the A/A control's row only when ``control``)."""
    import statistics

    rows = []
    for name, recs in comparison.records.items():
        if name not in comparison.arms and not control:
            continue
        keys = recs[0].keys() if recs else ()
        rows.append({"label": name, **{k: statistics.median(r[k] for r in recs) for k in keys}, "rounds": len(recs)})
    return rows
