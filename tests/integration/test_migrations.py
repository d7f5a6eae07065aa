"""Migrations apply from zero, are idempotent, refuse edited history, and force RLS on every tenant table."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import asyncpg
import pytest

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.errors import MigrationError
from ibex_dataplane.store.migrations import default_migrations_dir, discover, migrate_clickhouse, migrate_postgres

# Tables the catalog lists as tenant tables must include at least these (a sanity check on the derivation).
KNOWN_TENANT_TABLES = {"organizations", "agents", "api_keys", "memories", "budget_holds", "outbox"}


async def fresh_database(info: RuntimeInfo) -> str:
    """A brand-new empty database on the session's server; returns its admin DSN."""
    name = f"mig_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(info.postgres_admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return info.postgres_admin_dsn.rsplit("/", 1)[0] + f"/{name}"


async def test_postgres_migrations_apply_from_zero_and_are_idempotent(runtime_info: RuntimeInfo) -> None:
    dsn = await fresh_database(runtime_info)
    folder = default_migrations_dir() / "postgres"
    every_version = [m.version for m in discover(folder)]
    assert await migrate_postgres(dsn, folder) == every_version
    assert await migrate_postgres(dsn, folder) == []
    conn = await asyncpg.connect(dsn)
    try:
        recorded = [r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY 1")]
        rls = {
            r["relname"]: (r["relrowsecurity"], r["relforcerowsecurity"])
            for r in await conn.fetch(
                "SELECT relname, relrowsecurity, relforcerowsecurity FROM pg_class "
                "WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
            )
        }
        # Every table that carries an org (organizations: its own id) is a tenant table, from the catalog.
        tenant_tables = {
            r["table_name"]
            for r in await conn.fetch(
                "SELECT table_name FROM information_schema.columns WHERE table_schema = 'public'"
                " AND column_name = 'org_id'"
            )
        } | {"organizations"}
        definers = await conn.fetch(
            "SELECT p.oid::regprocedure::text AS name, p.proconfig FROM pg_proc p"
            " WHERE p.prosecdef AND p.pronamespace = 'public'::regnamespace"
        )
        app_role = await conn.fetchrow("SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = 'ibex_app'")
    finally:
        await conn.close()
    assert recorded == every_version
    assert tenant_tables >= KNOWN_TENANT_TABLES
    for table in tenant_tables:
        assert rls[table] == (True, True), f"{table} must ENABLE and FORCE row-level security"
    assert definers, "the schema has SECURITY DEFINER functions; the catalog query found none"
    for fn in definers:
        pinned = [c for c in fn["proconfig"] or [] if c.startswith("search_path=")]
        assert pinned and pinned[0].endswith("pg_temp"), f"{fn['name']} must pin search_path (pg_temp last)"
    assert app_role is not None and not app_role["rolsuper"] and not app_role["rolbypassrls"]


async def test_concurrent_migration_runs_apply_each_version_once(runtime_info: RuntimeInfo) -> None:
    import asyncio

    dsn = await fresh_database(runtime_info)
    folder = default_migrations_dir() / "postgres"
    results = await asyncio.gather(*(migrate_postgres(dsn, folder) for _ in range(3)))
    applied = sorted(v for r in results for v in r)
    assert applied == [m.version for m in discover(folder)]


async def test_an_applied_migration_that_changed_is_refused(runtime_info: RuntimeInfo, tmp_path: Path) -> None:
    dsn = await fresh_database(runtime_info)
    folder = tmp_path / "postgres"
    shutil.copytree(default_migrations_dir() / "postgres", folder)
    await migrate_postgres(dsn, folder)
    first = sorted(folder.glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- edited after the fact\n")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        await migrate_postgres(dsn, folder)


async def test_badly_named_migration_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "1_init.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match=r"does not match NNNN_name\.sql"):
        discover(tmp_path)


async def test_clickhouse_migrations_create_the_analytics_tables_once(stores: Stores) -> None:
    folder = default_migrations_dir() / "clickhouse"
    # The session fixture already migrated this engine: a second run applies nothing.
    assert await migrate_clickhouse(stores.clickhouse, folder) == []
    tables = {
        r[0]
        for r in await stores.clickhouse.admin_query(
            "SELECT name FROM system.tables WHERE database = currentDatabase()"
        )
    }
    assert {"llm_traces", "usage_facts", "ibex_schema_migrations"} <= tables
