"""Liveness and readiness: ``/healthz`` answers while the process runs; ``/readyz`` checks the stores.

A store the process fails closed without (Postgres and Redis for the proxy) makes it not ready (503). A store it
only degrades without (ClickHouse: analytics rows are dropped and counted, no request is refused) is reported in
the body and under ``degraded``, and the process stays ready: taking every replica out of service for an
analytics outage would turn a degradation into a full outage."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

Check = Callable[[], Awaitable[None]]


class HealthChecks:
    def __init__(
        self, checks: dict[str, Check], *, degradable: frozenset[str] = frozenset(), timeout: float = 2.0
    ) -> None:
        self._checks = checks
        self._degradable = degradable
        self._timeout = timeout

    async def run(self) -> dict[str, str]:
        return await self.warm(self._timeout)

    async def warm(self, timeout: float = 30.0) -> dict[str, str]:
        """Run every check once with a generous timeout, at start-up: the first call to a store may have to open
        it (the embedded ClickHouse engine starts its child process on first use), and readiness must not depend
        on whether a probe happens to be the first caller. Failures are returned, not raised: readiness reports
        them."""

        async def one(check: Check) -> str:
            try:
                await asyncio.wait_for(check(), timeout)
            except Exception as e:
                return f"error: {type(e).__name__}"
            return "ok"

        names = list(self._checks)
        return dict(zip(names, await asyncio.gather(*(one(self._checks[n]) for n in names)), strict=True))

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        results = await self.run()
        ready = all(v == "ok" for name, v in results.items() if name not in self._degradable)
        degraded = sorted(name for name, v in results.items() if name in self._degradable and v != "ok")
        body: dict[str, object] = {"status": "ready" if ready else "not ready", "checks": results}
        if degraded:
            body["degraded"] = degraded
        return web.json_response(body, status=200 if ready else 503)
