"""The capacity planner: which deployment of a model on N GPUs serves a trace with the most goodput per GPU.

It searches replicas x tensor-parallel size x pipeline-parallel size (x a given expert-parallel size) x (colocated | P:D
disaggregated, each side with its own TP) x scheduling policy x chunk size, as Vidur-Search (Agrawal et al., MLSys'24)
searches deployment configurations and DistServe (Zhong et al., OSDI'24) places prefill and decode instances. Every
candidate is one run of the discrete-event simulator (``workbench.sim.cluster.simulate``) on the same requests, priced
by the calibrated roofline of its own shape; its goodput (requests/s meeting the TTFT and TPOT SLOs) is divided by the
GPUs it uses. Candidates that cannot hold their weights (or divide the model's heads) are listed as skipped, with why.

The simulations are independent, so they run in parallel on Ray (the maintained engine for this, and what
Vidur-Search uses): ``ray.init(num_cpus=...)`` on this machine unless ``ray_address`` joins a cluster. Each
candidate is simulated by the same deterministic function with the same seed wherever it runs, and the results
come back in candidate order, so a Ray run equals a serial one (``parallel='serial'``) row for row. Ray is imported
only when it is used.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.timing import now
from workbench.workloads import Request

PLAN_POLICIES = ("continuous", "chunked", "decode-first")
# Ray's raylet must register within this many seconds; its default (10 s) is too short on a busy 2-core machine
RAY_START_ENV = {"RAY_raylet_start_wait_time_s": "120"}


@dataclass(frozen=True)
class Candidate:
    """One deployment: ``replicas`` colocated replicas of TP x PP (x EP) GPUs, or ``disaggregate`` (P, D) replicas
    with ``prefill_tp`` / ``decode_tp``; a policy and, for ``chunked``, a chunk size (the step's token budget). ``ep``:
    a mixture of experts' expert-parallel size (attention data-parallel over the EP ranks, TP 1)."""

    tp: int = 1
    pp: int = 1
    replicas: int = 1
    disaggregate: tuple[int, int] | None = None
    prefill_tp: int | None = None
    decode_tp: int | None = None
    policy: str = "continuous"
    chunk_size: int | None = None
    ep: int = 1

    @property
    def num_gpus(self) -> int:
        if self.disaggregate:
            p, d = self.disaggregate
            return self.pp * self.ep * (p * (self.prefill_tp or self.tp) + d * (self.decode_tp or self.tp))
        return self.replicas * self.tp * self.pp * self.ep

    @property
    def name(self) -> str:
        if self.disaggregate:
            p, d = self.disaggregate
            shape = f"P{p}xTP{self.prefill_tp or self.tp}:D{d}xTP{self.decode_tp or self.tp}"
        else:
            shape = f"{self.replicas}xTP{self.tp}"
        shape += f"xPP{self.pp}" if self.pp > 1 else ""
        shape += f"xEP{self.ep}" if self.ep > 1 else ""
        return f"{shape} {self.policy}" + (f"/{self.chunk_size}" if self.chunk_size else "")


def candidates(
    num_gpus: int,
    tps: Iterable[int] = (1, 2, 4, 8),
    pps: Iterable[int] = (1, 2),
    policies: Iterable[str] = ("continuous", "chunked"),
    chunk_sizes: Iterable[int] = (512, 2048),
    disaggregated: bool = True,
    all_replica_counts: bool = True,
    expert_parallel_size: int = 1,
) -> list[Candidate]:
    """Every deployment of at most ``num_gpus`` GPUs over the given sizes (chunk sizes apply to ``chunked``);
    ``all_replica_counts`` tries 1 .. max replicas per shape (else only the most that fit). With
    ``expert_parallel_size`` > 1 every replica is TP 1 x PP x EP GPUs (a ``ConfigError`` when ``tps`` lacks 1 or
    one replica of the smallest ``pps`` needs more than ``num_gpus``)."""
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ConfigError(f"num_gpus must be a positive integer, got {num_gpus!r}")
    ep = expert_parallel_size
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError(f"expert_parallel_size must be a positive integer, got {ep!r}")
    tps, pps, policies, chunk_sizes = sorted(set(tps)), sorted(set(pps)), list(policies), sorted(set(chunk_sizes))
    if ep > 1:
        if 1 not in tps:
            raise ConfigError(f"expert_parallel_size {ep} runs attention data-parallel, one GPU per EP rank: it "
                              f"needs tensor-parallel size 1 among the sizes searched (--tp), got {tps}")  # fmt: skip
        if ep * pps[0] > num_gpus:
            raise ConfigError(f"expert_parallel_size {ep} needs {ep * pps[0]} GPUs per replica (EP x PP "
                              f"{pps[0]}), more than the {num_gpus} GPU(s) to deploy on")  # fmt: skip
        tps = [1]
    for policy in policies:
        if policy not in PLAN_POLICIES:
            raise ConfigError(f"plan policies must be among {', '.join(PLAN_POLICIES)}; got {policy!r}")
    sched = [(p, c) for p in policies for c in (chunk_sizes if p == "chunked" else [None])]
    out: list[Candidate] = []
    for pp in pps:
        for tp in tps:
            most = num_gpus // (tp * pp * ep)
            counts = range(1, most + 1) if all_replica_counts else ([most] if most else [])
            for replicas in counts:
                out += [Candidate(tp, pp, replicas, policy=p, chunk_size=c, ep=ep) for p, c in sched]
        if disaggregated:
            for ptp in tps:
                for dtp in tps:
                    for np_ in range(1, num_gpus + 1):
                        for nd in range(1, num_gpus + 1):
                            cand = Candidate(ptp, pp, 1, (np_, nd), ptp, dtp, ep=ep)
                            if cand.num_gpus > num_gpus:
                                break
                            if not all_replica_counts and cand.num_gpus + min(ptp, dtp) * pp * ep <= num_gpus:
                                continue  # room for one more replica: not one of the largest
                            # the prefill side runs whole prompts (DistServe): no chunking to search there
                            out.append(cand)
    return out


@dataclass
class PlanSettings:
    """What every candidate shares: model, hardware, formats, calibration, SLOs, seed."""

    model: str
    hardware: str
    slo_ttft_s: float
    slo_tpot_s: float
    dtype: str = "bf16"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    calibration: str = "hardware"  # or "ideal"
    step_overhead_s: float | None = None
    max_model_len: int | None = None
    link_gbps: float = 400.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


def evaluate(candidate: Candidate, requests: list[Request], settings: PlanSettings) -> dict[str, Any]:
    """Simulate ``requests`` on one candidate; its row of the plan (goodput per GPU, latencies, or why skipped)."""
    from workbench.hardware import IDEAL, get_hardware
    from workbench.sim.cluster import SimConfig, simulate
    from workbench.sim.costmodel import RooflineCostModel
    from workbench.workloads import truncate_to_context

    row: dict[str, Any] = {"name": candidate.name, **asdict(candidate), "num_gpus": candidate.num_gpus}
    t0 = now()
    try:
        cfg = ModelConfig.resolve(settings.model)
        hw = get_hardware(settings.hardware)
        cal = IDEAL if settings.calibration == "ideal" else hw.calibration
        if settings.step_overhead_s is not None:
            cal = cal.replace(step_overhead_s=settings.step_overhead_s)
        config = SimConfig(
            policy=candidate.policy, token_budget=candidate.chunk_size, chunk_size=candidate.chunk_size,
            max_model_len=settings.max_model_len, dtype=settings.dtype, quantization=settings.quantization,
            kv_cache_dtype=settings.kv_cache_dtype, num_replicas=candidate.replicas,
            disaggregate=candidate.disaggregate, prefill_tp=candidate.prefill_tp if candidate.disaggregate else None,
            decode_tp=candidate.decode_tp if candidate.disaggregate else None, tensor_parallel_size=candidate.tp,
            pipeline_parallel_size=candidate.pp, link_gbps=settings.link_gbps, router="least-outstanding",
            expert_parallel_size=candidate.ep,
        )  # fmt: skip
        roles = (["prefill"] * candidate.disaggregate[0] + ["decode"] * candidate.disaggregate[1]
                 if candidate.disaggregate else ["mixed"] * candidate.replicas)  # fmt: skip
        models = {
            role: RooflineCostModel(cfg, hw, config.dtype, quantization=config.quantization,
                                    kv_cache_dtype=config.kv_cache_dtype, tensor_parallel_size=config.role_tp(role),
                                    pipeline_parallel_size=config.pipeline_parallel_size, calibration=cal,
                                    host_gap_s=None, expert_parallel_size=candidate.ep)
            for role in set(roles)
        }  # fmt: skip
        # workbench plan rejects (and counts) the rows beyond max_model_len before it gets here, so nothing is
        # clipped for it; the notebooks' callers (workbench.experiments) still shape their workloads this way, and
        # the row says how many it clipped (num_clipped)
        reqs = truncate_to_context(requests, config.resolved_max_model_len(cfg))
        row["num_clipped"] = sum(a.prompt_len + a.output_len != b.prompt_len + b.output_len
                                 for a, b in zip(requests, reqs))  # fmt: skip
        result = simulate(reqs, cfg, [models[r] for r in roles], config, hardware=hw, seed=settings.seed)
    except ConfigError as exc:
        row.update(status="skipped", reason=str(exc), wall_s=now() - t0)
        return row
    m = result.summary(slo_ttft_s=settings.slo_ttft_s, slo_tpot_s=settings.slo_tpot_s)["metrics"]
    row.update(
        status="ok", goodput=m["goodput"], goodput_per_gpu=m["goodput"] / candidate.num_gpus,
        slo_attainment=m["slo_attainment"], request_throughput=m["request_throughput"],
        ttft_p90_s=m["ttft_s"]["p90"], tpot_p90_s=m["tpot_s"]["p90"], ttft_median_s=m["ttft_s"]["median"],
        tpot_median_s=m["tpot_s"]["median"], num_preemptions=result.num_preemptions, wall_s=now() - t0,
    )  # fmt: skip
    return row


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluated rows no other row beats on every one of: more goodput per GPU, fewer GPUs, lower p90 TTFT,
    lower p90 TPOT (ties broken by candidate order); sorted by GPUs, then goodput per GPU."""
    ok = [r for r in rows if r["status"] == "ok"]

    def key(r: dict[str, Any]) -> tuple[float, ...]:
        return (-r["goodput_per_gpu"], r["num_gpus"], r["ttft_p90_s"], r["tpot_p90_s"])

    front = []
    for r in ok:
        kr = key(r)
        dominated = any(all(a <= b for a, b in zip(key(o), kr)) and key(o) != kr for o in ok)
        if not dominated and not any(key(f) == kr for f in front):
            front.append(r)
    return sorted(front, key=lambda r: (r["num_gpus"], -r["goodput_per_gpu"]))


@dataclass
class PlanResult:
    """Every candidate's row (in candidate order), the best by goodput per GPU, the Pareto front, timings."""

    rows: list[dict[str, Any]]
    settings: PlanSettings
    num_gpus: int
    wall_s: float
    parallel: str
    best: list[dict[str, Any]] = field(default_factory=list)
    pareto: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"settings": asdict(self.settings), "num_gpus": self.num_gpus, "wall_s": self.wall_s,
                "parallel": self.parallel, "num_candidates": len(self.rows),
                "num_evaluated": sum(r["status"] == "ok" for r in self.rows), "best": self.best,
                "pareto": self.pareto, "rows": self.rows}  # fmt: skip


def plan(
    requests: list[Request],
    settings: PlanSettings,
    num_gpus: int,
    search: list[Candidate] | None = None,
    parallel: str = "ray",
    ray_address: str | None = None,
    num_cpus: int = 2,
    top: int = 5,
    timeout_s: float | None = None,
) -> PlanResult:
    """Evaluate every candidate (default: ``candidates(num_gpus)``) on ``requests``: serially, or on Ray
    (``ray.init(address=ray_address)`` to join a cluster, else a local one of ``num_cpus`` CPUs, shut down after);
    each Ray task is bounded by ``timeout_s`` when given. The best ``top`` rows by goodput per GPU and the Pareto
    front are attached."""
    if parallel not in ("ray", "serial"):
        raise ConfigError(f"parallel must be 'ray' or 'serial', got {parallel!r}")
    search = candidates(num_gpus) if search is None else search
    if not search:
        raise ConfigError(f"no deployment fits in {num_gpus} GPU(s)")
    t0 = now()
    if parallel == "serial":
        rows = [evaluate(c, requests, settings) for c in search]
    else:
        rows = _evaluate_on_ray(search, requests, settings, ray_address, num_cpus, timeout_s)
    ok = [r for r in rows if r["status"] == "ok"]
    best = sorted(ok, key=lambda r: (-r["goodput_per_gpu"], r["num_gpus"], r["ttft_p90_s"]))[:top]
    return PlanResult(rows, settings, num_gpus, now() - t0, parallel, best, pareto_front(rows))


def start_ray(address: str | None = None, num_cpus: int = 2, attempts: int = 3) -> None:
    """``ray.init`` joining ``address``, or a local Ray of ``num_cpus`` CPUs, tried up to ``attempts`` times: Ray
    gives its raylet a fixed 30 s to register, which a busy 2-core machine can miss (a ``ConfigError`` after the
    last attempt)."""
    import ray

    for key, value in RAY_START_ENV.items():
        os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": num_cpus}
    for attempt in range(attempts):
        try:
            ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True, **kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception when its node does not come up in time
            ray.shutdown()
            if attempt == attempts - 1:
                raise ConfigError(f"Ray did not start ({exc}); try again on a quieter machine, or --serial") from None


def _evaluate_on_ray(
    search: list[Candidate],
    requests: list[Request],
    settings: PlanSettings,
    address: str | None,
    num_cpus: int,
    timeout_s: float | None,
) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise ConfigError("the planner's parallel runs need Ray (pip install ray), or use --serial") from None
    started = not ray.is_initialized()
    if started:
        start_ray(address, num_cpus)
    try:
        remote = ray.remote(num_cpus=1)(evaluate)
        reqs, sett = ray.put(requests), ray.put(settings)
        futures = [remote.remote(c, reqs, sett) for c in search]
        try:
            return list(ray.get(futures, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            for f in futures:
                ray.cancel(f, force=True)
            raise ConfigError(f"the plan's simulations did not finish within {timeout_s} s") from None
    finally:
        if started:
            ray.shutdown()


__all__ = [
    "PLAN_POLICIES",
    "RAY_START_ENV",
    "Candidate",
    "PlanResult",
    "PlanSettings",
    "candidates",
    "evaluate",
    "pareto_front",
    "plan",
]
