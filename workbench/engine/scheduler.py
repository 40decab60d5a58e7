"""Batching policies over ``Sequence`` objects, in plain Python: what runs in the next step.

``Scheduler.schedule()`` returns a ``StepPlan`` (which sequences run, how many new tokens each, which were
preempted); the model runner turns it into tensors, or the simulator's cost model into a duration;
``Scheduler.update()`` then appends the sampled tokens and finishes sequences. The same objects serve the
real engine and the simulator, so every policy exists once.

Policies (``SchedulerConfig.policy``):

- ``static``: request-level batching, as a framework without continuous batching does (HF ``generate``,
  early FasterTransformer). A batch (up to ``max_num_seqs`` requests, prompts summing to at most
  ``token_budget`` tokens) is admitted only when nothing is running; its prompts are prefilled in one step,
  then the whole batch decodes together until its last member finishes. Finished members leave idle slots
  and nothing new joins until the batch is done. ``StepPlan.num_padding_tokens`` counts the padding a
  padded batch would carry (prompts padded to the longest) and ``num_idle_slots`` the finished members
  still occupying the batch; the runner computes neither.
- ``continuous``: iteration-level scheduling (Orca) as in vLLM v0's default scheduler, which prioritises
  prefills: each step, if waiting requests can be admitted (FCFS, stopping at the first that does not fit
  the token budget, ``max_num_seqs`` or the free blocks), the step is made of their whole-prompt prefills
  only and the running decodes wait ("generation stalls"); otherwise the step decodes every running
  sequence. A step is all prefills or all decodes.
- ``prefill-first``: the same policy as ``continuous`` (an alias, kept so experiments can name the
  priority explicitly).
- ``decode-first``: mixed batches with decodes prioritised, as vLLM v1 schedules with chunked prefill off:
  each step first schedules one token for every running sequence, then admits waiting requests as *whole*
  prompt prefills into the token budget left over (FCFS, stopping at the first that does not fit). Decodes
  never wait for prefills, but a step that carries a long prompt is long for its decodes too.
- ``chunked``: Sarathi-Serve's stall-free batching: each step's ``token_budget`` is filled first with every
  running decode, then with the next chunks of running partial prefills, then with the first chunks of
  newly admitted requests; each prefill chunk holds at most ``chunk_size`` tokens and the budget left.

Memory (all policies): admission reserves blocks for all of a request's current tokens (vLLM v0 does the
same), less the blocks found in the prefix cache; a running sequence only needs a new block when its decode
crosses a block boundary. When that block is not available the most recently arrived running sequence is
preempted by recomputation (vLLM's default): its blocks are freed, it returns to the front of the waiting
queue with ``num_computed_tokens = 0`` and keeps its outputs. The oldest running sequence is thus never
preempted while another runs, and alone it always fits (``add`` rejects a request whose longest possible
length would not, and one whose prompt + ``max_tokens`` exceeds ``max_model_len``: the one rule of
``workbench.request.validate_request``, so no request is ever capped), so every accepted request
finishes. Admission keeps ``watermark`` of the pool free while something is running (vLLM's 1% watermark
against immediate re-preemption); no request is admitted in a step that preempted one.

Speculative decoding (``proposer`` set; ``workbench.engine.speculative``): at each ``schedule()`` the proposer gives
proposed tokens for the running decodes; a decode then carries up to ``k`` of them (``_spec_tokens``) and computes
``1 + k`` tokens; ``update()`` appends the tokens verification kept and rolls back the rejected positions' blocks
(``_update_spec``); ``spec_stats`` counts acceptance.

Cost per step is O(running sequences + admitted requests): there is no per-step work over all requests. The
simulator's fast path advances several pure-decode steps at once while nothing changes
(``decode_steps_until_change``, ``advance_decode_steps``).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.config import check_positive_ints
from workbench.engine.speculative import SpecStats
from workbench.errors import ConfigError, RequestError
from workbench.kv.block_manager import BlockManager
from workbench.request import Sequence, SequenceStatus, validate_request

POLICIES = ("static", "continuous", "chunked", "prefill-first", "decode-first")


DEFAULT_MAX_NUM_SEQS = 32  # the engine's batch limit by default (the simulator's GPU server: SimConfig, 256)
DEFAULT_MAX_MODEL_LEN = 4096  # the longest sequence by default: min(the model's max positions, this)


def default_token_budget(policy: str, max_model_len: int) -> int:
    """The token budget (vLLM's ``max_num_batched_tokens``) when none is given: 2048 for ``chunked``, else
    ``max(max_model_len, 2048)`` (a whole-prompt policy never splits a prompt, so its budget holds the longest)."""
    return 2048 if policy == "chunked" else max(max_model_len, 2048)


DEFAULT_WATERMARK = 0.01  # vLLM's: the fraction of the pool admission keeps free while something runs


def blocks_over_watermark(num_seqs: int, blocks_per_seq: int, watermark: float = DEFAULT_WATERMARK) -> int:
    """The smallest pool (plus one block of float slack) in which ``num_seqs`` sequences of ``blocks_per_seq``
    blocks each are all admitted at once: admission keeps ``int(watermark * pool)`` blocks free while something
    runs, so a pool of exactly ``num_seqs * blocks_per_seq`` blocks may admit one sequence fewer (16 sequences of 129
    blocks in 2064, each admitted with 128: 16 blocks to spare, fewer than the 20 the watermark keeps)."""
    return math.ceil(num_seqs * blocks_per_seq / (1.0 - watermark)) + 1


def check_policy(policy: object) -> None:
    """Raise ConfigError unless ``policy`` is one of ``POLICIES``."""
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler, validated; errors name the field and the allowed values.

    ``token_budget`` is vLLM's ``max_num_batched_tokens``: new tokens per step over all sequences (``None``:
    ``default_token_budget``). ``chunk_size`` only matters for ``chunked`` (``None``: the token budget).
    """

    policy: str = "continuous"
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    token_budget: int | None = None
    chunk_size: int | None = None
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    enable_prefix_caching: bool = False
    watermark: float = DEFAULT_WATERMARK

    def __post_init__(self) -> None:
        check_policy(self.policy)
        check_positive_ints(self, ("max_num_seqs", "max_model_len"))
        if self.token_budget is None:
            self.token_budget = default_token_budget(self.policy, self.max_model_len)
        if self.chunk_size is None:
            self.chunk_size = self.token_budget
        check_positive_ints(self, ("token_budget", "chunk_size"))
        if self.policy != "chunked" and self.token_budget < self.max_model_len:
            raise ConfigError(
                f"token_budget ({self.token_budget}) must be >= max_model_len ({self.max_model_len}) "
                f"for policy {self.policy!r}, which never splits a prompt "
                "(policy 'chunked' allows a smaller budget)"
            )
        if not isinstance(self.watermark, (int, float)) or not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be a fraction in [0, 1), got {self.watermark!r}")
        self.enable_prefix_caching = bool(self.enable_prefix_caching)


@dataclass
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``seq`` computed this step, from position ``start``."""

    seq: Sequence
    num_new_tokens: int
    start: int
    is_prefill: bool
    samples: bool  # True when start + num_new_tokens == seq.num_tokens: this chunk yields the next token
    # speculative decoding: a decode that also verifies these proposed tokens (num_new_tokens = 1 + len of them)
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    """What one step computes. ``preempted`` sequences lost their blocks in this schedule() call."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_padding_tokens: int = 0  # static policy only: tokens a padded batch would carry in addition
    num_idle_slots: int = 0  # static policy only: finished members still holding a batch slot

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks if c.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks if not c.is_prefill)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens this step verifies (speculative decoding; counted in ``num_decode_tokens`` too)."""
        return sum(len(c.spec_token_ids) for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.chunks) and all(not c.is_prefill for c in self.chunks)


def _arrival_key(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)


class Scheduler:
    """One of the policies of the module docstring over a ``BlockManager``."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.enable_prefix_caching and not block_manager.enable_prefix_caching:
            raise ConfigError("enable_prefix_caching is set but the BlockManager was built without it")
        self.config = config
        self.block_manager = block_manager
        self.policy = "continuous" if config.policy == "prefill-first" else config.policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # ordered by (arrival_time, seq_id): the last is preempted first
        self._by_id: dict[int, Sequence] = {}
        self._rejected: list[Sequence] = []  # reported by the next update()
        self._static_batch_size = 0
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        # disaggregation's prefill side: a finished sequence keeps its blocks (its KV is still to be sent)
        # until release_held(); the pool then fills and admissions stop by themselves (backpressure)
        self.hold_finished = False
        self.held: dict[int, Sequence] = {}
        # cumulative counters
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_rejected = 0
        self.num_prefill_tokens = 0  # computed, i.e. not served by the prefix cache
        self.num_decode_tokens = 0
        # speculative decoding (workbench.engine.speculative): called at each schedule() with the running
        # sequences, returns proposed tokens by sequence id; a decode then verifies them in the same step
        self.proposer: Callable[[list[Sequence]], dict[int, list[int]]] | None = None
        self._drafts: dict[int, list[int]] = {}
        self.spec_stats = SpecStats()

    # ---- queue state -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_requests(self) -> int:
        """Requests the scheduler tracks: waiting, running and held (finished ones are forgotten)."""
        return len(self._by_id) + len(self.held)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, or a rejection is still to be reported by ``update``."""
        return bool(self.waiting or self.running or self._rejected)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens served from the prefix cache so far (over all admissions)."""
        return self.block_manager.num_hit_tokens

    # ---- requests ----------------------------------------------------------------------------------------
    def check_request(self, seq: Sequence) -> None:
        """Raise RequestError if ``seq`` can never be served by this scheduler and pool: the one request rule
        (``workbench.request.validate_request``: a prompt, prompt + ``max_tokens`` within ``max_model_len``), then
        the pool, which must hold the request's longest KV alone."""
        validate_request(seq.num_prompt_tokens, seq.sampling.max_tokens, self.config.max_model_len)
        # the last token is sampled, never computed, so the cache holds at most prompt + max_tokens - 1 positions
        bm = self.block_manager
        needed = bm.num_blocks_for(max(seq.num_prompt_tokens + seq.sampling.max_tokens - 1, seq.num_prompt_tokens))
        if needed > bm.num_blocks:
            raise RequestError(
                f"request needs up to {needed} KV blocks of {bm.block_size} tokens "
                f"(prompt {seq.num_prompt_tokens} + max_tokens {seq.sampling.max_tokens}) but the whole pool "
                f"has {bm.num_blocks}"
            )

    def add(self, seq: Sequence) -> bool:
        """Queue a request; False if it is rejected (then it is reported finished by the next ``update``)."""
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence id {seq.seq_id} is already in the scheduler")
        try:
            self.check_request(seq)
        except RequestError as exc:
            self.reject(seq, str(exc))
            return False
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq
        return True

    def reject(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` as 'rejected' for ``reason`` at its arrival; reported by the next ``update``."""
        seq.status, seq.finish_reason, seq.reject_reason = SequenceStatus.FINISHED, "rejected", reason
        seq.finish_time = seq.arrival_time
        self._rejected.append(seq)
        self.num_rejected += 1

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop an unfinished request (finish_reason 'abort'), freeing its blocks; None if unknown."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq

    # ---- scheduling --------------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> StepPlan:
        """Plan the next step; ``now`` (s), if given, stamps ``first_scheduled_time`` of admitted requests."""
        plan = StepPlan()
        self._drafts = self.proposer(self.running) if self.proposer is not None else {}
        if self.policy == "static":
            self._schedule_static(plan)
        elif self.policy == "continuous":
            budget = self._admit(plan, self.config.token_budget, whole=True)
            if not plan.chunks:
                self._schedule_running(plan, budget, decodes_only=False)
        else:  # decode-first, chunked
            budget = self._schedule_running(plan, self.config.token_budget, decodes_only=True)
            if self.policy == "chunked":
                budget = self._schedule_partial_prefills(plan, budget)
            if not plan.preempted:
                self._admit(plan, budget, whole=self.policy != "chunked")
        if now is not None:
            for chunk in plan.chunks:
                if chunk.seq.first_scheduled_time is None:
                    chunk.seq.first_scheduled_time = now
        return plan

    def _schedule_static(self, plan: StepPlan) -> None:
        if not self.running:
            self._static_batch_size = 0
            self._admit(plan, self.config.token_budget, whole=True)
            self._static_batch_size = len(plan.chunks)
            if plan.chunks:
                longest = max(c.num_new_tokens for c in plan.chunks)
                plan.num_padding_tokens = sum(longest - c.num_new_tokens for c in plan.chunks)
            return
        self._schedule_running(plan, self.config.token_budget, decodes_only=False)
        plan.num_idle_slots = max(self._static_batch_size - len(plan.chunks), 0)

    def _preempt_last(self, plan: StepPlan) -> Sequence:
        victim = self.running.pop()
        self.block_manager.free(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_cached_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)
        return victim

    def _schedule_running(self, plan: StepPlan, budget: int, decodes_only: bool) -> int:
        """One token for each running decode (oldest first), preempting the newest when out of blocks.

        With ``decodes_only=False`` a running sequence that is still prefilling (only possible after a
        policy change) gets its whole remainder; returns the budget left.
        """
        bm = self.block_manager
        bs = bm.block_size
        running = self.running
        chunks = plan.chunks
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            remaining = len(seq.prompt_token_ids) + len(seq.output_token_ids) - start
            if remaining > 1 and decodes_only:
                i += 1
                continue
            if remaining > budget:
                break
            spec = self._spec_tokens(seq, budget - 1, len(running) - i - 1) if remaining == 1 and self._drafts else []
            end = start + remaining
            while end > len(seq.block_table) * bs and not bm.append_slots(seq, end):
                victim = self._preempt_last(plan)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # preempted itself: it was the newest, so nothing after it remains
            chunks.append(ScheduledChunk(seq, remaining + len(spec), start, remaining > 1, True, spec))
            budget -= remaining + len(spec)
            i += 1
        return budget

    def _spec_tokens(self, seq: Sequence, budget: int, num_after: int) -> list[int]:
        """The proposed tokens a decode of ``seq`` verifies: its proposal cut to the token ``budget``, to what its
        ``max_tokens`` and the context leave (a step emits one token more than it verifies), and to the blocks the
        pool holds beyond one for each of the ``num_after`` running sequences after it (speculation never preempts).
        """
        draft = self._drafts.get(seq.seq_id)
        if not draft:
            return []
        k = min(len(draft), budget, seq.num_prompt_tokens + seq.sampling.max_tokens - seq.num_tokens - 1)
        if k < 1:
            return []
        bm = self.block_manager
        end = seq.num_computed_tokens + 1 + k
        needed = bm.num_blocks_for(end) - len(seq.block_table)
        if needed > 0 and (needed > bm.num_free_blocks - num_after or not bm.append_slots(seq, end)):
            return []
        return list(draft[:k])

    def _schedule_partial_prefills(self, plan: StepPlan, budget: int) -> int:
        """Next chunks of running sequences still prefilling (their blocks were reserved at admission)."""
        chunk_size = self.config.chunk_size
        for seq in self.running:
            if budget <= 0:
                break
            start = seq.num_computed_tokens
            remaining = seq.num_tokens - start
            if remaining <= 1:
                continue
            n = min(remaining, chunk_size, budget)
            plan.chunks.append(ScheduledChunk(seq, n, start, True, n == remaining))
            budget -= n
        return budget

    def _admit(self, plan: StepPlan, budget: int, whole: bool) -> int:
        """Admit waiting requests FCFS into ``budget``; stops at the first that does not fit."""
        bm = self.block_manager
        chunk_size = self.config.chunk_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            watermark = self._watermark_blocks if self.running else 0
            remaining = seq.num_tokens - bm.num_cached_prefix_tokens(seq)
            n = remaining if whole else min(remaining, chunk_size, budget)
            if n > budget or not bm.allocate(seq, watermark):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival_key)
            plan.chunks.append(ScheduledChunk(seq, n, seq.num_computed_tokens, True, n == remaining))
            budget -= n
        return budget

    # ---- results -----------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[int, int], now: float) -> list[Sequence]:
        """Apply a computed step: advance counters, append ``sampled[seq_id]`` for sampling chunks, finish.

        Returns the sequences finished by this step (and requests rejected since the last call).
        """
        finished, self._rejected = self._rejected, []
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        running_status = SequenceStatus.RUNNING
        self.num_steps += 1
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is not running_status:
                continue  # aborted between schedule() and update()
            if chunk.spec_token_ids:
                if self._update_spec(chunk, sampled, now):
                    self._finish(seq, now, finished)
                continue
            seq.num_computed_tokens += chunk.num_new_tokens
            if chunk.is_prefill:
                self.num_prefill_tokens += chunk.num_new_tokens
            else:
                self.num_decode_tokens += chunk.num_new_tokens
            if caching:
                bm.mark_computed(seq)
            if not chunk.samples:
                continue
            try:
                token = sampled[seq.seq_id]
            except KeyError:
                raise ValueError(f"update(): no sampled token for sequence {seq.seq_id}") from None
            if self._append_token(seq, token, now):
                self._finish(seq, now, finished)
        return finished

    def _append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Append one generated token at ``now``; True when it finishes ``seq`` (EOS: 'stop'; ``max_tokens``, which
        admission keeps within the context: 'length', ``finish_reason`` set)."""
        seq.output_token_ids.append(token)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if token in seq.eos_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= seq.sampling.max_tokens:
            seq.finish_reason = "length"
        else:
            return False
        return True

    def _finish(self, seq: Sequence, now: float, finished: list[Sequence]) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = now
        if self.hold_finished:
            self.held[seq.seq_id] = seq
        else:
            self.block_manager.free(seq)
        self.running.remove(seq)
        del self._by_id[seq.seq_id]
        finished.append(seq)

    def _update_spec(self, chunk: ScheduledChunk, sampled: dict[int, int | list[int]], now: float) -> bool:
        """Apply a verify step: ``sampled[seq_id]`` lists the accepted proposed tokens and the target's own
        token. Appends them up to a finish, keeps the KV of the positions they confirm and rolls back the
        rejected ones' blocks; True when the sequence finished."""
        seq = chunk.seq
        try:
            emitted = sampled[seq.seq_id]
        except KeyError:
            raise ValueError(f"update(): no sampled tokens for sequence {seq.seq_id}") from None
        emitted = [emitted] if isinstance(emitted, int) else emitted
        k = len(chunk.spec_token_ids)
        if not 1 <= len(emitted) <= k + 1 or emitted[:-1] != chunk.spec_token_ids[: len(emitted) - 1]:
            raise ValueError(f"update(): tokens {emitted} are not an accepted prefix of {chunk.spec_token_ids} + one")
        self.spec_stats.record(k, len(emitted) - 1)
        self.num_decode_tokens += chunk.num_new_tokens
        done = any(self._append_token(seq, token, now) for token in emitted)  # stops at the token that finishes
        # positions start .. start + m - 1 hold the last token and the m - 1 accepted proposals: their K/V stand
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.truncate(seq, seq.num_computed_tokens)
        if self.block_manager.enable_prefix_caching:
            self.block_manager.mark_computed(seq)
        return done

    # ---- bulk decode (the simulator's fast path) -------------------------------------------------------------
    def decode_steps_until_change(self) -> int:
        """How many next steps are the same pure-decode step over the same running sequences, the last included:
        zero unless no request waits (the static policy ignores them while its batch runs) and every running sequence
        decodes; else up to the first step that finishes a sequence by ``max_tokens`` (EOS ignored), capped where the
        free pool would run out of blocks (taking a free block is bookkeeping, not a scheduling decision)."""
        if (self.waiting and self.policy != "static") or not self.running or self._rejected:
            return 0
        if any(s.num_computed_tokens != len(s.prompt_token_ids) + len(s.output_token_ids) - 1 for s in self.running):
            return 0
        steps = max(0, min(s.sampling.max_tokens - len(s.output_token_ids) for s in self.running))
        free = self.block_manager.num_free_blocks
        if self._blocks_needed(steps) > free:  # the largest k < steps whose blocks fit (monotone in k)
            lo, hi = 0, steps - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self._blocks_needed(mid) <= free else (lo, mid - 1)
            steps = lo
        return steps

    def _blocks_needed(self, num_steps: int) -> int:
        """New blocks the running decodes take over ``num_steps`` steps (step j writes position computed + j - 1)."""
        bs = self.block_manager.block_size
        return sum(max(0, -(-(s.num_computed_tokens + num_steps) // bs) - len(s.block_table)) for s in self.running)

    def advance_decode_steps(self, end_times: list[float], token: int = 0) -> None:
        """Apply ``len(end_times)`` pure-decode steps to every running sequence at once, each sampling ``token``.

        Equivalent to that many ``schedule()`` + ``update(plan, {id: token}, end_times[j])`` rounds when fewer
        steps are asked than ``decode_steps_until_change()`` (so no step finishes a sequence, preempts or
        admits; the step that finishes one is left to ``schedule``/``update``). The simulator's fast path:
        O(running) work for the whole run instead of per step.
        """
        k = len(end_times)
        if k == 0:
            return
        window = self.decode_steps_until_change()
        if k >= window:
            raise ValueError(f"advance_decode_steps: {k} steps asked but only {window - 1} can be advanced in bulk")
        bm = self.block_manager
        tokens = [token] * k
        for seq in self.running:
            end = seq.num_computed_tokens + k
            if not bm.append_slots(seq, end):
                raise RuntimeError("advance_decode_steps: the pool ran out of blocks inside a checked window")
            seq.num_computed_tokens = end
            if seq.first_token_time is None:  # a chunked prefill that stopped one token short samples here
                seq.first_token_time = end_times[0]
            seq.output_token_ids.extend(tokens)
            seq.token_times.extend(end_times)
            if bm.enable_prefix_caching:
                bm.mark_computed(seq)
        self.num_steps += k
        self.num_decode_tokens += k * len(self.running)

    def release_held(self, seq_id: int) -> bool:
        """Free the blocks of a finished sequence kept by ``hold_finished`` (its KV has been sent); False when it is
        not held."""
        seq = self.held.pop(seq_id, None)
        if seq is not None:
            self.block_manager.free(seq)
        return seq is not None

    def admit_prefilled(self, seq: Sequence) -> bool:
        """Admit a request whose KV for all but its last token was computed elsewhere (prefill/decode
        disaggregation: the decode side receives the prompt's KV and the first token).

        Like an admission by ``schedule``: blocks for all its tokens (prefix-cache hits reused), keeping the
        watermark while something runs, within ``max_num_seqs``; then ``num_computed_tokens = num_tokens - 1``,
        so its next step is a decode. False, with nothing changed, when it does not fit now; RequestError when
        it never can.
        """
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence id {seq.seq_id} is already in the scheduler")
        self.check_request(seq)
        if len(self.running) >= self.config.max_num_seqs:
            return False
        bm = self.block_manager
        if not bm.allocate(seq, self._watermark_blocks if self.running else 0):
            return False
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_arrival_key)
        self._by_id[seq.seq_id] = seq
        if bm.enable_prefix_caching:
            bm.mark_computed(seq)
        return True
