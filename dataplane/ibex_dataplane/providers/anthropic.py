"""Adapter for Anthropic's Messages API: OpenAI Chat Completions shapes in and out, the Messages wire between.

The registry builds an ``AnthropicProvider`` for a ``providers`` entry of ``"type": "anthropic"``; the proxy
reaches it through ``Provider.complete`` / ``Provider.stream`` like any other provider, with a Chat Completions
body. Translation, both ways:

- ``system`` and ``developer`` messages, wherever they are (the directive first, memory context last), are folded
  in order into the top-level ``system``; consecutive turns of one role are merged, since the API wants
  user and assistant to alternate; ``tool`` messages become ``tool_result`` blocks of a user turn.
- Assistant ``tool_calls`` become ``tool_use`` blocks (arguments parsed as JSON); ``image_url`` parts become
  ``image`` blocks (``data:`` URLs as base64 sources, other URLs as url sources); ``tools`` / ``tool_choice``,
  ``stop``, ``temperature``, ``top_p`` and ``user`` map to their Messages counterparts.
- ``max_tokens`` is required by the API: the request's ``max_tokens`` / ``max_completion_tokens``, else the
  catalog's max output of the model.
- Answers come back as a ``chat.completion``: text blocks joined into ``content``, ``tool_use`` blocks as
  ``tool_calls``; stop reasons ``end_turn`` / ``stop_sequence`` / ``pause_turn`` -> ``stop``, ``max_tokens`` ->
  ``length``, ``tool_use`` -> ``tool_calls``, ``refusal`` -> ``content_filter``. Usage: prompt tokens are input
  plus cache-creation plus cache-read tokens, with the cache reads as ``prompt_tokens_details.cached_tokens``.
- Streams: ``message_start``, ``content_block_*``, ``message_delta`` and ``message_stop`` events become
  ``chat.completion.chunk`` payloads (a role delta, content and tool-call deltas, the finish chunk, and the
  usage chunk when the client asked for it); ``ping`` is skipped; an ``error`` event or a stream that ends before
  ``message_stop`` is ``ProviderStreamInterrupted``.

Retries, the breaker and status mapping are :class:`~ibex_dataplane.providers.http.HttpProvider`'s (Anthropic's
overloaded 529 counts as unavailable; its error bodies ``{"type": "error", "error": {"type", "message"}}`` pass
through on 4xx).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson
from pydantic import Field

from ibex_dataplane.providers.base import (
    ChatRequest,
    ChatResponse,
    StreamChunk,
    StreamDone,
    StreamEvent,
    Usage,
    piece_chunks,
)
from ibex_dataplane.providers.breaker import CircuitBreaker
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.errors import ProviderError, ProviderStreamInterrupted, ProviderTimeout, TransportError
from ibex_dataplane.providers.http import HttpProvider, HttpProviderConfig
from ibex_dataplane.providers.sse import SSEDecoder
from ibex_dataplane.providers.transport import UpstreamClient, UpstreamResponse

__all__ = ["AnthropicConfig", "AnthropicProvider", "anthropic_to_chat", "chat_to_anthropic"]

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop", "max_tokens": "length",
           "tool_use": "tool_calls", "refusal": "content_filter"}  # fmt: skip
DEFAULT_MAX_TOKENS = 4096  # only for a model missing from the catalog


class AnthropicConfig(HttpProviderConfig):
    """Settings of one Anthropic Messages upstream (a ``providers`` entry with ``"type": "anthropic"``)."""

    base_url: str = Field(default="https://api.anthropic.com/v1", description="Prefix of /messages.")
    anthropic_version: str = Field(default="2023-06-01", description="The anthropic-version header.")


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


# -- request ---------------------------------------------------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def _image(url: str) -> dict[str, Any]:
    if url.startswith("data:") and ";base64," in url:
        media, _, data = url[5:].partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    blocks: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, Mapping):
            continue
        if part.get("type") == "text" and isinstance(part.get("text"), str) and part["text"]:
            blocks.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "image_url" and isinstance(part.get("image_url"), Mapping):
            url = part["image_url"].get("url")
            if isinstance(url, str):
                blocks.append(_image(url))
        elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
            blocks.append({"type": "text", "text": part["refusal"]})
    return blocks


def _input(arguments: Any) -> Any:
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def chat_to_anthropic(body: Mapping[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """The Messages request for a Chat Completions body (see the module docstring for the mapping)."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)  # keep user and assistant alternating
        else:
            turns.append({"role": role, "content": list(blocks)})

    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role in ("system", "developer"):
            text = _text(message.get("content"))
            if text:
                system.append(text)
        elif role == "user":
            add("user", _blocks(message.get("content")))
        elif role == "assistant":
            blocks = _blocks(message.get("content"))
            for call in message.get("tool_calls") or []:
                function = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(function, Mapping):
                    call_id = str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}")
                    name, arguments = str(function.get("name", "")), _input(function.get("arguments"))
                    blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
            add("assistant", blocks)
        elif role in ("tool", "function"):
            result = {"type": "tool_result", "tool_use_id": str(message.get("tool_call_id") or message.get("name", "")),
                      "content": _text(message.get("content"))}  # fmt: skip
            add("user", [result])
    request: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": turns}
    if system:
        request["system"] = "\n\n".join(system)
    for name in ("temperature", "top_p"):
        if isinstance(body.get(name), int | float) and not isinstance(body.get(name), bool):
            request[name] = body[name]
    stop = body.get("stop")
    if isinstance(stop, str):
        request["stop_sequences"] = [stop]
    elif isinstance(stop, list) and stop:
        request["stop_sequences"] = [s for s in stop if isinstance(s, str)]
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        converted = []
        for tool in tools:
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                entry: dict[str, Any] = {"name": function["name"],
                                         "input_schema": function.get("parameters") or {"type": "object"}}  # fmt: skip
                if isinstance(function.get("description"), str):
                    entry["description"] = function["description"]
                converted.append(entry)
        request["tools"] = converted
        choice = body.get("tool_choice")
        mapped: dict[str, Any] | None = None
        if choice == "auto" or choice is None:
            mapped = {"type": "auto"}
        elif choice == "required":
            mapped = {"type": "any"}
        elif choice == "none":
            mapped = {"type": "none"}
        elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
            mapped = {"type": "tool", "name": str(choice["function"].get("name", ""))}
        if mapped is not None:
            if body.get("parallel_tool_calls") is False and mapped["type"] != "none":
                mapped["disable_parallel_tool_use"] = True
            request["tool_choice"] = mapped
    if isinstance(body.get("user"), str):
        request["metadata"] = {"user_id": body["user"]}
    return request


# -- answers ---------------------------------------------------------------------------------------------------


def _usage(raw: Any) -> tuple[Usage | None, int]:
    """(usage, cache-read tokens) of a Messages ``usage`` object; prompt tokens include both cache counts."""
    if not isinstance(raw, Mapping):
        return None, 0
    numbers = {k: raw.get(k) for k in ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                                       "cache_read_input_tokens")}  # fmt: skip
    counts = {k: v if isinstance(v, int) and v >= 0 else 0 for k, v in numbers.items()}
    if not isinstance(numbers["input_tokens"], int) or not isinstance(numbers["output_tokens"], int):
        return None, counts["cache_read_input_tokens"]
    prompt = counts["input_tokens"] + counts["cache_creation_input_tokens"] + counts["cache_read_input_tokens"]
    return Usage(prompt, counts["output_tokens"], estimated=False), counts["cache_read_input_tokens"]


def _usage_body(usage: Usage, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def anthropic_to_chat(message: Mapping[str, Any], model: str) -> tuple[dict[str, Any], Usage | None]:
    """The ``chat.completion`` for a Messages ``message``, and its usage if the upstream reported it."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    content = message.get("content")
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, Mapping):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block.get("type") == "tool_use":
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": str(block.get("name", "")),
                                       "arguments": orjson.dumps(block.get("input") or {}).decode()}})  # fmt: skip
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None,
                             "refusal": None}  # fmt: skip
    if calls:
        reply["tool_calls"] = calls
    usage, cached = _usage(message.get("usage"))
    body: dict[str, Any] = {
        "id": f"chatcmpl-{message.get('id', uuid.uuid4().hex)}", "object": "chat.completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": reply, "logprobs": None,
                     "finish_reason": _FINISH.get(str(message.get("stop_reason")), "stop")}],
    }  # fmt: skip
    if usage is not None:
        body["usage"] = _usage_body(usage, cached)
    return body, usage


class AnthropicProvider(HttpProvider):
    """``Provider`` for Anthropic's Messages API, over a shared :class:`UpstreamClient` it does not own."""

    def __init__(
        self,
        name: str,
        config: AnthropicConfig,
        client: UpstreamClient,
        *,
        catalog: ModelCatalog | None = None,
        breaker: CircuitBreaker | None = None,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        auth = {"anthropic-version": config.anthropic_version}
        if config.api_key is not None:
            auth["x-api-key"] = config.api_key.get_secret_value()
        super().__init__(
            name, config, client, path="/messages", auth_headers=auth, catalog=catalog, breaker=breaker,
            jitter=jitter,
        )  # fmt: skip

    def _payload(self, request: ChatRequest, *, stream: bool) -> bytes:
        info = self._catalog.get(request.model) if self._catalog is not None else None
        max_tokens = request.max_completion_tokens or (info.max_output_tokens if info else DEFAULT_MAX_TOKENS)
        payload = chat_to_anthropic(request.body, request.model, max_tokens)
        if stream:
            payload["stream"] = True
        return orjson.dumps(payload)

    async def complete(self, request: ChatRequest) -> ChatResponse:
        response = await self._open(request, self._payload(request, stream=False), accept="application/json")
        parsed = await self._read_json(request, response)
        if not isinstance(parsed, dict) or parsed.get("type") != "message":
            raise ProviderError("upstream answer is not a Messages message", provider=self._name)
        body, usage = anthropic_to_chat(parsed, request.model)
        if usage is None:
            choice = body["choices"][0]["message"]
            usage = self._estimate_usage(request, (choice.get("content") or "") + orjson.dumps(
                choice.get("tool_calls") or []).decode())  # fmt: skip
            body["usage"] = _usage_body(usage, 0)
        return ChatResponse(body=body, usage=usage, model=request.model, provider=self._name)

    @asynccontextmanager
    async def stream(self, request: ChatRequest) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        response = await self._open(request, self._payload(request, stream=True), accept="text/event-stream")
        finished: list[bool] = []
        events = self._events(request, response, finished)
        try:
            yield events
        finally:
            await events.aclose()
            if finished:
                await response.finish()  # the body's end is read, so the connection serves the next call
            else:
                response.close()  # drop the connection: the upstream sees the disconnect and stops generating

    async def _events(
        self, request: ChatRequest, response: UpstreamResponse, finished: list[bool]
    ) -> AsyncGenerator[StreamEvent, None]:
        decoder = SSEDecoder()
        include_usage = request.include_usage
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tools: dict[int, int] = {}  # content block index -> tool call index
        text: list[str] = []
        start_usage: Mapping[str, Any] = {}
        delta_usage: Mapping[str, Any] = {}
        finish_reason: str | None = None
        done = False

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            out: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                   "model": request.model, "system_fingerprint": None, "choices": choices}  # fmt: skip
            if include_usage:
                out["usage"] = usage
            return orjson.dumps(out)

        def delta(d: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
            return [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]

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
            ready: list[bytes] = []  # this piece's chunks, yielded together (the last one not marked more)
            try:
                for payload in decoder.feed(data) if data else decoder.flush():
                    try:
                        event = orjson.loads(payload)
                    except orjson.JSONDecodeError as e:
                        raise ProviderStreamInterrupted("upstream sent a malformed event", provider=self._name) from e
                    kind = event.get("type") if isinstance(event, dict) else None
                    if kind == "message_start":
                        message = _obj(event.get("message"))
                        if message.get("id"):
                            completion_id = f"chatcmpl-{message['id']}"
                        start_usage = _obj(message.get("usage"))
                        ready.append(chunk(delta({"role": "assistant", "content": "", "refusal": None})))
                    elif kind == "content_block_start":
                        block = _obj(event.get("content_block"))
                        if block.get("type") == "tool_use":
                            tools[int(event.get("index", 0))] = len(tools)
                            function = {"name": str(block.get("name", "")), "arguments": ""}
                            call = {"index": len(tools) - 1, "id": str(block.get("id", "")), "type": "function",
                                    "function": function}  # fmt: skip
                            ready.append(chunk(delta({"tool_calls": [call]})))
                        elif block.get("type") == "text" and block.get("text"):
                            text.append(str(block["text"]))
                            ready.append(chunk(delta({"content": str(block["text"])})))
                    elif kind == "content_block_delta":
                        d = _obj(event.get("delta"))
                        if d.get("type") == "text_delta" and isinstance(d.get("text"), str):
                            text.append(d["text"])
                            ready.append(chunk(delta({"content": d["text"]})))
                        elif d.get("type") == "input_json_delta" and isinstance(d.get("partial_json"), str):
                            index = tools.get(int(event.get("index", 0)))
                            if index is not None and d["partial_json"]:
                                text.append(d["partial_json"])
                                piece = {"index": index, "function": {"arguments": d["partial_json"]}}
                                ready.append(chunk(delta({"tool_calls": [piece]})))
                    elif kind == "message_delta":
                        d = _obj(event.get("delta"))
                        finish_reason = _FINISH.get(str(d.get("stop_reason")), "stop")
                        delta_usage = _obj(event.get("usage"))
                        ready.append(chunk(delta({}, finish_reason)))
                    elif kind == "message_stop":
                        done = True
                        break
                    elif kind == "error":
                        raise ProviderStreamInterrupted("upstream reported an error mid-stream", provider=self._name)
                    # ping and content_block_stop carry nothing a chat stream needs
            except ProviderStreamInterrupted:
                for ok in piece_chunks(ready, more_after=True):  # the events before the broken one
                    yield ok
                raise
            for ok in piece_chunks(ready, more_after=done):
                yield ok
            if not data and not done:
                raise ProviderStreamInterrupted("upstream closed the stream early", provider=self._name)
        finished.append(True)
        usage, cached = _usage({**start_usage, **{k: v for k, v in delta_usage.items() if v is not None}})
        if usage is None:
            usage = self._estimate_usage(request, "".join(text))
        if include_usage:
            yield StreamChunk(chunk([], _usage_body(usage, cached)))
        yield StreamDone(usage, finish_reason, request.model, self._name)
