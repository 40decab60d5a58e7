"""The server's Prometheus metrics, and quantiles read back from a histogram in Prometheus text.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` ...) with the prefix ``workbench:``. Latencies are taken on
the engine's clock: TTFT from the moment the server's handler received the request (before reading its body) to
the end of the step that produced its first token,
ITL between consecutive tokens of a request, E2E from receipt to the last token (requests that a client abandoned
are not counted). Built on ``prometheus_client``, one registry per server.

With speculative decoding on, vLLM's counters of it (as ``vllm:spec_decode_*``): ``spec_decode_num_drafts``
(proposals verified), ``spec_decode_num_draft_tokens`` (tokens proposed), ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos`` (label ``position``, 0 to k - 1: proposals accepted through that
position). Acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts, the rate at
position i = per_pos[i] / drafts, all over the deltas of two scrapes. ``workbench:engine_request_entries`` counts the
per-request entries the engine holds (``Engine.request_state``): the requests in flight, none of a finished one.
"""

from __future__ import annotations

import math
from typing import Any

# seconds; dense enough (about 1.5x apart) that a quantile read back from the buckets lands within a bucket's width
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip


class ServerMetrics:
    """Histograms, gauges and counters of one server (``render()`` gives the text of ``GET /metrics``)."""

    def __init__(self, model_name: str, num_speculative_tokens: int | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = {"registry": self.registry}

        def hist(name: str, doc: str) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=LATENCY_BUCKETS_S, **labels).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, ["model_name"], **labels).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], **labels).labels(model_name)

        self.ttft = hist("workbench:time_to_first_token_seconds", "Time to first token (receipt to first token).")
        self.itl = hist("workbench:inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = hist("workbench:e2e_request_latency_seconds", "Receipt to last token of a finished request.")
        self.running = gauge("workbench:num_requests_running", "Requests holding KV blocks.")
        self.waiting = gauge("workbench:num_requests_waiting", "Requests queued for admission.")
        self.blocks_used = gauge("workbench:kv_blocks_used", "KV-cache blocks in use.")
        self.blocks_total = gauge("workbench:kv_blocks_total", "KV-cache blocks in the pool.")
        self.kv_usage = gauge("workbench:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.preemptions = counter("workbench:num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("workbench:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("workbench:generation_tokens", "Tokens generated.")
        self.finished = Counter("workbench:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], **labels)  # fmt: skip
        self.request_entries = gauge(
            "workbench:engine_request_entries", "Per-request entries the engine holds (requests in flight only)."
        )
        self.model_name = model_name
        self.spec: dict[str, Any] | None = None  # speculative decoding's counters, when on
        if num_speculative_tokens is not None:
            per_pos = Counter(
                "workbench:spec_decode_num_accepted_tokens_per_pos", "Proposals accepted through each position.",
                ["model_name", "position"], **labels,
            )  # fmt: skip
            self.spec = {
                "num_drafts": counter("workbench:spec_decode_num_drafts", "Proposals verified."),
                "num_draft_tokens": counter("workbench:spec_decode_num_draft_tokens", "Tokens proposed."),
                "num_accepted_tokens": counter("workbench:spec_decode_num_accepted_tokens", "Tokens accepted."),
                "per_pos": [per_pos.labels(model_name, str(i)) for i in range(num_speculative_tokens)],
            }
        self._spec_seen: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                           "num_accepted_tokens_per_pos": []}  # fmt: skip

    def observe_speculative(self, stats: dict[str, Any]) -> None:
        """Advance the speculative counters to the engine's cumulative ``stats`` (``Engine.speculative_stats``)."""
        if self.spec is None:
            return
        seen = self._spec_seen
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if stats[key] > seen[key]:
                self.spec[key].inc(stats[key] - seen[key])
        per_pos, old = stats["num_accepted_tokens_per_pos"], seen["num_accepted_tokens_per_pos"]
        for i, count in enumerate(per_pos[: len(self.spec["per_pos"])]):
            before = old[i] if i < len(old) else 0
            if count > before:
                self.spec["per_pos"][i].inc(count - before)
        self._spec_seen = {**{k: stats[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
                           "num_accepted_tokens_per_pos": list(per_pos)}  # fmt: skip

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def histogram_buckets(text: str, name: str) -> list[tuple[float, float]]:
    """The cumulative ``(upper bound, count)`` buckets of histogram ``name`` in Prometheus text, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                counts[le] = counts.get(le, 0.0) + sample.value
    return sorted(counts.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's ``histogram_quantile``: the ``q``-quantile, linearly interpolated inside its bucket (the first
    bucket's lower bound is 0; a quantile in the +Inf bucket returns the highest finite bound). NaN if empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_delta(after: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The buckets of the observations made between two scrapes."""
    old = dict(before)
    return [(le, count - old.get(le, 0.0)) for le, count in after]


def scrape(base_url: str, timeout_s: float = 30.0) -> str:
    """The Prometheus text of a server's ``GET /metrics``."""
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as resp:
        return resp.read().decode()


def metric_total(text: str, name: str, label: str = "") -> float:
    """The sum of every sample of metric ``name`` (a counter, a gauge) whose labels contain ``label``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


LATENCY_HISTOGRAMS = {"ttft": "workbench:time_to_first_token_seconds", "itl": "workbench:inter_token_latency_seconds"}


def server_quantiles(before: str, after: str, percentiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """The server's own TTFT and ITL over the requests between two scrapes: ``<metric>_count`` and
    ``p<P>_<metric>_ms`` per percentile (``histogram_quantile`` of the buckets' difference)."""
    out = {}
    for metric, name in LATENCY_HISTOGRAMS.items():
        delta = bucket_delta(histogram_buckets(after, name), histogram_buckets(before, name))
        out[f"{metric}_count"] = delta[-1][1] if delta else 0.0
        for p in percentiles:
            out[f"p{p}_{metric}_ms"] = histogram_quantile(p / 100, delta) * 1e3
    return out
