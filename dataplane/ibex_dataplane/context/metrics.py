"""Prometheus metrics of the context stage (``ibex_context_*``), one registry per stage instance; no tenant labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from ibex_dataplane.runtime.heap import HeapMetrics

_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 1.0)


class ContextMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.heap = HeapMetrics("ibex_context", r)
        self.assembly_seconds = Histogram(
            "ibex_context_assembly_duration_seconds", "Whole assembly, by step.", ["step"], buckets=_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.branch_outcomes = Counter(
            "ibex_context_branch_outcomes_total", "Retrieval branch results.", ["branch", "status"], registry=r
        )
        self.assemblies = Counter(
            "ibex_context_assemblies_total", "Assemblies by degradation level.", ["degradation"], registry=r
        )
        self.memories_placed = Counter(
            "ibex_context_memories_placed_total", "Memories placed into contexts.", ["source"], registry=r
        )
        self.rejections = Counter(
            "ibex_context_principal_rejections_total", "Calls refused for a missing or invalid principal.", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
