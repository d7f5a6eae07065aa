"""The memory write path: candidate memories through the eight stages of architecture section 9.2.

validate -> pii -> exact_dedup -> embed -> near_dedup -> conflict -> persist -> after_commit

:class:`Refinery` runs a list of small named stages over a :class:`WriteBatch` (one write is a batch of one, so the
single and the bulk path are the same code and embeddings are always batched). Every stage looks only at the
candidates still in flight, settles the ones it decides (rejected, duplicate, quarantined, failed), and reports a
count per outcome; the refinery times each stage, feeds the Prometheus metrics and logs one line per call with ids,
outcomes and timings, never content. The caller's deadline is checked between stages up to persist; from persist on
nothing is interrupted, so a deadline can never leave half a write behind. The memory stage runs a batch in slices
through a pipeline of three steps (up to exact dedup, embed, the rest), so one slice's PII check, the next one's
embedding and the store work of a third overlap (:class:`Refinery`).

Called by :class:`ibex_dataplane.memory.service.MemoryService`. Each stage is its own class so it can be tested
alone; the pure helpers (:func:`normalize`, :func:`content_hash`) are the dedup contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import itertools
import logging
import re
import time
import unicodedata
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol
from uuid import UUID

import numpy as np

from ibex_dataplane.embedding import Embedder, EmbeddingError, SparseEncoder, SparseVector
from ibex_dataplane.memory.classifier import ConflictClassifier, ConflictQuestion, Verdict
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import (
    Memory,
    MemoryDraft,
    MemoryStatus,
    Neighbour,
    RelationKind,
    Relationship,
    Supersession,
    Tenant,
)
from ibex_dataplane.memory.outbox import OutboxWorker
from ibex_dataplane.memory.repository import HOT_SYNC, MemoryRepository
from ibex_dataplane.memory.validation import parse_write
from ibex_dataplane.pii import PiiError
from ibex_dataplane.shared.errors import (
    DeadlineExceeded,
    Degraded,
    ServiceError,
    Unprocessable,
    ValidationFailed,
)
from ibex_dataplane.shared.memory_limits import MAX_CONTENT_BYTES
from ibex_dataplane.store.errors import StoreUnavailable

log = logging.getLogger(__name__)

_WHITESPACE = re.compile(r"\s+")
# Text that could hold a pattern-recognizable PII value: a digit, an '@', a ':' (MAC/IPv6) or a long token
# (crypto addresses). Content is always scanned; this only spares labels and metadata values that cannot match.
_MAYBE_PII = re.compile(r"[0-9@:]|[^\W_]{20,}")


def normalize(text: str) -> str:
    """The dedup form: Unicode NFC, whitespace collapsed to single spaces and trimmed, casefolded."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFC", text)).strip().casefold()


def content_hash(text: str) -> bytes:
    """SHA-256 of the normalized (already redacted) content."""
    return hashlib.sha256(normalize(text).encode("utf-8")).digest()


class WriteOutcome(enum.StrEnum):
    CREATED = "created"
    DEDUPLICATED = "deduplicated"
    QUARANTINED = "quarantined"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What happened to one write; handlers turn it into 201, 200, 202 or the error's status."""

    outcome: WriteOutcome
    memory: Memory | None = None
    relationships: tuple[Relationship, ...] = ()
    error: ServiceError | None = None

    @property
    def status(self) -> int:
        if self.error is not None:
            return self.error.status
        return {WriteOutcome.CREATED: 201, WriteOutcome.DEDUPLICATED: 200, WriteOutcome.QUARANTINED: 202}[self.outcome]


@dataclass(eq=False)
class Candidate:
    """One write in flight. Stages fill it in; ``result`` set means it is settled and later stages skip it."""

    index: int
    raw: Any
    memory_id: UUID = field(default_factory=uuid.uuid4)
    draft: MemoryDraft | None = None
    content: str = ""
    labels: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    quarantined: bool = False
    content_hash: bytes = b""
    follows: Candidate | None = None  # an earlier item of the same batch with the same content
    embedding: np.ndarray[Any, Any] | None = None
    sparse: SparseVector | None = None
    neighbours: list[Neighbour] = field(default_factory=list)
    relationships: list[Relationship] = field(default_factory=list)
    supersessions: list[Supersession] = field(default_factory=list)
    result: WriteResult | None = None

    @property
    def in_flight(self) -> bool:
        return self.result is None and self.follows is None

    def settle(self, result: WriteResult) -> None:
        self.result = result

    def fail(self, error: ServiceError) -> None:
        self.result = WriteResult(WriteOutcome.REJECTED, error=error)


@dataclass
class WriteBatch:
    tenant: Tenant
    request_id: str
    deadline: float  # epoch seconds
    candidates: list[Candidate]
    outbox: list[tuple[int, list[UUID]]] = field(default_factory=list)
    seen: dict[bytes, Candidate] = field(default_factory=dict)  # content hash -> first item: shared by the slices

    def in_flight(self) -> list[Candidate]:
        return [c for c in self.candidates if c.in_flight]


@dataclass(frozen=True, slots=True)
class StageReport:
    stage: str
    outcomes: dict[str, int]
    seconds: float


class Stage(Protocol):
    name: str
    interruptible: bool

    async def __call__(self, batch: WriteBatch) -> Counter[str]: ...


class Redactor(Protocol):
    """What the PII stage needs from :class:`ibex_dataplane.pii.redactor.PiiRedactor`."""

    async def redact_async(self, text: str, *, disallowed_types: AbstractSet[str] = ...) -> Any: ...


# -- 1. validate ---------------------------------------------------------------------------------------------------


class Validate:
    name = "validate"
    interruptible = True

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        outcomes: Counter[str] = Counter()
        for c in batch.in_flight():
            try:
                c.draft = parse_write(c.raw)
            except ValidationFailed as e:
                c.fail(e)
                outcomes["rejected"] += 1
                continue
            outcomes["ok"] += 1
        return outcomes


# -- 2. pii ----------------------------------------------------------------------------------------------------------


class RedactPii:
    """Presidio over content (always), labels and metadata strings; confident findings become ``[TYPE]``."""

    name = "pii"
    interruptible = True

    def __init__(
        self,
        redactor: Redactor,
        metrics: MemoryMetrics,
        *,
        disallowed_types: AbstractSet[str] = frozenset(),
        scan_everything: bool = False,
    ) -> None:
        self._redactor = redactor
        self._metrics = metrics
        self._disallowed = frozenset(disallowed_types)
        self._scan_everything = scan_everything  # with NER on, names need no digits: scan every string

    async def _redact(self, text: str) -> tuple[str, bool]:
        result = await self._redactor.redact_async(text, disallowed_types=self._disallowed)
        for finding in result.findings:
            self._metrics.pii_findings.labels(finding.entity_type, "redacted" if finding.redacted else "flagged").inc()
        return str(result.text), bool(result.quarantine)

    async def _redact_side(self, text: str) -> tuple[str, bool]:
        if not self._scan_everything and not _MAYBE_PII.search(text):
            return text, False
        return await self._redact(text)

    async def _redact_json(self, value: Any) -> tuple[Any, bool]:
        if isinstance(value, str):
            return await self._redact_side(value)
        if isinstance(value, list):
            items = [await self._redact_json(v) for v in value]
            return [v for v, _ in items], any(q for _, q in items)
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            flagged = False
            for key, inner in value.items():
                new_key, q1 = await self._redact_side(key)
                new_value, q2 = await self._redact_json(inner)
                out[new_key] = new_value
                flagged = flagged or q1 or q2
            return out, flagged
        return value, False

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        outcomes: Counter[str] = Counter()
        for c in batch.in_flight():
            assert c.draft is not None
            try:
                content, flagged = await self._redact(c.draft.content)
                labels: list[str] = []
                for label in c.draft.labels:
                    redacted, q = await self._redact_side(label)
                    flagged = flagged or q
                    if redacted not in labels:
                        labels.append(redacted)
                metadata, q = await self._redact_json(c.draft.metadata)
                flagged = flagged or q
            except PiiError:
                c.fail(Degraded("the PII check is unavailable; nothing was stored"))
                outcomes["failed"] += 1
                continue
            if len(content.encode("utf-8")) > MAX_CONTENT_BYTES:
                c.fail(Unprocessable(f"the content exceeds {MAX_CONTENT_BYTES} bytes once personal data is masked"))
                outcomes["rejected"] += 1
                continue
            c.content, c.labels, c.metadata, c.quarantined = content, tuple(labels), metadata, flagged
            outcomes["quarantined" if flagged else "ok"] += 1
        return outcomes


# -- 3. exact dedup --------------------------------------------------------------------------------------------------


class ExactDedup:
    """Same normalized content as an active memory of the agent: bump it and answer with it; create nothing."""

    name = "exact_dedup"
    interruptible = True

    def __init__(self, repo: MemoryRepository, metrics: MemoryMetrics) -> None:
        self._repo = repo
        self._metrics = metrics

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        outcomes: Counter[str] = Counter()
        first: dict[bytes, Candidate] = {}  # this slice's new hashes; batch.seen also holds the earlier slices'
        for c in batch.in_flight():
            c.content_hash = content_hash(c.content)
            if c.quarantined:  # never deduplicated against, never a duplicate: kept for review as it came
                outcomes["skipped"] += 1
                continue
            leader = batch.seen.get(c.content_hash)
            if leader is not None:
                c.follows = leader
                outcomes["duplicate_in_batch"] += 1
            else:
                batch.seen[c.content_hash] = first[c.content_hash] = c
        existing = await self._repo.bump_duplicates(batch.tenant, list(first))
        for digest, memory in existing.items():
            first[digest].settle(WriteResult(WriteOutcome.DEDUPLICATED, memory=memory))
            self._metrics.dedup_outcomes.labels("exact").inc()
            outcomes["duplicate"] += 1
        outcomes["new"] += len(first) - len(existing)
        return outcomes


# -- 4. embed --------------------------------------------------------------------------------------------------------


class Embed:
    """One embedder call for every candidate still in flight (the embedder batches internally), and, with a sparse
    encoder, its SPLADE weights at the same time (the two models run on their own threads)."""

    name = "embed"
    interruptible = True

    def __init__(self, embedder: Embedder, sparse: SparseEncoder | None = None) -> None:
        self._embedder = embedder
        self._sparse = sparse

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        todo = [c for c in batch.in_flight() if not c.quarantined]
        if not todo:
            return Counter(skipped=len(batch.in_flight()))
        texts = [c.content for c in todo]
        sparse_task = None if self._sparse is None else asyncio.ensure_future(self._sparse.encode(texts))
        try:
            try:
                vectors = await self._embedder.embed(texts)
                if vectors.shape != (len(todo), self._embedder.dimensions) or not np.all(np.isfinite(vectors)):
                    raise EmbeddingError("the embedder returned vectors of the wrong shape or non-finite values")
            except BaseException:
                if sparse_task is not None:  # nothing keeps running behind a failed or cancelled write
                    sparse_task.cancel()
                    with contextlib.suppress(BaseException):
                        await sparse_task
                raise
            sparse = None if sparse_task is None else await sparse_task
            if sparse is not None and len(sparse) != len(todo):
                raise EmbeddingError("the sparse encoder returned the wrong number of vectors")
        except EmbeddingError as e:
            log.warning("embedding failed (request_id=%s): %s", batch.request_id, e)
            for c in todo:
                c.fail(Degraded("the embedding model is unavailable; nothing was stored"))
            return Counter(failed=len(todo))
        for i, (c, vector) in enumerate(zip(todo, vectors, strict=True)):
            c.embedding = np.ascontiguousarray(vector, dtype=np.float32)
            c.sparse = None if sparse is None else sparse[i]
        return Counter(ok=len(todo))


# -- 5. near dedup ---------------------------------------------------------------------------------------------------


class NearDedup:
    """Neighbours in embedding space (stored ones and earlier items of the batch); > threshold: near duplicate."""

    name = "near_dedup"
    interruptible = True

    def __init__(self, repo: MemoryRepository, *, threshold: float, subject_similarity: float, k: int = 5) -> None:
        self._repo = repo
        self._threshold = threshold
        self._floor = min(threshold, subject_similarity)
        self._k = k

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        todo = [c for c in batch.in_flight() if c.embedding is not None]
        if not todo:
            return Counter()
        vectors = np.stack([c.embedding for c in todo if c.embedding is not None])
        stored = await self._repo.neighbours(batch.tenant, vectors, k=self._k, min_similarity=self._floor)
        # Earlier items of the same batch are neighbours too: they will be committed in the same transaction.
        within = vectors @ vectors.T
        outcomes: Counter[str] = Counter()
        for j, c in enumerate(todo):
            found = list(stored[j])
            for i in range(j):
                similarity = float(within[j, i])
                if similarity >= self._floor:
                    earlier = todo[i]
                    assert earlier.draft is not None
                    found.append(
                        Neighbour(earlier.memory_id, similarity, earlier.content, 1, earlier.draft.valid_from,
                                  earlier.draft.valid_until, in_batch=True)
                    )  # fmt: skip
            found.sort(key=lambda n: (-n.similarity, str(n.id)))
            c.neighbours = found[: self._k]
            near = [n for n in c.neighbours if n.similarity > self._threshold]
            c.relationships.extend(
                Relationship(c.memory_id, n.id, RelationKind.NEAR_DUPLICATE_OF, n.similarity) for n in near
            )
            outcomes["near_duplicate" if near else "distinct"] += 1
        return outcomes


# -- 6. conflict -----------------------------------------------------------------------------------------------------

_VERDICT_KINDS = {
    Verdict.CONTRADICTION: RelationKind.CONTRADICTS,
    Verdict.OVERLAP: RelationKind.OVERLAPS,
    Verdict.SPECIALIZES: RelationKind.SPECIALIZES,
    Verdict.SUPERSEDES: RelationKind.SUPERSEDES,
}


def interval_supersedes(draft: MemoryDraft, old: Neighbour) -> bool:
    """The interval rule: both have a start, the new one starts later, and the old one ended by then."""
    return (
        draft.valid_from is not None
        and old.valid_from is not None
        and draft.valid_from > old.valid_from
        and old.valid_until is not None
        and old.valid_until <= draft.valid_from
    )


def closing_instant(draft: MemoryDraft, old: Neighbour, now: datetime) -> datetime | None:
    """Where to close the old memory's validity when the new one supersedes it (None: leave it as it is)."""
    close_at = draft.valid_from or now
    if old.valid_from is not None and close_at <= old.valid_from:
        return None
    if old.valid_until is not None and old.valid_until <= close_at:
        return None
    return close_at


class DetectConflicts:
    """Interval first; otherwise the classifier decides. A failing classifier only flags the pair for review."""

    name = "conflict"
    interruptible = True

    def __init__(
        self, classifier: ConflictClassifier, *, subject_similarity: float, max_pairs: int = 3, timeout: float = 1.0
    ) -> None:
        self._classifier = classifier
        self._subject = subject_similarity
        self._max_pairs = max_pairs
        self._timeout = timeout

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        outcomes: Counter[str] = Counter()
        now = datetime.now(UTC)
        for c in batch.in_flight():
            if c.embedding is None:
                continue
            assert c.draft is not None
            for old in [n for n in c.neighbours if n.similarity >= self._subject][: self._max_pairs]:
                if interval_supersedes(c.draft, old):
                    c.supersessions.append(Supersession(old.id, old.revision, None))
                    c.relationships.append(Relationship(c.memory_id, old.id, RelationKind.SUPERSEDES, old.similarity))
                    outcomes["supersedes_by_interval"] += 1
                    continue
                question = ConflictQuestion(
                    c.content, old.content, old.similarity, c.draft.valid_from, c.draft.valid_until, old.valid_from,
                    old.valid_until,
                )  # fmt: skip
                try:
                    async with asyncio.timeout(self._timeout):
                        verdict = Verdict(await self._classifier.classify(question))
                except Exception as e:  # any classifier failure: keep history, ask a human
                    log.warning("conflict classifier failed (request_id=%s): %s", batch.request_id, type(e).__name__)
                    c.relationships.append(
                        Relationship(c.memory_id, old.id, RelationKind.OVERLAPS, old.similarity, needs_review=True)
                    )
                    outcomes["review"] += 1
                    continue
                outcomes[verdict.value] += 1
                kind = _VERDICT_KINDS.get(verdict)
                if kind is None:
                    continue
                if kind is RelationKind.SUPERSEDES:
                    c.supersessions.append(Supersession(old.id, old.revision, closing_instant(c.draft, old, now)))
                c.relationships.append(Relationship(c.memory_id, old.id, kind, old.similarity))
        return outcomes


# -- 7. persist ------------------------------------------------------------------------------------------------------


class Persist:
    """Rows, labels, relationships, supersessions and the outbox event: one transaction for the batch it is given
    (with a sliced refinery, one slice of the request)."""

    name = "persist"
    interruptible = False

    def __init__(self, repo: MemoryRepository, metrics: MemoryMetrics, *, outbox_grace: float = 5.0) -> None:
        self._repo = repo
        self._metrics = metrics
        self._grace = outbox_grace

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        todo = batch.in_flight()
        if not todo:
            return Counter()
        try:
            created, raced = await asyncio.shield(self._commit(batch, todo))
        except StoreUnavailable:
            for c in todo:
                c.fail(Degraded("the memory store is unavailable; nothing was stored"))
            return Counter(failed=len(todo))
        outcomes: Counter[str] = Counter()
        for c, memory in created.items():
            outcome = WriteOutcome.QUARANTINED if c.quarantined else WriteOutcome.CREATED
            c.settle(WriteResult(outcome, memory=memory, relationships=tuple(c.relationships)))
            outcomes[outcome.value] += 1
        if raced:
            # Lost to a concurrent insert of the same content: that row is the answer, exactly as in stage 3.
            winners = await self._repo.bump_duplicates(batch.tenant, [c.content_hash for c in raced])
            for c in raced:
                self._metrics.dedup_outcomes.labels("raced").inc()
                winner = winners.get(c.content_hash)
                if winner is not None:
                    c.settle(WriteResult(WriteOutcome.DEDUPLICATED, memory=winner))
                    outcomes["duplicate_raced"] += 1
                else:  # the winner was forgotten or superseded in between: let the client retry
                    c.fail(Degraded("a concurrent change to the same memory won; retry"))
                    outcomes["failed"] += 1
        return outcomes

    async def _commit(
        self, batch: WriteBatch, todo: list[Candidate]
    ) -> tuple[dict[Candidate, Memory], list[Candidate]]:
        tenant = batch.tenant
        created: dict[Candidate, Memory] = {}
        raced: list[Candidate] = []
        lost: set[UUID] = set()
        # Locks are taken in one global order, so two batches of the same agent in flight cannot deadlock: first
        # the content hashes of the inserts (the unique index makes a second insert of a hash wait), ascending;
        # then the older rows being superseded, by id. A transaction only waits for locks later in that order than
        # every lock it holds.
        async with self._repo.transaction(tenant) as conn:
            for c in sorted(todo, key=lambda c: (c.content_hash, c.index)):
                assert c.draft is not None
                memory = await self._repo.insert_memory(
                    conn, tenant, memory_id=c.memory_id, content=c.content, content_hash=c.content_hash,
                    status=MemoryStatus.QUARANTINED if c.quarantined else MemoryStatus.ACTIVE,
                    source=c.draft.source, session_id=c.draft.session_id, request_id=batch.request_id,
                    observed_at=c.draft.observed_at, valid_from=c.draft.valid_from,
                    valid_until=c.draft.valid_until, confidence=c.draft.confidence, metadata=c.metadata,
                    embedding=None if c.quarantined else c.embedding, labels=c.labels,
                    sparse=None if c.quarantined else c.sparse,
                )  # fmt: skip
                if memory is None:
                    raced.append(c)
                    lost.add(c.memory_id)
                    continue
                created[c] = memory
            created = dict(sorted(created.items(), key=lambda item: item[0].index))
            touched: list[UUID] = [m.id for c, m in created.items() if not c.quarantined]
            changes = sorted(
                ((c, change) for c in created for change in c.supersessions if change.target_id not in lost),
                key=lambda pair: (str(pair[1].target_id), pair[0].index),
            )
            kept: set[tuple[UUID, UUID]] = set()
            for c, change in changes:
                if await self._repo.supersede(conn, tenant, change):
                    kept.add((c.memory_id, change.target_id))
                    touched.append(change.target_id)
            for c in created:
                c.relationships = [
                    r
                    for r in c.relationships
                    if r.target_id not in lost
                    and (r.kind is not RelationKind.SUPERSEDES or (c.memory_id, r.target_id) in kept)
                ]
                await self._repo.insert_relationships(conn, tenant, c.relationships)
            if touched:
                outbox_id = await self._repo.enqueue(conn, tenant, HOT_SYNC, touched, delay=self._grace)
                batch.outbox.append((outbox_id, touched))
        return created, raced


# -- 8. after commit -------------------------------------------------------------------------------------------------


class AfterCommit:
    """Apply the committed outbox events now (hot cache); a failure is counted and left to the outbox worker."""

    name = "after_commit"
    interruptible = False

    def __init__(self, outbox: OutboxWorker) -> None:
        self._outbox = outbox

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        outcomes: Counter[str] = Counter()
        for outbox_id, ids in batch.outbox:
            applied = await asyncio.shield(self._outbox.sync_now(batch.tenant, outbox_id, ids))
            outcomes["applied" if applied else "deferred"] += 1
        return outcomes


# -- the pipeline ----------------------------------------------------------------------------------------------------


class Refinery:
    """Runs the stages over a batch, as a pipeline when ``cut_at`` names stages.

    The stages are cut before each stage named in ``cut_at`` into steps, the batch into slices of ``slice_size``
    items, and each step works on a slice while the next step works on the slice before: with the memory stage's
    cuts (embed, near_dedup), one slice is checked for PII while the one before is embedded and the one before that
    is stored, so the models, Presidio and Postgres work on different cores at once and one ``:batch`` request alone
    keeps them busy. Each step takes the slices in order, so a store stage sees the slices before its own
    committed, exactly as it would see an earlier request; a stage before the store stages must not read what they
    write (exact dedup finds an earlier slice's items through the batch's ``seen`` hashes instead). Every item
    still gets one result, and each committed slice is one transaction.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        metrics: MemoryMetrics,
        *,
        clock: Callable[[], float] = time.time,
        cut_at: Sequence[str] = (),
        slice_size: int = 25,
    ):
        self.stages = list(stages)
        self._metrics = metrics
        self._clock = clock
        names = self.names
        for name in cut_at:
            if name not in names:
                raise ValueError(f"no stage named {name!r} to cut at")
        if slice_size < 1:
            raise ValueError("slice_size must be at least 1")
        bounds = sorted({0, len(names), *(names.index(name) for name in cut_at)})
        self._steps = [self.stages[a:b] for a, b in itertools.pairwise(bounds)] or [[]]
        self._slice_size = slice_size

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    async def run(
        self, tenant: Tenant, items: Sequence[Any], *, request_id: str, deadline: float
    ) -> tuple[list[WriteResult], list[StageReport]]:
        batch = WriteBatch(tenant, request_id, deadline, [Candidate(i, raw) for i, raw in enumerate(items)])
        tally = _Tally()
        if len(self._steps) == 1:
            await self._stages(self.stages, batch, tally)
        else:
            await self._pipelined(batch, tally)
        reports = tally.reports(self.names)
        results = [_result_of(c) for c in batch.candidates]
        log.info(
            "refinery request_id=%s items=%d %s -> %s",
            request_id,
            len(items),
            " ".join(f"{r.stage}[{_fmt(r.outcomes)}]={r.seconds * 1000:.1f}ms" for r in reports),
            _fmt(Counter(r.outcome.value if r.error is None else f"error_{r.status}" for r in results)),
        )
        return results, reports

    async def _pipelined(self, batch: WriteBatch, tally: _Tally) -> None:
        """Every slice through every step; step n of slice k starts once slice k left step n-1 and slice k-1 left
        step n. The first failure cancels everything still running and is the one that propagates."""
        size, everyone = self._slice_size, batch.candidates
        slices = [
            WriteBatch(batch.tenant, batch.request_id, batch.deadline, everyone[i : i + size], seen=batch.seen)
            for i in range(0, len(everyone), size)
        ] or [WriteBatch(batch.tenant, batch.request_id, batch.deadline, [], seen=batch.seen)]
        loop = asyncio.get_running_loop()
        left = [[loop.create_future() for _ in self._steps] for _ in slices]  # left[k][n]: slice k is past step n

        async def through(k: int, piece: WriteBatch) -> None:
            going = True
            try:
                for n, step in enumerate(self._steps):
                    if k > 0:
                        await left[k - 1][n]
                    if going:  # a slice the deadline stopped has no items in flight; it only makes way
                        going = await self._stages(step, piece, tally)
                    left[k][n].set_result(None)
            finally:
                for waiter in left[k]:
                    if not waiter.done():
                        waiter.cancel()

        runs = [asyncio.ensure_future(through(k, piece)) for k, piece in enumerate(slices)]
        try:
            await asyncio.wait(runs, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for run in runs:  # nothing keeps running behind a failed or cancelled write
                if not run.done():
                    run.cancel()
            await asyncio.wait(runs)
        for run in runs:
            if not run.cancelled() and run.exception() is not None:
                raise run.exception()  # type: ignore[misc]

    async def _stages(self, stages: Sequence[Stage], batch: WriteBatch, tally: _Tally) -> bool:
        """Run ``stages`` over ``batch`` in order; False when the deadline stopped it."""
        for stage in stages:
            if stage.interruptible and self._clock() >= batch.deadline:
                late = batch.in_flight()
                for c in late:
                    c.fail(DeadlineExceeded("the request deadline passed before the memory was stored"))
                tally.add(stage.name, Counter(deadline=len(late)), 0.0)
                self._metrics.stage_outcomes.labels(stage.name, "deadline").inc(len(late))
                return False
            started = time.perf_counter()
            outcomes = await stage(batch)
            seconds = time.perf_counter() - started
            self._metrics.stage_seconds.labels(stage.name).observe(seconds)
            for outcome, count in outcomes.items():
                self._metrics.stage_outcomes.labels(stage.name, outcome).inc(count)
            tally.add(stage.name, outcomes, seconds)
        return True


class _Tally:
    """Outcomes and seconds per stage, summed over the slices that ran it."""

    def __init__(self) -> None:
        self._outcomes: dict[str, Counter[str]] = {}
        self._seconds: dict[str, float] = {}

    def add(self, stage: str, outcomes: Counter[str], seconds: float) -> None:
        self._outcomes.setdefault(stage, Counter()).update(outcomes)
        self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds

    def reports(self, order: Sequence[str]) -> list[StageReport]:
        return [StageReport(s, dict(self._outcomes[s]), self._seconds[s]) for s in order if s in self._outcomes]


def _result_of(c: Candidate) -> WriteResult:
    if c.follows is not None:
        primary = _result_of(c.follows)
        if primary.error is not None or primary.memory is None:
            return primary
        return WriteResult(WriteOutcome.DEDUPLICATED, memory=primary.memory)
    if c.result is None:  # only when a stage was skipped by the deadline break
        return WriteResult(WriteOutcome.REJECTED, error=DeadlineExceeded("the request deadline passed"))
    return c.result


def _fmt(outcomes: dict[str, int] | Counter[str]) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(outcomes.items()))
