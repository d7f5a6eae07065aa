"""Every SQL statement of the memory stage: memories, their labels and relationships, the memory outbox rows and
the capture queue.

Called by the refinery (write path), the search, the service (reads, forget, feedback), the outbox worker and the
capture worker.
Methods that are part of a larger transaction take the connection of a :meth:`Database.tenant` transaction; the
others open their own. Every statement names the org and the agent explicitly on top of row-level security
(architecture section 3), and reads that feed retrieval are validity-fenced (section 9.3).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import asyncpg
import numpy as np
import orjson

from ibex_dataplane.embedding import Embeddings, SparseVector
from ibex_dataplane.memory.models import (
    Memory,
    MemorySource,
    MemoryStatus,
    Neighbour,
    Relationship,
    Supersession,
    Tenant,
)
from ibex_dataplane.memory.populations import Populations
from ibex_dataplane.memory.validation import ListQuery
from ibex_dataplane.store.postgres import Database, postgres_errors

HOT_SYNC = "memory.hot_sync"
OUTBOX_KINDS = (HOT_SYNC,)


# A memory's columns but its retrieval bookkeeping, which lives in memory_retrievals (migration 0042: a bump of a
# row of memories rewrote about 2 kB and, when not HOT, every index of the table); a memory never returned has no
# row there and reads as a count of 0. The order is that of the search legs' rows (migration 0039).
def _columns(retrievals: str) -> str:
    return f"""
    m.id, m.agent_id, m.content, m.status, m.source, m.confidence, m.usefulness, m.valid_from, m.valid_until,
    m.observed_at, m.session_id, m.metadata, m.revision, {retrievals}, m.created_at, m.updated_at,
    m.positive_feedback, m.negative_feedback,
    coalesce((SELECT array_agg(l.label ORDER BY l.label) FROM memory_labels l WHERE l.memory_id = m.id), '{{}}')
        AS labels
    """


_COLUMNS = _columns(
    "coalesce((SELECT r.retrieval_count FROM memory_retrievals r WHERE r.memory_id = m.id), 0) AS retrieval_count,"
    " (SELECT r.last_retrieved_at FROM memory_retrievals r WHERE r.memory_id = m.id) AS last_retrieved_at"
)
# Valid at $3 (a timestamptz; NULL: now): the fence of every retrieval read.
_FENCE = (
    "(m.valid_from IS NULL OR m.valid_from <= coalesce($3::timestamptz, now()))"
    " AND (m.valid_until IS NULL OR m.valid_until > coalesce($3::timestamptz, now()))"
)

# Readable memories by id, read at now (migration 0043: one round trip; active and valid now, superseded if asked).
_GET_AS = "SELECT * FROM ibex_memory_get_as($1, $2, $3::uuid[], $4)"

# Counts the memories of {hits} (id, org_id, agent_id) as retrieved once more, now: the first retrieval inserts the
# memory's row of memory_retrievals, later ones update it (rows taken in id order, so two flushes cannot deadlock).
_BUMP_RETRIEVALS = """
INSERT INTO memory_retrievals AS r (memory_id, org_id, agent_id, retrieval_count, last_retrieved_at)
SELECT h.id, h.org_id, h.agent_id, 1, now() FROM {hits} h ORDER BY h.id
ON CONFLICT (memory_id) DO UPDATE
   SET retrieval_count = r.retrieval_count + 1, last_retrieved_at = excluded.last_retrieved_at
"""

# Each active duplicate share-locked (a concurrent supersede or forget waits for this transaction, or this statement
# for it, and then sees the row's new status), then counted as retrieved; the counts are read from the upsert, which
# the rest of the statement would not see.
_BUMP_DUPLICATES = f"""
WITH hit AS MATERIALIZED (
    SELECT m.* FROM memories m
     WHERE m.org_id = $1 AND m.agent_id = $2 AND m.status = 'active' AND m.content_hash = ANY($3::bytea[])
       FOR SHARE
), bumped AS (
    {_BUMP_RETRIEVALS.format(hits="hit")}
    RETURNING r.memory_id, r.retrieval_count, r.last_retrieved_at
)
SELECT m.content_hash, {_columns("b.retrieval_count, b.last_retrieved_at")}
  FROM hit m JOIN bumped b ON b.memory_id = m.id
"""

_INSERT = f"""
INSERT INTO memories AS m (id, org_id, agent_id, content, content_hash, status, source, session_id, request_id,
                           observed_at, valid_from, valid_until, confidence, metadata, embedding, sparse_tokens,
                           sparse_weights)
VALUES ($3, $1, $2, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14::jsonb, $15, $16::integer[], $17::real[])
ON CONFLICT (org_id, agent_id, content_hash) WHERE status = 'active' DO NOTHING
RETURNING {_COLUMNS}
"""

_INSERT_LABELS = """
INSERT INTO memory_labels (memory_id, label, org_id, agent_id)
SELECT $3, label, $1, $2 FROM unnest($4::text[]) AS label
"""

_INSERT_RELATIONSHIPS = """
INSERT INTO memory_relationships (source_id, target_id, kind, org_id, agent_id, score, needs_review)
SELECT s, t, k, $1, $2, sc, r
  FROM unnest($3::uuid[], $4::uuid[], $5::text[], $6::real[], $7::bool[]) AS x (s, t, k, sc, r)
ON CONFLICT DO NOTHING
"""

_SUPERSEDE = """
UPDATE memories m
   SET status = 'superseded', valid_until = coalesce($5, m.valid_until)
 WHERE m.org_id = $1 AND m.agent_id = $2 AND m.id = $3 AND m.revision = $4 AND m.status = 'active'
RETURNING m.id
"""

_NEIGHBOURS = """
SELECT n.id, n.similarity, n.content, n.revision, n.valid_from, n.valid_until FROM (
    SELECT m.id, 1 - (m.embedding <=> $3) AS similarity, m.content, m.revision, m.valid_from, m.valid_until
      FROM memories m
     WHERE m.org_id = $1 AND m.agent_id = $2 AND m.status = 'active' AND m.embedding IS NOT NULL
     ORDER BY m.embedding <=> $3
     LIMIT $4
) n
WHERE n.similarity >= $5
ORDER BY n.similarity DESC, n.id
"""

NEIGHBOUR_EF_SEARCH = 40
"""HNSW ef_search of the write path's neighbour lookup (near dedup and conflicts, five neighbours per item), apart
from search's: at 10,000 memories 40 finds 99.5% of the exact five nearest (100: 99.9%) in two thirds of the time
(bench/results/ingest.md)."""

_OUTBOX = """
INSERT INTO outbox (org_id, agent_id, kind, payload, available_at)
VALUES ($1, $2, $3, $4::jsonb, now() + $5::interval)
RETURNING id
"""

_LIST = f"""
SELECT {_COLUMNS} FROM memories m
 WHERE m.org_id = $1 AND m.agent_id = $2 AND m.status = $4
   AND ($4 <> 'active' OR {_FENCE})
   AND ($5::timestamptz IS NULL OR (m.created_at, m.id) < ($5, $6::uuid))
   AND ($8::text IS NULL OR m.source = $8)
 ORDER BY m.created_at DESC, m.id DESC
 LIMIT $7
"""

_LOCK_FOR_FORGET = """
SELECT m.id, m.revision, m.content_hash FROM memories m
 WHERE m.org_id = $1 AND m.agent_id = $2 AND m.id = $3 AND m.status <> 'forgotten'
   FOR UPDATE
"""

_FORGET = """
UPDATE memories m
   SET status = 'forgotten', content = NULL, embedding = NULL, sparse_tokens = NULL, sparse_weights = NULL,
       metadata = '{}'::jsonb,
       content_hash = $5, forgotten_at = now()
 WHERE m.org_id = $1 AND m.agent_id = $2 AND m.id = $3 AND m.revision = $4 AND m.status <> 'forgotten'
RETURNING m.revision
"""

_FEEDBACK = f"""
WITH changed AS (
    UPDATE memories m
       SET positive_feedback = m.positive_feedback + $5::int,
           negative_feedback = m.negative_feedback + (1 - $5::int),
           usefulness = (m.positive_feedback + $5::int + 1)::real / (m.positive_feedback + m.negative_feedback + 3)
     WHERE m.org_id = $1 AND m.agent_id = $2 AND m.id = $4 AND m.status = 'active' AND {_FENCE}
    RETURNING m.*
)
SELECT {_COLUMNS} FROM changed m
"""

# The memories are read (their owner and status checked) but not written.
_RECORD_RETRIEVALS = _BUMP_RETRIEVALS.format(
    hits="""(SELECT m.id, m.org_id, m.agent_id FROM memories m
              WHERE m.org_id = $1 AND m.agent_id = $2 AND m.id = ANY($3::uuid[]) AND m.status = 'active')"""
)


# Hybrid retrieval, two legs as two statements so the caller can run them concurrently (the text leg needs no
# embedding; it runs while the query is being embedded). Each leg hydrates its own hits row by row through the
# primary key; the caller merges them by id.
# Vector leg: HNSW with iterative scan, the cutoff applied after the index scan so the scan itself is not starved.
#   $1 org  $2 agent  $3 instant (NULL: now)  $4 query vector  $5 ANN candidates  $6 min similarity
#   $7 min confidence (NULL: none)  $8 labels (all required; empty: none)
# Text leg: BM25 over any query term. Current reads score from the postings kept at write time (migration 0012);
# history reads need superseded rows, which keep no postings, and go through the GIN index (migration 0011). Both
# are SECURITY DEFINER functions because `@@` and the postings must be read under row-level security.
#   $1 org  $2 agent  $3 instant (NULL: now)  $4 query text  $5 text candidates  $6 min confidence (NULL: none)
#   $7 labels  $8 rows read per query term  $9 memories of the agent for idf (current: counted by the caller;
#   history: the cap of the function's own count)
# The statements built here serve reads of a past instant; reads of now run the same statements from the *_as
# functions of migration 0039, which name `status = 'active'` literally: the partial HNSW index only serves
# queries whose predicate implies its own, and a parameterized status would hide that from a generic plan.
def _filters(statuses: str, confidence: str, labels: str) -> str:
    return f"""
       AND {_FENCE}
       AND m.status {statuses}
       AND ({confidence}::real IS NULL OR m.confidence >= {confidence})
       AND (cardinality({labels}::text[]) = 0
            OR (SELECT count(*) FROM memory_labels l WHERE l.memory_id = m.id AND l.label = ANY({labels}::text[]))
               = cardinality({labels}::text[]))
    """


def _hydrated(hits: str, filters: str) -> str:
    return f"""
    SELECT h.similarity, h.text_score, h.text_terms, x.*
      FROM {hits} h
     CROSS JOIN LATERAL (
        SELECT {_COLUMNS}
          FROM (SELECT * FROM memories m WHERE m.id = h.id OFFSET 0) m
         WHERE m.org_id = $1 AND m.agent_id = $2 {filters}
        OFFSET 0  -- keeps the subquery per hit, never a hash join over the whole table
     ) x
    """


def _vector_sql(statuses: str) -> str:
    filters = _filters(statuses, "$7", "$8")
    return f"""
    WITH ann AS MATERIALIZED (
        SELECT m.id, 1 - (m.embedding <=> $4) AS similarity, NULL::real AS text_score, 0 AS text_terms
          FROM memories m
         WHERE m.org_id = $1 AND m.agent_id = $2 AND m.embedding IS NOT NULL {filters}
         ORDER BY m.embedding <=> $4
         LIMIT $5
    )
    {_hydrated("(SELECT * FROM ann WHERE ann.similarity >= $6)", filters)}
    """


def _text_sql(statuses: str, function: str) -> str:
    return f"""
    WITH fts AS MATERIALIZED (
        SELECT t.id, NULL::float8 AS similarity, t.score AS text_score, t.terms AS text_terms FROM {function} t
    )
    {_hydrated("fts", _filters(statuses, "$6", "$7"))}
    """


# The inner `OFFSET 0` keeps the filters out of the lookup: with them, on a table not yet analyzed, the planner
# prefers walking the agent's part of the partial unique index (org, agent, hash; WHERE active) for every hit
# (measured: 0.18 ms per hit, 15 ms for 80 hits) to the primary key.


_VECTOR_HISTORY = _vector_sql("IN ('active', 'superseded')")
# The text leg's N (migration 0038): the agent's active memories, counted up to a cap ($3), at most once a minute.
_POPULATION = """
SELECT count(*) FROM (
    SELECT 1 FROM memories m WHERE m.org_id = $1 AND m.agent_id = $2 AND m.status = 'active' LIMIT $3
) a
"""
# Current reads (migration 0039): each leg is one statement calling its *_as function, which sets the tenant scope
# and the planner settings of _ann_settings itself, then runs the statements above for now (the sparse leg: the
# postings function of migration 0025, hydrated likewise) and returns their rows: one round trip instead of BEGIN +
# scope, settings, statement, COMMIT. Reads of a past instant keep the explicit transaction.
_VECTOR_AS = "SELECT * FROM ibex_memory_search_vector_as($1, $2, $3, $4, $5, $6, $7, $8)"
_TEXT_AS = "SELECT * FROM ibex_memory_search_text_as($1, $2, $3, $4, $5, $6, $7, $8, $9)"
_SPARSE_AS = "SELECT * FROM ibex_memory_search_sparse_as($1, $2, $3, $4, $5, $6, $7, $8, $9)"
_SPARSE_PENDING = "SELECT id, org_id, agent_id FROM ibex_memory_sparse_pending($1)"
_SPARSE_CONTENT = """
SELECT m.id, m.content FROM memories m
 WHERE m.org_id = $1 AND m.agent_id = $2 AND m.id = ANY($3::uuid[])
   AND m.status = 'active' AND m.sparse_tokens IS NULL AND m.content IS NOT NULL
"""
_SPARSE_FILL = """
UPDATE memories m SET sparse_tokens = x.tokens::integer[], sparse_weights = x.weights::real[]
  FROM (SELECT unnest($3::uuid[]) AS id, unnest($4::text[]) AS tokens, unnest($5::text[]) AS weights) x
 WHERE m.org_id = $1 AND m.agent_id = $2 AND m.id = x.id AND m.status = 'active' AND m.sparse_tokens IS NULL
"""
_TEXT_HISTORY = _text_sql(
    "IN ('active', 'superseded')",
    "ibex_memory_text_bm25($2, $4, $3::timestamptz, true, $6::real, $7::text[], $5, $8, $9)",
)


@dataclass(frozen=True, slots=True)
class SearchRow:
    """One hit of any search leg: cosine similarity (vector leg), BM25 score and query terms held (text leg),
    SPLADE dot product (sparse leg)."""

    memory: Memory
    similarity: float | None
    text_score: float | None
    text_terms: int
    sparse_score: float | None = None


def _decode_metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    decoded = orjson.loads(value) if isinstance(value, str | bytes) else value
    return decoded if isinstance(decoded, dict) else {}


_STATUSES = {status.value: status for status in MemoryStatus}
_SOURCES = {source.value: source for source in MemorySource}


def memory_of(row: Mapping[str, Any]) -> Memory:
    # Postgres real, integer and bigint columns arrive as float and int; the enums come from a dict (a search decodes
    # about a hundred rows, and the two enum calls were a seventh of each).
    return Memory(
        id=row["id"],
        agent_id=row["agent_id"],
        content=row["content"],
        status=_STATUSES[row["status"]],
        labels=tuple(row["labels"] or ()),
        source=_SOURCES[row["source"]],
        confidence=row["confidence"],
        usefulness=row["usefulness"],
        valid_from=row["valid_from"],
        valid_until=row["valid_until"],
        observed_at=row["observed_at"],
        session_id=row["session_id"],
        metadata=_decode_metadata(row["metadata"]),
        revision=row["revision"],
        retrieval_count=row["retrieval_count"],
        last_retrieved_at=row["last_retrieved_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        positive_feedback=row["positive_feedback"],
        negative_feedback=row["negative_feedback"],
    )


class MemoryRepository:
    """SQL over one :class:`Database`; every method is scoped by the :class:`Tenant` it is given."""

    def __init__(
        self,
        db: Database,
        *,
        ef_search: int = 100,
        neighbour_ef_search: int = NEIGHBOUR_EF_SEARCH,
        populations: Populations | None = None,
    ) -> None:
        self._db = db
        self._ef_search = int(ef_search)
        self._neighbour_ef_search = int(neighbour_ef_search)
        self._populations = populations if populations is not None else Populations()

    @asynccontextmanager
    async def transaction(self, tenant: Tenant, *, readonly: bool = False) -> AsyncIterator[asyncpg.Connection]:
        """A tenant transaction (org and agent set for row-level security); connection errors become 503s."""
        with postgres_errors():
            async with self._db.tenant(tenant.org_id, tenant.agent_id, readonly=readonly) as conn:
                yield conn

    async def _call_as(self, tenant: Tenant, sql: str, *args: object) -> list[asyncpg.Record]:
        """One statement calling a ``*_as`` function of the tenant (one round trip; connection errors become 503s
        in :meth:`Database.call_as_rows`)."""
        return await self._db.call_as_rows(tenant.org_id, tenant.agent_id, sql, *args)

    # -- write path ----------------------------------------------------------------------------------------------

    async def bump_duplicates(self, tenant: Tenant, hashes: Sequence[bytes]) -> dict[bytes, Memory]:
        """Active memories with these content hashes, their retrieval metadata bumped (exact dedup, stage 3)."""
        if not hashes:
            return {}
        async with self.transaction(tenant) as conn:
            rows = await conn.fetch(_BUMP_DUPLICATES, tenant.org_id, tenant.agent_id, list(hashes))
        return {bytes(r["content_hash"]): memory_of(r) for r in rows}

    async def neighbours(
        self, tenant: Tenant, vectors: Embeddings, *, k: int, min_similarity: float
    ) -> list[list[Neighbour]]:
        """The ``k`` nearest active memories of the agent for each vector, at or above ``min_similarity``."""
        found: list[list[Neighbour]] = []
        async with self.transaction(tenant, readonly=True) as conn:
            await self._ann_settings(conn, self._neighbour_ef_search)
            for vector in vectors:
                rows = await conn.fetch(_NEIGHBOURS, tenant.org_id, tenant.agent_id, vector, k, min_similarity)
                found.append(
                    [
                        Neighbour(
                            id=r["id"],
                            similarity=float(r["similarity"]),
                            content=r["content"] or "",
                            revision=int(r["revision"]),
                            valid_from=r["valid_from"],
                            valid_until=r["valid_until"],
                        )
                        for r in rows
                    ]
                )
        return found

    async def insert_memory(
        self,
        conn: asyncpg.Connection,
        tenant: Tenant,
        *,
        memory_id: UUID,
        content: str,
        content_hash: bytes,
        status: MemoryStatus,
        source: MemorySource,
        session_id: str | None,
        request_id: str | None,
        observed_at: datetime | None,
        valid_from: datetime | None,
        valid_until: datetime | None,
        confidence: float,
        metadata: dict[str, Any],
        embedding: np.ndarray[Any, Any] | None,
        labels: Sequence[str],
        sparse: SparseVector | None = None,
    ) -> Memory | None:
        """Insert one memory and its labels; ``None`` when an active row with the same hash won the race."""
        row = await conn.fetchrow(
            _INSERT, tenant.org_id, tenant.agent_id, memory_id, content, content_hash, status.value, source.value,
            session_id, request_id, observed_at, valid_from, valid_until, confidence,
            orjson.dumps(metadata).decode(), embedding,
            None if sparse is None else sparse.tokens.tolist(), None if sparse is None else sparse.weights.tolist(),
        )  # fmt: skip
        if row is None:
            return None
        if labels:
            await conn.execute(_INSERT_LABELS, tenant.org_id, tenant.agent_id, memory_id, list(labels))
        memory = memory_of(row)
        return Memory(**{**_fields(memory), "labels": tuple(sorted(labels))})

    async def insert_relationships(
        self, conn: asyncpg.Connection, tenant: Tenant, relationships: Sequence[Relationship]
    ) -> None:
        if not relationships:
            return
        await conn.execute(
            _INSERT_RELATIONSHIPS,
            tenant.org_id,
            tenant.agent_id,
            [r.source_id for r in relationships],
            [r.target_id for r in relationships],
            [r.kind.value for r in relationships],
            [r.score for r in relationships],
            [r.needs_review for r in relationships],
        )

    async def supersede(self, conn: asyncpg.Connection, tenant: Tenant, change: Supersession) -> bool:
        """Mark an older memory superseded, only if it is still active at the revision the refinery saw."""
        row = await conn.fetchrow(
            _SUPERSEDE, tenant.org_id, tenant.agent_id, change.target_id, change.revision, change.close_at
        )
        return row is not None

    async def enqueue(
        self, conn: asyncpg.Connection, tenant: Tenant, kind: str, memory_ids: Sequence[UUID], *, delay: float
    ) -> int:
        """Record an after-commit effect in the same transaction as the change it follows."""
        payload = orjson.dumps({"memory_ids": [str(i) for i in memory_ids]}).decode()
        outbox_id: int = await conn.fetchval(
            _OUTBOX, tenant.org_id, tenant.agent_id, kind, payload, timedelta(seconds=delay)
        )
        return outbox_id

    # -- reads -----------------------------------------------------------------------------------------------------

    async def get_many(
        self, tenant: Tenant, ids: Sequence[UUID], *, include_superseded: bool = False
    ) -> dict[UUID, Memory]:
        """Readable memories among ``ids``: active and valid now (and superseded ones if asked); never others."""
        if not ids:
            return {}
        rows = await self._call_as(tenant, _GET_AS, list(ids), include_superseded)
        return {r["id"]: memory_of(r) for r in rows}

    async def page(self, tenant: Tenant, query: ListQuery) -> list[Memory]:
        cursor_at = query.cursor.created_at if query.cursor else None
        cursor_id = query.cursor.id if query.cursor else None
        async with self.transaction(tenant, readonly=True) as conn:
            rows = await conn.fetch(
                _LIST, tenant.org_id, tenant.agent_id, None, query.status.value, cursor_at, cursor_id,
                query.limit + 1, query.source.value if query.source else None,
            )  # fmt: skip
        return [memory_of(r) for r in rows]

    async def search_vector(
        self,
        tenant: Tenant,
        *,
        vector: Awaitable[np.ndarray[Any, Any]],
        at: datetime | None,
        candidates: int,
        min_similarity: float,
        min_confidence: float | None,
        labels: Sequence[str],
    ) -> list[asyncpg.Record]:
        """The vector leg: the ``candidates`` nearest readable memories at or above ``min_similarity``, as rows
        (``similarity`` and the memory's columns) for :func:`merge_legs`.

        A read of now is one round trip once ``vector`` is there (the *_as function sets the tenant scope and the
        planner settings). A read of a past instant awaits ``vector`` inside its open transaction, so the
        connection, the scope and the settings are ready while the query is still being embedded.
        """
        if at is None:
            query_vector = await vector
            rows = await self._call_as(
                tenant, _VECTOR_AS, self._ef_search, query_vector, candidates, min_similarity, min_confidence,
                list(labels),
            )  # fmt: skip
            return rows
        async with self.transaction(tenant, readonly=True) as conn:
            await self._ann_settings(conn)
            query_vector = await vector
            history: list[asyncpg.Record] = await conn.fetch(
                _VECTOR_HISTORY, tenant.org_id, tenant.agent_id, at, query_vector, candidates, min_similarity,
                min_confidence, list(labels),
            )  # fmt: skip
        return history

    async def search_text(
        self,
        tenant: Tenant,
        *,
        text: str,
        at: datetime | None,
        candidates: int,
        min_confidence: float | None,
        labels: Sequence[str],
        term_rows: int = 400,
        population: int = 20000,
    ) -> list[asyncpg.Record]:
        """The text leg: the ``candidates`` best BM25 matches (``text_score``, ``text_terms`` and the memory's
        columns, for :func:`merge_legs`); ``term_rows`` and ``population`` bound its statistics.

        A current read takes the agent's memory count (idf's N, at most ``population``) from the population cache,
        counting it first when the cache has none, then is one round trip.
        """
        if at is None:
            n = self._populations.get(tenant.org_id, tenant.agent_id)
            if n is None:
                async with self.transaction(tenant, readonly=True) as conn:
                    n = int(await conn.fetchval(_POPULATION, tenant.org_id, tenant.agent_id, population))
                self._populations.put(tenant.org_id, tenant.agent_id, n)
            rows = await self._call_as(
                tenant, _TEXT_AS, self._ef_search, text, candidates, min_confidence, list(labels), term_rows, n
            )
            return rows
        async with self.transaction(tenant, readonly=True) as conn:
            await self._ann_settings(conn)
            history: list[asyncpg.Record] = await conn.fetch(
                _TEXT_HISTORY, tenant.org_id, tenant.agent_id, at, text, candidates, min_confidence, list(labels),
                term_rows, population,
            )  # fmt: skip
        return history

    async def search_sparse(
        self,
        tenant: Tenant,
        *,
        vector: Awaitable[SparseVector],
        candidates: int,
        min_confidence: float | None,
        labels: Sequence[str],
        term_rows: int = 400,
    ) -> list[asyncpg.Record]:
        """The sparse leg: the ``candidates`` best SPLADE matches of the current memories (the dot product in
        ``text_score``, and the memory's columns, for :func:`merge_legs`).

        One round trip once ``vector`` (the query's SPLADE weights) is there.
        """
        query = await vector
        rows = await self._call_as(
            tenant, _SPARSE_AS, self._ef_search, query.tokens.tolist(), query.weights.tolist(), candidates,
            min_confidence, list(labels), term_rows,
        )  # fmt: skip
        return rows

    async def sparse_pending(self, limit: int) -> list[tuple[UUID, Tenant]]:
        """Active memories of any org without sparse weights (written before migration 0025): ids and owners only."""
        async with self._db.unscoped() as conn:
            with postgres_errors():
                rows = await conn.fetch(_SPARSE_PENDING, limit)
        return [(r["id"], Tenant(org_id=r["org_id"], agent_id=r["agent_id"])) for r in rows]

    async def sparse_content(self, tenant: Tenant, ids: Sequence[UUID]) -> dict[UUID, str]:
        """Content of those of ``ids`` that are still active and still without sparse weights."""
        async with self.transaction(tenant, readonly=True) as conn:
            rows = await conn.fetch(_SPARSE_CONTENT, tenant.org_id, tenant.agent_id, list(ids))
        return {r["id"]: r["content"] for r in rows}

    async def fill_sparse(self, tenant: Tenant, vectors: dict[UUID, SparseVector]) -> int:
        """Store sparse weights of memories that still have none (the trigger writes their postings); how many."""
        if not vectors:
            return 0
        ids = list(vectors)
        tokens = ["{" + ",".join(map(str, vectors[i].tokens.tolist())) + "}" for i in ids]
        weights = ["{" + ",".join(repr(float(w)) for w in vectors[i].weights.tolist()) + "}" for i in ids]
        async with self.transaction(tenant) as conn:
            status = await conn.execute(_SPARSE_FILL, tenant.org_id, tenant.agent_id, ids, tokens, weights)
        return int(status.split()[-1])

    async def record_retrievals(self, tenant: Tenant, ids: Sequence[UUID]) -> None:
        if not ids:
            return
        async with self.transaction(tenant) as conn:
            await conn.execute(_RECORD_RETRIEVALS, tenant.org_id, tenant.agent_id, list(ids))

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def forget(self, tenant: Tenant, memory_id: UUID, digest: Any) -> bool:
        """Tombstone one memory: content, embedding, labels and metadata erased, hash replaced by a keyed digest.

        ``digest(content_hash) -> bytes`` makes the digest. The row is locked first, and the tombstone is written
        only over the revision that was locked, so nothing that read an older revision can slip in between. The
        hot-cache purge is queued in the same transaction. Returns False if there was nothing to forget.
        """
        async with self.transaction(tenant) as conn:
            locked = await conn.fetchrow(_LOCK_FOR_FORGET, tenant.org_id, tenant.agent_id, memory_id)
            if locked is None:
                return False
            revision = await conn.fetchval(
                _FORGET, tenant.org_id, tenant.agent_id, memory_id, locked["revision"],
                digest(bytes(locked["content_hash"])),
            )  # fmt: skip
            if revision is None:
                return False
            await conn.execute(
                "DELETE FROM memory_labels WHERE org_id = $1 AND agent_id = $2 AND memory_id = $3",
                tenant.org_id,
                tenant.agent_id,
                memory_id,
            )
            await self.enqueue(conn, tenant, HOT_SYNC, [memory_id], delay=5.0)
        return True

    async def feedback(self, tenant: Tenant, memory_id: UUID, *, useful: bool) -> Memory | None:
        """Count one vote and recompute usefulness, Laplace-smoothed: (positive + 1) / (positive + negative + 2)."""
        async with self.transaction(tenant) as conn:
            row = await conn.fetchrow(_FEEDBACK, tenant.org_id, tenant.agent_id, None, memory_id, 1 if useful else 0)
            if row is None:
                return None
            await self.enqueue(conn, tenant, HOT_SYNC, [memory_id], delay=5.0)
        return memory_of(row)

    # -- hot cache rehydration and the outbox --------------------------------------------------------------------

    async def hot_candidates(self, tenant: Tenant, ids: Sequence[UUID]) -> dict[UUID, Memory]:
        return await self.get_many(tenant, ids)

    async def lease_outbox(self, limit: int, lease: float) -> list[dict[str, Any]]:
        """Lease due outbox events of every org, then read their payloads inside each org's own scope.

        The cross-tenant step (a narrow SECURITY DEFINER function) returns ids and owners only; payloads are read
        under row-level security, one tenant transaction per org. Rows come back with ``payload`` added.
        """
        async with self._db.unscoped() as conn:
            with postgres_errors():
                leased: list[asyncpg.Record] = await conn.fetch(
                    "SELECT * FROM ibex_outbox_lease_ids($1::text[], $2, $3::interval)",
                    list(OUTBOX_KINDS),
                    limit,
                    timedelta(seconds=lease),
                )
        by_org: dict[UUID, list[int]] = {}
        for row in leased:
            by_org.setdefault(row["org_id"], []).append(row["id"])
        payloads: dict[int, Any] = {}
        for org_id, ids in by_org.items():
            async with self._db.tenant(org_id) as conn:
                for r in await conn.fetch(
                    "SELECT id, payload FROM outbox WHERE org_id = $1 AND id = ANY($2::bigint[])", org_id, ids
                ):
                    payloads[r["id"]] = r["payload"]
        return [{**dict(row), "payload": payloads.get(row["id"])} for row in leased]

    async def outbox_done(self, org_id: UUID, ids: Sequence[int]) -> None:
        async with self._db.tenant(org_id) as conn:
            await conn.execute(
                "UPDATE outbox SET done_at = now(), last_error = NULL WHERE org_id = $1 AND id = ANY($2::bigint[])",
                org_id,
                list(ids),
            )

    async def outbox_retry(self, org_id: UUID, ids: Sequence[int], *, error: str, delay: float) -> None:
        async with self._db.tenant(org_id) as conn:
            await conn.execute(
                "UPDATE outbox SET last_error = $3, available_at = now() + $4::interval"
                " WHERE org_id = $1 AND id = ANY($2::bigint[]) AND done_at IS NULL",
                org_id,
                list(ids),
                error[:200],
                timedelta(seconds=delay),
            )

    async def housekeeping(self, *, outbox_age: float, limit: int = 1000) -> int:
        async with self._db.unscoped() as conn:
            with postgres_errors():
                removed: int = await conn.fetchval(
                    "SELECT ibex_memory_housekeeping($1::interval, $2)", timedelta(seconds=outbox_age), limit
                )
        return removed

    # -- the capture queue (memories from conversations) -----------------------------------------------------------

    async def lease_capture(self, limit: int, lease: float) -> list[dict[str, Any]]:
        """Lease due capture jobs of every org (ids and owners only, through the SECURITY DEFINER lease), then read
        each job inside its own org's and agent's row-level-security scope."""
        async with self._db.unscoped() as conn:
            with postgres_errors():
                leased: list[asyncpg.Record] = await conn.fetch(
                    "SELECT * FROM ibex_capture_lease_ids($1, $2::interval)", limit, timedelta(seconds=lease)
                )
        jobs: list[dict[str, Any]] = []
        for row in leased:
            async with self._db.tenant(row["org_id"], row["agent_id"], readonly=True) as conn:
                job = await conn.fetchrow(
                    "SELECT id, org_id, agent_id, session_id, turn, request_id, mode, model, messages, observed_at,"
                    " created_at, attempts FROM capture_jobs WHERE org_id = $1 AND agent_id = $2 AND id = $3"
                    " AND failed_at IS NULL",
                    row["org_id"], row["agent_id"], row["id"],
                )  # fmt: skip
            if job is not None:
                jobs.append(dict(job))
        return jobs

    async def capture_done(self, tenant: Tenant, job_id: int) -> None:
        """A processed job goes, and its text with it."""
        async with self._db.tenant(tenant.org_id, tenant.agent_id) as conn:
            await conn.execute(
                "DELETE FROM capture_jobs WHERE org_id = $1 AND agent_id = $2 AND id = $3",
                tenant.org_id, tenant.agent_id, job_id,
            )  # fmt: skip

    async def capture_retry(self, tenant: Tenant, job_id: int, *, error: str, delay: float) -> None:
        async with self._db.tenant(tenant.org_id, tenant.agent_id) as conn:
            await conn.execute(
                "UPDATE capture_jobs SET available_at = now() + $4::interval, last_error = $5"
                " WHERE org_id = $1 AND agent_id = $2 AND id = $3",
                tenant.org_id, tenant.agent_id, job_id, timedelta(seconds=delay), error,
            )  # fmt: skip

    async def capture_failed(self, tenant: Tenant, job_id: int, *, error: str) -> None:
        """A job that can never succeed keeps its metadata and error (visible) but loses its text."""
        async with self._db.tenant(tenant.org_id, tenant.agent_id) as conn:
            await conn.execute(
                "UPDATE capture_jobs SET messages = NULL, failed_at = now(), last_error = $4"
                " WHERE org_id = $1 AND agent_id = $2 AND id = $3",
                tenant.org_id, tenant.agent_id, job_id, error,
            )  # fmt: skip

    async def extraction_policy(self, tenant: Tenant) -> dict[str, Any] | None:
        """What a fact extraction call for this agent is checked against, read in the tenant's own scope: the org's
        and the agent's status and budget, and the org's model policy (None: the org or the agent is gone)."""
        async with self._db.tenant(tenant.org_id, tenant.agent_id, readonly=True) as conn:
            row = await conn.fetchrow(
                "SELECT o.suspended AS org_suspended, o.budget_limit_usd AS org_limit, o.budget_enforcement,"
                " o.models_allow, o.models_deny, a.suspended AS agent_suspended, a.budget_limit_usd AS agent_limit"
                " FROM organizations o JOIN agents a ON a.org_id = o.id WHERE o.id = $1 AND a.id = $2",
                tenant.org_id, tenant.agent_id,
            )  # fmt: skip
        return None if row is None else dict(row)

    async def capture_backlog(self) -> tuple[int, int, float]:
        """Waiting jobs, failed jobs and the age in seconds of the oldest waiting one, across tenants (counts)."""
        async with self._db.unscoped() as conn:
            with postgres_errors():
                row = await conn.fetchrow("SELECT * FROM ibex_capture_backlog()")
        assert row is not None
        return int(row["waiting"]), int(row["failed"]), float(row["oldest_seconds"])

    async def capture_housekeeping(self, *, failed_age: float, limit: int = 1000) -> int:
        async with self._db.unscoped() as conn:
            with postgres_errors():
                removed: int = await conn.fetchval(
                    "SELECT ibex_capture_housekeeping($1::interval, $2)", timedelta(seconds=failed_age), limit
                )
        return removed

    async def _ann_settings(self, conn: asyncpg.Connection, ef_search: int | None = None) -> None:
        """Transaction-local planner settings for statements ordered by vector distance (``ef_search``: search's
        unless given).

        pgvector 0.8 iterative scans keep walking the HNSW graph until enough rows pass the tenant filter (recall
        under per-agent filtering); relaxed order is fine because hits are re-ranked anyway. Sequential scans and
        explicit sorts are ruled out so the plan cannot depend on statistics: until autovacuum analyzes a fast
        growing table, the planner believes it small and prefers reading all of the agent's rows and sorting them
        by distance (measured: 0.3 ms -> 17 ms per lookup at 8k memories). The only sorts left are the ones no
        plan can avoid, and Postgres then picks the plan with the fewest disabled steps: the HNSW scan.
        With those settings the plan does not depend on the parameters either, so the prepared statements use
        their generic plan from the first execution instead of planning each call (measured: the vector leg of
        search 4.2 -> 3.1 ms median).
        """
        await conn.execute(
            "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true), set_config('hnsw.ef_search', $1, true),"
            " set_config('enable_seqscan', 'off', true), set_config('enable_sort', 'off', true),"
            " set_config('plan_cache_mode', 'force_generic_plan', true)",
            str(self._ef_search if ef_search is None else ef_search),
        )


def merge_legs(
    vector: Sequence[Mapping[str, Any]], text: Sequence[Mapping[str, Any]], sparse: Sequence[Mapping[str, Any]] = ()
) -> list[SearchRow]:
    """One row per memory, in the order the legs first found them: a memory several legs found carries its
    similarity (vector leg), BM25 score and query terms held (text leg) and SPLADE dot product (sparse leg).

    Each memory is decoded once, however many legs returned it (the legs overlap by about a third).
    """
    found: dict[UUID, Mapping[str, Any]] = {}
    similarity: dict[UUID, float] = {}
    text_score: dict[UUID, float] = {}
    text_terms: dict[UUID, int] = {}
    sparse_score: dict[UUID, float] = {}
    for r in vector:
        found.setdefault(r["id"], r)
        if r["similarity"] is not None:
            similarity[r["id"]] = r["similarity"]
    for r in text:
        found.setdefault(r["id"], r)
        if r["text_score"] is not None:
            text_score[r["id"]] = r["text_score"]
        text_terms[r["id"]] = r["text_terms"]
    for r in sparse:
        found.setdefault(r["id"], r)
        if r["text_score"] is not None:
            sparse_score[r["id"]] = r["text_score"]
    return [
        SearchRow(memory_of(row), similarity.get(i), text_score.get(i), text_terms.get(i, 0), sparse_score.get(i))
        for i, row in found.items()
    ]


def _fields(memory: Memory) -> dict[str, Any]:
    return {name: getattr(memory, name) for name in Memory.__dataclass_fields__}
