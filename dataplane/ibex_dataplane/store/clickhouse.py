"""ClickHouse access through clickhouse-connect (``chdb://`` locally, HTTP in production).

The client is synchronous, so calls never run on the event loop. Over HTTP they run on one worker thread (the
socket I/O releases the GIL). The embedded chdb engine, however, holds the GIL for milliseconds at a time, which
would stall every request of the process, so for ``chdb://`` URLs the engine lives in a dedicated child process
and calls are shipped to it (rows and results are plain picklable values). ClickHouse has no row-level security:
every read goes through :func:`org_query`, which refuses SQL that does not filter on ``{org_id:UUID}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import re
from collections.abc import Callable, Sequence
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar
from uuid import UUID

from ibex_dataplane.store.errors import StoreQueryError, StoreUnavailable, TenantKeyError

log = logging.getLogger(__name__)
T = TypeVar("T")
_ORG_FILTER = re.compile(r"\borg_id\s*=\s*\{org_id:UUID\}")


@dataclass(frozen=True)
class OrgQuery:
    """A read that is guaranteed to be filtered by one organization."""

    sql: str
    parameters: dict[str, Any] = field(default_factory=dict)


def org_query(sql: str, org_id: UUID, **parameters: Any) -> OrgQuery:
    """Build the only kind of read the analytics store accepts: one that filters on the caller's org."""
    if not isinstance(org_id, UUID):
        raise TenantKeyError("ClickHouse queries need the org id as a UUID")
    if not _ORG_FILTER.search(sql):
        raise TenantKeyError("ClickHouse query must filter with 'org_id = {org_id:UUID}'")
    return OrgQuery(sql=sql, parameters={**parameters, "org_id": org_id})


# -- the calls, as top-level functions so they can run in a child process ------------------------------------------

_clients: dict[str, Any] = {}  # url -> client, per process (the parent's worker thread, or the chdb child)


def _client(url: str) -> Any:
    client = _clients.get(url)
    if client is None:
        import clickhouse_connect

        client = _clients[url] = clickhouse_connect.get_client(dsn=url)
    return client


def _command(url: str, sql: str) -> None:
    _client(url).command(sql)


def _insert(url: str, table: str, rows: list[list[Any]], column_names: list[str]) -> None:
    _client(url).insert(table, rows, column_names=column_names)


def _query(url: str, sql: str, parameters: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in _client(url).query(sql, parameters=parameters).result_rows]


def _close(url: str) -> None:
    client = _clients.pop(url, None)
    if client is not None:
        client.close()


class ClickHouse:
    """Async facade over a clickhouse-connect client (see the module docstring for where calls run).

    An embedded engine process that dies (killed, out of memory) fails the calls it had as an outage and is
    replaced: the next call starts a new engine process on the same data path, so analytics come back by
    themselves, as they do when a ClickHouse server returns."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._executor: Executor = self._new_executor()

    def _new_executor(self) -> Executor:
        if self._url.startswith("chdb:"):
            return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="clickhouse")

    def _replace(self, broken: Executor) -> None:
        """Swap a broken engine process for a fresh one (once, however many calls saw it break)."""
        if self._executor is broken:
            log.warning("clickhouse engine process died; starting a new one on the next call")
            self._executor = self._new_executor()
            broken.shutdown(wait=False)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` off the loop. Only a failure to reach the server (or the engine's process) is an outage,
        :class:`StoreUnavailable`; a statement the server refuses is :class:`StoreQueryError`."""
        from clickhouse_connect.driver.exceptions import OperationalError

        loop = asyncio.get_running_loop()
        executor = self._executor
        try:
            return await loop.run_in_executor(executor, fn, self._url, *args)
        except BrokenExecutor as e:
            self._replace(executor)
            raise StoreUnavailable("clickhouse", type(e).__name__) from e
        except (OperationalError, OSError, TimeoutError) as e:
            raise StoreUnavailable("clickhouse", type(e).__name__) from e
        except Exception as e:
            log.error("clickhouse rejected a statement: %s: %s", type(e).__name__, str(e)[:500])
            raise StoreQueryError("clickhouse", type(e).__name__) from e

    async def command(self, sql: str) -> None:
        await self._call(_command, sql)

    async def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        await self._call(_insert, table, [list(r) for r in rows], list(column_names))

    async def query(self, q: OrgQuery) -> list[tuple[Any, ...]]:
        if not isinstance(q, OrgQuery):
            raise TenantKeyError("ClickHouse reads must be built with org_query()")
        return await self._call(_query, q.sql, q.parameters)

    async def admin_query(self, sql: str, **parameters: Any) -> list[tuple[Any, ...]]:
        """Cross-tenant read for migrations and the operator only."""
        return await self._call(_query, sql, parameters)

    async def ping(self) -> None:
        await self._call(_command, "SELECT 1")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(self._executor, _close, self._url)
        self._executor.shutdown(wait=True)
