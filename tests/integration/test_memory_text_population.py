"""BM25's N for the text leg (migration 0038): given by the memory stage, counted at most once per minute.

The new function scores exactly as the old one did for the same N; the old one (kept for a stage of the previous
release) still counts for itself; the repository counts an agent once per ``ttl`` and reuses the count; and the
SECURITY DEFINER function gives nothing to a caller scoped to another agent or organization.
"""

from __future__ import annotations

import hashlib
import uuid

import asyncpg

from ibex_dataplane.memory.models import Tenant as MemoryTenant
from ibex_dataplane.memory.populations import Populations
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.runtime.stores import Stores
from tests.support.tenants import TenantFactory

GIVEN = "SELECT id, score, terms FROM ibex_memory_text_bm25_given_n($1, $2, NULL, '{}', 20, 400, $3) ORDER BY id"
COUNTED = "SELECT id, score, terms FROM ibex_memory_text_bm25_postings($1, $2, NULL, '{}', 20, 400, 20000) ORDER BY id"


async def _write(conn: asyncpg.Connection, org: uuid.UUID, agent: uuid.UUID, contents: list[str]) -> None:
    await conn.executemany(
        "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source, confidence, metadata)"
        " VALUES ($1, $2, $3, $4, $5, 'active', 'imported', 0.9, '{}'::jsonb)",
        [(uuid.uuid4(), org, agent, c, hashlib.sha256(c.encode()).digest()) for c in contents],
    )


def _contents(n: int, start: int = 0) -> list[str]:
    return [
        f"note {i}: the lighthouse keeper" + (" paints seashells" if i % 3 == 0 else " trims the lamp wicks")
        for i in range(start, start + n)
    ]


async def test_the_given_count_scores_as_the_function_that_counted_for_itself(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("alpha",))
    agent = t.agents["alpha"]
    async with stores.db.tenant(t.org_id, agent) as conn:
        await _write(conn, t.org_id, agent, _contents(260))  # above the floor of 200: N counts
    async with stores.db.tenant(t.org_id, agent, readonly=True) as conn:
        counted = [tuple(r) for r in await conn.fetch(COUNTED, agent, "who paints seashells")]
        given = [tuple(r) for r in await conn.fetch(GIVEN, agent, "who paints seashells", 260)]
        other_n = [tuple(r) for r in await conn.fetch(GIVEN, agent, "who paints seashells", 5000)]
    assert len(counted) == 20 and counted == given
    assert [r[1] for r in other_n] != [r[1] for r in given]  # N is used: another N, other scores


async def test_the_repository_counts_an_agent_once_per_ttl(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(agents=("alpha",))
    agent = t.agents["alpha"]
    clock = [0.0]
    populations = Populations(ttl=60.0, clock=lambda: clock[0])
    repo = MemoryRepository(stores.db, populations=populations)
    scope = MemoryTenant(t.org_id, agent)

    async def search() -> list[float]:
        rows = await repo.search_text(
            scope, text="who paints seashells", at=None, candidates=10, min_confidence=None, labels=[]
        )
        return sorted(round(r["text_score"] or 0.0, 4) for r in rows)

    async def scored_with(n: int) -> list[float]:
        async with stores.db.tenant(t.org_id, agent, readonly=True) as conn:
            rows = await conn.fetch(GIVEN.replace("20, 400", "10, 400"), agent, "who paints seashells", n)
        return sorted(round(float(r["score"]), 4) for r in rows)

    async with stores.db.tenant(t.org_id, agent) as conn:
        await _write(conn, t.org_id, agent, _contents(300))
    assert await search() == await scored_with(300)
    assert populations.get(t.org_id, agent) == 300
    async with stores.db.tenant(t.org_id, agent) as conn:
        await _write(conn, t.org_id, agent, _contents(300, start=300))
    stale, fresh = await scored_with(300), await scored_with(600)
    assert stale != fresh
    clock[0] = 59.0
    assert await search() == stale  # within the minute: the count kept
    clock[0] = 60.0
    assert await search() == fresh  # counted again
    assert populations.get(t.org_id, agent) == 600


async def test_the_function_gives_nothing_to_another_agent_or_organization(
    tenants: TenantFactory, stores: Stores
) -> None:
    victim, other = await tenants.create(), await tenants.create()
    agent = victim.agents["alpha"]
    async with stores.db.tenant(victim.org_id, agent) as conn:
        await _write(conn, victim.org_id, agent, _contents(10))
        assert len(await conn.fetch(GIVEN, agent, "seashells", 10)) > 0
    for org, caller in ((victim.org_id, victim.agents["beta"]), (other.org_id, other.agents["alpha"])):
        async with stores.db.tenant(org, caller, readonly=True) as conn:
            assert await conn.fetch(GIVEN, agent, "seashells", 10) == []
