"""Sessions: echoed ids, checkpoints of hashes and counts (never text), terminate, and the idle sweeper."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from aiohttp import ClientSession

from ibex_dataplane.proxy.sessions import SessionService
from ibex_dataplane.runtime.stores import Stores
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

TEXT = "my favourite colour is vermilion"


async def test_session_turns_are_checkpointed_without_text_and_can_be_terminated(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None)
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"]),
               "X-IBEX-Session-ID": "conv-1"}  # fmt: skip
    body = {"model": "echo", "messages": [{"role": "user", "content": TEXT}]}
    async with ClientSession() as http:
        for _ in range(2):
            async with http.post(proxy.v1 + "/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                assert r.headers["X-IBEX-Session-ID"] == "conv-1"
        assert stores.admin_pool is not None
        deadline = time.monotonic() + 5
        while True:
            async with stores.admin_pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT c.turn, c.messages_sha256, c.completion_sha256, c.prompt_tokens, s.status"
                    " FROM session_checkpoints c JOIN sessions s ON s.id = c.session_id"
                    " WHERE s.org_id = $1 ORDER BY c.turn",
                    t.org_id,
                )
                dump = await conn.fetchval(
                    "SELECT string_agg(row_to_json(c)::text, ' ') FROM session_checkpoints c WHERE org_id = $1",
                    t.org_id,
                )
            if len(rows) == 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert [r["turn"] for r in rows] == [1, 2]
        assert all(len(r["messages_sha256"]) == 1 and len(r["completion_sha256"]) == 64 for r in rows)
        assert all(r["prompt_tokens"] > 0 for r in rows)
        assert TEXT not in (dump or "")

        url = proxy.v1 + "/sessions/conv-1/terminate"
        async with http.post(url, headers=headers) as r:
            assert (r.status, (await r.json())["status"]) == (200, "closed")
        async with http.post(url, headers=headers) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (404, "NOT_FOUND")
        other = await tenants.create()
        foreign = {"Authorization": f"Bearer {other.keys['alpha']}", "X-IBEX-Agent-ID": str(other.agents["alpha"])}
        async with http.post(url, headers=foreign) as r:
            assert r.status == 404


async def test_idle_sessions_are_closed_by_the_sweeper(tenants: TenantFactory, stores: Stores) -> None:
    t = await tenants.create(directive=None)
    sessions = SessionService(stores.db)
    await sessions.record_turn(
        t.org_id, t.agents["alpha"], "idle-1", request_id="r1", message_digests=["a"], completion_digest=None,
        prompt_tokens=1, completion_tokens=1, latency_ms=1.0,
    )  # fmt: skip
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        await conn.execute(
            "UPDATE sessions SET last_activity_at = now() - interval '2 hours' WHERE org_id = $1", t.org_id
        )
    assert await sessions.sweep_idle(timedelta(hours=1)) >= 1
    async with stores.admin_pool.acquire() as conn:
        status = await conn.fetchval("SELECT status FROM sessions WHERE org_id = $1", t.org_id)
    assert status == "closed"
    # A later turn with the same id opens the session again (docs/concepts.md, "Session").
    turn = await sessions.record_turn(
        t.org_id, t.agents["alpha"], "idle-1", request_id="r2", message_digests=["b"], completion_digest=None,
        prompt_tokens=1, completion_tokens=1, latency_ms=1.0,
    )  # fmt: skip
    async with stores.admin_pool.acquire() as conn:
        status = await conn.fetchval("SELECT status FROM sessions WHERE org_id = $1", t.org_id)
    assert (turn, status) == (2, "active")
