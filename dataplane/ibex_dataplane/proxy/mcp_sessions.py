"""MCP sessions of the ``/mcp`` endpoint, kept in Redis so that any proxy replica can serve any message.

A session is protocol state only: the key id and agent that opened it with ``initialize`` and the protocol revision
negotiated. Every message is authenticated and bound again by the gates; the session lookup then requires the same
key and agent, so a session id is worth nothing to another key, agent or organization (404, as if it did not exist).
Keys are the org's tenant keys (``ibex:{<org>}:mcp:<id>``), so deleting an organization removes its sessions.
Sessions expire after ``ttl`` seconds without use; each use slides the expiry. Used by :mod:`ibex_dataplane.proxy.mcp`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from uuid import UUID

import orjson

from ibex_dataplane.store.keys import TenantKeys
from ibex_dataplane.store.redis import RedisClient, redis_errors

SESSION_TTL_SECONDS = 24 * 3600
_SESSION_ID = re.compile(r"^[A-Za-z0-9_\-]{16,128}$")


@dataclass(frozen=True)
class McpSession:
    id: str
    key_id: str
    agent_id: UUID
    protocol_version: str


class McpSessions:
    def __init__(self, redis: RedisClient, *, ttl: int = SESSION_TTL_SECONDS) -> None:
        self._redis = redis
        self._ttl = ttl

    async def open(self, org_id: UUID, key_id: str, agent_id: UUID, protocol_version: str) -> McpSession:
        session = McpSession(secrets.token_urlsafe(32), key_id, agent_id, protocol_version)
        value = orjson.dumps({"k": key_id, "a": str(agent_id), "v": protocol_version})
        with redis_errors():
            await self._redis.set(TenantKeys(org_id).mcp_session(session.id), value, ex=self._ttl)
        return session

    async def find(self, org_id: UUID, session_id: str, key_id: str, agent_id: UUID) -> McpSession | None:
        """The session, if it exists and was opened by this key as this agent (its expiry slides)."""
        if not _SESSION_ID.fullmatch(session_id):
            return None
        with redis_errors():
            raw = await self._redis.getex(TenantKeys(org_id).mcp_session(session_id), ex=self._ttl)
        if raw is None:
            return None
        try:
            data = orjson.loads(raw)
            session = McpSession(session_id, str(data["k"]), UUID(str(data["a"])), str(data["v"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
        if session.key_id != key_id or session.agent_id != agent_id:
            return None
        return session

    async def close(self, org_id: UUID, session: McpSession) -> None:
        with redis_errors():
            await self._redis.delete(TenantKeys(org_id).mcp_session(session.id))
