"""Measure the real engine's step times on this machine and fit the ``profiled`` cost model to them.

``measure_engine_steps`` replays workloads on an ``Engine`` and pairs every logged step with the ``StepStats``
of the plan it executed (``Engine.on_step`` hands over each plan with its log record), plus the host gap after
each step that was followed at once by another (not by an idle wait for an arrival). ``fit_engine_profile`` fits
``ProfiledCostModel`` to them. Torch is imported only through the engine.
"""

from __future__ import annotations

import bisect
import math
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

from workbench.engine.scheduler import StepPlan
from workbench.errors import ConfigError
from workbench.sim.costmodel import ProfiledCostModel, StepStats, fit_profile, plan_stats, token_knots
from workbench.timing import set_threads
from workbench.workloads import Request, synthetic_workload

STEP_FIELDS_PLAIN = StepStats._fields.index("spec_tokens")  # the fields before the speculative ones


@dataclass
class StepSamples:
    """Measured steps: what each computed, how long it took, and the busy host gaps between steps."""

    stats: list[StepStats] = field(default_factory=list)
    durations_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    after_idle: list[bool] = field(default_factory=list)  # per step: the engine idled (waited for an arrival) before it
    wakes_s: list[float] = field(default_factory=list)  # per idle wait: from the arrival that ended it to the step

    def extend(self, other: StepSamples) -> None:
        self.stats += other.stats
        self.durations_s += other.durations_s
        self.gaps_s += other.gaps_s
        self.after_idle += other.after_idle
        self.wakes_s += other.wakes_s

    def to_dict(self) -> dict[str, Any]:
        """The samples as compact JSON: ``fields`` (the ``StepStats`` fields, the speculative ones only when a step
        has them) and one row of them per step in ``stats``; ``durations_s``, ``gaps_s`` and ``wakes_s`` as measured
        (unrounded: a re-fit reproduces the fit exactly, its outlier cut and active set included); ``after_idle`` as
        0/1. ``from_dict`` reads it back."""
        width = STEP_FIELDS_PLAIN if all(not any(s[STEP_FIELDS_PLAIN:]) for s in self.stats) else len(StepStats._fields)
        return {"fields": list(StepStats._fields[:width]), "stats": [list(s[:width]) for s in self.stats],
                "durations_s": [float(x) for x in self.durations_s], "gaps_s": [float(x) for x in self.gaps_s],
                "after_idle": [int(x) for x in self.after_idle],
                "wakes_s": [float(x) for x in self.wakes_s]}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any, where: str = "steps") -> StepSamples:
        """Samples written by ``to_dict`` (ConfigError naming ``where`` and what is wrong otherwise)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected an object with fields, stats, durations_s, ..., got {type(data)}")
        missing = [k for k in ("fields", "stats", "durations_s", "gaps_s", "after_idle", "wakes_s") if k not in data]
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(missing)} (written by StepSamples.to_dict)")
        names = list(data["fields"])
        unknown = [n for n in names if n not in StepStats._fields]
        if unknown:
            raise ConfigError(f"{where}: unknown step fields {unknown}; expected some of {list(StepStats._fields)}")
        stats = data["stats"]
        n = len(stats)
        if len(data["durations_s"]) != n or len(data["after_idle"]) != n:
            raise ConfigError(f"{where}: {n} steps but {len(data['durations_s'])} durations_s and "
                              f"{len(data['after_idle'])} after_idle")  # fmt: skip
        bad = [i for i, row in enumerate(stats) if len(row) != len(names)]
        if bad:
            raise ConfigError(f"{where}: step {bad[0]} has {len(stats[bad[0]])} values for {len(names)} fields")
        return cls([StepStats(**dict(zip(names, (int(v) for v in row)))) for row in stats],
                   [float(x) for x in data["durations_s"]], [float(x) for x in data["gaps_s"]],
                   [bool(x) for x in data["after_idle"]], [float(x) for x in data["wakes_s"]])  # fmt: skip


def measure_engine_steps(
    engine_factory: Any, workloads: list[list[Request]], seed: int = 0, progress: Any = None
) -> StepSamples:
    """Replay each workload on a fresh engine from ``engine_factory()`` and collect its steps (``progress``: a
    tqdm-like object updated once per workload)."""
    samples = StepSamples()
    for requests in workloads:
        engine = engine_factory()
        plans = observe_steps(engine)
        engine.replay(requests, seed=seed)
        if progress is not None:
            progress.update(1)
        samples.extend(engine_samples(engine, requests, plans))
    return samples


def observe_steps(engine: Any) -> tuple[list[StepStats], list[bool]]:
    """Hook ``engine.on_step``: the two lists it returns fill, per step the engine runs, with the ``StepStats`` of
    its plan and whether work remained right after it (the next step follows at once); ``engine_samples`` pairs
    them with the step log."""
    stats: list[StepStats] = []
    busy_after: list[bool] = []

    def observe(plan: StepPlan, _record: Any) -> None:
        stats.append(plan_stats(plan))
        busy_after.append(engine.has_unfinished())

    engine.on_step = observe
    return stats, busy_after


def engine_samples(engine: Any, requests: list[Request], plans: tuple[list[StepStats], list[bool]]) -> StepSamples:
    """The steps of ``engine``'s replay of ``requests`` (observed by ``observe_steps``, which gave ``plans``): each
    step's stats and duration, the busy host gaps, which steps followed an idle wait and the wake-up delays."""
    stats, busy_after = plans
    steps = engine.step_log.steps
    if len(steps) != len(stats):
        raise RuntimeError(f"measured {len(steps)} logged steps but captured {len(stats)} plans")
    samples = StepSamples(list(stats), [s.end_s - s.start_s for s in steps])
    samples.gaps_s += [b.start_s - a.end_s for a, b, busy in zip(steps, steps[1:], busy_after) if busy]
    # a step follows an idle wait when no work was left after the previous one and the engine slept until an
    # arrival (one that came during the previous step is admitted at once, as in the simulator)
    arrivals = sorted(r.arrival_time_s for r in requests)
    for i, step in enumerate(steps):
        j = bisect.bisect_right(arrivals, step.start_s)
        idle = j > 0 and (i == 0 or (not busy_after[i - 1] and arrivals[j - 1] > steps[i - 1].end_s))
        samples.after_idle.append(idle)
        if idle:
            samples.wakes_s.append(max(0.0, step.start_s - arrivals[j - 1]))
    return samples


def step_errors(cost: Any, samples: StepSamples) -> dict[str, Any]:
    """A cost model's error on measured steps, those not after an idle wait (whose extra time the models price
    apart): per step ``(predicted - measured) / measured`` of ``cost.step_time``; ``num_steps``, the median signed
    and absolute error, the 90th percentile of the absolute error and ``total_ratio``, the predicted time of all
    these steps over the measured. On the fidelity check's own runs it tells a cost model that prices the steps off
    from a simulation that queues them otherwise (None values without such steps)."""
    import statistics

    pairs = [(cost.step_time(s), t) for s, t, idle in zip(samples.stats, samples.durations_s, samples.after_idle)
             if not idle and t > 0]  # fmt: skip
    if not pairs:
        return {"num_steps": 0, "median": None, "median_abs": None, "p90_abs": None, "total_ratio": None}
    rel = [(p - t) / t for p, t in pairs]
    absolute = sorted(abs(r) for r in rel)
    return {"num_steps": len(rel), "median": statistics.median(rel), "median_abs": statistics.median(absolute),
            "p90_abs": absolute[min(len(absolute) - 1, math.ceil(0.9 * len(absolute)) - 1)],
            "total_ratio": sum(p for p, _ in pairs) / sum(t for _, t in pairs)}  # fmt: skip


def measure_training_policy(net: Any, cfg: Any, num_requests: int, seed: int, progress: Any = None) -> StepSamples:
    """The training workloads' steps (``training_workloads``) on engines of ``cfg`` over ``net``, in steady state:
    one unmeasured replay of part of the first workload, then the measured replays (``measure_engine_steps``);
    ``InterleavedTraining`` all at once. Both profiles' fits measure their engine this way."""
    training = InterleavedTraining(net, [cfg], num_requests, seed, progress=progress)
    training.run_due(1.0)
    return training.samples


def training_workloads(max_model_len: int, num_requests: int = 24, seed: int = 1000) -> list[list[Request]]:
    """Synthetic workloads that cover the step mixes: a light and a heavy Poisson load, short and long prompts, a
    burst (all requests at once) whose batch fills to ``max_num_seqs`` and drains one finish at a time through
    every batch size with long contexts, whatever the model's speed (a Poisson rate is light for one model and
    saturating for another), and a sparse one: nearly regular arrivals 0.5 s apart of short requests, so that most
    steps start after an idle wait. A light held-out load (2 requests/s) is mostly such steps, whose extra time and
    wake-up delay the other three workloads sample a handful of times (6 of 441 steps of SmolLM2-135M's profile)."""
    top = max(16, max_model_len // 2)
    return [
        synthetic_workload(num_requests, rate=4.0, prompt_lens=f"uniform:8:{top}", output_lens="uniform:2:24",
                           seed=seed),
        synthetic_workload(num_requests, rate=30.0, prompt_lens=f"uniform:8:{top // 2}", output_lens="uniform:8:40",
                           seed=seed + 1),
        synthetic_workload(num_requests, rate=1000.0, prompt_lens=f"uniform:4:{max(16, 3 * max_model_len // 4)}",
                           output_lens=f"uniform:2:{max(8, max_model_len // 4)}", seed=seed + 2),
        synthetic_workload(max(2, num_requests // 2), rate=2.0, cv=0.25, prompt_lens=f"uniform:4:{top}",
                           output_lens="uniform:2:8", seed=seed + 3),
    ]  # fmt: skip


def default_profile_path(model: str) -> str:
    """Where ``workbench fit-profile`` writes the fitted profile of ``model`` on this machine by default."""
    import re

    from workbench.config import DATA_DIR
    from workbench.hardware import cpu_model_name

    machine = re.sub(r"[^a-z0-9]+", "-", cpu_model_name().lower()).strip("-") or "cpu"
    return str(DATA_DIR / "profiles" / f"{model}-{machine}.json")


def default_op_profile_path(model: str, machine: str) -> str:
    """Where ``workbench profile-ops`` writes the op profile of ``model`` on ``machine`` (a CPU model), by default."""
    import re

    from workbench.config import DATA_DIR

    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-") or "machine"
    return str(DATA_DIR / "profiles" / f"op-{model}-{slug}.json")


def machine_identity() -> dict[str, Any]:
    """What a profile's step times depend on, beyond the model: the CPU model as the OS names it (a VM's name can be
    as generic as "Intel(R) Xeon(R) Processor" for parts of several generations), its number of CPUs and the vector
    instruction set torch dispatches to on it (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2, ...)."""
    import os

    import torch

    from workbench.hardware import cpu_model_name

    return {"cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip


def identity_mismatch(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The facts of ``machine_identity`` on which a profile's record and this machine differ (those it recorded)."""
    return [f"{k} {recorded[k]!r} (here {current.get(k)!r})" for k in ("cpu", "cpu_count", "cpu_capability")
            if recorded.get(k) is not None and recorded[k] != current.get(k)]  # fmt: skip


def _load_1min() -> float | None:
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def fit_engine_profile(
    model: str,
    policies: tuple[str, ...] = ("continuous", "chunked"),
    num_requests: int = 24,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    token_budget: int | None = None,
    seed: int = 1000,
    device: str = "cpu",
    dtype: str = "fp32",
    threads: int | None = 1,
    progress: Any = None,
) -> ProfiledCostModel:
    """Measure ``model`` (a preset, random weights) on the engine under each policy and fit a profile.

    ``threads``: torch CPU threads while measuring (1 by default: a small model gains nothing from more, and on a
    shared machine extra threads wait on each other); the simulated engine should run with the same. Each policy
    is measured after one warm-up replay of the first workload. ``progress``: a
    tqdm-like object updated once per measured workload (``len(policies) * len(training_workloads(...))`` in all).
    """
    from workbench.device import resolve_device, torch_dtype
    from workbench.model.checkpoint import load_model

    _check_counts(num_requests=num_requests, threads=threads)
    if threads is not None:
        set_threads(threads)
    dev = resolve_device(device)
    net = load_model(model, dtype=torch_dtype(dtype), device=dev, seed=0)
    configs = training_configs(policies, max_num_seqs, max_model_len, token_budget, dtype, device)
    training = InterleavedTraining(net, configs, num_requests, seed, model, progress)
    training.run_due(1.0)
    return training.fit()


def training_configs(
    policies: tuple[str, ...] = ("continuous", "chunked"),
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    token_budget: int | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
) -> list[Any]:
    """The engines a profile is fitted on: one ``EngineConfig`` per policy (chunked: a token budget of half the
    context unless ``token_budget``)."""
    from workbench.engine.config import EngineConfig

    return [EngineConfig(policy=p, max_num_seqs=max_num_seqs, max_model_len=max_model_len, dtype=dtype,
                         device=device, token_budget=token_budget or (max_model_len // 2 if p == "chunked" else None))
            for p in policies]  # fmt: skip


def _check_counts(**values: Any) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(
                f"{name} must be a positive integer (--{name.replace('_', '-')} N, N >= 1), got {value!r}"
            )


def due_items(num_items: int, fraction: float) -> int:
    """How many of ``num_items`` evenly spread items are due once ``fraction`` (0 to 1) of a period has passed:
    ``floor(num_items * fraction + 1/2)``, so 8 items over 15 runs fall after runs 1, 3, 5, 7, 9, 11, 13 and 15."""
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"fraction must lie in [0, 1], got {fraction!r}")
    return min(num_items, math.floor(num_items * fraction + 0.5))


class InterleavedTraining:
    """The training workloads of ``fit_engine_profile`` (``training_workloads`` on engines of each of ``configs``,
    ``training_configs``, over ``net``), measured one workload at a time whenever ``run_due`` is called, then fitted
    (``fit``). ``fit_engine_profile`` runs them all at once; the fidelity check (``workbench fidelity`` and notebook 07,
    ``workbench.experiments.fidelity.colocated_fidelity``) calls ``run_due`` between its measured runs, so that the
    profile's steps sample the machine over the same minutes as the runs it is compared with (the op profile's overhead
    workloads too, on its own engine configs: ``workbench.sim.op_timing.overhead_engine_configs``). A shared CPU's speed
    drifts by more than the check's 10% tolerance from one minute to the next even at a load average of 1 (noisy
    neighbours the guest cannot see): on the 2-core AMD EPYC the repeats of one policy spread by up to 22%, and a
    profile measured in the 2 minutes before the runs priced their steps ~20% high, which at 2 requests/s (a replica
    busy most of the time) moved the simulated ITL median by +17..+57% and left 2 of 20 statistics within tolerance; the
    same profile scaled by 0.8 held 19 of 20. Each policy's first workload is preceded by one unmeasured warm-up replay
    of part of it (as ``measure_training_policy``)."""

    def __init__(
        self,
        net: Any,
        configs: list[Any],
        num_requests: int = 24,
        seed: int = 1000,
        model: str | None = None,
        progress: Any = None,
    ) -> None:
        _check_counts(num_requests=num_requests)
        if not configs:
            raise ConfigError("InterleavedTraining needs at least one engine config")
        self.net, self.configs, self.model, self.seed, self.progress = net, list(configs), model, seed, progress
        self.items = [(cfg, w) for cfg in self.configs
                      for w in training_workloads(cfg.max_model_len, num_requests, seed)]  # fmt: skip
        self.samples = StepSamples()
        self.done = 0
        self.seconds = 0.0
        self._warm: set[int] = set()
        self._loads = [_load_1min()]

    def run_due(self, fraction: float) -> int:
        """Measure the items due once ``fraction`` of the period has passed (``due_items``); returns how many ran."""
        from workbench.engine.engine import Engine
        from workbench.timing import now

        ran = 0
        while self.done < due_items(len(self.items), fraction):
            t0 = now()
            cfg, requests = self.items[self.done]
            if id(cfg) not in self._warm:
                self._warm.add(id(cfg))
                Engine(self.net, cfg).replay(requests[: max(2, len(requests) // 4)], seed=self.seed)  # not measured
            self.samples.extend(measure_engine_steps(lambda cfg=cfg: Engine(self.net, cfg), [requests], self.seed,
                                                     self.progress))  # fmt: skip
            self.done += 1
            ran += 1
            self.seconds += now() - t0
        self._loads.append(_load_1min())
        return ran

    def fit(self) -> ProfiledCostModel:
        """The profile fitted to the steps measured so far (ConfigError before any)."""
        import torch

        from workbench.device import resolve_device
        from workbench.engine.runner import make_backend
        from workbench.hardware import cpu_model_name
        from workbench.model.packed import count_packed

        if not self.samples.stats:
            raise ConfigError("no training steps measured yet (call run_due first)")
        dev = resolve_device(self.configs[0].device)
        loads = [x for x in self._loads if x is not None]
        meta = {
            "model": self.model,
            "machine": cpu_model_name() if dev.type == "cpu" else torch.cuda.get_device_name(dev),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "outlier_ratio": 2.0,
            "engine_configs": [asdict(c) for c in self.configs],
            "num_gaps": len(self.samples.gaps_s),
            **{k: v for k, v in machine_identity().items() if k != "cpu"},
            "load_average_1min": [loads[0], loads[-1]] if loads else [None, None],
            "workloads_measured": f"{self.done} of {len(self.items)}",
            "attention_backend": make_backend(self.configs[0].attention_backend, dev.type).name,  # as resolved
            "packed_layers": count_packed(self.net),  # what the engines packed (workbench.model.packed), not the flag
        }
        return fit_samples(self.samples, meta, engine_batched_decode(dev), engine_kernel_breaks(self.net))

    def steps_record(self) -> dict[str, Any]:
        """The steps measured so far and the engine facts the fit takes beside them (``steps_record``): what a
        re-fit elsewhere needs (``refit_steps``)."""
        from workbench.device import resolve_device

        dev = resolve_device(self.configs[0].device)
        return steps_record(self.samples, engine_batched_decode(dev), engine_kernel_breaks(self.net))


STEPS_FORMAT = "workbench-steps-v1"


def fit_samples(
    samples: StepSamples,
    meta: dict | None,
    batched_decode: tuple[int, int] | None,
    kernel_breaks: tuple[int, ...],
) -> ProfiledCostModel:
    """``fit_profile`` on measured engine steps, as ``fit-profile`` and the fidelity check fit them: a token curve
    with knots at the steps' token counts (``token_knots``), the steps after an idle wait and the wake-up delays
    apart, ``batched_decode`` and ``kernel_breaks`` the engine's (``engine_batched_decode``,
    ``engine_kernel_breaks``)."""
    s = samples
    knots = token_knots([x.num_tokens for x in s.stats])
    return fit_profile(s.stats, s.durations_s, s.gaps_s, meta, knots=knots, batched_decode=batched_decode,
                       after_idle=s.after_idle, wakes_s=s.wakes_s, kernel_breaks=tuple(kernel_breaks))  # fmt: skip


def steps_record(samples: StepSamples, batched_decode: tuple[int, int] | None, kernel_breaks: tuple[int, ...]) -> dict:
    """``samples`` as JSON (``StepSamples.to_dict``) with ``format`` (``STEPS_FORMAT``) and the engine facts
    ``fit_samples`` takes: ``batched_decode`` ([min_seqs, max_key_slots] or None) and ``kernel_breaks``, so that
    ``refit_steps`` repeats the fit on another machine whatever its own engine would do."""
    bd = None if batched_decode is None else [int(x) for x in batched_decode]
    return {"format": STEPS_FORMAT, "batched_decode": bd, "kernel_breaks": [int(b) for b in kernel_breaks],
            **samples.to_dict()}  # fmt: skip


def refit_steps(record: Any, meta: dict | None = None, where: str = "steps") -> ProfiledCostModel:
    """The ``profiled`` fit repeated on a ``steps_record`` (``fit_samples``; ``meta`` becomes the profile's meta
    beside the new ``fit``). ConfigError naming ``where`` when ``record`` is not one."""
    if not isinstance(record, dict) or record.get("format") != STEPS_FORMAT:
        got = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f'{where}: not a steps record (expected "format": "{STEPS_FORMAT}", got {got!r})')
    samples = StepSamples.from_dict(record, where)
    if not samples.stats:
        raise ConfigError(f"{where}: no steps to fit")
    bd = record.get("batched_decode")
    if bd is not None and (not isinstance(bd, list) or len(bd) != 2):
        raise ConfigError(f"{where}: batched_decode must be null or [min_seqs, max_key_slots], got {bd!r}")
    breaks = record.get("kernel_breaks") or []
    meta = {k: v for k, v in (meta or {}).items() if k != "fit"}
    return fit_samples(samples, meta, None if bd is None else (int(bd[0]), int(bd[1])), tuple(int(b) for b in breaks))


def engine_kernel_breaks(model: Any) -> tuple[int, ...]:
    """The token counts where the engine's dense layers switch kernels (``fit_profile``'s ``kernel_breaks``), from what
    ``model`` (the net the measured engines ran) holds: with any packed layer (``workbench.model.packed``,
    ``count_packed``), products of ``PACKED_MIN_ROWS`` rows or more run the packed kernel and the others the plain
    one; none when nothing was packed (another device or dtype, packing off, or a model of small matrices:
    ``PACKED_MIN_WEIGHT``)."""
    from workbench.model.packed import PACKED_MIN_ROWS, count_packed

    return (PACKED_MIN_ROWS,) if count_packed(model) else ()


def engine_batched_decode(device: Any) -> tuple[int, int] | None:
    """The engine's rule for attending a decode-only step in one padded gather, (min_seqs, max_key_slots), on a
    device whose engine attends with the torch backend one sequence at a time otherwise (CPU); None elsewhere."""
    from workbench.model.attention import MAX_GATHER_KEY_SLOTS

    return (1, MAX_GATHER_KEY_SLOTS) if str(device).startswith("cpu") else None


def check_profile_matches(profile: Any, path: Any, model_name: str, hardware: Any, force: bool = False) -> None:
    """ConfigError unless ``profile`` (a ``ProfiledCostModel``) was fitted on ``model_name`` and, when ``hardware``
    (a ``HardwareSpec``) is given, on that machine: a measured spec matches, a datasheet accelerator does not (the
    profile's step times are those of the machine it measured). ``force`` skips both checks."""
    if force:
        return
    meta = profile.meta or {}
    fitted = meta.get("model")
    if fitted is not None and str(fitted).lower() != model_name.lower():
        raise ConfigError(
            f"profile {path} was fitted on model {fitted!r}, not {model_name!r}; fit one with `workbench fit-profile "
            f"--model {model_name}`, or pass --force-profile to use it anyway"
        )
    if hardware is not None and not str(hardware.name).startswith("measured"):
        machine = meta.get("machine", "another machine")
        raise ConfigError(
            f"profile {path} holds step times measured on {machine}, not on {hardware.name}; leave out --hardware "
            f"(or give --hardware measured), use --cost-model roofline for {hardware.name}, or pass --force-profile"
        )


def profiled_engine_num_blocks(config: Any, model_cfg: Any) -> int:
    """The pool an engine of these settings gets by default (``EngineConfig.cache_shape``, the one planner): the pool
    a profiled machine ran with."""
    from workbench.engine.config import EngineConfig

    fields = ("policy", "block_size", "max_num_seqs", "max_model_len", "dtype")
    return EngineConfig(**{name: getattr(config, name) for name in fields}).cache_shape(model_cfg)[0]
