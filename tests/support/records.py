"""Stored memory records for tests of the pure memory code (ranking, scoring), built without a database."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

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
