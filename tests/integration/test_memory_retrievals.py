"""Retrieval bookkeeping in its own table (migration 0042).

A search's bumps and an exact duplicate's count go to ``memory_retrievals`` and never write a new version of the
memory's row; every read of a memory (get, the three search legs) shows the count; the table is as isolated as
memories, through the repository and in raw SQL; and the migration carries the counts of an existing database over.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from ibex_dataplane.memory.models import Tenant as MemoryTenant
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres
from tests.integration.test_migrations import database_before, tenant_before
from tests.integration.test_rls import insert_memory
from tests.support.tenants import TenantFactory

ROW_VERSION = "SELECT xmin::text, ctid::text, revision FROM memories WHERE id = $1"
COUNT = "SELECT retrieval_count, last_retrieved_at FROM memory_retrievals WHERE memory_id = $1"


async def test_a_retrieval_is_counted_without_a_new_version_of_the_memory_row(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("alpha",))
    tenant = MemoryTenant(t.org_id, t.agents["alpha"])
    repo = MemoryRepository(stores.db)
    async with stores.db.tenant(t.org_id, tenant.agent_id) as conn:
        mid = await insert_memory(conn, t.org_id, tenant.agent_id, "the lighthouse keeper trims the lamp wicks")
        before = tuple(await conn.fetchrow(ROW_VERSION, mid))
    assert (await repo.get_many(tenant, [mid]))[mid].retrieval_count == 0  # no row: never retrieved

    await repo.record_retrievals(tenant, [mid])
    await repo.record_retrievals(tenant, [mid])

    async with stores.db.tenant(t.org_id, tenant.agent_id) as conn:
        after = tuple(await conn.fetchrow(ROW_VERSION, mid))
        count, at = await conn.fetchrow(COUNT, mid)
    assert after == before  # same tuple, same transaction id, same revision: the memory was not written
    assert count == 2 and at is not None
    got = (await repo.get_many(tenant, [mid]))[mid]
    assert (got.retrieval_count, got.last_retrieved_at) == (2, at)
    # The legs of a current search read it too.
    rows = await stores.db.call_as_rows(
        t.org_id,
        tenant.agent_id,
        "SELECT id, retrieval_count, last_retrieved_at"
        " FROM ibex_memory_search_text_as($1, $2, 40, 'lighthouse keeper', 10, NULL, '{}', 400, 100)",
    )
    assert [tuple(r) for r in rows] == [(mid, 2, at)]


async def test_an_exact_duplicate_is_counted_and_answered_with_its_count(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("alpha",))
    tenant = MemoryTenant(t.org_id, t.agents["alpha"])
    repo = MemoryRepository(stores.db)
    async with stores.db.tenant(t.org_id, tenant.agent_id) as conn:
        mid = await insert_memory(conn, t.org_id, tenant.agent_id, "deploys happen on tuesdays")
        before = tuple(await conn.fetchrow(ROW_VERSION, mid))
    digest = hashlib.sha256(b"deploys happen on tuesdays").digest()
    first = await repo.bump_duplicates(tenant, [digest, hashlib.sha256(b"no such memory").digest()])
    second = await repo.bump_duplicates(tenant, [digest])
    assert list(first) == [digest] and first[digest].id == mid
    assert (first[digest].retrieval_count, second[digest].retrieval_count) == (1, 2)
    assert second[digest].last_retrieved_at is not None
    async with stores.db.tenant(t.org_id, tenant.agent_id) as conn:
        # a share lock marks the tuple (its xmax) but writes no new version
        assert (await conn.fetchrow(ROW_VERSION, mid))["ctid"] == before[1]


async def test_counts_stay_with_their_tenant(tenants: TenantFactory, stores: Stores) -> None:
    a = await tenants.create(agents=("alpha", "beta"))
    b = await tenants.create(agents=("alpha",))
    alpha = MemoryTenant(a.org_id, a.agents["alpha"])
    repo = MemoryRepository(stores.db)
    async with stores.db.tenant(a.org_id, alpha.agent_id) as conn:
        mid = await insert_memory(conn, a.org_id, alpha.agent_id, "alpha's retrieved memory")
    await repo.record_retrievals(alpha, [mid])

    # Another org's agent, and another agent of the same org, naming alpha's memory: nothing counted, nothing seen.
    await repo.record_retrievals(MemoryTenant(b.org_id, b.agents["alpha"]), [mid])
    await repo.record_retrievals(MemoryTenant(a.org_id, a.agents["beta"]), [mid])
    async with stores.db.tenant(a.org_id, alpha.agent_id) as conn:
        assert (await conn.fetchrow(COUNT, mid))["retrieval_count"] == 1
    for org, agent in ((b.org_id, b.agents["alpha"]), (a.org_id, a.agents["beta"]), (b.org_id, None)):
        async with stores.db.tenant(org, agent) as conn:
            assert await conn.fetchval("SELECT count(*) FROM memory_retrievals") == 0
    async with stores.db.unscoped() as conn:
        assert await conn.fetchval("SELECT count(*) FROM memory_retrievals") == 0

    # Raw SQL as the data plane cannot plant or move another tenant's count.
    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
        async with stores.db.tenant(b.org_id, b.agents["alpha"]) as conn:
            await conn.execute(
                "INSERT INTO memory_retrievals VALUES ($1, $2, $3, 99, now())", uuid.uuid4(), a.org_id, alpha.agent_id
            )
    async with stores.db.tenant(b.org_id) as conn:
        assert await conn.execute("UPDATE memory_retrievals SET retrieval_count = 99") == "UPDATE 0"


async def test_the_migration_carries_existing_counts_over(runtime_info: RuntimeInfo, tmp_path: Path) -> None:
    dsn = await database_before(runtime_info, tmp_path, 42)
    org, agent = tenant_before(42)
    conn = await asyncpg.connect(dsn)
    try:
        seen = await insert_memory(conn, org, agent, "retrieved before")
        unseen = await insert_memory(conn, org, agent, "never")
        await conn.execute(
            "UPDATE memories SET retrieval_count = 3, last_retrieved_at = '2026-01-02T03:04:05Z' WHERE id = $1", seen
        )
        assert 42 in await migrate_postgres(dsn, default_migrations_dir() / "postgres")
        rows = await conn.fetch("SELECT memory_id, org_id, agent_id, retrieval_count, last_retrieved_at"
                                " FROM memory_retrievals")  # fmt: skip
        columns = await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'memories'"
            " AND column_name IN ('retrieval_count', 'last_retrieved_at')"
        )
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [(seen, org, agent, 3, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))]
    assert unseen not in {r[0] for r in rows}
    assert columns == []
