"""Hybrid retrieval and composite scoring for ``POST /v1/memories/search`` (architecture section 9.3).

Owns turning a validated :class:`SearchQuery` into ranked hits: the query is masked for PII like content is, then
embedded; one SQL round trip runs the HNSW leg (iterative scan under the per-agent filter, ANN cutoff applied after
the index scan) and the full-text leg over active, currently valid memories, merged by id and hydrated; here the
relevance floor drops weak candidates and every survivor gets the composite score

    0.40 relevance + 0.25 recency + 0.20 usefulness + 0.10 confidence + 0.05 access_frequency

with all five components returned. Scoring is pure (:func:`score`) so the context stage and the tests can reuse it.
Called by the service; retrieval bookkeeping for the returned hits runs after the answer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ibex_dataplane.embedding import Embedder, EmbeddingError
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Memory, Tenant
from ibex_dataplane.memory.refinery import Redactor
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.memory.validation import SearchQuery
from ibex_dataplane.pii import PiiError
from ibex_dataplane.shared.errors import Degraded


@dataclass(frozen=True, slots=True)
class ScoreWeights:
    relevance: float = 0.40
    recency: float = 0.25
    usefulness: float = 0.20
    confidence: float = 0.10
    frequency: float = 0.05


@dataclass(frozen=True, slots=True)
class SearchTuning:
    min_similarity: float = 0.70  # ANN cutoff, before hydration
    relevance_floor: float = 0.15  # drop candidates below this relevance before scoring (must stay below 0.5)
    text_only_relevance: float = 0.5
    recency_half_life_days: float = 30.0
    frequency_half_saturation: float = 5.0  # retrieval_count at which the frequency component reaches 0.5
    ann_candidates: int = 40
    text_candidates: int = 20
    weights: ScoreWeights = ScoreWeights()

    def __post_init__(self) -> None:
        if not 0 <= self.relevance_floor < self.text_only_relevance:
            raise ValueError("the relevance floor must stay below the relevance of full-text-only hits (0.5)")


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


class MemorySearch:
    def __init__(
        self,
        repo: MemoryRepository,
        embedder: Embedder,
        redactor: Redactor,
        metrics: MemoryMetrics,
        tuning: SearchTuning,
    ) -> None:
        self._repo = repo
        self._embedder = embedder
        self._redactor = redactor
        self._metrics = metrics
        self.tuning = tuning

    async def search(self, tenant: Tenant, query: SearchQuery) -> list[SearchHit]:
        started = time.perf_counter()
        try:
            masked = (await self._redactor.redact_async(query.query)).text
        except PiiError as e:
            raise Degraded("the PII check is unavailable") from e
        try:
            vectors = await self._embedder.embed([masked])
        except EmbeddingError as e:
            raise Degraded("the embedding model is unavailable") from e
        embedded = time.perf_counter()
        self._metrics.search_seconds.labels("embed").observe(embedded - started)

        t = self.tuning
        min_similarity = query.min_similarity if query.min_similarity is not None else t.min_similarity
        rows = await self._repo.search(
            tenant,
            vector=vectors[0],
            text=masked,
            at=query.as_of,
            ann_candidates=max(t.ann_candidates, query.limit * 2),
            text_candidates=max(t.text_candidates, query.limit * 2),
            min_similarity=min_similarity,
            min_confidence=query.min_confidence,
            labels=query.labels,
        )
        queried = time.perf_counter()
        self._metrics.search_seconds.labels("query").observe(queried - embedded)

        now = query.as_of or datetime.now(UTC)
        hits: list[SearchHit] = []
        for similarity, text_hit, memory in rows:
            relevance = similarity if similarity is not None else t.text_only_relevance
            if relevance < t.relevance_floor:
                continue
            matched_by = (
                "both" if similarity is not None and text_hit else "vector" if similarity is not None else "text"
            )
            total, components = score(memory, relevance, now, t)
            hits.append(SearchHit(memory, total, components, matched_by))
        hits.sort(key=lambda h: (-h.score, str(h.memory.id)))
        hits = hits[: query.limit]
        for hit in hits:
            self._metrics.search_hits.labels(hit.matched_by).inc()
        self._metrics.search_seconds.labels("score").observe(time.perf_counter() - queried)
        return hits
