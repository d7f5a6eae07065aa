"""Postgres access: the asyncpg pool and the tenant transaction, the only way data-plane code reaches tenant tables.

Every pooled connection registers the pgvector codec. :meth:`Database.tenant` opens a transaction that first runs
``SET LOCAL app.org_id`` (and ``app.agent_id`` when given), so row-level security scopes every statement in it;
the settings die with the transaction, so nothing leaks to the next user of the connection. Repositories take the
connection this yields and own their SQL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from uuid import UUID

import asyncpg
from pgvector.asyncpg import register_vector

from ibex_dataplane.store.errors import StoreUnavailable

log = logging.getLogger(__name__)

# Errors that mean "the database is not there" rather than "the statement is wrong".
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.exceptions.OperatorInterventionError,  # admin shutdown, crash shutdown, cannot connect now
    # A pooled connection whose protocol state went inconsistent, seen when Postgres restarts under load ("cannot
    # switch to state 12; another operation is in progress"): that connection is gone for good, the database is not.
    asyncpg.InternalClientError,
)


def _broken(e: BaseException) -> bool:
    """An error (or the one a repository wrapped) after which the connection must not go back to the pool."""
    return isinstance(e, asyncpg.InternalClientError) or isinstance(e.__cause__, asyncpg.InternalClientError)


@contextmanager
def postgres_errors() -> Iterator[None]:
    """Inside: a lost or unreachable database surfaces as :class:`StoreUnavailable` (the edges answer 503)."""
    try:
        yield
    except CONNECTION_ERRORS as e:
        raise StoreUnavailable("postgres", type(e).__name__) from e


_SET_SCOPE = "SELECT set_config('app.org_id', $1, true), set_config('app.agent_id', $2, true)"


class _TenantConnection(asyncpg.Connection):  # type: ignore[misc]
    """Pooled connection without asyncpg's reset query on release (saves a round trip per use).

    Safe because tenant scope is only ever set with ``set_config(..., true)``, which dies with the transaction,
    and the data plane takes no session-level state (advisory locks, LISTEN, cursors, SET) on pooled connections.
    A connection released inside a transaction is still rolled back by asyncpg.
    """

    def get_reset_query(self) -> str:
        return ""


async def _init_connection(conn: asyncpg.Connection) -> None:
    await register_vector(conn)


COMMAND_TIMEOUT = 30.0
"""Seconds one statement may run on a pooled connection."""
ACQUIRE_TIMEOUT = COMMAND_TIMEOUT
"""Seconds a caller that names no timeout may wait for a free connection: no wait for the pool is unbounded, so a
pool drained by connections that never come back (a bug) fails its callers with a timeout instead of hanging them."""


class BoundedPool(asyncpg.Pool):  # type: ignore[misc]
    """An asyncpg pool whose :meth:`acquire` without a timeout waits at most :data:`ACQUIRE_TIMEOUT` seconds."""

    def acquire(self, *, timeout: float | None = None) -> Any:
        return super().acquire(timeout=ACQUIRE_TIMEOUT if timeout is None else timeout)


async def create_pool(
    dsn: str, *, min_size: int = 2, max_size: int = 10, application_name: str = "ibex", timeout: float = 10.0
) -> asyncpg.Pool:
    """Open a pool; raises StoreUnavailable when Postgres cannot be reached."""
    with postgres_errors():
        pool: asyncpg.Pool = await BoundedPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            max_queries=50000,  # asyncpg.create_pool's defaults for what Pool itself requires
            max_inactive_connection_lifetime=300.0,
            loop=None,
            init=_init_connection,
            connection_class=_TenantConnection,
            record_class=asyncpg.Record,
            timeout=timeout,
            command_timeout=COMMAND_TIMEOUT,
            server_settings={"application_name": application_name},
        )
    return pool


async def close_pool(pool: asyncpg.Pool, timeout: float = 10.0) -> None:
    """Close ``pool``, waiting up to ``timeout`` for connections in use to come back, then terminating them: a
    connection held by a task that never finishes (a bug) must not hold up a process's shutdown forever."""
    try:
        await asyncio.wait_for(pool.close(), timeout)
    except TimeoutError:
        log.warning("postgres pool: connections still in use %gs into its close; terminating them", timeout)
        pool.terminate()


class Database:
    """The data plane's handle on Postgres. Wraps one pool; hands out tenant-scoped transactions."""

    def __init__(self, pool: asyncpg.Pool, *, acquire_timeout: float = 5.0) -> None:
        self._pool = pool
        self._acquire_timeout = acquire_timeout

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    @asynccontextmanager
    async def tenant(
        self, org_id: UUID, agent_id: UUID | None = None, *, readonly: bool = False
    ) -> AsyncIterator[asyncpg.Connection]:
        """A transaction acting for one org (and optionally one agent): RLS applies to everything inside."""
        if not isinstance(org_id, UUID):
            raise TypeError("tenant transactions need the org id as a UUID")
        with postgres_errors():
            conn_cm = self._pool.acquire(timeout=self._acquire_timeout)
            conn = await conn_cm.__aenter__()
        try:
            try:
                with postgres_errors():
                    tx = conn.transaction(readonly=readonly)
                    await tx.start()
                    await conn.execute(_SET_SCOPE, str(org_id), str(agent_id) if agent_id else "")
            except StoreUnavailable as e:
                if _broken(e):
                    conn.terminate()
                raise
            try:
                yield conn
            except BaseException as e:
                if _broken(e):
                    conn.terminate()  # no rollback on a broken protocol: the server ends the transaction with it
                elif not conn.is_closed():
                    await tx.rollback()
                raise
            else:
                with postgres_errors():
                    await tx.commit()
        finally:
            await conn_cm.__aexit__(None, None, None)

    async def call_as(self, org_id: UUID, agent_id: UUID | None, sql: str, *args: object) -> asyncpg.Record | None:
        """One round trip: a single statement calling a ``*_as(p_org, p_agent, ...)`` database function.

        Those functions (migrations, ``*_as``) begin by setting ``app.org_id``/``app.agent_id`` from their first
        two arguments, exactly as :meth:`tenant` does, and run as the caller, so row-level security applies to
        everything they touch; the statement is its own transaction. For the hot path, where the three round
        trips of an explicit transaction (BEGIN + scope, statement, COMMIT) are too many.
        """
        rows = await self._call_as(org_id, agent_id, sql, args)
        return rows[0] if rows else None

    async def call_as_rows(self, org_id: UUID, agent_id: UUID | None, sql: str, *args: object) -> list[asyncpg.Record]:
        """:meth:`call_as` for a ``*_as`` function that returns a set: every row, in order."""
        return await self._call_as(org_id, agent_id, sql, args)

    async def _call_as(
        self, org_id: UUID, agent_id: UUID | None, sql: str, args: tuple[object, ...]
    ) -> list[asyncpg.Record]:
        if not isinstance(org_id, UUID) or (agent_id is not None and not isinstance(agent_id, UUID)):
            raise TypeError("call_as needs UUIDs")
        if "$1" not in sql or "$2" not in sql:
            raise ValueError("call_as statements pass the org as $1 and the agent as $2")
        with postgres_errors():
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                try:
                    rows: list[asyncpg.Record] = await conn.fetch(sql, org_id, agent_id, *args)
                except asyncpg.InternalClientError:
                    conn.terminate()  # the pool replaces a closed connection instead of handing this one out
                    raise
                return rows

    @asynccontextmanager
    async def unscoped(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection with no tenant set: row-level security shows it zero tenant rows.

        Only for what runs before the tenant is known (the SECURITY DEFINER key lookup) and for health checks.
        """
        with postgres_errors():
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                try:
                    yield conn
                except BaseException as e:
                    if _broken(e):
                        conn.terminate()
                    raise

    async def ping(self) -> None:
        async with self.unscoped() as conn:
            with postgres_errors():
                await conn.fetchval("SELECT 1", timeout=2)

    async def close(self) -> None:
        await close_pool(self._pool)
