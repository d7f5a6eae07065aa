"""The memory stage's edge: the error envelope and the internal principal check, as aiohttp middlewares.

Every response carries ``X-Request-ID`` (the proxy's, passed along, so both stages log the same id) and every error
uses the envelope of architecture section 6.4. Every route except health and metrics requires a valid internal
principal (section 6.6): missing is 401 ``MISSING_TOKEN``, malformed, forged or expired is 401 ``INVALID_TOKEN``,
checked before routing reveals anything. Handlers read the verified principal with :func:`principal_of`.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ibex_dataplane.memory.errors import MemoryServiceError, MissingPrincipal, Unauthenticated
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.security.principal import HEADER, Principal, PrincipalError, PrincipalSigner
from ibex_dataplane.store.errors import StoreUnavailable

log = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("memory_request_id", str)
PRINCIPAL = web.RequestKey("memory_principal", Principal)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_HTTP_CODES = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "PAYLOAD_TOO_LARGE", 415: "UNSUPPORTED_MEDIA_TYPE"}


def error_body(
    code: str, message: str, request_id: str, field_errors: Sequence[Mapping[str, Any]] | None = None
) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message, "request_id": request_id}
    if field_errors:
        error["field_errors"] = list(field_errors)
    return orjson.dumps({"error": error})


def error_response(error: MemoryServiceError, request_id: str) -> web.Response:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return web.Response(
        status=error.status,
        body=error_body(error.code, error.message, request_id, error.field_errors),
        content_type="application/json",
        headers=headers,
    )


def request_id_of(request: web.Request) -> str:
    rid: str = request.get(REQUEST_ID, "")
    return rid


def principal_of(request: web.Request) -> Principal:
    return request[PRINCIPAL]


@web.middleware
async def envelope_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    supplied = request.headers.get("X-Request-ID", "")
    rid = supplied if _REQUEST_ID.fullmatch(supplied) else f"req_{uuid.uuid4().hex}"
    request[REQUEST_ID] = rid
    try:
        response = await handler(request)
    except MemoryServiceError as e:
        response = error_response(e, rid)
    except StoreUnavailable as e:
        body = error_body("SERVICE_DEGRADED", f"a required store is unavailable ({e.store})", rid)
        response = web.Response(status=503, body=body, content_type="application/json", headers={"Retry-After": "1"})
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = _HTTP_CODES.get(e.status, "INVALID_REQUEST" if e.status < 500 else "INTERNAL_ERROR")
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        message = "no such route" if e.status == 404 else e.reason
        response = web.Response(
            status=e.status, body=error_body(code, message, rid), content_type="application/json", headers=headers
        )
    except Exception:
        log.exception("unhandled error in the memory stage (request_id=%s)", rid)
        response = web.Response(
            status=500, body=error_body("INTERNAL_ERROR", "internal error", rid), content_type="application/json"
        )
    if not response.prepared:
        response.headers["X-Request-ID"] = rid
    return response


def principal_middleware(signer: PrincipalSigner, metrics: MemoryMetrics) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        token = request.headers.get(HEADER)
        if not token:
            metrics.principal_rejections.labels("missing").inc()
            raise MissingPrincipal("an internal principal is required")
        try:
            principal = signer.verify(token)
        except PrincipalError as e:
            metrics.principal_rejections.labels("invalid").inc()
            raise Unauthenticated(str(e)) from None
        request[PRINCIPAL] = principal
        return await handler(request)

    return middleware
