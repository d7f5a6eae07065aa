"""ClickHouse access through clickhouse-connect (``chdb://`` locally, HTTP in production).

The client is synchronous, so every call runs on one dedicated worker thread (which also serialises access to the
in-process chdb engine). ClickHouse has no row-level security: every read goes through :func:`org_query`, which
refuses SQL that does not filter on the ``{org_id:UUID}`` parameter.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar
from uuid import UUID

from ibex_dataplane.store.errors import StoreUnavailable, TenantKeyError

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


class ClickHouse:
    """Async facade over a clickhouse-connect client."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clickhouse")
        self._client: Any = None

    def _connect(self) -> Any:
        if self._client is None:
            import clickhouse_connect

            self._client = clickhouse_connect.get_client(dsn=self._url)
        return self._client

    async def _call(self, fn: Callable[[Any], T]) -> T:
        loop = asyncio.get_running_loop()

        def run() -> T:
            return fn(self._connect())

        try:
            return await loop.run_in_executor(self._executor, run)
        except Exception as e:
            if isinstance(e, TenantKeyError):
                raise
            raise StoreUnavailable("clickhouse", f"{type(e).__name__}: {str(e)[:200]}") from e

    async def command(self, sql: str) -> None:
        await self._call(lambda c: c.command(sql))

    async def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        await self._call(lambda c: c.insert(table, list(rows), column_names=list(column_names)))

    async def query(self, q: OrgQuery) -> list[tuple[Any, ...]]:
        if not isinstance(q, OrgQuery):
            raise TenantKeyError("ClickHouse reads must be built with org_query()")
        result = await self._call(lambda c: c.query(q.sql, parameters=q.parameters))
        return [tuple(r) for r in result.result_rows]

    async def admin_query(self, sql: str, **parameters: Any) -> list[tuple[Any, ...]]:
        """Cross-tenant read for migrations and the operator only."""
        result = await self._call(lambda c: c.query(sql, parameters=parameters))
        return [tuple(r) for r in result.result_rows]

    async def ping(self) -> None:
        await self._call(lambda c: c.command("SELECT 1"))

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, client.close)
        self._executor.shutdown(wait=True)
