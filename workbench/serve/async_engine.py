"""The engine stepping in one loop while HTTP handlers add, stream and abort requests.

One asyncio task owns the ``Engine``: between steps it admits the requests handlers queued and applies their
aborts; each ``Engine.step`` runs in a single worker thread (torch releases the GIL, so the event loop keeps
accepting connections and writing streams meanwhile); after each step it hands every request its new token ids
through the request's own ``asyncio.Queue`` (the step's ``RequestOutput`` deltas; the engine forgets a request once it
finished, and its step log is bounded, so a long-running server holds no finished request). Handlers never touch the
engine: they call ``add`` and ``abort``, which
only queue work for the loop, so no lock is needed. When nothing is left to run the loop sleeps until ``add``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from workbench.engine.engine import Engine, RequestOutput
from workbench.errors import RequestError
from workbench.request import SamplingParams
from workbench.serve.prom import ServerMetrics

log = logging.getLogger("workbench.serve")
STEP_LOG_STEPS = 1024  # the server keeps the latest this many (to twice as many) engine steps


@dataclass
class Output:
    """What one engine step produced for a request: new ids, and how it ended once it has."""

    token_ids: list[int]
    finish_reason: str | None = None  # length | stop | abort | rejected | error
    error: str | None = None  # the reason of a rejection or an engine failure


@dataclass
class RequestHandle:
    """A request in flight, as its handler sees it."""

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    admitted: bool = False  # the engine accepted it (its prompt tokens are counted)
    last_token_time: float | None = None  # of its latest token on the engine clock (for the ITL)


class AsyncEngine:
    """Owns an ``Engine``; ``run()`` is its loop (one task), ``add``/``abort`` are called by request handlers."""

    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        engine.new_step_log(max_steps=STEP_LOG_STEPS)
        self.metrics.blocks_total.set(engine.stats()["num_blocks"])
        self._ids = itertools.count()
        self._to_add: list[RequestHandle] = []
        self._to_abort: list[tuple[int, str]] = []
        self._live: dict[int, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._num_preemptions = 0
        self.done = asyncio.Event()  # set when run() has returned

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (queued for admission included)."""
        return len(self._live) + len(self._to_add)

    def now(self) -> float:
        """The engine's clock (thread-safe: a read of ``workbench.timing.now``)."""
        return self.engine.now()

    def add(self, prompt_ids: list[int], sampling: SamplingParams, arrival_time: float | None = None) -> RequestHandle:
        """Queue a request; its outputs arrive on ``handle.queue``. Its TTFT counts from ``arrival_time`` (engine
        clock; default now)."""
        arrival = self.engine.now() if arrival_time is None else arrival_time
        handle = RequestHandle(next(self._ids), prompt_ids, sampling, arrival)
        self._to_add.append(handle)
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle, reason: str = "abort") -> None:
        """End a request that has not finished: ``abort`` (its client went away) or ``stop`` (a stop string ended
        its text; it then counts as a finished request in the metrics)."""
        if not handle.finished:
            handle.finished = True
            self._to_abort.append((handle.request_id, reason))
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Step while there is work; returns after ``stop()``, with every request still live aborted."""
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                self._apply_queued()
                if not self.engine.has_unfinished():
                    self._update_gauges()
                    self._wake.clear()
                    if not (self._to_add or self._to_abort or self._stopping):
                        await self._wake.wait()
                    continue
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as exc:  # an engine bug: fail the requests in flight, keep serving new ones
                    log.exception("engine step failed")
                    self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    continue
                self._dispatch(outputs)
        finally:
            self._apply_queued()
            for handle in list(self._live.values()):
                self.engine.abort(handle.request_id)
                self._finish(handle, Output([], "abort"))
            self._executor.shutdown(wait=True)
            self.done.set()

    def _apply_queued(self) -> None:
        to_add, self._to_add = self._to_add, []
        for handle in to_add:
            if handle.finished:  # aborted before admission
                continue
            try:
                self.engine.add_request(handle.prompt_ids, handle.sampling, handle.arrival_time, handle.request_id)
            except RequestError as exc:
                self._finish(handle, Output([], "rejected", str(exc)))
                continue
            self._live[handle.request_id] = handle  # a rejection comes back as the next step's output
        to_abort, self._to_abort = self._to_abort, []
        for rid, reason in to_abort:
            handle = self._live.pop(rid, None)
            out = self.engine.abort(rid) if handle is not None else None
            if out is None:
                continue
            self._admitted(handle)
            self.metrics.finished.labels(self.metrics.model_name, reason).inc()
            if reason == "stop" and handle.last_token_time is not None:
                self.metrics.e2e.observe(handle.last_token_time - out.arrival_time)
            handle.queue.put_nowait(Output([], reason))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._live.get(out.request_id)
            if handle is None:
                continue
            if out.finish_reason == "rejected":
                del self._live[out.request_id]
                self._finish(handle, Output([], "rejected", out.reject_reason))
                continue
            self._admitted(handle)
            self._observe_tokens(handle, out)
            if out.finished:
                del self._live[out.request_id]
                self.metrics.e2e.observe(out.finish_time - out.arrival_time)
                self._finish(handle, Output(out.new_token_ids, out.finish_reason))
            elif out.new_token_ids:
                handle.queue.put_nowait(Output(out.new_token_ids))
        self._update_gauges()

    def _admitted(self, handle: RequestHandle) -> None:
        if not handle.admitted:
            handle.admitted = True
            self.metrics.prompt_tokens.inc(len(handle.prompt_ids))

    def _observe_tokens(self, handle: RequestHandle, out: RequestOutput) -> None:
        for t in out.new_token_times:
            if handle.last_token_time is None:
                self.metrics.ttft.observe(out.first_token_time - out.arrival_time)
            else:
                self.metrics.itl.observe(t - handle.last_token_time)
            handle.last_token_time = t
        self.metrics.generation_tokens.inc(len(out.new_token_ids))

    def _finish(self, handle: RequestHandle, out: Output) -> None:
        handle.finished = True
        if out.finish_reason not in (None, "abort"):
            self.metrics.finished.labels(self.metrics.model_name, out.finish_reason).inc()
        handle.queue.put_nowait(out)

    def _fail_all(self, reason: str) -> None:
        for rid, handle in list(self._live.items()):
            self.engine.abort(rid)
            del self._live[rid]
            self._finish(handle, Output([], "error", reason))

    def _update_gauges(self) -> None:
        st = self.engine.stats()
        self.metrics.running.set(st["num_running"])
        self.metrics.waiting.set(st["num_waiting"] + len(self._to_add))
        self.metrics.blocks_used.set(st["num_used_blocks"])
        self.metrics.kv_usage.set(st["num_used_blocks"] / st["num_blocks"])
        if st["num_preemptions"] > self._num_preemptions:
            self.metrics.preemptions.inc(st["num_preemptions"] - self._num_preemptions)
            self._num_preemptions = st["num_preemptions"]
        self.metrics.request_entries.set(sum(self.engine.request_state().values()))
        spec = self.engine.speculative_stats()
        if spec is not None:
            self.metrics.observe_speculative(spec)
