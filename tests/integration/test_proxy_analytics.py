"""Every request leaves an analytics trace (never content); usage is reported per org and never across orgs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, cast

from aiohttp import ClientSession
from prometheus_client import CollectorRegistry

from ibex_dataplane.proxy.analytics import AnalyticsRecorder, Trace
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.clickhouse import ClickHouse, org_query
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

SECRET_WORDS = "the launch code is tangerine-42"


async def get(proxy: RunningProxy, token: str, path: str) -> tuple[int, dict[str, Any]]:
    async with (
        ClientSession() as http,
        http.get(proxy.base_url + path, headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        return r.status, await r.json()


async def test_traces_and_usage_are_recorded_per_org(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    a = await tenants.create(org_spec={"models": {"allow": ["echo"], "default": "echo"}})
    b = await tenants.create()
    headers = {"Authorization": f"Bearer {a.keys['alpha']}", "X-IBEX-Agent-ID": str(a.agents["alpha"])}
    async with ClientSession() as http:
        ok = {"model": "echo", "messages": [{"role": "user", "content": SECRET_WORDS}]}
        async with http.post(proxy.v1 + "/chat/completions", json=ok, headers=headers) as r:
            assert r.status == 200
        denied = {"model": "gpt-4o", "messages": [{"role": "user", "content": SECRET_WORDS}]}
        async with http.post(proxy.v1 + "/chat/completions", json=denied, headers=headers) as r:
            assert r.status == 403

    deadline = time.monotonic() + 10
    while True:
        status, report = await get(proxy, a.keys["alpha"], "/v1/usage?group_by=agent")
        assert status == 200
        if report["data"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert [row["key"] for row in report["data"]] == [str(a.agents["alpha"])]
    assert report["data"][0]["agent_name"] == f"alpha-{a.name.removeprefix('org-')}"  # the name people read
    assert report["data"][0]["requests"] == 1
    assert float(report["data"][0]["cost_usd"]) > 0

    traces = await stores.clickhouse.query(
        org_query(
            "SELECT status_code, error_code, model FROM llm_traces WHERE org_id = {org_id:UUID}"
            " ORDER BY ts, status_code",
            a.org_id,
        )
    )
    assert traces == [(200, "", "echo"), (403, "MODEL_NOT_ALLOWED", "gpt-4o")]
    everything = await stores.clickhouse.admin_query("SELECT * FROM llm_traces")
    assert all(SECRET_WORDS not in str(row) for row in everything), "message content reached analytics"

    status, other = await get(proxy, b.keys["alpha"], "/v1/usage?group_by=model")
    assert status == 200
    assert other["data"] == []


async def test_usage_needs_its_scope_and_valid_parameters(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(scopes=("chat",))
    status, body = await get(proxy, t.keys["alpha"], "/v1/usage")
    assert (status, body["error"]["code"]) == (403, "INSUFFICIENT_PERMISSIONS")
    u = await tenants.create()
    status, body = await get(proxy, u.keys["alpha"], "/v1/usage?group_by=planet&from=yesterday")
    assert (status, body["error"]["code"]) == (400, "VALIDATION_ERROR")
    assert {f["field"] for f in body["error"]["field_errors"]} == {"group_by", "from"}


class TrafficDuringInsert:
    """The real ClickHouse, with one more request recorded while each insert is in flight (steady traffic)."""

    def __init__(self, clickhouse: ClickHouse, recorder: Callable[[], AnalyticsRecorder], arrivals: int) -> None:
        self._ch, self._recorder, self._arrivals = clickhouse, recorder, arrivals
        self.inserts: list[tuple[str, int]] = []

    async def insert(self, table: str, rows: Iterable[Sequence[Any]], column_names: Sequence[str]) -> None:
        rows = list(rows)  # the recorder hands over a generator
        self.inserts.append((table, len(rows)))
        if self._arrivals > 0:
            self._arrivals -= 1
            self._recorder().record(a_trace())
        await self._ch.insert(table, rows, column_names)


def a_trace() -> Trace:
    org = uuid.uuid4()
    return Trace(
        org_id=org, agent_id=uuid.uuid4(), request_id=str(uuid.uuid4()), ts=datetime.now(UTC), key_id="k",
        session_id="s", route="chat.completions", model="echo", provider="echo", stream=False, status_code=200,
        error_code="", priced=True,
    )  # fmt: skip


async def test_a_flush_writes_what_was_queued_and_leaves_later_rows_for_the_next(stores: Stores) -> None:
    recorder: AnalyticsRecorder | None = None
    traffic = TrafficDuringInsert(stores.clickhouse, lambda: cast(AnalyticsRecorder, recorder), arrivals=5)
    recorder = AnalyticsRecorder(cast(ClickHouse, traffic), CollectorRegistry(), batch_size=2)
    for _ in range(3):
        recorder.record(a_trace())

    await recorder.flush()

    # Three rows queued: two batches (2 + 1), each a traces and a usage insert; the rows that arrived meanwhile
    # (one per insert) are not chased.
    assert traffic.inserts == [("llm_traces", 2), ("usage_facts", 2), ("llm_traces", 1), ("usage_facts", 1)]
    assert recorder.written._value.get() == 3
    await recorder.flush()  # the next flush takes them
    assert [n for table, n in traffic.inserts[4:] if table == "llm_traces"] == [2, 2]
