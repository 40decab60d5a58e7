"""Serving metrics: per-request latencies, their aggregates, goodput, and a per-step log.

Definitions (per request; times in seconds, from the request's timeline):

- ``ttft_s``  time to first token  = first_token_time - arrival_time
- ``e2el_s``  end-to-end latency   = finish_time - arrival_time
- ``tpot_s``  time per output token, after the first = (e2el_s - ttft_s) / (num_output_tokens - 1), defined
  only for requests with at least two output tokens (the others are left out of the TPOT statistics)
- ``itl_s``   inter-token latencies: the gaps between successive output tokens of a request; the ITL
  statistics pool the gaps of all requests

These follow vLLM's ``benchmarks/benchmark_serving.py`` (``calculate_metrics``), with these differences:
times are in seconds (vLLM reports milliseconds); the clock starts at the request's arrival in the engine or
the simulator (vLLM's at the client sending it); output lengths are counted tokens (vLLM re-tokenises the
returned text) and every token is its own ITL entry (vLLM has one per streamed chunk).

Aggregates, over the completed requests (those that produced a token and finished; rejected and aborted
requests are not completed): ``mean``, ``median``, ``p90``, ``p95``, ``p99`` (numpy's linear-interpolation
percentiles, as vLLM); an empty sample gives 0.0 like vLLM. Throughputs divide by ``duration_s``:
``request_throughput`` (completed requests/s), ``output_throughput`` (output tokens/s) and
``total_token_throughput`` ((prompt + output) tokens/s). ``goodput`` is vLLM's: completed requests per second
that meet *every* SLO given (``ttft_s <= slo_ttft_s``, ``tpot_s <= slo_tpot_s``, ``e2el_s <= slo_e2el_s``; a
request with one output token meets any TPOT SLO); with no SLO given, goodput and ``slo_attainment`` are null.
``slo_attainment`` is the percentage of *all* requests (rejected ones count as misses) meeting every SLO.

The JSON layout (``summarize``) is the contract of ``workbench replay`` and ``workbench simulate``.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.config import check_positive_ints
from workbench.request import RequestRecord, Sequence

if TYPE_CHECKING:
    import pandas as pd

    from workbench.engine.scheduler import StepPlan

STAT_KEYS = ("mean", "median", "p90", "p95", "p99")


def stats(values: Any) -> dict[str, float]:
    """mean, median, p90, p95, p99 of ``values`` (a list or array; 0.0 each when empty, as vLLM)."""
    if len(values) == 0:
        return {k: 0.0 for k in STAT_KEYS}
    arr = np.asarray(values, dtype=np.float64)
    return dict(zip(STAT_KEYS, map(float, (arr.mean(), np.median(arr), *np.percentile(arr, [90, 95, 99])))))


def counted_stats(values: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """``stats`` of the sample holding each of the sorted, distinct ``values`` ``counts`` times, without expanding
    it: the median and numpy's linear-interpolation percentiles are computed as numpy computes them on the expanded
    array (the same order statistics, the same interpolation formula); the mean is ``sum(value * count) / n``,
    which may differ from numpy's pairwise sum of the expanded array in the last bits."""
    n = int(counts.sum())
    if n == 0:
        return {k: 0.0 for k in STAT_KEYS}
    ends = np.cumsum(counts)

    def at(index: np.ndarray) -> np.ndarray:  # the expanded sorted sample's elements at these indexes
        return values[np.searchsorted(ends, index, side="right")]

    q = np.true_divide(np.array([90.0, 95.0, 99.0]), 100)
    virtual = (n - 1) * q  # numpy's virtual index of the linear method
    previous = np.floor(virtual)
    above = virtual >= n - 1
    low = np.where(above, n - 1, previous).astype(np.int64)
    high = np.where(above, n - 1, previous + 1).astype(np.int64)
    gamma = virtual - previous
    a, b = at(low), at(high)
    diff = b - a
    pct = np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)  # numpy's _lerp
    middle = at(np.array([(n - 1) // 2, n // 2]))
    median = middle[0] if n % 2 else (middle[0] + middle[1]) / 2
    return dict(zip(STAT_KEYS, map(float, (np.dot(values, counts.astype(np.float64)) / n, median, *pct))))


def is_completed(rec: RequestRecord) -> bool:
    return (
        rec.finish_reason not in ("rejected", "abort")
        and rec.first_token_time is not None
        and rec.finish_time is not None
        and rec.num_output_tokens > 0
    )


def request_latencies(rec: RequestRecord) -> dict[str, Any]:
    """``ttft_s``, ``tpot_s`` (None for a single output token) and ``e2el_s`` of a completed request."""
    ttft = rec.first_token_time - rec.arrival_time  # type: ignore[operator]
    e2el = rec.finish_time - rec.arrival_time  # type: ignore[operator]
    tpot = (e2el - ttft) / (rec.num_output_tokens - 1) if rec.num_output_tokens > 1 else None
    return {"ttft_s": ttft, "tpot_s": tpot, "e2el_s": e2el}


class ServingStats:
    """The streaming form of ``summarize`` (and how it computes): finished requests are added one at a time, in any
    order, each with its position in the workload, and only what the summary needs is kept: TTFT, TPOT and E2EL of
    each completed request (three float64 and a position) and the inter-token latencies as a count per distinct
    value (the gaps of requests decoded in the same steps are equal, so a simulator's run of many requests keeps a
    short table). Token lists are never held: memory grows by 32 bytes per completed request, not per token."""

    ITL_BUFFER = 1 << 20  # gaps buffered before they are folded into the value -> count table

    def __init__(self) -> None:
        self.num_requests = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # over the completed requests
        self.num_output_tokens = 0
        self.first_arrival = math.inf  # over every request added
        self.last_finish = -math.inf  # over the completed requests
        self._position = array("q")
        self._ttft = array("d")
        self._tpot = array("d")  # NaN for a request with one output token
        self._e2el = array("d")
        self._gaps = array("d")
        self._itl_values = np.empty(0, dtype=np.float64)
        self._itl_counts = np.empty(0, dtype=np.int64)

    @property
    def num_completed(self) -> int:
        return len(self._ttft)

    def add(self, rec: Sequence | RequestRecord, position: int | None = None) -> None:
        """Count one finished request (a ``Sequence`` or a ``RequestRecord``); ``position`` is its place in the
        workload (default: the order of the calls), which orders the samples as ``summarize`` orders them."""
        position = self.num_requests if position is None else position
        self.num_requests += 1
        self.num_preemptions += rec.num_preemptions
        self.first_arrival = min(self.first_arrival, rec.arrival_time)
        if not is_completed(rec):  # type: ignore[arg-type]
            return
        lat = request_latencies(rec)  # type: ignore[arg-type]
        self._position.append(position)
        self._ttft.append(lat["ttft_s"])
        self._tpot.append(math.nan if lat["tpot_s"] is None else lat["tpot_s"])
        self._e2el.append(lat["e2el_s"])
        self.num_output_tokens += rec.num_output_tokens
        self.num_prompt_tokens += rec.num_prompt_tokens
        self.last_finish = max(self.last_finish, rec.finish_time)  # type: ignore[type-var]
        times = rec.token_times
        if len(times) > 1:
            self._gaps.extend(np.diff(np.asarray(times, dtype=np.float64)))
            if len(self._gaps) >= self.ITL_BUFFER:
                self._fold_gaps()

    def _fold_gaps(self) -> None:
        values = np.concatenate([self._itl_values, np.frombuffer(self._gaps, dtype=np.float64)])
        counts = np.concatenate([self._itl_counts, np.ones(len(self._gaps), dtype=np.int64)])
        self._itl_values, inverse = np.unique(values, return_inverse=True)
        self._itl_counts = np.bincount(inverse.ravel(), weights=counts, minlength=len(self._itl_values)).astype(
            np.int64
        )
        self._gaps = array("d")

    def summary(
        self,
        duration_s: float | None = None,
        num_preemptions: int | None = None,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        slo_e2el_s: float | None = None,
    ) -> dict[str, Any]:
        """The contract JSON object of ``replay``/``simulate`` (see ``summarize``)."""
        self._fold_gaps()
        order = np.argsort(np.frombuffer(self._position, dtype=np.int64), kind="stable")
        ttft, tpot, e2el = (np.frombuffer(a, dtype=np.float64)[order] for a in (self._ttft, self._tpot, self._e2el))
        done = len(ttft)
        if duration_s is None:
            duration_s = self.last_finish - self.first_arrival if done else 0.0
        if num_preemptions is None:
            num_preemptions = self.num_preemptions
        good_mask = np.ones(done, dtype=bool)
        for values, slo in ((ttft, slo_ttft_s), (tpot, slo_tpot_s), (e2el, slo_e2el_s)):
            if slo is not None:
                good_mask &= ~(values > slo)  # a NaN TPOT (one output token) meets any TPOT SLO
        good = int(good_mask.sum())
        has_slo = any(x is not None for x in (slo_ttft_s, slo_tpot_s, slo_e2el_s))
        records = self.num_requests

        def per_s(x: float) -> float:
            return x / duration_s if duration_s and duration_s > 0 else 0.0

        metrics: dict[str, Any] = {
            "ttft_s": stats(ttft),
            "tpot_s": stats(tpot[~np.isnan(tpot)]),
            "itl_s": counted_stats(self._itl_values, self._itl_counts),
            "e2el_s": stats(e2el),
            "request_throughput": per_s(done),
            "output_throughput": per_s(self.num_output_tokens),
            "total_token_throughput": per_s(self.num_prompt_tokens + self.num_output_tokens),
            # without any SLO there is nothing to attain: null, not "100% within SLOs"
            "goodput": per_s(good) if has_slo else None,
            "slo_attainment": (100.0 * good / records if records else 0.0) if has_slo else None,
            "slos": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s, "e2el_s": slo_e2el_s},
        }
        return {
            "num_requests": records,
            "num_finished": done,
            "num_preemptions": int(num_preemptions),
            "duration_s": float(duration_s),
            "metrics": metrics,
        }


def summarize(
    requests: list[Sequence] | list[RequestRecord],
    duration_s: float | None = None,
    num_preemptions: int | None = None,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    slo_e2el_s: float | None = None,
) -> dict[str, Any]:
    """The contract JSON object of ``replay``/``simulate`` (the module docstring defines its metrics), computed by
    ``ServingStats``: ``num_requests``, ``num_finished``, ``num_preemptions`` (default: the sum over the requests),
    ``duration_s`` (default: last finish - first arrival) and ``metrics`` (with the ``slos`` used)."""
    acc = ServingStats()
    for r in requests:
        acc.add(r)
    return acc.summary(duration_s, num_preemptions, slo_ttft_s, slo_tpot_s, slo_e2el_s)


def requests_to_dataframe(requests: list[Sequence] | list[RequestRecord]) -> pd.DataFrame:
    """One row per request: ids, lengths, timestamps and derived latencies (``RequestRecord``'s fields, also for a
    ``RequestResult``; pandas imported lazily)."""
    import pandas as pd

    rows = []
    for item in requests:
        rec = RequestRecord.from_sequence(item) if isinstance(item, Sequence) else item
        row = {f.name: getattr(rec, f.name) for f in fields(RequestRecord) if f.name != "token_times"}
        if is_completed(rec):
            row.update(request_latencies(rec))
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class StepRecord:
    """One engine step: when it ran and what it computed."""

    step: int
    start_s: float
    end_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_blocks_used: int
    num_preempted: int = 0
    num_padding_tokens: int = 0  # static policy: what a padded batch would add
    num_idle_slots: int = 0  # static policy: finished members still holding a batch slot

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class StepLog:
    """The per-step log of a run: enough to draw a timeline of prefill/decode mixes and stalls.

    ``max_steps`` bounds it for a long-running server: it then keeps the latest ``max_steps`` to ``2 * max_steps``
    steps (older ones are dropped in halves); ``num_recorded`` counts every step, dropped or not."""

    steps: list[StepRecord] = field(default_factory=list)
    max_steps: int | None = None
    num_recorded: int = 0

    def __post_init__(self) -> None:
        check_positive_ints(self, ("max_steps",), optional=True)

    def record(self, plan: StepPlan, start_s: float, end_s: float, num_blocks_used: int) -> StepRecord:
        """Log one executed ``StepPlan``: the one step record of the engine and the simulator."""
        rec = StepRecord(
            step=self.num_recorded,
            start_s=start_s,
            end_s=end_s,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_seqs=plan.num_seqs,
            num_blocks_used=num_blocks_used,
            num_preempted=len(plan.preempted),
            num_padding_tokens=plan.num_padding_tokens,
            num_idle_slots=plan.num_idle_slots,
        )
        self.steps.append(rec)
        self.num_recorded += 1
        if self.max_steps is not None and len(self.steps) > 2 * self.max_steps:
            del self.steps[: -self.max_steps]
        return rec

    def __len__(self) -> int:
        return len(self.steps)

    def to_records(self) -> list[dict[str, Any]]:
        return [dict(asdict(s), duration_s=s.duration_s) for s in self.steps]

    def to_dataframe(self) -> pd.DataFrame:
        """Columns: the ``StepRecord`` fields and ``duration_s`` (pandas imported lazily)."""
        import pandas as pd

        columns = [f.name for f in StepRecord.__dataclass_fields__.values()] + ["duration_s"]
        return pd.DataFrame(self.to_records(), columns=columns)
