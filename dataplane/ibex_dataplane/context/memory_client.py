"""The context stage's client of the memory stage: hot memories, cold search, and what was placed.

Every call carries its own internal principal, signed for exactly that call (method and path), for the org and
agent of the principal the context stage itself was called with, with the ``memory:context`` scope only and a
deadline no later than the caller's. The memory stage scores hits (the composite score travels on the wire);
this module only decodes them into :class:`Hit` values. Any failure is a :class:`MemoryUnavailable`, which the
service reports as a failed branch. Called by :class:`ibex_dataplane.context.service.ContextService`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ibex_dataplane.security.principal import HEADER, Principal, PrincipalSigner, http_target

CONTEXT_SCOPE = "memory:context"
_HOT, _SEARCH, _RETRIEVED = "/v1/memories:hot", "/v1/memories/search", "/v1/memories:retrieved"


class MemoryUnavailable(Exception):
    """The memory stage could not answer (unreachable, an error status, or a body that is not what it promises)."""


@dataclass(frozen=True, slots=True)
class Hit:
    """One scored memory as the memory stage ranked it."""

    id: str
    content: str
    valid_from: str | None
    score: float
    components: dict[str, float]


def _hits(payload: Any) -> list[Hit]:
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list):
        raise MemoryUnavailable("the memory stage answered without results")
    hits: list[Hit] = []
    try:
        for item in results:
            memory = item["memory"]
            hits.append(
                Hit(
                    id=str(memory["id"]),
                    content=str(memory["content"]),
                    valid_from=memory.get("valid_from"),
                    score=float(item["score"]),
                    components={k: float(v) for k, v in item["components"].items()},
                )
            )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MemoryUnavailable("the memory stage answered a malformed hit") from e
    return hits


class MemoryStageClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, signer: PrincipalSigner) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self._signer = signer

    def _headers(self, caller: Principal, method: str, path: str) -> dict[str, str]:
        principal = Principal(
            org_id=caller.org_id,
            agent_id=caller.agent_id,
            scopes=frozenset({CONTEXT_SCOPE}),
            request_id=caller.request_id,
            deadline=min(caller.deadline, time.time() + 30.0),
            target=http_target(method, path),
        )
        return {HEADER: self._signer.sign(principal), "X-Request-ID": caller.request_id}

    async def _call(self, caller: Principal, method: str, path: str, *, body: Any = None, query: str = "") -> Any:
        headers = self._headers(caller, method, path)
        data = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        try:
            async with self._session.request(method, self._base + path + query, data=data, headers=headers) as r:
                raw = await r.read()
                if r.status == 204:
                    return None
                if r.status != 200:
                    raise MemoryUnavailable(f"the memory stage answered {r.status}")
        except aiohttp.ClientError as e:
            raise MemoryUnavailable(f"the memory stage is unreachable ({type(e).__name__})") from e
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise MemoryUnavailable("the memory stage answered a body that is not JSON") from e

    async def warm_up(self) -> None:
        """Open a pooled connection to the memory stage ahead of the first assembly (best effort)."""
        try:
            async with self._session.get(self._base + "/healthz", timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError):
            pass

    async def hot(self, caller: Principal, limit: int) -> list[Hit]:
        return _hits(await self._call(caller, "GET", _HOT, query=f"?limit={int(limit)}"))

    async def search(self, caller: Principal, query: str, limit: int) -> list[Hit]:
        return _hits(await self._call(caller, "POST", _SEARCH, body={"query": query, "limit": int(limit)}))

    async def retrieved(self, caller: Principal, ids: Sequence[str]) -> None:
        await self._call(caller, "POST", _RETRIEVED, body={"ids": list(ids)})
