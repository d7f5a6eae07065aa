"""A pooled connection whose protocol state broke (asyncpg's InternalClientError, seen when Postgres restarts
under load: "cannot switch to state 12; another operation is in progress") is an outage for that call, 503 at
the edge, never a 500, and the connection is dropped from the pool instead of being handed out again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from uuid import uuid4

import asyncpg
import pytest
import pytest_asyncio

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.postgres import Database, _TenantConnection, create_pool, postgres_errors

BROKEN = "cannot switch to state 12; another operation (2) is in progress"


@pytest_asyncio.fixture
async def db(runtime_info: RuntimeInfo, stores: Stores) -> AsyncIterator[Database]:
    """Its own pool on the session's (migrated: the vector type exists) Postgres."""
    pool = await create_pool(runtime_info.postgres_app_dsn, min_size=1, max_size=1)  # one connection: easy to follow
    try:
        yield Database(pool)
    finally:
        await pool.close()


async def backend(db: Database) -> int:
    async with db.unscoped() as conn:
        pid: int = await conn.fetchval("SELECT pg_backend_pid()")
        return pid


async def test_a_broken_connection_in_a_tenant_transaction_is_an_outage_and_leaves_the_pool(db: Database) -> None:
    before = await backend(db)

    async def statement_on_a_broken_connection() -> None:
        async with db.tenant(uuid4()):
            with postgres_errors():  # as a repository wraps its statements
                raise asyncpg.InternalClientError(BROKEN)

    with pytest.raises(StoreUnavailable):
        await statement_on_a_broken_connection()
    assert await backend(db) != before


async def test_a_broken_connection_in_one_round_trip_is_an_outage_and_leaves_the_pool(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = await backend(db)

    async def broken(self: _TenantConnection, *args: object, **kwargs: object) -> None:
        raise asyncpg.InternalClientError(BROKEN)

    with monkeypatch.context() as patched:
        patched.setattr(_TenantConnection, "fetch", broken)
        with pytest.raises(StoreUnavailable):
            await db.call_as(uuid4(), uuid4(), "SELECT $1::uuid AS org, $2::uuid AS agent")
    assert await backend(db) != before
