"""The built-in offline model ``echo``: it answers with exactly what it was sent.

The reply's content is the request's ``messages`` serialized as compact JSON
(``json.dumps(messages, separators=(",", ":"), ensure_ascii=False)``), so users and tests can see what the model
saw after directive and memory injection. Usage comes from the conservative estimates of ``tokens`` for the
model's tokenizer family (``generic`` for the built-in entry): prompt = estimate of the messages (and tools),
completion = estimate of the reply. With ``max_tokens`` / ``max_completion_tokens`` the reply is cut to the
longest prefix whose estimate fits and ``finish_reason`` is ``"length"``.

Streams look exactly like OpenAI's: a role delta, the content in a few pieces, a chunk with the finish reason,
then (only with ``stream_options.include_usage``) a usage chunk with empty ``choices``; every chunk carries
``"usage": null`` in that mode, as OpenAI's do. The registry routes models whose catalog provider is ``echo``
here; nothing leaves the process.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ibex_dataplane.providers.base import ChatRequest, ChatResponse, StreamChunk, StreamDone, StreamEvent, Usage
from ibex_dataplane.providers.catalog import ECHO_PROVIDER, ModelCatalog
from ibex_dataplane.providers.errors import ProviderTimeout
from ibex_dataplane.providers.tokens import (
    TokenizerFamily,
    estimate_chat_tokens,
    estimate_text_tokens,
    truncate_to_tokens,
)

__all__ = ["EchoProvider"]

STREAM_PIECES: Final = 4


@dataclass(frozen=True, slots=True)
class _EchoReply:
    completion_id: str
    created: int
    content: str
    finish_reason: str
    usage: Usage


class EchoProvider:
    """Deterministic, offline provider for every catalog model routed to the ``echo`` provider."""

    def __init__(self, catalog: ModelCatalog | None = None, *, name: str = ECHO_PROVIDER) -> None:
        self._catalog = catalog
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def _family(self, model: str) -> TokenizerFamily:
        info = self._catalog.get(model) if self._catalog is not None else None
        return info.tokenizer_family if info is not None else TokenizerFamily.GENERIC

    def _reply(self, request: ChatRequest) -> _EchoReply:
        if request.remaining() <= 0:
            raise ProviderTimeout("deadline passed before the model was called", provider=self._name)
        family = self._family(request.model)
        messages = request.messages
        tools = request.body.get("tools")
        prompt = estimate_chat_tokens(messages, family, tools=tools if isinstance(tools, list) else None)
        content = json.dumps(messages, separators=(",", ":"), ensure_ascii=False)
        finish_reason = "stop"
        limit = request.max_completion_tokens
        if limit is not None and estimate_text_tokens(content, family) > limit:
            content = truncate_to_tokens(content, limit, family)
            finish_reason = "length"
        usage = Usage(prompt.tokens, estimate_text_tokens(content, family), estimated=True)
        return _EchoReply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), content, finish_reason, usage)

    async def complete(self, request: ChatRequest) -> ChatResponse:
        reply = self._reply(request)
        body: dict[str, Any] = {
            "id": reply.completion_id,
            "object": "chat.completion",
            "created": reply.created,
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.content, "refusal": None},
                    "logprobs": None,
                    "finish_reason": reply.finish_reason,
                }
            ],
            "usage": _usage_body(reply.usage),
            "system_fingerprint": None,
        }
        return ChatResponse(body=body, usage=reply.usage, model=request.model, provider=self._name)

    @asynccontextmanager
    async def stream(self, request: ChatRequest) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        reply = self._reply(request)  # errors surface on entering, before any byte
        yield self._events(request, reply)

    async def _events(self, request: ChatRequest, reply: _EchoReply) -> AsyncIterator[StreamEvent]:
        include_usage = request.include_usage

        def chunk(choices: list[dict[str, Any]], usage: Usage | None = None) -> StreamChunk:
            body: dict[str, Any] = {
                "id": reply.completion_id,
                "object": "chat.completion.chunk",
                "created": reply.created,
                "model": request.model,
                "system_fingerprint": None,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = _usage_body(usage) if usage is not None else None
            return StreamChunk(orjson.dumps(body), more=True)  # the whole answer is here: StreamDone follows at once

        def delta(d: dict[str, Any], finish_reason: str | None = None) -> list[dict[str, Any]]:
            return [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}]

        yield chunk(delta({"role": "assistant", "content": "", "refusal": None}))
        content = reply.content
        step = max(1, math.ceil(len(content) / STREAM_PIECES))
        for start in range(0, len(content), step):
            yield chunk(delta({"content": content[start : start + step]}))
        yield chunk(delta({}, reply.finish_reason))
        if include_usage:
            yield chunk([], reply.usage)
        yield StreamDone(reply.usage, reply.finish_reason, request.model, self._name)

    async def aclose(self) -> None:
        return None


def _usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
