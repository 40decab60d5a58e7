"""Speculative decoding's torch-free half: its config, the n-gram proposer, the acceptance counters and the
expected gain.

A speculating decode step (Leviathan et al., ICML 2023; Chen et al., 2023) runs the sequence's last token and ``k``
proposed tokens as ``k + 1`` query tokens over the cached context, in the engine's ragged step; verification
(``workbench.engine.spec_decode``) keeps the longest accepted prefix plus one token of the target's own, so a step
emits 1 to ``k + 1`` tokens. The proposers: ``ngram`` (vLLM's prompt lookup, ``NgramProposer`` here), ``draft`` (a
smaller checkpoint with the same vocabulary) and ``oracle`` (experiments: the target's own greedy continuation with
a dialled acceptance rate), the last two in ``workbench.engine.spec_decode``.

With i.i.d. per-token acceptance ``alpha``, a step emits ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens on average
(Leviathan et al., eq. 1): ``expected_tokens_per_step``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from workbench.config import check_positive_ints
from workbench.errors import ConfigError

SPEC_METHODS = ("ngram", "draft", "oracle")
_METHOD_ALIASES = {"draft_model": "draft", "ngram": "ngram", "draft": "draft", "oracle": "oracle"}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither prompt_lookup_min nor prompt_lookup_max is given


@dataclass
class SpeculativeConfig:
    """``--speculative-config``, in vLLM's shape, validated; errors name the field and the allowed values.

    ``method``: 'ngram', 'draft' (vLLM's 'draft_model'; implied by ``model``) or 'oracle'. ``num_speculative_tokens``
    (k): tokens proposed per step. ngram: ``prompt_lookup_min`` / ``prompt_lookup_max`` (the n-gram lengths tried,
    longest first; one given sets the other, neither gives vLLM's 5). draft: ``model``, a checkpoint directory or
    preset with the target's vocabulary. oracle: ``acceptance`` (alpha in [0, 1]) and ``seed`` of its coin flips.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    acceptance: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method is None:
            if self.model is None:
                raise ConfigError(
                    "speculative config: give 'method' (one of ngram, draft, oracle) or 'model' (a draft checkpoint)"
                )
            self.method = "draft"
        if self.method not in _METHOD_ALIASES:
            allowed = ", ".join(SPEC_METHODS)
            raise ConfigError(f"speculative config: method must be one of {allowed}, got {self.method!r}")
        self.method = _METHOD_ALIASES[self.method]
        check_positive_ints(self, ("num_speculative_tokens",), where="speculative config: ")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            self.prompt_lookup_min, self.prompt_lookup_max = hi if lo is None else lo, lo if hi is None else hi
            check_positive_ints(self, ("prompt_lookup_min", "prompt_lookup_max"), where="speculative config: ")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo > hi:
                raise ConfigError(f"speculative config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ConfigError(f"speculative config: prompt_lookup_min/max are for method 'ngram', not {self.method!r}")
        if self.method == "draft":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError("speculative config: method 'draft' needs 'model', a checkpoint directory or preset")
        elif self.model is not None:
            raise ConfigError(f"speculative config: 'model' is for method 'draft', not {self.method!r}")
        if self.method == "oracle":
            a = self.acceptance
            if not isinstance(a, (int, float)) or isinstance(a, bool) or not 0.0 <= a <= 1.0:
                raise ConfigError(f"speculative config: method 'oracle' needs 'acceptance' in [0, 1], got {a!r}")
            self.acceptance = float(a)
        elif self.acceptance is not None:
            raise ConfigError(f"speculative config: 'acceptance' is for method 'oracle', not {self.method!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"speculative config: seed must be an integer, got {self.seed!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict or a JSON object text (``--speculative-config``); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--speculative-config is not valid JSON ({exc}); e.g. "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None  # fmt: skip
        if not isinstance(value, dict):
            raise ConfigError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative config: unknown key(s) {unknown}; allowed: {', '.join(sorted(known))}")
        return cls(**value)


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens a verify step emits on average when each proposed token is accepted with probability ``alpha``
    independently: ``sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha)`` (``k + 1`` at alpha = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ConfigError(f"k must be >= 0, got {k}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, decode_s: float, verify_s: float, draft_step_s: float = 0.0) -> float:
    """Decode throughput with speculation over without: a verify step (``verify_s``, e.g.
    ``RooflineModel.verify(...).time_s``) after ``k`` draft steps of ``draft_step_s`` each emits
    ``expected_tokens_per_step(alpha, k)`` tokens, where a plain decode step (``decode_s``) emits one."""
    if decode_s <= 0 or verify_s <= 0 or draft_step_s < 0:
        raise ConfigError("decode_s and verify_s must be > 0 and draft_step_s >= 0")
    return expected_tokens_per_step(alpha, k) * decode_s / (verify_s + k * draft_step_s)


@dataclass
class SpecStats:
    """Acceptance counters of a run: per verified proposal, how many of its tokens were accepted, by position."""

    num_drafts: int = 0  # proposals verified (a sequence's verify step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)  # proposals with a token at position i
    accepted_per_position: list[int] = field(default_factory=list)  # ... whose token at position i was accepted

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One verified proposal of ``num_proposed`` tokens of which the first ``num_accepted`` were accepted."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} proposed tokens")
        grow = num_proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_proposed):
            self.proposed_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def to_dict(self) -> dict[str, Any]:
        """The run JSON's ``speculative`` entry: counts, ``acceptance_rate`` (accepted / proposed tokens),
        ``mean_accepted_length`` (accepted tokens per verified proposal; vLLM's mean acceptance length is this + 1,
        the target's own token), ``per_position_acceptance`` (at each position, the proposals accepted up to and
        including it over those that reached it: cumulative, ``alpha^(i+1)`` for i.i.d. acceptance alpha) and
        ``num_accepted_tokens_per_pos`` (the counts: proposals accepted through each position; vLLM's counter of that
        name, whose rate it reports over ``num_drafts``)."""
        d, t, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        pairs = zip(self.accepted_per_position, self.proposed_per_position)
        return {
            "num_drafts": d,
            "num_draft_tokens": t,
            "num_accepted_tokens": a,
            "acceptance_rate": a / t if t else None,
            "mean_accepted_length": a / d if d else None,
            "per_position_acceptance": [acc / prop if prop else None for acc, prop in pairs],
            "num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }


def merged_spec_stats(parts: list[SpecStats]) -> SpecStats:
    """One ``SpecStats`` counting every proposal of ``parts`` (e.g. the replicas of a simulation)."""
    return SpecStats(
        sum(p.num_drafts for p in parts),
        sum(p.num_draft_tokens for p in parts),
        sum(p.num_accepted_tokens for p in parts),
        [sum(c) for c in zip_longest(*(p.proposed_per_position for p in parts), fillvalue=0)],
        [sum(c) for c in zip_longest(*(p.accepted_per_position for p in parts), fillvalue=0)],
    )


class NgramProposer:
    """Prompt lookup (vLLM's n-gram proposer): match the last ``n`` tokens earlier in prompt + outputs.

    For ``n`` from ``max_n`` down to ``min_n``, the first earlier occurrence of the sequence's last ``n`` tokens
    (as vLLM, the earliest) gives the proposal: the up to ``k`` tokens that followed it. No match: no proposal.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching earlier n-gram of ``token_ids`` (a new list)."""
        length = len(token_ids)
        if k < 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n :]
            first = suffix[0]
            for i in range(length - n):  # occurrences ending before the suffix itself
                if token_ids[i] == first and token_ids[i : i + n] == suffix:
                    return token_ids[i + n : i + n + k]
        return []
