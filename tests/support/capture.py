"""Helpers of the capture tests: chat through the proxy as an agent, list what was captured, wait for the worker."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from aiohttp import ClientSession

from ibex_dataplane.runtime.stores import Stores
from tests.support.proxy import RunningProxy
from tests.support.tenants import Tenant
from tests.support.waiting import until

__all__ = ["chat", "extracted", "headers", "jobs_of", "queued_turns", "until"]


def headers(t: Tenant, agent: str, session: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {t.keys[agent]}", "X-IBEX-Agent-ID": str(t.agents[agent]),
            "X-IBEX-Session-ID": session, **extra}  # fmt: skip


async def chat(http: ClientSession, proxy: RunningProxy, h: dict[str, str], *messages: dict[str, Any],
               stream: bool = False) -> tuple[int, str, dict[str, str]]:  # fmt: skip
    body: dict[str, Any] = {"model": "echo", "messages": list(messages)}
    if stream:
        body["stream"] = True
    async with http.post(proxy.v1 + "/chat/completions", json=body, headers=h) as r:
        text = await r.text()
        return r.status, text, dict(r.headers)


async def extracted(http: ClientSession, proxy: RunningProxy, t: Tenant, agent: str) -> list[dict[str, Any]]:
    h = headers(t, agent, "listing")
    async with http.get(proxy.v1 + "/memories", params={"source": "extracted", "limit": "100"}, headers=h) as r:
        assert r.status == 200, await r.text()
        data: list[dict[str, Any]] = (await r.json())["data"]
        return data


async def jobs_of(stores: Stores, org_id: UUID) -> list[dict[str, Any]]:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        return [dict(r) for r in await conn.fetch("SELECT * FROM capture_jobs WHERE org_id = $1", org_id)]


async def queued_turns(stores: Stores, org_id: UUID) -> list[tuple[str, int]]:
    """(session id, turn) of every capture job queued for the org, still waiting or already processed: a worker
    running for other tests deletes a job once done, after committing its claim in the idempotency ledger, so one
    snapshot of both sees every job either way."""
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT session_id, turn FROM capture_jobs WHERE org_id = $1"
            " UNION SELECT split_part(key, ':', 2), split_part(key, ':', 3)::integer FROM idempotency_keys"
            " WHERE org_id = $1 AND route = 'capture' ORDER BY 1, 2",
            org_id,
        )
    return [(r[0], r[1]) for r in rows]
