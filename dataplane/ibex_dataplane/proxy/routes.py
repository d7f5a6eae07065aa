"""Handlers of the non-generation protected routes: models, me, auth-probe, session terminate, usage and stored
Responses API answers. HTTP in, service out."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from uuid import UUID

from aiohttp import web

from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.proxy.analytics import GROUPINGS, usage_report
from ibex_dataplane.proxy.gates import SESSION_ID, GatePipeline, GateState
from ibex_dataplane.proxy.policy import PolicyService
from ibex_dataplane.proxy.response_store import ResponseStore
from ibex_dataplane.proxy.sessions import SessionService
from ibex_dataplane.shared.errors import ApiError
from ibex_dataplane.shared.http import request_id_of
from ibex_dataplane.store.clickhouse import ClickHouse


class ProtectedRoutes:
    def __init__(
        self,
        *,
        keyed: GatePipeline,
        bound: GatePipeline,
        catalog: ModelCatalog,
        sessions: SessionService,
        policies: PolicyService,
        clickhouse: ClickHouse,
        responses: ResponseStore,
        servable: Callable[[str], str | None] = lambda name: None,
    ) -> None:
        self._responses = responses
        self._keyed = keyed  # body, content type, key (no agent needed)
        self._bound = bound  # ... plus agent binding and status
        self._catalog = catalog
        self._sessions = sessions
        self._policies = policies
        self._clickhouse = clickhouse
        self._servable = servable

    async def _run(self, pipeline: GatePipeline, request: web.Request, scope: str) -> GateState:
        state = GateState(request, request_id_of(request), scope)
        await pipeline.run(state)
        return state

    async def models(self, request: web.Request) -> web.Response:
        """Models the key's org may use (agent binding is optional here: the list is per org)."""
        state = await self._run(self._bound if request.headers.get("X-IBEX-Agent-ID") else self._keyed, request,
                                "chat")  # fmt: skip
        caller = state.require_caller()
        policy = state.policy or await self._policies.snapshot(caller.org_id)
        created = int(time.time())
        data = [
            {"id": m.name, "object": "model", "created": created, "owned_by": m.provider,
             "context_window": m.context_window, "max_output_tokens": m.max_output_tokens, "kind": str(m.kind)}
            for m in self._catalog
            if policy is not None and policy.model_allowed(m.name) and self._servable(m.name) is None
        ]  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def me(self, request: web.Request) -> web.Response:
        state = await self._run(self._keyed, request, "any")
        caller = state.require_caller()
        policy = await self._policies.snapshot(caller.org_id)
        agents = [
            {"id": str(a.id), "name": a.name, "suspended": a.suspended}
            for a in (policy.agents.values() if policy else [])
            if a.id in caller.agent_ids
        ]
        return web.json_response(
            {
                "org_id": str(caller.org_id),
                "org_name": policy.org_name if policy else None,
                "key_id": caller.key_id,
                "scopes": sorted(caller.scopes),
                "agents": sorted(agents, key=lambda a: a["name"]),
            }
        )

    async def auth_probe(self, request: web.Request) -> web.Response:
        state = await self._run(self._keyed, request, "any")
        caller = state.require_caller()
        if request.match_info["org_id"] != str(caller.org_id):
            raise ApiError(403, "PATH_ORG_MISMATCH", "the organization in the path is not the API key's")
        return web.json_response({"ok": True, "org_id": str(caller.org_id), "key_id": caller.key_id})

    async def terminate_session(self, request: web.Request) -> web.Response:
        state = await self._run(self._bound, request, "chat")
        caller = state.require_caller()
        _, agent = state.require_agent()
        session_id = request.match_info["session_id"]
        # An id no session can have (the header's own rule) is simply no such session, before any query.
        if not SESSION_ID.fullmatch(session_id) or not await self._sessions.terminate(
            caller.org_id, agent.id, session_id
        ):
            raise ApiError(404, "NOT_FOUND", "no such active session")
        return web.json_response({"id": session_id, "status": "closed"})

    async def stored_response(self, request: web.Request) -> web.Response:
        """A stored Responses API answer of this agent (another agent's or org's id is simply not found)."""
        state = await self._run(self._bound, request, "chat")
        caller = state.require_caller()
        _, agent = state.require_agent()
        found = await self._responses.get(caller.org_id, agent.id, request.match_info["response_id"])
        if found is None:
            raise ApiError(404, "NOT_FOUND", "no such response")
        return web.json_response(found)

    async def usage(self, request: web.Request) -> web.Response:
        """The org's spend and tokens in [from, to) (default: this month) by agent, model or day."""
        state = await self._run(self._keyed, request, "usage:read")
        caller = state.require_caller()
        group_by = request.query.get("group_by", "agent")
        errors = []
        if group_by not in GROUPINGS:
            errors.append({"field": "group_by", "message": f"must be one of {', '.join(GROUPINGS)}"})
        today = datetime.now(UTC).date()
        start, end = today.replace(day=1), today + timedelta(days=1)
        for name in ("from", "to"):
            if name in request.query:
                try:
                    value = date.fromisoformat(request.query[name])
                except ValueError:
                    errors.append({"field": name, "message": "must be a date (YYYY-MM-DD)"})
                    continue
                start, end = (value, end) if name == "from" else (start, value)
        if not errors and end <= start:
            errors.append({"field": "to", "message": "must be after from"})
        if errors:
            raise ApiError(400, "VALIDATION_ERROR", "invalid usage query", field_errors=errors)
        data = await usage_report(self._clickhouse, caller.org_id, group_by, start, end)
        if group_by == "agent":  # people read names: add the agent's name next to its id
            policy = await self._policies.snapshot(caller.org_id)
            for row in data:
                try:
                    agent = policy.agents.get(UUID(row["key"])) if policy is not None else None
                except ValueError:
                    agent = None
                row["agent_name"] = agent.name if agent is not None else None
        return web.json_response(
            {"object": "usage", "org_id": str(caller.org_id), "group_by": group_by, "from": start.isoformat(),
             "to": end.isoformat(), "data": data}
        )  # fmt: skip
