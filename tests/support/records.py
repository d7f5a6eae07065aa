"""Stored memory records for tests of the pure memory code (ranking, scoring), built without a database."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import orjson

from ibex_dataplane.memory.models import Memory, MemorySource, MemoryStatus

WRITTEN = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)


def stored_memory(content: str = "c", at: datetime = WRITTEN, **overrides: object) -> Memory:
    """An active, imported memory valid from, observed and written ``at``; any field can be overridden."""
    fields: dict[str, object] = dict(
        id=uuid.uuid4(), agent_id=uuid.uuid4(), content=content, status=MemoryStatus.ACTIVE, labels=(),
        source=MemorySource.IMPORTED, confidence=1.0, usefulness=0.5, valid_from=at, valid_until=None,
        observed_at=at, session_id=None, metadata={}, revision=1, retrieval_count=0, last_retrieved_at=None,
        created_at=at, updated_at=at,
    )  # fmt: skip
    fields.update(overrides)
    return Memory(**fields)  # type: ignore[arg-type]


def leg_row(memory: Memory, **scores: Any) -> dict[str, Any]:
    """``memory`` as a search leg's row: its columns as Postgres returns them (enums as text, metadata as JSON
    text, labels as a list), plus the leg's ``scores`` (``similarity``, ``text_score``, ``text_terms``)."""
    row: dict[str, Any] = {name: getattr(memory, name) for name in Memory.__dataclass_fields__}
    row.update(
        status=memory.status.value, source=memory.source.value, labels=list(memory.labels),
        metadata=orjson.dumps(memory.metadata).decode(), similarity=None, text_score=None, text_terms=0,
    )  # fmt: skip
    row.update(scores)
    return row
