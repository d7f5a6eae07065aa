"""The proxy's memory routes (architecture section 6.2): gates first, then a signed hop to the memory stage.

Each route runs the shared bound gate pipeline (body limit, content type, API key with the route's scope, agent
binding, org and agent status), then forwards the request to the memory stage on localhost with an internal
principal (org, agent, the key's memory scopes, request id, deadline; section 6.6) and relays its status, body and
the headers a client needs. The API key itself never leaves the proxy, and nothing a client sends can name the
tenant: the memory stage takes scope from the principal alone. An agent whose ``memory.enabled`` is false accepts
no memory writes (403); its existing memories can still be listed, read and forgotten. A memory stage that is not
configured, cannot be reached or misses the deadline is 503 ``SERVICE_DEGRADED``.

The MCP tools (:mod:`ibex_dataplane.proxy.mcp`) run the same gates and make their memory calls through
:meth:`MemoryForwarder.call`, the same signed hop to the same routes. Wired by :func:`add_memory_routes`, called from
:func:`ibex_dataplane.proxy.app.create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ibex_dataplane.proxy.auth import require_scope
from ibex_dataplane.proxy.gates import GatePipeline, GateState
from ibex_dataplane.security.principal import HEADER, Principal, PrincipalSigner, http_target
from ibex_dataplane.shared.errors import ApiError
from ibex_dataplane.shared.http import request_id_of

log = logging.getLogger(__name__)

MEMORY_SCOPES = frozenset({"memory:read", "memory:write", "memory:delete"})
_FORWARDED_REQUEST_HEADERS = ("Idempotency-Key", "X-Idempotency-Key")
_RELAYED_RESPONSE_HEADERS = ("Retry-After", "X-Idempotency-Replayed")

MEMORY_CLIENT = web.AppKey("memory_client", aiohttp.ClientSession)


@dataclass(frozen=True)
class StageReply:
    """What the memory stage answered: status, body, the headers a client needs, and the body's content type."""

    status: int
    body: bytes
    headers: dict[str, str]
    content_type: str

    def json(self) -> Any:
        """The body as JSON (``None`` when empty or not JSON)."""
        try:
            return orjson.loads(self.body) if self.body else None
        except orjson.JSONDecodeError:
            return None


class MemoryForwarder:
    """Runs the gates for a memory route, then makes the signed call to the memory stage."""

    def __init__(
        self,
        app: web.Application,
        bound: GatePipeline,
        *,
        memory_url: str | None,
        signer: PrincipalSigner | None,
        timeout: float,
    ) -> None:
        self._app = app
        self._bound = bound
        self._url = memory_url.rstrip("/") if memory_url else None
        self._signer = signer
        self._timeout = timeout

    def route(self, scope: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.forward(request, scope)

        return handler

    async def forward(self, request: web.Request, scope: str) -> web.StreamResponse:
        state = GateState(request, request_id_of(request), scope)
        await self._bound.run(state)
        headers = {name: request.headers[name] for name in _FORWARDED_REQUEST_HEADERS if name in request.headers}
        reply = await self.call(
            state, scope, request.method, request.path, raw_path=request.rel_url.raw_path,
            query=request.rel_url.raw_query_string, body=state.raw_body, headers=headers,
        )  # fmt: skip
        relayed = {**state.response_headers, **reply.headers}  # the rate limit's headers, like every limited route
        if reply.status == 204 or not reply.body:
            return web.Response(status=reply.status, headers=relayed)
        return web.Response(
            status=reply.status, body=reply.body, headers={**relayed, "Content-Type": reply.content_type}
        )

    def admit(self, state: GateState, scope: str) -> None:
        """The route's scope and, for writes, the agent's memory switch (after the gates ran)."""
        caller = state.require_caller()
        _, agent = state.require_agent()
        require_scope(caller, scope)
        if scope == "memory:write" and not agent.memory_enabled:
            raise ApiError(
                403, "INSUFFICIENT_PERMISSIONS", "memory is disabled for this agent (spec.memory.enabled is false)"
            )

    async def call(
        self,
        state: GateState,
        scope: str,
        method: str,
        path: str,
        *,
        raw_path: str | None = None,
        query: str = "",
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> StageReply:
        """One signed call to the memory stage for a request whose gates passed: the HTTP memory routes and the MCP
        tools both come through here, so both send the same principal to the same routes. ``path`` is what the
        principal is signed for; ``raw_path`` (default ``path``) and ``query`` (encoded) are what is sent."""
        self.admit(state, scope)
        caller = state.require_caller()
        _, agent = state.require_agent()
        if self._url is None or self._signer is None:
            raise ApiError(503, "SERVICE_DEGRADED", "the memory stage is not configured", headers={"Retry-After": "5"})
        principal = Principal(
            org_id=caller.org_id,
            agent_id=agent.id,
            scopes=frozenset(caller.scopes & MEMORY_SCOPES),
            request_id=state.request_id,
            deadline=time.time() + self._timeout,
            target=http_target(method, path),
        )
        sent = {HEADER: self._signer.sign(principal), "X-Request-ID": state.request_id}
        if body:
            sent["Content-Type"] = "application/json"
        for name, value in (headers or {}).items():
            if name in _FORWARDED_REQUEST_HEADERS:
                sent[name] = value
        session = self._app[MEMORY_CLIENT]
        try:
            async with session.request(
                method,
                self._url + (raw_path or path) + (f"?{query}" if query else ""),
                data=body or None,
                headers=sent,
                timeout=aiohttp.ClientTimeout(total=self._timeout + 1.0),
                allow_redirects=False,
            ) as upstream:
                raw = await upstream.read()
                relayed = {k: upstream.headers[k] for k in _RELAYED_RESPONSE_HEADERS if k in upstream.headers}
                return StageReply(
                    upstream.status, raw, relayed, upstream.headers.get("Content-Type", "application/json")
                )
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("memory stage call failed (request_id=%s): %s", state.request_id, type(e).__name__)
            raise ApiError(
                503, "SERVICE_DEGRADED", "the memory stage is unavailable", headers={"Retry-After": "1"}
            ) from e


def add_memory_routes(
    app: web.Application,
    *,
    bound: GatePipeline,
    memory_url: str | None,
    signer: PrincipalSigner | None,
    timeout: float = 30.0,
) -> MemoryForwarder:
    """Register the section 6.2 memory routes on the proxy app, and the client session they share."""
    forwarder = MemoryForwarder(app, bound, memory_url=memory_url, signer=signer, timeout=timeout)

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200), auto_decompress=False)
        app[MEMORY_CLIENT] = session
        try:
            yield
        finally:
            await session.close()
            # Let the connector's transports finish closing before the loop moves on.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)

    app.cleanup_ctx.append(client_ctx)
    r = app.router
    r.add_post("/v1/memories", forwarder.route("memory:write"))
    r.add_get("/v1/memories", forwarder.route("memory:read"))
    r.add_post("/v1/memories:batch", forwarder.route("memory:write"))
    r.add_post("/v1/memories/search", forwarder.route("memory:read"))
    r.add_get("/v1/memories/{memory_id}", forwarder.route("memory:read"))
    r.add_delete("/v1/memories/{memory_id}", forwarder.route("memory:delete"))
    r.add_post("/v1/memories/{memory_id}/feedback", forwarder.route("memory:write"))
    return forwarder
