"""Row-level security as the data-plane role: no org set sees nothing; one org never reaches another."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import asyncpg
import pytest

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from tests.support.tenants import TenantFactory

README = Path(__file__).resolve().parents[2] / "README.md"
READABLE = ["organizations", "agents", "api_keys", "api_key_agents", "directives", "directive_versions"]


async def insert_memory(conn: asyncpg.Connection, org_id: uuid.UUID, agent_id: uuid.UUID, text: str) -> uuid.UUID:
    mid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO memories (id, org_id, agent_id, content, content_hash, status, source)"
        " VALUES ($1, $2, $3, $4::text, sha256(convert_to($4::text, 'UTF8')), 'active', 'user_provided')",
        mid,
        org_id,
        agent_id,
        text,
    )
    return mid


async def test_the_data_plane_role_sees_zero_rows_without_an_org(stores: Stores, tenants: TenantFactory) -> None:
    a = await tenants.create()
    async with stores.db.tenant(a.org_id, a.agents["alpha"]) as conn:
        await insert_memory(conn, a.org_id, a.agents["alpha"], "alpha likes tea")
    async with stores.db.unscoped() as conn:
        assert await conn.fetchval("SELECT current_user") == "ibex_app"
        for table in [*READABLE, "memories", "memory_labels", "sessions", "budget_ledger", "outbox"]:
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0, table


async def test_an_org_sees_only_its_own_rows(stores: Stores, tenants: TenantFactory) -> None:
    a = await tenants.create()
    b = await tenants.create()
    async with stores.db.tenant(b.org_id, b.agents["alpha"]) as conn:
        await insert_memory(conn, b.org_id, b.agents["alpha"], "b's secret plan")
    async with stores.db.tenant(a.org_id) as conn:
        assert {r["id"] for r in await conn.fetch("SELECT id FROM organizations")} == {a.org_id}
        assert {r["id"] for r in await conn.fetch("SELECT id FROM agents")} == set(a.agents.values())
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0
        assert await conn.fetchval("SELECT count(*) FROM api_keys WHERE org_id = $1", b.org_id) == 0


async def test_inserting_into_another_org_is_refused(stores: Stores, tenants: TenantFactory) -> None:
    a = await tenants.create()
    b = await tenants.create()
    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
        async with stores.db.tenant(a.org_id) as conn:
            await insert_memory(conn, b.org_id, b.agents["alpha"], "planted")
    async with stores.db.tenant(b.org_id) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0


async def test_an_agent_scoped_transaction_sees_only_that_agents_memories(
    stores: Stores, tenants: TenantFactory
) -> None:
    a = await tenants.create()
    alpha, beta = a.agents["alpha"], a.agents["beta"]
    async with stores.db.tenant(a.org_id) as conn:
        await insert_memory(conn, a.org_id, alpha, "alpha's memory")
        await insert_memory(conn, a.org_id, beta, "beta's memory")
    async with stores.db.tenant(a.org_id, alpha) as conn:
        assert [r["content"] for r in await conn.fetch("SELECT content FROM memories")] == ["alpha's memory"]
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await insert_memory(conn, a.org_id, beta, "written as beta by alpha")


async def test_tenant_configuration_is_read_only_to_the_data_plane(stores: Stores, tenants: TenantFactory) -> None:
    a = await tenants.create()
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        async with stores.db.tenant(a.org_id) as conn:
            await conn.execute("UPDATE organizations SET suspended = true")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        async with stores.db.tenant(a.org_id) as conn:
            await conn.execute("INSERT INTO directive_versions SELECT * FROM directive_versions")


async def test_the_org_setting_does_not_outlive_its_transaction(stores: Stores, tenants: TenantFactory) -> None:
    a = await tenants.create()
    async with stores.db.tenant(a.org_id) as conn:
        assert await conn.fetchval("SELECT count(*) FROM agents") == 2
    # Every pooled connection, including the one that just served the org, has forgotten it.
    pool = stores.db.pool
    held = [await pool.acquire() for _ in range(pool.get_size())]
    try:
        for conn in held:
            assert await conn.fetchval("SELECT count(*) FROM agents") == 0
            assert await conn.fetchval("SELECT current_setting('app.org_id', true)") in (None, "")
    finally:
        for conn in held:
            await pool.release(conn)


async def test_key_lookup_before_the_tenant_is_known_returns_only_the_named_key(
    stores: Stores, tenants: TenantFactory
) -> None:
    a = await tenants.create()
    key_id = a.key_ids["alpha"]
    async with stores.db.unscoped() as conn:
        rows = await conn.fetch("SELECT * FROM ibex_lookup_api_key($1)", key_id)
        assert len(rows) == 1
        assert rows[0]["org_id"] == a.org_id
        assert rows[0]["agent_ids"] == [a.agents["alpha"]]
        assert await conn.fetch("SELECT * FROM ibex_lookup_api_key($1)", "nosuchkeyxxxxxxx") == []


async def test_directive_versions_are_immutable_even_for_the_owner(runtime_info: RuntimeInfo, stores: Stores) -> None:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        with pytest.raises(asyncpg.IntegrityConstraintViolationError, match="immutable"):
            await conn.execute("UPDATE directive_versions SET content = 'rewritten'")


async def test_the_outbox_lease_reveals_ids_and_owners_but_no_tenant_data(
    stores: Stores, tenants: TenantFactory
) -> None:
    """The one cross-tenant read of the data-plane role (finding background work) carries no payload."""
    t = await tenants.create()
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        await conn.execute(
            "INSERT INTO outbox (org_id, agent_id, kind, payload) VALUES ($1, $2, 'memory.hot_sync', $3::jsonb)",
            t.org_id, t.agents["alpha"], '{"memory_ids": [], "secret": "tenant data"}',
        )  # fmt: skip
    async with stores.db.unscoped() as conn:
        leased = await conn.fetch("SELECT * FROM ibex_outbox_lease_ids(ARRAY['memory.hot_sync'], 1000, '1 second')")
        assert leased, "the due event was not leased"
        assert set(leased[0].keys()) == {"id", "org_id", "agent_id", "kind", "attempts"}
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 0  # and the table itself stays invisible


async def test_the_readme_names_every_cross_tenant_function_the_data_plane_may_call(stores: Stores) -> None:
    """Functions ibex_app may execute that bypass row-level security are either tenant-scoped themselves (they
    read the current org, or set it from their arguments) or named in the README as the only cross-tenant work."""
    readme = README.read_text()
    bullet = readme[readme.index("- **Tenant isolation**") :].split("\n- ", 1)[0]
    named = set(re.findall(r"`(ibex_[a-z_]+)\(", bullet))
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT p.proname,"
            " (p.prosrc LIKE '%ibex_current_org()%' OR p.prosrc LIKE '%ibex_set_tenant(%') AS scoped"
            " FROM pg_proc p WHERE p.prosecdef AND p.pronamespace = 'public'::regnamespace"
            " AND has_function_privilege('ibex_app', p.oid, 'EXECUTE')"
        )
    cross_tenant = {r["proname"] for r in rows if not r["scoped"]}
    assert cross_tenant == named, f"README names {sorted(named)}, the catalog has {sorted(cross_tenant)}"


async def test_every_policy_reads_the_tenant_once_per_statement(stores: Stores) -> None:
    """Migration 0041: a policy calls ibex_current_org() / ibex_current_agent() only inside a scalar subquery,
    which Postgres computes once per statement; a bare call is inlined into current_setting(...) for every row."""
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT tablename, policyname, qual, with_check FROM pg_policies WHERE schemaname = 'public'"
        )
    assert {r["tablename"] for r in rows} >= {"memories", "memory_terms", "memory_sparse_terms", "organizations"}
    for r in rows:
        for expression in (r["qual"], r["with_check"]):
            calls = re.findall(r"(SELECT )?ibex_current_(?:org|agent)\(\)", expression)
            assert calls, (r["tablename"], r["policyname"], expression)
            assert all(calls), (r["tablename"], r["policyname"], expression)


async def test_an_agent_scoped_scan_filters_rows_without_reading_the_settings_per_row(
    stores: Stores, tenants: TenantFactory
) -> None:
    a = await tenants.create()
    alpha = a.agents["alpha"]
    async with stores.db.tenant(a.org_id, alpha) as conn:
        await insert_memory(conn, a.org_id, alpha, "alpha's memory")
        plan = "\n".join(
            r[0] for r in await conn.fetch("EXPLAIN (COSTS OFF) SELECT content FROM memories WHERE status = 'active'")
        )
        assert [r["content"] for r in await conn.fetch("SELECT content FROM memories")] == ["alpha's memory"]
    assert "InitPlan" in plan, plan
    assert "current_setting" not in plan, plan
