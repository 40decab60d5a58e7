"""The serving engine: requests in, a scheduler step, the model runner, tokens out; timed on the wall clock.

    Request -> Scheduler.schedule() -> StepPlan -> Executor.execute() -> Scheduler.update() -> metrics

The executor runs each plan on the engine's workers (``workbench.engine.executor``): one ``ModelRunner`` in this
process, or one per rank of a tensor-parallel engine, all running the same code on their shards.

The engine's public methods are the only way in for the server, the benchmarks, disaggregation and the simulator's
measurements; a finished request is forgotten once ``step`` (or ``abort``) has returned its output. Every timestamp
is seconds since the engine's clock was started (``reset_clock``), and each step's measured duration advances it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from workbench import timing
from workbench.config import ModelConfig
from workbench.device import dtype_name, resolve_device, synchronize, torch_dtype
from workbench.dist.group import WorkerGroup, launched_by_torchrun
from workbench.engine.config import EngineConfig
from workbench.engine.executor import Executor, start_workers
from workbench.engine.handoff import Handoff, prefilled_sequence
from workbench.engine.metrics import StepLog, StepRecord, summarize
from workbench.engine.runner import ModelRunner, check_triton_backend
from workbench.engine.scheduler import Scheduler, StepPlan
from workbench.engine.worker import Worker
from workbench.errors import ConfigError, RequestError
from workbench.kv.block_manager import BlockManager
from workbench.kv.ledger import MemoryLedger
from workbench.model.sharding import TensorParallelShard, check_tensor_parallel_size
from workbench.model.transformer import Transformer
from workbench.request import RequestRecord, SamplingParams, Sequence, validate_request
from workbench.workloads import prompt_token_ids


@dataclass
class RequestResult(RequestRecord):
    """One request's outcome: its timeline (``RequestRecord``, seconds on the engine clock) and its tokens."""

    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reject_reason: str | None = None
    num_cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "reject_reason": self.reject_reason,
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": self.num_cached_tokens,
        }

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestResult:
        return cls(
            **vars(RequestRecord.from_sequence(seq)),
            prompt_ids=list(seq.prompt_token_ids),
            tokens=list(seq.output_token_ids),
            reject_reason=seq.reject_reason,
            num_cached_tokens=seq.num_cached_tokens,
        )


@dataclass
class RequestOutput:
    """What one ``Engine.step`` (or ``abort``) did for one request: a delta, as vLLM's ``RequestOutput``.

    ``new_token_ids``/``new_token_times``: the tokens this step produced and their times (engine clock);
    ``num_output_tokens``/``num_tokens``: the totals after it (``num_tokens`` = prompt + outputs, the keys its next
    decode attends to). Once ``finished``, ``finish_reason`` says why (length | stop | rejected | abort) and
    ``result`` holds the whole request (the engine has dropped it by then).
    """

    request_id: int
    new_token_ids: list[int]
    new_token_times: list[float]
    num_output_tokens: int
    num_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    reject_reason: str | None = None
    finish_time: float | None = None
    result: RequestResult | None = None


@dataclass
class RunResult:
    """What ``generate``/``replay`` return: per-request results, the step log and the run's duration."""

    requests: list[RequestResult]
    sequences: list[Sequence]
    step_log: StepLog
    duration_s: float
    num_preemptions: int
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, **slos: float | None) -> dict[str, Any]:
        """The contract JSON of ``workbench replay`` (``workbench.engine.metrics.summarize``)."""
        return summarize(self.sequences, duration_s=self.duration_s, num_preemptions=self.num_preemptions, **slos)


class Engine:
    """A model, a KV pool, a block manager and a scheduler policy, stepped on the wall clock."""

    def __init__(
        self, model: Transformer, config: EngineConfig | None = None, workers: WorkerGroup | None = None
    ) -> None:
        """``workers``: the ranks of a tensor-parallel engine (``Engine.from_model`` starts them; each rank a
        ``workbench.engine.worker.Worker``); ``model`` is then rank 0's shard, whose config sizes each rank's shard
        of the KV pool. Every rank builds its runner with this config (``Executor.init_cache``)."""
        self.config = config or EngineConfig()
        self.model = model
        self.workers = workers
        mcfg: ModelConfig = model.config
        num_blocks, block_size = self.config.cache_shape(mcfg)
        self.block_manager = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler_config(mcfg), self.block_manager)
        max_len = self.scheduler.config.max_model_len
        model_q = getattr(model, "quantization", None)
        if model_q != self.config.quantization:
            raise ConfigError(
                f"the engine's quantization is {self.config.quantization or 'none'} but the model's weights are "
                f"{model_q or 'unquantized'}; quantize with workbench.model.quant.quantize_model or use "
                "Engine.from_model"
            )
        # the pool stores a quantized KV dtype, else the weights' dtype (whatever config.dtype says)
        self.ledger = MemoryLedger(
            mcfg, self.block_manager, weight_dtype=dtype_name(model.dtype),
            kv_dtype=self.config.kv_cache_dtype if self.config.kv_cache_quantized else dtype_name(model.dtype),
            max_model_len=max_len, quantization=model_q,
            group_size=getattr(model, "group_size", self.config.group_size),
        )  # fmt: skip
        if self.config.attention_backend == "triton":
            check_triton_backend(model.device)
        # every rank holds its shard of the pool, its own backend, decode step and ragged step
        self.executor = Executor(Worker.for_model(model) if workers is None else workers.worker, workers)
        self.runner: ModelRunner = self.executor.init_cache(self.config, num_blocks, block_size, max_len)
        self.cache, self.backend, self.decode = self.runner.cache, self.runner.backend, self.runner.decode
        self.prefill = self.runner.prefill
        self.speculator = None  # speculative decoding: proposals through the scheduler's hook (engine.spec_decode)
        if self.config.speculative_config is not None:
            from workbench.engine.spec_decode import make_speculator

            self.speculator = make_speculator(self.config.speculative_config, model, self.config.max_num_seqs,
                                              max_len, block_size)  # fmt: skip
            self.executor.speculator = self.speculator
            self.scheduler.proposer = self.speculator.propose
        self.step_log = StepLog()  # every step of a run; a server bounds it (``new_step_log(max_steps)``)
        # called after every executed step with its plan and log record (``workbench.sim.measure`` pairs them)
        self.on_step: Callable[[StepPlan, StepRecord], None] | None = None
        self.sequences: dict[int, Sequence] = {}  # unfinished requests only: step() and abort() drop the others
        self._num_reported: dict[int, int] = {}  # request id -> output tokens already reported by step()
        self._keep: dict[int, Sequence] | None = None  # generate/replay: their finished sequences, for the RunResult
        self._ids = itertools.count()
        self._handoff_states: dict[int, torch.Tensor] = {}  # held requests' generators (handoff_state)
        self.reset_clock()

    @classmethod
    def from_model(cls, name_or_path: str, config: EngineConfig | None = None, seed: int = 0) -> Engine:
        """Load a checkpoint directory, or a preset with random weights, on the config's device and dtype."""
        from workbench.model.checkpoint import load_model

        config = config or EngineConfig()
        device = resolve_device(config.device)
        tp = config.tensor_parallel_size
        if tp > 1:
            check_tensor_parallel_size(ModelConfig.resolve(name_or_path), tp)
            available = torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)
            if tp > available and not launched_by_torchrun():  # under torchrun the ranks may span nodes
                kind = "CUDA devices" if device.type == "cuda" else "CPU cores"
                raise ConfigError(f"tensor_parallel_size {tp} exceeds the {available} {kind} of this machine")
        if config.quantization is not None:  # every check before a weight is read (of every rank's shard)
            from workbench.model.quant import check_engine_quantization

            full = ModelConfig.resolve(name_or_path)
            for cfg in (full, TensorParallelShard(full, 0, tp).local_config()):
                cfg.check_quantization(config.quantization, config.group_size)
            check_engine_quantization(config.quantization, config.group_size, torch_dtype(config.dtype), device)
        if tp > 1:
            workers = start_workers(str(name_or_path), tp, config.dtype, config.device, seed, torch.get_num_threads(),
                                    config.quantization, config.group_size)  # fmt: skip
            return cls(workers.worker.model, config, workers=workers)
        model = load_model(name_or_path, dtype=torch_dtype(config.dtype), device=device, seed=seed)
        if config.quantization is not None:
            from workbench.model.quant import quantize_model

            quantize_model(model, config.quantization, config.group_size)
        return cls(model, config)

    def shutdown(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine (nothing to do for one process). Safe to repeat."""
        self.executor.shutdown()

    def warmup_decode(self) -> dict[int, float]:
        """Compile every decode batch bucket before anything is timed (``EngineConfig.compile_decode``; nothing to do
        otherwise), on every rank of a tensor-parallel engine. Returns the seconds each bucket took to compile."""
        return self.executor.call("warmup_decode")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- clock -------------------------------------------------------------------------------------------
    def reset_clock(self, t0: float | None = None) -> None:
        """Start the engine's clock now, or at ``t0`` on ``workbench.timing.now`` (a clock shared by the processes
        of one machine: disaggregated engines stamp their times on one run clock)."""
        self._t0 = timing.now() if t0 is None else t0

    def now(self) -> float:
        return timing.now() - self._t0

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | dict[str, Any] | None = None,
        arrival_time: float | None = None,
        request_id: int | None = None,
    ) -> int:
        """Queue a request and return its id. An invalid request is finished at once as 'rejected' with the reason.
        Requests are checked by ``workbench.request.validate_request``, the rule every entry point shares: ids in the
        vocabulary, and a prompt + ``max_tokens`` beyond ``max_model_len`` is rejected (never capped).

        ``request_id`` None takes the next automatic id not yet used; the id of a request still in the engine
        raises RequestError before anything changes (its outputs could not be told apart from the earlier one's).
        A rejected request's output (finish_reason 'rejected', with the reason) comes with the next ``step``.
        """
        if request_id is None:
            rid = next(self._ids)
            while rid in self.sequences:  # an explicit id took it earlier
                rid = next(self._ids)
        else:
            if not isinstance(request_id, int) or isinstance(request_id, bool):
                raise RequestError(f"request_id must be an integer or None, got {request_id!r}")
            if request_id in self.sequences:
                raise RequestError(f"request_id {request_id} is already in use by this engine; give a new id")
            rid = request_id
        arrival = self.now() if arrival_time is None else arrival_time
        reason = None
        prompt = list(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else []
        try:
            if not isinstance(prompt_ids, (list, tuple)):
                raise RequestError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
            if isinstance(sampling, dict):
                sampling = SamplingParams(**sampling)
            elif isinstance(sampling, SamplingParams):
                sampling.__post_init__()  # validated again: its fields may have been changed since
            elif sampling is not None:
                raise RequestError(
                    f"sampling must be a SamplingParams, a dict of its fields or None, got {type(sampling).__name__}"
                )
            sp = sampling if sampling is not None else SamplingParams()
            validate_request(prompt, sp.max_tokens, self.max_model_len, self.model.config.vocab_size)
        except (RequestError, TypeError) as exc:
            reason, sampling = str(exc), None
        seq = Sequence(rid, prompt, sampling, arrival, eos_token_ids=self.model.config.eos_token_ids)
        self.sequences[rid] = seq
        if reason is not None:
            self.scheduler.reject(seq, reason)
        else:
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id: int) -> RequestOutput | None:
        """Drop an unfinished request between steps (finish_reason 'abort'): its KV blocks go back to the pool, its
        sampler state is released and the engine forgets it. Its final output (no new tokens); None when it is
        unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        seq.finish_time = self.now()
        self.executor.release(request_id)
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self, start: float | None = None) -> list[RequestOutput]:
        """Schedule, execute and update once; returns an output for every request that got tokens or finished (or
        was rejected) in this step. Finished requests leave the engine (held ones stay in the pool: ``release``).

        ``start``: the step's start time when the caller already read the clock (``replay`` passes the time at
        which it admitted arrivals, so that a simulator replaying the step log admits exactly the same ones).
        """
        start = self.now() if start is None else start
        plan = self.scheduler.schedule(now=start)
        sampled = self.executor.execute(plan)
        synchronize(self.model.device)
        end = self.now()
        finished = self.scheduler.update(plan, sampled, end)
        if not plan.is_empty:
            record = self.step_log.record(plan, start, end, self.block_manager.num_used_blocks)
            if self.on_step is not None:
                self.on_step(plan, record)
        for seq in finished:
            if seq.seq_id in self.scheduler.held:  # a finished prefill to hand off: its sampling continues there
                state = self.executor.sampler.generator_state(seq.seq_id)
                if state is not None:
                    self._handoff_states[seq.seq_id] = state
            self.executor.release(seq.seq_id)
        # the step's deltas: every unfinished sequence of the plan that sampled, then every finished one
        out = [self._output(c.seq) for c in plan.chunks if c.samples and not c.seq.is_finished]
        return out + [self._output(seq) for seq in finished]

    def _output(self, seq: Sequence) -> RequestOutput:
        """``seq``'s tokens since its last output; a finished sequence is dropped from the engine here."""
        rid, done = seq.seq_id, seq.is_finished
        sent = self._num_reported.pop(rid, 0) if done else self._num_reported.get(rid, 0)
        n = len(seq.output_token_ids)
        if not done:
            self._num_reported[rid] = n
        else:
            self.sequences.pop(rid, None)
            if self._keep is not None:
                self._keep[rid] = seq
        return RequestOutput(
            request_id=rid, new_token_ids=seq.output_token_ids[sent:], new_token_times=seq.token_times[sent:],
            num_output_tokens=n, num_tokens=seq.num_tokens, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, finished=done, finish_reason=seq.finish_reason,
            reject_reason=seq.reject_reason, finish_time=seq.finish_time,
            result=RequestResult.from_sequence(seq) if done else None,
        )  # fmt: skip

    def stats(self) -> dict[str, int]:
        """The queue and pool gauges a server exports (``num_preemptions``: cumulative)."""
        sched, bm = self.scheduler, self.block_manager
        return {
            "num_running": sched.num_running, "num_waiting": sched.num_waiting, "num_blocks": bm.num_blocks,
            "block_size": bm.block_size, "num_used_blocks": bm.num_used_blocks,
            "num_preemptions": sched.num_preemptions, "max_model_len": sched.config.max_model_len,
        }  # fmt: skip

    @property
    def num_speculative_tokens(self) -> int | None:
        """Speculative decoding's k (tokens proposed per step at most); None when speculation is off."""
        spec = self.config.speculative_config
        return None if spec is None else spec.num_speculative_tokens

    def speculative_stats(self) -> dict[str, Any] | None:
        """Speculative decoding's acceptance counters since the engine started (``SpecStats.to_dict``: counts,
        ``acceptance_rate``, ``mean_accepted_length``, per position); None when speculation is off."""
        return None if self.speculator is None else self.scheduler.spec_stats.to_dict()

    def request_state(self) -> dict[str, int]:
        """How many requests each per-request store of the engine holds: ``sequences`` (unfinished requests),
        ``scheduler`` (waiting, running and held), ``reported`` (output counts already sent), ``generators`` (seeded
        samplers), ``handoff`` (held requests' generator states) and ``speculator`` (a draft model's sequences, the
        oracle's continuations). Once every request has finished or been aborted (and none is held) each is 0: the
        engine holds no finished request (``workbench bench soak`` checks it)."""
        sched = self.scheduler
        return {
            "sequences": len(self.sequences),
            "scheduler": sched.num_requests,
            "reported": len(self._num_reported),
            "generators": self.executor.sampler.num_generators,
            "handoff": len(self._handoff_states),
            "speculator": 0 if self.speculator is None else self.speculator.num_requests,
        }

    def check_invariants(self) -> None:
        """The block manager's invariants against the block tables of every request holding blocks (running or
        held): reference counts, free lists, no block twice (AssertionError on a violation)."""
        sched = self.scheduler
        self.block_manager.check_invariants([s.block_table for s in (*sched.running, *sched.held.values())])

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + outputs) this engine serves."""
        return self.scheduler.config.max_model_len

    @property
    def token_budget(self) -> int:
        """The most tokens one step computes (``SchedulerConfig.token_budget``)."""
        return self.scheduler.config.token_budget

    def new_step_log(self, max_steps: int | None = None) -> None:
        """Start a fresh step log; ``max_steps`` keeps only the latest that many steps (a long-running server)."""
        self.step_log = StepLog(max_steps=max_steps)

    # ---- handoff (prefill/decode disaggregation) -------------------------------------------------------------
    def hold(self, enabled: bool = True) -> None:
        """The prefill side of disaggregation (``Handoff.hold``): from now on a finished request keeps its KV blocks
        until ``release``."""
        Handoff.hold(self.scheduler, enabled)

    def held_blocks(self, request_id: int) -> list[int]:
        """The KV block table of held request ``request_id`` (to send its KV again after a damaged transfer)."""
        try:
            return self.scheduler.held[request_id].block_table
        except KeyError:
            raise RequestError(f"request {request_id} is not held by this engine") from None

    def release(self, request_id: int) -> bool:
        """Free the KV blocks of a held finished request (its KV reached the decode side, or is no longer
        wanted); False when it is not held."""
        self._handoff_states.pop(request_id, None)
        return Handoff.release(self.scheduler, request_id)

    def add_prefilled(
        self,
        request_id: int,
        prompt_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float,
        first_token: int,
        first_token_time: float,
        sampler_state: torch.Tensor | None = None,
        receive: Callable[[list[int]], float | None] | None = None,
    ) -> str:
        """The decode side of disaggregation: admit a request whose prompt another engine prefilled and whose first
        token it sampled; its sampling continues from ``sampler_state`` (that engine's ``handoff_state``).

        With ``receive``: blocks are allocated for the prompt's KV and ``receive(block_table)`` fills them (the KV
        connector), returning when the KV landed (engine clock: the request's first token time, as the client
        sees it) or None when it failed. Returns 'admitted'; 'full' with nothing changed when the pool or the
        batch has no room now (the sender keeps the KV: backpressure); 'failed' with nothing kept when the
        receive failed. Without ``receive`` the prompt is recomputed here (queued like a preempted request,
        holding its first token at ``first_token_time``): 'admitted'. RequestError when it can never be served.
        """
        if request_id in self.sequences:
            raise RequestError(f"request_id {request_id} is already in use by this engine; give a new id")
        eos = self.model.config.eos_token_ids
        seq = prefilled_sequence(request_id, prompt_ids, sampling, arrival_time, first_token, first_token_time, eos)
        if receive is None:
            if not self.scheduler.add(seq):
                raise RequestError(f"request {request_id} cannot be served here: {seq.reject_reason}")
        else:
            if not self.scheduler.admit_prefilled(seq):
                return "full"
            landed = receive(seq.block_table)
            if landed is None:
                self.scheduler.abort(request_id)
                return "failed"
            seq.first_token_time, seq.token_times = landed, [landed]
        self.sequences[request_id] = seq
        self._num_reported[request_id] = 1  # the first token was reported by the prefill side
        if sampler_state is not None:  # a seeded request draws on as on one engine, not from its seed again
            self.executor.sampler.resume(request_id, sampler_state, self.model.device)
        return "admitted"

    def handoff_state(self, seq_id: int) -> torch.Tensor | None:
        """The sampling generator's state of held request ``seq_id`` as it finished here (taken: asked once), for
        ``add_prefilled`` on the engine that continues the request; None when it sampled greedily."""
        return self._handoff_states.pop(seq_id, None)

    # ---- serving a batch or a workload ---------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None
    ) -> RunResult:
        """Offline: every prompt arrives now; step until all are done. Results in prompt order."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(
                f"{len(params)} sampling params for {len(prompts)} prompts; give one SamplingParams for all "
                "or a list with one per prompt"
            )
        start = self.now()
        self._keep = {}
        ids = [self.add_request(p, sp, arrival_time=start) for p, sp in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return self._result(ids, self.now() - start)

    def replay(
        self, requests: Iterable[Any], sampling: SamplingParams | None = None, seed: int = 0, progress: Any = None
    ) -> RunResult:
        """Online: each request joins when its ``arrival_time_s`` comes on the wall clock (the engine idles until then).

        Each request needs ``arrival_time_s``, ``output_len`` and ``prompt_token_ids`` or a ``prompt_len``
        (``workbench.workloads.Request``: ids are then drawn deterministically, equal Mooncake hash ids giving equal
        blocks); it is served with ``sampling`` (greedy by default) and exactly ``output_len`` tokens (EOS ignored).
        ``progress``: a tqdm-like object updated once per finished request. On Ctrl-C the ``KeyboardInterrupt``
        carries ``partial``: the ``RequestResult`` of every request that had finished (for partial results).
        """
        vocab = self.model.config.vocab_size
        pending = sorted(requests, key=lambda r: r.arrival_time_s)
        counts = Counter(r.request_id for r in pending if getattr(r, "request_id", None) is not None)
        clash = sorted({i for i in counts if i in self.sequences or counts[i] > 1})
        if clash:  # checked before anything is queued
            raise RequestError(
                f"request id(s) {clash[:5]} appear twice in the workload or are already used by this engine; "
                "give each request its own id, or replay on a fresh Engine"
            )
        base = sampling or SamplingParams()
        self.reset_clock()
        self._keep = {}
        ids: list[int] = []
        try:
            self._replay_loop(pending, ids, base, vocab, seed, progress)
        except KeyboardInterrupt as exc:
            kept, self._keep = self._keep or {}, None
            finished = [RequestResult.from_sequence(kept[rid]) for rid in ids if rid in kept]
            exc.partial = finished  # type: ignore[attr-defined]
            raise
        return self._result(ids, self.now())

    def _replay_loop(
        self, pending: list[Any], ids: list[int], base: SamplingParams, vocab: int, seed: int, progress: Any
    ) -> None:
        """``replay``'s loop: admit each request at its arrival (its id appended to ``ids``), step until done."""
        i = 0
        while i < len(pending) or self.has_unfinished():
            now = self.now()
            while i < len(pending) and pending[i].arrival_time_s <= now:
                r = pending[i]
                sp = {**asdict(base), "max_tokens": r.output_len, "ignore_eos": True}
                prompt = r.prompt_token_ids if r.prompt_token_ids is not None else prompt_token_ids(r, vocab, seed)
                rid = getattr(r, "request_id", None)  # the trace's own id, so results can be joined to it
                ids.append(self.add_request(list(prompt), sp, arrival_time=r.arrival_time_s, request_id=rid))
                i += 1
            if self.has_unfinished():
                done = sum(out.finished for out in self.step(now))
                if progress is not None and done:
                    progress.update(done)
            elif i < len(pending):
                time.sleep(max(0.0, pending[i].arrival_time_s - self.now()))

    def _result(self, ids: list[int], duration_s: float) -> RunResult:
        kept, self._keep = self._keep or {}, None
        seqs = [kept[i] for i in ids]
        spec = self.speculative_stats()
        return RunResult(
            requests=[RequestResult.from_sequence(s) for s in seqs],
            sequences=seqs,
            step_log=self.step_log,
            duration_s=duration_s,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            extra={} if spec is None else {"speculative": spec},
        )
