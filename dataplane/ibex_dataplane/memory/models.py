"""Values of the memory domain: the record as read, the validated draft of a write, relationships, wire shapes.

Owned by the memory stage; the refinery, the search and the service pass these around, the handlers turn them into
the JSON of architecture section 9.5 with :meth:`Memory.to_wire`. Pure: no I/O here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID


class MemoryStatus(enum.StrEnum):
    ACTIVE = "active"
    SUPERSEDED = "superseded"
    QUARANTINED = "quarantined"
    FORGOTTEN = "forgotten"


class MemorySource(enum.StrEnum):
    USER_PROVIDED = "user_provided"
    EXTRACTED = "extracted"
    IMPORTED = "imported"


class RelationKind(enum.StrEnum):
    SUPERSEDES = "supersedes"
    CONTRADICTS = "contradicts"
    OVERLAPS = "overlaps"
    SPECIALIZES = "specializes"
    NEAR_DUPLICATE_OF = "near_duplicate_of"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a call acts for: taken from the internal principal, never from a body, a query or a path."""

    org_id: UUID
    agent_id: UUID


def rfc3339(value: datetime | None) -> str | None:
    """UTC, with a ``Z``: ``2026-01-02T03:04:05.123456Z``."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Memory:
    """One memory as stored (content is ``None`` once forgotten)."""

    id: UUID
    agent_id: UUID
    content: str | None
    status: MemoryStatus
    labels: tuple[str, ...]
    source: MemorySource
    confidence: float
    usefulness: float
    valid_from: datetime | None
    valid_until: datetime | None
    observed_at: datetime | None
    session_id: str | None
    metadata: dict[str, Any]
    revision: int
    retrieval_count: int
    last_retrieved_at: datetime | None
    created_at: datetime
    updated_at: datetime
    positive_feedback: int = 0
    negative_feedback: int = 0

    def to_wire(self) -> dict[str, Any]:
        """The memory object of section 9.5. A quarantined memory never echoes its content or labels."""
        hidden = self.status in (MemoryStatus.QUARANTINED, MemoryStatus.FORGOTTEN)
        return {
            "id": str(self.id),
            "agent_id": str(self.agent_id),
            "content": None if hidden else self.content,
            "status": self.status.value,
            "labels": [] if hidden else list(self.labels),
            "source": self.source.value,
            "confidence": round(self.confidence, 6),
            "usefulness": round(self.usefulness, 6),
            "valid_from": rfc3339(self.valid_from),
            "valid_until": rfc3339(self.valid_until),
            "observed_at": rfc3339(self.observed_at),
            "session_id": self.session_id,
            "metadata": {} if hidden else self.metadata,
            "revision": self.revision,
            "retrieval_count": self.retrieval_count,
            "created_at": rfc3339(self.created_at),
            "updated_at": rfc3339(self.updated_at),
        }


@dataclass(frozen=True, slots=True)
class Relationship:
    """A directed edge from a (new) memory to another one of the same agent."""

    source_id: UUID
    target_id: UUID
    kind: RelationKind
    score: float | None = None
    needs_review: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "source_id": str(self.source_id),
            "target_id": str(self.target_id),
            "score": None if self.score is None else round(self.score, 6),
            "needs_review": self.needs_review,
        }


@dataclass(frozen=True, slots=True)
class MemoryDraft:
    """A write request that passed validation (stage 1). ``content`` is still the caller's text here."""

    content: str
    labels: tuple[str, ...] = ()
    source: MemorySource = MemorySource.USER_PROVIDED
    confidence: float = 1.0
    valid_from: datetime | None = None
    valid_until: datetime | None = None
    observed_at: datetime | None = None
    session_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Neighbour:
    """An existing active memory close to a candidate in embedding space (or an earlier item of the same batch)."""

    id: UUID
    similarity: float
    content: str
    revision: int
    valid_from: datetime | None
    valid_until: datetime | None
    in_batch: bool = False


@dataclass(frozen=True, slots=True)
class Supersession:
    """Close an older memory because a newer one replaces it; applied only if the old row is still at ``revision``."""

    target_id: UUID
    revision: int
    close_at: datetime | None  # the new valid_until of the old row, or None to leave it as it is
