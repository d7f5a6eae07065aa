"""Prometheus metrics of the memory stage, named ``ibex_memory_<noun>_<unit>``; no tenant ids as labels.

One registry per application (no global state), rendered by the stage's ``GET /metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ibex_dataplane.runtime.heap import HeapMetrics

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_SLOW = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class MemoryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.heap = HeapMetrics("ibex_memory", r)
        self.request_seconds = Histogram(
            "ibex_memory_request_duration_seconds", "Memory stage request latency per route.", ["route", "status"],
            buckets=_SLOW, registry=r,
        )  # fmt: skip
        self.stage_seconds = Histogram(
            "ibex_memory_refinery_stage_duration_seconds", "Time spent in each refinery stage per write call.",
            ["stage"], buckets=_FAST, registry=r,
        )  # fmt: skip
        self.stage_outcomes = Counter(
            "ibex_memory_refinery_stage_outcomes_total", "Per-item outcomes of each refinery stage.",
            ["stage", "outcome"], registry=r,
        )  # fmt: skip
        self.dedup_outcomes = Counter(
            "ibex_memory_dedup_outcomes_total", "Exact dedup results: exact, raced (lost to a concurrent insert), new.",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.pii_findings = Counter(
            "ibex_memory_pii_findings_total", "PII findings by entity type and whether they were redacted.",
            ["entity_type", "action"], registry=r,
        )  # fmt: skip
        self.after_commit_failures = Counter(
            "ibex_memory_after_commit_failures_total", "After-commit effects that failed and were left to the outbox.",
            ["effect"], registry=r,
        )  # fmt: skip
        self.outbox_processed = Counter(
            "ibex_memory_outbox_events_total", "Outbox events handled by the worker, by result.", ["result"],
            registry=r,
        )  # fmt: skip
        self.search_seconds = Histogram(
            "ibex_memory_search_duration_seconds", "Search latency by phase (embed, query, score).", ["phase"],
            buckets=_FAST, registry=r,
        )  # fmt: skip
        self.search_hits = Counter(
            "ibex_memory_search_hits_total", "Search hits returned, by how they matched.", ["matched_by"], registry=r
        )
        self.query_cache = Counter(
            "ibex_memory_query_cache_lookups_total", "Search query encodings looked up in the query cache, by result.",
            ["result"], registry=r,
        )  # fmt: skip
        self.idempotency_outcomes = Counter(
            "ibex_memory_idempotency_outcomes_total", "Idempotency ledger decisions.", ["outcome"], registry=r
        )
        self.principal_rejections = Counter(
            "ibex_memory_principal_rejections_total", "Calls refused for a missing, forged or expired principal.",
            ["reason"], registry=r,
        )  # fmt: skip

        self.capture_jobs = Counter(
            "ibex_memory_capture_jobs_total",
            "Capture jobs handled by the worker: captured, replayed (already done), retry, failed.", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.capture_messages = Counter(
            "ibex_memory_capture_messages_total",
            "Captured messages by refinery result: created, deduplicated, quarantined, rejected.", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.capture_lag = Histogram(
            "ibex_memory_capture_lag_seconds", "From the chat answer to its captured memories being stored.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0), registry=r,
        )  # fmt: skip
        self.capture_queue = Gauge(
            "ibex_memory_capture_queue_jobs", "Capture jobs in the queue, by state (waiting, failed).", ["state"],
            registry=r,
        )  # fmt: skip
        self.capture_oldest = Gauge(
            "ibex_memory_capture_oldest_job_age_seconds", "Age of the oldest waiting capture job.", registry=r
        )
        self.extraction_calls = Counter(
            "ibex_memory_extraction_calls_total",
            "Fact extraction model calls: answered, malformed (answers that failed the schema), timeout,"
            " unavailable, refused.", ["outcome"], registry=r,
        )  # fmt: skip
        self.extraction_tokens = Counter(
            "ibex_memory_extraction_tokens_total", "Tokens billed for fact extraction, by kind (prompt, completion).",
            ["kind"], registry=r,
        )  # fmt: skip
        self.extraction_usage_dropped = Counter(
            "ibex_memory_extraction_usage_dropped_total",
            "Usage rows of extraction calls ClickHouse did not take (the budget ledger has them).", registry=r,
        )  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)
