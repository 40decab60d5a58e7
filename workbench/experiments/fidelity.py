"""Simulator fidelity on this machine: the simulator against the real engine, per policy, with the measured runs'
own spread (``scripts/sim_fidelity.py`` and notebook 07).

- ``measure_policies`` replays one held-out workload on the real engine under every policy, ``repeats`` times,
  interleaved (repeat 1 of every policy, then repeat 2, ...), so that a change of the machine's load during the
  run falls on every policy alike; the load average is read before and after every run.
- ``simulate_policies`` simulates the same workload with the same scheduler settings and pool on a cost model
  (``profiled``, ``op-profile``; deterministic, or with the profile's residuals drawn as seeded noise).
- ``compare`` sets each simulated statistic (TTFT and ITL, median and p90) against the median of the measured
  repeats and their spread: ``tolerance = max(FIDELITY_TOLERANCE, spread)``, where ``spread`` is the largest
  deviation of one repeat from their median, relative to it; a statistic is ``within`` when its relative error is at
  most that. ``fidelity_claim`` states the verdict.
- ``disaggregated_fidelity`` does the same for the real disaggregated engines (``workbench.dist.disagg``) against
  the simulator's disaggregated model, the KV link fitted to the real transfers.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.engine.config import EngineConfig
from workbench.experiments.claims import CONFIRMED, INCONCLUSIVE, NOT_CONFIRMED, make_claim
from workbench.experiments.hygiene import load_average
from workbench.sim.cluster import SimConfig, simulate
from workbench.workloads import Request, synthetic_workload

FIDELITY_TOLERANCE = 0.10  # the simulator's target: within 10% of the measured median (or the spread, if larger)
NOISY_SPREAD = 0.25  # a spread beyond this makes the comparison inconclusive: the runs do not bound the error
STATISTICS = (("ttft_s", "median"), ("ttft_s", "p90"), ("itl_s", "median"), ("itl_s", "p90"))


def held_out_workload(num_requests: int = 40, rate: float = 10.0, seed: int = 7) -> list[Request]:
    """The held-out Poisson workload of the fidelity check (other seed and lengths than the training workloads)."""
    return synthetic_workload(num_requests, rate=rate, prompt_lens="uniform:4:160", output_lens="uniform:2:48",
                              seed=seed)  # fmt: skip


def engine_config(policy: str, max_num_seqs: int = 16, max_model_len: int = 256) -> EngineConfig:
    """The engine of the fidelity check: the profiles' settings (chunked: a budget of half the context)."""
    budget = max_model_len // 2 if policy == "chunked" else None
    return EngineConfig(policy=policy, max_num_seqs=max_num_seqs, max_model_len=max_model_len, token_budget=budget,
                        device="cpu")  # fmt: skip


def sim_config(policy: str, num_blocks: int, block_size: int, max_num_seqs: int = 16, max_model_len: int = 256,
               **kwargs: Any) -> SimConfig:  # fmt: skip
    """The simulator's settings matching ``engine_config``, with the real engine's pool."""
    budget = max_model_len // 2 if policy == "chunked" else None
    return SimConfig(policy=policy, max_num_seqs=max_num_seqs, max_model_len=max_model_len, token_budget=budget,
                     num_blocks=num_blocks, block_size=block_size, dtype="fp32", **kwargs)  # fmt: skip


def measure_policies(
    net: Any,
    requests: Sequence[Request],
    policies: Sequence[str],
    repeats: int = 3,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    progress: bool = False,
) -> dict[str, Any]:
    """The real engine on ``requests`` under each policy, ``repeats`` times, interleaved: ``runs`` (per policy the
    metrics of each repeat), ``loads`` (per run: policy, repeat, load average before and after), ``pool`` (per
    policy: num_blocks, block_size). One warm-up replay first, not measured."""
    from workbench.engine.engine import Engine

    if repeats < 1:
        from workbench.errors import ConfigError

        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    Engine(net, engine_config(policies[0], max_num_seqs, max_model_len)).replay(list(requests[:4]))
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    loads, pool = [], {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=repeats * len(policies), desc="measured runs", leave=False)
    for rep in range(repeats):
        for policy in policies:
            before = load_average()
            engine = Engine(net, engine_config(policy, max_num_seqs, max_model_len))
            runs[policy].append(engine.replay(list(requests)).summary()["metrics"])
            loads.append({"policy": policy, "repeat": rep, "load_before": before, "load_after": load_average()})
            bm = engine.block_manager
            pool[policy] = {"num_blocks": bm.num_blocks, "block_size": bm.block_size}
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return {"runs": runs, "loads": loads, "pool": pool, "repeats": repeats}


def simulate_policies(
    requests: Sequence[Request],
    model: Any,
    cost: Any,
    measured: Mapping[str, Any],
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    noise_seed: int | None = None,
) -> dict[str, dict]:
    """Per policy of ``measured`` (``measure_policies``), the simulated metrics on ``cost`` (a fresh copy per
    policy; with ``noise_seed``, its residuals drawn as seeded noise)."""
    out = {}
    for policy, pool in measured["pool"].items():
        scfg = sim_config(policy, pool["num_blocks"], pool["block_size"], max_num_seqs, max_model_len)
        out[policy] = simulate(list(requests), model, cost.with_noise(noise_seed), scfg).summary()["metrics"]
    return out


def _spread(values: Sequence[float]) -> tuple[float, float, float, float]:
    mid = statistics.median(values)
    dev = max(abs(v - mid) for v in values) / mid if mid else 0.0
    return min(values), mid, max(values), dev


def compare(runs: Mapping[str, Sequence[Mapping]], simulated: Mapping[str, Mapping], label: str) -> list[dict]:
    """One row per policy and statistic: the measured repeats' min, median, max and ``spread``, the simulated
    value, its ``rel_error`` against the median, the ``tolerance`` and whether it is ``within`` it."""
    rows = []
    for policy, reps in runs.items():
        sim = simulated[policy]
        for metric, stat in STATISTICS:
            lo, mid, hi, spread = _spread([r[metric][stat] for r in reps])
            s = sim[metric][stat]
            err = (s - mid) / mid if mid else 0.0
            tol = max(FIDELITY_TOLERANCE, spread)
            rows.append({"model": label, "policy": policy, "statistic": f"{metric.removesuffix('_s')} {stat}",
                         "measured_min_ms": lo * 1e3, "measured_ms": mid * 1e3, "measured_max_ms": hi * 1e3,
                         "spread": spread, "simulated_ms": s * 1e3, "rel_error": err, "tolerance": tol,
                         "within": abs(err) <= tol})  # fmt: skip
    return rows


def fidelity_claim(rows: Sequence[Mapping[str, Any]], label: str) -> dict[str, Any]:
    """ "The simulator (``label``) reproduces every policy within 10% or the measured spread": confirmed when every
    statistic is within its tolerance, not confirmed when one is not, inconclusive when a spread beyond
    ``NOISY_SPREAD`` sets the tolerance of a statistic outside 10% (the runs themselves vary too much to say)."""
    mine = [r for r in rows if r["model"] == label]
    worst = max(mine, key=lambda r: abs(r["rel_error"]))
    outside = [r for r in mine if not r["within"]]
    noisy = [r for r in mine if abs(r["rel_error"]) > FIDELITY_TOLERANCE and r["spread"] > NOISY_SPREAD]
    evidence = {"num_statistics": len(mine), "num_within": len(mine) - len(outside),
                "worst": {k: worst[k] for k in ("policy", "statistic", "rel_error", "tolerance")},
                "max_spread": max(r["spread"] for r in mine)}  # fmt: skip
    text = (f"worst {worst['policy']} {worst['statistic']}: {100 * worst['rel_error']:+.1f}% against a tolerance of "
            f"{100 * worst['tolerance']:.0f}%; {evidence['num_within']}/{len(mine)} statistics within")  # fmt: skip
    claim = f"The simulator ({label}) reproduces every policy's TTFT and ITL within 10% or the run-to-run spread"
    if outside:
        return make_claim(claim, NOT_CONFIRMED, evidence, text)
    if noisy:
        return make_claim(claim, INCONCLUSIVE, evidence, text + f"; but {len(noisy)} only thanks to a spread > "
                          f"{100 * NOISY_SPREAD:.0f}%")  # fmt: skip
    return make_claim(claim, CONFIRMED, evidence, text)


def disaggregated_fidelity(
    model: str,
    costs: Any,
    requests: Sequence[Request],
    split: tuple[int, int],
    repeats: int = 3,
    threads: int = 1,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    noise_seed: int | None = 7,
) -> dict[str, Any]:
    """The real disaggregated run (``repeats`` times) against the simulated one on each cost model of ``costs`` (one
    or a list), with the KV link fitted to the real transfers (``workbench.sim.comm.fit_latency_bandwidth``): ``rows``
    as ``compare`` (models ``cost.name`` and ``cost.name + " noise"``), ``link``, ``loads``."""
    from workbench.config import ModelConfig
    from workbench.dist.disagg import DisaggCluster, DisaggConfig
    from workbench.engine.metrics import summarize
    from workbench.request import SamplingParams
    from workbench.sim.comm import fit_latency_bandwidth
    from workbench.workloads import prompt_token_ids

    cfg_model = ModelConfig.resolve(model)
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, device="cpu")
    work = [(prompt_token_ids(r, cfg_model.vocab_size, 0), SamplingParams(max_tokens=r.output_len, ignore_eos=True),
             r.arrival_time_s) for r in requests]  # fmt: skip
    dcfg = DisaggConfig(prefill=ecfg, decode=ecfg, num_prefill=split[0], num_decode=split[1],
                        threads_per_engine=threads)  # fmt: skip
    runs, points, loads = [], [], []
    with DisaggCluster(model, dcfg) as cluster:
        cluster.run(work[:4], online=False)  # warm-up, not measured
        for rep in range(repeats):
            before = load_average()
            result = cluster.run(work, online=True)
            loads.append({"repeat": rep, "load_before": before, "load_after": load_average()})
            runs.append(summarize(result.requests, duration_s=result.duration_s)["metrics"])
            points += [(t["kv_transfer_bytes"], t["kv_transfer_s"]) for t in result.transfers.values()
                       if t["kv_transfer_bytes"] > 0]  # fmt: skip
    latency, bandwidth = fit_latency_bandwidth(points)
    link_fit = "latency-bandwidth"
    if not (bandwidth > 0 and latency >= 0):  # noisy transfers on a loaded machine: bytes over seconds, no latency
        latency, bandwidth = 0.0, sum(b for b, _ in points) / max(sum(t for _, t in points), 1e-12)
        link_fit = "mean (the latency-bandwidth fit was not physical)"
    scfg = SimConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_blocks=ecfg.cache_shape(cfg_model)[0],
                     block_size=ecfg.block_size, dtype="fp32", disaggregate=split, link_gbps=bandwidth * 8 / 1e9,
                     link_latency_s=latency)  # fmt: skip
    rows = []
    n = sum(split)
    setup = f"disaggregated {split[0]}:{split[1]}"
    for cost in costs if isinstance(costs, (list, tuple)) else [costs]:
        for name, seeds in ((cost.name, [None] * n), (f"{cost.name} noise", [noise_seed + i for i in range(n)])):
            replicas = [cost.with_noise(s) for s in seeds]  # stateful: one per replica
            sim = simulate(list(requests), cfg_model, replicas, scfg).summary()["metrics"]
            rows += compare({setup: runs}, {setup: sim}, name)
    link = {"latency_s": latency, "gbps": bandwidth * 8 / 1e9, "num_transfers": len(points), "fit": link_fit}
    return {"rows": rows, "link": link, "loads": loads, "repeats": repeats}


# ---- notebook 07: the profiles of this machine, where a step's time goes, published GPU measurements ------------
def profile_provenance(kind: str, cost: Any) -> dict[str, Any]:
    """Where a cost model's profile was measured: its machine facts (``workbench.sim.measure.machine_identity``, as
    far as the file records them), the load average while it was measured, and ``loaded``: whether that load
    exceeded the machine's CPUs (the profile then holds other processes' time: unreliable)."""
    if kind == "op-profile":
        data = cost.source or {}
        machine = dict(data.get("machine") or {})
        loads = [x[0] for x in (data.get("load_average_start"), data.get("load_average_end")) if x]
    else:
        meta = cost.meta or {}
        machine = {"cpu": meta.get("machine"), "cpu_count": meta.get("cpu_count"),
                   "cpu_capability": meta.get("cpu_capability")}  # fmt: skip
        loads = [x for x in (meta.get("load_average_1min") or []) if x is not None]
    cpus = machine.get("cpu_count")
    peak = max(loads) if loads else None
    return {"machine": machine, "load_average_1min": loads or None,
            "loaded": None if peak is None or not cpus else peak > cpus}  # fmt: skip


def profile_for_this_machine(
    kind: str,
    model: str,
    path: str | None = None,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    max_tokens: int = 2048,
    num_requests: int = 24,
    measure: bool = False,
) -> tuple[Any, str]:
    """(cost model, where it came from): ``kind`` ``op-profile`` or ``profiled``; from ``path`` when given, else
    the committed profile of this machine (``data/profiles/``, named after the CPU model as ``workbench
    profile-ops`` and ``workbench fit-profile`` name them) when there is one and it records this machine (the CPU
    model, the number of CPUs and torch's instruction set, ``workbench.sim.measure.machine_identity``: a VM's CPU
    name can cover parts of several kinds), else measured now (``max_tokens``: the op profile's largest size;
    ``num_requests``: per workload of the engine runs that fit). ``measure``: measure now in any case (the profile
    then shares the fidelity check's machine and conditions)."""
    from pathlib import Path

    from workbench.commands.fit_profile import default_profile_path
    from workbench.commands.profile_ops import default_op_profile_path
    from workbench.errors import ConfigError
    from workbench.hardware import cpu_model_name
    from workbench.sim.costmodel import ProfiledCostModel
    from workbench.sim.measure import identity_mismatch, machine_identity
    from workbench.sim.op_profile import OpProfileCostModel

    if kind not in ("op-profile", "profiled"):
        raise ConfigError(f"unknown profile kind {kind!r}; expected op-profile or profiled")
    why = ""
    if path is not None:
        load = OpProfileCostModel.load if kind == "op-profile" else ProfiledCostModel.load
        return load(path), path
    if not measure:
        found = (default_op_profile_path(model, cpu_model_name()) if kind == "op-profile"
                 else default_profile_path(model))  # fmt: skip
        if Path(found).is_file():
            cost = (OpProfileCostModel if kind == "op-profile" else ProfiledCostModel).load(found)
            differ = identity_mismatch(profile_provenance(kind, cost)["machine"], machine_identity())
            if not differ:
                return cost, found
            why = f" (the committed {found} is of another machine: {'; '.join(differ)})"
    if kind == "op-profile":
        from workbench.sim.op_timing import measure_overhead, profile_ops

        load_start = load_average()
        profile = profile_ops(model, "cpu", "fp32", max_tokens=max_tokens, progress=False)
        profile["model"] = model
        profile["overhead"] = measure_overhead(profile, num_requests=num_requests, max_num_seqs=max_num_seqs,
                                               max_model_len=max_model_len)  # fmt: skip
        profile["machine"] = machine_identity()
        profile["load_average_start"], profile["load_average_end"] = load_start, load_average()
        return OpProfileCostModel.from_dict(profile, "the measured op profile"), "measured now (profile-ops)" + why
    from workbench.sim.measure import fit_engine_profile

    fitted = fit_engine_profile(model, num_requests=num_requests, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len)  # fmt: skip
    return fitted, "fitted now (fit-profile)" + why


def step_breakdown(cost: Any, steps: Mapping[str, Any]) -> list[dict]:
    """Per named step (``StepStats``), the op-profile model's seconds per operation and its fitted overhead, in
    ms: where a step's time goes by the profile."""
    rows = []
    for label, stats in steps.items():
        ops = cost.op_times(stats)
        total_ops = sum(ops.values())
        for op, seconds in sorted(ops.items(), key=lambda kv: -kv[1]):
            rows.append({"step": label, "part": op, "ms": seconds * 1e3})
        rows.append({"step": label, "part": "overhead (fitted)", "ms": cost.overhead_time(stats, total_ops) * 1e3})
    return rows


def overhead_claim(overhead: Mapping[str, Any]) -> dict[str, Any]:
    """ "The isolated operations alone underestimate an engine step here": from the op profile's overhead fit,
    confirmed when the summed operations are more than 10% below the measured steps on average, not confirmed
    when they are more than 10% above, inconclusive within 10%."""
    from workbench.experiments.claims import SINGLE_RUN_TOLERANCE

    fit = overhead["fit"]
    bias = fit["ops_only_mean_signed_rel_error"]
    evidence = {"ops_only_mean_signed_rel_error": bias, "ops_only_median_rel_error": fit["ops_only_median_rel_error"],
                "with_overhead_median_rel_error": fit["median_rel_error"], "num_steps": fit["num_steps"],
                "coefficients": dict(overhead["coefficients"])}  # fmt: skip
    text = (f"over {fit['num_steps']} engine steps the summed operations are {100 * bias:+.1f}% off on average "
            f"(median |error| {100 * fit['ops_only_median_rel_error']:.1f}%); with the fitted overhead the median "
            f"|error| is {100 * fit['median_rel_error']:.1f}%")  # fmt: skip
    claim = "The operations timed alone underestimate an engine step on this machine (a per-step overhead is needed)"
    if bias < -SINGLE_RUN_TOLERANCE:
        return make_claim(claim, CONFIRMED, evidence, text)
    if bias > SINGLE_RUN_TOLERANCE:
        return make_claim(claim, NOT_CONFIRMED, evidence, text)
    return make_claim(claim, INCONCLUSIVE, evidence, text)


def published_measurements(directory: Any) -> list[dict] | None:
    """Every record of the YAML files in ``directory`` (``data/validation/``: published GPU measurements), each
    with its ``source_file``; a file is a list of records or a mapping whose list values are the records. None when
    there is no such file (the notebook then says so rather than showing anything)."""
    from pathlib import Path

    import yaml

    files = sorted(Path(directory).glob("*.yaml")) if directory is not None else []
    if not files:
        return None
    rows: list[dict] = []
    for path in files:
        data = yaml.safe_load(path.read_text())
        lists = [data] if isinstance(data, list) else [v for v in (data or {}).values() if isinstance(v, list)]
        for records in lists:
            for rec in records:
                if isinstance(rec, dict):
                    rows.append(
                        {"source_file": path.name, **{k: v for k, v in rec.items() if not isinstance(v, (dict, list))}}
                    )
    return rows


HELD_OUT_MEDIAN_TARGET = 0.15  # the bar on published GPU rows the calibration never saw
HELD_OUT_MAX_TARGET = 0.30


def published_errors() -> tuple[list[dict], dict[str, dict]]:
    """The calibrated roofline against every published GPU row (``workbench.sim.published.error_table`` with each
    source's stack, as ``scripts/validate_gpu_costs.py`` prints it) and the median and largest absolute error per
    split (calibration, held_out)."""
    from workbench.sim.published import error_table, load_published, load_stack_overheads, summarize_errors

    table = error_table(load_published(), "hardware", None, load_stack_overheads())
    return table, {split: summarize_errors([r for r in table if r["split"] == split])
                   for split in ("calibration", "held_out")}  # fmt: skip


def published_claim(summary: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """ "On published GPU measurements the calibration did not see, the median absolute error is at most 15% and no
    case is off by more than 30%": confirmed or not from the held-out summary (analytic: no timing, no spread)."""
    held = summary["held_out"]
    med, top = held["median_abs_error"], held["max_abs_error"]
    claim = (f"On published GPU measurements the calibration did not see, the cost model's median absolute error is "
             f"at most {100 * HELD_OUT_MEDIAN_TARGET:.0f}% and no case is off by more than "
             f"{100 * HELD_OUT_MAX_TARGET:.0f}%")  # fmt: skip
    text = f"{held['n']} held-out rows: median |error| {100 * med:.1f}%, largest {100 * top:.1f}%"
    ok = med <= HELD_OUT_MEDIAN_TARGET and top <= HELD_OUT_MAX_TARGET
    return make_claim(claim, CONFIRMED if ok else NOT_CONFIRMED, dict(held), text, uses=("published",))
