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

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.request import RequestRecord, Sequence

if TYPE_CHECKING:
    import pandas as pd

    from workbench.engine.scheduler import StepPlan

STAT_KEYS = ("mean", "median", "p90", "p95", "p99")
LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2el_s")


def stats(values: list[float]) -> dict[str, float]:
    """mean, median, p90, p95, p99 of ``values`` (0.0 each when empty, as vLLM)."""
    if not values:
        return {k: 0.0 for k in STAT_KEYS}
    arr = np.asarray(values, dtype=np.float64)
    p90, p95, p99 = np.percentile(arr, [90, 95, 99])
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
    }


def _record(item: Sequence | RequestRecord) -> RequestRecord:
    return RequestRecord.from_sequence(item) if isinstance(item, Sequence) else item


def is_completed(rec: RequestRecord) -> bool:
    return (
        rec.finish_reason not in ("rejected", "abort")
        and rec.first_token_time is not None
        and rec.finish_time is not None
        and rec.num_output_tokens > 0
    )


def request_latencies(rec: RequestRecord) -> dict[str, Any]:
    """``ttft_s``, ``tpot_s`` (None for a single output token), ``e2el_s`` and the ``itl_s`` list of a request."""
    ttft = rec.first_token_time - rec.arrival_time  # type: ignore[operator]
    e2el = rec.finish_time - rec.arrival_time  # type: ignore[operator]
    tpot = (e2el - ttft) / (rec.num_output_tokens - 1) if rec.num_output_tokens > 1 else None
    times = rec.token_times
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": ttft, "tpot_s": tpot, "e2el_s": e2el, "itl_s": itl}


def meets_slos(
    lat: dict[str, Any],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    slo_e2el_s: float | None = None,
) -> bool:
    """Whether one request's latencies meet every SLO given (None = no SLO on that metric)."""
    if slo_ttft_s is not None and lat["ttft_s"] > slo_ttft_s:
        return False
    if slo_tpot_s is not None and lat["tpot_s"] is not None and lat["tpot_s"] > slo_tpot_s:
        return False
    return not (slo_e2el_s is not None and lat["e2el_s"] > slo_e2el_s)


def summarize(
    requests: list[Sequence] | list[RequestRecord],
    duration_s: float | None = None,
    num_preemptions: int | None = None,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    slo_e2el_s: float | None = None,
) -> dict[str, Any]:
    """The contract JSON object of ``replay``/``simulate`` from finished requests and the run's duration.

    ``duration_s`` defaults to last finish - first arrival. ``num_preemptions`` defaults to the sum over
    the requests. Layout: ``num_requests``, ``num_finished``, ``num_preemptions``, ``duration_s`` and
    ``metrics`` with ``ttft_s``/``tpot_s``/``itl_s``/``e2el_s`` (each ``mean``, ``median``, ``p90``,
    ``p95``, ``p99``), ``request_throughput``, ``output_throughput``, ``total_token_throughput``,
    ``goodput``, ``slo_attainment`` (%; both null when no SLO is given) and the ``slos`` used.
    """
    records = [_record(r) for r in requests]
    done = [r for r in records if is_completed(r)]
    lats = [request_latencies(r) for r in done]
    if duration_s is None:
        if done:
            duration_s = max(r.finish_time for r in done) - min(r.arrival_time for r in records)  # type: ignore[type-var]
        else:
            duration_s = 0.0
    if num_preemptions is None:
        num_preemptions = sum(r.num_preemptions for r in records)
    good = sum(meets_slos(lat, slo_ttft_s, slo_tpot_s, slo_e2el_s) for lat in lats)
    has_slo = any(x is not None for x in (slo_ttft_s, slo_tpot_s, slo_e2el_s))
    out_tokens = sum(r.num_output_tokens for r in done)
    in_tokens = sum(r.num_prompt_tokens for r in done)

    def per_s(x: float) -> float:
        return x / duration_s if duration_s and duration_s > 0 else 0.0

    metrics: dict[str, Any] = {
        "ttft_s": stats([lat["ttft_s"] for lat in lats]),
        "tpot_s": stats([lat["tpot_s"] for lat in lats if lat["tpot_s"] is not None]),
        "itl_s": stats([g for lat in lats for g in lat["itl_s"]]),
        "e2el_s": stats([lat["e2el_s"] for lat in lats]),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        # without any SLO there is nothing to attain: null, not "100% within SLOs"
        "goodput": per_s(good) if has_slo else None,
        "slo_attainment": (100.0 * good / len(records) if records else 0.0) if has_slo else None,
        "slos": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s, "e2el_s": slo_e2el_s},
    }
    return {
        "num_requests": len(records),
        "num_finished": len(done),
        "num_preemptions": int(num_preemptions),
        "duration_s": float(duration_s),
        "metrics": metrics,
    }


def requests_to_dataframe(requests: list[Sequence] | list[RequestRecord]) -> pd.DataFrame:
    """One row per request: ids, lengths, timestamps and derived latencies (``RequestRecord``'s fields, also for a
    ``RequestResult``; pandas imported lazily)."""
    import pandas as pd

    rows = []
    for rec in map(_record, requests):
        row = {f.name: getattr(rec, f.name) for f in fields(RequestRecord) if f.name != "token_times"}
        if is_completed(rec):
            lat = request_latencies(rec)
            row.update(ttft_s=lat["ttft_s"], tpot_s=lat["tpot_s"], e2el_s=lat["e2el_s"])
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
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps must be a positive integer or None, got {self.max_steps!r}")

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
