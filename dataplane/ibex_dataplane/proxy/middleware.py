"""Request id and error envelope middleware: every response carries ``X-Request-ID``; every error is enveloped."""

from __future__ import annotations

import logging
import re
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler

from ibex_dataplane.proxy.errors import HTTP_STATUS_CODES, ApiError, error_response

log = logging.getLogger(__name__)

REQUEST_ID = web.AppKey("request_id_key", str)
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(request: web.Request) -> str:
    rid = request.get("request_id")
    return rid if isinstance(rid, str) else ""


@web.middleware
async def envelope_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    supplied = request.headers.get("X-Request-ID", "")
    rid = supplied if _CLIENT_REQUEST_ID.match(supplied) else f"req_{uuid.uuid4().hex}"
    request["request_id"] = rid
    try:
        response = await handler(request)
    except ApiError as e:
        response = error_response(e.status, e.code, e.message, rid, field_errors=e.field_errors, headers=e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = HTTP_STATUS_CODES.get(e.status, "INVALID_REQUEST" if e.status < 500 else "INTERNAL_ERROR")
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
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
