"""The discrete-event serving simulator: replicas running the engine's own Scheduler, a router, and optional
prefill/decode disaggregation with a KV link.

One replica is the engine with its device replaced by a ``CostModel``: the same ``Scheduler`` and
``BlockManager`` objects, driven by the same loop as ``Engine.replay`` on a virtual clock. At the top of each
iteration, every request that has arrived (``arrival <= step start``) is in the scheduler; the step is planned by
``Scheduler.schedule(now=start)``, lasts what the cost model says, and ``Scheduler.update`` stamps its tokens
with the step's end time. When nothing is left to do the replica idles until its next request arrives.

Fast path: when the scheduler says the next steps are the same pure-decode step over the same sequences
(``Scheduler.decode_steps_until_change``: no request waits, no finish, enough free blocks), all but the last of
them that start before the next event are applied at once by ``Scheduler.advance_decode_steps`` with the
times of ``CostModel.decode_run``; the last goes through ``schedule``/``update`` as usual.

Cluster: ``num_replicas`` replicas behind a router (``round-robin``; ``least-outstanding``: fewest routed and
unfinished requests; ``shortest-queue``: fewest requests waiting for admission; ties go to the lowest index).
Disaggregation (``disaggregate=(P, D)``): P prefill replicas run each request's prompt and first token; its KV
(``num_prompt_tokens * kv_bytes_per_token``) then crosses a link in
``bytes / (link_gbps * 1e9 / 8) + link_latency_s`` (each transfer on its own, no contention, as in
DistServe's model of a dedicated high-bandwidth link: Zhong et al., OSDI'24), and the request joins the
decode replica chosen by the router when the transfer completes; that replica admits it (blocks for its
tokens, FCFS, keeping the watermark) at the top of its next step, and its next token is a decode. TTFT ends at
that admission: the first token reaches the client from the decode side (DistServe's definition, and the real
disaggregated engine's), so it counts the prefill, the transfer and any wait for room. The handoff is the real
pair's (``workbench.engine.handoff.Handoff``): a prefill replica holds a finished prefill's blocks until a decode
replica admits it (a full decode pool fills the prefill pool, which then stops admitting: backpressure, counted per
replica in ``num_backpressure``), and with ``round-robin`` the ``n``-th arrival decodes on replica ``n mod D``. A
release reaches a prefill replica that waits for it at once; one that still runs sees it at its next step.
Two settings describe a real engine's handoff rather than a dedicated link (``workbench.cluster.disagg`` on gloo, and
``workbench fidelity --disaggregate``, which measures both): ``kv_handoff_s``, host time from the prefill
step's end to the transfer's start (the sender's gather and the control message; or drawn, seeded, from measured
ones: ``kv_handoff_quantiles_s``, each draw rank-correlated with the noise of the prefill step before it by
``kv_handoff_rank_correlation``, as the real engines' slow moments fall on both), and
``kv_receive='between-steps'``: the decode replica receives each admitted request's KV before its next step, which
the wire time then delays (TTFT ends when the KV has landed); the default ``'overlapped'`` moves it beside the
decode replica's steps.

Events are processed in time order: at equal times, step completions come before arrivals and KV transfers,
and both before a step that starts at that time (so such a step admits them, as the engine does).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import asdict, dataclass, field
from typing import Any

from workbench.config import ModelConfig, canonical_dtype, ceil_div, check_positive_ints
from workbench.engine.config import ServingConfig
from workbench.engine.handoff import Handoff, prefilled_sequence
from workbench.engine.metrics import ServingStats, StepLog
from workbench.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepPlan, blocks_over_watermark
from workbench.engine.speculative import SpeculativeConfig, merged_spec_stats
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.kv.sizing import plan_num_blocks
from workbench.request import RequestRecord, SamplingParams, Sequence, fits_context
from workbench.sim.costmodel import CostModel, plan_stats
from workbench.sim.speculation import SIM_TOKEN, SimSpeculator, resolve_acceptance
from workbench.sim.stats import correlated_uniform
from workbench.timing import now
from workbench.workloads import Request, prompt_token_ids

ROUTERS = ("round-robin", "least-outstanding", "shortest-queue")


KV_RECEIVE = ("overlapped", "between-steps")


@dataclass
class SimConfig(ServingConfig):
    """One replica's engine settings (the shared ``ServingConfig`` of ``EngineConfig``) and the cluster around it.

    ``num_blocks``: KV blocks per replica; None derives it from the hardware's memory:
    ``(mem_capacity * gpu_memory_utilization - weight bytes) / (block_size * kv bytes per token)``
    (vLLM's ``gpu_memory_utilization``; activations are not reserved), or from ``kv_cache_bytes`` when given. A
    derived pool larger than the batch could ever fill (``max_num_seqs`` sequences of ``max_model_len``) is tracked
    at the size it could fill, without prefix caching (the same schedule, with bookkeeping bounded by the batch, not
    by the memory or the trace; a disaggregated prefill replica's grows by the blocks its held prefills take, up to the
    pool's size); with prefix caching, or ``num_blocks`` given, the pool is tracked as is, its blocks made as they are
    first taken (``BlockManager``).
    It models a GPU server, so two defaults differ from the CPU engine's (and are written here only): 256
    sequences (vLLM's ``max_num_seqs``) and bf16. The shared fields (``ServingConfig``: policy, block size, token
    budget, max_num_seqs, max_model_len, dtype, quantization, group size, KV dtype, tensor-parallel size) are the
    engine's, validated there.
    """

    max_num_seqs: int = 256  # a GPU server's batch limit (vLLM's default); the CPU engine's is 32
    dtype: str = "bf16"  # a GPU server computes in bf16; the CPU engine in fp32
    gpu_memory_utilization: float = 0.9
    num_replicas: int = 1
    router: str = "round-robin"
    disaggregate: tuple[int, int] | None = None
    link_gbps: float = 100.0
    link_latency_s: float = 0.0
    kv_handoff_s: float = 0.0  # disaggregated: host time from a prefill's end to its transfer's start
    # measured handoffs to draw each one from (seeded by kv_handoff_seed) in place of kv_handoff_s; () = constant
    kv_handoff_quantiles_s: tuple[float, ...] = ()
    kv_handoff_seed: int = 0
    # Spearman's rank correlation of a drawn handoff with the noise of the prefill step before it (a Gaussian
    # copula; the real engines' slow moments fall on both); needs kv_handoff_quantiles_s and a noisy cost model
    kv_handoff_rank_correlation: float = 0.0
    kv_receive: str = "overlapped"  # or 'between-steps': the decode replica spends the wire time before a step
    pipeline_parallel_size: int = 1  # stages per replica
    prefill_tp: int | None = None  # disaggregated: the prefill replicas' tensor-parallel size (default: tp)
    decode_tp: int | None = None  # disaggregated: the decode replicas'
    expert_parallel_size: int = 1  # MoE: GPUs per stage splitting the experts, attention data-parallel over them
    # speculative decoding (workbench.sim.speculation): the engine's --speculative-config, parsed by the same
    # SpeculativeConfig; spec_acceptance: the acceptance each proposal is drawn with (one alpha, or one per position)
    # for the methods other than the oracle, whose own 'acceptance' it is
    speculative_config: SpeculativeConfig | dict | str | None = None
    spec_acceptance: float | tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if canonical_dtype(self.dtype) in ("fp8", "int8"):
            raise ConfigError(f"dtype is the activations' (fp32, fp16 or bf16), got {self.dtype!r}: FP8 or int8 "
                              "weights are quantization='fp8'/'int8' (--quantization), an FP8 or int8 KV cache "
                              "kv_cache_dtype (--kv-cache-dtype)")  # fmt: skip
        super().__post_init__()  # the shared fields, the KV dtype resolved ('auto' -> dtype)
        check_positive_ints(self, ("pipeline_parallel_size", "expert_parallel_size", "num_replicas"))
        check_positive_ints(self, ("prefill_tp", "decode_tp"), optional=True)
        if (self.prefill_tp is not None or self.decode_tp is not None) and self.disaggregate is None:
            raise ConfigError("prefill_tp and decode_tp (--prefill-tp, --decode-tp) apply to disaggregated pools "
                              "only; without --disaggregate use --tensor-parallel-size")  # fmt: skip
        tps = {self.tensor_parallel_size, self.prefill_tp or 1, self.decode_tp or 1}
        if self.expert_parallel_size > 1 and tps != {1}:
            raise ConfigError(f"expert_parallel_size {self.expert_parallel_size} runs attention data-parallel over the "
                              "EP ranks, one GPU each: it needs tensor_parallel_size 1 (and --prefill-tp/--decode-tp "
                              f"1), got {max(tps)}")  # fmt: skip
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.disaggregate is not None:
            try:
                p, d = (int(x) for x in self.disaggregate)
            except (TypeError, ValueError):
                raise ConfigError(f"disaggregate must be (prefill replicas, decode replicas), got "
                                  f"{self.disaggregate!r}") from None  # fmt: skip
            if p < 1 or d < 1:
                raise ConfigError(f"disaggregate needs at least one prefill and one decode replica, got {p}:{d}")
            self.disaggregate = (p, d)
        for name in ("link_gbps",):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("link_latency_s", "kv_handoff_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        self.kv_handoff_quantiles_s = tuple(float(x) for x in self.kv_handoff_quantiles_s)
        if not all(x >= 0 and math.isfinite(x) for x in self.kv_handoff_quantiles_s):
            raise ConfigError("kv_handoff_quantiles_s must be numbers >= 0")
        rc = self.kv_handoff_rank_correlation
        if not isinstance(rc, (int, float)) or isinstance(rc, bool) or not -1.0 <= rc <= 1.0:
            raise ConfigError(f"kv_handoff_rank_correlation must be a number in [-1, 1], got {rc!r}")
        if rc and not self.kv_handoff_quantiles_s:
            raise ConfigError("kv_handoff_rank_correlation correlates drawn handoffs: it needs kv_handoff_quantiles_s")
        if self.kv_receive not in KV_RECEIVE:
            raise ConfigError(f"kv_receive must be one of {', '.join(KV_RECEIVE)}; got {self.kv_receive!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None:
            if self.disaggregate is not None:
                raise ConfigError("speculative decoding is not simulated with disaggregation (as the engine refuses "
                                  "it: the decode side would need the proposer's state); drop one of them")  # fmt: skip
            resolve_acceptance(self.speculative_config, self.spec_acceptance)  # a ConfigError when it has none
        elif self.spec_acceptance is not None:
            raise ConfigError("spec_acceptance (--spec-acceptance) needs a speculative config (--speculative-config)")
        if isinstance(self.spec_acceptance, list):
            self.spec_acceptance = tuple(self.spec_acceptance)

    @property
    def total_replicas(self) -> int:
        return sum(self.disaggregate) if self.disaggregate else self.num_replicas

    def role_tp(self, role: str) -> int:
        """The tensor-parallel size of a replica of ``role`` ('prefill', 'decode' or 'mixed')."""
        if role == "prefill" and self.prefill_tp is not None:
            return self.prefill_tp
        if role == "decode" and self.decode_tp is not None:
            return self.decode_tp
        return self.tensor_parallel_size

    @property
    def num_gpus(self) -> int:
        """GPUs of the whole cluster: every replica's TP x PP x EP group."""
        pp = self.pipeline_parallel_size * self.expert_parallel_size
        if self.disaggregate:
            p, d = self.disaggregate
            return pp * (p * self.role_tp("prefill") + d * self.role_tp("decode"))
        return pp * self.num_replicas * self.tensor_parallel_size

    def resolved_num_blocks(self, model: ModelConfig, hardware: Any = None, role: str = "mixed") -> int:
        """KV blocks per replica of ``role`` (see the class docstring). With a hardware spec each GPU of the
        replica's TP x PP group holds its shard of the weights and the blocks' KV for its layers and KV heads
        (``workbench.roofline.Shard``), so the pool is what the most loaded GPU has left. Under expert parallelism
        each of the ``expert_parallel_size`` GPUs of a stage holds its own sequences' KV beside every non-expert
        weight and its share of the experts: the replica's pool is that many GPUs' blocks."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_bytes is not None:
            return plan_num_blocks(model, self.block_size, self.kv_cache_dtype, self.kv_cache_bytes)
        if hardware is None:
            raise ConfigError("num_blocks or kv_cache_bytes is needed when no hardware spec is given")
        from workbench.hardware import get_hardware
        from workbench.roofline import Shard

        hw = get_hardware(hardware)
        tp, pp, ep = self.role_tp(role), self.pipeline_parallel_size, self.expert_parallel_size
        shard = Shard.of(model, tp, pp, ep)
        weights = shard.weight_bytes(model, self.dtype, self.quantization, self.group_size)
        budget = hw.mem_capacity * self.gpu_memory_utilization - weights
        block_bytes = self.block_size * shard.kv_bytes_per_token(model, self.kv_cache_dtype)
        num_blocks = int(max(0.0, budget) // block_bytes) * ep
        if num_blocks < 1:
            fmt = self.quantization or self.dtype
            raise ConfigError(
                f"{model.name} does not fit on {hw.name} at tensor_parallel_size {tp}, pipeline_parallel_size {pp}"
                + (f", expert_parallel_size {ep}" if ep > 1 else "")
                + ": "
                f"the weights per GPU ({weights / 2**30:.1f} GiB in {fmt}) leave {budget / 2**30:.2f} GiB of "
                f"{hw.mem_capacity * self.gpu_memory_utilization / 2**30:.1f} GiB (gpu_memory_utilization "
                f"{self.gpu_memory_utilization}) for no KV block of {self.block_size} tokens; raise "
                "--tensor-parallel-size, --pipeline-parallel-size or --expert-parallel-size, or quantize the weights"
            )
        return num_blocks


class Replica:
    """One simulated engine: a Scheduler over a BlockManager, a cost model and a virtual clock."""

    def __init__(
        self,
        index: int,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        cost_model: CostModel,
        record_steps: bool = False,
        on_finish: Callable[[Replica, Sequence, float], None] | None = None,
        role: str = "mixed",
        fast: bool = True,
        speculator: SimSpeculator | None = None,
    ) -> None:
        self.index = index
        self.role = role
        self.fast = fast  # advance runs of identical decode steps in bulk (False: the step-by-step reference)
        self.block_manager = BlockManager(num_blocks, block_size, scheduler_config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.cost = cost_model
        self.speculator = speculator  # speculative decoding: the scheduler's proposer and the step's verifier
        if speculator is not None:
            self.scheduler.proposer = speculator.propose
        self.clock = 0.0  # when the replica became free (end of its last step, or an arrival while idle)
        self.inflight: tuple[StepPlan, float, float, float | None] | None = None  # (plan, start, end, noise u)
        self.step_noise_u: float | None = None  # the last completed step's noise uniform (CostModel.last_noise_u)
        # disaggregated decode: prefills whose KV arrived, not yet admitted (each with the prefill replica holding it)
        self.handoff: Handoff[tuple[Sequence, Replica | None]] = Handoff()
        self.blocked = False  # a prefill replica whose pool is full of held prefills: it waits for a release
        # a pool tracked below its capacity (see SimConfig) grows by what held prefills take, up to the capacity
        self.capacity, self.base_blocks, self.held_blocks = num_blocks, num_blocks, 0
        if role == "prefill":
            Handoff.hold(self.scheduler)  # its finished prefills keep their blocks until the decode side takes them
        self.receive_s: dict[int, float] = {}  # kv_receive 'between-steps': each ready request's wire time here
        self.on_finish = on_finish
        self.step_log: StepLog | None = StepLog() if record_steps else None
        self.busy_s = 0.0
        self.num_steps = 0
        self.num_bulk_steps = 0
        self.outstanding = 0  # routed and not finished

    # ---- state the router reads ------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self.scheduler.waiting) + len(self.handoff)

    @property
    def idle(self) -> bool:
        return self.inflight is None and not self.handoff and not self.scheduler.has_unfinished()

    # ---- requests in ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence, now: float) -> None:
        """A new request at ``now`` (queued for admission by the scheduler)."""
        if self.idle:
            self.clock = max(self.clock, now)
        self.outstanding += 1
        self.scheduler.add(seq)

    def add_prefilled(self, seq: Sequence, now: float, receive_s: float = 0.0, source: Replica | None = None) -> None:
        """A request whose prompt KV arrived at ``now`` (disaggregated decode): admitted at the next step, which
        ``receive_s`` (the wire time, when this replica receives between its steps) then delays; the prefill
        replica ``source`` holds its blocks until then."""
        if self.idle:
            self.clock = max(self.clock, now)
        self.outstanding += 1
        self.handoff.arrive(seq.seq_id, (seq, source))
        if receive_s:
            self.receive_s[seq.seq_id] = receive_s

    def release(self, seq_id: int, now: float) -> bool:
        """The decode side took held prefill ``seq_id`` at ``now``: its blocks go back to this replica's pool.
        True when that unblocks the replica (it then goes on from ``now``)."""
        held = self.scheduler.held.get(seq_id)
        if held is not None:
            self.held_blocks -= len(held.block_table)
        if not (Handoff.release(self.scheduler, seq_id) and self.blocked):
            return False
        self.blocked = False
        self.clock = max(self.clock, now)
        return True

    # ---- the loop ------------------------------------------------------------------------------------------
    def advance(self, until: float) -> None:
        """Run every step that starts before ``until`` and complete every step that ends by ``until``."""
        sched = self.scheduler
        cost = self.cost
        while True:
            if self.inflight is not None:
                plan, start, end, self.step_noise_u = self.inflight
                if end > until:
                    return
                self.inflight = None
                self._complete(plan, start, end)
                continue
            if self.blocked or not (self.handoff or sched.has_unfinished()):
                return
            start = cost.start_time(self.clock)
            if start >= until:
                return
            received, woke = 0.0, False

            def take(item: tuple[Sequence, Replica | None], start: float = start) -> bool:
                nonlocal received, woke
                seq, source = item
                if not sched.admit_prefilled(seq):
                    return False
                # its first token reaches the client from here, now that this replica holds its KV (DistServe's
                # TTFT, as the real disaggregated engine measures it: workbench.cluster.disagg)
                received += self.receive_s.pop(seq.seq_id, 0.0)
                seq.first_token_time = seq.token_times[0] = max(start + received, seq.token_times[0])
                if source is not None:
                    woke = source.release(seq.seq_id, start) or woke
                return True

            self.handoff.admit(take)
            start += received  # kv_receive 'between-steps': the step waits for the KV it admitted
            if not (self.handoff or received or woke) and self.fast and self.speculator is None:
                window = sched.decode_steps_until_change()
                if window > 1:
                    running = list(sched.running)  # the run may finish some: log what it decoded
                    n = len(running)
                    context = sum(s.num_computed_tokens for s in running) + n
                    starts, ends = cost.decode_run(self.clock, n, context, window - 1, until)
                    if ends:
                        sched.advance_decode_steps(ends, SIM_TOKEN)
                        self._log_bulk(starts, ends, running)
                        self.clock = ends[-1]
                        continue
            plan = sched.schedule(now=start)
            if plan.is_empty:
                finished = sched.update(plan, {}, start)
                if not finished and not sched.running:
                    if sched.held:  # its pool is full of prefills the decode side has not taken yet
                        self.blocked = True
                        continue
                    raise RuntimeError(f"replica {self.index}: nothing can be scheduled and nothing runs")
                self.clock = start
                self._finish(finished, start)
                continue
            draft_s = 0.0 if self.speculator is None else self.speculator.draft_time(plan)  # before the verify
            end = cost.end_time(start + draft_s, plan_stats(plan))
            self.inflight = (plan, start, end, cost.last_noise_u)  # kept with its step: a model may be shared
            if woke:  # a prefill replica waited for the blocks it released: it catches up to here first
                return

    def _complete(self, plan: StepPlan, start: float, end: float) -> None:
        if self.speculator is not None:
            sampled = self.speculator.verify(plan)
        else:
            sampled = {c.seq.seq_id: SIM_TOKEN for c in plan.chunks if c.samples}
        finished = self.scheduler.update(plan, sampled, end)
        self.clock = end
        self.busy_s += end - start
        self.num_steps += 1
        if self.step_log is not None:
            self.step_log.record(plan, start, end, self.block_manager.num_used_blocks)
        self._finish(finished, end)

    def _log_bulk(self, starts: list[float], ends: list[float], running: list[Sequence]) -> None:
        self.busy_s += sum(ends) - sum(starts)
        self.num_steps += len(ends)
        self.num_bulk_steps += len(ends)
        if self.step_log is not None:
            used = self.block_manager.num_used_blocks  # after the run (a run may take a block mid-way)
            # every step of the run decodes the same sequences: one plan of their decode chunks logs each
            plan = StepPlan([ScheduledChunk(q, 1, q.num_computed_tokens - 1, False, True) for q in running])
            for s, e in zip(starts, ends):
                self.step_log.record(plan, s, e, used)

    def _finish(self, finished: list[Sequence], now: float) -> None:
        bm, held = self.block_manager, self.scheduler.held
        for seq in finished:
            if seq.seq_id in held:
                self.held_blocks += len(seq.block_table)
                bm.num_blocks = max(bm.num_blocks, min(self.capacity, self.base_blocks + self.held_blocks))
        for seq in finished:
            self.outstanding -= 1
            if self.on_finish is not None:
                self.on_finish(self, seq, now)


# ---- routing ---------------------------------------------------------------------------------------------
class Router:
    """Picks a replica for each request: ``round-robin``, ``least-outstanding`` or ``shortest-queue``."""

    def __init__(self, policy: str, replicas: list[Replica]) -> None:
        if policy not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}; got {policy!r}")
        self.policy = policy
        self.replicas = replicas
        self._next = 0

    def pick(self) -> Replica:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.policy == "round-robin":
            r = reps[self._next % len(reps)]
            self._next += 1
            return r
        if self.policy == "least-outstanding":
            return min(reps, key=lambda r: (r.outstanding, r.index))
        return min(reps, key=lambda r: (r.queue_length, r.index))


# ---- results ---------------------------------------------------------------------------------------------
@dataclass
class SimResult:
    """What ``simulate`` returns: the serving statistics of its requests (``stats``), per-request records (empty
    when ``simulate`` was told not to keep them), the run's duration, per-replica figures, wall time."""

    records: list[RequestRecord]
    duration_s: float
    replicas: list[dict[str, Any]]
    step_logs: list[StepLog | None]
    num_steps: int
    wall_s: float
    config: SimConfig
    cost_model: dict[str, Any] = field(default_factory=dict)
    rejected: list[dict[str, Any]] = field(default_factory=list)  # request_id and reason of each rejected request
    stats: ServingStats = field(default_factory=ServingStats)  # every request, kept records or not
    speculative: dict[str, Any] | None = None  # speculative decoding's counters over the replicas (SpecStats.to_dict)

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    def summary(self, **slos: float | None) -> dict[str, Any]:
        """The contract JSON of ``workbench replay`` plus ``wall_s``, ``requests_per_wall_s``, ``num_steps``,
        ``us_per_step`` and per-replica utilisation."""
        out = self.stats.summary(duration_s=self.duration_s, num_preemptions=self.num_preemptions, **slos)
        out["wall_s"] = self.wall_s
        out["requests_per_wall_s"] = self.stats.num_requests / self.wall_s if self.wall_s > 0 else 0.0
        out["num_steps"] = self.num_steps
        out["us_per_step"] = 1e6 * self.wall_s / self.num_steps if self.num_steps else 0.0
        out["replicas"] = self.replicas
        if self.speculative is not None:
            out["speculative"] = self.speculative
        return out


# ---- the simulation --------------------------------------------------------------------------------------
def simulate(
    requests: Iterable[Request],
    model: ModelConfig | str,
    cost_model: CostModel | SequenceABC[CostModel],
    config: SimConfig | None = None,
    hardware: Any = None,
    seed: int = 0,
    record_steps: bool = False,
    sampling: SamplingParams | None = None,
    fast: bool = True,
    progress: Any = None,
    keep_records: bool = True,
    draft_cost_model: CostModel | None = None,
) -> SimResult:
    """Serve ``requests`` (``workbench.workloads.Request``) on simulated replicas; see the module docstring.

    ``cost_model``: one model shared by every replica, or one per replica (prefill replicas first when
    disaggregated; a ``TraceCostModel`` is stateful, so give each replica its own). ``hardware`` sizes the KV
    pool when ``config.num_blocks`` and ``kv_cache_bytes`` are unset. Each request generates exactly its
    ``output_len`` tokens (at least one) with EOS ignored, as ``Engine.replay``; prompt token ids are made
    (deterministically from ``seed``) only when prefix caching needs them. ``fast=False`` steps every decode
    through ``schedule``/``update`` (the reference the bulk fast path is tested against). ``progress``: a tqdm-like
    object updated once per finished (or rejected) request.

    Memory. A list of requests is sorted by arrival; any other iterable is read as the simulation goes (it must be
    in arrival order: a trace file read lazily, ``workbench.workloads.iter_workload``), so only the requests in
    flight are held. Each finished request goes into ``SimResult.stats`` (``ServingStats``: 32 bytes a request);
    ``keep_records=False`` keeps no ``RequestRecord`` (token timelines) of its own, so a run of millions of
    requests holds what is in flight, those statistics and the set of request ids seen (to refuse a repeat). A
    pool sized from an accelerator's memory is tracked at what the batch can fill (see ``SimConfig``); with prefix
    caching the cache keeps every distinct block the pool can hold, as the real one would.

    Speculative decoding (``config.speculative_config``): each replica's scheduler verifies proposals whose
    acceptance a coin seeded by ``seed`` and the replica's index draws (``workbench.sim.speculation``); a draft
    model's proposals are priced by ``draft_cost_model`` (its own cost model, needed for method 'draft'). Every step
    then goes through ``schedule``/``update`` (the bulk decode path does not speculate).
    """
    wall0 = now()
    config = config or SimConfig()
    cfg = model if isinstance(model, ModelConfig) else ModelConfig.resolve(model)
    sched_cfg = config.scheduler_config(cfg)
    roles = ("prefill", "decode") if config.disaggregate else ("mixed",)
    capacity = {role: config.resolved_num_blocks(cfg, hardware, role) for role in roles}
    tracked = dict(capacity)
    if config.num_blocks is None and not config.enable_prefix_caching:
        never_short = _blocks_never_short(sched_cfg, config.block_size)
        tracked = {role: min(c, never_short) for role, c in capacity.items()}
    total = config.total_replicas
    costs = [cost_model] * total if isinstance(cost_model, CostModel) else list(cost_model)
    if len(costs) != total:
        raise ConfigError(f"{len(costs)} cost models given for {total} replicas")
    stats = ServingStats()
    records: dict[int, RequestRecord] | None = {} if keep_records else None
    position: dict[int, int] = {}  # request id -> its place in arrival order, while in flight
    transfers: list[tuple[float, int, Sequence, float]] = []
    # each GPU of the prefill group sends its own shard of a prompt's KV at once, over a link of link_gbps each
    kv_bytes_per_token = cfg.kv_bytes_per_token(config.kv_cache_dtype) / (
        config.role_tp("prefill") * config.pipeline_parallel_size
    )
    link_bytes_per_s = config.link_gbps * 1e9 / 8
    between_steps = config.kv_receive == "between-steps"
    handoffs = config.kv_handoff_quantiles_s
    pair = Handoff(*config.disaggregate) if config.disaggregate else Handoff()  # the real pair's routing
    handoff_rng = random.Random(config.kv_handoff_seed)
    output_len: dict[int, int] = {}

    rejected: list[dict[str, Any]] = []

    def done(replica: Replica, seq: Sequence, now: float) -> None:
        stats.add(seq, position.pop(seq.seq_id))
        output_len.pop(seq.seq_id, None)
        if records is not None:
            records[seq.seq_id] = RequestRecord.from_sequence(seq)
        if progress is not None:
            progress.update(1)
        if seq.finish_reason == "rejected":
            rejected.append({"request_id": seq.seq_id, "reason": seq.reject_reason})

    def prefilled(replica: Replica, seq: Sequence, now: float) -> None:
        want = output_len[seq.seq_id]
        if seq.finish_reason != "length" or want <= 1 or seq.num_output_tokens != 1:
            replica.release(seq.seq_id, now)  # nothing for a decode replica to do
            done(replica, seq, now)
            return
        nxt = prefilled_sequence(seq.seq_id, seq.prompt_token_ids, _sampling(sampling, want), seq.arrival_time,
                                 seq.output_token_ids[0], seq.first_token_time)  # fmt: skip
        # the request's record keeps its prefill side's queueing and preemptions
        nxt.first_scheduled_time, nxt.num_preemptions = seq.first_scheduled_time, seq.num_preemptions
        wire = seq.num_prompt_tokens * kv_bytes_per_token / link_bytes_per_s + config.link_latency_s
        if not handoffs:
            handoff = config.kv_handoff_s
        elif replica.step_noise_u is None or not config.kv_handoff_rank_correlation:
            handoff = handoffs[handoff_rng.randrange(len(handoffs))]
        else:  # drawn with the prefill step's noise: a slow step is followed by a slow handoff as often as measured
            u = correlated_uniform(replica.step_noise_u, config.kv_handoff_rank_correlation, handoff_rng)
            handoff = handoffs[min(int(u * len(handoffs)), len(handoffs) - 1)]
        arrive = now + handoff + (0.0 if between_steps else wire)
        # round-robin: decode replica n mod D of the n-th arrival (the real pair's routing); else the router's pick
        decode = back[pair.route(position[seq.seq_id])[1]] if config.router == "round-robin" else None
        heapq.heappush(transfers, (arrive, seq.seq_id, nxt, wire if between_steps else 0.0, replica, decode))

    spec = config.speculative_config

    def replica(index: int, on_finish: Callable[[Replica, Sequence, float], None], role: str) -> Replica:
        speculator = None if spec is None else SimSpeculator(
            spec, config.spec_acceptance, seed=hash((seed, spec.seed, index)) & 0xFFFFFFFF, draft_cost=draft_cost_model
        )  # fmt: skip
        return Replica(index, sched_cfg, tracked[role if role in tracked else "mixed"], config.block_size,
                       costs[index], record_steps, on_finish, role, fast, speculator)  # fmt: skip

    if config.disaggregate:
        p, d = config.disaggregate
        front = [replica(i, prefilled, "prefill") for i in range(p)]
        for rep in front:
            rep.capacity = capacity["prefill"]
        back = [replica(p + i, done, "decode") for i in range(d)]
    else:
        front = [replica(i, done, "mixed") for i in range(total)]
        back = []
    router = Router(config.router, front)
    back_router = Router(config.router, back) if back else None
    vocab = cfg.vocab_size
    caching = config.enable_prefix_caching
    if isinstance(requests, (list, tuple)):
        for r in requests:  # all checked before anything runs
            _check_arrival(r, None)
        stream = iter(sorted(requests, key=lambda r: r.arrival_time_s))
    else:
        stream = iter(requests)
    seen: set[int] = set()
    order: list[int] = []  # request ids in arrival order (keep_records only)
    inf = math.inf
    nxt: Request | None = next(stream, None)
    last_arrival = 0.0
    while True:
        t_arr = nxt.arrival_time_s if nxt is not None else inf
        for rep in front:
            rep.advance(t_arr)
        t_xfer = transfers[0][0] if transfers else inf
        t = t_arr if t_arr < t_xfer else t_xfer
        for rep in back:
            rep.advance(t)
        if t == inf:
            if any(not (rep.blocked or rep.idle) for rep in front + back):
                continue  # a decode replica took held prefills: their prefill replica goes on, then the decode one
            break
        if t_xfer <= t_arr:
            _, _, seq, receive_s, source, decode = heapq.heappop(transfers)
            (decode or back_router.pick()).add_prefilled(seq, t_xfer, receive_s, source)  # type: ignore[union-attr]
            continue
        r = nxt
        _check_arrival(r, last_arrival if seen else None)
        nxt = next(stream, None)
        if r.request_id in seen:
            raise ConfigError(f"request id {r.request_id} appears twice in the workload")
        seen.add(r.request_id)
        position[r.request_id] = len(seen) - 1
        if records is not None:
            order.append(r.request_id)
        last_arrival = r.arrival_time_s
        want = max(int(r.output_len), 1)
        if back:
            output_len[r.request_id] = want
        ids = prompt_token_ids(r, vocab, seed) if (caching or r.prompt_token_ids is not None) else [0] * r.prompt_len
        # disaggregated: the prefill side serves the first token, unless the whole request breaks the one request
        # rule; then the prefill side rejects it as any entry point would (nothing is prefilled for a request
        # the decode side would refuse)
        first = _sampling(sampling, 1 if back and fits_context(len(ids), want, sched_cfg.max_model_len) else want)
        router.pick().add(Sequence(r.request_id, ids, first, r.arrival_time_s), t_arr)
    reps = front + back
    duration = max([rep.clock for rep in reps] + [last_arrival])
    if position:
        raise RuntimeError(f"simulation ended with {len(position)} request(s) unfinished")
    ordered = [records[i] for i in order] if records is not None else []
    replicas = [
        {
            "index": rep.index,
            "role": rep.role,
            "num_steps": rep.num_steps,
            "num_bulk_steps": rep.num_bulk_steps,
            "busy_s": rep.busy_s,
            "utilization": rep.busy_s / duration if duration > 0 else 0.0,
            "num_preemptions": rep.scheduler.num_preemptions,
            "num_backpressure": rep.handoff.num_backpressure,
            "num_blocks": rep.block_manager.num_blocks,
            "num_blocks_capacity": capacity[rep.role if rep.role in capacity else "mixed"],
            "tensor_parallel_size": config.role_tp(rep.role),
            "pipeline_parallel_size": config.pipeline_parallel_size,
            "expert_parallel_size": config.expert_parallel_size,
        }
        for rep in reps
    ]
    return SimResult(
        records=ordered,
        duration_s=duration,
        replicas=replicas,
        step_logs=[rep.step_log for rep in reps],
        num_steps=sum(rep.num_steps for rep in reps),
        wall_s=now() - wall0,
        config=config,
        cost_model=costs[0].describe() if costs else {},
        rejected=rejected,
        stats=stats,
        speculative=None if spec is None else merged_spec_stats([rep.scheduler.spec_stats for rep in reps]).to_dict(),
    )


def _check_arrival(request: Request, previous: float | None) -> None:
    """A ConfigError unless the request's arrival time is a number >= 0, not before ``previous`` (a stream's order)."""
    t = request.arrival_time_s
    if not (t >= 0 and math.isfinite(t)):
        raise ConfigError(f"request {request.request_id}: arrival time must be a number >= 0, got {t!r}")
    if previous is not None and t < previous:
        raise ConfigError(f"request {request.request_id} arrives at {t!r} s, before the one read before it "
                          f"({previous!r} s): a streamed workload must be in arrival order")  # fmt: skip


def _blocks_never_short(sched_cfg: SchedulerConfig, block_size: int) -> int:
    """A pool size past which more blocks change nothing without prefix caching: at most ``max_num_seqs`` sequences
    hold blocks, each those of at most ``max_model_len`` + 1 tokens, so with this many over the admission watermark
    no allocation fails (the same schedule as any larger pool). A pool derived from an accelerator's memory
    (millions of blocks) is tracked at this size: the bookkeeping is bounded by the batch, not by the memory or the
    trace. (With prefix caching, freed blocks stay cached until the pool runs out: the whole pool is tracked, its
    blocks made as they are first taken.)"""
    per_seq = ceil_div(sched_cfg.max_model_len, block_size) + 1
    return blocks_over_watermark(sched_cfg.max_num_seqs, per_seq, sched_cfg.watermark)


def _sampling(base: SamplingParams | None, max_tokens: int) -> SamplingParams:
    if base is None:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(**{**asdict(base), "max_tokens": max_tokens, "ignore_eos": True})


__all__ = ["ROUTERS", "SimConfig", "Replica", "Router", "SimResult", "simulate"]
