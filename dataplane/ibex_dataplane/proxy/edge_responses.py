"""``POST /v1/responses``: the OpenAI Responses API at the edge of the one generation pipeline.

The request becomes a Chat Completions body, so every provider serves it (none needs the Responses API itself):

- ``instructions`` -> a leading system message; ``input`` as a string -> one user message; as items: messages
  (``input_text`` / ``output_text`` / ``input_image`` parts), ``function_call`` items -> assistant ``tool_calls``
  (consecutive calls share one assistant message), ``function_call_output`` items -> ``tool`` messages;
  ``reasoning`` items are dropped (no chat upstream can take them back).
- ``tools`` of type ``function`` -> chat tools (other built-in tool types are refused with 400: this gateway does
  not run them); ``tool_choice``, ``parallel_tool_calls``, ``temperature``, ``top_p``, ``user`` map directly;
  ``max_output_tokens`` -> ``max_completion_tokens``; ``text.format`` -> ``response_format``;
  ``reasoning.effort`` -> ``reasoning_effort``.
- ``previous_response_id`` and ``conversation`` are refused with 400: send the conversation as input items.

The ``chat.completion`` comes back as a ``response`` object (a ``message`` output item with ``output_text``,
one ``function_call`` item per tool call, usage as ``input_tokens`` / ``output_tokens``), ``status``
``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` when the answer was cut. Streams emit the
standard events in order: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` / ``.done``, ``response.content_part.done`` or
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``, then
``response.completed`` (or ``response.incomplete``); a failure after the first byte is an ``error`` event. With
``store`` (the default, as in OpenAI's API) the final response is kept for ``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import secrets
from collections.abc import Coroutine, Mapping
from typing import Any
from uuid import UUID

import orjson

from ibex_dataplane.providers.base import Usage
from ibex_dataplane.proxy.edge import RenderContext, StreamEncoder, sse
from ibex_dataplane.proxy.response_store import ResponseStore
from ibex_dataplane.proxy.validation import validate_chat_body
from ibex_dataplane.shared.errors import ApiError

FieldErrors = list[dict[str, str]]
_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_UNSUPPORTED = ("previous_response_id", "conversation", "background", "prompt")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _fail(errors: FieldErrors) -> ApiError:
    return ApiError(400, "VALIDATION_ERROR", "the request body is invalid", field_errors=errors)


def _parts(content: Any, where: str, role: str, errors: FieldErrors) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        errors.append({"field": where, "message": "must be a string or a non-empty list of content parts"})
        return ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            errors.append({"field": at, "message": "must be an input_text, output_text or input_image (URL) part"})
    if role != "user":  # only user turns may carry images; the others are text
        return "".join(p.get("text", "") for p in parts)
    return parts


def _input_messages(items: Any, errors: FieldErrors) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        errors.append({"field": "input", "message": "must be a string or a non-empty list of items"})
        return []
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            errors.append({"field": where, "message": "must be an object"})
            continue
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _MESSAGE_ROLES:
                errors.append({"field": f"{where}.role", "message": "must be user, assistant, system or developer"})
                continue
            messages.append({"role": role, "content": _parts(item.get("content"), f"{where}.content", role, errors)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
                errors.append({"field": where, "message": "a function_call needs string call_id, name and arguments"})
                continue
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and isinstance(last.get("content"), str | None):
                last.setdefault("tool_calls", []).append(call)
                if last.get("content") == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                errors.append({"field": f"{where}.call_id", "message": "must be a string"})
                continue
            text = output if isinstance(output, str) else _parts(output, f"{where}.output", "tool", errors)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            errors.append({"field": f"{where}.type", "message": f"item type '{kind}' is not supported here"})
    return messages


def _tools(tools: Any, errors: FieldErrors) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        errors.append({"field": "tools", "message": "must be a list"})
        return []
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            errors.append({"field": f"tools[{i}]", "message": "only function tools are supported by this gateway"})
            continue
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        converted.append({"type": "function", "function": function})
    return converted


def responses_to_chat(body: Any) -> dict[str, Any]:
    """The Chat Completions body for a Responses API body; 400 ``VALIDATION_ERROR`` for bad input."""
    if not isinstance(body, dict):
        raise _fail([{"field": "body", "message": "must be a JSON object"}])
    errors: FieldErrors = []
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False):
            errors.append(
                {"field": name, "message": "is not supported by this gateway: send the conversation as input"}
            )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            errors.append({"field": "instructions", "message": "must be a string"})
        elif instructions:
            messages.append({"role": "system", "content": instructions})
    messages += _input_messages(body.get("input"), errors)
    chat: dict[str, Any] = {"messages": messages}
    if isinstance(body.get("model"), str):
        chat["model"] = body["model"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            errors.append({"field": "max_output_tokens", "message": "must be an integer of at least 1"})
        else:
            chat["max_completion_tokens"] = limit
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"], errors)
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        chat["tool_choice"] = choice
    elif isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        errors.append({"field": "tool_choice", "message": "must be auto, none, required or a function choice"})
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, Mapping) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    if body.get("store") is not None and not isinstance(body.get("store"), bool):
        errors.append({"field": "store", "message": "must be a boolean"})
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    if errors:
        raise _fail(errors)
    return validate_chat_body(chat)


# -- answers ---------------------------------------------------------------------------------------------------


def _usage(usage: Usage | None, cached: int = 0) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }  # fmt: skip


def _cached(completion: Mapping[str, Any]) -> int:
    usage = completion.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return cached if isinstance(cached, int) else 0


def response_shell(ctx: RenderContext, response_id: str, status: str) -> dict[str, Any]:
    """A ``response`` object with the request's settings echoed and no output yet."""
    body = ctx.client_body if isinstance(ctx.client_body, Mapping) else {}
    return {
        "id": response_id, "object": "response", "created_at": ctx.created, "status": status, "error": None,
        "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": ctx.model, "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": body.get("store", True) is not False,
        "temperature": body.get("temperature", 1.0), "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": None, "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }  # fmt: skip


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def _finish(response: dict[str, Any], finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    elif finish_reason == "content_filter":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "content_filter"}
    else:
        response["status"] = "completed"


def chat_to_response(completion: Mapping[str, Any], usage: Usage, ctx: RenderContext) -> dict[str, Any]:
    """The ``response`` object for a ``chat.completion``."""
    response = response_shell(ctx, _new_id("resp"), "completed")
    choices = completion.get("choices")
    choice: Mapping[str, Any] = choices[0] if isinstance(choices, list) and choices else {}
    found = choice.get("message")
    message: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    text = message.get("content")
    if isinstance(text, str) and text:
        response["output"].append(_message_item(_new_id("msg"), text))
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            response["output"].append(
                _call_item(_new_id("fc"), str(call.get("id") or _new_id("call")), str(function.get("name", "")),
                           str(function.get("arguments") or ""))
            )  # fmt: skip
    _finish(response, choice.get("finish_reason"))
    response["usage"] = _usage(usage, _cached(completion))
    return response


class ResponsesEncoder:
    """Chat chunks in, Responses API stream events out; keeps the final response for the store."""

    def __init__(self, ctx: RenderContext) -> None:
        self._ctx = ctx
        self._response = response_shell(ctx, _new_id("resp"), "in_progress")
        self._sequence = 0
        self._started = False
        self._text: dict[str, Any] | None = None  # the open message item: {"index", "id", "text"}
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> {"index", "id", "call_id", ...}
        self._output: list[dict[str, Any] | None] = []  # finished items by output index
        self._finish_reason: str | None = None
        self._final: dict[str, Any] | None = None

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return sse(orjson.dumps(data), kind)

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [self._event("response.created", {"response": self._response}),
                self._event("response.in_progress", {"response": self._response})]  # fmt: skip

    def _close_text(self) -> list[bytes]:
        item = self._text
        if item is None:
            return []
        self._text = None
        index, item_id, text = item["index"], item["id"], item["text"]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        done = _message_item(item_id, text)
        self._output[index] = done
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**where, "part": part}),
            self._event("response.output_item.done", {"output_index": index, "item": done}),
        ]

    def _close_calls(self) -> list[bytes]:
        frames = []
        for call in self._calls.values():
            if call.get("done"):
                continue
            call["done"] = True
            done = _call_item(call["id"], call["call_id"], call["name"], call["arguments"])
            self._output[call["index"]] = done
            frames.append(self._event("response.function_call_arguments.done", {
                "item_id": call["id"], "output_index": call["index"], "name": call["name"],
                "arguments": call["arguments"]}))  # fmt: skip
            frames.append(self._event("response.output_item.done", {"output_index": call["index"], "item": done}))
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
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
            delta = choice.get("delta")
            if not isinstance(delta, Mapping):
                continue
            text = delta.get("content")
            if isinstance(text, str) and text:
                frames += self._text_delta(text)
            for call in delta.get("tool_calls") or []:
                if isinstance(call, Mapping):
                    frames += self._call_delta(call)
        return frames

    def _text_delta(self, text: str) -> list[bytes]:
        frames: list[bytes] = []
        if self._text is None:
            index = len(self._output)
            self._output.append(None)
            item_id = _new_id("msg")
            self._text = {"index": index, "id": item_id, "text": ""}
            added = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            frames.append(self._event("response.output_item.added", {"output_index": index, "item": added}))
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            frames.append(self._event("response.content_part.added", {**where, "part": part}))
        self._text["text"] += text
        frames.append(self._event("response.output_text.delta", {
            "item_id": self._text["id"], "output_index": self._text["index"], "content_index": 0, "delta": text,
            "logprobs": []}))  # fmt: skip
        return frames

    def _call_delta(self, call: Mapping[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        key = call.get("index", 0)
        found = call.get("function")
        function: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        state = self._calls.get(key if isinstance(key, int) else 0)
        if state is None:
            frames += self._close_text()
            index = len(self._output)
            self._output.append(None)
            state = {"index": index, "id": _new_id("fc"), "call_id": str(call.get("id") or _new_id("call")),
                     "name": str(function.get("name") or ""), "arguments": ""}  # fmt: skip
            self._calls[key if isinstance(key, int) else 0] = state
            added = _call_item(state["id"], state["call_id"], state["name"], "", "in_progress")
            frames.append(self._event("response.output_item.added", {"output_index": index, "item": added}))
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            state["arguments"] += arguments
            where = {"item_id": state["id"], "output_index": state["index"]}
            frames.append(self._event("response.function_call_arguments.delta", {**where, "delta": arguments}))
        return frames

    def finish(self, usage: Usage | None, finish_reason: str | None) -> list[bytes]:
        frames = self._start() + self._close_text() + self._close_calls()
        response = {**self._response, "output": [item for item in self._output if item is not None]}
        _finish(response, finish_reason or self._finish_reason)
        response["usage"] = _usage(usage)
        self._final = response
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        frames.append(self._event(kind, {"response": response}))
        return frames

    def error(self, code: str, message: str, request_id: str) -> list[bytes]:
        envelope = {"code": code, "message": message, "request_id": request_id}
        return [*self._start(), self._event("error", {"code": code, "message": message, "param": None,
                                                      "error": envelope})]  # fmt: skip

    def final(self) -> dict[str, Any] | None:
        return self._final


class ResponsesEdge:
    route = "responses"

    def __init__(self, store: ResponseStore) -> None:
        self._store = store

    def to_chat(self, body: Any) -> dict[str, Any]:
        return responses_to_chat(body)

    def render(self, completion: dict[str, Any], usage: Usage, ctx: RenderContext) -> dict[str, Any]:
        return chat_to_response(completion, usage, ctx)

    def encoder(self, ctx: RenderContext) -> StreamEncoder:
        return ResponsesEncoder(ctx)

    def served(self, org_id: UUID, agent_id: UUID, answer: dict[str, Any]) -> Coroutine[Any, Any, None] | None:
        if answer.get("store") is False:
            return None
        return self._store.save(org_id, agent_id, answer)
