"""Run the proxy application in-process on a free port, as a test 'replica' of the data plane."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ibex_dataplane.proxy.app import create_app
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings


@dataclass(frozen=True)
class RunningProxy:
    base_url: str
    app: web.Application

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


@asynccontextmanager
async def running_proxy(
    settings: Settings, stores: Stores, pepper: bytes, provider_config: dict[str, Any] | None = None
) -> AsyncIterator[RunningProxy]:
    app = create_app(settings, stores, pepper=pepper, provider_config=provider_config)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield RunningProxy(f"http://127.0.0.1:{port}", app)
    finally:
        await runner.cleanup()
