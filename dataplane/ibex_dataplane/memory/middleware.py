"""The memory stage's internal principal check, as an aiohttp middleware (the envelope is the shared one).

Every route except health and metrics requires a valid internal principal (section 6.6) signed for this very call
(method and path): missing is 401 ``MISSING_TOKEN``; malformed, forged, expired or signed for another call is 401
``INVALID_TOKEN``, checked before routing reveals anything. Handlers read the verified principal with
:func:`principal_of`. The request id and the error envelope come from :mod:`ibex_dataplane.shared.http`.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.security.principal import HEADER, Principal, PrincipalError, PrincipalSigner, http_target
from ibex_dataplane.shared.errors import MissingPrincipal, Unauthenticated

PRINCIPAL = web.RequestKey("memory_principal", Principal)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def principal_of(request: web.Request) -> Principal:
    return request[PRINCIPAL]


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
            principal = signer.verify(token, target=http_target(request.method, request.path))
        except PrincipalError as e:
            metrics.principal_rejections.labels("invalid").inc()
            raise Unauthenticated(str(e)) from None
        request[PRINCIPAL] = principal
        return await handler(request)

    return middleware
