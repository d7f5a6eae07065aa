"""The agent's active directive (cached, invalidated on change) and its injection into the message list.

Modes (section 4): ``SystemFirst`` puts the directive first as its own system message, ahead of anything the
client sent; ``SystemAppend`` appends it to the client's first system message (or adds one at the start);
``UserPrepend`` prepends it to the first user message. The client's list is never modified in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

import orjson

from ibex_dataplane.proxy.cache import TieredCache
from ibex_dataplane.proxy.repository import DirectiveRow, ProxyRepository
from ibex_dataplane.store.keys import TenantKeys


def encode_directive(d: DirectiveRow | None) -> bytes:
    return orjson.dumps(None if d is None else [d.version, d.content, d.sha256, d.injection_mode])


def decode_directive(raw: bytes) -> DirectiveRow | None:
    data = orjson.loads(raw)
    return None if data is None else DirectiveRow(int(data[0]), data[1], data[2], data[3])


class DirectiveService:
    def __init__(self, repo: ProxyRepository, cache: TieredCache[DirectiveRow | None]) -> None:
        self._repo = repo
        self._cache = cache

    async def active(self, org_id: UUID, agent_id: UUID) -> DirectiveRow | None:
        return await self._cache.get(
            TenantKeys(org_id).directive(agent_id), lambda: self._repo.active_directive(org_id, agent_id)
        )


def _with_text(content: Any, text: str, *, before: bool) -> Any:
    """Add text to a message content that is a string or a list of parts."""
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        return [part, *content] if before else [*content, part]
    existing = content if isinstance(content, str) else ""
    if not existing:
        return text
    return f"{text}\n\n{existing}" if before else f"{existing}\n\n{text}"


def inject_directive(messages: Sequence[Mapping[str, Any]], directive: DirectiveRow | None) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    if directive is None:
        return out
    mode, text = directive.injection_mode, directive.content
    if mode == "SystemAppend":
        for m in out:
            if m.get("role") in ("system", "developer"):
                m["content"] = _with_text(m.get("content"), text, before=False)
                return out
        return [{"role": "system", "content": text}, *out]
    if mode == "UserPrepend":
        for m in out:
            if m.get("role") == "user":
                m["content"] = _with_text(m.get("content"), text, before=True)
                return out
        return [{"role": "user", "content": text}, *out]
    return [{"role": "system", "content": text}, *out]
