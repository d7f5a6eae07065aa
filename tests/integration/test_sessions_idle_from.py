"""A session's next turn rewrites no index entry, and the idle sweeper closes what it closed before (migration 0044).

Both writers of turns (the batch settle of the proxy's answers and the one-by-one path) update the session's row
as a heap-only tuple when the turn comes within a minute of the row's ``idle_from``; ``idle_from`` stays within a
minute below ``last_activity_at`` whatever writes the row; the sweeper closes a session by its exact last activity,
not by ``idle_from``; and the migration fills ``idle_from`` in for sessions that exist before it.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import orjson

from ibex_dataplane.proxy.sessions import _SETTLE_TURNS, _TURN, SessionService, Turn
from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_postgres
from tests.integration.test_migrations import database_before, tenant_before
from tests.support.tenants import TenantFactory

# This backend's counts of updates of the table not yet sent to the statistics (they only grow in a transaction).
UPDATES = (
    "SELECT pg_stat_get_xact_tuples_updated('sessions'::regclass) AS updated,"
    " pg_stat_get_xact_tuples_hot_updated('sessions'::regclass) AS hot"
)
ROW = "SELECT status, turn_count, idle_from, last_activity_at FROM sessions WHERE org_id = $1 AND external_id = $2"


def one_by_one(conn: asyncpg.Connection, org: uuid.UUID, agent: uuid.UUID, session: str) -> Any:
    turn = Turn(session, f"req_{uuid.uuid4().hex}", ["a"], None, 1, 1, 1.0)
    # The statement SessionService.record_turn sends, here inside the caller's transaction.
    return conn.fetchval(f"SELECT ibex_session_turn_capture_as($1, $2, {_TURN})", org, agent, *turn.args())


async def batch(conn: asyncpg.Connection, org: uuid.UUID, agent: uuid.UUID, session: str) -> Any:
    # A hold that does not exist settles nothing (its status is NULL); the checkpoint is written all the same.
    item = {
        "hold": str(uuid.uuid4()), "actual": "0", "model": "m", "prompt_tokens": 1, "completion_tokens": 1,
        "session": session, "request_id": f"req_{uuid.uuid4().hex}", "messages": ["a"], "completion": None,
        "latency_ms": 1.0, "mode": None, "capture_model": None, "capture": None, "observed_at": None,
    }  # fmt: skip
    # The statement SessionService.settle_and_record_turns sends, here inside the caller's transaction.
    rows = await conn.fetch(_SETTLE_TURNS, org, agent, orjson.dumps([item]).decode(), timedelta(hours=1))
    return rows[0]["turn"]


async def test_a_later_turn_is_a_heap_only_update_on_both_paths(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    for write in (one_by_one, batch):
        session = f"hot-{write.__name__}"
        async with stores.db.tenant(t.org_id, agent) as conn:
            assert await write(conn, t.org_id, agent, session) == 1  # the row is inserted
        async with stores.db.tenant(t.org_id, agent) as conn:
            before = await conn.fetchrow(UPDATES)
            assert await write(conn, t.org_id, agent, session) == 2
            after = await conn.fetchrow(UPDATES)
        # The session's row updated once, heap-only.
        assert (after["updated"] - before["updated"], after["hot"] - before["hot"]) == (1, 1), write.__name__


async def test_idle_from_follows_last_activity_within_a_minute(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    async with stores.db.tenant(t.org_id, agent) as conn:
        await batch(conn, t.org_id, agent, "follow")
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as admin:
        status, turns, idle_from, last = await admin.fetchrow(ROW, t.org_id, "follow")
        assert (status, turns, idle_from) == ("active", 1, last)
        # A turn two minutes after idle_from moves it to the turn's time.
        await admin.execute(
            "UPDATE sessions SET last_activity_at = last_activity_at - interval '2 minutes' WHERE org_id = $1",
            t.org_id,
        )
        _, _, idle_from, last = await admin.fetchrow(ROW, t.org_id, "follow")
        assert idle_from == last  # moved backwards: idle_from with it
        async with stores.db.tenant(t.org_id, agent) as conn:
            await batch(conn, t.org_id, agent, "follow")
        _, turns, idle_from, last = await admin.fetchrow(ROW, t.org_id, "follow")
        assert (turns, idle_from) == (2, last)
        # Thirty seconds later (as written by hand): idle_from stays, last_activity_at moves.
        await admin.execute(
            "UPDATE sessions SET last_activity_at = idle_from + interval '30 seconds' WHERE org_id = $1", t.org_id
        )
        _, _, kept, later = await admin.fetchrow(ROW, t.org_id, "follow")
        assert (kept, later - kept) == (idle_from, timedelta(seconds=30))
        # A direct write of idle_from cannot break the bound either: the trigger keeps the value that holds it.
        await admin.execute("UPDATE sessions SET idle_from = now() + interval '1 day' WHERE org_id = $1", t.org_id)
        _, _, idle_from, last = await admin.fetchrow(ROW, t.org_id, "follow")
        assert (idle_from, last) == (kept, later)


async def test_the_sweeper_closes_by_last_activity_not_by_idle_from(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    async with stores.db.tenant(t.org_id, agent) as conn:
        for session in ("idle", "recent"):
            await one_by_one(conn, t.org_id, agent, session)
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as admin:
        # Both idle for an hour and twenty seconds; then "recent" active thirty seconds later, which leaves its
        # idle_from where it was, past the hour.
        await admin.execute(
            "UPDATE sessions SET last_activity_at = now() - interval '60 minutes 20 seconds' WHERE org_id = $1",
            t.org_id,
        )
        await admin.execute(
            "UPDATE sessions SET last_activity_at = last_activity_at + interval '30 seconds'"
            " WHERE org_id = $1 AND external_id = 'recent'",
            t.org_id,
        )
        before = {r["external_id"]: r for r in await admin.fetch(
            "SELECT external_id, idle_from, last_activity_at, now() - interval '1 hour' AS cutoff FROM sessions"
            " WHERE org_id = $1", t.org_id)}  # fmt: skip
        recent = before["recent"]
        assert recent["idle_from"] < recent["cutoff"] < recent["last_activity_at"]
        await SessionService(stores.db).sweep_idle(timedelta(hours=1))
        closed = dict(await admin.fetch("SELECT external_id, status FROM sessions WHERE org_id = $1", t.org_id))
    assert closed == {"idle": "closed", "recent": "active"}


async def test_the_migration_fills_idle_from_in(runtime_info: RuntimeInfo, tmp_path: Path) -> None:
    dsn = await database_before(runtime_info, tmp_path, 44)
    org, agent = tenant_before(44)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO sessions (org_id, agent_id, external_id, last_activity_at)"
            " VALUES ($1, $2, 'old', '2026-01-02T03:04:05Z')",
            org, agent,
        )  # fmt: skip
        assert 44 in await migrate_postgres(dsn, default_migrations_dir() / "postgres")
        idle_from, last = await conn.fetchrow("SELECT idle_from, last_activity_at FROM sessions")
        indexes = {r["indexname"] for r in await conn.fetch("SELECT indexname FROM pg_indexes"
                                                             " WHERE tablename = 'sessions'")}  # fmt: skip
    finally:
        await conn.close()
    assert idle_from == last
    assert "sessions_idle_from" in indexes and "sessions_idle" not in indexes
