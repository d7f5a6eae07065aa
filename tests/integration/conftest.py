"""Fixtures for tests that drive the proxy (and the memory stage behind it) over HTTP, and the store clients that
several test modules open beside the session's stores."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from ibex_dataplane.runtime.embedded import RuntimeInfo
    from ibex_dataplane.store.postgres import Database
    from tests.support.proxy import MemoryDeps, RunningProxy
    from tests.support.upstream import Upstream

# The fact extraction model of `capture: facts` tests, served by the session's fake OpenAI-wire upstream.
EXTRACTION_MODEL = "extractor"
# The memory stage's extraction call timeout in these tests: far above the fake upstream's answer times (ms), and
# far below the delay the slow-upstream test scripts.
EXTRACTION_TIMEOUT = 3.0


@pytest.fixture(scope="session")
def memory_deps() -> Iterator[MemoryDeps]:
    """The real ONNX embedder and Presidio redactor, built once per session (they take seconds to load)."""
    from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder
    from ibex_dataplane.pii.redactor import PiiRedactor
    from tests.support.proxy import MemoryDeps

    with OnnxMiniLMEmbedder.from_installed_packages() as embedder, PiiRedactor() as redactor:
        yield MemoryDeps(embedder, redactor)


@pytest_asyncio.fixture(scope="session")
async def extraction_upstream() -> AsyncIterator[Upstream]:
    from tests.support.upstream import running_upstream

    async with running_upstream() as upstream:
        yield upstream


def extraction_providers(upstream: Upstream) -> dict[str, object]:
    from tests.support.upstream import API_KEY

    return {
        "models": [{"name": EXTRACTION_MODEL, "provider": "fake-upstream", "context_window": 16384,
                    "max_output_tokens": 2048, "input_price_per_mtok": "3", "output_price_per_mtok": "15"}],
        "providers": {"fake-upstream": {"type": "openai_compat", "base_url": upstream.url, "api_key": API_KEY,
                                        "max_attempts": 1, "breaker_failure_threshold": 1000}},
    }  # fmt: skip


@pytest_asyncio.fixture(scope="session")
async def proxy(
    settings: Settings, stores: Stores, pepper: bytes, memory_deps: MemoryDeps, extraction_upstream: Upstream
) -> AsyncIterator[RunningProxy]:
    """The session's shared stack; its memory stage is the only one that runs the capture worker, and it serves
    the fact extraction model of the fake upstream."""
    from tests.support.proxy import running_proxy

    options = {"provider_config": extraction_providers(extraction_upstream), "extraction_timeout": EXTRACTION_TIMEOUT}
    async with running_proxy(
        settings, stores, pepper, memory=memory_deps, capture_worker=True, memory_options=options
    ) as running:
        yield running


@pytest_asyncio.fixture(scope="session")
async def second_proxy(settings: Settings, stores: Stores, pepper: bytes) -> AsyncIterator[RunningProxy]:
    """Another replica over the same stores (its own caches and invalidation subscription)."""
    from tests.support.proxy import running_proxy

    async with running_proxy(settings, stores, pepper) as running:
        yield running


@pytest_asyncio.fixture
async def redis(runtime_info: RuntimeInfo) -> AsyncIterator[aioredis.Redis]:
    """A client of the session's Valkey of its own."""
    from ibex_dataplane.store.redis import create_redis

    client = create_redis(runtime_info.redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest_asyncio.fixture
async def second_replica(runtime_info: RuntimeInfo) -> AsyncIterator[Database]:
    """Another data-plane pool on the same Postgres, as a second proxy replica would have."""
    from ibex_dataplane.store.postgres import Database, create_pool

    pool = await create_pool(runtime_info.postgres_app_dsn, min_size=1, max_size=10, application_name="replica-2")
    try:
        yield Database(pool)
    finally:
        await pool.close()
