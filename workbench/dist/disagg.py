"""Prefill/decode disaggregation on the real engine (Splitwise, DistServe): separate engines, KV moved between them.

    coordinator (this process)  --request-->  prefill engine (rank p)  --KV over torch.distributed-->
                                              decode engine (rank P + d)  --tokens-->  coordinator

``run_disaggregated`` starts ``P`` prefill engines and ``D`` decode engines, each an ``Engine`` in its own process
with its own KV pool, joined in one gloo (CPU) or NCCL (CUDA) group for the KV transfers
(``workbench.dist.kv_connector``); control messages travel on multiprocessing queues. Request ``i`` goes to prefill
engine ``i mod P`` and decode engine ``i mod D``. The prefill engine serves it with ``max_tokens=1``: its first
token ends it there, its blocks are held (``Scheduler.hold_finished``) and its prompt's KV is sent; the decode
engine admits it with that KV (``Scheduler.admit_prefilled``) and decodes the rest.

Definitions (DistServe's): TTFT is from arrival to the moment the first token reaches the client **from the decode
side**, i.e. when the decode engine has the request's KV and first token (so TTFT includes the prefill, any wait
for room in the decode pool, and the transfer). ITL and TPOT are the decode engine's. A request's
``kv_transfer_s`` is from the later of the send and the receive being posted to the KV landing in the decode pool
(wire time, not the wait for room, which ``num_backpressure`` counts).

Nothing is lost: a full decode pool leaves the KV held on the prefill side (whose pool then fills and stops
admitting: backpressure, counted); a transfer whose checksum fails is retried (``max_retries``), then recomputed
from the prompt on the decode side, as is one that times out (counted); a process that dies ends the run with a
``DisaggregationError`` that names it and carries the requests that had finished.

Every process stamps times on one clock: ``time.perf_counter`` is CLOCK_MONOTONIC, shared by the processes of a
machine, and the run's zero is sent to every engine once all have loaded their model.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from workbench.dist.group import DistConfig, ProcessSet, WorkerError, free_port
from workbench.dist.kv_connector import KVReceiver, KVSender, KVTransfer, wall_clock
from workbench.config import parse_disaggregate
from workbench.engine.config import EngineConfig
from workbench.engine.engine import RequestResult
from workbench.request import SamplingParams, Sequence
from workbench.errors import ConfigError

POLL_S = 0.002  # how long an idle engine waits on its queue before looking again


class DisaggregationError(WorkerError):
    """A prefill or decode engine died or stalled; ``partial`` holds the requests that had finished."""

    partial: list[RequestResult] = []


@dataclass(frozen=True)
class DisaggConfig:
    """The two pools and the transfer policy. ``prefill``/``decode``: each pool's ``EngineConfig`` (the same
    model, dtype and block size on both sides; pools and policies may differ)."""

    prefill: EngineConfig = field(default_factory=EngineConfig)
    decode: EngineConfig = field(default_factory=EngineConfig)
    num_prefill: int = 1
    num_decode: int = 1
    threads_per_engine: int = 1
    transfer_timeout_s: float = 30.0
    max_retries: int = 1
    stall_timeout_s: float = 300.0  # no message from any engine for this long ends the run
    backend: str = "auto"  # of the KV transfers: NCCL with CUDA, gloo otherwise (a CUDA pool staged through the host)

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "threads_per_engine"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.prefill.block_size != self.decode.block_size or self.prefill.dtype != self.decode.dtype:
            raise ConfigError("the prefill and decode pools need the same block_size and dtype")
        if self.prefill.tensor_parallel_size != 1 or self.decode.tensor_parallel_size != 1:
            raise ConfigError("tensor parallelism inside a disaggregated pool is not supported yet: use 1 per engine")
        if any(e.kv_cache_dtype in ("int8", "fp8") for e in (self.prefill, self.decode)):
            raise ConfigError(
                "a quantized KV cache (--kv-cache-dtype int8/fp8) is not sent by the KV connector yet (it moves K "
                "and V, not their scales); use --kv-cache-dtype auto with --disaggregate"
            )
        if self.max_retries < 0 or not self.transfer_timeout_s > 0:
            raise ConfigError("max_retries must be >= 0 and transfer_timeout_s > 0")


@dataclass(frozen=True)
class Faults:
    """Fault injection for tests: request ids whose first transfer, or every transfer, arrives damaged, and a
    decode engine that dies after finishing ``kill_decode_after`` requests."""

    corrupt_once: tuple[int, ...] = ()
    corrupt_always: tuple[int, ...] = ()
    kill_decode_after: int | None = None


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
    pools: dict[str, Any]
    duration_s: float
    num_backpressure: int

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


def _load_engine(source: str, config: EngineConfig, seed: int, threads: int, out: mp.Queue, rank: int) -> Any:
    from workbench.engine.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine.from_model(source, config, seed=seed)
    out.put(("ready", rank))
    return engine


def _next_run(engine: Any, inbox: mp.Queue) -> tuple[float, Faults] | None:
    """Wait for the coordinator: ("start", t0, faults) begins a run on the shared clock; ("exit",) ends."""
    from workbench.engine.metrics import StepLog

    while True:
        message = inbox.get()
        if message[0] == "exit":
            return None
        if message[0] == "start":  # a new run: its own clock, step log and request ids
            engine.reset_clock(message[1])
            engine.step_log = StepLog()
            engine.sequences.clear()  # the previous run's requests are all finished
            return message[1], message[2]


def _pool_stats(engine: Any, role: str, rank: int, extra: dict[str, Any]) -> tuple:
    rows = engine.step_log.to_records()
    busy = sum(r["duration_s"] for r in rows)
    return ("pool", role, rank, {"num_steps": len(rows), "busy_s": busy, "steps": rows, **extra})


def _prefill_main(
    rank: int, world_size: int, report: Any, source: str, config: EngineConfig, seed: int, cfg: DisaggConfig,
    inbox: mp.Queue, decode_inboxes: dict[int, mp.Queue], out: mp.Queue,
) -> None:  # fmt: skip
    engine = _load_engine(source, config, seed, cfg.threads_per_engine, out, rank)
    engine.scheduler.hold_finished = True
    while (run := _next_run(engine, inbox)) is not None:
        _prefill_run(engine, rank, *run, inbox, decode_inboxes, out)


def _prefill_run(
    engine: Any, rank: int, t0: float, faults: Faults, inbox: mp.Queue, decode_inboxes: dict[int, mp.Queue],
    out: mp.Queue,
) -> None:  # fmt: skip
    sender = KVSender(engine.cache, wall_clock(t0), frozenset(faults.corrupt_once), frozenset(faults.corrupt_always))
    specs: dict[int, RequestSpec] = {}
    first_tokens: dict[int, tuple[int, float]] = {}
    attempts: dict[int, int] = {}
    stopping = False
    max_len = engine.scheduler.config.max_model_len
    while True:
        idle = not engine.has_unfinished()
        for message in _drain(inbox, POLL_S if idle else 0.0):
            kind = message[0]
            if kind == "request":
                spec: RequestSpec = message[1]
                specs[spec.request_id] = spec
                engine.add_request(
                    spec.prompt_ids, dataclasses.replace(spec.sampling, max_tokens=1), spec.arrival_time,
                    spec.request_id,
                )  # fmt: skip
            elif kind == "ack":  # the decode side has the KV (or will recompute it): free the blocks
                rid = message[1]
                sender.finish(rid)
                engine.scheduler.release_held(rid)
            elif kind == "nack":  # the KV arrived damaged: send the staged copy again
                rid = message[1]
                attempts[rid] = attempts.get(rid, 0) + 1
                spec = specs[rid]
                table = engine.scheduler.held[rid].block_table
                meta = sender.start(rid, table, len(spec.prompt_ids), spec.decode_rank, attempts[rid])
                decode_inboxes[spec.decode_rank].put(("kv", spec, meta, *first_tokens[rid]))
            elif kind == "stop":
                stopping = True
        if engine.has_unfinished():
            for seq in engine.step():
                spec = specs[seq.seq_id]
                result = RequestResult.from_sequence(seq)
                done_here = (
                    seq.finish_reason in ("rejected", "stop")
                    or spec.sampling.max_tokens == 1
                    or len(spec.prompt_ids) + 1 >= max_len
                )
                if done_here:  # nothing for a decode engine to do
                    if seq.seq_id in engine.scheduler.held:
                        engine.scheduler.release_held(seq.seq_id)
                    out.put(("done", result, {}))
                    continue
                first_tokens[seq.seq_id] = (seq.output_token_ids[0], seq.first_token_time)
                meta = sender.start(seq.seq_id, seq.block_table, len(spec.prompt_ids), spec.decode_rank)
                decode_inboxes[spec.decode_rank].put(("kv", spec, meta, *first_tokens[seq.seq_id]))
        if stopping and not engine.has_unfinished() and not sender.in_flight:
            break
    out.put(_pool_stats(engine, "prefill", rank, {}))


def _decode_main(
    rank: int, world_size: int, report: Any, source: str, config: EngineConfig, seed: int, cfg: DisaggConfig,
    inbox: mp.Queue, prefill_inboxes: dict[int, mp.Queue], out: mp.Queue,
) -> None:  # fmt: skip
    engine = _load_engine(source, config, seed, cfg.threads_per_engine, out, rank)
    while (run := _next_run(engine, inbox)) is not None:
        _decode_run(engine, rank, *run, cfg, inbox, prefill_inboxes, out)


def _decode_run(
    engine: Any, rank: int, t0: float, faults: Faults, cfg: DisaggConfig, inbox: mp.Queue,
    prefill_inboxes: dict[int, mp.Queue], out: mp.Queue,
) -> None:  # fmt: skip
    clock = wall_clock(t0)
    receiver = KVReceiver(engine.cache, cfg.transfer_timeout_s)
    arrived: deque[tuple[RequestSpec, KVTransfer, int, float, float]] = deque()
    recomputed: dict[int, tuple[int, float]] = {}  # rid -> (first token, when it reached the client)
    transfers: dict[int, dict[str, Any]] = {}
    waited: set[int] = set()
    stopping, num_done = False, 0
    eos = engine.model.config.eos_token_ids
    while True:
        idle = not engine.has_unfinished() and not arrived
        for message in _drain(inbox, POLL_S if idle else 0.0):
            if message[0] == "kv":
                arrived.append((*message[1:], clock()))
            elif message[0] == "stop":
                stopping = True
        while arrived:
            spec, meta, first, _, _ = arrived[0]
            rid = spec.request_id
            seq = Sequence(rid, spec.prompt_ids, spec.sampling, spec.arrival_time, eos_token_ids=eos)
            seq.output_token_ids = [first]  # its KV is the prompt's, to be received; the first token's comes next
            if not engine.scheduler.admit_prefilled(seq):
                waited.add(rid)
                break  # backpressure: the KV stays on the prefill side until blocks free up here
            arrived.popleft()
            recv_start = clock()
            ok, why = receiver.receive(meta, seq.block_table)
            landed = clock()
            info = transfers.setdefault(
                rid, {"kv_transfer_bytes": 0, "kv_transfer_s": 0.0, "num_transfers": 0, "num_retries": 0,
                      "num_recomputed": 0},
            )  # fmt: skip
            info["num_transfers"] += 1
            if ok:
                info["kv_transfer_bytes"] += meta.num_bytes
                info["kv_transfer_s"] += landed - max(meta.sent_at, recv_start)
                seq.first_token_time = landed
                seq.token_times = [landed]
                engine.sequences[rid] = seq
                prefill_inboxes[meta.src_rank].put(("ack", rid))
                continue
            engine.scheduler.abort(rid)
            if why == "checksum mismatch" and meta.attempt < cfg.max_retries:
                info["num_retries"] += 1
                prefill_inboxes[meta.src_rank].put(("nack", rid))
                continue
            # give up on the transfer: the decode engine computes the prompt's KV itself
            info["num_recomputed"] += 1
            prefill_inboxes[meta.src_rank].put(("ack", rid))
            recomputed[rid] = (first, landed)
            engine.add_request(
                list(spec.prompt_ids) + [first],
                dataclasses.replace(spec.sampling, max_tokens=spec.sampling.max_tokens - 1),
                spec.arrival_time,
                rid,
            )
        if engine.has_unfinished():
            for seq in engine.step():
                result = RequestResult.from_sequence(seq)
                if seq.seq_id in recomputed:
                    first, at = recomputed.pop(seq.seq_id)
                    result = dataclasses.replace(
                        result,
                        prompt_ids=result.prompt_ids[:-1],
                        num_prompt_tokens=result.num_prompt_tokens - 1,
                        tokens=[first, *result.tokens],
                        num_output_tokens=result.num_output_tokens + 1,
                        first_token_time=at,
                        token_times=[at, *result.token_times],
                    )
                out.put(("done", result, transfers.get(seq.seq_id, {})))
                num_done += 1
                if faults.kill_decode_after is not None and num_done >= faults.kill_decode_after:
                    time.sleep(0.2)  # let the queue's feeder thread deliver, then die without a word
                    os.kill(os.getpid(), signal.SIGKILL)
        if stopping and not arrived and not engine.has_unfinished():
            break
    out.put(_pool_stats(engine, "decode", rank, {"num_backpressure": len(waited)}))


# ---- the coordinator ------------------------------------------------------------------------------------------
class DisaggCluster:
    """P prefill and D decode engine processes, started once and serving one run after another.

    Use as a context manager (or ``close()``): every process is stopped at the end, killed if it must be.
    """

    def __init__(self, source: str, cfg: DisaggConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.num_p, self.num_d = cfg.num_prefill, cfg.num_decode
        world = self.world = self.num_p + self.num_d
        context = mp.get_context("spawn")
        self.inboxes = {rank: context.Queue() for rank in range(world)}
        self.out = context.Queue()
        prefill_inboxes = {r: self.inboxes[r] for r in range(self.num_p)}
        decode_inboxes = {r: self.inboxes[r] for r in range(self.num_p, world)}

        def args(rank: int) -> tuple:
            if rank < self.num_p:
                return (str(source), cfg.prefill, seed, cfg, self.inboxes[rank], decode_inboxes, self.out)
            return (str(source), cfg.decode, seed, cfg, self.inboxes[rank], prefill_inboxes, self.out)

        def name(rank: int) -> str:
            return f"workbench-prefill{rank}" if rank < self.num_p else f"workbench-decode{rank - self.num_p}"

        backend = DistConfig(world, backend=cfg.backend).resolved_backend()
        init = f"tcp://127.0.0.1:{free_port()}"
        self.processes = ProcessSet(
            list(range(world)), world, backend, init, cfg.transfer_timeout_s + 60, _rank_entry, args, name
        )
        self._closed = False
        ready: set[int] = set()
        try:
            self._wait(lambda m: ready.add(m[1]) if m[0] == "ready" else None, lambda: len(ready) == world, {})
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> DisaggCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox in self.inboxes.values():
            inbox.put(("exit",))
        self.processes.stop(grace_s=10.0)

    def run(
        self,
        requests: list[tuple[list[int], SamplingParams, float]],
        online: bool = True,
        faults: Faults | None = None,
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
        t0 = time.perf_counter()
        for inbox in self.inboxes.values():
            inbox.put(("start", t0, faults or Faults()))

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
                    self._wait(on_result, lambda: False, results, arrival - (time.perf_counter() - t0), True)
                spec = RequestSpec(i, list(prompt), sampling, arrival if online else 0.0, self.num_p + n % self.num_d)
                self.inboxes[n % self.num_p].put(("request", spec))
            self._wait(on_result, lambda: len(results) == len(ids), results)
            duration = time.perf_counter() - t0
            for inbox in self.inboxes.values():
                inbox.put(("stop",))

            def on_pool(message: tuple) -> None:
                if message[0] == "pool":
                    role, rank = message[1], message[2]
                    pools[f"{role}{rank if role == 'prefill' else rank - self.num_p}"] = message[3]

            self._wait(on_pool, lambda: len(pools) == self.world, results)
        except BaseException:
            self.close()
            raise
        backpressure = sum(p.get("num_backpressure", 0) for p in pools.values())
        return DisaggResult([results[i] for i in ids], transfers, pools, duration, backpressure)

    def _wait(
        self, on_message: Any, done: Any, results: dict[int, RequestResult], seconds: float | None = None,
        deadline_only: bool = False,
    ) -> None:  # fmt: skip
        """Handle messages until ``done()``. Raise DisaggregationError when a process fails or nothing arrives
        for ``stall_timeout_s``; ``deadline_only``: just handle messages for ``seconds``."""
        timeout_s = self.cfg.stall_timeout_s if seconds is None else seconds
        deadline = time.perf_counter() + timeout_s
        while not done():
            remaining = deadline - time.perf_counter()
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
                deadline = time.perf_counter() + timeout_s


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


def _rank_entry(rank: int, world_size: int, report: Any, *args: Any) -> None:
    num_prefill = args[3].num_prefill
    (_prefill_main if rank < num_prefill else _decode_main)(rank, world_size, report, *args)


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
    """The ``DisaggConfig`` of ``--disaggregate P:D --threads-per-engine N`` (both pools configured as ``engine``)."""
    num_p, num_d = parse_disaggregate(args.disaggregate)
    return DisaggConfig(
        prefill=engine, decode=engine, num_prefill=num_p, num_decode=num_d, threads_per_engine=args.threads_per_engine
    )
