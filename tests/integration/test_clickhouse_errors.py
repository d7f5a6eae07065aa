"""ClickHouse failures say what happened: a refused statement is a query error (a bug), only an unreachable
engine is an outage, and neither carries the driver's text into what a client could see."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.errors import StoreQueryError, StoreUnavailable


@pytest.mark.parametrize(
    "sql",
    ["SELEC 1", "SELECT toUUID('not-a-uuid')", "SELECT * FROM no_such_table_anywhere"],
    ids=["syntax", "type", "unknown-table"],
)
async def test_a_refused_statement_is_a_query_error_not_an_outage(stores: Stores, sql: str) -> None:
    with pytest.raises(StoreQueryError) as caught:
        await stores.clickhouse.admin_query(sql)
    assert not isinstance(caught.value, StoreUnavailable)
    assert str(caught.value) == "clickhouse rejected a statement (DatabaseError)"  # no driver text
    await stores.clickhouse.ping()  # and the engine is still fine


async def test_an_unreachable_server_is_an_outage() -> None:
    unreachable = ClickHouse("http://127.0.0.1:9/")  # discard port: nothing listens
    try:
        with pytest.raises(StoreUnavailable):
            await unreachable.ping()
    finally:
        await unreachable.close()


async def test_a_killed_engine_process_is_an_outage_and_a_new_one_takes_over(tmp_path: Path) -> None:
    """The embedded engine runs in a child process: when it dies, calls fail as an outage, then the facade
    starts a new engine on the same data path (before, every later call failed until the process restarted)."""
    clickhouse = ClickHouse(f"chdb://{tmp_path / 'analytics'}")
    try:
        await clickhouse.command("CREATE TABLE kept (n UInt8) ENGINE = MergeTree ORDER BY n")
        await clickhouse.insert("kept", [[1]], ["n"])
        (engine,) = clickhouse._executor._processes  # type: ignore[attr-defined]
        os.kill(engine, signal.SIGKILL)
        with pytest.raises(StoreUnavailable):
            await clickhouse.ping()
        rows = await _once_a_new_engine_answers(clickhouse, "SELECT n FROM kept")
        assert rows == [(1,)]  # the data survived: same path, new process
        assert engine not in clickhouse._executor._processes  # type: ignore[attr-defined]
    finally:
        await clickhouse.close()


async def test_a_stuck_engine_process_is_an_outage_and_is_replaced(tmp_path: Path) -> None:
    """An engine that stops answering (here: stopped with SIGSTOP) must not hold a caller forever, a flush at
    shutdown included: the call fails as an outage after the call timeout, the stuck process is killed, and the
    next calls get a new engine on the same data path."""
    clickhouse = ClickHouse(f"chdb://{tmp_path / 'analytics'}", call_timeout=3)
    try:
        await clickhouse.command("CREATE TABLE kept (n UInt8) ENGINE = MergeTree ORDER BY n")
        await clickhouse.insert("kept", [[7]], ["n"])
        (engine,) = clickhouse._executor._processes  # type: ignore[attr-defined]
        os.kill(engine, signal.SIGSTOP)
        with pytest.raises(StoreUnavailable) as caught:
            await clickhouse.insert("kept", [[8]], ["n"])
        assert str(caught.value) == "clickhouse unavailable: TimeoutError"
        rows = await _once_a_new_engine_answers(clickhouse, "SELECT n FROM kept ORDER BY n")
        assert rows[0] == (7,)  # what was written before the engine got stuck is still there
        assert engine not in clickhouse._executor._processes  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60
        while _alive(engine):  # killed and reaped by the old pool, not left stopped
            assert time.monotonic() < deadline, "the stuck engine process was left behind"
            await asyncio.sleep(0.1)
    finally:
        await clickhouse.close()


def test_the_call_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="call_timeout"):
        ClickHouse("chdb:///nowhere", call_timeout=0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _once_a_new_engine_answers(clickhouse: ClickHouse, sql: str) -> list[tuple[object, ...]]:
    """``sql``'s rows as soon as the facade's next engine process answers (the broken one fails as an outage)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await clickhouse.admin_query(sql)
        except StoreUnavailable:
            assert time.monotonic() < deadline, "no new engine process took over"
            await asyncio.sleep(0.1)
