"""What a step computes, as the cost models see it (``StepStats``), and the ``CostModel`` interface that prices it.

A step is reduced to ``StepStats``: prefill tokens, prefill sequences, the (query, key) pairs and context tokens
of the prefill chunks, decode sequences and the context tokens the decodes read (a decode at context length L
attends to L keys, the new one included, as in ``workbench.roofline``). A ``CostModel`` turns that into a
duration and owns the clock's advance across a step:

- ``start_time(now)``: when the next step starts if the replica is free at ``now`` (``now + host_gap_s``: the
  host work between two steps, such as the engine's update and admission);
- ``end_time(start, stats)``: when a step that starts at ``start`` ends (``start + step_time(stats)``);
- ``decode_run(now, num_seqs, context, max_steps, before)``: start and end times of a run of identical
  pure-decode steps (the context read grows by ``num_seqs`` a step), for the simulator's bulk fast path.

The models, one per file: ``roofline_cost``, ``profiled`` (fitted by ``fit``), ``trace_cost``; the factory is
``workbench.sim.costmodel.make_cost_model``.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import TYPE_CHECKING, Any, NamedTuple

from workbench.errors import ConfigError
from workbench.roofline import attended_pairs

if TYPE_CHECKING:
    from workbench.engine.scheduler import StepPlan

FEATURES = ("const", "prefill_tokens", "prefill_seqs", "prefill_pairs", "decode_seqs", "decode_context",
            "decode_looped_seqs")  # fmt: skip


class StepStats(NamedTuple):
    """What a step computes, as the cost models see it."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_pairs: int = 0  # causal (query, key) pairs of the prefill chunks
    prefill_context: int = 0  # cached + new tokens whose K/V the prefill chunks read
    decode_seqs: int = 0
    decode_context: int = 0  # sum of the decodes' context lengths (keys read, the new one included)
    decode_max_context: int = 0  # the longest decode context (0: unknown)
    # speculative decoding: proposed tokens the step verifies. A verify (a decode with k proposals) is a ragged
    # chunk of k + 1 tokens over the cached context (counted in the prefill_* sums, as the roofline prices it), with
    # logits at all k + 1 positions: these k extra logit rows
    spec_tokens: int = 0
    verify_seqs: int = 0  # verify chunks (each also counted in prefill_seqs)
    verify_pairs: int = 0  # their causal (query, key) pairs (in prefill_pairs): row j at position p + j reads p + j + 1
    verify_context: int = 0  # their cached + new tokens (in prefill_context)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def verifies_as_decodes(self) -> StepStats:
        """This step with every verify's ``k + 1`` query rows counted as decodes (row ``j`` of a verify at ``p``
        cached tokens reads ``p + j + 1`` keys; every row has logits), the rest unchanged: a verify's cost on the
        CPU engine, which runs it as ``k + 1`` more rows through the dense layers and the LM head, attended row by
        row through the paged decode op (``workbench.model.cpu_backend``), i.e. as a decode batch of ``k + 1``
        rows, not as a prefill chunk (whose fitted per-chunk cost is the ragged SDPA path's). The models fitted on
        this machine's steps (profiled, op profile) price a step in this view; the roofline keeps the chunk view
        (the KV read once for the ``k + 1`` queries, as a GPU kernel reads it)."""
        vs = self.verify_seqs
        if not vs:
            return self
        rows = vs + self.spec_tokens
        return self._replace(
            prefill_tokens=self.prefill_tokens - rows,
            prefill_seqs=self.prefill_seqs - vs,
            prefill_pairs=self.prefill_pairs - self.verify_pairs,
            prefill_context=self.prefill_context - self.verify_context,
            decode_seqs=self.decode_seqs + rows,
            decode_context=self.decode_context + self.verify_pairs,
            spec_tokens=0, verify_seqs=0, verify_pairs=0, verify_context=0,
        )  # fmt: skip

    def looped_decodes(self, batched_decode: tuple[int, int] | None) -> int:
        """Decode sequences that attend one at a time: all of them unless the step is decode-only with at least
        ``min_seqs`` sequences and ``num_seqs * longest context <= max_key_slots`` (``batched_decode``, the
        engine's rule for one padded gather); 0 when ``batched_decode`` is None (the distinction is not modelled)."""
        if batched_decode is None or not self.decode_seqs:
            return 0
        min_seqs, max_key_slots = batched_decode
        ds = self.decode_seqs
        batched = not self.prefill_tokens and ds >= min_seqs and 0 < ds * self.decode_max_context <= max_key_slots
        return 0 if batched else ds

    def features(self, batched_decode: tuple[int, int] | None = None) -> tuple[float, ...]:
        """The ``FEATURES`` vector of the profiled model."""
        return (1.0, self.prefill_tokens, self.prefill_seqs, self.prefill_pairs, self.decode_seqs, self.decode_context,
                self.looped_decodes(batched_decode))  # fmt: skip


def plan_stats(plan: StepPlan) -> StepStats:
    """``StepStats`` of a scheduler ``StepPlan`` (chunk ``n`` new tokens after ``start`` computed ones). A
    speculative decode (``spec_token_ids``: the last token and ``k`` proposals) counts as the engine runs it: a
    ragged chunk of ``k + 1`` tokens over its cached context (``workbench.engine.runner``), with ``k`` more
    logit rows (``spec_tokens``), and its share of those sums in the ``verify_*`` fields (``verifies_as_decodes``);
    its longest context counts in ``decode_max_context``, which the decode view reads."""
    pt = ps = pp = pc = ds = dc = dm = st = vs = vp = vc = 0
    for c in plan.chunks:
        n, p = c.num_new_tokens, c.start
        if c.is_prefill or c.spec_token_ids:
            pairs = attended_pairs(n, p)
            pt += n
            ps += 1
            pp += pairs
            pc += n + p
            if c.spec_token_ids:
                st += len(c.spec_token_ids)
                vs += 1
                vp += pairs
                vc += n + p
                dm = max(dm, p + n)
        else:
            ds += n
            dc += p + n
            dm = max(dm, p + n)
    return StepStats(pt, ps, pp, pc, ds, dc, dm, st, vs, vp, vc)


def decode_stats(num_seqs: int, context: int) -> StepStats:
    """A pure-decode step of ``num_seqs`` sequences reading ``context`` tokens in all."""
    return StepStats(0, 0, 0, 0, num_seqs, context)


class CostModel:
    """Base class: subclasses give ``step_time``; ``host_gap_s`` is the idle host time between two steps."""

    name = "cost"
    host_gap_s: float = 0.0
    # the uniform in [0, 1) behind the last step's noise draw (its rank among the model's residuals), None when
    # the model draws none: the simulator draws a request's handoff correlated with its prefill step's (SimConfig)
    last_noise_u: float | None = None

    def step_time(self, stats: StepStats) -> float:
        """Seconds the device spends on a step."""
        raise NotImplementedError

    def start_time(self, now: float) -> float:
        """When the next step starts if the replica became free at ``now``."""
        return now + self.host_gap_s

    def end_time(self, start: float, stats: StepStats) -> float:
        """When a step that starts at ``start`` ends."""
        return start + self.step_time(stats)

    def decode_run(
        self, now: float, num_seqs: int, context: int, max_steps: int, before: float
    ) -> tuple[list[float], list[float]]:
        """(starts, ends) of up to ``max_steps`` consecutive pure-decode steps, the first reading ``context``
        tokens, each starting strictly before ``before`` (a step starting at an arrival must admit it first)."""
        starts: list[float] = []
        ends: list[float] = []
        t = now
        for _ in range(max_steps):
            s = self.start_time(t)
            if s >= before:
                break
            t = self.end_time(s, decode_stats(num_seqs, context))
            starts.append(s)
            ends.append(t)
            context += num_seqs
        return starts, ends

    def describe(self) -> dict[str, Any]:
        """A JSON-able description (name and parameters) for reports."""
        return {"name": self.name, "host_gap_s": self.host_gap_s}


def check_gap(seconds: float, name: str = "host_gap_s") -> None:
    """ConfigError naming ``name`` unless ``seconds`` is a finite number >= 0."""
    if not isinstance(seconds, (int, float)) or not (seconds >= 0 and math.isfinite(seconds)):
        raise ConfigError(f"{name} must be a number >= 0, got {seconds!r}")


def correlated_uniform(u: float, rank_correlation: float, rng: random.Random) -> float:
    """A uniform draw in (0, 1) whose Spearman rank correlation with the uniform ``u`` is ``rank_correlation``: a
    Gaussian copula, whose normal scores correlate with Pearson's ``2 sin(pi rho_s / 6)`` (the bivariate normal's
    relation between the two coefficients, Kruskal 1958). 0: independent of ``u``; 1: ``u`` itself."""
    rho = rank_correlation if abs(rank_correlation) == 1.0 else 2.0 * math.sin(math.pi * rank_correlation / 6.0)
    normal = statistics.NormalDist()
    z = normal.inv_cdf(min(max(u, 1e-12), 1.0 - 1e-12))
    return normal.cdf(rho * z + math.sqrt(max(1.0 - rho * rho, 0.0)) * rng.gauss(0.0, 1.0))


def rank_correlation(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation of two equally long samples (ties get their average rank); 0.0 when either
    has no spread or there are fewer than three pairs."""
    if len(x) != len(y):
        raise ValueError(f"rank_correlation: {len(x)} values against {len(y)}")
    if len(x) < 3:
        return 0.0
    rx, ry = _ranks(x), _ranks(y)
    if len(set(rx)) < 2 or len(set(ry)) < 2:
        return 0.0
    return statistics.correlation(rx, ry)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks
