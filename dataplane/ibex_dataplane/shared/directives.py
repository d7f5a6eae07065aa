"""How a directive enters a message list (architecture sections 4 and 8), shared by the proxy and the context stage.

Modes: ``SystemFirst`` puts the directive first as its own system message, ahead of anything the client sent;
``SystemAppend`` appends it to the client's first system message (or adds one at the start); ``UserPrepend``
prepends it to the first user message. The client's list is never modified in place. The proxy injects when it
assembles no memory context (memory off, or the context stage degraded); the context stage when it assembles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class DirectiveText(Protocol):
    """What injection needs of a directive: its text and its mode."""

    @property
    def content(self) -> str: ...

    @property
    def injection_mode(self) -> str: ...


def _with_text(content: Any, text: str, *, before: bool) -> Any:
    """Add text to a message content that is a string or a list of parts."""
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        return [part, *content] if before else [*content, part]
    existing = content if isinstance(content, str) else ""
    if not existing:
        return text
    return f"{text}\n\n{existing}" if before else f"{existing}\n\n{text}"


def inject_directive(messages: Sequence[Mapping[str, Any]], directive: DirectiveText | None) -> list[dict[str, Any]]:
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
