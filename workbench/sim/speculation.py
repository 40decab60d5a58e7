"""Speculative decoding in the simulator: the engine's scheduler verifies proposals that a seeded coin accepts.

A replica with speculation on gives its ``Scheduler`` the ``proposer`` hook the engine gives it
(``workbench.engine.spec_decode.Speculator``): at each ``schedule()``, every running sequence that decodes next gets
``k`` proposed tokens (``SpeculativeConfig.num_speculative_tokens``; the scheduler cuts them to the token budget, to
``max_tokens`` and the context, and to the free blocks, as in the engine). The step is then priced as the engine runs
it: a verify is a ragged chunk of ``k + 1`` query tokens over the sequence's cached context, through the same
weights, with ``k + 1`` logit rows (``workbench.sim.stats.plan_stats``); the roofline prices that chunk (the KV read
once for its queries), the models fitted on this machine price it as the CPU engine runs it, a decode of ``k + 1``
rows (``StepStats.verifies_as_decodes``). Proposing is free for ``ngram`` and
``oracle``; a ``draft`` model's proposals cost what its engine spends, ``k`` forwards of one token for each
speculating sequence in turn (``DraftModelProposer``), priced by the draft's own cost model (``draft_time``).

Verification (``verify``) draws the accepted count position by position: proposal ``i`` (0-based) is accepted with
probability ``acceptance[i]`` if every one before it was, so with one ``alpha`` for every position a step emits
``(1 - alpha^(k+1)) / (1 - alpha)`` tokens on average (``workbench.engine.speculative.expected_tokens_per_step``).
The acceptance is the oracle's ``acceptance`` (``{"method": "oracle", "acceptance": 0.8, ...}``); the other methods
need it given (``acceptance``: one alpha, or the conditional acceptance of each position, e.g. from a measured run's
``per_position_acceptance``), since the simulator has no tokens to match. The coin is seeded per replica, so a run
is reproducible; ``stats`` (the scheduler's ``spec_stats``) counts what was accepted, as in the engine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as SequenceABC

from workbench.engine.scheduler import StepPlan
from workbench.engine.speculative import SpeculativeConfig
from workbench.errors import ConfigError
from workbench.request import Sequence
from workbench.sim.stats import CostModel, decode_stats

SIM_TOKEN = 0  # the token every simulated step samples, and proposes (EOS is ignored, as in the engine's replay)


def conditional_acceptance(per_position: SequenceABC[float | None]) -> list[float]:
    """The acceptance of each position given all before it were accepted, from the cumulative per-position
    acceptance of a run (``SpecStats.to_dict()["per_position_acceptance"]``: ``alpha^(i+1)`` for i.i.d. alpha);
    positions never reached or never accepted past end the list with 0."""
    out: list[float] = []
    before = 1.0
    for cumulative in per_position:
        if cumulative is None or before <= 0.0:
            out.append(0.0)
            before = 0.0
            continue
        out.append(min(1.0, cumulative / before))
        before = cumulative
    return out


def resolve_acceptance(config: SpeculativeConfig, acceptance: float | SequenceABC[float] | None = None) -> list[float]:
    """The acceptance of each of the ``k`` positions (given all before it were accepted): ``acceptance`` (one alpha
    for every position, or one per position, the last repeated past the list), else the oracle's own; a
    ``ConfigError`` for another method without one, or for a value outside [0, 1]."""
    if acceptance is None:
        if config.method != "oracle":
            raise ConfigError(
                f"the simulator draws acceptances: method {config.method!r} needs an acceptance rate (one alpha "
                "in [0, 1], or one per position, e.g. a measured run's; --spec-acceptance)"
            )
        acceptance = config.acceptance
    if isinstance(acceptance, (int, float)) and not isinstance(acceptance, bool):
        alphas = [float(acceptance)]
    elif isinstance(acceptance, (list, tuple)):
        alphas = list(acceptance)
    else:
        alphas = []
    if not alphas or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= a <= 1.0
                             for a in alphas):  # fmt: skip
        raise ConfigError(f"acceptance must be a number in [0, 1] or a list of them, got {acceptance!r}")
    k = config.num_speculative_tokens
    return [float(a) for a in (alphas + [alphas[-1]] * k)[:k]]


class SimSpeculator:
    """The proposer and verifier of one simulated replica (module docstring); ``acceptance`` as
    ``resolve_acceptance``; ``draft_cost``: the draft model's cost model (needed by method 'draft')."""

    def __init__(
        self,
        config: SpeculativeConfig | dict | str,
        acceptance: float | SequenceABC[float] | None = None,
        seed: int = 0,
        draft_cost: CostModel | None = None,
    ) -> None:
        config = SpeculativeConfig.parse(config)
        if config is None:
            raise ConfigError("SimSpeculator needs a speculative config")
        self.config = config
        self.k = config.num_speculative_tokens
        self.acceptance = resolve_acceptance(config, acceptance)
        if config.method == "draft" and draft_cost is None:
            raise ConfigError("the simulator prices a draft model's proposals with the draft's own cost model: give "
                              "draft_cost (e.g. the roofline of the draft's config on the same hardware)")  # fmt: skip
        self.draft_cost = draft_cost if config.method == "draft" else None
        self.rng = random.Random(seed)

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """``k`` proposed tokens for each running sequence that decodes next (the scheduler's ``proposer`` hook)."""
        k = self.k
        return {s.seq_id: [SIM_TOKEN] * k for s in running if s.num_computed_tokens == s.num_tokens - 1}

    def verify(self, plan: StepPlan) -> dict[int, int | list[int]]:
        """The tokens of a computed step for ``Scheduler.update``: per verify, its accepted proposals (drawn
        position by position) and the target's token; one token for every other chunk that samples."""
        out: dict[int, int | list[int]] = {}
        rng, alphas = self.rng.random, self.acceptance
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            draft = chunk.spec_token_ids
            if not draft:
                out[chunk.seq.seq_id] = SIM_TOKEN
                continue
            accepted = 0
            while accepted < len(draft) and rng() < alphas[accepted]:
                accepted += 1
            out[chunk.seq.seq_id] = draft[:accepted] + [SIM_TOKEN]
        return out

    def draft_time(self, plan: StepPlan) -> float:
        """Seconds the draft model spends proposing this step's verifies before it (0 without a draft model): per
        speculating sequence, ``k`` one-token forwards at its growing context, one sequence at a time."""
        cost = self.draft_cost
        if cost is None:
            return 0.0
        total = 0.0
        for chunk in plan.chunks:
            context = chunk.start + 1  # the draft's first forward reads the context the target's verify starts at
            for j in range(len(chunk.spec_token_ids)):
                total += cost.step_time(decode_stats(1, context + j))
        return total
