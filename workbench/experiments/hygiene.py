"""Measurement hygiene: what every timed experiment checks about itself before its numbers count as findings.

A notebook calls ``start_checks`` before it times anything and ``end_checks`` after, and hands its results to the
sanity checks. Together they give:

- the machine's ceilings (matmul peak, memory read bandwidth) measured *in this process* at the start and at the
  end (``measured_spec(refresh=True, cache_dir=None)``: never a file cache written by another process at another
  time), and whether they moved;
- a reference step (a fixed small prefill and a fixed small decode of the notebook's model, its linears plain even
  where an engine packed them in between), timed at the start and at the end: its drift says whether the machine
  changed under the experiment;
- the load average and the CPU steal time before and after, and the torch thread count;
- anomalies: an MFU or MBU above 1 beyond ``UTILIZATION_TOLERANCE``, a batch that makes decode slower per token,
  a drift beyond ``DRIFT_THRESHOLD``, an end ceiling above the start one by more than ``CEILING_THRESHOLD``.

Settled ceilings (``settled_ceilings``). A ceiling is an upper bound, and interference (another process, a page
fault storm, a kernel starting) only lowers a probe's reading; on the 2-core VMs a notebook's first probe has read
20-35% low while a fresh process read the same machine steadily. So each ceiling is probed until two consecutive
readings agree within ``SETTLE_TOLERANCE`` (or the probes' own repeatability, if larger), at most
``SETTLE_TRIES`` readings, and the figure is the best (highest) of the readings. The change check compares the
settled start with the settled end and is one-sided: the figures were divided by the start's ceiling, so only an end
reading *above* it beyond the threshold says they were inflated; an end reading below it says the machine was
slower at the end, which the reference step's drift measures directly for the timings.

Each anomaly names exactly what it ``affects``, and a claim is voided only by an anomaly of what it rests on:
"timing" (a measured time quoted on its own, as a property of the machine: the reference step's drift, which says
the machine's speed changed under the experiment); "ceilings" (every figure divided by a measured ceiling: an MFU,
an MBU, a balance point; so an MFU or MBU above 1 and a ceiling that moved); "batching" (the batch sweep's table).
A claim that compares timings measured in the same notebook without dividing by a ceiling (07's simulator against
the engine) ``uses`` ("timing",) and a moving ceiling does not void it;
``workbench.experiments.claims.apply_anomalies`` turns the claims that rest on an affected quantity into
*inconclusive, unreliable*, so an anomaly is never stated as a finding. The claims that compare timings are decided
by paired, interleaved rounds (``workbench.experiments.trials``) and rest on none of these: rounds that interleave
the arms cancel a machine whose speed moves slowly, and such a claim is voided only by its own A/A control. The
record stays, for the absolute figures (an MFU, an MBU, a millisecond value quoted as the machine's).

Thread count: ``WORKBENCH_NUM_THREADS`` (set by ``workbench report --threads N``) when present. One thread is the
pipeline's default on a CPU because OpenMP's thread teams wait for their slowest member at every barrier: with two
threads on two cores and one other busy job, a batch-8 decode step was measured at 2,720 ms against 150 ms with one
thread, while one thread only shares its core.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from workbench.timing import now, set_threads, time_stats

UTILIZATION_TOLERANCE = 0.10  # MFU/MBU up to 1.10 is measurement noise of the ceiling probes; above is an error
DRIFT_THRESHOLD = 0.25  # reference step median changed by more than 25% between start and end
CEILING_THRESHOLD = 0.25  # the end's settled ceiling above the start's by more than 25%
SETTLE_TOLERANCE = 0.10  # two consecutive ceiling readings within 10% (or the probes' repeatability) agree
SETTLE_TRIES = 4  # at most this many ceiling readings (a CPU probe takes ~1-2 s)
REFERENCE_PREFILL_TOKENS = 32  # fp32: 16 FLOP/byte, compute-bound above a CPU's balance point (~3-5)
REFERENCE_DECODE_CONTEXT = 128
REFERENCE_SAMPLE_S = 0.1  # a timed sample of the reference step runs steps back to back for at least this long
REFERENCE_MAX_CALLS = 200  # ... but at most this many steps


# ---------------------------------------------------------------- the machine's state


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def cpu_times() -> dict[str, int] | None:
    """Aggregate CPU jiffies from /proc/stat: ``total``, ``idle`` (idle and iowait) and ``steal`` (None off
    Linux)."""
    try:
        line = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in line[1:]]
    return {"total": sum(values[:8]), "idle": sum(values[3:5]), "steal": values[7] if len(values) > 7 else 0}


def wait_until_quiet(max_s: float = 10.0, busy_share: float = 0.05, window_s: float = 0.2) -> float:
    """Wait until the machine's CPUs were busy less than ``busy_share`` of a ``window_s`` window (``cpu_times``), at
    most ``max_s`` seconds; returns the seconds waited (0 off Linux). Before a trial of one process timed against
    another's: work the other left running (vLLM's engine keeps its CPUs busy for a while after ``generate``
    returns, ``workbench bench vllm``) would otherwise fall into this trial's time."""
    start = now()
    before = cpu_times()
    if before is None:
        return 0.0
    while True:
        time.sleep(window_s)
        after = cpu_times()
        if after is None:
            return now() - start
        total = after["total"] - before["total"]
        quiet = total > 0 and 1 - (after["idle"] - before["idle"]) / total < busy_share
        if quiet or now() - start >= max_s:
            return now() - start
        before = after


def steal_share(before: Mapping[str, int] | None, after: Mapping[str, int] | None) -> float | None:
    """The share of CPU time stolen by the hypervisor between two ``cpu_times`` readings (None if unknown)."""
    if not before or not after or after["total"] <= before["total"]:
        return None
    return (after["steal"] - before["steal"]) / (after["total"] - before["total"])


def machine_state() -> dict[str, Any]:
    """Load average, CPU jiffies and the time: the "before" or "after" of a measurement."""
    return {"load_average": load_average(), "cpu_times": cpu_times(), "at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def measure_ceilings_now(device: str = "cpu", warm: bool = False) -> Any:
    """The ceilings measured now, in this process (no file cache read or written): a ``HardwareSpec``. ``warm``:
    the machine computed just before (a previous reading, an experiment), so a CPU probe skips its warm-up by time
    (``hardware.WARMUP_S``) and keeps its one warm-up call."""
    from workbench.hardware import measured_spec

    warmup = {"warmup_s": 0.0} if warm and device == "cpu" else {}
    return measured_spec(device=device, refresh=True, cache_dir=None, **warmup)


def ceiling_readings(device: str = "cpu", warm: bool = False) -> Callable[[], Any]:
    """The ``measure`` of ``settled_ceilings`` for ``device``: its first reading warms every probe up unless the
    machine is ``warm`` already (the end of an experiment, which computed until then), the readings that follow it at
    once do not again (about 1 s of warm-up less per reading on a CPU)."""

    def read() -> Any:
        nonlocal warm
        spec, warm = measure_ceilings_now(device, warm=warm), True
        return spec

    return read


def _agree(a: Any, b: Any, dtype: str, tolerance: float) -> bool:
    """Whether two ceiling readings agree: peak (``dtype``) and bandwidth each within the larger of ``tolerance``
    and the two readings' own repeatability (relative to the higher reading)."""
    tol = max([tolerance] + [float(h.details.get("repeatability") or 0.0) for h in (a, b)])
    pairs = ((a.peak(dtype), b.peak(dtype)), (a.mem_bandwidth, b.mem_bandwidth))
    return all(abs(x - y) <= tol * max(x, y) for x, y in pairs)


def settled_ceilings(
    measure: Callable[[], Any],
    dtype: str = "fp32",
    tries: int = SETTLE_TRIES,
    tolerance: float = SETTLE_TOLERANCE,
) -> Any:
    """Ceilings read with ``measure`` (a ``HardwareSpec`` per call) until two consecutive readings agree (see
    ``_agree``), at most ``tries`` readings; returns the best of them: each peak and the bandwidth at their highest
    reading (a ceiling is an upper bound that interference only lowers). ``details["settle"]`` records the readings
    (``peak_flops_dtype`` and ``mem_bandwidth`` of each), whether the last two agreed (``settled``) and the tolerance.
    """
    if tries < 2:
        raise ValueError(f"settled_ceilings: tries must be >= 2 (two readings to agree), got {tries}")
    readings = [measure()]
    settled = False
    while len(readings) < tries and not settled:
        readings.append(measure())
        settled = _agree(readings[-2], readings[-1], dtype, tolerance)
    peaks: dict[str, float] = {}
    for h in readings:
        for k, v in h.peak_flops.items():
            peaks[k] = max(peaks.get(k, 0.0), float(v))
    best = max(readings, key=lambda h: h.peak(dtype))
    details = {
        **best.details,
        "repeatability": max(float(h.details.get("repeatability") or 0.0) for h in readings),
        "settle": {
            "readings": [{"peak_flops_dtype": h.peak(dtype), "mem_bandwidth": h.mem_bandwidth} for h in readings],
            "settled": settled,
            "tolerance": tolerance,
        },
    }
    return replace(best, peak_flops=peaks, mem_bandwidth=max(h.mem_bandwidth for h in readings), details=details)


def ceilings_summary(hw: Any, dtype: str = "fp32") -> dict[str, Any]:
    """The numbers of a measured ``HardwareSpec`` that results are divided by (with its settling, if settled)."""
    return {
        "peak_flops": {k: float(v) for k, v in hw.peak_flops.items()},
        "peak_flops_dtype": float(hw.peak(dtype)),
        "mem_bandwidth": float(hw.mem_bandwidth),
        "measured_at": hw.details.get("measured_at"),
        "num_threads": hw.details.get("num_threads"),
        "repeatability": hw.details.get("repeatability"),  # the largest (max - min) / median of the probes' calls
        "settle": hw.details.get("settle"),
    }


def balance_points(record: Mapping[str, Any]) -> list[float]:
    """The balance point (peak / bandwidth, FLOP/byte) of every ceiling reading of a hygiene ``record``
    (``end_checks``'s, or ``start_checks``'s): each settled probe's readings, the start's then the end's; the
    spread of the balance point a roofline claim is divided by (``claims.prefill_compute_bound``)."""
    out = []
    for key in ("ceilings_start", "ceilings_end"):
        settle = (record.get(key) or {}).get("settle") or {}
        out += [r["peak_flops_dtype"] / r["mem_bandwidth"] for r in settle.get("readings") or ()]
    return out


# ---------------------------------------------------------------- the reference step


def reference_step(model: Any, repeats: int = 5, calls: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Time a fixed small prefill (``REFERENCE_PREFILL_TOKENS`` tokens) and decode (batch 1 at context
    ``REFERENCE_DECODE_CONTEXT``) of ``model``: ``{"prefill": stats, "decode": stats}`` (see ``time_stats``), each
    with ``calls``, the steps run back to back in every timed sample; the figures are per step.

    A sample lasts at least ``REFERENCE_SAMPLE_S``: ``calls`` None takes as many steps per sample as that needs
    (from the fastest of three steps after the warm-up); the end of an experiment passes the start's counts, so that
    both time the same work. A tiny model's step takes ~1 ms, and the median of ``repeats`` single steps measures
    the scheduler rather than the machine: on the project's 2-core EPYC the minimum of 40 single tiny-gqa prefills
    read 1.2 and 2.6 ms back to back in one unchanged process, and notebook 07's reference moved +73% (prefill) and
    -39% (decode), opposite directions, on a quiet machine. A model whose step outlasts a sample is timed one step
    at a time, as before.
    """
    import torch

    from workbench.device import synchronize
    from workbench.model.packed import plain_linears
    from workbench.timing import timed

    cfg = model.config
    n = min(REFERENCE_PREFILL_TOKENS, cfg.max_position_embeddings - 1)
    ctx = min(REFERENCE_DECODE_CONTEXT, cfg.max_position_embeddings)
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    pcache = model.new_cache(1, n)
    dcache = model.new_cache(1, ctx)

    def prefill() -> None:
        model.prefill([prompt], pcache, [0])

    def decode() -> None:
        dcache.lengths[0] = ctx - 1
        model.decode([1], dcache, [0])

    def sync() -> None:
        synchronize(model.device)

    out = {}
    with plain_linears(model):  # an engine packs the model it runs (Engine.__init__): time the same products
        for name, fn in (("prefill", prefill), ("decode", decode)):
            given = calls is not None and name in calls  # the end of an experiment: the start's counts
            if given:
                k = int(calls[name])
            else:
                fn()  # warm-up: the first step of a shape builds what later ones reuse
                one = min(timed(fn, sync=sync)[0] for _ in range(3))  # a step when nothing interrupts it
                k = max(1, min(REFERENCE_MAX_CALLS, math.ceil(REFERENCE_SAMPLE_S / max(one, 1e-9))))

            def sample(fn: Callable[[], None] = fn, k: int = k) -> None:
                for _ in range(k):
                    fn()

            # a given count warms up once (the model ran other shapes since); else the four steps above did
            stats = time_stats(sample, warmup=1 if given else 0, repeats=repeats, sync=sync)
            stats.pop("times_s")
            out[name] = {**{key: (v / k if key.endswith("_s") else v) for key, v in stats.items()}, "calls": k}
    return out


# ---------------------------------------------------------------- start and end of an experiment


def start_checks(model: Any, device: str = "cpu", dtype: str = "fp32", num_threads: int | None = None) -> dict:
    """Threads, machine state, ceilings and the reference step at the start of an experiment.

    Returns ``{"num_threads", "state_start", "hw", "ceilings_start", "reference_start"}``; ``hw`` is the
    ``HardwareSpec`` to divide results by (measured now, settled: ``settled_ceilings``).
    """
    threads = set_threads(num_threads, otherwise="keep")  # else $WORKBENCH_NUM_THREADS, else as they are
    state = machine_state()
    hw = settled_ceilings(ceiling_readings(device), dtype)
    return {
        "num_threads": threads,
        "state_start": state,
        "hw": hw,
        "dtype": dtype,
        "ceilings_start": ceilings_summary(hw, dtype),
        "reference_start": reference_step(model),
    }


def end_checks(start: Mapping[str, Any], model: Any, device: str = "cpu") -> dict[str, Any]:
    """The same at the end (the ceilings settled again), with the drift of the reference step and the change of
    each ceiling (end over start, minus 1).

    Returns the JSON-ready record of the experiment's hygiene (``ceilings_start``, ``ceilings_end``,
    ``load_average_start``, ``load_average_end``, ``cpu_steal_share``, ``num_threads``, ``reference_start``,
    ``reference_end``, ``reference_drift``, ``ceiling_change``) and ``anomalies`` from the drift and the ceilings.
    """
    calls = {phase: stats["calls"] for phase, stats in start["reference_start"].items() if "calls" in stats}
    reference_end = reference_step(model, calls=calls)  # the same steps per sample as at the start
    dtype = start.get("dtype", "fp32")
    ceilings_end = ceilings_summary(settled_ceilings(ceiling_readings(device, warm=True), dtype), dtype)
    state_end = machine_state()
    drift = {
        phase: reference_end[phase]["median_s"] / start["reference_start"][phase]["median_s"] - 1.0
        for phase in ("prefill", "decode")
    }
    c0 = start["ceilings_start"]
    change = {
        "peak_flops": ceilings_end["peak_flops_dtype"] / c0["peak_flops_dtype"] - 1.0,
        "mem_bandwidth": ceilings_end["mem_bandwidth"] / c0["mem_bandwidth"] - 1.0,
    }
    out = {
        "num_threads": start["num_threads"],
        "ceilings_start": c0,
        "ceilings_end": ceilings_end,
        "load_average_start": start["state_start"]["load_average"],
        "load_average_end": state_end["load_average"],
        "cpu_steal_share": steal_share(start["state_start"]["cpu_times"], state_end["cpu_times"]),
        "reference_start": start["reference_start"],
        "reference_end": reference_end,
        "reference_drift": drift,
        "ceiling_change": change,
    }
    out["anomalies"] = check_drift(drift) + check_ceilings(change)
    return out


# ---------------------------------------------------------------- sanity checks


def anomaly(check: str, message: str, affects: str, **values: Any) -> dict[str, Any]:
    """One flagged problem: which ``check``, a sentence, what it ``affects`` (timing | ceilings | batching)."""
    return {"check": check, "message": message, "affects": affects, **values}


def check_utilization(rows: Iterable[Mapping[str, Any]], tolerance: float = UTILIZATION_TOLERANCE) -> list[dict]:
    """An anomaly for every row whose ``mfu`` or ``mbu`` exceeds ``1 + tolerance``: the ceiling it is divided by
    was measured too low (or the count is wrong), so no utilization of this run is a finding."""
    out = []
    for r in rows:
        for key in ("mfu", "mbu"):
            value = r.get(key)
            if value is not None and value > 1.0 + tolerance:
                where = f"{r.get('phase', '?')} batch {r.get('batch')} context {r.get('context_len')}"
                out.append(
                    anomaly(
                        f"{key}_above_1",
                        f"{key.upper()} {value:.2f} > 1 + {tolerance:g} ({where}): the measured ceiling is too low "
                        "for this run, so utilizations are not findings",
                        "ceilings",
                        value=value,
                        tolerance=tolerance,
                    )
                )
    return out


def check_batching(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    """An anomaly where a larger decode batch made each token slower, beyond the spread of both timings.

    For each context length, batches in increasing order: per-token time = step time / batch; a larger batch is
    flagged when its fastest per-token time (``time_min_s``) exceeds the slowest (``time_max_s``) of the smaller.
    Rows without a spread use their ``time_s`` for both. It blames no one: on a quiet machine it is the engine's
    batched step (its attention at long contexts) costing more per token; whether the machine moved is for the
    reference step's drift and the paired claims' A/A control to say.
    """
    out = []
    by_ctx: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("phase", "decode") == "decode":
            by_ctx.setdefault(r.get("context_len"), []).append(r)
    for ctx, group in by_ctx.items():
        group = sorted(group, key=lambda r: r["batch"])
        for small, big in zip(group, group[1:]):
            small_max = small.get("time_max_s", small["time_s"]) / small["batch"]
            big_min = big.get("time_min_s", big["time_s"]) / big["batch"]
            if big_min > small_max:
                out.append(
                    anomaly(
                        "batching_slower_per_token",
                        f"decode at context {ctx}: batch {big['batch']} took {big_min * 1e3:.2f} ms per token at "
                        f"best, batch {small['batch']} {small_max * 1e3:.2f} ms at worst: the larger batch's step "
                        "costs more per token here (the sweep's per-token figures at this context are not the "
                        "machine's; the paired batching claim and its A/A control decide the claim)",
                        "batching",
                        context_len=ctx,
                        batches=[small["batch"], big["batch"]],
                    )
                )
    return out


def check_drift(drift: Mapping[str, float], threshold: float = DRIFT_THRESHOLD) -> list[dict]:
    """An anomaly for a reference step whose median moved by more than ``threshold`` between start and end."""
    return [
        anomaly(
            "reference_drift",
            f"the reference {phase} step's median changed by {value:+.0%} between the start and the end "
            f"(threshold {threshold:.0%}): the machine's speed changed during the experiment",
            "timing",
            phase=phase,
            value=value,
            threshold=threshold,
        )
        for phase, value in drift.items()
        if abs(value) > threshold
    ]


def check_ceilings(change: Mapping[str, float], threshold: float = CEILING_THRESHOLD) -> list[dict]:
    """An anomaly for a ceiling whose settled end reading exceeds the start's by more than ``threshold``.

    It ``affects`` "ceilings" only: the figures divided by the start's ceiling (an MFU, an MBU, a balance point)
    were inflated by a start reading that was too low. A reading that fell is not flagged here (the start's, the
    higher, is the better upper bound; a slower machine is the reference step's drift to say), and no timing
    claim rests on a ceiling."""
    return [
        anomaly(
            "ceiling_moved",
            f"the measured {name.replace('_', ' ')} read {value:+.0%} higher at the end than at the start, both "
            f"settled (threshold {threshold:.0%}): the start's ceiling was too low, so the figures divided by it "
            "(MFU, MBU, the balance point) are unreliable; the timings themselves are not affected",
            "ceilings",
            ceiling=name,
            value=value,
            threshold=threshold,
        )
        for name, value in change.items()
        if value > threshold
    ]


__all__ = [
    "machine_state",
    "ceiling_readings",
    "measure_ceilings_now",
    "settled_ceilings",
    "balance_points",
    "reference_step",
    "start_checks",
    "end_checks",
    "anomaly",
    "check_utilization",
    "check_batching",
    "check_drift",
    "check_ceilings",
]
