"""Run the proxy application in-process on a free port, as a test 'replica' of the data plane.

With ``memory=`` the memory and context stages run too, in-process on their own free ports, and the proxy reaches
them (HTTP and gRPC) with principals signed by a per-run random secret, exactly as ``ibex dev`` wires them.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ibex_dataplane.context.app import ContextStage
from ibex_dataplane.embedding import Embedder
from ibex_dataplane.memory.app import create_memory_app
from ibex_dataplane.memory.refinery import Redactor
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.proxy.app import create_app
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.principal import PrincipalSigner
from ibex_dataplane.settings import Settings


@dataclass(frozen=True)
class MemoryDeps:
    """What the memory stage needs beyond settings and stores (built once per test session: both are slow)."""

    embedder: Embedder
    redactor: Redactor


@dataclass(frozen=True)
class RunningStage:
    base_url: str
    app: web.Application
    secret: bytes

    @property
    def signer(self) -> PrincipalSigner:
        return PrincipalSigner(self.secret)


@dataclass(frozen=True)
class RunningProxy:
    base_url: str
    app: web.Application
    memory: RunningStage | None = None
    context: ContextStage | None = None

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def running_memory_stage(
    settings: Settings, stores: Stores, deps: MemoryDeps, *, secret: bytes | None = None, **options: Any
) -> AsyncIterator[RunningStage]:
    secret = secret or secrets.token_bytes(32)
    app = create_memory_app(settings, stores, embedder=deps.embedder, redactor=deps.redactor, secret=secret, **options)
    async with serve(app) as url:
        yield RunningStage(url, app, secret)


def unhurried(settings: Settings) -> Settings:
    """Settings whose context deadlines tolerate a loaded CI machine: functional tests must not depend on timing
    (the deadline behaviour has its own tests, and the latency is measured by bench/context_bench.py)."""
    return settings.model_copy(
        update={"context_deadline_ms": 5000.0, "context_directive_ms": 5000.0, "context_hot_ms": 5000.0,
                "context_cold_ms": 5000.0, "context_timeout_ms": 8000.0}
    )  # fmt: skip


@asynccontextmanager
async def running_proxy(
    settings: Settings,
    stores: Stores,
    pepper: bytes,
    provider_config: dict[str, Any] | None = None,
    memory: MemoryDeps | None = None,
    *,
    capture_worker: bool = False,
    memory_options: dict[str, Any] | None = None,
) -> AsyncIterator[RunningProxy]:
    """``capture_worker``: the memory stage drains the capture queue. The test session's shared proxy does, and
    other test stacks do not: a worker leases jobs of every tenant, so it would take other tests' jobs (with its
    own, perhaps broken, embedder or providers). ``memory_options`` go to :func:`create_memory_app`."""
    if memory is None:
        app = create_app(settings, stores, pepper=pepper, provider_config=provider_config)
        async with serve(app) as url:
            yield RunningProxy(url, app)
        return
    settings = unhurried(settings)
    stage_settings = settings.model_copy(update={"memory_capture_worker": capture_worker})
    async with (
        running_memory_stage(stage_settings, stores, memory, **(memory_options or {})) as stage,
        running_context_stage(settings, stage) as context,
    ):
        app = create_app(
            settings, stores, pepper=pepper, provider_config=provider_config, memory_url=stage.base_url,
            context_url=context.address, principal_signer=stage.signer, embedder=memory.embedder,
        )  # fmt: skip
        async with serve(app) as url:
            yield RunningProxy(url, app, stage, context)


@asynccontextmanager
async def running_context_stage(settings: Settings, memory: RunningStage) -> AsyncIterator[ContextStage]:
    """The context stage on a free port, in front of ``memory`` and sharing its principal secret."""
    stage = ContextStage(
        settings, catalog=ModelCatalog.builtin(), memory_url=memory.base_url, secret=memory.secret,
        host="127.0.0.1", port=0, health_port=0,
    )  # fmt: skip
    await stage.start()
    try:
        yield stage
    finally:
        await stage.stop()
