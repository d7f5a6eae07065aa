"""The memory stage's error hierarchy. Handlers map these to HTTP statuses and envelope codes at the edge.

The service and the refinery raise these (or store errors); nothing below the handlers knows about HTTP, but each
error class names the status and envelope code it stands for, and only the stage's middleware and handlers read
them (:mod:`ibex_dataplane.memory.middleware`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class MemoryServiceError(Exception):
    """Base class: ``status`` and ``code`` are what a client sees (architecture section 6.4)."""

    status = 500
    code = "INTERNAL_ERROR"

    def __init__(
        self,
        message: str,
        *,
        field_errors: Sequence[Mapping[str, Any]] | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field_errors = list(field_errors) if field_errors else None
        self.retry_after = retry_after


class InvalidJson(MemoryServiceError):
    status = 400
    code = "INVALID_JSON"


class ValidationFailed(MemoryServiceError):
    """Bad input: reported field by field before anything expensive runs."""

    status = 400
    code = "VALIDATION_ERROR"


class NotFound(MemoryServiceError):
    """No such memory for this org and agent (also for another tenant's id: existence is never revealed)."""

    status = 404
    code = "NOT_FOUND"


class Unprocessable(MemoryServiceError):
    """Well-formed, but impossible (e.g. content that outgrows the bounds once placeholders replace PII)."""

    status = 422
    code = "UNPROCESSABLE"


class Unauthenticated(MemoryServiceError):
    """The internal principal is missing, forged, malformed or expired."""

    status = 401
    code = "INVALID_TOKEN"


class MissingPrincipal(Unauthenticated):
    code = "MISSING_TOKEN"


class Forbidden(MemoryServiceError):
    """The principal lacks the scope the route needs."""

    status = 403
    code = "INSUFFICIENT_PERMISSIONS"


class Degraded(MemoryServiceError):
    """A dependency the operation cannot do without (Postgres, the embedder, the PII engine) failed: retry later."""

    status = 503
    code = "SERVICE_DEGRADED"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


class DeadlineExceeded(Degraded):
    """The caller's deadline passed before the work could finish; nothing durable was left half done."""


class IdempotencyConflict(MemoryServiceError):
    """The key was used before with a different request."""

    status = 409
    code = "IDEMPOTENCY_CONFLICT"


class IdempotencyInProgress(MemoryServiceError):
    """The first request with this key is still running."""

    status = 409
    code = "IDEMPOTENCY_IN_PROGRESS"


class IdempotencyUnavailable(MemoryServiceError):
    """The ledger cannot be reached, or a claim could not be finalized: never report success then."""

    status = 503
    code = "IDEMPOTENCY_UNAVAILABLE"
