"""ClickHouse failures say what happened: a refused statement is a query error (a bug), only an unreachable
engine is an outage, and neither carries the driver's text into what a client could see."""

from __future__ import annotations

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
