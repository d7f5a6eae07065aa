"""Build the proxy's aiohttp application from settings and open stores; nothing else happens here.

Wires the caches, the gate pipelines, the providers and the routes, and owns their lifecycle (the invalidation
subscription, the periodic sweepers, the provider HTTP session and draining after-response work on shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ibex_dataplane.embedding.base import Embedder

if TYPE_CHECKING:
    from ibex_dataplane.embedding.onnx_graph import Precision
from ibex_dataplane.providers.breaker import BreakerState
from ibex_dataplane.providers.catalog import ModelCatalog, ModelKind, configured_providers, load_provider_config
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.providers.transport import UpstreamClient
from ibex_dataplane.proxy.accounting import Accounting, BackgroundTasks
from ibex_dataplane.proxy.analytics import AnalyticsRecorder
from ibex_dataplane.proxy.auth import KeyValidator, decode_key, encode_key
from ibex_dataplane.proxy.cache import InvalidationListener, TieredCache
from ibex_dataplane.proxy.context import ContextClient
from ibex_dataplane.proxy.directives import DirectiveService, decode_directive, encode_directive
from ibex_dataplane.proxy.edge import CHAT_EDGE
from ibex_dataplane.proxy.edge_messages import MESSAGES_EDGE
from ibex_dataplane.proxy.edge_responses import ResponsesEdge
from ibex_dataplane.proxy.embeddings import LocalEmbedder
from ibex_dataplane.proxy.gates import (
    GatePipeline,
    authenticate,
    bind_agent,
    body_limit,
    json_content_type,
    request_rate_limit,
    tenant_status,
)
from ibex_dataplane.proxy.generation import (
    GenerationHandler,
    GenerationServices,
    budget_hold,
    context_assembly,
    directive_and_session,
    idempotency,
    model_policy,
    rate_limit,
    validate_embeddings,
    validate_request,
)
from ibex_dataplane.proxy.health import HealthChecks
from ibex_dataplane.proxy.mcp import add_mcp_routes
from ibex_dataplane.proxy.mcp_sessions import McpSessions
from ibex_dataplane.proxy.memory_routes import add_memory_routes
from ibex_dataplane.proxy.metrics import CONTENT_TYPE, ProxyMetrics, timing_middleware
from ibex_dataplane.proxy.openapi import openapi_document
from ibex_dataplane.proxy.policy import PolicyService, decode_policy, encode_policy
from ibex_dataplane.proxy.rate_grants import GrantSettings
from ibex_dataplane.proxy.ratelimit import RateLimiter
from ibex_dataplane.proxy.repository import ProxyRepository
from ibex_dataplane.proxy.response_store import ResponseStore
from ibex_dataplane.proxy.routes import ProtectedRoutes
from ibex_dataplane.proxy.sessions import SessionService
from ibex_dataplane.runtime.heap import HEAP
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.principal import PrincipalSigner
from ibex_dataplane.settings import Settings
from ibex_dataplane.shared.budget import BudgetService, LeaseSettings
from ibex_dataplane.shared.http import envelope_middleware
from ibex_dataplane.shared.idempotency import IdempotencyLedger
from ibex_dataplane.store.keys import GlobalKeys
from ibex_dataplane.store.redis import ping as redis_ping

log = logging.getLogger(__name__)

STORES = web.AppKey("stores", Stores)
SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", ProxyMetrics)
SERVICES = web.AppKey("generation_services", GenerationServices)
GENERATION = web.AppKey("generation_handler", GenerationHandler)


def _on_invalidation(keys: TieredCache[Any], policies: TieredCache[Any], directives: TieredCache[Any]) -> Any:
    from ibex_dataplane.store.keys import TenantKeys

    def handle(event: dict[str, str]) -> None:
        kind = event.get("kind")
        try:
            if kind == "apikey":
                keys.evict(GlobalKeys.api_key(event["key_id"]))
            elif kind == "org":
                policies.evict(TenantKeys(event["org_id"]).policy())
            elif kind == "directive":
                directives.evict(TenantKeys(event["org_id"]).directive(event["agent_id"]))
        except (KeyError, ValueError):
            log.warning("ignoring malformed invalidation event of kind %s", kind)

    return handle


def lease_settings(settings: Settings) -> LeaseSettings | None:
    """How the proxy's budget service leases (docs/budget-leases.md); None: a hold per request. A maximum below
    ``IBEX_BUDGET_LEASE_REQUESTS`` is that number: leases then keep one size."""
    if not settings.budget_lease_requests:
        return None
    least = settings.budget_lease_requests
    return LeaseSettings(least, settings.budget_lease_seconds, most=max(least, settings.budget_lease_max_requests))


def grant_settings(settings: Settings) -> GrantSettings | None:
    """Rate-limit grants as configured (None: off), their most at least their least."""
    least = settings.rate_grant_requests
    if least <= 1:
        return None
    return GrantSettings(least, settings.rate_grant_seconds, most=max(least, settings.rate_grant_max_requests))


def create_app(
    settings: Settings,
    stores: Stores,
    *,
    pepper: bytes,
    catalog: ModelCatalog | None = None,
    provider_config: dict[str, Any] | None = None,
    memory_url: str | None = None,
    context_url: str | None = None,
    principal_signer: PrincipalSigner | None = None,
    embedder: Embedder | None = None,
    metrics_dir: Path | None = None,
) -> web.Application:
    """The proxy. Memory routes reach the stage at ``memory_url`` and chat reaches the context stage at
    ``context_url`` with principals from ``principal_signer``; they default to ``IBEX_MEMORY_URL``,
    ``IBEX_CONTEXT_URL`` and ``IBEX_INTERNAL_SECRET`` (without a secret memory routes answer 503 and context
    assembly degrades). ``embedder`` serves the built-in embedding model; without one it is loaded on first use.
    ``metrics_dir``: this is one worker of several, whose metrics are merged through files there (see metrics.py)."""
    metrics = ProxyMetrics(metrics_dir)
    app = web.Application(
        middlewares=[timing_middleware(metrics), envelope_middleware], client_max_size=settings.max_body_bytes
    )
    app[SETTINGS] = settings
    app[STORES] = stores
    app[METRICS] = metrics

    if provider_config is None and settings.providers_file is not None:
        provider_config = load_provider_config(settings.providers_file)
    catalog = catalog or ModelCatalog.from_config(
        provider_config or {},
        echo_input_price_per_mtok=settings.echo_input_price_per_mtok,
        echo_output_price_per_mtok=settings.echo_output_price_per_mtok,
    )
    served_by = configured_providers(provider_config or {})

    def servable(name: str) -> str | None:
        """None when the model can be served, else the provider it needs that is not configured."""
        info = catalog.get(name)
        return None if info is None or info.provider in served_by else info.provider

    repo = ProxyRepository(stores.db)

    def lookups(cache: str) -> Any:
        tiers = {
            tier: metrics.gathered_counter(metrics.cache_lookups, cache, tier) for tier in ("local", "redis", "load")
        }
        return lambda tier: tiers[tier].inc()

    key_cache: TieredCache[Any] = TieredCache(
        stores.redis, encode=encode_key, decode=decode_key, on_lookup=lookups("api_key")
    )
    policy_cache: TieredCache[Any] = TieredCache(
        stores.redis, encode=encode_policy, decode=decode_policy, on_lookup=lookups("policy")
    )
    directive_cache: TieredCache[Any] = TieredCache(
        stores.redis, encode=encode_directive, decode=decode_directive, on_lookup=lookups("directive")
    )
    keys = KeyValidator(repo, key_cache, pepper)
    policies = PolicyService(repo, policy_cache)
    directives = DirectiveService(repo, directive_cache)
    sessions = SessionService(stores.db)
    listener = InvalidationListener(
        stores.redis,
        GlobalKeys.INVALIDATION_CHANNEL,
        _on_invalidation(key_cache, policy_cache, directive_cache),
        [key_cache, policy_cache, directive_cache],
    )
    background = BackgroundTasks(metrics)
    budgets = BudgetService(stores.db, leases=lease_settings(settings))
    rate_limiter = RateLimiter(stores.redis, grants=grant_settings(settings))
    analytics = AnalyticsRecorder(stores.clickhouse, metrics.registry, flush_interval=settings.analytics_flush_seconds)

    keyed = [
        ("body_limit", body_limit(settings.max_body_bytes)),
        ("content_type", json_content_type),
        ("api_key", authenticate(keys)),
    ]
    bound = [*keyed, ("agent_binding", bind_agent(policies)), ("tenant_status", tenant_status)]

    if principal_signer is None and settings.internal_secret is not None:
        principal_signer = PrincipalSigner(settings.internal_secret.get_secret_value().encode())
    context_client = ContextClient(
        context_url or settings.context_url, principal_signer, timeout=settings.context_timeout_ms / 1000,
        metrics=metrics,
    )  # fmt: skip

    local_embedder = LocalEmbedder(
        catalog, embedder, functools.partial(_load_embedder, settings.memory_embedding_precision)
    )

    async def providers_ctx(app: web.Application) -> AsyncIterator[None]:
        # One client serves every tenant; it keeps no cookies, so nothing one tenant's upstream answer sets can go
        # out with another tenant's call.
        upstreams = UpstreamClient()
        registry = ProviderRegistry.from_config(
            provider_config or {}, catalog, upstreams, builtin={local_embedder.name: local_embedder}
        )
        accounting = Accounting(
            catalog=catalog, budgets=budgets, rate_limiter=rate_limiter, sessions=sessions, analytics=analytics,
            background=background, metrics=metrics, settle_gather_s=settings.settle_gather_ms / 1000,
        )  # fmt: skip
        breaker_levels = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}

        def refresh_breakers() -> None:
            for name, state in registry.breaker_states().items():
                metrics.breaker_state.labels(name).set(breaker_levels[state])

        metrics.before_render(refresh_breakers)
        services = GenerationServices(
            catalog=catalog, providers=registry, rate_limiter=rate_limiter, budgets=budgets, directives=directives,
            metrics=metrics, accounting=accounting, idempotency=IdempotencyLedger(stores.db), context=context_client,
        )  # fmt: skip
        app[SERVICES] = services
        generation_pipeline = GatePipeline(
            [
                *bound,
                ("model_policy", model_policy(catalog, servable)),
                ("rate_limit", rate_limit(services.rate_limiter)),
                ("validation", validate_request),
                ("idempotency", idempotency(services.idempotency)),
                ("budget_hold", budget_hold(budgets, catalog, directives, metrics)),
                ("directive_session", directive_and_session(directives)),
                ("context", context_assembly(context_client)),
            ],
            metrics,
        )
        embedding_pipeline = GatePipeline(
            [
                *bound,
                ("model_policy", model_policy(catalog, servable, ModelKind.EMBEDDING)),
                ("rate_limit", rate_limit(services.rate_limiter)),
                ("validation", validate_embeddings),
                ("budget_hold", budget_hold(budgets, catalog, directives, metrics)),
            ],
            metrics,
        )
        app[GENERATION] = GenerationHandler(generation_pipeline, services, embedding_pipeline)
        await listener.start()
        await analytics.start()
        await context_client.start()
        await health.warm()  # before the process reports ready: first store calls may be slow to open
        sweeper = asyncio.create_task(_sweep(budgets, sessions), name="ibex-sweeper")
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await listener.stop()
            budgets.stop_retrying()  # settles waiting on a lost Postgres end now instead of holding up shutdown
            await background.drain()
            await accounting.close()
            await rate_limiter.close()
            await budgets.drain()
            await analytics.stop()
            await registry.aclose()
            await upstreams.close()
            await context_client.close()
            local_embedder.close()

    async def chat(request: web.Request) -> web.StreamResponse:
        return await request.app[GENERATION].handle(request, CHAT_EDGE)

    async def embeddings(request: web.Request) -> web.StreamResponse:
        return await request.app[GENERATION].embeddings(request)

    async def messages(request: web.Request) -> web.StreamResponse:
        return await request.app[GENERATION].handle(request, MESSAGES_EDGE)

    response_store = ResponseStore(stores.redis)
    responses_edge = ResponsesEdge(response_store)

    async def responses(request: web.Request) -> web.StreamResponse:
        return await request.app[GENERATION].handle(request, responses_edge)

    app.cleanup_ctx.append(providers_ctx)
    app[HEAP] = metrics.heap
    app.cleanup_ctx.append(metrics.heap.watching)
    app.cleanup_ctx.append(metrics.flushing)

    routes = ProtectedRoutes(
        keyed=GatePipeline(keyed, metrics), bound=GatePipeline(bound, metrics), catalog=catalog, sessions=sessions,
        policies=policies, clickhouse=stores.clickhouse, servable=servable, responses=response_store,
    )  # fmt: skip
    health = HealthChecks(
        {
            "postgres": stores.db.ping,
            "redis": lambda: redis_ping(stores.redis),
            "clickhouse": stores.clickhouse.ping,
        },
        degradable=frozenset({"clickhouse"}),  # analytics degrade (rows dropped and counted); nothing is refused
    )

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi_handler(request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    memory_gates = GatePipeline([*bound, ("rate_limit", request_rate_limit(rate_limiter))], metrics)
    forwarder = add_memory_routes(
        app,
        bound=memory_gates,
        memory_url=memory_url or settings.memory_url,
        signer=principal_signer,
        timeout=settings.memory_timeout_seconds,
    )
    add_mcp_routes(app, bound=memory_gates, forwarder=forwarder, sessions=McpSessions(stores.redis), metrics=metrics)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", routes.stored_response)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/me", routes.me)
    app.router.add_get("/v1/usage", routes.usage)
    app.router.add_get("/v1/orgs/{org_id}/auth-probe", routes.auth_probe)
    app.router.add_post("/v1/sessions/{session_id}/terminate", routes.terminate_session)
    app.router.add_get("/healthz", health.healthz)
    app.router.add_get("/readyz", health.readyz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/openapi.json", openapi_handler)
    return app


def _load_embedder(precision: Precision) -> Embedder:
    """The built-in embedding model from the installed packages (imported here: onnxruntime loads only if used)."""
    from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder

    return OnnxMiniLMEmbedder.from_installed_packages(precision)


async def _sweep(budgets: BudgetService, sessions: SessionService, every: float = 30.0) -> None:
    """Release expired budget holds and close idle sessions, forever; failures are logged and retried."""
    while True:
        await asyncio.sleep(every)
        try:
            await budgets.sweep_expired()
            await sessions.sweep_idle(timedelta(minutes=30))
        except Exception as e:
            log.warning("sweeper run failed: %s", type(e).__name__)
