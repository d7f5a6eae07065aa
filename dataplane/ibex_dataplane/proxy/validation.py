"""Validation of OpenAI Chat Completions bodies: precise ``field_errors``, unknown fields passed through.

Hand-written rather than a schema library: it sits on the hot path, and its messages name the exact field
(``messages[2].content[0].text``). Only what the gateway relies on or what an upstream would reject anyway is
checked; anything else the client sends travels on untouched to OpenAI-compatible upstreams.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ibex_dataplane.shared.errors import ApiError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
PART_TYPES = frozenset({"text", "image_url", "input_audio", "file", "refusal"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
MAX_MESSAGES = 4096
MAX_OUTPUT_TOKENS = 1_000_000

FieldErrors = list[dict[str, str]]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number_in(errors: FieldErrors, body: Mapping[str, Any], name: str, lo: float, hi: float) -> None:
    if name in body and body[name] is not None:
        v = body[name]
        if not _is_number(v) or not lo <= v <= hi:
            errors.append({"field": name, "message": f"must be a number between {lo:g} and {hi:g}"})


def _int_in(errors: FieldErrors, body: Mapping[str, Any], name: str, lo: int, hi: int) -> None:
    if name in body and body[name] is not None:
        v = body[name]
        if not _is_int(v) or not lo <= v <= hi:
            errors.append({"field": name, "message": f"must be an integer between {lo} and {hi}"})


def _content(errors: FieldErrors, where: str, content: object, role: str, message: Mapping[str, Any]) -> None:
    if isinstance(content, str):
        return
    if content is None:
        if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
            return
        errors.append({"field": where, "message": "is required"})
        return
    if not isinstance(content, list):
        errors.append({"field": where, "message": "must be a string or a list of content parts"})
        return
    if not content:
        errors.append({"field": where, "message": "must not be an empty list"})
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            errors.append({"field": at, "message": "must be an object"})
            continue
        kind = part.get("type")
        if kind not in PART_TYPES:
            errors.append({"field": f"{at}.type", "message": f"must be one of {', '.join(sorted(PART_TYPES))}"})
        elif kind == "text" and not isinstance(part.get("text"), str):
            errors.append({"field": f"{at}.text", "message": "must be a string"})
        elif kind == "image_url":
            image = part.get("image_url")
            if not isinstance(image, Mapping) or not isinstance(image.get("url"), str):
                errors.append({"field": f"{at}.image_url.url", "message": "must be a string"})


def _tool_calls(errors: FieldErrors, where: str, calls: object) -> None:
    if not isinstance(calls, list):
        errors.append({"field": where, "message": "must be a list"})
        return
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(call, Mapping) or not isinstance(call.get("id"), str):
            errors.append({"field": f"{at}.id", "message": "must be a string"})
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            errors.append({"field": f"{at}.function.name", "message": "must be a string"})
        elif not isinstance(fn.get("arguments", ""), str):
            errors.append({"field": f"{at}.function.arguments", "message": "must be a string (JSON text)"})


def _messages(errors: FieldErrors, messages: object) -> None:
    if not isinstance(messages, list):
        errors.append({"field": "messages", "message": "is required and must be a list"})
        return
    if not messages:
        errors.append({"field": "messages", "message": "must contain at least one message"})
    if len(messages) > MAX_MESSAGES:
        errors.append({"field": "messages", "message": f"must contain at most {MAX_MESSAGES} messages"})
        return
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, Mapping):
            errors.append({"field": at, "message": "must be an object"})
            continue
        role = message.get("role")
        if role not in ROLES:
            errors.append({"field": f"{at}.role", "message": f"must be one of {', '.join(sorted(ROLES))}"})
            continue
        _content(errors, f"{at}.content", message.get("content"), role, message)
        if "name" in message and not isinstance(message["name"], str):
            errors.append({"field": f"{at}.name", "message": "must be a string"})
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            errors.append({"field": f"{at}.tool_call_id", "message": "is required for tool messages"})
        if role == "assistant" and message.get("tool_calls") is not None:
            _tool_calls(errors, f"{at}.tool_calls", message["tool_calls"])


def _tools(errors: FieldErrors, tools: object) -> None:
    if not isinstance(tools, list):
        errors.append({"field": "tools", "message": "must be a list"})
        return
    if len(tools) > 128:
        errors.append({"field": "tools", "message": "must contain at most 128 tools"})
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            errors.append({"field": f"{at}.type", "message": "must be 'function'"})
            continue
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            errors.append({"field": f"{at}.function", "message": "must be an object"})
            continue
        if not isinstance(fn.get("name"), str) or not _TOOL_NAME.fullmatch(fn["name"]):
            errors.append({"field": f"{at}.function.name", "message": "must match ^[A-Za-z0-9_-]{1,64}$"})
        if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
            errors.append({"field": f"{at}.function.parameters", "message": "must be a JSON Schema object"})
        if "description" in fn and not isinstance(fn["description"], str):
            errors.append({"field": f"{at}.function.description", "message": "must be a string"})


def chat_field_errors(body: object) -> FieldErrors:
    """All problems of a Chat Completions body; empty when it is acceptable."""
    if not isinstance(body, Mapping):
        return [{"field": "(body)", "message": "must be a JSON object"}]
    errors: FieldErrors = []
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not 0 < len(model) <= 256):
        errors.append({"field": "model", "message": "must be a non-empty string"})
    _messages(errors, body.get("messages"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        errors.append({"field": "stream", "message": "must be a boolean"})
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, Mapping):
            errors.append({"field": "stream_options", "message": "must be an object"})
        elif stream is not True:
            errors.append({"field": "stream_options", "message": "is only allowed when stream is true"})
        elif "include_usage" in options and not isinstance(options["include_usage"], bool):
            errors.append({"field": "stream_options.include_usage", "message": "must be a boolean"})
    _int_in(errors, body, "max_tokens", 1, MAX_OUTPUT_TOKENS)
    _int_in(errors, body, "max_completion_tokens", 1, MAX_OUTPUT_TOKENS)
    _int_in(errors, body, "n", 1, 1)
    _int_in(errors, body, "top_logprobs", 0, 20)
    _number_in(errors, body, "temperature", 0, 2)
    _number_in(errors, body, "top_p", 0, 1)
    _number_in(errors, body, "presence_penalty", -2, 2)
    _number_in(errors, body, "frequency_penalty", -2, 2)
    stop = body.get("stop")
    bad_stop = not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop)
    if stop is not None and not isinstance(stop, str) and bad_stop:
        errors.append({"field": "stop", "message": "must be a string or a list of at most 4 strings"})
    if body.get("tools") is not None:
        _tools(errors, body["tools"])
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not isinstance(choice, Mapping):
        errors.append({"field": "tool_choice", "message": "must be 'none', 'auto', 'required' or an object"})
    fmt = body.get("response_format")
    if fmt is not None and (
        not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "json_object", "json_schema")
    ):
        errors.append({"field": "response_format.type", "message": "must be text, json_object or json_schema"})
    for name in ("user",):
        if name in body and body[name] is not None and not isinstance(body[name], str):
            errors.append({"field": name, "message": "must be a string"})
    return errors


def validate_chat_body(body: object) -> dict[str, Any]:
    errors = chat_field_errors(body)
    if errors:
        raise ApiError(400, "VALIDATION_ERROR", "the request body is invalid", field_errors=errors)
    assert isinstance(body, dict)
    return body
