"""Sessions: echoed ids, checkpoints of hashes and counts (never text), terminate, and the idle sweeper."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from decimal import Decimal
from typing import Any

from aiohttp import ClientSession

from ibex_dataplane.proxy.capture import CaptureRequest
from ibex_dataplane.proxy.sessions import SessionService, Turn
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.shared.budget import BudgetPolicy, BudgetService, Enforcement
from ibex_dataplane.shared.budget_repository import HoldStatus
from tests.support.capture import queued_turns
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


async def settled_turn(stores: Stores, tenants: TenantFactory, capture: CaptureRequest | None) -> tuple[Any, ...]:
    """Settle a fresh hold together with a checkpoint; returns what the call said, the hold and the session rows."""
    t = await tenants.create(directive=None)
    budgets = BudgetService(stores.db)
    policy = BudgetPolicy(org_limit_usd=Decimal("1.00"), agent_limit_usd=None, enforcement=Enforcement.HARD_CAP)
    hold = await budgets.hold(t.org_id, t.agents["alpha"], "srv-1", Decimal("0.10"), policy)
    settlement = budgets.settlement(hold, Decimal("0.03"), model="echo", prompt_tokens=7, completion_tokens=5)
    turn = Turn("conv-9", "req-9", ["d1", "d2"], "c1", 7, 5, 12.5, capture)
    [written] = await SessionService(stores.db).settle_and_record_turns(
        t.org_id, t.agents["alpha"], [(settlement, turn)]
    )
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        held = await conn.fetchrow("SELECT status, actual_usd FROM budget_holds WHERE id = $1", hold.id)
        ledger = await conn.fetchval("SELECT count(*) FROM budget_ledger WHERE org_id = $1", t.org_id)
        checkpoints = await conn.fetch(
            "SELECT turn, request_id, messages_sha256, prompt_tokens, completion_tokens FROM session_checkpoints"
            " WHERE org_id = $1",
            t.org_id,
        )
    jobs = len(await queued_turns(stores, t.org_id))
    return written, held, ledger, checkpoints, jobs


async def test_an_answer_settles_and_checkpoints_in_one_statement(tenants: TenantFactory, stores: Stores) -> None:
    capture = CaptureRequest("turns", None, [{"role": "user", "content": "hello"}], None)
    written, held, ledger, checkpoints, jobs = await settled_turn(stores, tenants, capture)
    assert (written.hold_before, written.turn, written.checkpoint_error) == (HoldStatus.HELD, 1, None)
    assert (held["status"], held["actual_usd"], ledger) == ("settled", Decimal("0.03"), 1)
    assert [tuple(r) for r in checkpoints] == [(1, "req-9", ["d1", "d2"], 7, 5)]
    assert jobs == 1


async def test_a_checkpoint_that_fails_leaves_the_settle_standing(tenants: TenantFactory, stores: Stores) -> None:
    # A capture mode the queue refuses (CHECK constraint) fails the checkpoint's subtransaction only.
    broken = CaptureRequest("bogus", None, [{"role": "user", "content": "hello"}], None)
    written, held, ledger, checkpoints, jobs = await settled_turn(stores, tenants, broken)
    assert (written.hold_before, written.turn, written.checkpoint_error) == (HoldStatus.HELD, None, "23514")
    assert (held["status"], held["actual_usd"], ledger) == ("settled", Decimal("0.03"), 1)
    assert checkpoints == [] and jobs == 0  # the turn and its job went together
