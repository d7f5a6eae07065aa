"""The seam between a wire format and the one generation pipeline: what every edge translator provides.

Chat Completions, the Responses API and Anthropic Messages each have an :class:`Edge`: it turns the client's body
into a Chat Completions body before the gates need it (``to_chat``), renders the provider's ``chat.completion`` in
the client's format (``render``), and encodes the stream of ``chat.completion.chunk`` payloads as the client's SSE
events (``encoder``). Everything between (gates, context, provider call, relay, accounting) is shared and lives in
:mod:`ibex_dataplane.proxy.generation`; the edges are pure and never do I/O, except ``served`` (the Responses API
stores what it answered).

This module also holds the Chat Completions edge itself, which translates nothing.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol
from uuid import UUID

import orjson

from ibex_dataplane.providers.base import Usage
from ibex_dataplane.proxy.validation import validate_chat_body


@dataclass(frozen=True, slots=True)
class RenderContext:
    """What an edge needs to know about the request when it renders the answer."""

    request_id: str
    model: str  # the model that answered (after any fallback)
    created: int  # unix seconds
    prompt_tokens: int  # the gateway's estimate, for formats that announce input tokens before the end
    client_body: Any  # the body as the client sent it, in its own format


class StreamEncoder(Protocol):
    """Turns chat chunks into the client's SSE frames (each a complete ``event:``/``data:`` block)."""

    def chunk(self, data: bytes) -> list[bytes]:
        """Frames for one ``chat.completion.chunk`` payload (serialized JSON)."""
        ...

    def finish(self, usage: Usage | None, finish_reason: str | None) -> list[bytes]:
        """Frames that close a stream the provider completed."""
        ...

    def error(self, code: str, message: str, request_id: str) -> list[bytes]:
        """Frames that close a stream cut short by the provider (the HTTP status is already sent)."""
        ...

    def final(self) -> dict[str, Any] | None:
        """The whole answer in the client's format, once the stream has finished (for formats that store it)."""
        ...


class Edge(Protocol):
    """One wire format's translator to and from Chat Completions."""

    @property
    def route(self) -> str:
        """The route label of traces, metrics and the idempotency scope (``chat.completions``, ``messages``...)."""
        ...

    def to_chat(self, body: Any) -> dict[str, Any]:
        """The Chat Completions body for a client body; raises ``ApiError`` (400) for bad input."""
        ...

    def render(self, completion: dict[str, Any], usage: Usage, ctx: RenderContext) -> dict[str, Any]:
        """The client's answer for a ``chat.completion``."""
        ...

    def encoder(self, ctx: RenderContext) -> StreamEncoder:
        """A fresh encoder for one streamed answer."""
        ...

    def served(self, org_id: UUID, agent_id: UUID, answer: dict[str, Any]) -> Coroutine[Any, Any, None] | None:
        """Work to do with a complete answer (run in the background), or None."""
        ...


def sse(data: bytes, event: str | None = None) -> bytes:
    """One SSE frame."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


class _ChatEncoder:
    def chunk(self, data: bytes) -> list[bytes]:
        return [sse(data)]

    def finish(self, usage: Usage | None, finish_reason: str | None) -> list[bytes]:
        return [b"data: [DONE]\n\n"]

    def error(self, code: str, message: str, request_id: str) -> list[bytes]:
        error = {"error": {"code": code, "message": message, "request_id": request_id}}
        return [sse(orjson.dumps(error)), b"data: [DONE]\n\n"]

    def final(self) -> dict[str, Any] | None:
        return None


class ChatEdge:
    """``POST /v1/chat/completions``: the internal format already; answers pass through untouched."""

    route = "chat.completions"

    def to_chat(self, body: Any) -> dict[str, Any]:
        return validate_chat_body(body)

    def render(self, completion: dict[str, Any], usage: Usage, ctx: RenderContext) -> dict[str, Any]:
        return completion

    def encoder(self, ctx: RenderContext) -> StreamEncoder:
        return _ChatEncoder()

    def served(self, org_id: UUID, agent_id: UUID, answer: dict[str, Any]) -> Coroutine[Any, Any, None] | None:
        return None


CHAT_EDGE = ChatEdge()
