"""Forward-only schema migrations for Postgres and ClickHouse, run by ``ibex migrate``, the operator's leader
(``--migrate``) and at ``ibex dev`` start; and the wait for them (``ibex wait-schema``) that holds the data plane back
until the Postgres schema it was built for is there.

Migrations are numbered SQL files (``NNNN_name.sql``) under ``<migrations>/postgres`` and
``<migrations>/clickhouse``. Applied versions are recorded with a checksum; an applied file that changed later is
an error (forward-only: add a new file instead). Postgres migrations run as the privileged role, each in its own
transaction, under an advisory lock so concurrent runners apply each version once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.errors import MigrationError
from ibex_dataplane.store.postgres import postgres_errors

log = logging.getLogger(__name__)

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_LOCK_ID = 0x1BE7_0001  # pg_advisory_lock key for migration runs


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def default_migrations_dir() -> Path:
    """The migrations shipped with the package: ``ibex_dataplane/migrations`` (package data in a wheel; in the
    source tree a symbolic link to the repository's ``migrations/`` folder)."""
    return Path(__file__).resolve().parents[1] / "migrations"


def discover(folder: Path) -> list[Migration]:
    if not folder.is_dir():
        raise MigrationError(f"migrations folder {folder} does not exist")
    found: list[Migration] = []
    for path in sorted(folder.iterdir()):
        if path.suffix != ".sql":
            continue
        m = _FILE.fullmatch(path.name)
        if not m:
            raise MigrationError(f"migration file {path.name} does not match NNNN_name.sql")
        found.append(Migration(int(m.group(1)), m.group(2), path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration versions in {folder}")
    return found


async def migrate_postgres(admin_dsn: str, folder: Path) -> list[int]:
    """Apply pending Postgres migrations; returns the versions applied now."""
    migrations = discover(folder)
    with postgres_errors():
        conn = await asyncpg.connect(admin_dsn, timeout=10)
    applied_now: list[int] = []
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_ID)
        try:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            rows = await conn.fetch("SELECT version, name, checksum FROM schema_migrations")
            applied = {r["version"]: r["checksum"] for r in rows}
            for m in migrations:
                if m.version in applied:
                    if applied[m.version] != m.checksum:
                        raise MigrationError(
                            f"postgres migration {m.version:04d}_{m.name} changed after it was applied"
                        )
                    continue
                async with conn.transaction():
                    await conn.execute(m.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                        m.version,
                        m.name,
                        m.checksum,
                    )
                log.info("applied postgres migration %04d_%s", m.version, m.name)
                applied_now.append(m.version)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_ID)
    except asyncpg.PostgresError as e:
        raise MigrationError(f"postgres migration failed: {e}") from e
    finally:
        await conn.close()
    return applied_now


def _statements(sql: str) -> list[str]:
    """Split a ClickHouse migration into statements (it does not accept several per request)."""
    body = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--"))
    return [s.strip() for s in body.split(";") if s.strip()]


async def migrate_clickhouse(ch: ClickHouse, folder: Path) -> list[int]:
    """Apply pending ClickHouse migrations (DDL there is not transactional: statements are idempotent)."""
    migrations = discover(folder)
    await ch.command(
        "CREATE TABLE IF NOT EXISTS ibex_schema_migrations"
        " (version UInt32, name String, checksum String, applied_at DateTime DEFAULT now())"
        " ENGINE = ReplacingMergeTree ORDER BY version"
    )
    rows = await ch.admin_query("SELECT version, checksum FROM ibex_schema_migrations FINAL")
    applied = {int(r[0]): str(r[1]) for r in rows}
    applied_now: list[int] = []
    for m in migrations:
        if m.version in applied:
            if applied[m.version] != m.checksum:
                raise MigrationError(f"clickhouse migration {m.version:04d}_{m.name} changed after it was applied")
            continue
        for statement in _statements(m.sql):
            await ch.command(statement)
        await ch.insert("ibex_schema_migrations", [[m.version, m.name, m.checksum]], ["version", "name", "checksum"])
        log.info("applied clickhouse migration %04d_%s", m.version, m.name)
        applied_now.append(m.version)
    return applied_now


async def _missing_postgres_versions(dsn: str, wanted: set[int]) -> str | None:
    """What keeps the schema from being ready (``None``: every wanted version is applied)."""
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (OSError, TimeoutError, asyncpg.PostgresError) as e:
        return f"Postgres is not reachable ({type(e).__name__}: {e})"
    try:
        rows = await conn.fetch("SELECT version FROM schema_migrations")
    except asyncpg.UndefinedTableError:
        return "no migration has been applied yet"
    except asyncpg.InsufficientPrivilegeError:
        return "schema_migrations is not readable yet (migration 0031 grants it)"
    except asyncpg.PostgresError as e:
        return f"cannot read schema_migrations ({type(e).__name__}: {e})"
    finally:
        await conn.close()
    missing = sorted(wanted - {r["version"] for r in rows})
    if not missing:
        return None
    return f"{len(wanted) - len(missing)} of {len(wanted)} migrations applied, waiting for " + ", ".join(
        f"{v:04d}" for v in missing
    )


async def wait_for_postgres_schema(
    dsn: str, folder: Path, *, timeout: float, interval: float = 1.0, report_every: float = 15.0
) -> int:
    """Return (the number of migrations) once every Postgres migration in ``folder`` is applied, by whoever applies
    them (the operator's leader, ``ibex migrate``); raise :class:`MigrationError` saying what is missing after
    ``timeout`` seconds. Applies nothing and needs no privilege: ``dsn`` is the data plane's role, which may read
    ``schema_migrations`` from migration 0031 on. An unreachable server, a missing table and a refused read all
    mean "not yet"; the wait is logged every ``report_every`` seconds."""
    wanted = {m.version for m in discover(folder)}
    deadline = time.monotonic() + timeout
    next_report = time.monotonic()
    while (why := await _missing_postgres_versions(dsn, wanted)) is not None:
        now = time.monotonic()
        if now >= deadline:
            raise MigrationError(f"the Postgres schema is not ready after {timeout:.0f} s: {why}")
        if now >= next_report:
            log.info("waiting for the Postgres schema (%.0f s left): %s", deadline - now, why)
            next_report = now + report_every
        await asyncio.sleep(min(interval, deadline - now))
    log.info("the Postgres schema is ready: %d migrations applied", len(wanted))
    return len(wanted)
