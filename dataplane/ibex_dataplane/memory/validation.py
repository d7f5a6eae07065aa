"""Stage 1 of the refinery and the checks of every other memory route: bad input fails here, before anything costs.

Pure functions from decoded JSON (or query strings) to validated values; each collects every problem it finds into
``field_errors`` and raises :class:`ValidationFailed` (400 ``VALIDATION_ERROR``). Called by the refinery's validate
stage and by the service. Messages never echo the submitted content.
"""

from __future__ import annotations

import base64
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import orjson

from ibex_dataplane.memory.models import MemoryDraft, MemorySource, MemoryStatus
from ibex_dataplane.shared.errors import ValidationFailed
from ibex_dataplane.shared.memory_limits import (
    DEFAULT_LIST_LIMIT,
    DEFAULT_SEARCH_LIMIT,
    MAX_BATCH_ITEMS,
    MAX_CONTENT_BYTES,
    MAX_LABEL_CHARS,
    MAX_LABELS,
    MAX_LIST_LIMIT,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_QUERY_BYTES,
    MAX_SEARCH_LIMIT,
    SESSION_ID_PATTERN,
)

_SESSION_ID = re.compile(SESSION_ID_PATTERN)
_WRITE_FIELDS = frozenset(
    {"content", "labels", "source", "confidence", "valid_from", "valid_until", "observed_at", "session_id", "metadata"}
)
_SEARCH_FIELDS = frozenset({"query", "limit", "min_confidence", "labels"})
_INTERNAL_SEARCH_FIELDS = frozenset({"as_of", "min_similarity"})


class _Errors:
    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.items: list[dict[str, str]] = []

    def add(self, name: str, message: str) -> None:
        self.items.append({"field": f"{self.prefix}{name}", "message": message})

    def raise_if_any(self, message: str = "the request is invalid") -> None:
        if self.items:
            raise ValidationFailed(message, field_errors=self.items)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _timestamp(value: Any, name: str, errors: _Errors) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 64:
        errors.add(name, "must be an RFC 3339 timestamp with a time zone")
        return None
    text = value.strip()
    if text.endswith(("z", "Z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        errors.add(name, "must be an RFC 3339 timestamp with a time zone")
        return None
    if parsed.tzinfo is None or "T" not in text.upper():
        errors.add(name, "must be an RFC 3339 timestamp with a time zone")
        return None
    return parsed.astimezone(UTC)


def _label_set(value: Any, name: str, errors: _Errors) -> tuple[str, ...] | None:
    """Labels are a set of 1..5 distinct short strings; an explicit empty array is an error, not 'no labels'."""
    if value is None:
        return None
    if not isinstance(value, list):
        errors.add(name, "must be an array of strings")
        return None
    if not value:
        errors.add(name, "must not be an empty array (leave it out for no labels)")
        return None
    if len(value) > MAX_LABELS:
        errors.add(name, f"must hold at most {MAX_LABELS} labels")
        return None
    labels: list[str] = []
    for i, label in enumerate(value):
        if not isinstance(label, str):
            errors.add(f"{name}[{i}]", "must be a string")
            continue
        normalized = unicodedata.normalize("NFC", label)
        if not normalized.strip() or len(normalized) > MAX_LABEL_CHARS or normalized != normalized.strip():
            errors.add(f"{name}[{i}]", f"must be 1..{MAX_LABEL_CHARS} characters without surrounding spaces")
            continue
        if any(unicodedata.category(ch) == "Cc" for ch in normalized):
            errors.add(f"{name}[{i}]", "must not contain control characters")
            continue
        if normalized in labels:
            errors.add(f"{name}[{i}]", "duplicates an earlier label (labels are a set)")
            continue
        labels.append(normalized)
    return tuple(labels)


def _metadata_ok(value: Any, depth: int = 0) -> bool:
    if depth > MAX_METADATA_DEPTH:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _metadata_ok(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_metadata_ok(v, depth + 1) for v in value)
    return value is None or isinstance(value, str | bool | int | float)


def parse_write(body: Any, *, prefix: str = "") -> MemoryDraft:
    """Validate one write body (``POST /v1/memories`` or one item of a batch)."""
    errors = _Errors(prefix)
    if not isinstance(body, dict):
        errors.add("", "must be a JSON object")
        errors.raise_if_any()
    assert isinstance(body, dict)
    for unknown in sorted(set(body) - _WRITE_FIELDS):
        errors.add(unknown, "is not a known field")

    content = body.get("content")
    if not isinstance(content, str):
        errors.add("content", "is required and must be a string")
    else:
        size = len(content.encode("utf-8", "surrogatepass"))
        if not content.strip():
            errors.add("content", "must not be empty")
        elif size > MAX_CONTENT_BYTES:
            errors.add("content", f"must be at most {MAX_CONTENT_BYTES} bytes (UTF-8)")
        elif any(unicodedata.category(ch) == "Cs" for ch in content):
            errors.add("content", "must be valid Unicode")

    labels = _label_set(body.get("labels"), "labels", errors)

    source = MemorySource.USER_PROVIDED
    raw_source = body.get("source")
    if raw_source is not None:
        try:
            source = MemorySource(raw_source) if isinstance(raw_source, str) else MemorySource("?")
        except ValueError:
            errors.add("source", "must be one of " + ", ".join(s.value for s in MemorySource))

    confidence = 1.0
    raw_confidence = body.get("confidence")
    if raw_confidence is not None:
        if not _is_number(raw_confidence) or not 0 <= raw_confidence <= 1:
            errors.add("confidence", "must be a number between 0 and 1")
        else:
            confidence = float(raw_confidence)

    valid_from = _timestamp(body.get("valid_from"), "valid_from", errors)
    valid_until = _timestamp(body.get("valid_until"), "valid_until", errors)
    observed_at = _timestamp(body.get("observed_at"), "observed_at", errors)
    if valid_from is not None and valid_until is not None and valid_until <= valid_from:
        errors.add("valid_until", "must be later than valid_from (validity is half-open)")

    session_id = body.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id)):
        errors.add("session_id", "must match ^[A-Za-z0-9._:-]{1,128}$")
        session_id = None

    metadata: dict[str, Any] = {}
    raw_metadata = body.get("metadata")
    if raw_metadata is not None:
        if not isinstance(raw_metadata, dict):
            errors.add("metadata", "must be a JSON object")
        elif not _metadata_ok(raw_metadata):
            errors.add("metadata", f"must nest at most {MAX_METADATA_DEPTH} levels of plain JSON values")
        elif len(orjson.dumps(raw_metadata)) > MAX_METADATA_BYTES:
            errors.add("metadata", f"must be at most {MAX_METADATA_BYTES} bytes as JSON")
        else:
            metadata = raw_metadata

    errors.raise_if_any()
    assert isinstance(content, str)
    return MemoryDraft(
        content=content,
        labels=labels or (),
        source=source,
        confidence=confidence,
        valid_from=valid_from,
        valid_until=valid_until,
        observed_at=observed_at,
        session_id=session_id,
        metadata=metadata,
    )


def parse_batch(body: Any) -> list[Any]:
    """The envelope of ``POST /v1/memories:batch``: 1..100 items; each item is validated on its own later."""
    errors = _Errors()
    if not isinstance(body, dict):
        errors.add("", "must be a JSON object with an 'items' array")
        errors.raise_if_any()
    assert isinstance(body, dict)
    for unknown in sorted(set(body) - {"items"}):
        errors.add(unknown, "is not a known field")
    items = body.get("items")
    if not isinstance(items, list):
        errors.add("items", "is required and must be an array")
    elif not 1 <= len(items) <= MAX_BATCH_ITEMS:
        errors.add("items", f"must hold 1..{MAX_BATCH_ITEMS} items")
    errors.raise_if_any()
    assert isinstance(items, list)
    return items


@dataclass(frozen=True, slots=True)
class SearchQuery:
    query: str
    limit: int = DEFAULT_SEARCH_LIMIT
    min_confidence: float | None = None
    labels: tuple[str, ...] = ()
    as_of: datetime | None = None  # internal callers only: read history at that instant
    min_similarity: float | None = None  # internal callers only: override the ANN cutoff


def parse_search(body: Any, *, internal: bool) -> SearchQuery:
    errors = _Errors()
    if not isinstance(body, dict):
        errors.add("", "must be a JSON object")
        errors.raise_if_any()
    assert isinstance(body, dict)
    allowed = _SEARCH_FIELDS | (_INTERNAL_SEARCH_FIELDS if internal else frozenset())
    for unknown in sorted(set(body) - allowed):
        errors.add(unknown, "is not a known field")
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        errors.add("query", "is required and must be a non-empty string")
    elif len(query.encode("utf-8", "surrogatepass")) > MAX_QUERY_BYTES:
        errors.add("query", f"must be at most {MAX_QUERY_BYTES} bytes")
    limit = DEFAULT_SEARCH_LIMIT
    raw_limit = body.get("limit")
    if raw_limit is not None:
        if not isinstance(raw_limit, int) or isinstance(raw_limit, bool) or not 1 <= raw_limit <= MAX_SEARCH_LIMIT:
            errors.add("limit", f"must be an integer between 1 and {MAX_SEARCH_LIMIT}")
        else:
            limit = raw_limit
    min_confidence = body.get("min_confidence")
    if min_confidence is not None and (not _is_number(min_confidence) or not 0 <= min_confidence <= 1):
        errors.add("min_confidence", "must be a number between 0 and 1")
        min_confidence = None
    labels = _label_set(body.get("labels"), "labels", errors)
    as_of = _timestamp(body.get("as_of"), "as_of", errors) if internal else None
    min_similarity = body.get("min_similarity") if internal else None
    if min_similarity is not None and (not _is_number(min_similarity) or not 0 <= min_similarity <= 1):
        errors.add("min_similarity", "must be a number between 0 and 1")
        min_similarity = None
    errors.raise_if_any()
    assert isinstance(query, str)
    return SearchQuery(
        query=query,
        limit=limit,
        min_confidence=None if min_confidence is None else float(min_confidence),
        labels=labels or (),
        as_of=as_of,
        min_similarity=None if min_similarity is None else float(min_similarity),
    )


@dataclass(frozen=True, slots=True)
class ListCursor:
    created_at: datetime
    id: UUID

    def encode(self) -> str:
        raw = orjson.dumps({"t": self.created_at.isoformat(), "i": str(self.id)})
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@dataclass(frozen=True, slots=True)
class ListQuery:
    status: MemoryStatus = MemoryStatus.ACTIVE
    limit: int = DEFAULT_LIST_LIMIT
    cursor: ListCursor | None = None
    source: MemorySource | None = None  # only memories of this source (e.g. extracted: captured from chats)


_LISTABLE = (MemoryStatus.ACTIVE, MemoryStatus.SUPERSEDED, MemoryStatus.QUARANTINED)  # quarantined: for review


def parse_list(params: Mapping[str, str]) -> ListQuery:
    errors = _Errors()
    for unknown in sorted(set(params) - {"status", "limit", "cursor", "source"}):
        errors.add(unknown, "is not a known query parameter")
    source = None
    raw_source = params.get("source")
    if raw_source is not None:
        if raw_source not in {s.value for s in MemorySource}:
            errors.add("source", "must be one of " + ", ".join(s.value for s in MemorySource))
        else:
            source = MemorySource(raw_source)
    status = MemoryStatus.ACTIVE
    raw_status = params.get("status")
    if raw_status:
        if raw_status not in {s.value for s in _LISTABLE}:
            errors.add("status", "must be one of " + ", ".join(s.value for s in _LISTABLE))
        else:
            status = MemoryStatus(raw_status)
    limit = DEFAULT_LIST_LIMIT
    raw_limit = params.get("limit")
    if raw_limit:
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIST_LIMIT:
            errors.add("limit", f"must be an integer between 1 and {MAX_LIST_LIMIT}")
        else:
            limit = int(raw_limit)
    cursor = None
    raw_cursor = params.get("cursor")
    if raw_cursor:
        try:
            decoded = orjson.loads(base64.urlsafe_b64decode(raw_cursor + "=" * (-len(raw_cursor) % 4)))
            cursor = ListCursor(datetime.fromisoformat(decoded["t"]).astimezone(UTC), UUID(decoded["i"]))
        except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            errors.add("cursor", "is not a cursor this API returned")
    errors.raise_if_any()
    return ListQuery(status=status, limit=limit, cursor=cursor, source=source)


@dataclass(frozen=True, slots=True)
class Feedback:
    useful: bool


def parse_feedback(body: Any) -> Feedback:
    """``{"useful": true|false}``; ``{"signal": "positive"|"negative"}`` is accepted as a synonym."""
    errors = _Errors()
    if not isinstance(body, dict):
        errors.add("", "must be a JSON object")
        errors.raise_if_any()
    assert isinstance(body, dict)
    for unknown in sorted(set(body) - {"useful", "signal"}):
        errors.add(unknown, "is not a known field")
    useful = body.get("useful")
    signal = body.get("signal")
    if useful is None and signal is None:
        errors.add("useful", "is required (true or false)")
    elif useful is not None and not isinstance(useful, bool):
        errors.add("useful", "must be true or false")
    elif signal is not None and signal not in ("positive", "negative"):
        errors.add("signal", "must be 'positive' or 'negative'")
    elif useful is not None and signal is not None and useful != (signal == "positive"):
        errors.add("signal", "contradicts 'useful'")
    errors.raise_if_any()
    return Feedback(useful=bool(useful) if useful is not None else signal == "positive")


def parse_memory_id(raw: str) -> UUID | None:
    """A path id; anything that is not a UUID is simply a memory that does not exist (404, never 400)."""
    try:
        return UUID(raw)
    except ValueError:
        return None


def parse_memory_ids(body: Any, *, limit: int = 200) -> list[UUID]:
    """``{"ids": [uuid, ...]}`` (at most ``limit``): the memories a caller placed into a context."""
    ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or len(ids) > limit:
        raise ValidationFailed(
            "ids must be a list of memory ids", field_errors=[{"field": "ids", "message": f"1..{limit} ids"}]
        )
    parsed: list[UUID] = []
    for i, raw in enumerate(ids):
        value = parse_memory_id(raw) if isinstance(raw, str) else None
        if value is None:
            raise ValidationFailed(
                "ids must be memory ids", field_errors=[{"field": f"ids[{i}]", "message": "not a uuid"}]
            )
        parsed.append(value)
    return parsed
