"""Rows reach ClickHouse as a JSON block encoded on the event loop (store/clickhouse.py): every column type the
analytics tables use comes back as it went in, a value the encoding does not know is refused before anything is
sent, and a large batch lets other work run while it is encoded."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from ibex_dataplane.proxy.analytics import TRACE_COLUMNS, USAGE_COLUMNS
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.clickhouse import ENCODE_SLICE, json_rows, org_query
from ibex_dataplane.store.errors import StoreQueryError, StoreUnavailable


def trace(org: uuid.UUID, request_id: str, ts: datetime, **changes: object) -> list[object]:
    row: dict[str, object] = {
        "org_id": org, "agent_id": uuid.uuid4(), "request_id": request_id, "ts": ts, "key_id": "key-1",
        "session_id": "s-1", "route": "/v1/chat/completions", "model": "m", "provider": "p", "stream": 1,
        "status_code": 200, "error_code": "", "prompt_tokens": 12, "completion_tokens": 34,
        "cost_usd": Decimal("0.00012345"), "latency_ms": 1.25, "upstream_ms": 0.5,
        "stage_ms": {"rate_limit": 0.125, "budget_hold": 0.25}, "memories_injected": 3, "context_tokens": 456,
        "context_degraded": 0, "degradations": ["context_timeout"], "captured": 1,
    }  # fmt: skip
    row.update(changes)
    return [row[c] for c in TRACE_COLUMNS]


async def test_every_column_type_comes_back_as_it_went_in(stores: Stores) -> None:
    org = uuid.uuid4()
    plus_two = timezone(timedelta(hours=2))
    rows = [
        trace(org, "r-utc", datetime(2026, 12, 6, 20, 14, 23, 123000, tzinfo=UTC)),
        # Another offset is stored as the same instant in UTC; a naive time is read as UTC (the column's zone).
        trace(org, "r-offset", datetime(2026, 12, 6, 22, 14, 23, 456000, tzinfo=plus_two)),
        trace(org, "r-naive", datetime(2026, 12, 6, 20, 14, 23), stage_ms={}, degradations=[]),
        # None in a non-nullable column is the column's default; the largest Decimal(18, 8) stays exact.
        trace(
            org,
            "r-defaults",
            datetime(2026, 12, 6, tzinfo=UTC),
            session_id=None,
            error_code=None,
            cost_usd=Decimal("9999999999.99999999"),
        ),
    ]
    await stores.clickhouse.insert("llm_traces", rows, TRACE_COLUMNS)
    got = await stores.clickhouse.query(
        org_query(
            "SELECT request_id, ts, session_id, error_code, cost_usd, stage_ms, degradations, agent_id, captured "
            "FROM llm_traces WHERE org_id = {org_id:UUID} ORDER BY request_id",
            org,
        )
    )
    by_id = {r[0]: r[1:] for r in got}
    assert set(by_id) == {"r-utc", "r-offset", "r-naive", "r-defaults"}
    assert by_id["r-utc"][0] == datetime(2026, 12, 6, 20, 14, 23, 123000)
    assert by_id["r-offset"][0] == datetime(2026, 12, 6, 20, 14, 23, 456000)
    assert by_id["r-naive"][0] == datetime(2026, 12, 6, 20, 14, 23)
    assert by_id["r-utc"][1:6] == ("s-1", "", Decimal("0.00012345"), {"rate_limit": 0.125, "budget_hold": 0.25},
                                   ["context_timeout"])  # fmt: skip
    assert by_id["r-naive"][4:6] == ({}, [])
    assert by_id["r-defaults"][1:4] == ("", "", Decimal("9999999999.99999999"))
    sent = {r[TRACE_COLUMNS.index("request_id")]: r for r in rows}
    for request_id, back in by_id.items():
        assert back[6] == sent[request_id][TRACE_COLUMNS.index("agent_id")] and back[7] == 1


async def test_a_value_the_encoding_does_not_know_is_refused_and_nothing_is_written(stores: Stores) -> None:
    org = uuid.uuid4()
    good = [org, uuid.uuid4(), "u-good", datetime.now(UTC), "m", 1, 2, Decimal("0.1")]
    bad = [org, uuid.uuid4(), "u-bad", datetime.now(UTC), "m", 1, 2, object()]
    with pytest.raises(StoreQueryError) as caught:
        await stores.clickhouse.insert("usage_facts", [good, bad], USAGE_COLUMNS)
    assert not isinstance(caught.value, StoreUnavailable)  # a bug of the caller's, not an outage
    count = await stores.clickhouse.query(
        org_query("SELECT count() FROM usage_facts WHERE org_id = {org_id:UUID}", org)
    )
    assert count == [(0,)]


async def test_no_rows_send_nothing(stores: Stores) -> None:
    await stores.clickhouse.insert("no_such_table_anywhere", [], ["n"])  # no statement: no error for the table


async def test_a_large_batch_lets_other_tasks_run_while_it_is_encoded() -> None:
    rows = [[uuid.uuid4(), i, Decimal(i) / 100] for i in range(4 * ENCODE_SLICE)]
    turns = 0
    done = False

    async def other_task() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_task())
    await asyncio.sleep(0)  # the other task is running
    started = turns
    block = await json_rows(rows)
    done = True
    await other
    assert turns - started >= 3  # it ran between the four slices
    lines = block.splitlines()
    assert len(lines) == len(rows)
    assert lines[7] == f'["{rows[7][0]}",7,"0.07"]'.encode()
