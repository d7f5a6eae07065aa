"""A small HTTP client for the memory routes of the proxy, as an agent with an API key would call them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import ClientSession

from tests.support.proxy import RunningProxy
from tests.support.tenants import Tenant


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any
    headers: dict[str, str]
    raw: bytes

    def error_code(self) -> str | None:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            code = self.body["error"].get("code")
            return str(code) if code is not None else None
        return None


class MemoryClient:
    def __init__(self, http: ClientSession, base_url: str, token: str | None, agent: str | None) -> None:
        self._http = http
        self._base = base_url
        self.token = token
        self.agent = agent

    def as_(self, token: str | None, agent: str | None) -> MemoryClient:
        return MemoryClient(self._http, self._base, token, agent)

    async def call(self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None) -> Reply:
        h = dict(headers or {})
        if self.token is not None:
            h["Authorization"] = f"Bearer {self.token}"
        if self.agent is not None:
            h["X-IBEX-Agent-ID"] = self.agent
        data = None
        if body is not None:
            data = orjson.dumps(body)
            h.setdefault("Content-Type", "application/json")
        async with self._http.request(method, self._base + path, data=data, headers=h) as r:
            raw = await r.read()
            parsed = orjson.loads(raw) if raw and r.content_type == "application/json" else None
            return Reply(r.status, parsed, dict(r.headers), raw)

    async def write(self, body: Any, **kw: Any) -> Reply:
        return await self.call("POST", "/v1/memories", body, **kw)

    async def batch(self, items: list[Any], **kw: Any) -> Reply:
        return await self.call("POST", "/v1/memories:batch", {"items": items}, **kw)

    async def search(self, query: str, **fields: Any) -> Reply:
        return await self.call("POST", "/v1/memories/search", {"query": query, **fields})

    async def get(self, memory_id: str) -> Reply:
        return await self.call("GET", f"/v1/memories/{memory_id}")

    async def list(self, query: str = "") -> Reply:
        return await self.call("GET", "/v1/memories" + (f"?{query}" if query else ""))

    async def forget(self, memory_id: str, **kw: Any) -> Reply:
        return await self.call("DELETE", f"/v1/memories/{memory_id}", **kw)

    async def feedback(self, memory_id: str, useful: bool) -> Reply:
        return await self.call("POST", f"/v1/memories/{memory_id}/feedback", {"useful": useful})


@asynccontextmanager
async def memory_client(proxy: RunningProxy, tenant: Tenant, agent: str = "alpha") -> AsyncIterator[MemoryClient]:
    async with ClientSession() as http:
        yield MemoryClient(http, proxy.base_url, tenant.keys[agent], str(tenant.agents[agent]))
