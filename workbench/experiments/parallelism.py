"""Notebook 06: what tensor parallelism buys each phase, and which deployment of a real trace serves most per GPU.

Analytic, from the calibrated roofline with communication (``workbench.roofline``) and the simulator's capacity
planner (``workbench.sim.planner``):

- ``tp_sweep``: per model and tensor-parallel size, the batch's TTFT and ITL (the step's wall time on the group,
  all-reduces included), their GPU-seconds (latency x GPUs: what the phase costs per GPU), the share of the step
  spent communicating, and whether the weights and the batch's KV fit in each GPU;
- ``phase_preferences``: per model and phase, the TP with the lowest latency and the one with the fewest
  GPU-seconds;
- ``capacity_plan``: the planner on a trace, its rows and its Pareto front.

The claims (``tp_claims``, ``plan_claim``) are tested on these numbers: more TP cuts latency with a growing
communication share; decode gains less from TP than prefill; the plan's Pareto front holds more than one
deployment (no one shape wins on every axis).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from workbench.errors import ConfigError
from workbench.experiments.claims import (
    CONFIRMED,
    INCONCLUSIVE,
    NOT_CONFIRMED,
    RATIO_KEYS,
    exact_comparison,
    exact_text,
    make_claim,
)
from workbench.roofline import COMM_OPS, get_model


def tp_sweep(
    models: Sequence[str],
    hardware: str,
    tps: Sequence[int],
    prompt_len: int = 1024,
    context_len: int = 1024,
    batch: int = 1,
    dtype: str = "bf16",
    calibration: str | None = "hardware",
) -> pd.DataFrame:
    """One row per (model, TP): ``ttft_s``/``itl_s`` (wall time on the group), ``ttft_gpu_s``/``itl_gpu_s``
    (times the GPUs), ``*_comm_share`` (communication's share of the step), ``fits``, ``weight_gib_per_gpu``."""
    rows = []
    for name in models:
        for tp in tps:
            try:
                m = get_model(name, hardware, dtype=dtype, tensor_parallel_size=tp, calibration=calibration)
            except ConfigError:
                continue  # a size that does not divide the model's heads
            fits = True
            try:
                m.check_memory(batch * max(prompt_len, context_len))
            except ConfigError:
                fits = False
            pre, dec = m.prefill([prompt_len] * batch), m.decode([context_len] * batch)
            row = {"model": name, "tp": tp, "fits": fits, "weight_gib_per_gpu": m.weight_bytes_per_gpu() / 2**30,
                   "ttft_s": pre.time_s, "itl_s": dec.time_s, "ttft_gpu_s": pre.time_s * tp,
                   "itl_gpu_s": dec.time_s * tp}  # fmt: skip
            for phase, cost in (("ttft", pre), ("itl", dec)):
                comm = sum(op.time_s for op in cost.ops if op.name in COMM_OPS)
                row[f"{phase}_comm_share"] = comm / cost.time_s if cost.time_s else 0.0
            rows.append(row)
    return pd.DataFrame(rows)


def phase_preferences(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per model and phase, among the sizes that fit: the TP of the lowest latency and of the fewest GPU-seconds,
    and the speed-up from the smallest fitting TP to the largest."""
    rows = []
    for name, group in sweep[sweep.fits].groupby("model", sort=False):
        group = group.sort_values("tp")
        for phase in ("ttft", "itl"):
            fastest = group.loc[group[f"{phase}_s"].idxmin()]
            cheapest = group.loc[group[f"{phase}_gpu_s"].idxmin()]
            lo, hi = group.iloc[0], group.iloc[-1]
            rows.append({"model": name, "phase": "prefill" if phase == "ttft" else "decode",
                         "fastest_tp": int(fastest.tp), "cheapest_tp": int(cheapest.tp),
                         "smallest_tp": int(lo.tp), "largest_tp": int(hi.tp),
                         "speedup": float(lo[f"{phase}_s"] / hi[f"{phase}_s"]),
                         "ideal_speedup": float(hi.tp / lo.tp),
                         "comm_share_largest": float(hi[f"{phase}_comm_share"])})  # fmt: skip
    return pd.DataFrame(rows)


def capacity_plan(
    requests: list,
    model: str,
    hardware: str,
    num_gpus: int,
    slo_ttft_s: float,
    slo_tpot_s: float,
    tps: Sequence[int] = (1, 2, 4),
    pps: Sequence[int] = (1,),
    policies: Sequence[str] = ("continuous", "chunked"),
    chunk_sizes: Sequence[int] = (512,),
    parallel: str = "serial",
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame, float]:
    """The planner on ``requests``: (every evaluated row, the Pareto front, wall seconds)."""
    from workbench.sim.planner import PlanSettings, candidates, plan

    settings = PlanSettings(model=model, hardware=hardware, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s, seed=seed)
    search = candidates(num_gpus, tps, pps, policies, chunk_sizes, disaggregated=True, all_replica_counts=True)
    result = plan(requests, settings, num_gpus, search, parallel=parallel)
    cols = ["name", "num_gpus", "goodput", "goodput_per_gpu", "slo_attainment", "ttft_p90_s", "tpot_p90_s"]
    rows = pd.DataFrame([r for r in result.rows if r["status"] == "ok"])[cols]
    front = pd.DataFrame(result.pareto)[cols] if result.pareto else rows.iloc[:0]
    return rows, front, result.wall_s


# ---- claims --------------------------------------------------------------------------------------------------
def tp_cuts_latency_with_growing_comm(sweep: pd.DataFrame, model: str) -> dict[str, Any]:
    """More tensor parallelism cuts ``model``'s decode latency (ITL at the largest TP below the smallest fitting
    one's, beyond 10%) while communication takes a larger share of the step (the diminishing return)."""
    g = sweep[(sweep.model == model) & sweep.fits].sort_values("tp")
    if len(g) < 2:
        return make_claim(f"More TP cuts {model}'s ITL, with a growing communication share", INCONCLUSIVE,
                          {"tps": list(g.tp), "no_ratio": "fewer than two tensor-parallel sizes fit"},
                          "fewer than two tensor-parallel sizes fit", uses=("model",))  # fmt: skip
    lo, hi = g.iloc[0], g.iloc[-1]
    faster = exact_comparison(f"TP {int(lo.tp)}", lo.itl_s, f"TP {int(hi.tp)}", hi.itl_s, "lower")
    comm_grows = bool(hi.itl_comm_share > lo.itl_comm_share)
    verdict = CONFIRMED if faster["verdict"] == CONFIRMED and comm_grows else NOT_CONFIRMED
    reason = faster["reason"] if faster["verdict"] != CONFIRMED else (
        "beyond the margin in the claimed direction" if comm_grows else "the communication share does not grow"
    )  # fmt: skip
    evidence = {**{k: faster[k] for k in RATIO_KEYS}, "reason": reason, "tp_small": int(lo.tp), "tp_large": int(hi.tp),
                "itl_ms_small": lo.itl_s * 1e3, "itl_ms_large": hi.itl_s * 1e3, "comm_share_small": lo.itl_comm_share,
                "comm_share_large": hi.itl_comm_share}  # fmt: skip
    detail = (
        f"ITL {lo.itl_s * 1e3:.2f} ms at TP {int(lo.tp)} -> {hi.itl_s * 1e3:.2f} ms at TP {int(hi.tp)} "
        f"({lo.itl_s / hi.itl_s:.2f}x for {hi.tp / lo.tp:.0f}x the GPUs; ITL ratio {exact_text(faster)}); "
        f"communication {100 * lo.itl_comm_share:.0f}% -> {100 * hi.itl_comm_share:.0f}% of the step"
    )
    return make_claim(f"More TP cuts {model}'s ITL, with a growing communication share", verdict, evidence, detail,
                      uses=("model",))  # fmt: skip


def decode_gains_less_from_tp(prefs: pd.DataFrame, model: str) -> dict[str, Any]:
    """Each phase prefers its own parallelism: from the smallest to the largest fitting TP, ``model``'s decode
    speeds up less than its prefill (beyond 10%), so a decode pool gets less from a wide group than a prefill pool
    (the asymmetry DistServe's per-phase parallelism exploits). The roofline model is exact (no spread), so the
    speed-ups are compared as exact figures (``exact_comparison``, prefill's against decode's, claimed higher):
    not confirmed ``equivalent`` within 10%, ``opposite`` when decode gains more."""
    p = prefs[prefs.model == model].set_index("phase")
    pre, dec = float(p.loc["prefill", "speedup"]), float(p.loc["decode", "speedup"])
    c = exact_comparison("decode speed-up", dec, "prefill speed-up", pre, "higher")
    verdict = c["verdict"]
    tail = {CONFIRMED: "", "opposite": ": decode gains more", "equivalent": " (within 10%)"}[
        CONFIRMED if verdict == CONFIRMED else c["reason"]]  # fmt: skip
    detail = (f"TP {int(p.loc['prefill', 'smallest_tp'])} -> {int(p.loc['prefill', 'largest_tp'])}: prefill "
              f"{pre:.2f}x faster, decode {dec:.2f}x{tail}; prefill/decode {exact_text(c)}")  # fmt: skip
    evidence = {"prefill_speedup": pre, "decode_speedup": dec,
                **{k: c[k] for k in (*RATIO_KEYS, "reason")}}  # fmt: skip
    return make_claim(f"{model}'s decode gains less from tensor parallelism than its prefill", verdict, evidence,
                      detail, uses=("model",))  # fmt: skip


def plan_has_a_tradeoff(front: pd.DataFrame, rows: pd.DataFrame) -> dict[str, Any]:
    """No single deployment wins on every axis: the plan's Pareto front (goodput per GPU, GPUs, p90 TTFT, p90
    TPOT) holds more than one deployment."""
    n = len(front)
    verdict = CONFIRMED if n >= 2 else NOT_CONFIRMED if len(rows) >= 2 else INCONCLUSIVE
    best = rows.sort_values("goodput_per_gpu", ascending=False).iloc[0] if len(rows) else None
    detail = (f"{n} of {len(rows)} simulated deployments on the Pareto front"
              + (f"; most goodput per GPU: {best['name']} ({best.goodput_per_gpu:.2f} req/s/GPU)" if best is not None
                 else ""))  # fmt: skip
    no_ratio = "a count of deployments on a four-axis Pareto front, not a comparison of two figures"
    return make_claim("No single deployment wins on every axis of the capacity plan", verdict,
                      {"pareto_size": n, "num_deployments": len(rows), "no_ratio": no_ratio}, detail,
                      uses=("simulation",))  # fmt: skip


__all__ = ["capacity_plan", "decode_gains_less_from_tp", "phase_preferences", "plan_has_a_tradeoff",
           "tp_cuts_latency_with_growing_comm", "tp_sweep"]  # fmt: skip
