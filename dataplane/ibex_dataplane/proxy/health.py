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
        async def one(check: Check) -> str:
            try:
                await asyncio.wait_for(check(), self._timeout)
            except Exception as e:
                return f"error: {type(e).__name__}"
            return "ok"

        names = list(self._checks)
        results = await asyncio.gather(*(one(self._checks[n]) for n in names))
        return dict(zip(names, results, strict=True))

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        results = await self.run()
        ready = all(v == "ok" for v in results.values())
        return web.json_response(
            {"status": "ready" if ready else "not ready", "checks": results}, status=200 if ready else 503
        )
