"""Adapter for any OpenAI-compatible Chat Completions upstream (OpenAI, vLLM, Ollama, any ``base_url``).

The registry builds one ``OpenAICompatProvider`` per configured upstream and the proxy reaches it through
``Provider.complete`` / ``Provider.stream``. It owns the wire work: the request body passes through untouched
except ``model`` (the resolved catalog name) and the streaming flags; JSON answers and SSE streams are relayed
(each ``data:`` payload is forwarded as it arrives); usage is taken from the upstream, or estimated when absent.

Retries, the breaker and status mapping are :class:`~ibex_dataplane.providers.http.HttpProvider`'s. Once an
upstream has answered 200 nothing is retried: a failure after that is ``ProviderStreamInterrupted`` (or
``ProviderTimeout``). Leaving the stream's context (for instance when the client disconnects and the proxy's task
is cancelled) closes the upstream connection at once.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

import orjson
from pydantic import Field

from ibex_dataplane.providers.base import (
    ChatRequest,
    ChatResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    StreamDone,
    StreamEvent,
    Usage,
    piece_chunks,
)
from ibex_dataplane.providers.breaker import CircuitBreaker
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.errors import (
    ProviderError,
    ProviderStreamInterrupted,
    ProviderTimeout,
    TransportError,
)
from ibex_dataplane.providers.http import HttpProvider, HttpProviderConfig
from ibex_dataplane.providers.sse import SSEDecoder
from ibex_dataplane.providers.transport import UpstreamClient, UpstreamResponse

__all__ = ["OpenAICompatConfig", "OpenAICompatProvider"]

logger = logging.getLogger(__name__)

_DONE: Final = b"[DONE]"


class OpenAICompatConfig(HttpProviderConfig):
    """Settings of one OpenAI-compatible upstream (the ``providers`` section of the catalog configuration)."""

    base_url: str = Field(default="https://api.openai.com/v1", description="Prefix of /chat/completions.")
    request_stream_usage: bool = Field(
        default=True, description="Ask the upstream for stream usage (stream_options.include_usage)."
    )


class OpenAICompatProvider(HttpProvider):
    """``Provider`` for an OpenAI-compatible upstream, over a shared :class:`UpstreamClient` it does not own."""

    def __init__(
        self,
        name: str,
        config: OpenAICompatConfig,
        client: UpstreamClient,
        *,
        catalog: ModelCatalog | None = None,
        breaker: CircuitBreaker | None = None,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        auth = {"Authorization": f"Bearer {config.api_key.get_secret_value()}"} if config.api_key is not None else {}
        super().__init__(
            name, config, client, path="/chat/completions", auth_headers=auth, catalog=catalog, breaker=breaker,
            jitter=jitter,
        )  # fmt: skip
        self._config: OpenAICompatConfig = config

    # --- public API ----------------------------------------------------------------------------------------

    async def complete(self, request: ChatRequest) -> ChatResponse:
        body = dict(request.body)
        body["model"] = request.model
        body.pop("stream", None)
        body.pop("stream_options", None)
        response = await self._open(request, orjson.dumps(body), accept="application/json")
        parsed = await self._read_json(request, response)
        if not isinstance(parsed, dict) or not isinstance(parsed.get("choices"), list):
            raise ProviderError("upstream answer is not a chat completion", provider=self._name)
        usage = _reported_usage(parsed.get("usage"))
        if usage is None:
            usage = self._estimate_usage(request, _completion_text(parsed["choices"]))
        return ChatResponse(body=parsed, usage=usage, model=request.model, provider=self._name)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """``POST /embeddings`` with the client's body (``model`` replaced); the answer is relayed as it came."""
        body = {**request.body, "model": request.model}
        response = await self._open(
            request, orjson.dumps(body), accept="application/json", url=self._base_url + "/embeddings"
        )
        parsed = await self._read_json(request, response)
        if not isinstance(parsed, dict) or not isinstance(parsed.get("data"), list):
            raise ProviderError("upstream answer is not an embeddings list", provider=self._name)
        usage = parsed.get("usage")
        prompt = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        if not isinstance(prompt, int) or prompt < 0:
            raise ProviderError("upstream answer reports no usage", provider=self._name)
        return EmbeddingResponse(parsed, Usage(prompt, 0, estimated=False), request.model, self._name)

    @asynccontextmanager
    async def stream(self, request: ChatRequest) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        body = dict(request.body)
        body["model"] = request.model
        body["stream"] = True
        client_wants_usage = request.include_usage
        if self._config.request_stream_usage and not client_wants_usage:
            options = body.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, Mapping) else {}), "include_usage": True}
        response = await self._open(request, orjson.dumps(body), accept="text/event-stream")
        state = _StreamState()
        events = self._events(request, response, client_wants_usage, state)
        try:
            yield events
        finally:
            await events.aclose()
            if state.finished:
                await response.finish()  # the body's end is read, so the connection serves the next call
            else:
                response.close()  # drop the connection: the upstream sees the disconnect and stops generating

    # --- streaming -----------------------------------------------------------------------------------------

    async def _events(
        self,
        request: ChatRequest,
        response: UpstreamResponse,
        client_wants_usage: bool,
        state: _StreamState,
    ) -> AsyncGenerator[StreamEvent, None]:
        decoder = SSEDecoder()
        usage: Usage | None = None
        finish_reason: str | None = None
        completion: list[str] = []
        done = False
        while not done:
            try:
                self._remaining(request)
                data = await response.read_some()  # within the deadline the response was opened with
            except TimeoutError as e:
                self._breaker.record_failure()
                error = self._timeout_error(request, "streaming")
                if isinstance(error, ProviderTimeout):
                    raise error from e
                raise ProviderStreamInterrupted("upstream went silent mid-stream", provider=self._name) from e
            except TransportError as e:
                self._breaker.record_failure()
                raise ProviderStreamInterrupted("upstream connection broke mid-stream", provider=self._name) from e
            payloads = decoder.feed(data) if data else decoder.flush()
            ready: list[bytes] = []  # this piece's chunks, yielded together (the last one not marked more)
            try:
                for payload in payloads:
                    if payload == _DONE:
                        done = True
                        break
                    try:
                        chunk = orjson.loads(payload)
                    except orjson.JSONDecodeError as e:
                        raise ProviderStreamInterrupted("upstream sent a malformed chunk", provider=self._name) from e
                    if not isinstance(chunk, dict):
                        raise ProviderStreamInterrupted("upstream sent a malformed chunk", provider=self._name)
                    if "error" in chunk and not chunk.get("choices"):
                        raise ProviderStreamInterrupted("upstream reported an error mid-stream", provider=self._name)
                    choices = chunk.get("choices")
                    if isinstance(choices, list):
                        for choice in choices:
                            if isinstance(choice, dict):
                                finish_reason = choice.get("finish_reason") or finish_reason
                                _collect_delta(choice.get("delta"), completion)
                    reported = _reported_usage(chunk.get("usage"))
                    if reported is not None:
                        usage = reported
                        if not client_wants_usage:
                            if not choices:
                                continue  # the usage-only chunk the client did not ask for
                            del chunk["usage"]
                            payload = orjson.dumps(chunk)
                    ready.append(payload)
            except ProviderStreamInterrupted:
                for ok in piece_chunks(ready, more_after=True):  # what came before the broken event still goes out
                    yield ok
                raise
            for ok in piece_chunks(ready, more_after=done):
                yield ok
            if not data and not done:
                if finish_reason is None:
                    raise ProviderStreamInterrupted("upstream closed the stream early", provider=self._name)
                done = True  # some servers omit [DONE] after the final chunk
        state.finished = True
        if usage is None:
            usage = self._estimate_usage(request, "".join(completion))
        yield StreamDone(usage, finish_reason, request.model, self._name)


class _StreamState:
    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = False


def _reported_usage(value: object) -> Usage | None:
    if not isinstance(value, Mapping):
        return None
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int) and prompt >= 0 and completion >= 0:
        return Usage(prompt, completion, estimated=False)
    return None


def _collect_delta(delta: object, into: list[str]) -> None:
    if not isinstance(delta, Mapping):
        return
    content = delta.get("content")
    if isinstance(content, str):
        into.append(content)
    tool_calls = delta.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping):
                for key in ("name", "arguments"):
                    piece = function.get(key)
                    if isinstance(piece, str):
                        into.append(piece)


def streamed_text(payloads: Iterable[bytes]) -> str:
    """The completion text (content and tool-call pieces) carried by ``chat.completion.chunk`` payloads; chunks
    that are not JSON objects are skipped. What the proxy estimates a partial stream's tokens from."""
    parts: list[str] = []
    for payload in payloads:
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, Mapping):
                    _collect_delta(choice.get("delta"), parts)
    return "".join(parts)


def _completion_text(choices: list[Any]) -> str:
    parts: list[str] = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, Mapping) else None
        if isinstance(message, Mapping):
            _collect_delta(message, parts)
    return "".join(parts)
