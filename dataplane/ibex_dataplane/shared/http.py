"""The HTTP edge every aiohttp stage shares: request ids and the error envelope, as one middleware.

Every response carries ``X-Request-ID`` (the client's, when it is well formed, else a server-generated one; the
memory stage receives the proxy's, so both log the same id). Every error is rendered with the envelope of
:mod:`ibex_dataplane.shared.errors`: service errors with their own status and code, an unavailable store as 503
``SERVICE_DEGRADED``, aiohttp's HTTP exceptions with their mapped codes, and anything unexpected as 500
``INTERNAL_ERROR`` without internals. Used by the proxy and the memory stage apps.
"""

from __future__ import annotations

import logging
import re
import secrets

from aiohttp import web
from aiohttp.typedefs import Handler

from ibex_dataplane.shared.errors import HTTP_STATUS_CODES, ServiceError, error_response, service_error_response
from ibex_dataplane.store.errors import StoreUnavailable

log = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("request_id", str)
# Always server-generated and unique: what budgets and ledgers key on (a client may reuse its own X-Request-ID).
SERVER_REQUEST_ID = web.RequestKey("server_request_id", str)
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_KEPT_HEADERS = ("allow", "retry-after")


def server_request_id_of(request: web.Request) -> str:
    rid: str = request.get(SERVER_REQUEST_ID) or f"req_{secrets.token_hex(16)}"
    return rid


def request_id_of(request: web.Request) -> str:
    rid: str = request.get(REQUEST_ID, "")
    return rid


@web.middleware
async def envelope_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    supplied = request.headers.get("X-Request-ID", "")
    server_rid = f"req_{secrets.token_hex(16)}"
    rid = supplied if _CLIENT_REQUEST_ID.fullmatch(supplied) else server_rid
    request[REQUEST_ID] = rid
    request[SERVER_REQUEST_ID] = server_rid
    try:
        response = await handler(request)
    except ServiceError as e:
        response = service_error_response(e, rid)
    except StoreUnavailable as e:
        response = error_response(
            503, "SERVICE_DEGRADED", f"a required store is unavailable ({e.store})", rid, headers={"Retry-After": "1"}
        )
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = HTTP_STATUS_CODES.get(e.status, "INVALID_REQUEST" if e.status < 500 else "INTERNAL_ERROR")
        headers = {k: v for k, v in e.headers.items() if k.lower() in _KEPT_HEADERS}
        message = e.reason if e.status != 404 else "no such route"
        if e.status == 405:
            message = f"method {request.method} is not allowed here"
        response = error_response(e.status, code, message, rid, headers=headers)
    except Exception:
        log.exception("unhandled error (request_id=%s)", rid)
        response = error_response(500, "INTERNAL_ERROR", "internal error", rid)
    if not response.prepared:
        response.headers["X-Request-ID"] = rid
    return response
