"""The memory service: the domain operations behind every memory route, free of HTTP.

Writes go through the :class:`~ibex_dataplane.memory.refinery.Refinery`; reads through the repository and
:class:`~ibex_dataplane.memory.search.MemorySearch`; forget and feedback change one record in one transaction and
queue the hot-cache follow-up in the outbox. Every operation takes the :class:`Tenant` of the verified internal
principal and nothing else decides scope. Called by :mod:`ibex_dataplane.memory.handlers`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from ibex_dataplane.memory.hotcache import HotCache
from ibex_dataplane.memory.models import Memory, Tenant
from ibex_dataplane.memory.outbox import OutboxWorker
from ibex_dataplane.memory.refinery import Refinery, StageReport, WriteResult
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.memory.search import MemorySearch, SearchHit, score
from ibex_dataplane.memory.validation import ListCursor, ListQuery, SearchQuery, parse_feedback
from ibex_dataplane.shared.errors import NotFound
from ibex_dataplane.store.errors import StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Page:
    memories: list[Memory]
    next_cursor: str | None


class BackgroundWork:
    """Fire-and-forget work after an answer (retrieval bookkeeping); tracked so shutdown can wait for it."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        async def guarded() -> None:
            try:
                await coro
            except (StoreError, OSError) as e:
                log.warning("background %s failed: %s", name, type(e).__name__)
            except Exception:
                log.exception("background %s failed", name)

        task = asyncio.get_running_loop().create_task(guarded(), name=f"ibex-memory-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 10.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


class RetrievalLog:
    """Retrieval bookkeeping off the read path: hits are collected and written in one statement per agent.

    Every search bumps ``retrieval_count`` and ``last_retrieved_at`` of what it returned. Done inline (or as one
    task per search) that is a write transaction per read, competing with the next read; collected for
    ``delay`` seconds it becomes one UPDATE per agent per interval. Best effort: counts are a ranking signal.
    """

    def __init__(self, repo: MemoryRepository, background: BackgroundWork, *, delay: float = 0.5) -> None:
        self._repo = repo
        self._background = background
        self._delay = delay
        self._pending: dict[Tenant, set[UUID]] = {}
        self._scheduled = False

    def record(self, tenant: Tenant, ids: Sequence[UUID]) -> None:
        self._pending.setdefault(tenant, set()).update(ids)
        if not self._scheduled:
            self._scheduled = True
            self._background.spawn("retrievals", self._flush_later())

    async def _flush_later(self) -> None:
        try:
            await asyncio.sleep(self._delay)
        finally:
            self._scheduled = False
            pending, self._pending = self._pending, {}
        for tenant, ids in pending.items():
            await self._repo.record_retrievals(tenant, sorted(ids))


class MemoryService:
    def __init__(
        self,
        *,
        repo: MemoryRepository,
        refinery: Refinery,
        search: MemorySearch,
        hot: HotCache,
        outbox: OutboxWorker,
        digest_key: bytes,
        background: BackgroundWork,
    ) -> None:
        self._repo = repo
        self._refinery = refinery
        self._search = search
        self._hot = hot
        self._outbox = outbox
        self._digest_key = digest_key
        self._retrievals = RetrievalLog(repo, background)

    # -- writes --------------------------------------------------------------------------------------------------

    async def write(
        self, tenant: Tenant, items: Sequence[Any], *, request_id: str, deadline: float
    ) -> tuple[list[WriteResult], list[StageReport]]:
        """Run candidate memories through the refinery; one result per item, in input order."""
        return await self._refinery.run(tenant, items, request_id=request_id, deadline=deadline)

    # -- reads ---------------------------------------------------------------------------------------------------

    async def get(self, tenant: Tenant, memory_id: UUID | None) -> Memory:
        if memory_id is None:
            raise NotFound("no such memory")
        found = await self._repo.get_many(tenant, [memory_id], include_superseded=True)
        memory = found.get(memory_id)
        if memory is None:
            raise NotFound("no such memory")
        return memory

    async def page(self, tenant: Tenant, query: ListQuery) -> Page:
        rows = await self._repo.page(tenant, query)
        page, more = rows[: query.limit], len(rows) > query.limit
        cursor = ListCursor(page[-1].created_at, page[-1].id).encode() if more and page else None
        return Page(page, cursor)

    async def search(self, tenant: Tenant, query: SearchQuery, *, record: bool = True) -> list[SearchHit]:
        """Ranked hits; ``record`` bumps their retrieval metadata (the context stage bumps only what it placed)."""
        hits = await self._search.search(tenant, query)
        if record and hits and query.as_of is None:
            self._retrievals.record(tenant, [h.memory.id for h in hits])
        return hits

    async def hot(self, tenant: Tenant, limit: int) -> list[Memory]:
        """The agent's hot memories, best first, each rehydrated (and fenced) through Postgres."""
        ids = await self._hot.ids(tenant, limit)
        live = await self._repo.get_many(tenant, ids)
        return [live[i] for i in ids if i in live]

    async def hot_hits(self, tenant: Tenant, limit: int) -> list[SearchHit]:
        """The hot memories with their composite score; with no query, relevance is 0 (the context stage's hot
        branch: they compete with query-relevant cold hits only on recency, usefulness and confidence)."""
        now = datetime.now(UTC)
        hits = []
        for memory in await self.hot(tenant, limit):
            total, components = score(memory, 0.0, now, self._search.tuning)
            hits.append(SearchHit(memory, total, components, "hot"))
        return hits

    def record_retrievals(self, tenant: Tenant, ids: Sequence[UUID]) -> None:
        """Bump retrieval metadata of memories a caller used (batched off the request path)."""
        if ids:
            self._retrievals.record(tenant, ids)

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def _digest(self, content_hash: bytes) -> bytes:
        return hmac.new(self._digest_key, content_hash, hashlib.sha256).digest()

    async def forget(self, tenant: Tenant, memory_id: UUID | None) -> None:
        """Tombstone the memory, then purge it from the hot cache (retried through the outbox if that fails)."""
        if memory_id is None:
            raise NotFound("no such memory")
        forgotten = await asyncio.shield(self._repo.forget(tenant, memory_id, self._digest))
        if not forgotten:
            raise NotFound("no such memory")
        try:
            await self._hot.remove(tenant, [memory_id])
        except StoreError as e:
            log.warning("hot cache purge deferred to the outbox: %s", type(e).__name__)

    async def feedback(self, tenant: Tenant, memory_id: UUID | None, body: Any) -> Memory:
        vote = parse_feedback(body)
        if memory_id is None:
            raise NotFound("no such memory")
        memory = await asyncio.shield(self._repo.feedback(tenant, memory_id, useful=vote.useful))
        if memory is None:
            raise NotFound("no such memory")
        return memory
