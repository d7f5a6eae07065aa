"""Responses API answers kept for ``GET /v1/responses/{id}``: one Redis value per answer, owned here.

Keys are the org's tenant keys and name the agent (``ibex:{<org>}:resp:<agent>:<id>``): another agent or another
organization asking for the id finds nothing (404, as if it did not exist), and deleting an organization removes
its answers. Answers expire after ``ttl`` seconds (30 days by default, as OpenAI keeps them). Written after the
answer by :mod:`ibex_dataplane.proxy.edge_responses`, read by :mod:`ibex_dataplane.proxy.routes`.
"""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

import orjson

from ibex_dataplane.store.keys import TenantKeys
from ibex_dataplane.store.redis import RedisClient, redis_errors

RESPONSE_TTL_SECONDS = 30 * 24 * 3600
RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9]{16,64}$")


class ResponseStore:
    def __init__(self, redis: RedisClient, *, ttl: int = RESPONSE_TTL_SECONDS) -> None:
        self._redis = redis
        self._ttl = ttl

    async def save(self, org_id: UUID, agent_id: UUID, response: dict[str, Any]) -> None:
        with redis_errors():
            await self._redis.set(
                TenantKeys(org_id).stored_response(agent_id, str(response["id"])), orjson.dumps(response), ex=self._ttl
            )

    async def get(self, org_id: UUID, agent_id: UUID, response_id: str) -> dict[str, Any] | None:
        if not RESPONSE_ID.fullmatch(response_id):  # an id no answer can have: no such answer, before any I/O
            return None
        with redis_errors():
            raw = await self._redis.get(TenantKeys(org_id).stored_response(agent_id, response_id))
        if raw is None:
            return None
        value = orjson.loads(raw)
        return value if isinstance(value, dict) else None
