"""Prefill/decode disaggregation on the real engine (Splitwise, DistServe): separate engines, KV moved between them.

    coordinator (this process)  --request-->  prefill engine (rank p)  --KV over torch.distributed-->
                                              decode engine (rank P + d)  --tokens-->  coordinator

``run_disaggregated`` starts ``P`` prefill engines and ``D`` decode engines, each an ``Engine`` with its own KV pool
in its own processes: ``EngineConfig.tensor_parallel_size`` ranks per engine (each pool its own: ``prefill_tp``,
``decode_tp``), all joined in one gloo (CPU) or NCCL (CUDA) world for the KV transfers
(``workbench.dist.kv_connector``). An engine of TP > 1 is a subgroup of that world (``dist.new_group``) running
the engine's executor over its ranks (``workbench.engine.executor``): its first rank drives (scheduler, sampler) and
every rank moves its own KV heads (``transfer_plan``: rank i to rank i with equal TP, heads re-sliced otherwise).
Control messages travel on multiprocessing queues between the coordinator and each engine's first rank.
Request ``i`` goes to prefill engine ``i mod P`` and decode engine ``i mod D`` (``workbench.engine.handoff.Handoff``,
the simulator's handoff too). The prefill engine serves it with
``max_tokens=1``: its first token ends it there, its blocks are held (``Engine.hold``, ``Engine.release``) and its
prompt's KV is sent; the decode engine admits it with that KV (``Engine.add_prefilled``) and decodes the rest, its
sampling generator continued from the prefill's (``Engine.handoff_state``): seeded sampling gives
the colocated tokens.

Definitions (DistServe's): TTFT is from arrival to the moment the first token reaches the client **from the decode
side**, i.e. when the decode engine has the request's KV and first token (so TTFT includes the prefill, any wait
for room in the decode pool, and the transfer). ITL and TPOT are the decode engine's. A request's
``kv_transfer_s`` is from the later of the send and the receive being posted to the KV landing in the decode pool
(wire time, not the wait for room, which ``num_backpressure`` counts).

Nothing is lost: a full decode pool leaves the KV held on the prefill side (whose pool then fills and stops
admitting: backpressure, counted); a transfer whose checksum fails is retried (``max_retries``), then recomputed
from the prompt on the decode side, as is one that times out (counted); a process that dies, or stops beating for
the liveness bound (``workbench.dist.group.liveness_timeout_s``: stopped, frozen; it is then killed), ends the run
with a ``DisaggregationError`` that names it and carries the requests that had finished.

Every process stamps times on one clock: ``workbench.timing.now`` (``time.perf_counter``) is CLOCK_MONOTONIC,
shared by the processes of a machine, and the run's zero is sent to every engine once all have loaded their model.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workbench.config import ModelConfig, check_positive_ints, parse_disaggregate
from workbench.dist.group import DistConfig, ProcessSet, WorkerError, WorkerGroup, free_port, serve_subgroup
from workbench.dist.kv_connector import (
    KVReceiver,
    KVSender,
    KVTransfer,
    Piece,
    head_range,
    layer_scales,
    transfer_plan,
    wall_clock,
)
from workbench.engine.config import EngineConfig
from workbench.engine.engine import RequestResult
from workbench.engine.handoff import Handoff
from workbench.engine.worker import Worker
from workbench.errors import ConfigError
from workbench.model.sharding import check_tensor_parallel_size
from workbench.request import SamplingParams, fits_context
from workbench.timing import now, set_threads

POLL_S = 0.002  # how long an idle engine waits on its queue before looking again


class DisaggregationError(WorkerError):
    """A prefill or decode engine died or stalled; ``partial`` holds the requests that had finished."""

    partial: list[RequestResult] = []


@dataclass(frozen=True)
class DisaggConfig:
    """The two pools and the transfer policy. ``prefill``/``decode``: each pool's ``EngineConfig`` (the same
    model, dtype, block size and KV cache dtype on both sides; pools, policies and ``tensor_parallel_size`` may
    differ: each engine of a pool has that many ranks)."""

    prefill: EngineConfig = field(default_factory=EngineConfig)
    decode: EngineConfig = field(default_factory=EngineConfig)
    num_prefill: int = 1
    num_decode: int = 1
    threads_per_engine: int = 1  # torch threads of each process (each rank of a tensor-parallel engine)
    transfer_timeout_s: float = 30.0
    max_retries: int = 1
    stall_timeout_s: float = 300.0  # no message from any engine for this long ends the run
    backend: str = "auto"  # of the KV transfers: NCCL with CUDA, gloo otherwise (a CUDA pool staged through the host)

    def __post_init__(self) -> None:
        check_positive_ints(self, ("num_prefill", "num_decode", "threads_per_engine"))
        if self.prefill.block_size != self.decode.block_size or self.prefill.dtype != self.decode.dtype:
            raise ConfigError("the prefill and decode pools need the same block_size and dtype")
        kv = [e.kv_cache_dtype for e in (self.prefill, self.decode)]  # resolved by ServingConfig
        if kv[0] != kv[1]:
            raise ConfigError(f"the prefill and decode pools need the same kv_cache_dtype, got {kv[0]} and {kv[1]}")
        if self.prefill.cache != "paged" or self.decode.cache != "paged":
            raise ConfigError("disaggregation moves paged KV blocks: both pools need cache='paged'")
        if self.prefill.speculative_config is not None or self.decode.speculative_config is not None:
            raise ConfigError(
                "speculative decoding is not supported with disaggregation (the decode engine would need the "
                "proposer's state, a draft model's KV, handed off with the prompt's); drop --speculative-config "
                "or --disaggregate"
            )
        if any(
            e.tensor_parallel_size > 1 and (e.kv_cache_quantized or e.quantization) for e in (self.prefill, self.decode)
        ):
            raise ConfigError(
                "quantized weights or a quantized KV cache are not supported with tensor_parallel_size > 1 in a "
                "disaggregated run yet (moving a quantized pool's head slices between ranks is untested); use one "
                "rank per engine or an unquantized pool"
            )
        if self.max_retries < 0 or not self.transfer_timeout_s > 0:
            raise ConfigError("max_retries must be >= 0 and transfer_timeout_s > 0")

    @property
    def layout(self) -> Layout:
        return Layout(
            self.num_prefill, self.num_decode, self.prefill.tensor_parallel_size, self.decode.tensor_parallel_size
        )

    def check_model(self, cfg: ModelConfig) -> None:
        """ConfigError when a pool's tensor_parallel_size cannot split ``cfg``."""
        for role, engine in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                check_tensor_parallel_size(cfg, engine.tensor_parallel_size)
            except ConfigError as exc:
                raise ConfigError(f"the {role} pool: {exc}") from None


@dataclass(frozen=True)
class Layout:
    """Where the ranks of a disaggregated world are: prefill engine ``e``'s ``prefill_tp`` ranks first, from
    ``e * prefill_tp``; then decode engine ``e``'s ``decode_tp`` ranks, from ``num_prefill * prefill_tp +
    e * decode_tp``. An engine's first rank is its driver."""

    num_prefill: int
    num_decode: int
    prefill_tp: int
    decode_tp: int

    @property
    def world(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    def tp(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def driver(self, role: str, index: int) -> int:
        """The global rank of engine ``index``'s first rank."""
        if role == "prefill":
            return index * self.prefill_tp
        return self.num_prefill * self.prefill_tp + index * self.decode_tp

    def place(self, rank: int) -> tuple[str, int, int]:
        """(role, engine index, rank within the engine) of a global rank."""
        split = self.num_prefill * self.prefill_tp
        if rank < split:
            return "prefill", rank // self.prefill_tp, rank % self.prefill_tp
        return "decode", (rank - split) // self.decode_tp, (rank - split) % self.decode_tp

    def engines(self) -> list[tuple[str, int]]:
        return [("prefill", e) for e in range(self.num_prefill)] + [("decode", e) for e in range(self.num_decode)]

    def ranks(self, role: str, index: int) -> list[int]:
        first = self.driver(role, index)
        return list(range(first, first + self.tp(role)))


@dataclass(frozen=True)
class RequestSpec:
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    decode_rank: int


@dataclass
class DisaggResult:
    """What ``run_disaggregated`` returns: per-request results (in request order), transfers and pool logs."""

    requests: list[RequestResult]
    transfers: dict[int, dict[str, Any]]  # request_id -> kv_transfer_bytes, kv_transfer_s, retries, recomputed
    pools: dict[str, Any]  # 'prefill0', 'decode0', ...: steps, num_steps, busy_s, attention_backend, num_threads
    duration_s: float
    num_backpressure: int
    engines: dict[int, tuple[int, int]] = field(default_factory=dict)  # request_id -> (prefill, decode engine)

    def kv_transfer(self) -> dict[str, Any]:
        t = self.transfers.values()
        return {
            "bytes": sum(x["kv_transfer_bytes"] for x in t),
            "seconds": sum(x["kv_transfer_s"] for x in t),
            "num_transfers": sum(x["num_transfers"] for x in t),
            "num_retries": sum(x["num_retries"] for x in t),
            "num_recomputed": sum(x["num_recomputed"] for x in t),
            "num_backpressure": self.num_backpressure,
        }

    def request_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.requests:
            t = self.transfers.get(r.request_id, {})
            rows.append(
                {
                    "request_id": r.request_id,
                    "prompt_len": r.num_prompt_tokens,
                    "output_len": r.num_output_tokens,
                    "finish_reason": r.finish_reason,
                    "kv_transfer_bytes": t.get("kv_transfer_bytes", 0),
                    "kv_transfer_s": t.get("kv_transfer_s", 0.0),
                    "ttft_s": r.ttft_s,
                }
            )
        return rows


# ---- the two kinds of engine process ----------------------------------------------------------------------------
def prefill_sampling(sampling: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """What the prefill engine serves of a request: its first token (``max_tokens`` 1) when the whole request passes
    the one request rule (``workbench.request.fits_context``), else the request itself, which that engine then rejects
    with the reason any entry point gives (never a prefill of a request the decode side would refuse)."""
    if not fits_context(num_prompt_tokens, sampling.max_tokens, max_model_len):
        return sampling
    return dataclasses.replace(sampling, max_tokens=1)


def _drain(inbox: mp.Queue, wait_s: float) -> list[tuple]:
    """Every message waiting in ``inbox``; waits up to ``wait_s`` for the first one when none is there."""
    out = []
    try:
        out.append(inbox.get(timeout=wait_s) if wait_s > 0 else inbox.get_nowait())
        while True:
            out.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return out


class KVPeer:
    """One rank's connector over its shard of the pool: a ``KVSender`` and a ``KVReceiver``, made anew per run."""

    sender_class = KVSender

    def __init__(self, cache: Any, first_head: int) -> None:
        self.cache, self.first_head = cache, first_head
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None

    def begin(self, timeout_s: float) -> None:
        self.sender = self.sender_class(self.cache, self.first_head)
        self.receiver = KVReceiver(self.cache, timeout_s, self.first_head)

    def send(self, rid: int, table: list[int], n: int, pieces: list[Piece], attempt: int) -> list[tuple[int, Piece]]:
        return self.sender.start(rid, table, n, pieces, attempt)

    def finish(self, rid: int) -> None:
        self.sender.finish(rid)

    def receive(self, meta: KVTransfer, table: list[int]) -> tuple[bool, str]:
        return self.receiver.receive(meta, table)


class DisaggShardWorker(Worker):
    """A rank of a tensor-parallel engine in a disaggregated world: a ``Worker`` on its engine's subgroup that
    also moves its KV heads (``kv_call``, called on every rank by the engine's driver)."""

    def init_cache(self, *args: Any) -> None:
        super().init_cache(*args)
        self.kv = KVPeer(self.runner.cache, head_range(self.model.tp_shard.cfg, self.rank, self.world_size)[0])

    def kv_call(self, name: str, *args: Any) -> list[Any] | None:
        """``KVPeer.name(*args)`` on this rank; every rank's result on the driver."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(getattr(self.kv, name)(*args), out, group=self.group, group_dst=0)
        return out


class EngineKV:
    """An engine driver's handle on the connector of all its ranks: ``call(name, ...)`` runs ``KVPeer.name`` on
    every rank and returns their results (in this process for TP 1, through the engine's worker group above)."""

    def __init__(self, engine: Any, peer_class: type[KVPeer] = KVPeer) -> None:
        self.workers = engine.workers
        self.peer = peer_class(engine.cache, 0) if self.workers is None else None

    def call(self, name: str, *args: Any) -> list[Any]:
        if self.workers is None:
            return [getattr(self.peer, name)(*args)]
        return self.workers.call("kv_call", name, *args)


def _worker_args(source: str, config: EngineConfig, seed: int, threads: int, group: Any) -> tuple:
    return (source, config.dtype, config.device, seed, threads, group, config.quantization, config.group_size)


def _load_engine(
    source: str, config: EngineConfig, seed: int, threads: int, out: mp.Queue, rank: int, group: Any
) -> Any:
    """This engine's driver: a whole engine (TP 1), or the first rank of its subgroup with the others serving it."""
    from workbench.engine.engine import Engine

    set_threads(threads)
    if group is None:
        engine = Engine.from_model(source, config, seed=seed)
    else:
        workers = WorkerGroup.on_subgroup(
            group, DisaggShardWorker, _worker_args(source, config, seed, threads, group), timeout_s=120.0
        )
        engine = Engine(workers.worker.model, config, workers=workers)
    out.put(("ready", rank))
    return engine


def _next_run(engine: Any, inbox: mp.Queue) -> tuple[float, tuple, list[tuple]] | None:
    """Wait for the coordinator: ("start", t0, *options) begins a run on the shared clock; ("exit",) ends.

    Returns t0, the options (``EngineLoop.begin``'s further arguments) and the messages that came before the start:
    they belong to the new run (the previous one consumed all of its own before it ended). Two processes write to a
    decode engine's queue, each through its own feeder thread, so the prefill engine's first KV announcement of a
    run can overtake the coordinator's start."""
    early: list[tuple] = []
    while True:
        message = inbox.get()
        if message[0] == "exit":
            return None
        if message[0] != "start":
            early.append(message)
            continue
        engine.reset_clock(message[1])  # a new run: its own clock and step log (the engine kept no request)
        engine.new_step_log()
        return message[1], tuple(message[2:]), early


class EngineLoop:
    """The driver of one engine of a disaggregated world: serves one run after another through the engine's API.

    The prefill side (``prefill_run``) serves each request with ``max_tokens=1`` and holds its blocks
    (``Engine.hold``) until the decode side acknowledges its KV; the decode side (``decode_run``) admits each with
    its KV (``Engine.add_prefilled``), or recomputes it when the transfer cannot be had. Finished requests are
    reported to the coordinator (``report``)."""

    peer_class = KVPeer

    def __init__(
        self, engine: Any, rank: int, index: int, role: str, cfg: DisaggConfig, plan: list[Piece],
        inboxes: dict[int, mp.Queue], out: mp.Queue,
    ) -> None:  # fmt: skip
        self.engine, self.rank, self.index, self.role, self.cfg, self.plan = engine, rank, index, role, cfg, plan
        self.inboxes, self.inbox, self.out = inboxes, inboxes[rank], out
        self.kv = EngineKV(engine, self.peer_class)

    def serve(self) -> None:
        """Serve runs until the coordinator says exit."""
        if self.role == "prefill":
            self.engine.hold()
        while (run := _next_run(self.engine, self.inbox)) is not None:
            t0, options, early = run
            self.begin(t0, *options)
            stats = (self.prefill_run if self.role == "prefill" else self.decode_run)(t0, early)
            rows = self.engine.step_log.to_records()
            busy = sum(r["duration_s"] for r in rows)
            self.out.put(("pool", self.role, self.index, {"num_steps": len(rows), "busy_s": busy, "steps": rows,
                                                          **self.engine_facts(), **stats}))  # fmt: skip

    def engine_facts(self) -> dict[str, Any]:
        """What this engine's steps ran on: ``attention_backend`` (as resolved here: 'auto' decided) and
        ``num_threads`` (torch's intra-op threads of this process). A cost model timed on a colocated engine prices
        these steps only when both are the colocated engine's (``workbench.experiments.fidelity`` checks them)."""
        return {"attention_backend": self.engine.backend.name, "num_threads": torch.get_num_threads()}

    def begin(self, t0: float) -> None:
        """A run starts at ``t0`` (``time.perf_counter``): fresh connectors on every rank."""
        self.kv.call("begin", self.cfg.transfer_timeout_s)

    def report(self, result: RequestResult, transfer: dict[str, Any]) -> None:
        """Send a finished request's result (and its transfer's counts) to the coordinator."""
        self.out.put(("done", result, transfer))

    def prefill_run(self, t0: float, early: list[tuple]) -> dict[str, Any]:
        engine, kv, rank, clock = self.engine, self.kv, self.rank, wall_clock(t0)
        scales = layer_scales(engine.cache)
        in_flight: set[int] = set()

        def send(spec: RequestSpec, table: list[int], attempt: int) -> None:
            pieces = [Piece(rank + p.src, spec.decode_rank + p.dst, p.head_lo, p.head_hi) for p in self.plan]
            posted = sorted(x for per_rank in kv.call("send", spec.request_id, table, len(spec.prompt_ids), pieces,
                                                       attempt) for x in per_rank)  # fmt: skip
            meta = KVTransfer(spec.request_id, rank, len(spec.prompt_ids), tuple(p for _, p in posted), attempt,
                              clock(), scales)  # fmt: skip
            in_flight.add(spec.request_id)
            self.inboxes[spec.decode_rank].put(("kv", spec, meta, *first_tokens[spec.request_id]))

        specs: dict[int, RequestSpec] = {}
        first_tokens: dict[int, tuple[int, float, Any]] = {}  # rid -> (first token, when, the generator's state)
        attempts: dict[int, int] = {}
        stopping = False
        while True:
            idle = not engine.has_unfinished()
            messages, early = early + _drain(self.inbox, 0.0 if early or not idle else POLL_S), []
            for message in messages:
                kind = message[0]
                if kind == "request":
                    spec: RequestSpec = message[1]
                    specs[spec.request_id] = spec
                    engine.add_request(spec.prompt_ids, prefill_sampling(spec.sampling, len(spec.prompt_ids),
                                       engine.max_model_len), spec.arrival_time, spec.request_id)  # fmt: skip
                elif kind == "ack":  # the decode side has the KV (or will recompute it): free the blocks
                    rid = message[1]
                    kv.call("finish", rid)
                    in_flight.discard(rid)
                    engine.release(rid)
                elif kind == "nack":  # the KV arrived damaged: send the staged copy again
                    rid = message[1]
                    attempts[rid] = attempts.get(rid, 0) + 1
                    send(specs[rid], engine.held_blocks(rid), attempts[rid])
                elif kind == "stop":
                    stopping = True
            if engine.has_unfinished():
                for out in engine.step():
                    if not out.finished:
                        continue
                    rid, spec = out.request_id, specs[out.request_id]
                    done_here = out.finish_reason in ("rejected", "stop") or spec.sampling.max_tokens == 1
                    state = engine.handoff_state(rid)
                    if done_here:  # nothing for a decode engine to do
                        engine.release(rid)
                        self.report(out.result, {})
                        continue
                    first_tokens[rid] = (out.result.tokens[0], out.first_token_time, state)
                    send(spec, engine.held_blocks(rid), 0)
            if stopping and not engine.has_unfinished() and not in_flight:
                return {}

    def decode_run(self, t0: float, early: list[tuple]) -> dict[str, Any]:
        engine, kv, cfg, clock = self.engine, self.kv, self.cfg, wall_clock(t0)
        handoff: Handoff[tuple[RequestSpec, KVTransfer, int, float, Any, float]] = Handoff()
        transfers: dict[int, dict[str, Any]] = {}
        stopping = False

        def take(item: tuple[RequestSpec, KVTransfer, int, float, Any, float]) -> bool:
            spec, meta, first, first_at, state, announced = item  # state: the prefill's generator
            rid = spec.request_id
            outcome: dict[str, Any] = {}

            def receive(table: list[int]) -> float | None:
                outcome["posted"] = clock()
                outcomes = kv.call("receive", meta, table)  # every rank's (ok, why)
                outcome["ok"], outcome["why"] = next(((o, w) for o, w in outcomes if not o), (True, ""))
                outcome["landed"] = clock()
                return outcome["landed"] if outcome["ok"] else None

            admitted = engine.add_prefilled(
                rid, spec.prompt_ids, spec.sampling, spec.arrival_time, first, first_at, state, receive
            )
            if admitted == "full":
                return False  # backpressure: the KV stays on the prefill side until blocks free up here
            info = transfers.setdefault(
                rid, {"kv_transfer_bytes": 0, "kv_transfer_s": 0.0, "num_transfers": 0, "num_retries": 0,
                      "num_recomputed": 0},
            )  # fmt: skip
            info["num_transfers"] += 1
            # the last attempt's timeline on the run clock: the prefill side's first token, the send posted, the
            # announcement's arrival here, the receive posted (after this engine's step in flight), the KV landed
            landed = outcome["landed"]
            info["timeline"] = {"prefill_token_s": first_at, "sent_s": meta.sent_at, "announced_s": announced,
                                "receive_posted_s": outcome["posted"], "landed_s": landed}  # fmt: skip
            if admitted == "admitted":
                info["kv_transfer_bytes"] += meta.num_bytes
                info["kv_transfer_s"] += landed - max(meta.sent_at, outcome["posted"])
                self.inboxes[meta.src_rank].put(("ack", rid))
            elif outcome["why"] == "checksum mismatch" and meta.attempt < cfg.max_retries:
                info["num_retries"] += 1
                self.inboxes[meta.src_rank].put(("nack", rid))
            else:  # give up on the transfer: the decode engine computes the prompt's KV itself, the first token kept
                info["num_recomputed"] += 1
                self.inboxes[meta.src_rank].put(("ack", rid))
                engine.add_prefilled(rid, spec.prompt_ids, spec.sampling, spec.arrival_time, first, landed, state)
            return True

        while True:
            idle = not engine.has_unfinished() and not handoff
            messages, early = early + _drain(self.inbox, 0.0 if early or not idle else POLL_S), []
            for message in messages:
                if message[0] == "kv":
                    handoff.arrive(message[1].request_id, (*message[1:], clock()))
                elif message[0] == "stop":
                    stopping = True
            handoff.admit(take)
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        self.report(out.result, transfers.get(out.request_id, {}))
            if stopping and not handoff and not engine.has_unfinished():
                return {"num_backpressure": handoff.num_backpressure}


# ---- the coordinator ------------------------------------------------------------------------------------------
class DisaggCluster:
    """P prefill and D decode engine processes, started once and serving one run after another.

    Use as a context manager (or ``close()``): every process is stopped at the end, killed if it must be.
    ``loop_class``: what drives each engine (``EngineLoop``; tests subclass it to inject faults).
    """

    loop_class: type[EngineLoop] = EngineLoop

    def __init__(self, source: str, cfg: DisaggConfig, seed: int = 0) -> None:
        from workbench.model.checkpoint import check_model_source

        check_model_source(source)  # a bad checkpoint is one line here, not a traceback from every rank
        cfg.check_model(ModelConfig.resolve(source))
        self.cfg = cfg
        self.handoff: Handoff[Any] = Handoff(cfg.num_prefill, cfg.num_decode)  # its routing
        layout = self.layout = cfg.layout
        world = self.world = layout.world
        context = mp.get_context("spawn")
        self.inboxes = {layout.driver(*e): context.Queue() for e in layout.engines()}  # one per engine's driver
        self.out = context.Queue()

        def name(rank: int) -> str:
            role, index, local = layout.place(rank)
            return f"workbench-{role}{index}" + (f"-tp{local}" if local else "")

        backend = DistConfig(world, backend=cfg.backend).resolved_backend()
        init = f"tcp://127.0.0.1:{free_port()}"
        self.processes = ProcessSet(
            list(range(world)), world, backend, init, cfg.transfer_timeout_s + 60, _rank_entry,
            lambda rank: (str(source), cfg, seed, self.inboxes, self.out, self.loop_class), name,
        )  # fmt: skip
        self._closed = False
        ready: set[int] = set()
        engines = len(self.inboxes)
        try:
            self._wait(lambda m: ready.add(m[1]) if m[0] == "ready" else None, lambda: len(ready) == engines, {})
        except BaseException:
            self.close(grace_s=1.0)
            raise

    def __enter__(self) -> DisaggCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, grace_s: float = 10.0) -> None:
        """Ask every engine to exit, give them ``grace_s``, then kill what is left (after a failure: 1 s, since
        engines waiting on a dead peer would spend the grace period for nothing)."""
        if self._closed:
            return
        self._closed = True
        for inbox in self.inboxes.values():
            inbox.put(("exit",))
        self.processes.stop(grace_s=grace_s)

    def run(
        self,
        requests: list[tuple[list[int], SamplingParams, float]],
        online: bool = True,
        progress: Any = None,
    ) -> DisaggResult:
        """Serve ``requests`` — (prompt ids, sampling, arrival time in seconds) — and return their results in order.

        ``online``: each request is sent when its arrival time comes on the run clock (``replay``); otherwise all
        are sent at time 0 (``generate``). ``progress``: a tqdm-like object updated per finished request.
        """
        if self._closed:
            raise DisaggregationError("the disaggregated cluster has been closed")
        results: dict[int, RequestResult] = {}
        transfers: dict[int, dict[str, Any]] = {}
        pools: dict[str, Any] = {}
        ids = list(range(len(requests)))
        t0 = now()
        for inbox in self.inboxes.values():
            inbox.put(self._start_message(t0))

        def on_result(message: tuple) -> None:
            if message[0] == "done":
                results[message[1].request_id] = message[1]
                if message[2]:
                    transfers[message[1].request_id] = message[2]
                if progress is not None:
                    progress.update(1)

        try:
            order = sorted(ids, key=lambda i: requests[i][2]) if online else ids
            for n, i in enumerate(order):
                prompt, sampling, arrival = requests[i]
                if online:  # wait for the arrival time, collecting results meanwhile
                    self._wait(on_result, lambda: False, results, arrival - (now() - t0), True)
                p, d = self.handoff.route(n)
                spec = RequestSpec(
                    i, list(prompt), sampling, arrival if online else 0.0, self.layout.driver("decode", d)
                )
                self.inboxes[self.layout.driver("prefill", p)].put(("request", spec))
            self._wait(on_result, lambda: len(results) == len(ids), results)
            duration = now() - t0
            for inbox in self.inboxes.values():
                inbox.put(("stop",))

            def on_pool(message: tuple) -> None:
                if message[0] == "pool":
                    pools[f"{message[1]}{message[2]}"] = message[3]

            self._wait(on_pool, lambda: len(pools) == len(self.inboxes), results)
        except BaseException as exc:
            self.close(grace_s=1.0)
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C: the requests that finished, for partial results
                exc.partial = [results[i] for i in sorted(results)]  # type: ignore[attr-defined]
            raise
        backpressure = sum(p.get("num_backpressure", 0) for p in pools.values())
        engines = {i: self.handoff.route(n) for n, i in enumerate(order)}
        return DisaggResult([results[i] for i in ids], transfers, pools, duration, backpressure, engines)

    def _start_message(self, t0: float) -> tuple:
        """What starts a run on every engine: ("start", t0, *options for ``loop_class.begin``)."""
        return ("start", t0)

    def _wait(
        self, on_message: Any, done: Any, results: dict[int, RequestResult], seconds: float | None = None,
        deadline_only: bool = False,
    ) -> None:  # fmt: skip
        """Handle messages until ``done()``. Raise DisaggregationError when a process fails or nothing arrives
        for ``stall_timeout_s``; ``deadline_only``: just handle messages for ``seconds``."""
        timeout_s = self.cfg.stall_timeout_s if seconds is None else seconds
        deadline = now() + timeout_s
        while not done():
            remaining = deadline - now()
            if remaining <= 0:
                if deadline_only:
                    return
                raise _error(f"no progress for {timeout_s:g} s (an engine may be hung)", results)
            try:
                message = self.out.get(timeout=min(0.05, remaining))
            except queue.Empty:
                problem = self.processes.problem()
                if problem is not None:
                    raise _error(problem[0], results, problem[1]) from None
                continue
            on_message(message)
            if not deadline_only:
                deadline = now() + timeout_s


def run_disaggregated(
    source: str,
    requests: list[tuple[list[int], SamplingParams, float]],
    cfg: DisaggConfig,
    seed: int = 0,
    online: bool = True,
    progress: Any = None,
) -> DisaggResult:
    """One run on a cluster started for it (``DisaggCluster``), then stopped."""
    with DisaggCluster(source, cfg, seed) as cluster:
        return cluster.run(requests, online=online, progress=progress)


def _rank_entry(
    rank: int, world_size: int, report: Any, source: str, cfg: DisaggConfig, seed: int,
    inboxes: dict[int, mp.Queue], out: mp.Queue, loop_class: type[EngineLoop] = EngineLoop,
) -> None:  # fmt: skip
    """One rank of the disaggregated world: join every engine's subgroup (each rank creates each, in one order, as
    ``dist.new_group`` requires), then drive an engine (an engine's first rank) or serve its driver (the others)."""
    layout = cfg.layout
    role, index, local = layout.place(rank)
    config = cfg.prefill if role == "prefill" else cfg.decode
    timeout = datetime.timedelta(seconds=cfg.transfer_timeout_s + 60)
    group = None
    for engine in layout.engines():
        if layout.tp(engine[0]) > 1:
            made = dist.new_group(layout.ranks(*engine), timeout=timeout)
            if engine == (role, index):
                group = made
    if local:
        serve_subgroup(group, DisaggShardWorker, _worker_args(source, config, seed, cfg.threads_per_engine, group))
        return
    engine = _load_engine(source, config, seed, cfg.threads_per_engine, out, rank, group)
    try:
        plan = transfer_plan(ModelConfig.resolve(source), layout.prefill_tp, layout.decode_tp)
        loop_class(engine, rank, index, role, cfg, plan, inboxes, out).serve()
    finally:
        engine.shutdown()


def _error(what: str, results: dict[int, RequestResult], traceback_text: str = "") -> DisaggregationError:
    finished = sorted(results)
    error = DisaggregationError(
        f"disaggregated run failed: {what}; {len(finished)} request(s) had finished: {finished[:20]}"
        + (" ..." if len(finished) > 20 else "")
    )
    error.partial = [results[i] for i in finished]
    error.remote_traceback = traceback_text
    return error


def disagg_config_from_args(args: Any, engine: EngineConfig) -> DisaggConfig:
    """The ``DisaggConfig`` of ``--disaggregate P:D --threads-per-engine N [--prefill-tp N] [--decode-tp M]``: both
    pools configured as ``engine``, each with its own tensor-parallel size (default ``--tensor-parallel-size``, the
    meaning these flags have in ``simulate --disaggregate``)."""
    num_p, num_d = parse_disaggregate(args.disaggregate)
    prefill_tp, decode_tp = getattr(args, "prefill_tp", None), getattr(args, "decode_tp", None)
    return DisaggConfig(
        prefill=dataclasses.replace(engine, tensor_parallel_size=prefill_tp or engine.tensor_parallel_size),
        decode=dataclasses.replace(engine, tensor_parallel_size=decode_tp or engine.tensor_parallel_size),
        num_prefill=num_p, num_decode=num_d, threads_per_engine=args.threads_per_engine,
    )  # fmt: skip
