"""The operator's small HTTP endpoint: ``/healthz`` (liveness), ``/readyz`` (stores reachable) and ``/metrics``.

Started by ``app`` before leader election, so a standby replica (waiting for the lease) is alive and ready too:
otherwise a rolling update could never bring up the pod that is meant to take over. Metrics are reconcile
outcomes per kind and reason (no tenant names or ids as labels), in the Prometheus text format.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

log = logging.getLogger(__name__)


@dataclass
class OperatorState:
    """What the endpoints report; written by ``app`` and ``handlers``."""

    leader: bool = False
    running: bool = False  # kopf is processing resources
    reconciles: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, reason) -> count
    deletions: Counter[str] = field(default_factory=Counter)  # kind -> count

    def count_reconcile(self, kind: str, reason: str) -> None:
        self.reconciles[(kind, reason)] += 1

    def metrics_text(self) -> str:
        lines = [
            "# HELP ibex_operator_leader 1 when this replica holds the leader lease.",
            "# TYPE ibex_operator_leader gauge",
            f"ibex_operator_leader {int(self.leader)}",
            "# HELP ibex_operator_reconcile_total Reconciles by kind and Ready reason.",
            "# TYPE ibex_operator_reconcile_total counter",
        ]
        for (kind, reason), n in sorted(self.reconciles.items()):
            lines.append(f'ibex_operator_reconcile_total{{kind="{kind}",reason="{reason}"}} {n}')
        lines += [
            "# HELP ibex_operator_deletions_total Finalizer clean-ups completed, by kind.",
            "# TYPE ibex_operator_deletions_total counter",
        ]
        for kind, n in sorted(self.deletions.items()):
            lines.append(f'ibex_operator_deletions_total{{kind="{kind}"}} {n}')
        return "\n".join(lines) + "\n"


class HealthServer:
    """aiohttp server for the probes; ``check_stores`` raises when a store cannot be reached."""

    def __init__(self, state: OperatorState, check_stores: Callable[[], Awaitable[None]], host: str, port: int) -> None:
        self._state = state
        self._check = check_stores
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port = port

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            await asyncio.wait_for(self._check(), timeout=3)
        except Exception as e:  # any failure means not ready; the reason is the exception class only
            return web.json_response({"status": "unavailable", "reason": type(e).__name__}, status=503)
        return web.json_response({"status": "ok", "leader": self._state.leader, "running": self._state.running})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self._state.metrics_text(), content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        if self._runner.addresses:
            self.port = int(self._runner.addresses[0][1])
        log.info("health endpoint on %s:%d", self._host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
