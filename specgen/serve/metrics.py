"""What the server exposes at GET /metrics, in Prometheus' text format (`prometheus_client`).

Requests by endpoint and outcome, tokens in and out, the queue's depth and the batch's width,
draft tokens proposed and accepted (so the acceptance rate and tokens per target forward can
be read as rates of the counters, or from the gauges kept here), and time to first token and
time in the queue as histograms. One registry per server (tests run several in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specgen.decoding.stats import Stats

LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specgen_requests",
            "Requests answered, by endpoint and outcome",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specgen_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.cached_tokens = Counter(
            "specgen_cached_prompt_tokens",
            "Prompt tokens whose K/V came from an earlier "
            "request (a kept row or the prefix cache), not from a prefill",
            registry=r,
        )
        self.generated_tokens = Counter("specgen_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("specgen_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter(
            "specgen_accepted_draft_tokens", "Draft tokens accepted by the target", registry=r
        )
        self.target_forwards = Counter(
            "specgen_target_forwards", "Target forwards while decoding (one per round and row)", registry=r
        )
        self.queue_depth = Gauge("specgen_queue_depth", "Requests waiting for a row", registry=r)
        self.batch_width = Gauge("specgen_batch_width", "Rows in the running batch", registry=r)
        self.threads = Gauge(
            "specgen_threads", "torch threads of the engine's forwards (fitted to the free cores)", registry=r
        )
        self.acceptance = Gauge(
            "specgen_acceptance_rate", "Accepted / drafted draft tokens since the start", registry=r
        )
        self.per_forward = Gauge(
            "specgen_tokens_per_target_forward",
            "Generated tokens per target forward since the start",
            registry=r,
        )
        self.draft_length = Gauge(
            "specgen_draft_length",
            "Most draft tokens the last row of this method to finish at this batch width would "
            "draft: its draft length under the width cap and the ceiling its measured rounds set "
            "(0: plain rounds)",
            ["method", "width"],
            registry=r,
        )
        self.together = Gauge(
            "specgen_drafting_together",
            "Fewest rows of this batch width that draft with the draft model in one round (fewer "
            "run plain rounds: the model's step holds up every row); measured at the start",
            ["width"],
            registry=r,
        )
        self.prefix_cache = Gauge(
            "specgen_prefix_cache_bytes",
            "K/V the prefix cache holds, per model (set as requests finish)",
            ["model"],
            registry=r,
        )
        self.ttft = Histogram(
            "specgen_time_to_first_token_seconds",
            "From the request's prefill to its first token",
            buckets=LATENCY,
            registry=r,
        )
        self.queued = Histogram(
            "specgen_queue_seconds", "From the request's arrival to its row", buckets=LATENCY, registry=r
        )
        self.totals = Stats(method="served", generations=0)  # every round since the start: for the gauges

    def joined(self, queued_seconds: float, prompt_tokens: int, cached_tokens: int, width: int) -> None:
        self.queued.observe(queued_seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.batch_width.set(width)

    def round(self, result, stats) -> None:
        drafted = len(result.draft_tokens)
        totals = self.totals
        totals.drafted += drafted
        totals.accepted += result.accepted_emitted
        totals.new_tokens += len(result.emitted)
        totals.rounds += 1
        self.drafted.inc(drafted)
        self.accepted.inc(result.accepted_emitted)
        self.generated_tokens.inc(len(result.emitted))
        self.target_forwards.inc()
        if stats.rounds == 1 and stats.time_to_first_token is not None:
            self.ttft.observe(stats.time_to_first_token)
        self.acceptance.set(totals.acceptance_rate)
        self.per_forward.set(totals.tokens_per_target_forward)

    def draft_lengths(self, method: str, lengths: dict[int, int]) -> None:
        for width, k in lengths.items():
            self.draft_length.labels(method, str(width)).set(k)

    def drafting_together(self, least: dict[int, int]) -> None:
        for width, rows in least.items():
            self.together.labels(str(width)).set(rows)

    def finished(self, ticket, outcome: str, stats) -> None:
        """A row ended (a scheduler.Ticket): its request counted once, at its first choice."""
        if ticket.choice == 0:  # a request of n choices is one request (its rows count in the token totals)
            self.requests.labels(ticket.request.endpoint, outcome).inc()

    def prefixes(self, target_bytes: int, draft_bytes: int) -> None:
        self.prefix_cache.labels("target").set(target_bytes)
        self.prefix_cache.labels("draft").set(draft_bytes)

    def refused(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
