"""Requests refused after the rate limiter admitted them give their token charge back: a tenant retrying refused
requests (a bad session header, an idempotent replay) must not burn its own tokens-per-minute window."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import ClientSession

from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

BODY = {"model": "echo", "messages": [{"role": "user", "content": "count my tokens"}], "max_tokens": 200}


@pytest.mark.parametrize("refusal", ["bad-session-header", "idempotent-replay"])
async def test_refused_requests_do_not_burn_the_token_window(
    proxy: RunningProxy, tenants: TenantFactory, refusal: str
) -> None:
    # Each request is admitted for about 210 tokens (prompt + max_tokens): three fit the window, eight do not.
    t = await tenants.create(
        directive=None, agent_spec={"limits": {"requestsPerMinute": 1000, "tokensPerMinute": 700},
                                    "memory": {"enabled": False}},
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    async with ClientSession() as http:

        async def post(extra: dict[str, str]) -> int:
            async with http.post(proxy.v1 + "/chat/completions", json=BODY, headers={**headers, **extra}) as r:
                await r.read()
                return r.status

        if refusal == "idempotent-replay":
            assert await post({"Idempotency-Key": "k-1"}) == 200
            refused = [await post({"Idempotency-Key": "k-1"}) for _ in range(8)]
            assert refused == [200] * 8  # replays of the stored answer
        else:
            refused = [await post({"X-IBEX-Session-ID": "not a valid id!"}) for _ in range(8)]
            assert refused == [400] * 8
        deadline = time.monotonic() + 10
        while True:  # the refunds are written after the refusals are answered
            status = await post({})
            if status != 429 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    assert status == 200
