"""Liveness and readiness: ``/healthz`` answers while the process runs; ``/readyz`` checks the critical stores."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

Check = Callable[[], Awaitable[None]]


class HealthChecks:
    def __init__(self, checks: dict[str, Check], *, timeout: float = 2.0) -> None:
        self._checks = checks
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
        ready = all(v == "ok" for v in results.values())
        return web.json_response(
            {"status": "ready" if ready else "not ready", "checks": results}, status=200 if ready else 503
        )
