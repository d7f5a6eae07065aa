"""Migrations apply from zero, are idempotent, refuse edited history, and force RLS on every tenant table; the data
plane's wait for them returns once they land and fails after its deadline, saying what is missing."""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from pathlib import Path

import asyncpg
import pytest

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.errors import MigrationError
from ibex_dataplane.store.migrations import (
    default_migrations_dir,
    discover,
    migrate_clickhouse,
    migrate_postgres,
    wait_for_postgres_schema,
)
from tests.support.waiting import until

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


async def database_before(info: RuntimeInfo, folder: Path, version: int) -> str:
    """A new database migrated up to (not including) migration ``version``, with one org and one agent (both
    ``uuid5`` of the version, so a test can name them); returns its admin DSN. ``folder`` must be empty."""
    for f in sorted((default_migrations_dir() / "postgres").glob("*.sql")):
        if int(f.name[:4]) < version:
            shutil.copy(f, folder / f.name)
    dsn = await fresh_database(info)
    await migrate_postgres(dsn, folder)
    org, agent = tenant_before(version)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("INSERT INTO organizations (id, namespace, name) VALUES ($1, 'ns', 'org')", org)
        await conn.execute("INSERT INTO agents (id, org_id, namespace, name) VALUES ($1, $2, 'ns', 'a')", agent, org)
    finally:
        await conn.close()
    return dsn


def tenant_before(version: int) -> tuple[uuid.UUID, uuid.UUID]:
    """The org and agent :func:`database_before` creates."""
    return uuid.uuid5(uuid.NAMESPACE_OID, f"org-{version}"), uuid.uuid5(uuid.NAMESPACE_OID, f"agent-{version}")


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


def as_data_plane(info: RuntimeInfo, admin_dsn: str) -> str:
    """The data plane's DSN (its RLS-bound role) for the database ``admin_dsn`` names."""
    return info.postgres_app_dsn.rsplit("/", 1)[0] + "/" + admin_dsn.rsplit("/", 1)[1]


async def test_the_schema_wait_returns_once_the_migrations_land(
    runtime_info: RuntimeInfo, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ibex_dataplane.store.migrations")
    admin = await fresh_database(runtime_info)
    folder = default_migrations_dir() / "postgres"
    versions = [m.version for m in discover(folder)]
    waiting = asyncio.create_task(
        wait_for_postgres_schema(as_data_plane(runtime_info, admin), folder, timeout=60, interval=0.05, report_every=0)
    )
    try:
        await until(lambda: logged(caplog, "no migration has been applied yet"), "the wait to start", timeout=10)
        # Every migration but the last (the grant): the data plane's role cannot read the table yet.
        partial = tmp_path / "partial"
        partial.mkdir()
        for path in sorted(folder.glob("*.sql"))[:-1]:
            shutil.copy(path, partial)
        assert await migrate_postgres(admin, partial) == versions[:-1]
        await until(lambda: logged(caplog, "schema_migrations is not readable yet"), "the partial schema", timeout=10)
        assert not waiting.done()
        assert await migrate_postgres(admin, folder) == versions[-1:]
        assert await asyncio.wait_for(waiting, timeout=10) == len(versions)
    finally:
        waiting.cancel()
    assert logged_now(caplog, f"the Postgres schema is ready: {len(versions)} migrations applied")


async def test_the_schema_wait_gives_up_after_its_deadline_saying_what_is_missing(
    runtime_info: RuntimeInfo, tmp_path: Path
) -> None:
    admin = await fresh_database(runtime_info)
    dsn = as_data_plane(runtime_info, admin)
    folder = default_migrations_dir() / "postgres"
    with pytest.raises(MigrationError, match="not ready after 1 s: no migration has been applied yet"):
        await wait_for_postgres_schema(dsn, folder, timeout=1, interval=0.1)

    # A build with a migration the database does not have yet (an upgrade whose operator has not migrated).
    await migrate_postgres(admin, folder)
    newer = tmp_path / "newer"
    shutil.copytree(folder, newer)
    (newer / "9999_next.sql").write_text("SELECT 1;")
    count = len(discover(newer))
    with pytest.raises(MigrationError, match=rf"{count - 1} of {count} migrations applied, waiting for 9999$"):
        await wait_for_postgres_schema(dsn, newer, timeout=1, interval=0.1)

    unreachable = "postgresql://nobody@127.0.0.1:1/none"
    with pytest.raises(MigrationError, match="Postgres is not reachable"):
        await wait_for_postgres_schema(unreachable, folder, timeout=0.5, interval=0.1)


def logged_now(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


async def logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return logged_now(caplog, text)
