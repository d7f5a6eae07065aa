"""Hybrid retrieval and composite scoring for ``POST /v1/memories/search`` (architecture section 9.3).

Owns turning a validated :class:`SearchQuery` into ranked hits. The query is masked for PII like content is; the
BM25 full-text leg (any query term may match, statistics from the postings kept at write time) starts at once and
runs while the masked query is embedded, then the HNSW leg (iterative scan under the per-agent filter, a low ANN
cutoff after the index scan) runs; beside them the sparse leg encodes the masked query with SPLADE (its own model
thread) and scores the postings of migration 0025. All read active, currently valid memories, hydrated, and are
merged by id.
Then, here and pure (:func:`relevance_of`, so the tests and the tuning runs reuse it):

1. fusion: each leg's evidence on an absolute scale (cosine between ``similarity_zero`` and ``similarity_full``;
   term evidence ``s / (s + text_half)`` with ``s`` = BM25 + ``sparse_weight`` x SPLADE dot product), weighted and
   summed, plus a bonus when both agree;
2. time: a query naming a day, a month or a year lifts memories whose validity starts inside it;
   names: a memory holding a name the query mentions (a capitalized word not starting a sentence) is lifted;
3. neighbours: a memory observed within ``neighbour_seconds`` of a strong hit in the same session, and every
   memory of a session that holds strong hits, is lifted by a share of their evidence (turns of one conversation
   explain each other: a question matches a reply, the fact sits in the turn before);
4. the relevance floor drops what is left below it, so junk finds nothing.

The ``limit`` most relevant survivors are returned, ordered by the composite score

    0.40 relevance + 0.25 recency + 0.20 usefulness + 0.10 confidence + 0.05 access_frequency

with all five components. Relevance decides *which* memories answer; the other components only order that answer
(an old memory that is the answer is never pushed out by recent, unrelated ones; see docs/retrieval.md). Called
by the service; retrieval bookkeeping for the returned hits runs after the answer.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import math
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from ibex_dataplane.embedding import Embedder, EmbeddingError, SparseEncoder, SparseVector
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Memory, Tenant
from ibex_dataplane.memory.refinery import Redactor
from ibex_dataplane.memory.repository import MemoryRepository, SearchRow, merge_legs
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
    """Every knob of retrieval; the defaults are calibrated on the LoCoMo development split for MiniLM."""

    min_similarity: float = 0.20  # ANN cutoff, before hydration (kept low: weak hits can still be lifted)
    relevance_floor: float = 0.30  # drop candidates below this relevance before scoring
    recency_half_life_days: float = 30.0
    frequency_half_saturation: float = 5.0  # retrieval_count at which the frequency component reaches 0.5
    ann_candidates: int = 40
    text_candidates: int = 60
    text_term_rows: int = 400  # memories read per query term for BM25 document frequencies
    text_population: int = 20000  # memories counted for BM25 idf
    vector_weight: float = 0.30
    text_weight: float = 0.70
    agreement_bonus: float = 0.0  # both legs found it (measured: no gain on top of the weighted sum)
    similarity_zero: float = 0.30  # cosine that is no evidence at all for MiniLM (unrelated sentences)
    similarity_full: float = 0.80  # cosine that is full evidence
    text_half: float = 12.0  # BM25 score plus the weighted SPLADE dot product that is half evidence (6 before it)
    sparse_weight: float = 0.2  # SPLADE dot product added to the BM25 score, in BM25 units (0: no sparse leg)
    sparse_candidates: int = 60
    sparse_term_rows: int = 400  # postings read per query token (the highest weights)
    name_weight: float = 0.10  # lift for a memory holding a name the query mentions (see names_in)
    time_weight: float = 0.10  # lift for memories valid from inside a period the query names
    neighbour_weight: float = 0.35  # share of a neighbour's evidence lent to a memory observed close to it
    neighbour_seconds: float = 120.0  # how close (observed_at, same session) counts as a neighbour
    session_weight: float = 0.20  # share of the best evidence in a session lent to all of its memories
    weights: ScoreWeights = ScoreWeights()

    def __post_init__(self) -> None:
        if not 0 <= self.relevance_floor < 1:
            raise ValueError("the relevance floor must be in [0, 1)")
        if not self.similarity_zero < self.similarity_full:
            raise ValueError("similarity_zero must be below similarity_full")


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


# -- relevance (pure) -----------------------------------------------------------------------------------------------

_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name} | {
    name.lower(): i for i, name in enumerate(calendar.month_abbr) if name
}
_MONTH = "|".join(sorted(_MONTHS, key=len, reverse=True))
_DAY_MONTH_YEAR = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+({_MONTH})\.?,?\s+((?:19|20)\d\d)\b", re.I)
_MONTH_DAY_YEAR = re.compile(rf"\b({_MONTH})\.?\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+((?:19|20)\d\d)\b", re.I)
_MONTH_YEAR = re.compile(rf"\b({_MONTH})\.?,?\s+(?:of\s+)?((?:19|20)\d\d)\b", re.I)
_ISO_DATE = re.compile(r"\b((?:19|20)\d\d)-(\d\d)-(\d\d)\b")
_YEAR = re.compile(r"\b((?:19|20)\d\d)\b")


@dataclass(frozen=True, slots=True)
class Period:
    """A half-open stretch of time a query names: [start, end)."""

    start: datetime
    end: datetime

    def holds(self, instant: datetime | None) -> bool:
        return instant is not None and self.start <= instant < self.end


def _month(year: int, month: int) -> Period:
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return Period(start, end)


def _day(year: int, month: int, day: int) -> Period | None:
    try:
        start = datetime(year, month, day, tzinfo=UTC)
    except ValueError:
        return None
    # A day spoken of is a day somewhere: a day either side covers every time zone and "the night before".
    return Period(start - timedelta(days=1), start + timedelta(days=2))


def periods_named(query: str) -> list[Period]:
    """The days, months and years a query names explicitly ("on 8 May 2023", "in June 2022", "2021")."""
    found: list[Period] = []
    spans: list[tuple[int, int]] = []

    def take(match: re.Match[str], period: Period | None) -> None:
        if period is not None and not any(a < match.end() and match.start() < b for a, b in spans):
            found.append(period)
            spans.append((match.start(), match.end()))

    for m in _ISO_DATE.finditer(query):
        take(m, _day(int(m.group(1)), int(m.group(2)), int(m.group(3))))
    for m in _DAY_MONTH_YEAR.finditer(query):
        take(m, _day(int(m.group(3)), _MONTHS[m.group(2).lower()], int(m.group(1))))
    for m in _MONTH_DAY_YEAR.finditer(query):
        take(m, _day(int(m.group(3)), _MONTHS[m.group(1).lower()], int(m.group(2))))
    for m in _MONTH_YEAR.finditer(query):
        take(m, _month(int(m.group(2)), _MONTHS[m.group(1).lower()]))
    for m in _YEAR.finditer(query):
        year = int(m.group(1))
        take(m, Period(datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC)))
    return found


_CAPITALIZED = re.compile(r"\b([A-Z][A-Za-z]+)\b")
_SENTENCE_START = re.compile(r"(?:^|[.?!:;\"(]\s*)$")
_WORD = re.compile(r"[A-Za-z]+")


def names_in(query: str) -> frozenset[str]:
    """Capitalized words of the query that do not start a sentence: names ("What did Maria paint?" -> Maria)."""
    found = set()
    for m in _CAPITALIZED.finditer(query):
        if not _SENTENCE_START.search(query[: m.start()]):
            found.add(m.group(1))
    return frozenset(found)


def holds_a_name(memory: Memory, names: frozenset[str]) -> bool:
    return bool(names) and not names.isdisjoint(_WORD.findall(memory.content or ""))


def vector_evidence(similarity: float | None, t: SearchTuning) -> float:
    if similarity is None:
        return 0.0
    return max(0.0, min(1.0, (similarity - t.similarity_zero) / (t.similarity_full - t.similarity_zero)))


def text_evidence(score: float | None, t: SearchTuning, sparse: float | None = None) -> float:
    """BM25 plus ``sparse_weight`` times the SPLADE dot product, on the scale ``s / (s + text_half)``."""
    total = (score or 0.0) + t.sparse_weight * (sparse or 0.0)
    if total <= 0:
        return 0.0
    return total / (total + t.text_half)


def _observed(memory: Memory) -> datetime:
    return memory.observed_at or memory.valid_from or memory.created_at


def relevance_of(
    rows: Sequence[SearchRow],
    tuning: SearchTuning,
    periods: Sequence[Period] = (),
    names: frozenset[str] = frozenset(),
) -> list[float]:
    """Relevance in [0, 1] of each candidate, in the order given (the floor is the caller's)."""
    t = tuning
    own: list[float] = []
    named: list[bool] = []
    for row in rows:
        v, x = vector_evidence(row.similarity, t), text_evidence(row.text_score, t, row.sparse_score)
        fused = t.vector_weight * v + t.text_weight * x + (t.agreement_bonus if v > 0 and x > 0 else 0.0)
        if periods and any(p.holds(row.memory.valid_from) or p.holds(row.memory.observed_at) for p in periods):
            fused += t.time_weight
        own.append(fused)
        named.append(holds_a_name(row.memory, names))
    lifted = list(own)
    if t.neighbour_weight > 0 or t.session_weight > 0:
        sessions: dict[str, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            if row.memory.session_id is not None:
                sessions[row.memory.session_id].append(i)
        window = t.neighbour_seconds
        for members in sessions.values():
            best = max(own[i] for i in members)
            ordered = sorted(members, key=lambda i: _observed(rows[i].memory))
            for pos, i in enumerate(ordered):
                near = 0.0
                at = _observed(rows[i].memory)
                for j in ordered[max(0, pos - 8) : pos + 9]:
                    if j != i and abs((_observed(rows[j].memory) - at).total_seconds()) <= window:
                        near = max(near, own[j])
                lifted[i] += t.neighbour_weight * near + t.session_weight * best
    # Names are the sharpest words of a question, yet a name an agent hears often has a low idf in BM25.
    lifted = [r + (t.name_weight if n else 0.0) for r, n in zip(lifted, named, strict=True)]
    return [max(0.0, min(1.0, r)) for r in lifted]


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
    rows: Sequence[SearchRow], query_text: str, limit: int, now: datetime, tuning: SearchTuning
) -> list[SearchHit]:
    """The answer: the ``limit`` most relevant candidates at or above the floor, ordered by composite score."""
    relevance = relevance_of(rows, tuning, periods_named(query_text), names_in(query_text))
    kept = sorted(
        ((r, row) for r, row in zip(relevance, rows, strict=True) if r >= tuning.relevance_floor),
        key=lambda pair: (-pair[0], str(pair[1].memory.id)),
    )[:limit]
    hits: list[SearchHit] = []
    for r, row in kept:
        total, components = score(row.memory, r, now, tuning)
        hits.append(SearchHit(row.memory, total, components, matched_by(row)))
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
    ) -> None:
        self._repo = repo
        self._embedder = embedder
        self._sparse = sparse if tuning.sparse_weight > 0 else None
        self._redactor = redactor
        self._metrics = metrics
        self.tuning = tuning

    async def candidates(self, tenant: Tenant, query: SearchQuery) -> tuple[str, list[SearchRow]]:
        """The masked query and every hit of either leg (unranked).

        The text leg needs only the masked query, so it runs while the query is embedded; the vector leg opens its
        transaction meanwhile and runs its statement once the embedding is there. Nothing but the masked text
        reaches the embedder or either statement.
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
        embedded = started

        async def embedding() -> np.ndarray[Any, Any]:
            nonlocal embedded
            try:
                vectors = await self._embedder.embed([masked])
            except EmbeddingError as e:
                raise Degraded("the embedding model is unavailable") from e
            embedded = time.perf_counter()
            self._metrics.search_seconds.labels("embed").observe(embedded - started)
            vector: np.ndarray[Any, Any] = vectors[0]
            return vector

        vector_task = asyncio.ensure_future(embedding())
        legs: list[asyncio.Future[Any]] = [vector_task, text_leg]
        sparse_leg: asyncio.Future[list[SearchRow]] | None = None
        if self._sparse is not None and query.as_of is None:  # history reads: superseded rows keep no postings
            sparse_leg = asyncio.ensure_future(self._sparse_rows(tenant, query, masked))
            legs.append(sparse_leg)
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
        return masked, merge_legs(vector_rows, text_rows, sparse_rows)

    async def _sparse_rows(self, tenant: Tenant, query: SearchQuery, masked: str) -> list[SearchRow]:
        """The sparse leg: the masked query's SPLADE weights (its own model thread), then the postings statement."""
        assert self._sparse is not None
        encoder = self._sparse
        started = time.perf_counter()

        async def encoded() -> SparseVector:
            try:
                vectors = await encoder.encode([masked])
            except EmbeddingError as e:
                raise Degraded("the sparse model is unavailable") from e
            self._metrics.search_seconds.labels("sparse_encode").observe(time.perf_counter() - started)
            return vectors[0]

        t = self.tuning
        vector = asyncio.ensure_future(encoded())
        try:
            return await self._repo.search_sparse(
                tenant, vector=vector, candidates=max(t.sparse_candidates, query.limit * 2),
                min_confidence=query.min_confidence, labels=query.labels, term_rows=t.sparse_term_rows,
            )  # fmt: skip
        finally:
            if not vector.done():
                vector.cancel()
                with contextlib.suppress(BaseException):
                    await vector
            elif not vector.cancelled():
                vector.exception()

    async def search(self, tenant: Tenant, query: SearchQuery) -> list[SearchHit]:
        masked, rows = await self.candidates(tenant, query)
        started = time.perf_counter()
        hits = rank(rows, masked, query.limit, query.as_of or datetime.now(UTC), self.tuning)
        for hit in hits:
            self._metrics.search_hits.labels(hit.matched_by).inc()
        self._metrics.search_seconds.labels("score").observe(time.perf_counter() - started)
        return hits
