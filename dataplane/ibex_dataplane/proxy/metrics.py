"""Prometheus metrics of the proxy, named ``ibex_proxy_<noun>_<unit>``; no tenant ids as labels.

One registry per application (no global state), rendered by ``GET /metrics``. :func:`timing_middleware` times every
request by route template (``/v1/memories/{memory_id}``, ``/mcp``; ``unmatched`` for unknown paths) and status.

In a worker of ``ibex proxy --workers N`` (``multiprocess_dir`` set; prometheus_client's multiprocess mode, which
its supervisor turns on with ``PROMETHEUS_MULTIPROC_DIR`` before the worker starts) every worker writes its values
to files of that per-run folder and ``GET /metrics`` on any worker renders the sum over all of them: counters and
histograms add up (those of workers that exited included), the breaker gauge shows the most open state among live
workers, and ``ibex_proxy_worker_requests{pid}`` counts the requests each live worker finished.

What every request observes (each gate's time and pass, the request's time, the provider call, the budget hold,
the cache tiers) is **gathered**: added up in plain Python numbers on the event loop and moved into the Prometheus
metrics by :meth:`ProxyMetrics.flush`, which runs before every render and once a second while the application runs
(:meth:`ProxyMetrics.flushing`), so a worker's files are at most a second behind. A Prometheus observation takes a
lock and, for a histogram, a loop over the buckets in Python: about 1.5 us each, and a request makes about thirty.
Rare outcomes (refusals, failures) go to Prometheus directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from ibex_dataplane.runtime.heap import HeapMetrics

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_SLOW = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
FLUSH_SECONDS = 1.0


class GatheredHistogram:
    """Observations of one labelled histogram, counted per bucket until :meth:`flush` adds them to it. Event loop
    only (no lock)."""

    __slots__ = ("_bounds", "_child", "_counts", "_sum")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._bounds: list[float] = list(child._upper_bounds)  # ends in +Inf: every number has a bucket
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._counts[bisect_left(self._bounds, amount)] += 1  # the first bound >= amount, as Histogram.observe
        self._sum += amount

    def flush(self) -> None:
        if not any(self._counts):
            return
        counts, total = self._counts, self._sum
        self._counts, self._sum = [0] * len(self._bounds), 0.0
        self._child._sum.inc(total)
        for bucket, count in zip(self._child._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


class GatheredCounter:
    """Increments of one labelled counter, added to it by :meth:`flush`. Event loop only."""

    __slots__ = ("_child", "_count")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._count = 0

    def inc(self, amount: int = 1) -> None:
        self._count += amount

    def flush(self) -> None:
        if self._count:
            count, self._count = self._count, 0
            self._child.inc(count)


_G = TypeVar("_G", GatheredHistogram, GatheredCounter)


class ProxyMetrics:
    def __init__(self, multiprocess_dir: Path | None = None) -> None:
        if multiprocess_dir is not None and not getattr(prometheus_values.ValueClass, "_multiprocess", False):
            # Chosen by prometheus_client when it is first imported: too late to turn on from here.
            raise RuntimeError("multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set before the process starts")
        self._multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        r = self.registry
        self.gate_seconds = Histogram(
            "ibex_proxy_gate_duration_seconds", "Time spent in each gate of the protected path.", ["gate"],
            buckets=_FAST, registry=r,
        )  # fmt: skip
        self.gate_outcomes = Counter(
            "ibex_proxy_gate_outcomes_total", "Gate results: pass or the error code it raised.", ["gate", "outcome"],
            registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "ibex_proxy_request_duration_seconds", "Whole request latency per route.", ["route", "status"],
            buckets=_SLOW, registry=r,
        )  # fmt: skip
        self.provider_calls = Counter(
            "ibex_proxy_provider_calls_total", "Provider calls by provider and outcome.", ["provider", "outcome"],
            registry=r,
        )  # fmt: skip
        self.provider_seconds = Histogram(
            "ibex_proxy_provider_duration_seconds", "Provider call latency (to last byte).", ["provider"],
            buckets=_SLOW, registry=r,
        )  # fmt: skip
        self.degradations = Counter(
            "ibex_proxy_degradations_total", "Work that degraded instead of failing (context, analytics...).",
            ["kind"], registry=r,
        )  # fmt: skip
        self.background_failures = Counter(
            "ibex_proxy_background_failures_total", "After-response work that failed (settle, checkpoint...).",
            ["task"], registry=r,
        )  # fmt: skip

        self.budget_holds = Counter(
            "ibex_proxy_budget_holds_total",
            "Budget holds by outcome: placed, drawn (from a lease), refused, settled, released.",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.cache_lookups = Counter(
            "ibex_proxy_cache_lookups_total", "Cached reads (keys, policies, directives) by the tier that answered: "
            "local, redis or load (a miss read from Postgres).", ["cache", "tier"], registry=r,
        )  # fmt: skip
        self.breaker_state = Gauge(
            "ibex_proxy_provider_breaker_state", "Circuit breaker of each network provider: 0 closed, 1 half-open, "
            "2 open (read at scrape time).", ["provider"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.mcp_messages = Counter(
            "ibex_proxy_mcp_messages_total", "MCP JSON-RPC messages by method and outcome (ok or the JSON-RPC code).",
            ["method", "outcome"], registry=r,
        )  # fmt: skip
        self.mcp_tool_calls = Counter(
            "ibex_proxy_mcp_tool_calls_total", "MCP tool calls by tool and outcome (ok or the envelope code).",
            ["tool", "outcome"], registry=r,
        )  # fmt: skip

        self.heap = HeapMetrics("ibex_proxy", r)

        self.worker_requests: Gauge | None = None
        if multiprocess_dir is not None:
            self.worker_requests = Gauge(
                "ibex_proxy_worker_requests", "Requests finished by each live worker process of the proxy (label "
                "pid; only with --workers above 1).", registry=r, multiprocess_mode="liveall",
            )  # fmt: skip

        self._before_render: list[Callable[[], None]] = []
        self._gathered: dict[tuple[object, tuple[str, ...]], GatheredHistogram | GatheredCounter] = {}

    def before_render(self, refresh: Callable[[], None]) -> None:
        """Run ``refresh`` before each scrape (gauges read from live objects, e.g. breaker states)."""
        self._before_render.append(refresh)

    def gathered_histogram(self, histogram: Histogram, *labels: str) -> GatheredHistogram:
        """The gathered child of ``histogram`` for ``labels`` (one per label set: ask once, keep it)."""
        return self._gathered_child(GatheredHistogram, histogram, labels)

    def gathered_counter(self, counter: Counter, *labels: str) -> GatheredCounter:
        """The gathered child of ``counter`` for ``labels`` (one per label set)."""
        return self._gathered_child(GatheredCounter, counter, labels)

    def _gathered_child(self, kind: type[_G], metric: Histogram | Counter, labels: tuple[str, ...]) -> _G:
        found = self._gathered.get((metric, labels))
        if found is None:
            found = self._gathered[(metric, labels)] = kind(metric.labels(*labels))
        assert isinstance(found, kind)
        return found

    def flush(self) -> None:
        """Move every gathered observation into its Prometheus metric."""
        for gathered in list(self._gathered.values()):
            gathered.flush()

    async def flushing(self, _app: web.Application) -> AsyncIterator[None]:
        """A ``cleanup_ctx`` entry: flush once a second while the application runs, and once more at its end."""

        async def every_second() -> None:
            while True:
                await asyncio.sleep(FLUSH_SECONDS)
                self.flush()

        task = asyncio.create_task(every_second(), name="ibex-metrics-flush")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.flush()

    def render(self) -> bytes:
        self.flush()
        for refresh in self._before_render:
            refresh()
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=str(self._multiprocess_dir))  # type: ignore[no-untyped-call]
        return generate_latest(merged)


def timing_middleware(metrics: ProxyMetrics) -> Middleware:
    """Observe ``ibex_proxy_request_duration_seconds`` for every request (outermost: it sees the final status)."""

    timers: dict[tuple[str, int], GatheredHistogram] = {}

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            timer = timers.get((route, status))
            if timer is None:  # route templates times statuses: a bounded set
                timer = timers[(route, status)] = metrics.gathered_histogram(
                    metrics.request_seconds, route, str(status)
                )
            timer.observe(time.perf_counter() - started)
            if metrics.worker_requests is not None:  # not gathered: each worker's count is current in every scrape
                metrics.worker_requests.inc()

    return middleware
