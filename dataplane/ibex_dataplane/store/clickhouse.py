"""ClickHouse access through clickhouse-connect (``chdb://`` locally, HTTP in production).

The client is synchronous, so calls never run on the event loop. Over HTTP they run on one worker thread (the
socket I/O releases the GIL). The embedded chdb engine, however, holds the GIL for milliseconds at a time, which
would stall every request of the process, so for ``chdb://`` URLs the engine lives in a dedicated child process
and calls are shipped to it (arguments and results are plain picklable values). Wherever it runs, the embedded
engine runs at the lowest CPU priority (:data:`ENGINE_NICE`), so that its bursts of work wait for a free core
instead of taking one from the requests beside it.

Inserted rows travel as one bytes block in ClickHouse's ``JSONCompactEachRow`` format, encoded on the event loop
by orjson in slices that yield to the loop between them (:func:`json_rows`), and parsed by ClickHouse. Handing the
rows over as Python values instead cost the process a multi-millisecond hold of the GIL per 1,000-row batch
(pickling them for the engine process, or clickhouse-connect's own encoding on the HTTP thread), during which no
request of the process could run (``bench/analytics_flush_bench.py``). A data path opens in one process only,
so the workers of ``ibex proxy --workers N`` do not open it: the supervisor serves its one engine to them over a
Unix socket (:class:`EngineServer`, authenticated with a per-run key) and their clients are
``ClickHouse(url, engine=EngineAddress(...))``. ClickHouse has no row-level security:
every read goes through :func:`org_query`, which refuses SQL that does not filter on ``{org_id:UUID}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, TypeVar
from uuid import UUID

import orjson

from ibex_dataplane.store.errors import StoreQueryError, StoreUnavailable, TenantKeyError

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_TIMEOUT = 60.0
"""Seconds a call may take before it counts as an outage (analytics degrade; nothing waits on a stuck engine)."""
_ORG_FILTER = re.compile(r"\borg_id\s*=\s*\{org_id:UUID\}")
ENCODE_SLICE = 100
"""Rows encoded between two yields to the event loop (bench/analytics_flush_bench.py: about 0.3 ms of work)."""
_INSERT_FORMAT = "JSONCompactEachRow"
# orjson writes datetimes as RFC 3339 ("2026-12-06T20:14:23.123456+00:00"); naive ones (no offset) are read in the
# column's time zone, as clickhouse-connect's own encoding does.
_INSERT_SETTINGS = {"date_time_input_format": "best_effort"}


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


ENGINE_NICE = 19
"""The embedded engine's CPU priority (a nice value; 19 is the lowest). Its inserts are bursts of work on several
threads (parsing a batch, writing and merging parts) that, at the default priority, take cores away from the
requests of the process beside it; analytics can wait for a free core (``bench/results/proxy_overhead.txt``)."""


def lower_priority() -> None:
    """Run the calling thread, and the threads it starts, at :data:`ENGINE_NICE` (Linux keeps a nice value per
    thread; a new thread takes its creator's). Lowering one's own priority needs no privilege."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: a platform without setpriority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENGINE_NICE)


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


def _insert(url: str, table: str, block: bytes, column_names: list[str]) -> None:
    _client(url).raw_insert(table, column_names, insert_block=block, settings=_INSERT_SETTINGS, fmt=_INSERT_FORMAT)


def _exact(value: Any) -> str:
    """orjson's fallback: Decimals as their exact text (a ``Decimal`` column parses it), and UUIDs of a subclass
    orjson does not take as one (asyncpg's); nothing else."""
    if isinstance(value, Decimal | UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not an analytics column value")


async def json_rows(rows: Iterable[Sequence[Any]]) -> bytes:
    """``rows`` as a ``JSONCompactEachRow`` block: one JSON array per row and line (UUIDs and datetimes as
    strings, Decimals exact, None as null, which ClickHouse reads as the column's default). Encoded
    :data:`ENCODE_SLICE` rows at a time, yielding to the event loop between slices, so a large batch never holds
    the loop for long. A value of another type is a :class:`StoreQueryError` (a bug of the caller's)."""
    lines: list[bytes] = []
    try:
        for i, row in enumerate(rows, 1):
            lines.append(orjson.dumps(row, default=_exact, option=orjson.OPT_APPEND_NEWLINE))
            if i % ENCODE_SLICE == 0:
                await asyncio.sleep(0)
    except TypeError as e:
        log.error("clickhouse row not encodable: %s", e)
        raise StoreQueryError("clickhouse", type(e).__name__) from e
    return b"".join(lines)


def _query(url: str, sql: str, parameters: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in _client(url).query(sql, parameters=parameters).result_rows]


def _close(url: str) -> None:
    client = _clients.pop(url, None)
    if client is not None:
        client.close()


def _consume(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()


# -- one engine served to the workers of one `ibex proxy --workers N` run -------------------------------------------

_REMOTE_CALLS: dict[str, Callable[..., Any]] = {"command": _command, "insert": _insert, "query": _query}


@dataclass(frozen=True)
class EngineAddress:
    """Where a worker reaches the engine of its supervisor: a Unix socket and the key that authenticates to it."""

    path: str
    authkey: bytes = field(repr=False)


class EngineUnavailable(OSError):
    """The engine's server cannot be reached, or it could not reach the engine (an outage, as for a server)."""


class EngineRejected(Exception):
    """The engine refused the statement (the server side's exception, by name and message)."""


class EngineServer:
    """Serve the embedded engine of ``url``, opened in this process, to the workers of one run.

    One thread per connected worker; calls run one at a time (chdb is one engine). The process serving it runs no
    event loop that the engine's hold on the GIL could stall (``ibex proxy``'s supervisor). Only the calls of
    :data:`_REMOTE_CALLS` are served, and only to peers that know ``authkey`` (multiprocessing's HMAC challenge)."""

    def __init__(self, url: str, address: EngineAddress) -> None:
        self._url = url
        self._listener = Listener(address.path, family="AF_UNIX", authkey=address.authkey)
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, name="clickhouse-engine-server", daemon=True)
        self._closed = False

    def start(self) -> None:
        self._accepting.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError) as e:  # closed, or a peer that failed the challenge
                if self._closed:
                    return
                log.warning("clickhouse engine server refused a connection: %s", type(e).__name__)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="clickhouse-engine-call", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        from clickhouse_connect.driver.exceptions import OperationalError

        lower_priority()  # the engine opens in one of these threads, and its own threads start from it
        with conn:
            while True:
                try:
                    name, args = conn.recv()
                except (EOFError, OSError):
                    return  # the worker closed its end (or exited)
                fn = _REMOTE_CALLS.get(name)
                reply: tuple[str, Any]
                if fn is None:
                    reply = ("rejected", f"unknown call {name!r}")
                else:
                    try:
                        with self._lock:
                            reply = ("ok", fn(self._url, *args))
                    except (OperationalError, OSError, TimeoutError) as e:
                        reply = ("unavailable", type(e).__name__)
                    except Exception as e:
                        reply = ("rejected", f"{type(e).__name__}: {str(e)[:500]}")
                try:
                    conn.send(reply)
                except (OSError, ValueError):
                    return

    def close(self) -> None:
        """Stop accepting and close the engine (after the workers exited: their last flushes come through here)."""
        self._closed = True
        self._listener.close()
        with self._lock:
            _close(self._url)


class _EngineClient:
    """A worker's connection to :class:`EngineServer`, used from its one ClickHouse thread (so never shared)."""

    def __init__(self, address: EngineAddress) -> None:
        self._address = address
        self._conn: Connection | None = None

    def call(self, name: str, *args: Any) -> Any:
        try:
            if self._conn is None:
                self._conn = Client(self._address.path, family="AF_UNIX", authkey=self._address.authkey)
            self._conn.send((name, args))
            status, value = self._conn.recv()
        except (OSError, EOFError) as e:
            self.close()
            raise EngineUnavailable(f"engine server unreachable: {type(e).__name__}") from e
        if status == "ok":
            return value
        if status == "unavailable":
            raise EngineUnavailable(value)
        raise EngineRejected(value)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None


class ClickHouse:
    """Async facade over a clickhouse-connect client (see the module docstring for where calls run).

    An embedded engine process that dies (killed, out of memory) fails the calls it had as an outage and is
    replaced: the next call starts a new engine process on the same data path, so analytics come back by
    themselves, as they do when a ClickHouse server returns. With ``engine``, calls go to the engine another
    process serves (:class:`EngineServer`) instead, from one thread of this process."""

    def __init__(self, url: str, *, engine: EngineAddress | None = None, call_timeout: float = CALL_TIMEOUT) -> None:
        if call_timeout <= 0:
            raise ValueError("call_timeout must be positive")
        self._url = url
        self._remote = _EngineClient(engine) if engine is not None else None
        self._call_timeout = call_timeout
        self._executor: Executor = self._new_executor()

    def _new_executor(self) -> Executor:
        if self._url.startswith("chdb:") and self._remote is None:
            return ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=lower_priority
            )
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="clickhouse")

    def _replace(self, broken: Executor) -> None:
        """Swap a broken engine process for a fresh one (once, however many calls saw it break)."""
        if self._executor is broken:
            log.warning("clickhouse engine process died; starting a new one on the next call")
            self._executor = self._new_executor()
            broken.shutdown(wait=False)

    def _hung(self, executor: Executor) -> None:
        """A call outlived the call timeout. An engine process is killed and replaced (its other calls fail as an
        outage); a thread (a server over HTTP, or the supervisor's engine) cannot be stopped, so the calls queued
        behind it time out the same way until it returns."""
        if isinstance(executor, ProcessPoolExecutor):
            log.error("clickhouse engine process did not answer within %.0fs; killing it", self._call_timeout)
            for process in list((getattr(executor, "_processes", None) or {}).values()):
                with contextlib.suppress(OSError):
                    process.kill()
            self._replace(executor)
        else:
            log.error("clickhouse call did not return within %.0fs", self._call_timeout)

    async def _run(self, executor: Executor, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``executor``, given up (and the executor dealt with, :meth:`_hung`) after the call
        timeout, so that no caller (a flush at shutdown, say) can wait on a stuck engine forever."""
        call = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        try:
            done, _ = await asyncio.wait({call}, timeout=self._call_timeout)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if not done:
            call.add_done_callback(_consume)  # its late outcome is nobody's
            self._hung(executor)
            raise TimeoutError(f"clickhouse call exceeded {self._call_timeout:.0f}s")
        return call.result()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` off the loop. Only a failure to reach the server (or the engine's process) is an outage,
        :class:`StoreUnavailable` (a call that does not return within the call timeout is one too); a statement
        the server refuses is :class:`StoreQueryError`."""
        from clickhouse_connect.driver.exceptions import OperationalError

        executor = self._executor
        try:
            if self._remote is not None:
                name = next(n for n, f in _REMOTE_CALLS.items() if f is fn)
                result: T = await self._run(executor, self._remote.call, name, *args)
                return result
            return await self._run(executor, fn, self._url, *args)
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

    async def insert(self, table: str, rows: Iterable[Sequence[Any]], column_names: Sequence[str]) -> None:
        """Insert ``rows`` (values in ``column_names`` order, taken from the iterable as they are encoded) as one
        block: see :func:`json_rows` for the encoding and the types it takes. Nothing is sent for no rows."""
        block = await json_rows(rows)
        if block:
            await self._call(_insert, table, block, list(column_names))

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
        executor = self._executor
        stuck = False
        try:
            if self._remote is not None:  # the engine is the server's to close
                await self._run(executor, self._remote.close)
            else:
                await self._run(executor, _close, self._url)
        except TimeoutError:  # a stuck engine process was killed by _run; a stuck thread cannot be waited for
            stuck = True
        except Exception as e:  # a broken engine has nothing left to close
            log.debug("clickhouse close: %s", type(e).__name__)
        self._executor.shutdown(wait=not stuck)
