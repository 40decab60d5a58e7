"""Notebook 05: when does running prefill and decode on separate pools beat sharing one?

Two halves, as the notebook has them:

- **real, on this machine**: the same workload through one colocated engine (``continuous`` and ``chunked``, one
  process with ``threads`` torch threads) and through a disaggregated 1:1 pair (two processes of
  ``threads // 2`` threads each, the same compute; ``workbench.cluster.disagg``). ``real_comparison`` gives one row
  per setup: TTFT, ITL, TPOT and E2E percentiles, goodput under the SLOs, and the KV bytes moved and the seconds
  spent moving them.
- **at datasheet scale, simulated**: ``num_gpus`` accelerators as colocated replicas or as P:D splits, each
  layout a capacity-planner candidate (``workbench.sim.planner``: the engine's own scheduler on the calibrated
  roofline of each role's tensor-parallel size): SLO attainment and goodput per GPU against the request rate
  (DistServe's figure), against the KV link's bandwidth for one split, and with a different TP per phase.

The claims are tested on these numbers: disaggregation removes prefill-decode interference from ITL (decided in
paired rounds, ``interference_trial``: each round the same slice of a workload with fresh arrivals through the
colocated prefill-first engine, the disaggregated pair and the colocated engine again, the A/A control); it pays
only under tight TTFT and TPOT SLOs; a slow link erases it; prefill and decode want different TP sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.metrics import summarize
from workbench.experiments.claims import (
    CONFIRMED,
    INCONCLUSIVE,
    NOT_CONFIRMED,
    RATIO_KEYS,
    exact_comparison,
    exact_text,
    make_claim,
    paired_claim,
)
from workbench.experiments.serving import metrics_row, reseed_arrivals, summary_row
from workbench.experiments.trials import LATENCY_MARGIN, Comparison, DecisionRule, Rounds
from workbench.request import SamplingParams
from workbench.timing import using_threads
from workbench.workloads import Request, prompt_token_ids


# ---- real: colocated against disaggregated --------------------------------------------------------------------
def open_pair(source: str, engine_config: EngineConfig, threads: int = 2, seed: int = 0) -> Any:
    """The disaggregated 1:1 pair of ``real_comparison`` and ``interference_trial``: a started ``DisaggCluster`` of
    two processes loading ``source``, ``threads // 2`` threads each, both engines configured by ``engine_config``
    (close it, or use it as a context manager)."""
    from workbench.cluster.disagg import DisaggCluster, DisaggConfig

    cfg = DisaggConfig(prefill=engine_config, decode=engine_config, threads_per_engine=max(1, threads // 2))
    return DisaggCluster(source, cfg, seed)


def real_comparison(
    source: str,
    model: Any,
    workloads: Mapping[str, Sequence[Request]],
    engine_config: EngineConfig,
    chunk_budget: int,
    threads: int = 2,
    seed: int = 0,
    slos: Mapping[str, float | None] | None = None,
    cluster: Any = None,
) -> pd.DataFrame:
    """Each workload through colocated ``continuous`` and ``chunked`` engines on ``model`` (the loaded
    ``source``; one process, ``threads`` threads) and through one disaggregated 1:1 pair (``open_pair``, started
    once for all workloads, or ``cluster`` when given, left open); one row per workload and setup, with
    ``kv_bytes`` and ``kv_transfer_ms`` for the disaggregated ones. Every engine gets the pool ``engine_config``
    sizes, so give it a ``num_blocks`` the workload needs rather than the default (which reserves
    ``max_num_seqs x max_model_len`` tokens per engine)."""
    import contextlib
    import dataclasses

    slos = dict(slos or {})
    setups = {
        "colocated continuous": dataclasses.replace(engine_config, policy="continuous"),
        f"colocated chunked ({chunk_budget})": dataclasses.replace(
            engine_config, policy="chunked", token_budget=chunk_budget, chunk_size=chunk_budget
        ),
    }
    rows = []
    with using_threads(threads):
        for name, requests in workloads.items():
            for label, cfg in setups.items():
                result = Engine(model, cfg).replay(list(requests), seed=seed)  # a fresh pool per run, same weights
                rows.append({"workload": name} | summary_row(label, result, **slos) | {"processes": 1,
                            "threads_each": threads})  # fmt: skip
    vocab = model.config.vocab_size
    opened = contextlib.nullcontext(cluster) if cluster is not None else open_pair(source, engine_config, threads, seed)
    with opened as cluster:
        for name, requests in workloads.items():
            work = [
                (
                    list(r.prompt_token_ids or prompt_token_ids(r, vocab, seed)),
                    SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                    r.arrival_time_s,
                )
                for r in requests
            ]
            result = cluster.run(work, online=True)
            summary = summarize(result.requests, duration_s=result.duration_s, **slos)
            kv = result.kv_transfer()
            steps = sum(p["num_steps"] for p in result.pools.values())
            rows.append(
                {"workload": name}
                | metrics_row("disaggregated 1:1", summary, steps)
                | {
                    "processes": 2,
                    "threads_each": cluster.cfg.threads_per_engine,
                    "kv_bytes": kv["bytes"],
                    "kv_transfer_ms": kv["seconds"] * 1e3,
                    "num_backpressure": kv["num_backpressure"],
                }
            )
    return pd.DataFrame(rows)


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and v is not None}


def interference_trial(
    source: str,
    model: Any,
    requests: Sequence[Request],
    engine_config: EngineConfig,
    rounds: Rounds,
    threads: int = 2,
    seed: int = 0,
    slos: Mapping[str, float | None] | None = None,
    margin: float = LATENCY_MARGIN,
    cluster: Any = None,
) -> Comparison:
    """The colocated prefill-first engine (A: one process, ``threads`` threads) against the disaggregated 1:1 pair
    (B: ``open_pair``, started once for all rounds, or ``cluster`` when given, left open) on
    the same slice of ``requests``, each round with arrivals drawn afresh (``reseed_arrivals``, ``seed`` + round),
    in paired rounds decided on the p99 ITL (B lower by more than ``margin``); the A/A control is the colocated
    engine again. Every figure of ``metrics_row`` is in the rounds' records (``Comparison.on``)."""
    import contextlib
    import dataclasses

    slos = dict(slos or {})
    colocated = dataclasses.replace(engine_config, policy="continuous")
    vocab = model.config.vocab_size

    def colocated_arm(index: int) -> dict[str, float]:
        with using_threads(threads):
            result = Engine(model, colocated).replay(reseed_arrivals(requests, seed + index), seed=seed)
        return _numbers(summary_row("", result, **slos))

    opened = contextlib.nullcontext(cluster) if cluster is not None else open_pair(source, engine_config, threads, seed)
    with opened as cluster:

        def disaggregated_arm(index: int) -> dict[str, float]:
            work = [
                (list(r.prompt_token_ids or prompt_token_ids(r, vocab, seed)),
                 SamplingParams(max_tokens=r.output_len, ignore_eos=True), r.arrival_time_s)
                for r in reseed_arrivals(requests, seed + index)
            ]  # fmt: skip
            result = cluster.run(work, online=True)
            summary = summarize(result.requests, duration_s=result.duration_s, **slos)
            steps = sum(p["num_steps"] for p in result.pools.values())
            return _numbers(metrics_row("", summary, steps))

        arms = {"colocated continuous": colocated_arm, "disaggregated 1:1": disaggregated_arm}
        return rounds.run(arms, DecisionRule("lower", margin), metric="itl_p99_ms")


# ---- simulated: a node of accelerators -------------------------------------------------------------------------
def node_layouts(num_replicas: int) -> dict[str, tuple[int, int] | None]:
    """``colocated xN`` (N replicas, None) and every ``P:D`` split of the node's replicas (P + D = N)."""
    layouts: dict[str, tuple[int, int] | None] = {f"colocated x{num_replicas}": None}
    for p in range(1, num_replicas):
        layouts[f"{p}:{num_replicas - p}"] = (p, num_replicas - p)
    return layouts


def _settings(model: str, hardware: str, slos: Mapping[str, float], link_gbps: float, dtype: str) -> Any:
    from workbench.sim.planner import PlanSettings

    return PlanSettings(model, hardware, slos["slo_ttft_s"], slos["slo_tpot_s"], dtype=dtype, link_gbps=link_gbps)


def simulate_layout(
    requests: Sequence[Request],
    model: str,
    hardware: str,
    num_gpus: int,
    split: tuple[int, int] | None,
    slos: Mapping[str, float],
    link_gbps: float = 400.0,
    dtype: str = "bf16",
    policy: str = "continuous",
    tp: int = 1,
) -> dict[str, Any]:
    """One simulated run of ``num_gpus`` accelerators as replicas of ``tp`` GPUs each, colocated (``split`` None)
    or split into (P, D) prefill and decode replicas. It is a capacity-planner candidate
    (``workbench.sim.planner.evaluate``): the calibrated roofline that ``workbench simulate`` uses by default
    (per-kernel floor, matrix-product efficiency by size, host time per step, TP all-reduces); a layout that does
    not fit raises ``ConfigError`` with the planner's reason."""
    from workbench.errors import ConfigError
    from workbench.sim.planner import Candidate, evaluate

    if split is None:
        cand = Candidate(tp=tp, replicas=num_gpus // tp, policy=policy)
    else:
        cand = Candidate(tp=tp, disaggregate=tuple(split), prefill_tp=tp, decode_tp=tp, policy=policy)
    if cand.num_gpus != num_gpus:
        raise ConfigError(f"{split or 'colocated'} replicas of TP {tp} use {cand.num_gpus} GPUs, not {num_gpus}")
    r = evaluate(cand, list(requests), _settings(model, hardware, slos, link_gbps, dtype))
    if r["status"] != "ok":
        raise ConfigError(f"{cand.name}: {r['reason']}")
    return _metrics(r)


def _metrics(r: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of a planner row (``workbench.sim.planner.evaluate``) that this notebook tabulates, in ms."""
    return {
        "ttft_p90_ms": r["ttft_p90_s"] * 1e3,
        "tpot_p90_ms": r["tpot_p90_s"] * 1e3,
        "slo_attainment": r["slo_attainment"],
        "goodput": r["goodput"],
        "goodput_per_gpu": r["goodput_per_gpu"],
    }


def rate_sweep(
    requests: Sequence[Request],
    rates: Sequence[float],
    model: str,
    hardware: str,
    num_gpus: int,
    slos: Mapping[str, float],
    link_gbps: float = 400.0,
    layouts: Mapping[str, tuple[int, int] | None] | None = None,
    tp: int = 1,
) -> pd.DataFrame:
    """SLO attainment and goodput per GPU of every layout (replicas of ``tp`` GPUs) at every request rate
    (DistServe's figure 1 style)."""
    from workbench.sim.capacity import rate_scaled

    rows = []
    for rate in rates:
        work = rate_scaled(list(requests), rate)
        for label, split in (layouts or node_layouts(num_gpus // tp)).items():
            row = simulate_layout(work, model, hardware, num_gpus, split, slos, link_gbps, tp=tp)
            rows.append({"layout": label, "rate": rate, **row})
    return pd.DataFrame(rows)


def link_sweep(
    requests: Sequence[Request],
    rate: float,
    model: str,
    hardware: str,
    num_gpus: int,
    split: tuple[int, int],
    slos: Mapping[str, float],
    link_gbps: Sequence[float],
    tp: int = 1,
) -> pd.DataFrame:
    """Goodput per GPU of one split against the KV link's bandwidth, beside the colocated node's (a constant)."""
    from workbench.sim.capacity import rate_scaled

    work = rate_scaled(list(requests), rate)
    colocated = simulate_layout(work, model, hardware, num_gpus, None, slos, tp=tp)
    rows = []
    for gbps in link_gbps:
        row = simulate_layout(work, model, hardware, num_gpus, split, slos, gbps, tp=tp)
        rows.append({"link_gbps": gbps, **row, "colocated_goodput_per_gpu": colocated["goodput_per_gpu"]})
    return pd.DataFrame(rows)


def best_layouts(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per rate: the best colocated and the best disaggregated goodput per GPU."""
    out = []
    for rate, group in sweep.groupby("rate"):
        colo = group[group.layout.str.startswith("colocated")]
        dis = group[~group.layout.str.startswith("colocated")]
        best = dis.loc[dis.goodput_per_gpu.idxmax()]
        out.append(
            {
                "rate": rate,
                "colocated_goodput_per_gpu": float(colo.goodput_per_gpu.max()),
                "best_split": best.layout,
                "split_goodput_per_gpu": float(best.goodput_per_gpu),
            }
        )
    return pd.DataFrame(out)


# ---- simulated: a different tensor-parallel size per phase ----------------------------------------------------
def tp_sweep(
    requests: Sequence[Request],
    rates: Sequence[float],
    model: str,
    hardware: str,
    num_gpus: int,
    slos: Mapping[str, float],
    tps: Sequence[int],
    link_gbps: float = 400.0,
    dtype: str = "bf16",
) -> pd.DataFrame:
    """Goodput per GPU at every rate of every way to fill the node with replicas of the tensor-parallel sizes
    ``tps``: colocated (``4xTP2``: 4 replicas of 2 GPUs), split with one TP for both phases, split with a TP per
    phase (``P2xTP2:D4xTP1``). Each layout is a capacity-planner candidate (``workbench.sim.planner``: the
    calibrated roofline of each role's own TP, ``continuous``), run serially; a layout whose weights and KV do not
    fit is left out. DistServe's placement search (Zhong et al., OSDI 2024) asks the same question per phase."""
    from workbench.sim.capacity import rate_scaled
    from workbench.sim.planner import candidates, evaluate

    layouts = [c for c in candidates(num_gpus, tps, pps=(1,), policies=("continuous",), all_replica_counts=False)
               if c.num_gpus == num_gpus]  # fmt: skip
    settings = _settings(model, hardware, slos, link_gbps, dtype)
    rows = []
    for rate in rates:
        work = rate_scaled(list(requests), rate)
        for cand in layouts:
            r = evaluate(cand, work, settings)
            if r["status"] != "ok":
                continue
            rows.append({
                "layout": cand.name.removesuffix(" continuous"), "rate": rate, "split": cand.disaggregate is not None,
                "prefill_tp": cand.prefill_tp or cand.tp, "decode_tp": cand.decode_tp or cand.tp, **_metrics(r),
            })  # fmt: skip
    return pd.DataFrame(rows)


def best_by_tp(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per rate: the best layout with one TP for both phases (colocated or split) and the best with a TP per phase."""
    out = []
    for rate, group in sweep.groupby("rate"):
        same = group[group.prefill_tp == group.decode_tp]
        per_phase = group[group.prefill_tp != group.decode_tp]
        row: dict[str, Any] = {"rate": rate}
        for name, part in (("one_tp", same), ("tp_per_phase", per_phase)):
            best = part.loc[part.goodput_per_gpu.idxmax()] if not part.empty else None
            row[f"{name}_layout"] = None if best is None else best.layout
            row[f"{name}_goodput_per_gpu"] = float("nan") if best is None else float(best.goodput_per_gpu)
        out.append(row)
    return pd.DataFrame(out)


# ---- claims ------------------------------------------------------------------------------------------------------
def removes_interference(comparison: Comparison) -> dict[str, Any]:
    """Disaggregation removes prefill-decode interference from ITL: its p99 ITL is below the colocated
    (prefill-first) engine's by more than the rule's margin, in paired rounds (``interference_trial``)."""
    what = "p99 ITL, the disaggregated 1:1 pair against the colocated prefill-first engine (the same compute)"
    return paired_claim("Disaggregation removes prefill-decode interference from ITL", comparison, what)


def _exact_evidence(comparison: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """The top-level evidence keys of a claim decided on exact figures (``exact_comparison``): its ``RATIO_KEYS``
    (arms, ratio, the zero-width interval, rounds 0, margin, confidence None, direction) and the reason of its
    verdict."""
    return {k: comparison[k] for k in RATIO_KEYS} | {"reason": reason}


def _only_where(here: Mapping[str, Any], there: Mapping[str, Any], here_name: str, also_there: str) -> tuple[str, str]:
    """Verdict and reason of a claim "the effect holds here and not there" from two ``exact_comparison`` results:
    confirmed when ``here`` is and ``there`` is not; else not confirmed, saying why (``here``'s own reason, or
    ``also_there``)."""
    if here["verdict"] != CONFIRMED:
        return NOT_CONFIRMED, f"{here_name}: {here['reason']}"
    if there["verdict"] == CONFIRMED:
        return NOT_CONFIRMED, also_there
    return CONFIRMED, "beyond the margin in the claimed direction"


def pays_under_tight_slos(tight: pd.DataFrame, loose: pd.DataFrame) -> dict[str, Any]:
    """Disaggregation pays only under tight TTFT and TPOT SLOs: at the highest rate swept, the best split's
    goodput per GPU beats colocation by more than 10% under the tight SLOs, and does not under the loose ones
    (``best_layouts`` tables of the two sweeps). The simulator is deterministic, so each comparison is decided on
    its exact figures (``exact_comparison``): not confirmed when the split does not beat colocation under the tight
    SLOs (``equivalent`` within 10%, or ``opposite``) or beats it under the loose ones too."""
    t, lo = tight.iloc[-1], loose.iloc[-1]
    tight_c = exact_comparison("colocated", t.colocated_goodput_per_gpu, f"split {t.best_split}",
                               t.split_goodput_per_gpu, "higher")  # fmt: skip
    loose_c = exact_comparison("colocated", lo.colocated_goodput_per_gpu, f"split {lo.best_split}",
                               lo.split_goodput_per_gpu, "higher")  # fmt: skip
    verdict, reason = _only_where(tight_c, loose_c, "tight SLOs", "it pays under the loose SLOs too")
    detail = (
        f"at {t.rate:g} req/s, goodput per GPU split {t.split_goodput_per_gpu:.2f} ({t.best_split}) vs colocated "
        f"{t.colocated_goodput_per_gpu:.2f} under the tight SLOs ({exact_text(tight_c)}); "
        f"{lo.split_goodput_per_gpu:.2f} vs {lo.colocated_goodput_per_gpu:.2f} under the loose ones "
        f"({exact_text(loose_c)}); the simulator is deterministic: exact figures, no rounds"
    )
    evidence = {
        **_exact_evidence(tight_c, reason),
        "rate": float(t.rate),
        "tight_split": float(t.split_goodput_per_gpu),
        "tight_colocated": float(t.colocated_goodput_per_gpu),
        "loose_split": float(lo.split_goodput_per_gpu),
        "loose_colocated": float(lo.colocated_goodput_per_gpu),
        "tight": tight_c,
        "loose": loose_c,
    }
    return make_claim("Disaggregation pays only under tight TTFT and TPOT SLOs", verdict, evidence, detail,
                      uses=("simulation",))  # fmt: skip


def slow_link_erases_it(links: pd.DataFrame) -> dict[str, Any]:
    """A slow KV link erases disaggregation's gain: at the slowest link swept the split's goodput per GPU is below
    the colocated node's by more than 10%, at the fastest it is not (``link_sweep``; exact figures of the
    deterministic simulator, ``exact_comparison``)."""
    links = links.sort_values("link_gbps")
    slow, fast = links.iloc[0], links.iloc[-1]
    colocated = float(slow.colocated_goodput_per_gpu)
    slow_c = exact_comparison("colocated", colocated, f"split over {slow.link_gbps:g} Gb/s",
                              float(slow.goodput_per_gpu), "lower")  # fmt: skip
    fast_c = exact_comparison("colocated", colocated, f"split over {fast.link_gbps:g} Gb/s",
                              float(fast.goodput_per_gpu), "lower")  # fmt: skip
    verdict, reason = _only_where(slow_c, fast_c, "slowest link", "the fastest link loses too")
    detail = (
        f"goodput per GPU {slow.goodput_per_gpu:.2f} over {slow.link_gbps:g} Gb/s ({exact_text(slow_c)}) and "
        f"{fast.goodput_per_gpu:.2f} over {fast.link_gbps:g} Gb/s ({exact_text(fast_c)}), against {colocated:.2f} "
        "colocated"
    )
    evidence = {
        **_exact_evidence(slow_c, reason),
        "slow_gbps": float(slow.link_gbps),
        "slow": float(slow.goodput_per_gpu),
        "fast_gbps": float(fast.link_gbps),
        "fast": float(fast.goodput_per_gpu),
        "colocated": colocated,
    }
    return make_claim("A slow KV link erases disaggregation's gain", verdict, evidence, detail, uses=("simulation",))


def break_even_link_gbps(links: pd.DataFrame) -> float | None:
    """The slowest link swept at which the split's goodput per GPU reaches the colocated node's (None: none)."""
    ok = links[links.goodput_per_gpu >= links.colocated_goodput_per_gpu].sort_values("link_gbps")
    return None if ok.empty else float(ok.iloc[0].link_gbps)


def tp_per_phase_pays(best: pd.DataFrame) -> dict[str, Any]:
    """Prefill and decode want different tensor-parallel sizes (DistServe): at some rate swept, the best layout
    with a TP per phase beats the best with one TP for both by more than 10% of goodput per GPU (``best_by_tp``).
    10% is about the simulator's held-out median error on GPUs: a smaller gap is not a finding. The simulator is
    deterministic, so each rate is decided on its exact figures (``exact_comparison``): not confirmed when no rate
    shows the gain (``equivalent`` when the best rate is within 10%, ``opposite`` when every rate is below)."""
    best = best.dropna(subset=["one_tp_goodput_per_gpu", "tp_per_phase_goodput_per_gpu"])
    if best.empty:
        return make_claim("Prefill and decode want different tensor-parallel sizes", INCONCLUSIVE,
                          {"no_ratio": "no rate had both kinds of layout to compare"},
                          "no rate had both kinds of layout", uses=("simulation",))  # fmt: skip
    comps = [exact_comparison(f"one TP ({r.one_tp_layout})", r.one_tp_goodput_per_gpu,
                              f"a TP per phase ({r.tp_per_phase_layout})", r.tp_per_phase_goodput_per_gpu, "higher")
             for r in best.itertuples()]  # fmt: skip
    rank = {CONFIRMED: 2, "equivalent": 1, "opposite": 0}
    score = [rank[c["verdict"]] if c["verdict"] == CONFIRMED else rank[c["reason"]] for c in comps]
    gains = [c["ratio"] if c["ratio"] is not None else float("inf") for c in comps]
    i = max(range(len(comps)), key=lambda j: (score[j], gains[j]))  # the rate that says most
    top, top_c = best.iloc[i], comps[i]
    verdict = CONFIRMED if top_c["verdict"] == CONFIRMED else NOT_CONFIRMED
    detail = (
        f"at {top.rate:g} req/s, {top.tp_per_phase_layout} gives {top.tp_per_phase_goodput_per_gpu:.2f} good "
        f"requests/s per GPU against {top.one_tp_goodput_per_gpu:.2f} for {top.one_tp_layout} ({exact_text(top_c)})"
        + ("" if verdict == CONFIRMED else "; no rate swept shows a gain beyond 10%")
    )
    evidence = {
        **_exact_evidence(top_c, top_c["reason"]),
        "rate": float(top.rate),
        "tp_per_phase_layout": top.tp_per_phase_layout,
        "tp_per_phase": float(top.tp_per_phase_goodput_per_gpu),
        "one_tp_layout": top.one_tp_layout,
        "one_tp": float(top.one_tp_goodput_per_gpu),
    }
    return make_claim("Prefill and decode want different tensor-parallel sizes", verdict, evidence, detail,
                      uses=("simulation",))  # fmt: skip
