"""The proxy's error hierarchy and the one envelope every error body uses (architecture section 6.4).

Handlers and gates raise :class:`ApiError`; the middleware in :mod:`ibex_dataplane.proxy.middleware` renders it,
and also converts aiohttp's own HTTP exceptions (404, 405, 413 ...) and anything unexpected (500, no internals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web


class ApiError(Exception):
    """An error a client can see: HTTP status, UPPER_SNAKE code, message, optional field errors and headers."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field_errors: Sequence[Mapping[str, Any]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field_errors = list(field_errors) if field_errors else None
        self.headers = dict(headers or {})


# aiohttp's own exceptions -> our codes.
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


def error_body(code: str, message: str, request_id: str, field_errors: Sequence[Mapping[str, Any]] | None) -> bytes:
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
