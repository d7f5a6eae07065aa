"""The persist stage's lock order: two batches of one agent in flight, superseding the same memories, both finish."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np

from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Memory, MemoryDraft, MemorySource, MemoryStatus, Supersession, Tenant
from ibex_dataplane.memory.refinery import Candidate, Persist, WriteBatch, WriteOutcome, content_hash
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.runtime.stores import Stores
from tests.support.tenants import TenantFactory


class _MeetingRepository(MemoryRepository):
    """Holds each transaction's first insert or first supersession until both transactions have reached it, so
    the two batches really are inside their transactions at the same time."""

    def __init__(self, stores: Stores, at: str) -> None:
        super().__init__(stores.db)
        self._barrier = asyncio.Barrier(2)
        self._at = at
        self._met: set[int] = set()

    async def _meet(self, conn: Any, step: str) -> None:
        if step == self._at and id(conn) not in self._met:
            self._met.add(id(conn))
            await asyncio.wait_for(self._barrier.wait(), timeout=10)

    async def insert_memory(self, conn: Any, tenant: Tenant, **fields: Any) -> Memory | None:
        await self._meet(conn, "insert")
        return await super().insert_memory(conn, tenant, **fields)

    async def supersede(self, conn: Any, tenant: Tenant, change: Supersession) -> bool:
        await self._meet(conn, "supersede")
        return await super().supersede(conn, tenant, change)


def _vector(seed: int) -> np.ndarray[Any, Any]:
    v = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    return v / np.linalg.norm(v)


def _candidate(index: int, content: str, targets: list[tuple[uuid.UUID, int]]) -> Candidate:
    c = Candidate(index, raw={"content": content})
    c.draft = MemoryDraft(content=content, source=MemorySource.IMPORTED)
    c.content, c.content_hash, c.embedding = content, content_hash(content), _vector(index)
    c.supersessions = [Supersession(target, revision, None) for target, revision in targets]
    return c


async def _old_memories(stores: Stores, tenant: Tenant, count: int) -> list[tuple[uuid.UUID, int]]:
    repo = MemoryRepository(stores.db)
    old: list[tuple[uuid.UUID, int]] = []
    async with repo.transaction(tenant) as conn:
        for i in range(count):
            content = f"Old fact number {i}."
            memory = await repo.insert_memory(
                conn, tenant, memory_id=uuid.uuid4(), content=content, content_hash=content_hash(content),
                status=MemoryStatus.ACTIVE, source=MemorySource.IMPORTED, session_id=None, request_id=None,
                observed_at=None, valid_from=None, valid_until=None, confidence=1.0, metadata={},
                embedding=_vector(100 + i), labels=(),
            )  # fmt: skip
            assert memory is not None
            old.append((memory.id, memory.revision))
    return old


async def _persist_both(stores: Stores, tenant: Tenant, at: str, *items: list[Candidate]) -> list[WriteBatch]:
    persist = Persist(_MeetingRepository(stores, at), MemoryMetrics())
    batches = [WriteBatch(tenant, f"req-{n}", 0.0, candidates) for n, candidates in enumerate(items)]
    reports = await asyncio.gather(*(persist(b) for b in batches), return_exceptions=True)
    assert not [r for r in reports if isinstance(r, BaseException)], reports
    for batch in batches:
        assert all(c.result is not None and c.result.error is None for c in batch.candidates)
        outcomes = {c.result.outcome for c in batch.candidates if c.result is not None}
        assert outcomes <= {WriteOutcome.CREATED, WriteOutcome.DEDUPLICATED}, outcomes
    return batches


async def test_two_batches_superseding_the_same_memories_in_opposite_orders_both_commit(
    stores: Stores, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    tenant = Tenant(t.org_id, t.agents["alpha"])
    old = await _old_memories(stores, tenant, 6)
    forward = [_candidate(i, f"Forward fact {i}.", old[i:] + old[:i]) for i in range(3)]
    backward = [_candidate(i, f"Backward fact {i}.", list(reversed(old[i:] + old[:i]))) for i in range(3)]

    await _persist_both(stores, tenant, "supersede", forward, backward)

    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        statuses = await conn.fetch("SELECT status FROM memories WHERE id = ANY($1::uuid[])", [i for i, _ in old])
        active = await conn.fetchval("SELECT count(*) FROM memories WHERE status = 'active'")
    assert [r["status"] for r in statuses] == ["superseded"] * 6
    assert active == 6  # three forward and three backward facts; every old one replaced exactly once


async def test_two_batches_writing_the_same_new_contents_in_opposite_orders_both_finish(
    stores: Stores, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    tenant = Tenant(t.org_id, t.agents["alpha"])
    shared = [f"Shared new fact {i}." for i in range(4)]
    forward = [_candidate(i, text, []) for i, text in enumerate(shared)]
    backward = [_candidate(i, text, []) for i, text in enumerate(reversed(shared))]

    batches = await _persist_both(stores, tenant, "insert", forward, backward)

    ids = [{c.content: c.result.memory.id for c in b.candidates if c.result and c.result.memory} for b in batches]
    assert ids[0] == ids[1]  # each content stored once, and both batches answer with that memory
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE status = 'active'") == 4
