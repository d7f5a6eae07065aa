"""After-commit effects of memory changes (architecture section 9.2, stage 8), made durable by the outbox.

Every transaction that changes a memory also inserts an outbox row naming the memories whose derived state (today
the agent's hot cache) must follow. Right after the commit the refinery or the service asks :meth:`OutboxWorker.
sync_now` to apply it at once; if that fails (Redis down, process killed) the row stays due and the worker loop
leases it later, with backoff, until it succeeds. Applying an event is idempotent and order-independent: it reads
each memory's current state from Postgres and makes the hot cache agree (live memories in, anything else out), so a
late or repeated event can never resurrect a forgotten memory. Failures here degrade reads and are counted; they
never touch the durable record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Sequence
from uuid import UUID

import orjson

from ibex_dataplane.memory.hotcache import HotCache
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.shared.waits import woken
from ibex_dataplane.store.errors import StoreError

log = logging.getLogger(__name__)


class OutboxWorker:
    def __init__(
        self,
        repo: MemoryRepository,
        hot: HotCache,
        metrics: MemoryMetrics,
        *,
        poll_seconds: float = 1.0,
        lease_seconds: float = 30.0,
        batch: int = 100,
        max_backoff: float = 60.0,
        housekeeping_every: float = 600.0,
    ) -> None:
        self._repo = repo
        self._hot = hot
        self._metrics = metrics
        self._poll = poll_seconds
        self._lease = lease_seconds
        self._batch = batch
        self._max_backoff = max_backoff
        self._housekeeping_every = housekeeping_every
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def apply(self, tenant: Tenant, memory_ids: Sequence[UUID]) -> None:
        """Make the hot cache agree with Postgres for these memories (raises on store failures)."""
        live = await self._repo.hot_candidates(tenant, memory_ids)
        gone = [i for i in memory_ids if i not in live]
        await self._hot.sync(tenant, live.values(), gone)

    async def sync_now(self, tenant: Tenant, outbox_id: int, memory_ids: Sequence[UUID]) -> bool:
        """Apply one just-committed event and mark it done; on failure leave it to the worker and count it."""
        try:
            await self.apply(tenant, memory_ids)
            await self._repo.outbox_done(tenant.org_id, [outbox_id])
        except (StoreError, OSError) as e:
            self._metrics.after_commit_failures.labels("hot_cache").inc()
            log.warning("after-commit hot cache update deferred to the outbox (outbox_id=%d): %s",
                        outbox_id, type(e).__name__)  # fmt: skip
            self._wake.set()
            return False
        return True

    async def run_once(self) -> int:
        """Lease due events, apply each, and record the results; returns how many were handled."""
        rows = await self._repo.lease_outbox(self._batch, self._lease)
        finished: dict[UUID, list[int]] = defaultdict(list)
        for row in rows:
            payload = orjson.loads(row["payload"]) if isinstance(row["payload"], str | bytes) else row["payload"]
            try:
                ids = [UUID(i) for i in payload.get("memory_ids", [])]
                if row["agent_id"] is None:
                    raise ValueError("memory outbox events need an agent")
                await self.apply(Tenant(row["org_id"], row["agent_id"]), ids)
            except (ValueError, TypeError, AttributeError) as e:
                # A malformed event can never succeed: finish it rather than retry it forever.
                log.error("dropping malformed outbox event %d: %s", row["id"], type(e).__name__)
                self._metrics.outbox_processed.labels("malformed").inc()
                finished[row["org_id"]].append(row["id"])
                continue
            except (StoreError, OSError) as e:
                delay = min(self._max_backoff, 2.0 ** min(int(row["attempts"]), 10))
                self._metrics.outbox_processed.labels("retry").inc()
                with contextlib.suppress(StoreError, OSError):
                    await self._repo.outbox_retry(row["org_id"], [row["id"]], error=type(e).__name__, delay=delay)
                continue
            self._metrics.outbox_processed.labels("done").inc()
            finished[row["org_id"]].append(row["id"])
        for org_id, outbox_ids in finished.items():
            await self._repo.outbox_done(org_id, outbox_ids)
        return len(rows)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_housekeeping = loop.time() + self._housekeeping_every
        while True:
            try:
                handled = await self.run_once()
                if loop.time() >= next_housekeeping:
                    next_housekeeping = loop.time() + self._housekeeping_every
                    await self._repo.housekeeping(outbox_age=86400.0)
            except (StoreError, OSError) as e:
                log.warning("outbox worker pass failed: %s", type(e).__name__)
                handled = 0
            except Exception:
                log.exception("outbox worker pass failed unexpectedly")
                handled = 0
            if handled >= self._batch:
                continue
            self._wake.clear()
            await woken(self._wake, self._poll)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="ibex-memory-outbox")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
