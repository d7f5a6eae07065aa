"""Build the context stage from settings: the service, its memory-stage client, the gRPC servicer, and a small
HTTP listener for ``/healthz``, ``/readyz`` and ``/metrics`` (what Kubernetes probes and Prometheus scrape).

:class:`ContextStage` owns the lifecycle (the HTTP session to the memory stage, the grpc.aio server, the health
listener, the after-answer reports). The gRPC port trusts nothing but a valid internal principal signed with
``secret`` for its one method. Nothing else happens here; ``ibex context`` and ``ibex dev`` start it.
"""

from __future__ import annotations

import aiohttp
import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ibex_dataplane.context.memory_client import MemoryStageClient
from ibex_dataplane.context.metrics import ContextMetrics
from ibex_dataplane.context.service import ContextService, ContextTuning
from ibex_dataplane.context.servicer import ContextServicer
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2_grpc as pb_grpc
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.security.principal import PrincipalSigner
from ibex_dataplane.settings import Settings


def tuning_of(settings: Settings) -> ContextTuning:
    return ContextTuning(
        deadline=settings.context_deadline_ms / 1000,
        directive_timeout=settings.context_directive_ms / 1000,
        hot_timeout=settings.context_hot_ms / 1000,
        cold_timeout=settings.context_cold_ms / 1000,
        max_memories=settings.context_max_memories,
        hot_limit=settings.context_hot_limit,
    )


class ContextStage:
    """The running stage: ``await start()`` binds the port (0 picks a free one), ``await stop()`` drains."""

    def __init__(
        self,
        settings: Settings,
        *,
        catalog: ModelCatalog,
        memory_url: str,
        secret: bytes,
        host: str,
        port: int,
        health_port: int | None = None,
    ) -> None:
        self._settings = settings
        self._catalog = catalog
        self._memory_url = memory_url
        self._signer = PrincipalSigner(secret)
        self._host = host
        self._requested_port = port
        self._health_port = health_port
        self._session: aiohttp.ClientSession | None = None
        self._server: grpc.aio.Server | None = None
        self._health: web.AppRunner | None = None
        self.metrics = ContextMetrics()
        self.service: ContextService | None = None
        self.port = 0
        self.health_url = ""

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=200), timeout=aiohttp.ClientTimeout(total=30)
        )
        memory = MemoryStageClient(self._session, self._memory_url, self._signer)
        await memory.warm_up()
        self.service = ContextService(self._catalog, memory, tuning_of(self._settings), self.metrics)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        servicer = ContextServicer(self.service, self._signer, self.metrics)
        pb_grpc.add_ContextAssemblyServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        self.port = server.add_insecure_port(f"{self._host}:{self._requested_port}")
        if self.port == 0:
            await self._session.close()
            raise OSError(f"the context stage cannot listen on {self._host}:{self._requested_port}")
        await server.start()
        self._server = server
        self.metrics.heap.watch()
        if self._health_port is not None:
            self._health = web.AppRunner(self._health_app(), access_log=None, handle_signals=False)
            await self._health.setup()
            await web.TCPSite(self._health, self._host, self._health_port).start()
            bound = self._health.addresses[0][1] if self._health.addresses else self._health_port
            self.health_url = f"http://{self._host}:{bound}"

    def _health_app(self) -> web.Application:
        async def healthz(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def readyz(request: web.Request) -> web.Response:
            ready = self._server is not None
            return web.json_response({"status": "ready" if ready else "starting"}, status=200 if ready else 503)

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics)
        return app

    async def stop(self, grace: float = 2.0) -> None:
        self.metrics.heap.unwatch()
        if self._health is not None:
            await self._health.cleanup()
        if self._server is not None:
            await self._server.stop(grace)
        if self.service is not None:
            await self.service.drain()
        if self._session is not None:
            await self._session.close()
