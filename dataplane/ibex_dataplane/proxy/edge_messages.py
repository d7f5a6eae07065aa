"""``POST /v1/messages``: the Anthropic Messages wire format at the edge of the one generation pipeline.

The client's Messages body becomes a Chat Completions body (``system`` first as a system message, content blocks
as content parts, ``tool_use`` blocks as ``tool_calls``, ``tool_result`` blocks as ``tool`` messages, images as
``image_url`` parts with data URLs), and the ``chat.completion`` that comes back is rendered as a Messages
``message`` (stop reasons mapped back, usage as ``input_tokens`` / ``output_tokens`` with cache reads). A stream
becomes the Messages event sequence: ``message_start``, ``content_block_start`` / ``content_block_delta`` /
``content_block_stop`` per text or tool block, ``message_delta`` with the stop reason and usage, ``message_stop``.
A failure after the first byte is an ``error`` event carrying the gateway's envelope fields.
"""

from __future__ import annotations

import uuid
from collections.abc import Coroutine, Mapping
from typing import Any
from uuid import UUID

import orjson

from ibex_dataplane.providers.base import Usage
from ibex_dataplane.proxy.edge import RenderContext, StreamEncoder, sse
from ibex_dataplane.proxy.validation import validate_chat_body
from ibex_dataplane.shared.errors import ApiError

FieldErrors = list[dict[str, str]]

_STOP_TO_ANTHROPIC = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


def _fail(errors: FieldErrors) -> ApiError:
    return ApiError(400, "VALIDATION_ERROR", "the request body is invalid", field_errors=errors)


def _text_of(blocks: Any, where: str, errors: FieldErrors) -> str:
    """A string, or the joined text of a list of ``text`` blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        errors.append({"field": where, "message": "must be a string or a list of text blocks"})
        return ""
    parts: list[str] = []
    for i, block in enumerate(blocks):
        if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            errors.append({"field": f"{where}[{i}]", "message": "must be a text block"})
            continue
        parts.append(block["text"])
    return "\n\n".join(parts)


def _image_part(block: Mapping[str, Any], where: str, errors: FieldErrors) -> dict[str, Any] | None:
    source = block.get("source")
    if isinstance(source, Mapping) and source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    elif isinstance(source, Mapping) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    errors.append({"field": f"{where}.source", "message": "must be a base64 or url image source"})
    return None


def _user_turn(content: Any, where: str, errors: FieldErrors) -> list[dict[str, Any]]:
    """A user turn: ``tool`` messages for its tool results, then one user message for the rest."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            part = _image_part(block, at, errors)
            if part is not None:
                parts.append(part)
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                errors.append({"field": f"{at}.tool_use_id", "message": "must be a non-empty string"})
                continue
            result = block.get("content", "")
            text = _text_of(result, f"{at}.content", errors) if result != "" else ""
            if block.get("is_error") is True:
                text = f"[tool error] {text}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            errors.append({"field": at, "message": "must be a text, image or tool_result block"})
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_turn(content: Any, where: str, errors: FieldErrors) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            name, call_id = block.get("name"), block.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                errors.append({"field": at, "message": "a tool_use block needs a string id and name"})
                continue
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # reasoning the client echoes back: nothing an OpenAI-shaped upstream can take
        else:
            errors.append({"field": at, "message": "must be a text or tool_use block"})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif not texts:
        message["content"] = ""
    return message


def messages_to_chat(body: Any) -> dict[str, Any]:
    """The Chat Completions body for an Anthropic Messages body; 400 ``VALIDATION_ERROR`` for bad input."""
    if not isinstance(body, dict):
        raise _fail([{"field": "body", "message": "must be a JSON object"}])
    errors: FieldErrors = []
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        errors.append({"field": "max_tokens", "message": "is required: an integer of at least 1"})
    messages: list[dict[str, Any]] = []
    if "system" in body and body["system"] is not None:
        system = _text_of(body["system"], "system", errors)
        if system:
            messages.append({"role": "system", "content": system})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        errors.append({"field": "messages", "message": "must be a non-empty list"})
        raw = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            errors.append({"field": where, "message": "must be an object"})
            continue
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str) and not (
            isinstance(content, list) and content and all(isinstance(b, Mapping) for b in content)
        ):
            errors.append({"field": f"{where}.content", "message": "must be a string or a non-empty list of blocks"})
            continue
        if role == "user":
            messages.extend(_user_turn(content, f"{where}.content", errors))
        elif role == "assistant":
            messages.append(_assistant_turn(content, f"{where}.content", errors))
        else:
            errors.append({"field": f"{where}.role", "message": "must be user or assistant"})
    chat: dict[str, Any] = {"messages": messages}
    if isinstance(body.get("model"), str):
        chat["model"] = body["model"]
    if isinstance(max_tokens, int):
        chat["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):
        if name in body:
            chat[name] = body[name]
    if "stop_sequences" in body:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            errors.append({"field": "stop_sequences", "message": "must be a list of strings"})
        elif stops:
            chat["stop"] = stops
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            errors.append({"field": "tools", "message": "must be a list"})
        else:
            converted = []
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
                    errors.append({"field": f"tools[{i}].name", "message": "must be a string"})
                    continue
                function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
                if isinstance(tool.get("description"), str):
                    function["description"] = tool["description"]
                converted.append({"type": "function", "function": function})
            if converted:
                chat["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if isinstance(kind, str) and kind in _TOOL_CHOICE:
            chat["tool_choice"] = _TOOL_CHOICE[kind]
        elif kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            errors.append({"field": "tool_choice.type", "message": "must be auto, any, tool or none"})
        if choice.get("disable_parallel_tool_use") is True and "tools" in chat:
            chat["parallel_tool_calls"] = False
    elif choice is not None:
        errors.append({"field": "tool_choice", "message": "must be an object"})
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    if errors:
        raise _fail(errors)
    return validate_chat_body(chat)


def _usage(usage: Usage, completion: Mapping[str, Any] | None = None) -> dict[str, int]:
    details = (completion or {}).get("usage")
    cached = 0
    if isinstance(details, Mapping):
        prompt_details = details.get("prompt_tokens_details")
        if isinstance(prompt_details, Mapping) and isinstance(prompt_details.get("cached_tokens"), int):
            cached = prompt_details["cached_tokens"]
    return {
        "input_tokens": max(0, usage.prompt_tokens - cached),
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _arguments(raw: Any) -> Any:
    try:
        parsed = orjson.loads(raw) if isinstance(raw, str) and raw else {}
    except orjson.JSONDecodeError:
        return {"_raw": raw}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def chat_to_message(completion: Mapping[str, Any], usage: Usage, ctx: RenderContext) -> dict[str, Any]:
    """The Messages ``message`` for a ``chat.completion``."""
    choices = completion.get("choices")
    choice: Mapping[str, Any] = (
        choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else {}
    )
    found = choice.get("message")
    message: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            call_id = str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}")
            name, arguments = str(function.get("name", "")), _arguments(function.get("arguments"))
            content.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
    finish = choice.get("finish_reason")
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": content,
        "stop_reason": _STOP_TO_ANTHROPIC.get(str(finish), "end_turn"),
        "stop_sequence": None,
        "usage": _usage(usage, completion),
    }


class MessagesEncoder:
    """Chat chunks in, Anthropic Messages stream events out."""

    def __init__(self, ctx: RenderContext) -> None:
        self._ctx = ctx
        self._started = False
        self._block: int = -1  # index of the open block, -1 for none
        self._kind = ""  # "text" or "tool_use"
        self._tools: dict[int, int] = {}  # chat tool-call index -> block index
        self._finish: str | None = None

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        return sse(orjson.dumps({"type": kind, **payload}), kind)

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": self._ctx.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self._ctx.prompt_tokens, "output_tokens": 0},
        }  # fmt: skip
        return [self._event("message_start", {"message": message})]

    def _close(self) -> list[bytes]:
        if self._block < 0 or not self._kind:
            return []
        self._kind = ""
        return [self._event("content_block_stop", {"index": self._block})]

    def _open(self, block: dict[str, Any], kind: str) -> list[bytes]:
        frames = self._close()
        self._block += 1
        self._kind = kind
        frames.append(self._event("content_block_start", {"index": self._block, "content_block": block}))
        return frames

    def chunk(self, data: bytes) -> list[bytes]:
        frames = self._start()
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return frames
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, Mapping):
                continue
            self._finish = choice.get("finish_reason") or self._finish
            delta = choice.get("delta")
            if not isinstance(delta, Mapping):
                continue
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._kind != "text":
                    frames += self._open({"type": "text", "text": ""}, "text")
                delta_event = {"index": self._block, "delta": {"type": "text_delta", "text": text}}
                frames.append(self._event("content_block_delta", delta_event))
            for call in delta.get("tool_calls") or []:
                if not isinstance(call, Mapping):
                    continue
                index = call.get("index", 0)
                found = call.get("function")
                function: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
                if index not in self._tools:
                    block = {"type": "tool_use", "id": str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
                             "name": str(function.get("name") or ""), "input": {}}  # fmt: skip
                    frames += self._open(block, "tool_use")
                    self._tools[index] = self._block
                arguments = function.get("arguments")
                if isinstance(arguments, str) and arguments:
                    frames.append(self._event("content_block_delta", {"index": self._tools[index],
                        "delta": {"type": "input_json_delta", "partial_json": arguments}}))  # fmt: skip
        return frames

    def finish(self, usage: Usage | None, finish_reason: str | None) -> list[bytes]:
        frames = self._start() + self._close()
        reason = _STOP_TO_ANTHROPIC.get(str(finish_reason or self._finish), "end_turn")
        counted = _usage(usage) if usage is not None else {"output_tokens": 0}
        frames.append(self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": None},
                                                    "usage": counted}))  # fmt: skip
        frames.append(self._event("message_stop", {}))
        return frames

    def error(self, code: str, message: str, request_id: str) -> list[bytes]:
        error = {"type": "api_error", "code": code, "message": message, "request_id": request_id}
        return [*self._start(), self._event("error", {"error": error})]

    def final(self) -> dict[str, Any] | None:
        return None


class MessagesEdge:
    route = "messages"

    def to_chat(self, body: Any) -> dict[str, Any]:
        return messages_to_chat(body)

    def render(self, completion: dict[str, Any], usage: Usage, ctx: RenderContext) -> dict[str, Any]:
        return chat_to_message(completion, usage, ctx)

    def encoder(self, ctx: RenderContext) -> StreamEncoder:
        return MessagesEncoder(ctx)

    def served(self, org_id: UUID, agent_id: UUID, answer: dict[str, Any]) -> Coroutine[Any, Any, None] | None:
        return None


MESSAGES_EDGE = MessagesEdge()
