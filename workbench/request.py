"""The request vocabulary, below everything that uses it: ``SamplingParams``, the ``Sequence`` state machine,
the ``RequestRecord`` of a finished request, and a workload's ``Request`` (what arrives, and when).

The block manager, scheduler, model runner, sampler, simulator, workloads and metrics all speak these types; this
module imports only ``workbench.errors``.

A ``Sequence`` is one request in flight. Its life: WAITING (queued, no KV blocks) -> RUNNING (holds KV
blocks; each step computes some of its tokens) -> FINISHED (stop token, ``max_tokens``, the model's context,
rejection or abort). Preemption by recomputation sends a RUNNING sequence back to WAITING with
``num_computed_tokens = 0``; it keeps its output tokens and is later re-prefilled over all of them.

Token accounting (the contract between scheduler, model runner and sampler):
- ``num_computed_tokens``: positions ``[0, num_computed_tokens)`` have their K/V in the cache;
- a step schedules ``n`` new tokens starting at position ``num_computed_tokens``; when
  ``num_computed_tokens + n == num_tokens`` the step's last logits sample one new token for the sequence
  (the end of a prefill, or a decode step, which is ``n == 1`` at ``num_tokens - 1``);
- ``num_cached_tokens``: prompt tokens taken from the prefix cache at the last admission (not computed).

No torch here: the same objects drive the real engine and the simulator.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from workbench.errors import RequestError


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


FINISH_REASONS = ("length", "stop", "rejected", "abort")
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64) (and negatives, which we refuse)


@dataclass
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off.

    ``seed`` makes a non-greedy request reproducible on its own (a per-request generator in the sampler).
    ``ignore_eos`` keeps generating through end-of-sequence tokens until ``max_tokens`` (benchmarks use it).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise RequestError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise RequestError(f"seed must be in [0, 2**64) (an unsigned 64-bit integer), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


# ---- the one request ingest ----------------------------------------------------------------------------------
# Every entry point (the server's protocol, Engine.add_request behind generate/replay/bench, the scheduler's
# admission behind the simulator, trace rows) applies this one rule, vLLM's: a request whose prompt + max_tokens
# exceeds max_model_len is rejected (never silently capped); an unset max_tokens takes the room the prompt leaves.


def default_max_tokens(num_prompt_tokens: int, max_model_len: int) -> int:
    """vLLM's ``max_tokens`` when a request leaves it unset (chat): the room the prompt leaves in the context, at
    least 1 (a prompt that fills the context is then refused by ``validate_request``)."""
    return max(1, max_model_len - num_prompt_tokens)


def validate_request(
    prompt: list[int] | tuple[int, ...] | int, max_tokens: int, max_model_len: int, vocab_size: int | None = None
) -> None:
    """Raise RequestError (with ``param``) unless a request of ``prompt`` (token ids, or a length when the ids are
    not known yet, as for a trace row) and ``max_tokens`` can be served by a model of ``max_model_len`` positions
    and ``vocab_size`` tokens: a non-empty prompt, every id in the vocabulary, prompt + max_tokens within the
    context. ``max_tokens`` 0 checks the prompt alone (a prefill into a cache of ``max_model_len`` positions, as
    ``Transformer.prefill`` does). The sampling parameters themselves are checked by ``SamplingParams``."""
    num_prompt_tokens = prompt if isinstance(prompt, int) else len(prompt)
    if num_prompt_tokens == 0:
        raise RequestError("empty prompt: at least one token id is needed", param="prompt")
    if vocab_size is not None and not isinstance(prompt, int):
        bad = [t for t in prompt if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size)]
        if bad:
            raise RequestError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})", param="prompt")
    if num_prompt_tokens + max_tokens > max_model_len:
        if max_tokens == 0:  # a prefill alone (the static loop's cache), no output asked for yet
            raise RequestError(
                f"this model's maximum context length is {max_model_len} tokens; the prompt alone has "
                f"{num_prompt_tokens}: shorten the prompt, or use a larger max_model_len",
                param="prompt",
            )
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt_tokens} and "
            f"max_tokens asks for {max_tokens} more ({num_prompt_tokens + max_tokens} in all): shorten the prompt, "
            "lower max_tokens, or serve with a larger max_model_len",
            param="max_tokens" if num_prompt_tokens < max_model_len else "prompt",
        )


def fits_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    """True when a request of these lengths passes ``validate_request`` (a disaggregated prefill serves only the
    first token of such a request; it hands any other to the engine whole, to be rejected with the reason)."""
    try:
        validate_request(num_prompt_tokens, max_tokens, max_model_len)
    except RequestError:
        return False
    return True


class Sequence:
    """One request: its tokens, sampling parameters, KV block table, progress counters and timestamps (s)."""

    __slots__ = (
        "seq_id",
        "prompt_token_ids",
        "output_token_ids",
        "sampling",
        "arrival_time",
        "eos_token_ids",
        "status",
        "finish_reason",
        "reject_reason",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_table",
        "block_hashes",
        "num_committed_blocks",
        "num_preemptions",
        "first_scheduled_time",
        "first_token_time",
        "token_times",
        "finish_time",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        arrival_time: float = 0.0,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.arrival_time = float(arrival_time)
        self.eos_token_ids: tuple[int, ...] = () if self.sampling.ignore_eos else tuple(eos_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.reject_reason: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # chained prefix-cache hashes of this sequence's full blocks (filled by the BlockManager, never stale:
        # tokens are only appended, so the hash of a full block never changes)
        self.block_hashes: list[int] = []
        self.num_committed_blocks = 0  # leading full blocks already offered to the prefix cache
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the outputs so far (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_at(self, position: int) -> int:
        """The token at ``position`` of prompt + outputs, without building the joined list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + outputs."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    # ---- state -------------------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while more than the last token is still to be computed (a prompt, or a recomputation)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, finish_reason={self.finish_reason})"
        )


@dataclass
class RequestRecord:
    """The timeline of one finished request, as the metrics need it (from a Sequence or a simulator)."""

    request_id: int
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_time: float | None
    finish_time: float | None
    token_times: list[float] = field(default_factory=list)
    first_scheduled_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestRecord:
        return cls(
            request_id=seq.seq_id,
            arrival_time=seq.arrival_time,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            token_times=list(seq.token_times),
            first_scheduled_time=seq.first_scheduled_time,
            finish_reason=seq.finish_reason,
            num_preemptions=seq.num_preemptions,
        )


@dataclass
class Request:
    """One request of a workload. ``hash_ids[i]`` identifies prompt tokens ``[512 i, 512 (i + 1))``."""

    request_id: int
    arrival_time_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    hash_ids: list[int] | None = None
