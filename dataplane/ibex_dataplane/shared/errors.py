"""The data plane's error hierarchy and the one envelope every error body uses (architecture section 6.4).

Services raise :class:`ServiceError` subclasses (each names the HTTP status and envelope code it stands for);
gates and handlers that decide status and code at the raise site use :class:`ApiError`. Nothing below the edges
knows about HTTP or gRPC: only the edge middleware (:mod:`ibex_dataplane.shared.http`) and the gRPC servicer read
``status`` and ``code``. Every stage renders bodies with :func:`error_body`, so the envelope has one definition:
``{"error": {"code", "message", "request_id", "field_errors"?}}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web


class ServiceError(Exception):
    """Base class: ``status`` and ``code`` are what a client sees."""

    status = 500
    code = "INTERNAL_ERROR"

    def __init__(
        self,
        message: str,
        *,
        field_errors: Sequence[Mapping[str, Any]] | None = None,
        retry_after: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field_errors = list(field_errors) if field_errors else None
        self.retry_after = retry_after
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers.setdefault("Retry-After", str(retry_after))


class ApiError(ServiceError):
    """An error whose status and code are chosen where it is raised (gates, route handlers)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field_errors: Sequence[Mapping[str, Any]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, field_errors=field_errors, headers=headers)
        self.status = status
        self.code = code


class InvalidJson(ServiceError):
    status = 400
    code = "INVALID_JSON"


class ValidationFailed(ServiceError):
    """Bad input: reported field by field before anything expensive runs."""

    status = 400
    code = "VALIDATION_ERROR"


class NotFound(ServiceError):
    """No such object for this org and agent (also for another tenant's id: existence is never revealed)."""

    status = 404
    code = "NOT_FOUND"


class Unprocessable(ServiceError):
    """Well-formed, but impossible (e.g. content that outgrows the bounds once placeholders replace PII)."""

    status = 422
    code = "UNPROCESSABLE"


class Unauthenticated(ServiceError):
    """The internal principal is missing, forged, malformed, expired or signed for another call."""

    status = 401
    code = "INVALID_TOKEN"


class MissingPrincipal(Unauthenticated):
    code = "MISSING_TOKEN"


class Forbidden(ServiceError):
    """The principal lacks the scope the route needs."""

    status = 403
    code = "INSUFFICIENT_PERMISSIONS"


class Degraded(ServiceError):
    """A dependency the operation cannot do without (Postgres, the embedder, the PII engine) failed: retry later."""

    status = 503
    code = "SERVICE_DEGRADED"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


class DeadlineExceeded(Degraded):
    """The caller's deadline passed before the work could finish; nothing durable was left half done."""


class IdempotencyConflict(ServiceError):
    """The key was used before with a different request."""

    status = 409
    code = "IDEMPOTENCY_CONFLICT"


class IdempotencyInProgress(ServiceError):
    """The first request with this key is still running."""

    status = 409
    code = "IDEMPOTENCY_IN_PROGRESS"


class IdempotencyUnavailable(ServiceError):
    """The ledger cannot be reached, or a claim could not be finalized: never report success then."""

    status = 503
    code = "IDEMPOTENCY_UNAVAILABLE"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)  # every 503 says when to come back


# aiohttp's own HTTP exceptions -> envelope codes.
HTTP_STATUS_CODES: dict[int, str] = {
    400: "INVALID_REQUEST",
    401: "INVALID_TOKEN",
    403: "INSUFFICIENT_PERMISSIONS",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    408: "REQUEST_TIMEOUT",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    422: "UNPROCESSABLE",
    429: "RATE_LIMITED",
    500: "INTERNAL_ERROR",
    502: "PROVIDER_ERROR",
    503: "SERVICE_DEGRADED",
    504: "PROVIDER_TIMEOUT",
}


# Every code a client can meet in an envelope, by HTTP status: the OpenAPI document and docs/troubleshooting.md
# list them from here, and a test checks that the code raises nothing this table lacks.
ERROR_CODES: dict[int, tuple[str, ...]] = {
    400: ("INVALID_JSON", "VALIDATION_ERROR", "MISSING_AGENT_ID", "INVALID_REQUEST"),
    401: ("MISSING_TOKEN", "INVALID_TOKEN"),
    402: ("BUDGET_EXCEEDED",),
    403: (
        "INSUFFICIENT_PERMISSIONS",
        "AGENT_NOT_AUTHORIZED",
        "AGENT_SUSPENDED",
        "ORG_SUSPENDED",
        "MODEL_NOT_ALLOWED",
        "PATH_ORG_MISMATCH",
    ),
    404: ("NOT_FOUND",),
    405: ("METHOD_NOT_ALLOWED",),
    408: ("REQUEST_TIMEOUT",),
    409: ("IDEMPOTENCY_CONFLICT", "IDEMPOTENCY_IN_PROGRESS"),
    413: ("PAYLOAD_TOO_LARGE",),
    415: ("UNSUPPORTED_MEDIA_TYPE",),
    422: ("UNPROCESSABLE",),
    429: ("RATE_LIMITED",),
    500: ("INTERNAL_ERROR",),
    502: ("PROVIDER_ERROR",),
    503: ("SERVICE_DEGRADED", "PROVIDER_UNAVAILABLE", "IDEMPOTENCY_UNAVAILABLE"),
    504: ("PROVIDER_TIMEOUT",),
}


def error_body(
    code: str, message: str, request_id: str, field_errors: Sequence[Mapping[str, Any]] | None = None
) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message, "request_id": request_id}
    if field_errors:
        error["field_errors"] = list(field_errors)
    return orjson.dumps({"error": error})


def error_response(
    status: int,
    code: str,
    message: str,
    request_id: str,
    *,
    field_errors: Sequence[Mapping[str, Any]] | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(code, message, request_id, field_errors),
        content_type="application/json",
        headers=headers,
    )


def service_error_response(error: ServiceError, request_id: str) -> web.Response:
    return error_response(
        error.status, error.code, error.message, request_id, field_errors=error.field_errors, headers=error.headers
    )
