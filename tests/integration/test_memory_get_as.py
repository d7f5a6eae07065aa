"""Memories by id in one round trip (migration 0043).

``MemoryRepository.get_many`` reads through ``ibex_memory_get_as``: active memories valid now, superseded ones only
when asked, never forgotten, quarantined or expired ones; nothing for another organization or another agent, even
naming the ids; and the tenant it sets ends with its statement.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from ibex_dataplane.memory import repository
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.postgres import close_pool, create_pool
from tests.support.tenants import TenantFactory


async def _write(
    conn: asyncpg.Connection, org: uuid.UUID, agent: uuid.UUID, content: str, *, status: str = "active", **at: object
) -> uuid.UUID:
    memory_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source, valid_from, valid_until)"
        " VALUES ($1, $2, $3, $4, $5, $6, 'imported', $7, $8)",
        memory_id,
        org,
        agent,
        content,
        hashlib.sha256(content.encode()).digest(),
        status,
        at.get("valid_from"),
        at.get("valid_until"),
    )
    return memory_id


async def test_get_many_reads_what_is_readable_now(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(agents=("alpha",))
    tenant = Tenant(t.org_id, t.agents["alpha"])
    now = datetime.now(UTC)
    async with stores.db.tenant(t.org_id, tenant.agent_id) as conn:
        active = await _write(conn, t.org_id, tenant.agent_id, "valid now")
        superseded = await _write(conn, t.org_id, tenant.agent_id, "an older version", status="superseded")
        quarantined = await _write(conn, t.org_id, tenant.agent_id, "held back", status="quarantined")
        expired = await _write(conn, t.org_id, tenant.agent_id, "over", valid_until=now - timedelta(days=1))
        future = await _write(conn, t.org_id, tenant.agent_id, "not yet", valid_from=now + timedelta(days=1))
        await conn.execute(
            "INSERT INTO memory_labels (memory_id, label, org_id, agent_id)"
            " VALUES ($1, 'b', $2, $3), ($1, 'a', $2, $3)",
            active,
            t.org_id,
            tenant.agent_id,
        )
    repo = MemoryRepository(stores.db)
    asked = [active, superseded, quarantined, expired, future, uuid.uuid4()]
    await repo.record_retrievals(tenant, [active])

    found = await repo.get_many(tenant, asked)
    assert list(found) == [active]
    memory = found[active]
    assert (memory.content, memory.labels, memory.retrieval_count) == ("valid now", ("a", "b"), 1)
    assert memory.last_retrieved_at is not None
    assert set(await repo.get_many(tenant, asked, include_superseded=True)) == {active, superseded}


async def test_get_many_gives_nothing_to_another_org_or_another_agent(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(agents=("alpha", "beta"))
    other = await tenants.create(agents=("alpha",))
    org, agent = t.org_id, t.agents["alpha"]
    async with stores.db.tenant(org, agent) as conn:
        mid = await _write(conn, org, agent, "alpha's own")
    repo = MemoryRepository(stores.db)
    assert list(await repo.get_many(Tenant(org, agent), [mid])) == [mid]
    for org_id, agent_id in ((other.org_id, agent), (org, t.agents["beta"]), (other.org_id, other.agents["alpha"])):
        assert await repo.get_many(Tenant(org_id, agent_id), [mid], include_superseded=True) == {}
        # and straight at the function, a scope of one tenant with the ids (and org) of another
        assert await stores.db.call_as_rows(org_id, agent_id, repository._GET_AS, [mid], True) == []


async def test_the_tenant_it_sets_ends_with_its_statement(
    tenants: TenantFactory, stores: Stores, runtime_info: RuntimeInfo
) -> None:
    t = await tenants.create(agents=("alpha",))
    org, agent = t.org_id, t.agents["alpha"]
    async with stores.db.tenant(org, agent) as conn:
        mid = await _write(conn, org, agent, "scoped for one statement")
    pool = await create_pool(runtime_info.postgres_app_dsn, min_size=1, max_size=1)  # one connection: the same one
    try:
        async with pool.acquire() as conn:
            assert len(await conn.fetch(repository._GET_AS, org, agent, [mid], False)) == 1
            assert await conn.fetchval("SELECT current_setting('app.org_id', true)") == ""
            assert await conn.fetchval("SELECT count(*) FROM memories") == 0  # row-level security: no scope, no rows
    finally:
        await close_pool(pool)
