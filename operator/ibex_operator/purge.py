"""Remove an organization's or an agent's data from every store, and record what was removed.

Called by the operator's finalizers (``handlers``) when an Organization or Agent resource is deleted; owns every
statement that deletes tenant data and the ``tenant_deletions`` record (migration 0004). Order:

1. Postgres, in one transaction: every table that carries ``org_id`` (and ``agent_id`` for an agent), children
   before parents so each count is exact, then the organization or agent row itself; the record's Postgres counts
   are written in the same transaction. Tables are found in the catalog, so a table added by a later migration is
   purged without a change here.
2. Redis: caches are first moved to a new version and every replica is told (``ibex:invalidate``), then the
   tenant's keys are removed with SCAN + DEL over ``TenantKeys(org).pattern()`` (an agent: only the keys that name
   it); on a Redis Cluster only the primary serving the org's hash-tag slot holds them, and only it is scanned.
   Cached API key records of the removed keys are deleted too; their version counters stay (a number, no tenant data)
   so a reader that loaded before the commit can only write under a version nobody reads again.
3. ClickHouse: ``ALTER TABLE ... DELETE WHERE org_id = ...`` on every MergeTree table with an ``org_id`` column,
   waiting for the mutation.

Every step is idempotent: a finalizer that is retried after a store outage repeats it and adds zero to the counts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import asyncpg

from ibex_dataplane.store.clickhouse import ClickHouse, org_query
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.keys import GlobalKeys, TenantKeys
from ibex_dataplane.store.postgres import CONNECTION_ERRORS
from ibex_dataplane.store.redis import REDIS_DOWN, RedisClient, scan_tagged, unavailable
from ibex_operator.repository import TenantConfigRepository

log = logging.getLogger(__name__)

RECORD_TABLE = "tenant_deletions"
# Rows that must outlive the purge: the deletion records themselves and the migration ledger.
_KEEP = frozenset({RECORD_TABLE, "schema_migrations"})
_LOCK_TIMEOUT = "10s"
_SCAN_BATCH = 500


@dataclass
class DeletionReport:
    """What one purge removed, per store and per table (Postgres, ClickHouse) or key family (Redis)."""

    kind: str
    namespace: str
    name: str
    org_id: UUID | None
    agent_id: UUID | None = None
    removed: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, store: str, counts: dict[str, int]) -> None:
        bucket = self.removed.setdefault(store, {})
        for what, n in counts.items():
            if n:
                bucket[what] = bucket.get(what, 0) + n

    def total(self, store: str) -> int:
        return sum(self.removed.get(store, {}).values())

    def summary(self) -> str:
        """One line for logs and Events: counts only, never content or secrets."""
        parts = []
        for store, unit in (("postgres", "rows"), ("redis", "keys"), ("clickhouse", "rows")):
            detail = ", ".join(f"{k} {v}" for k, v in sorted(self.removed.get(store, {}).items()))
            parts.append(f"{store} {self.total(store)} {unit}" + (f" ({detail})" if detail else ""))
        return "; ".join(parts)


def _quote(identifier: str) -> str:
    # Identifiers come from the catalog, never from a user; quoting keeps odd names from breaking the statement.
    return '"' + identifier.replace('"', '""') + '"'


def _deleted(status: str) -> int:
    # asyncpg returns the command tag, e.g. "DELETE 12"
    try:
        return int(status.rsplit(" ", 1)[-1])
    except ValueError:
        return 0


def _children_first(tables: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[str]:
    """Order tables so every table comes before the tables it references (cycles fall back to name order)."""
    pending = sorted(set(tables))
    parents: dict[str, set[str]] = {t: set() for t in pending}
    children: dict[str, set[str]] = {t: set() for t in pending}
    for child, parent in edges:
        if child in parents and parent in parents and child != parent:
            parents[child].add(parent)
            children[parent].add(child)
    ordered: list[str] = []
    while pending:
        ready = [t for t in pending if not (children[t] - set(ordered))]
        if not ready:  # a cycle: counts of the rest may include cascaded rows, nothing is missed
            ready = pending[:1]
        for t in ready:
            ordered.append(t)
            pending.remove(t)
    return ordered


class TenantPurger:
    """Deletes tenant data across Postgres (privileged pool), Redis and ClickHouse; records each deletion."""

    def __init__(
        self, pool: asyncpg.Pool, redis: RedisClient, clickhouse: ClickHouse, repo: TenantConfigRepository
    ) -> None:
        self._pool = pool
        self._redis = redis
        self._clickhouse = clickhouse
        self._repo = repo

    # -- public ------------------------------------------------------------------------------------------------
    async def purge_organization(self, uid: str, namespace: str, name: str, org_id: UUID | None) -> DeletionReport:
        report = DeletionReport("Organization", namespace, name, org_id)
        await self._begin(uid, report)
        if org_id is not None:
            key_ids = await self._postgres(uid, report, org_id, None)
            for key_id in key_ids:
                await self._repo.invalidate_key(key_id)
            await self._repo.invalidate_org(org_id)
            report.add("redis", await self._redis_org(org_id, key_ids))
            await self._record(uid, report)
            report.add("clickhouse", await self._clickhouse_rows(org_id, None))
            await self._record(uid, report)
        await self._complete(uid)
        log.info("purged Organization %s/%s: %s", namespace, name, report.summary())
        return report

    async def purge_agent(
        self, uid: str, namespace: str, name: str, org_id: UUID | None, agent_id: UUID | None
    ) -> DeletionReport:
        report = DeletionReport("Agent", namespace, name, org_id, agent_id)
        await self._begin(uid, report)
        if org_id is not None and agent_id is not None:
            key_ids = await self._postgres(uid, report, org_id, agent_id)
            for key_id in key_ids:
                await self._repo.invalidate_key(key_id)
            await self._repo.invalidate_org(org_id)
            await self._repo.invalidate_directive(org_id, agent_id)
            report.add("redis", await self._redis_agent(org_id, agent_id))
            await self._record(uid, report)
            report.add("clickhouse", await self._clickhouse_rows(org_id, agent_id))
            await self._record(uid, report)
        await self._complete(uid)
        log.info("purged Agent %s/%s: %s", namespace, name, report.summary())
        return report

    # -- the deletion record -----------------------------------------------------------------------------------
    async def _fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        try:
            async with self._pool.acquire() as conn:
                row: asyncpg.Record | None = await conn.fetchrow(sql, *args)
                return row
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e

    async def _begin(self, uid: str, report: DeletionReport) -> None:
        """Create the record, or count another attempt and carry over what earlier attempts removed."""
        row = await self._fetchrow(
            f"""
            INSERT INTO {RECORD_TABLE} (resource_uid, kind, namespace, name, org_id, agent_id)
            VALUES ($1, $2, $3, $4, $5, $6)
            ON CONFLICT (resource_uid) DO UPDATE SET attempts = {RECORD_TABLE}.attempts + 1,
                org_id = coalesce({RECORD_TABLE}.org_id, EXCLUDED.org_id),
                agent_id = coalesce({RECORD_TABLE}.agent_id, EXCLUDED.agent_id)
            RETURNING removed
            """,
            uid,
            report.kind,
            report.namespace,
            report.name,
            report.org_id,
            report.agent_id,
        )
        assert row is not None
        for store, counts in json.loads(row["removed"]).items():
            report.add(store, counts)

    async def _record(self, uid: str, report: DeletionReport, conn: asyncpg.Connection | None = None) -> None:
        sql = f"UPDATE {RECORD_TABLE} SET removed = $2::jsonb WHERE resource_uid = $1"
        payload = json.dumps(report.removed, sort_keys=True)
        if conn is not None:
            await conn.execute(sql, uid, payload)
            return
        try:
            async with self._pool.acquire() as c:
                await c.execute(sql, uid, payload)
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e

    async def _complete(self, uid: str) -> None:
        try:
            async with self._pool.acquire() as conn:
                await conn.execute(
                    f"UPDATE {RECORD_TABLE} SET completed_at = coalesce(completed_at, now()) WHERE resource_uid = $1",
                    uid,
                )
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e

    # -- Postgres ----------------------------------------------------------------------------------------------
    async def _tenant_tables(self, conn: asyncpg.Connection) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
        rows = await conn.fetch(
            """
            SELECT c.table_name, c.column_name
              FROM information_schema.columns c
              JOIN information_schema.tables t ON t.table_schema = c.table_schema AND t.table_name = c.table_name
             WHERE c.table_schema = 'public' AND t.table_type = 'BASE TABLE'
            """
        )
        columns: dict[str, set[str]] = {}
        for r in rows:
            columns.setdefault(r["table_name"], set()).add(r["column_name"])
        edges = await conn.fetch(
            """
            SELECT child.relname AS child, parent.relname AS parent
              FROM pg_constraint k
              JOIN pg_class child ON child.oid = k.conrelid
              JOIN pg_class parent ON parent.oid = k.confrelid
             WHERE k.contype = 'f' AND k.connamespace = 'public'::regnamespace
            """
        )
        return columns, [(e["child"], e["parent"]) for e in edges]

    async def _postgres(self, uid: str, report: DeletionReport, org_id: UUID, agent_id: UUID | None) -> list[str]:
        """Delete the rows in one transaction; returns the ids of the API keys that lost rows (to invalidate)."""
        counts: dict[str, int] = {}
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'")
                columns, edges = await self._tenant_tables(conn)
                if agent_id is None:
                    key_ids = [r["id"] for r in await conn.fetch("SELECT id FROM api_keys WHERE org_id = $1", org_id)]
                    scoped = [t for t, cols in columns.items() if "org_id" in cols and t not in _KEEP]
                    for table in _children_first([*scoped, "organizations"], edges):
                        if table == "organizations":
                            status = await conn.execute("DELETE FROM organizations WHERE id = $1", org_id)
                        else:
                            status = await conn.execute(f"DELETE FROM {_quote(table)} WHERE org_id = $1", org_id)
                        counts[table] = _deleted(status)
                else:
                    key_ids = [
                        r["key_id"]
                        for r in await conn.fetch(
                            "SELECT key_id FROM api_key_agents WHERE org_id = $1 AND agent_id = $2", org_id, agent_id
                        )
                    ]
                    scoped = [
                        t
                        for t, cols in columns.items()
                        if "org_id" in cols
                        and t not in _KEEP
                        and ("agent_id" in cols or {"scope_kind", "scope_id"} <= cols)
                    ]
                    for table in _children_first([*scoped, "agents"], edges):
                        cols = columns.get(table, set())
                        if table == "agents":
                            sql = "DELETE FROM agents WHERE org_id = $1 AND id = $2"
                        elif "agent_id" in cols:
                            sql = f"DELETE FROM {_quote(table)} WHERE org_id = $1 AND agent_id = $2"
                        else:  # per-scope rows such as budget_periods: the agent's own scope only
                            sql = (
                                f"DELETE FROM {_quote(table)}"
                                " WHERE org_id = $1 AND scope_kind = 'agent' AND scope_id = $2"
                            )
                        counts[table] = _deleted(await conn.execute(sql, org_id, agent_id))
                report.add("postgres", counts)
                await self._record(uid, report, conn)
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e
        except asyncpg.LockNotAvailableError as e:
            raise StoreUnavailable("postgres", "lock timeout while deleting tenant rows") from e
        return key_ids

    # -- Redis -------------------------------------------------------------------------------------------------
    async def _scan_delete(self, pattern: str, keep: Callable[[str], bool] | None = None) -> dict[str, int]:
        """SCAN + DEL every key matching the pattern (and the predicate); counts by key family."""
        counts: dict[str, int] = {}
        try:
            batch: list[bytes] = []
            async for raw in scan_tagged(self._redis, pattern, count=_SCAN_BATCH):
                key = raw.decode() if isinstance(raw, bytes) else str(raw)
                if keep is not None and not keep(key):
                    continue
                batch.append(raw)
                family = _family(key)
                counts[family] = counts.get(family, 0) + 1
                if len(batch) >= _SCAN_BATCH:
                    await self._redis.delete(*batch)
                    batch.clear()
            if batch:
                await self._redis.delete(*batch)
        except REDIS_DOWN as e:
            raise unavailable(e) from e
        return counts

    async def _redis_org(self, org_id: UUID, key_ids: list[str]) -> dict[str, int]:
        counts = await self._scan_delete(TenantKeys(org_id).pattern())
        for key_id in key_ids:
            for family, n in (await self._scan_delete(GlobalKeys.api_key(key_id) + ":*")).items():
                counts[family] = counts.get(family, 0) + n
        return counts

    async def _redis_agent(self, org_id: UUID, agent_id: UUID) -> dict[str, int]:
        agent = str(agent_id)
        return await self._scan_delete(TenantKeys(org_id).pattern(), keep=lambda key: agent in key.split(":"))

    # -- ClickHouse --------------------------------------------------------------------------------------------
    async def _clickhouse_rows(self, org_id: UUID, agent_id: UUID | None) -> dict[str, int]:
        rows = await self._clickhouse.admin_query(
            "SELECT t.name, groupArray(c.name) FROM system.tables AS t"
            " INNER JOIN system.columns AS c ON c.database = t.database AND c.table = t.name"
            " WHERE t.database = currentDatabase() AND endsWith(t.engine, 'MergeTree')"
            " AND c.name IN ('org_id', 'agent_id') GROUP BY t.name ORDER BY t.name"
        )
        counts: dict[str, int] = {}
        for table, cols in rows:
            if "org_id" not in cols or (agent_id is not None and "agent_id" not in cols):
                continue
            where = "org_id = {org_id:UUID}" + (" AND agent_id = {agent_id:UUID}" if agent_id is not None else "")
            params: dict[str, Any] = {"agent_id": agent_id} if agent_id is not None else {}
            name = "`" + str(table).replace("`", "``") + "`"
            found = await self._clickhouse.query(
                org_query(f"SELECT count() FROM {name} WHERE {where}", org_id, **params)
            )
            n = int(found[0][0]) if found else 0
            if n:
                await self._clickhouse.admin_query(
                    f"ALTER TABLE {name} DELETE WHERE {where} SETTINGS mutations_sync = 2", org_id=org_id, **params
                )
                counts[str(table)] = n
        return counts


def _family(key: str) -> str:
    """The family of a Redis key for the record: ``ibex:{org}:rl:agent:<id>:win`` -> ``rl``, ``ibex:apikey:..``
    -> ``apikey``."""
    parts = key.split(":")
    if len(parts) >= 3 and parts[1].startswith("{"):
        return parts[2]
    return parts[1] if len(parts) > 1 else key
