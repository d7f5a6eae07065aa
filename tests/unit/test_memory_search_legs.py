"""The two legs of a search when a store fails: the error reaches the caller, and a leg that failed beside it is
retrieved (no "Task exception was never retrieved" left for the event loop to report); a failing model is a degraded
search that caches nothing."""

from __future__ import annotations

import asyncio
import gc
import uuid
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from ibex_dataplane.embedding import Embedder, EmbeddingError, SparseEncoder, SparseVector
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.query_cache import QueryCache
from ibex_dataplane.memory.refinery import Redactor
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.memory.search import MemorySearch
from ibex_dataplane.memory.tuning import SearchTuning
from ibex_dataplane.memory.validation import SearchQuery
from ibex_dataplane.shared.errors import Degraded
from ibex_dataplane.store.errors import StoreUnavailable


class PlainRedactor:
    async def redact_async(self, text: str, **_: Any) -> Any:
        return SimpleNamespace(text=text)


class Embeds:
    async def embed(self, texts: list[str]) -> np.ndarray[Any, Any]:
        await asyncio.sleep(0)
        return np.ones((len(texts), 384), dtype=np.float32)


class DownRepository:
    """Postgres away: the text leg fails at once, the vector leg once its vector is there."""

    async def search_text(self, tenant: Tenant, **_: Any) -> list[Any]:
        raise StoreUnavailable("postgres", "ConnectionRefusedError")

    async def search_vector(self, tenant: Tenant, *, vector: asyncio.Future[Any], **_: Any) -> list[Any]:
        await vector
        await asyncio.sleep(0)  # the text leg has failed by now
        raise StoreUnavailable("postgres", "ConnectionRefusedError")


async def test_both_legs_failing_raise_once_and_leave_no_unretrieved_exception() -> None:
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    try:
        search = MemorySearch(
            cast(MemoryRepository, DownRepository()), cast(Embedder, Embeds()), cast(Redactor, PlainRedactor()),
            MemoryMetrics(), SearchTuning(),
        )  # fmt: skip
        tenant = Tenant(uuid.uuid4(), uuid.uuid4())
        with pytest.raises(StoreUnavailable):
            await search.search(tenant, SearchQuery(query="where is the lighthouse"))
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert unretrieved == []


class DownEmbedder:
    async def embed(self, texts: list[str]) -> np.ndarray[Any, Any]:
        raise EmbeddingError("the model is gone")


class QuietRepository:
    """Postgres answering with nothing; the vector leg still waits for its vector."""

    async def search_text(self, tenant: Tenant, **_: Any) -> list[Any]:
        return []

    async def search_vector(self, tenant: Tenant, *, vector: asyncio.Future[Any], **_: Any) -> list[Any]:
        await vector
        return []


async def test_a_failing_embedder_is_a_degraded_search_and_nothing_is_cached() -> None:
    cache = QueryCache(8)
    search = MemorySearch(
        cast(MemoryRepository, QuietRepository()), cast(Embedder, DownEmbedder()), cast(Redactor, PlainRedactor()),
        MemoryMetrics(), SearchTuning(), cache=cache,
    )  # fmt: skip
    with pytest.raises(Degraded, match="embedding model is unavailable"):
        await search.search(Tenant(uuid.uuid4(), uuid.uuid4()), SearchQuery(query="where is the lighthouse"))
    assert len(cache) == 0


class Expands:
    """A sparse model that gives every query 20 tokens of rising weight."""

    model_name = "test"

    async def encode(self, texts: list[str]) -> list[SparseVector]:
        tokens = np.arange(100, 120, dtype=np.int32)
        return [SparseVector(tokens, np.linspace(0.1, 2.0, 20, dtype=np.float32)) for _ in texts]


class SparseRecorder(QuietRepository):
    def __init__(self) -> None:
        self.sparse: list[SparseVector] = []

    async def search_sparse(self, tenant: Tenant, *, vector: asyncio.Future[SparseVector], **_: Any) -> list[Any]:
        self.sparse.append(await vector)
        return []


@pytest.mark.parametrize("kept", [12, 5, 0])
async def test_the_sparse_leg_reads_only_the_strongest_query_tokens(kept: int) -> None:
    repo = SparseRecorder()
    search = MemorySearch(
        cast(MemoryRepository, repo), cast(Embedder, Embeds()), cast(Redactor, PlainRedactor()), MemoryMetrics(),
        SearchTuning(sparse_query_tokens=kept), cast(SparseEncoder, Expands()), cache=QueryCache(8),
    )  # fmt: skip
    tenant = Tenant(uuid.uuid4(), uuid.uuid4())
    for _ in range(2):  # the second answer comes from the query cache
        await search.search(tenant, SearchQuery(query="where is the lighthouse"))
    expected = list(range(120 - (kept or 20), 120))
    assert [v.tokens.tolist() for v in repo.sparse] == [expected, expected]
