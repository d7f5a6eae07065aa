"""Hybrid retrieval and composite scoring for ``POST /v1/memories/search`` (architecture section 9.3).

Owns turning a validated :class:`SearchQuery` into ranked hits. The query is masked for PII like content is; the
BM25 full-text leg (any query term may match, statistics from the postings kept at write time) starts at once and
runs while the masked query is embedded, then the HNSW leg (iterative scan under the per-agent filter, a low ANN
cutoff after the index scan) runs; beside them the sparse leg encodes the masked query with SPLADE (its own model
thread) and scores the postings of migration 0025. All read active, currently valid memories, hydrated, and are
merged by id. A query the organization searched recently takes both encodings from the :class:`QueryCache`.
Then, here and pure (:func:`rank`):

1. the evidence of :mod:`~ibex_dataplane.memory.evidence` (each leg on an absolute scale, named periods, names,
   neighbours and sessions) decides which candidates may answer: below the relevance floor, nothing, so junk
   finds nothing;
2. the learned ranker of :mod:`~ibex_dataplane.memory.ranker` orders the survivors; the ``limit`` best are the
   answer and its score, mapped to [0, 1], is their ``relevance`` component.

The answer is ordered by the composite score

    0.40 relevance + 0.25 recency + 0.20 usefulness + 0.10 confidence + 0.05 access_frequency

with all five components. Relevance decides *which* memories answer; the other components only order that answer
(an old memory that is the answer is never pushed out by recent, unrelated ones; see docs/retrieval.md). Called
by the service; retrieval bookkeeping for the returned hits runs after the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
import numpy as np

from ibex_dataplane.embedding import Embedder, EmbeddingError, SparseEncoder, SparseVector
from ibex_dataplane.memory.evidence import evidence_of, names_in, periods_named
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Memory, Tenant
from ibex_dataplane.memory.query_cache import QueryCache
from ibex_dataplane.memory.ranker import Ranker, default_ranker, features
from ibex_dataplane.memory.refinery import Redactor
from ibex_dataplane.memory.repository import MemoryRepository, SearchRow, merge_legs
from ibex_dataplane.memory.tuning import SearchTuning
from ibex_dataplane.memory.validation import SearchQuery
from ibex_dataplane.pii import PiiError
from ibex_dataplane.shared.errors import Degraded

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Components:
    relevance: float
    recency: float
    usefulness: float
    confidence: float
    frequency: float

    def to_wire(self) -> dict[str, float]:
        return {
            "relevance": round(self.relevance, 6),
            "recency": round(self.recency, 6),
            "usefulness": round(self.usefulness, 6),
            "confidence": round(self.confidence, 6),
            "frequency": round(self.frequency, 6),
        }


@dataclass(frozen=True, slots=True)
class SearchHit:
    memory: Memory
    score: float
    components: Components
    matched_by: str  # "vector" | "text" | "both"

    def to_wire(self) -> dict[str, Any]:
        return {
            "memory": self.memory.to_wire(),
            "score": round(self.score, 6),
            "components": self.components.to_wire(),
            "matched_by": self.matched_by,
        }


def recency(anchor: datetime, now: datetime, half_life_days: float) -> float:
    """Exponential decay from the start of validity: 1 now, 0.5 after one half-life; future starts count as now."""
    age_days = max(0.0, (now - anchor).total_seconds() / 86400.0)
    return math.pow(0.5, age_days / half_life_days)


def frequency(retrieval_count: int, half_saturation: float) -> float:
    """Saturating in the number of retrievals: 0 never, 0.5 at ``half_saturation``, towards 1 after."""
    count = max(0, retrieval_count)
    return count / (count + half_saturation)


def score(memory: Memory, relevance: float, now: datetime, tuning: SearchTuning) -> tuple[float, Components]:
    components = Components(
        relevance=max(0.0, min(1.0, relevance)),
        recency=recency(memory.valid_from or memory.created_at, now, tuning.recency_half_life_days),
        usefulness=memory.usefulness,
        confidence=memory.confidence,
        frequency=frequency(memory.retrieval_count, tuning.frequency_half_saturation),
    )
    w = tuning.weights
    total = (
        w.relevance * components.relevance
        + w.recency * components.recency
        + w.usefulness * components.usefulness
        + w.confidence * components.confidence
        + w.frequency * components.frequency
    )
    return total, components


def matched_by(row: SearchRow) -> str:
    """``vector``, ``text`` (BM25 or SPLADE: both are term matches) or ``both``."""
    text = row.text_score is not None or row.sparse_score is not None
    if row.similarity is not None and text:
        return "both"
    return "vector" if row.similarity is not None else "text"


def rank(
    rows: Sequence[SearchRow],
    query_text: str,
    limit: int,
    now: datetime,
    tuning: SearchTuning,
    ranker: Ranker | None = None,
) -> list[SearchHit]:
    """The answer: of the candidates whose evidence reaches the floor, the ``limit`` the ranker puts first (by
    evidence when ``ranker`` is None), ordered by composite score."""
    periods, names = periods_named(query_text), names_in(query_text)
    evidence = evidence_of(rows, tuning, periods, names)
    passed = [i for i, e in enumerate(evidence) if e >= tuning.relevance_floor]
    if ranker is None:
        relevance = evidence
        order = {i: -evidence[i] for i in passed}
    else:
        # Features over every candidate, as the ranker was trained: a leg's best and a session's best are the
        # query's, whether or not they passed the floor.
        scores = ranker.scores(features(rows, tuning, periods, names))
        relevance = ranker.relevance(scores).tolist()
        order = {i: -float(scores[i]) for i in passed}
    kept = sorted(passed, key=lambda i: (order[i], str(rows[i].memory.id)))[:limit]
    hits: list[SearchHit] = []
    for i in kept:
        total, components = score(rows[i].memory, relevance[i], now, tuning)
        hits.append(SearchHit(rows[i].memory, total, components, matched_by(rows[i])))
    hits.sort(key=lambda h: (-h.score, -h.components.relevance, str(h.memory.id)))
    return hits


class MemorySearch:
    def __init__(
        self,
        repo: MemoryRepository,
        embedder: Embedder,
        redactor: Redactor,
        metrics: MemoryMetrics,
        tuning: SearchTuning,
        sparse: SparseEncoder | None = None,
        ranker: Ranker | None = None,
        cache: QueryCache | None = None,
    ) -> None:
        self._repo = repo
        self._embedder = embedder
        self._sparse = sparse if tuning.sparse_weight > 0 else None
        self._redactor = redactor
        self._metrics = metrics
        self.tuning = tuning
        self.ranker = ranker if ranker is not None else default_ranker()
        self._cache = cache if cache is not None else QueryCache(0)

    async def candidates(self, tenant: Tenant, query: SearchQuery) -> tuple[str, list[SearchRow]]:
        """The masked query and every hit of either leg (unranked).

        The text leg needs only the masked query, so it runs while the query is embedded; the vector leg runs its
        statement once the embedding is there; the sparse leg likewise waits for the SPLADE weights. A query this
        organization searched recently takes both encodings from the query cache instead. Nothing but the masked
        text reaches either model or any statement.
        """
        started = time.perf_counter()
        try:
            masked = (await self._redactor.redact_async(query.query)).text
        except PiiError as e:
            raise Degraded("the PII check is unavailable") from e
        t = self.tuning
        text_leg = asyncio.ensure_future(
            self._repo.search_text(
                tenant,
                text=masked,
                at=query.as_of,
                candidates=max(t.text_candidates, query.limit * 2),
                min_confidence=query.min_confidence,
                labels=query.labels,
                term_rows=t.text_term_rows,
                population=t.text_population,
            )
        )
        cached = self._cache.get(tenant.org_id, masked)
        self._metrics.query_cache.labels("miss" if cached is None else "hit").inc()
        dense = None if cached is None else cached.dense
        vector_task = self._encoded(
            "embed", started, dense, functools.partial(self._embedding, masked), "embedding model"
        )
        legs: list[asyncio.Future[Any]] = [text_leg, vector_task]
        embedded = started

        def mark_embedded(_: object) -> None:
            nonlocal embedded
            embedded = time.perf_counter()

        vector_task.add_done_callback(mark_embedded)
        sparse_vector: asyncio.Future[SparseVector] | None = None
        sparse_leg: asyncio.Future[list[asyncpg.Record]] | None = None
        if self._sparse is not None and query.as_of is None:  # history reads: superseded rows keep no postings
            weights = None if cached is None else cached.sparse
            encode = functools.partial(self._sparse_weights, masked)
            sparse_vector = self._encoded("sparse_encode", started, weights, encode, "sparse model")
            sparse_search = self._repo.search_sparse(
                tenant, vector=sparse_vector, candidates=max(t.sparse_candidates, query.limit * 2),
                min_confidence=query.min_confidence, labels=query.labels, term_rows=t.sparse_term_rows,
            )  # fmt: skip
            sparse_leg = asyncio.ensure_future(sparse_search)
            legs += [sparse_leg, sparse_vector]
        try:
            vector_rows = await self._repo.search_vector(
                tenant, vector=vector_task, at=query.as_of, candidates=max(t.ann_candidates, query.limit * 2),
                min_similarity=query.min_similarity if query.min_similarity is not None else t.min_similarity,
                min_confidence=query.min_confidence, labels=query.labels,
            )  # fmt: skip
            text_rows = await text_leg
            sparse_rows = [] if sparse_leg is None else await sparse_leg
        finally:
            for leg in legs:  # a failed leg leaves nothing running behind the answer
                if not leg.done():
                    leg.cancel()
                    with contextlib.suppress(BaseException):
                        await leg
                elif not leg.cancelled():
                    leg.exception()  # retrieved: a leg that failed while the other raised is not reported twice
        self._metrics.search_seconds.labels("query").observe(time.perf_counter() - embedded)
        if cached is None or (cached.sparse is None and sparse_vector is not None):
            self._cache.put(
                tenant.org_id, masked, vector_task.result(), None if sparse_vector is None else sparse_vector.result()
            )
        return masked, merge_legs(vector_rows, text_rows, sparse_rows)

    async def _embedding(self, masked: str) -> np.ndarray[Any, Any]:
        vectors = await self._embedder.embed([masked])
        vector: np.ndarray[Any, Any] = vectors[0]
        return vector

    async def _sparse_weights(self, masked: str) -> SparseVector:
        assert self._sparse is not None
        return (await self._sparse.encode([masked]))[0].strongest(self.tuning.sparse_query_tokens)

    def _encoded(
        self, phase: str, started: float, cached: T | None, encode: Callable[[], Awaitable[T]], model: str
    ) -> asyncio.Future[T]:
        """One encoding of the masked query, timed as ``phase``: the cached one, or the model's (its own thread)."""
        if cached is not None:
            self._metrics.search_seconds.labels(phase).observe(time.perf_counter() - started)
            return _resolved(cached)

        async def run() -> T:
            try:
                value = await encode()
            except EmbeddingError as e:
                raise Degraded(f"the {model} is unavailable") from e
            self._metrics.search_seconds.labels(phase).observe(time.perf_counter() - started)
            return value

        return asyncio.ensure_future(run())

    async def search(self, tenant: Tenant, query: SearchQuery) -> list[SearchHit]:
        masked, rows = await self.candidates(tenant, query)
        started = time.perf_counter()
        hits = rank(rows, masked, query.limit, query.as_of or datetime.now(UTC), self.tuning, self.ranker)
        for hit in hits:
            self._metrics.search_hits.labels(hit.matched_by).inc()
        self._metrics.search_seconds.labels("score").observe(time.perf_counter() - started)
        return hits


def _resolved(value: T) -> asyncio.Future[T]:
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
