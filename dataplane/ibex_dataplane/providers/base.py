"""The seam between the proxy and model providers: request, response, stream events and the ``Provider`` protocol.

The proxy builds a ``ChatRequest`` after every gate has passed and hands it to a provider (through the
``ProviderRegistry``); adapters (``echo``, ``openai_compat``) implement ``Provider``. Nothing here does I/O.

Streaming contract
------------------
``provider.stream(request)`` returns an async context manager. Entering it does everything that can still fail
*before the first byte* (breaker check, connecting, retries, the upstream's status line); an error there is a
normal ``ProviderError`` and the proxy can still answer with a proper HTTP status. The value it yields is an
async iterator of ``StreamEvent``: ``StreamChunk`` for each SSE ``data:`` payload (serialized JSON of one
``chat.completion.chunk``, forwarded as ``b"data: " + chunk.data + b"\\n\\n"``), then exactly one
``StreamDone`` with the usage. A chunk marked ``more`` is followed by another event without a wait on the network
(the upstream sent them together): the proxy writes such runs to its client at once, in one write. Providers never
yield the ``[DONE]`` sentinel; the proxy writes it. An error after
the first chunk raises ``ProviderStreamInterrupted`` (or ``ProviderTimeout``) from the iterator. Leaving the
``async with`` block, normally, by an exception, or by cancellation (client disconnect), closes the upstream
response at once::

    async with provider.stream(request) as events:
        async for event in events:
            if isinstance(event, StreamChunk):
                await response.write(b"data: " + event.data + b"\\n\\n")
            else:
                usage = event.usage
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ChatRequest",
    "ChatResponse",
    "EmbeddingProvider",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "Provider",
    "StreamChunk",
    "StreamDone",
    "StreamEvent",
    "Usage",
    "piece_chunks",
]


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One validated Chat Completions call, ready for a provider.

    ``body`` is the client's JSON body as validated by the proxy (after directive and context injection);
    fields the gateway does not know pass through to OpenAI-compatible upstreams untouched. ``model`` is the
    resolved catalog model name and wins over ``body["model"]``. ``deadline`` is in ``time.monotonic()``
    seconds.
    """

    body: Mapping[str, Any]
    model: str
    deadline: float
    request_id: str

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it has passed)."""
        return self.deadline - time.monotonic()

    @property
    def messages(self) -> list[Mapping[str, Any]]:
        """The ``messages`` list of the body (empty if absent or malformed)."""
        messages = self.body.get("messages")
        return messages if isinstance(messages, list) else []

    @property
    def max_completion_tokens(self) -> int | None:
        """The tighter of ``max_tokens`` and ``max_completion_tokens``, if either is an integer."""
        limits = [
            v
            for v in (self.body.get("max_tokens"), self.body.get("max_completion_tokens"))
            if isinstance(v, int) and not isinstance(v, bool)
        ]
        return min(limits) if limits else None

    @property
    def include_usage(self) -> bool:
        """Whether the client asked for the usage chunk at the end of a stream."""
        options = self.body.get("stream_options")
        return isinstance(options, Mapping) and options.get("include_usage") is True


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a call consumed; ``estimated`` is true when the provider did not report them."""

    prompt_tokens: int
    completion_tokens: int
    estimated: bool

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class ChatResponse:
    """A non-streaming answer: the OpenAI ``chat.completion`` body, and who served it.

    ``model`` is the catalog model that actually answered (it differs from the request's after a fallback), so
    the proxy prices ``usage`` with it.
    """

    body: dict[str, Any]
    usage: Usage
    model: str
    provider: str


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One SSE ``data:`` payload: serialized JSON of a ``chat.completion.chunk``, without prefix or newlines.
    ``more``: the provider has the stream's next event already (the same piece of the upstream's answer held it), so
    a relay may hold this chunk back and write both at once: the next event comes without waiting on the network."""

    data: bytes
    more: bool = False


def piece_chunks(ready: Sequence[bytes], *, more_after: bool) -> list[StreamChunk]:
    """The chunks of one piece of an upstream's answer: each marked ``more`` but the last, and the last one too when
    ``more_after`` (another event follows it without a wait, such as the stream's end)."""
    last = len(ready) - 1
    return [StreamChunk(data, more=i < last or more_after) for i, data in enumerate(ready)]


@dataclass(frozen=True, slots=True)
class StreamDone:
    """The last event of every stream."""

    usage: Usage
    finish_reason: str | None
    model: str
    provider: str


StreamEvent = StreamChunk | StreamDone


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """One validated OpenAI embeddings call (``body`` as the client sent it; ``model`` the catalog name)."""

    body: Mapping[str, Any]
    model: str
    deadline: float
    request_id: str

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it has passed)."""
        return self.deadline - time.monotonic()


@dataclass(frozen=True, slots=True)
class EmbeddingResponse:
    """An OpenAI embeddings ``list`` body, its usage (completion tokens always 0) and who served it."""

    body: dict[str, Any]
    usage: Usage
    model: str
    provider: str


@runtime_checkable
class EmbeddingProvider(Protocol):
    """A provider that also serves ``/embeddings``."""

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Embed, or raise a ``ProviderError``."""
        ...


@runtime_checkable
class Provider(Protocol):
    """A model provider adapter. Implementations are safe to share between concurrent requests."""

    @property
    def name(self) -> str:
        """The provider name the catalog routes models to."""
        ...

    async def complete(self, request: ChatRequest) -> ChatResponse:
        """Answer a non-streaming request, or raise a ``ProviderError``."""
        ...

    def stream(self, request: ChatRequest) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        """Open a streaming answer (see the module docstring for the contract)."""
        ...

    async def aclose(self) -> None:
        """Release what the provider owns (not the shared HTTP session, which its creator closes)."""
        ...
