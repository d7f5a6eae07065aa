"""Analytics: one ``llm_traces`` row per request and one ``usage_facts`` row per priced call, in ClickHouse.

``record`` never blocks and never fails a request: rows go to a bounded in-memory queue that a background task
flushes in batches (off the event loop, through :class:`~ibex_dataplane.store.clickhouse.ClickHouse`). When
ClickHouse is down or the queue is full, rows are dropped and counted (``ibex_proxy_analytics_dropped_total``).
Rows carry ids, model, tokens, latencies, outcome and cost; never message content. Reads for ``GET /v1/usage``
go through :func:`~ibex_dataplane.store.clickhouse.org_query`, so every query is filtered by the caller's org.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from prometheus_client import CollectorRegistry, Counter

from ibex_dataplane.shared.usage import USAGE_COLUMNS
from ibex_dataplane.shared.waits import woken
from ibex_dataplane.store.clickhouse import ClickHouse, org_query
from ibex_dataplane.store.errors import StoreQueryError, StoreUnavailable

log = logging.getLogger(__name__)

TRACE_COLUMNS = (
    "org_id", "agent_id", "request_id", "ts", "key_id", "session_id", "route", "model", "provider", "stream",
    "status_code", "error_code", "prompt_tokens", "completion_tokens", "cost_usd", "latency_ms", "upstream_ms",
    "stage_ms", "memories_injected", "context_tokens", "context_degraded", "degradations", "captured",
)  # fmt: skip


@dataclass(frozen=True)
class Trace:
    org_id: UUID
    agent_id: UUID
    request_id: str
    ts: datetime
    key_id: str
    session_id: str
    route: str
    model: str
    provider: str
    stream: bool
    status_code: int
    error_code: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    latency_ms: float = 0.0
    upstream_ms: float = 0.0
    stage_ms: dict[str, float] = field(default_factory=dict)
    memories_injected: int = 0
    context_tokens: int = 0
    context_degraded: bool = False
    degradations: tuple[str, ...] = ()
    captured: bool = False  # the turn was queued for capture into memory
    priced: bool = False  # a provider answered with usage: also write a usage fact

    def trace_row(self) -> list[Any]:
        return [
            self.org_id, self.agent_id, self.request_id, self.ts, self.key_id, self.session_id, self.route,
            self.model, self.provider, int(self.stream), self.status_code, self.error_code, self.prompt_tokens,
            self.completion_tokens, self.cost_usd, self.latency_ms, self.upstream_ms, self.stage_ms,
            self.memories_injected, self.context_tokens, int(self.context_degraded), list(self.degradations),
            int(self.captured),
        ]  # fmt: skip

    def usage_row(self) -> list[Any]:
        return [
            self.org_id, self.agent_id, self.request_id, self.ts, self.model, self.prompt_tokens,
            self.completion_tokens, self.cost_usd,
        ]  # fmt: skip


class AnalyticsRecorder:
    def __init__(
        self,
        clickhouse: ClickHouse,
        registry: CollectorRegistry,
        *,
        max_queue: int = 20_000,
        batch_size: int = 1_000,
        flush_interval: float = 1.0,
    ) -> None:
        self._ch = clickhouse
        self._queue: deque[Trace] = deque()
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._flush_interval = flush_interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dropped = Counter(
            "ibex_proxy_analytics_dropped_total", "Analytics rows dropped (queue full or ClickHouse down).",
            ["reason"], registry=registry,
        )  # fmt: skip
        self.written = Counter(
            "ibex_proxy_analytics_written_total", "Analytics rows written to ClickHouse.", registry=registry
        )

    def record(self, trace: Trace) -> None:
        if len(self._queue) >= self._max_queue:
            self.dropped.labels("queue_full").inc()
            return
        self._queue.append(trace)
        if len(self._queue) >= self._batch_size:
            self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ibex-analytics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while True:
            await woken(self._wake, self._flush_interval)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write the rows queued when the flush starts, in batches. Rows recorded while it writes wait for the next
        flush: under steady traffic the queue is never empty, and draining it until it is would turn the periodic
        flush into a stream of tiny inserts (each with ClickHouse's fixed cost of a new part)."""
        pending = len(self._queue)
        while pending > 0:
            batch = [self._queue.popleft() for _ in range(min(self._batch_size, pending, len(self._queue)))]
            if not batch:
                return
            pending -= len(batch)
            try:
                # Generators: each row is built as it is encoded, in slices between which requests run.
                await self._ch.insert("llm_traces", (t.trace_row() for t in batch), TRACE_COLUMNS)
                await self._ch.insert("usage_facts", (t.usage_row() for t in batch if t.priced), USAGE_COLUMNS)
            except StoreUnavailable as e:
                self.dropped.labels("clickhouse_unavailable").inc(len(batch))
                log.warning("dropped %d analytics rows: %s", len(batch), e)
                return
            except StoreQueryError as e:  # a bug of ours: drop this batch, keep the next ones flowing
                self.dropped.labels("clickhouse_rejected").inc(len(batch))
                log.error("dropped %d analytics rows: %s", len(batch), e)
                continue
            self.written.inc(len(batch))


GROUPINGS = {"agent": "toString(agent_id)", "model": "model", "day": "toString(toDate(ts))"}


async def usage_report(
    clickhouse: ClickHouse, org_id: UUID, group_by: str, start: date, end: date
) -> list[dict[str, Any]]:
    """Spend and tokens of one org in [start, end), grouped by agent, model or day (usage_facts, deduplicated)."""
    key = GROUPINGS[group_by]
    sql = (
        f"SELECT {key} AS k, count() AS requests, sum(prompt_tokens) AS prompt_tokens,"  # key comes from GROUPINGS only
        " sum(completion_tokens) AS completion_tokens, sum(cost_usd) AS cost_usd"
        " FROM usage_facts FINAL"
        " WHERE org_id = {org_id:UUID} AND ts >= {start:Date} AND ts < {end:Date}"
        " GROUP BY k ORDER BY k"
    )
    rows = await clickhouse.query(org_query(sql, org_id, start=start, end=end))
    return [
        {
            "key": str(k),
            "requests": int(n),
            "prompt_tokens": int(p),
            "completion_tokens": int(c),
            "cost_usd": format(Decimal(cost), "f"),
        }
        for k, n, p, c, cost in rows
    ]
