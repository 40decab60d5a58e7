"""Notebook 05: when does running prefill and decode on separate pools beat sharing one?

Two halves, as the notebook has them:

- **real, on this machine**: the same workload through one colocated engine (``continuous`` and ``chunked``, one
  process with ``threads`` torch threads) and through a disaggregated 1:1 pair (two processes of
  ``threads // 2`` threads each, the same compute; ``workbench.dist.disagg``). ``real_comparison`` gives one row
  per setup: TTFT, ITL, TPOT and E2E percentiles, goodput under the SLOs, and the KV bytes moved and the seconds
  spent moving them.
- **at datasheet scale, simulated**: ``num_gpus`` accelerators as colocated replicas or as P:D splits
  (``workbench.sim``, the engine's own scheduler on a roofline cost model): SLO attainment and goodput per GPU
  against the request rate (DistServe's figure), and against the KV link's bandwidth for one split.

The claims (``disaggregation_claims``) are tested on these numbers: disaggregation removes prefill-decode
interference from ITL; it pays only under tight TTFT and TPOT SLOs; a slow link erases it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.metrics import summarize
from workbench.experiments.claims import CONFIRMED, INCONCLUSIVE, NOT_CONFIRMED, make_claim, order_single
from workbench.experiments.serving import metrics_row, summary_row
from workbench.request import SamplingParams
from workbench.workloads import Request, prompt_token_ids


# ---- real: colocated against disaggregated --------------------------------------------------------------------
def real_comparison(
    source: str,
    model: Any,
    workloads: Mapping[str, Sequence[Request]],
    engine_config: EngineConfig,
    chunk_budget: int,
    threads: int = 2,
    seed: int = 0,
    slos: Mapping[str, float | None] | None = None,
) -> pd.DataFrame:
    """Each workload through colocated ``continuous`` and ``chunked`` engines on ``model`` (the loaded
    ``source``; one process, ``threads`` threads) and through one disaggregated 1:1 pair (two processes loading
    ``source``, ``threads // 2`` threads each, started once for all workloads); one row per workload and setup, with
    ``kv_bytes`` and ``kv_transfer_ms`` for the disaggregated ones. Every engine gets the pool ``engine_config``
    sizes, so give it a ``num_blocks`` the workload needs rather than the default (which reserves
    ``max_num_seqs x max_model_len`` tokens per engine)."""
    import dataclasses

    import torch

    from workbench.dist.disagg import DisaggCluster, DisaggConfig

    slos = dict(slos or {})
    setups = {
        "colocated continuous": dataclasses.replace(engine_config, policy="continuous"),
        f"colocated chunked ({chunk_budget})": dataclasses.replace(
            engine_config, policy="chunked", token_budget=chunk_budget, chunk_size=chunk_budget
        ),
    }
    rows = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, requests in workloads.items():
            for label, cfg in setups.items():
                result = Engine(model, cfg).replay(list(requests), seed=seed)  # a fresh pool per run, same weights
                rows.append({"workload": name} | summary_row(label, result, **slos) | {"processes": 1,
                            "threads_each": threads})  # fmt: skip
    finally:
        torch.set_num_threads(before)
    vocab = model.config.vocab_size
    cfg = DisaggConfig(prefill=engine_config, decode=engine_config, threads_per_engine=max(1, threads // 2))
    with DisaggCluster(source, cfg, seed) as cluster:
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
                    "threads_each": cfg.threads_per_engine,
                    "kv_bytes": kv["bytes"],
                    "kv_transfer_ms": kv["seconds"] * 1e3,
                    "num_backpressure": kv["num_backpressure"],
                }
            )
    return pd.DataFrame(rows)


# ---- simulated: a node of accelerators -------------------------------------------------------------------------
def node_layouts(num_gpus: int) -> dict[str, tuple[int, int] | None]:
    """``colocated xN`` (N replicas, None) and every ``P:D`` split of the node (P + D = N)."""
    layouts: dict[str, tuple[int, int] | None] = {f"colocated x{num_gpus}": None}
    for p in range(1, num_gpus):
        layouts[f"{p}:{num_gpus - p}"] = (p, num_gpus - p)
    return layouts


def simulate_layout(
    requests: Sequence[Request],
    model: str,
    hardware: str,
    num_gpus: int,
    split: tuple[int, int] | None,
    slos: Mapping[str, float | None],
    link_gbps: float = 400.0,
    dtype: str = "bf16",
    policy: str = "continuous",
) -> dict[str, Any]:
    """One simulated run of ``num_gpus`` accelerators (one replica each) laid out as ``split`` or colocated."""
    from workbench.sim.cluster import SimConfig, simulate
    from workbench.sim.costmodel import RooflineCostModel

    cost = RooflineCostModel(model, hardware, dtype=dtype)
    if split is None:
        cfg = SimConfig(num_replicas=num_gpus, router="least-outstanding", dtype=dtype, policy=policy)
    else:
        cfg = SimConfig(disaggregate=split, router="least-outstanding", link_gbps=link_gbps, dtype=dtype,
                        policy=policy)  # fmt: skip
    summary = simulate(list(requests), model, cost, cfg, hardware=hardware).summary(**slos)
    m = summary["metrics"]
    return {
        "ttft_p90_ms": m["ttft_s"]["p90"] * 1e3,
        "tpot_p90_ms": m["tpot_s"]["p90"] * 1e3,
        "slo_attainment": m["slo_attainment"],
        "goodput": m["goodput"],
        "goodput_per_gpu": (m["goodput"] or 0.0) / num_gpus,
    }


def rate_sweep(
    requests: Sequence[Request],
    rates: Sequence[float],
    model: str,
    hardware: str,
    num_gpus: int,
    slos: Mapping[str, float | None],
    link_gbps: float = 400.0,
    layouts: Mapping[str, tuple[int, int] | None] | None = None,
) -> pd.DataFrame:
    """SLO attainment and goodput per GPU of every layout at every request rate (DistServe's figure 1 style)."""
    from workbench.sim.capacity import rate_scaled

    rows = []
    for rate in rates:
        work = rate_scaled(list(requests), rate)
        for label, split in (layouts or node_layouts(num_gpus)).items():
            row = simulate_layout(work, model, hardware, num_gpus, split, slos, link_gbps)
            rows.append({"layout": label, "rate": rate, **row})
    return pd.DataFrame(rows)


def link_sweep(
    requests: Sequence[Request],
    rate: float,
    model: str,
    hardware: str,
    num_gpus: int,
    split: tuple[int, int],
    slos: Mapping[str, float | None],
    link_gbps: Sequence[float],
) -> pd.DataFrame:
    """Goodput per GPU of one split against the KV link's bandwidth, beside the colocated node's (a constant)."""
    from workbench.sim.capacity import rate_scaled

    work = rate_scaled(list(requests), rate)
    colocated = simulate_layout(work, model, hardware, num_gpus, None, slos)
    rows = []
    for gbps in link_gbps:
        row = simulate_layout(work, model, hardware, num_gpus, split, slos, gbps)
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


# ---- claims ------------------------------------------------------------------------------------------------------
def removes_interference(itl_p99_colocated_ms: float, itl_p99_disaggregated_ms: float) -> dict[str, Any]:
    """Disaggregation removes prefill-decode interference from ITL: its p99 ITL is below the colocated
    (prefill-first) engine's, beyond the single-run tolerance."""
    o = order_single(itl_p99_colocated_ms, itl_p99_disaggregated_ms)
    verdict = {1: CONFIRMED, -1: NOT_CONFIRMED, 0: INCONCLUSIVE}[o]
    detail = (
        f"p99 ITL {itl_p99_disaggregated_ms:.1f} ms disaggregated against {itl_p99_colocated_ms:.1f} ms on the "
        "colocated prefill-first engine" + {1: "", -1: ": the colocated tail is lower", 0: " (within 10%: noise)"}[o]
    )
    evidence = {"itl_p99_ms_colocated": itl_p99_colocated_ms, "itl_p99_ms_disaggregated": itl_p99_disaggregated_ms}
    return make_claim("Disaggregation removes prefill-decode interference from ITL", verdict, evidence, detail)


def pays_under_tight_slos(tight: pd.DataFrame, loose: pd.DataFrame) -> dict[str, Any]:
    """Disaggregation pays only under tight TTFT and TPOT SLOs: at the highest rate swept, the best split's
    goodput per GPU beats colocation under the tight SLOs, and does not under the loose ones (``best_layouts``
    tables of the two sweeps)."""
    t, lo = tight.iloc[-1], loose.iloc[-1]
    tight_gain = order_single(t.split_goodput_per_gpu, t.colocated_goodput_per_gpu)
    loose_gain = order_single(lo.split_goodput_per_gpu, lo.colocated_goodput_per_gpu)
    if tight_gain > 0 and loose_gain <= 0:
        verdict = CONFIRMED
    elif tight_gain <= 0 and loose_gain > 0:
        verdict = NOT_CONFIRMED
    elif tight_gain == 0 and loose_gain == 0:
        verdict = INCONCLUSIVE
    else:
        verdict = NOT_CONFIRMED
    detail = (
        f"at {t.rate:g} req/s, goodput per GPU split {t.split_goodput_per_gpu:.2f} ({t.best_split}) vs colocated "
        f"{t.colocated_goodput_per_gpu:.2f} under the tight SLOs; {lo.split_goodput_per_gpu:.2f} vs "
        f"{lo.colocated_goodput_per_gpu:.2f} under the loose ones"
    )
    evidence = {
        "rate": float(t.rate),
        "tight_split": float(t.split_goodput_per_gpu),
        "tight_colocated": float(t.colocated_goodput_per_gpu),
        "loose_split": float(lo.split_goodput_per_gpu),
        "loose_colocated": float(lo.colocated_goodput_per_gpu),
    }
    return make_claim("Disaggregation pays only under tight TTFT and TPOT SLOs", verdict, evidence, detail,
                      uses=("simulation",))  # fmt: skip


def slow_link_erases_it(links: pd.DataFrame) -> dict[str, Any]:
    """A slow KV link erases disaggregation's gain: at the slowest link swept the split's goodput per GPU is below
    the colocated node's, at the fastest it is not (``link_sweep``)."""
    links = links.sort_values("link_gbps")
    slow, fast = links.iloc[0], links.iloc[-1]
    colocated = float(slow.colocated_goodput_per_gpu)
    slow_o = order_single(float(slow.goodput_per_gpu), colocated)
    fast_o = order_single(float(fast.goodput_per_gpu), colocated)
    if slow_o < 0 and fast_o >= 0:
        verdict = CONFIRMED
    elif slow_o == 0 and fast_o == 0:
        verdict = INCONCLUSIVE
    else:
        verdict = NOT_CONFIRMED
    detail = (
        f"goodput per GPU {slow.goodput_per_gpu:.2f} over {slow.link_gbps:g} Gb/s and {fast.goodput_per_gpu:.2f} over "
        f"{fast.link_gbps:g} Gb/s, against {colocated:.2f} colocated"
    )
    evidence = {
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
