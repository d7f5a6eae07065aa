"""Build the proxy's aiohttp application from settings and open stores; nothing else happens here."""

from __future__ import annotations

from aiohttp import web

from ibex_dataplane.proxy.health import HealthChecks
from ibex_dataplane.proxy.middleware import envelope_middleware
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.redis import ping as redis_ping

STORES = web.AppKey("stores", Stores)
SETTINGS = web.AppKey("settings", Settings)


def create_app(settings: Settings, stores: Stores) -> web.Application:
    app = web.Application(middlewares=[envelope_middleware], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[STORES] = stores
    health = HealthChecks(
        {
            "postgres": stores.db.ping,
            "redis": lambda: redis_ping(stores.redis),
            "clickhouse": stores.clickhouse.ping,
        }
    )
    app.router.add_get("/healthz", health.healthz)
    app.router.add_get("/readyz", health.readyz)
    return app
