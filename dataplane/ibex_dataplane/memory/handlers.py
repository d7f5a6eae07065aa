"""HTTP <-> service for the memory stage: decode requests, check the principal's scope, encode section 9.5 shapes.

The tenant comes from the verified internal principal only (never a body, query or path field). Mutating routes go
through the idempotency ledger when the caller sent ``Idempotency-Key`` (or ``X-Idempotency-Key``): a replay
carries ``X-Idempotency-Replayed: true``, and a response is only returned as a success once its claim is finalized.
Reads run under the principal's deadline; writes check it between refinery stages and never stop mid-commit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.middleware import principal_of
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.refinery import WriteResult
from ibex_dataplane.memory.service import MemoryService
from ibex_dataplane.memory.validation import parse_batch, parse_list, parse_memory_id, parse_memory_ids, parse_search
from ibex_dataplane.security.principal import Principal
from ibex_dataplane.shared.errors import (
    DeadlineExceeded,
    Forbidden,
    InvalidJson,
    ServiceError,
    ValidationFailed,
    error_body,
)
from ibex_dataplane.shared.http import request_id_of
from ibex_dataplane.shared.idempotency import (
    REPLAYED_HEADER,
    Claim,
    IdempotencyLedger,
    StoredResponse,
    fingerprint,
    idempotency_key_of,
)
from ibex_dataplane.shared.input import nul_path

READ, WRITE, DELETE, INTERNAL = "memory:read", "memory:write", "memory:delete", "memory:internal"
# The context stage's own scope: hot memories, search without retrieval bookkeeping, and reporting what it placed.
CONTEXT = "memory:context"


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _result_body(result: WriteResult) -> dict[str, Any]:
    """The body of one write (section 9.5): 201 memory + relationships, 200 dedup, 202 quarantined, or an error."""
    if result.error is not None:
        error = result.error
        body: dict[str, Any] = {"code": error.code, "message": error.message}
        if error.field_errors:
            body["field_errors"] = error.field_errors
        return {"error": body}
    assert result.memory is not None
    if result.status == 200:
        return {"memory": result.memory.to_wire(), "deduplicated": "exact"}
    if result.status == 202:
        wire = result.memory.to_wire()
        return {"memory": {k: v for k, v in wire.items() if k not in ("content", "labels", "metadata")}}
    return {"memory": result.memory.to_wire(), "relationships": [r.to_wire() for r in result.relationships]}


class MemoryHandlers:
    def __init__(self, service: MemoryService, ledger: IdempotencyLedger, metrics: MemoryMetrics) -> None:
        self._service = service
        self._ledger = ledger
        self._metrics = metrics

    # -- helpers -------------------------------------------------------------------------------------------------

    @staticmethod
    def _scoped(request: web.Request, *scopes: str) -> tuple[Principal, Tenant]:
        """The principal and its tenant, if the principal holds any of ``scopes``."""
        principal = principal_of(request)
        if not any(principal.has(scope) for scope in scopes):
            raise Forbidden(f"the caller lacks the '{scopes[0]}' scope")
        return principal, Tenant(principal.org_id, principal.agent_id)

    @staticmethod
    async def _body(request: web.Request) -> Any:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            raise InvalidJson("the request body is not valid JSON") from None
        where = nul_path(body)
        if where is not None:
            raise ValidationFailed(
                "strings must not contain NUL characters", field_errors=[{"field": where, "message": "contains NUL"}]
            )
        return body

    @staticmethod
    async def _within_deadline(principal: Principal, work: Awaitable[Any]) -> Any:
        remaining = principal.remaining()
        if remaining <= 0:
            raise DeadlineExceeded("the request deadline passed")
        try:
            async with asyncio.timeout(remaining):
                return await work
        except TimeoutError:
            raise DeadlineExceeded("the request deadline passed") from None

    async def _idempotent(
        self, request: web.Request, route: str, principal: Principal, run: Callable[[], Awaitable[web.Response]]
    ) -> web.Response:
        key = idempotency_key_of(request.headers)
        if key is None:
            return await run()
        outcome = await self._ledger.claim(
            principal.org_id, principal.agent_id, key, route, fingerprint(route, await request.read()),
            lock_seconds=principal.remaining() + 5,
        )  # fmt: skip
        if isinstance(outcome, StoredResponse):
            self._metrics.idempotency_outcomes.labels("replayed").inc()
            response = web.Response(status=outcome.status, body=outcome.body, content_type="application/json")
            response.headers[REPLAYED_HEADER] = "true"
            return response
        self._metrics.idempotency_outcomes.labels("claimed").inc()
        return await asyncio.shield(self._run_claimed(request, outcome, run))

    async def _run_claimed(
        self, request: web.Request, claim: Claim, run: Callable[[], Awaitable[web.Response]]
    ) -> web.Response:
        try:
            response = await run()
        except ServiceError as e:
            if e.status >= 500:
                await self._ledger.abandon(claim)
                raise
            headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
            body = error_body(e.code, e.message, request_id_of(request), e.field_errors)
            response = web.Response(status=e.status, body=body, content_type="application/json", headers=headers)
        except BaseException:
            await self._ledger.abandon(claim)
            raise
        if response.status >= 500:
            await self._ledger.abandon(claim)
            return response
        assert isinstance(response.body, bytes)
        await self._ledger.complete(claim, StoredResponse(response.status, response.body))
        self._metrics.idempotency_outcomes.labels("completed").inc()
        return response

    # -- writes --------------------------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        principal, tenant = self._scoped(request, WRITE)

        async def run() -> web.Response:
            body = await self._body(request)
            results, _ = await self._service.write(
                tenant, [body], request_id=request_id_of(request), deadline=principal.deadline
            )
            result = results[0]
            if result.error is not None:
                raise result.error
            return _json(_result_body(result), result.status)

        return await self._idempotent(request, "POST /v1/memories", principal, run)

    async def batch(self, request: web.Request) -> web.Response:
        principal, tenant = self._scoped(request, WRITE)

        async def run() -> web.Response:
            items = parse_batch(await self._body(request))
            results, _ = await self._service.write(
                tenant, items, request_id=request_id_of(request), deadline=principal.deadline
            )
            return _json({"results": [{"status": r.status, **_result_body(r)} for r in results]})

        return await self._idempotent(request, "POST /v1/memories:batch", principal, run)

    async def delete(self, request: web.Request) -> web.Response:
        principal, tenant = self._scoped(request, DELETE)
        memory_id = parse_memory_id(request.match_info["memory_id"])

        async def run() -> web.Response:
            await self._service.forget(tenant, memory_id)
            return web.Response(status=204, body=b"")

        return await self._idempotent(request, f"DELETE /v1/memories/{memory_id}", principal, run)

    async def feedback(self, request: web.Request) -> web.Response:
        principal, tenant = self._scoped(request, WRITE)
        memory_id = parse_memory_id(request.match_info["memory_id"])

        async def run() -> web.Response:
            memory = await self._service.feedback(tenant, memory_id, await self._body(request))
            return _json({"memory": memory.to_wire()})

        return await self._idempotent(request, f"POST /v1/memories/{memory_id}/feedback", principal, run)

    # -- reads ---------------------------------------------------------------------------------------------------

    async def get(self, request: web.Request) -> web.Response:
        principal, tenant = self._scoped(request, READ)
        memory_id = parse_memory_id(request.match_info["memory_id"])
        memory = await self._within_deadline(principal, self._service.get(tenant, memory_id))
        return _json({"memory": memory.to_wire()})

    async def page(self, request: web.Request) -> web.Response:
        principal, tenant = self._scoped(request, READ)
        query = parse_list(request.query)
        page = await self._within_deadline(principal, self._service.page(tenant, query))
        return _json({"data": [m.to_wire() for m in page.memories], "next_cursor": page.next_cursor})

    async def search(self, request: web.Request) -> web.Response:
        principal, tenant = self._scoped(request, READ, CONTEXT)
        query = parse_search(await self._body(request), internal=principal.has(INTERNAL))
        record = not principal.has(CONTEXT)  # the context stage reports what it placed, not what it saw
        hits = await self._within_deadline(principal, self._service.search(tenant, query, record=record))
        return _json({"results": [h.to_wire() for h in hits]})

    async def hot(self, request: web.Request) -> web.Response:
        """The agent's hot memories with composite scores (for the context stage; not routed by the proxy)."""
        principal, tenant = self._scoped(request, READ, CONTEXT)
        raw = request.query.get("limit", "20")
        limit = int(raw) if raw.isdigit() and 1 <= int(raw) <= 200 else 20
        hits = await self._within_deadline(principal, self._service.hot_hits(tenant, limit))
        return _json({"results": [h.to_wire() for h in hits]})

    async def retrieved(self, request: web.Request) -> web.Response:
        """The context stage reports the memories it placed into a prompt: their retrieval metadata is bumped."""
        _, tenant = self._scoped(request, CONTEXT)
        ids = parse_memory_ids(await self._body(request))
        self._service.record_retrievals(tenant, ids)
        return web.Response(status=204)


def timed(metrics: MemoryMetrics, route: str, handler: Callable[[web.Request], Awaitable[web.Response]]) -> Any:
    async def wrapped(request: web.Request) -> web.Response:
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except ServiceError as e:
            status = e.status
            raise
        finally:
            metrics.request_seconds.labels(route, str(status)).observe(time.perf_counter() - started)

    return wrapped
