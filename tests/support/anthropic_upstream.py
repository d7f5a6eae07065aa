"""A local upstream speaking Anthropic's Messages wire format (JSON and SSE), for tests.

An aiohttp server on 127.0.0.1 (free port) that answers ``POST /v1/messages`` the way Anthropic's API does: it
checks ``x-api-key`` and ``anthropic-version``, refuses bodies the real API refuses (no ``max_tokens``, a role
other than user/assistant, turns that do not alternate, a first turn that is not the user's, a ``tool_result``
without its ``tool_use``) with Anthropic's error shape, and streams the real event sequence (``message_start``,
``ping``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). With tools and
no tool result yet it calls the first tool; after a tool result it answers with what the tool said. It can be
scripted to fail N times with a status (429 with ``retry-after``, 529 overloaded, 500), hang before answering or
go silent mid-stream; it records the bodies it received and whether the client went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

API_KEY = "sk-ant-test-key"
PIECES = ["Hel", "lo ", "from ", "Claude"]
USAGE = {"input_tokens": 21, "output_tokens": 5, "cache_creation_input_tokens": 3, "cache_read_input_tokens": 7}
TOOL_INPUT = {"city": "Paris"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error",
                500: "api_error", 529: "overloaded_error"}  # fmt: skip


@dataclass
class AnthropicScript:
    fail_first: int = 0
    fail_status: int = 529
    retry_after: str | None = None
    hang: bool = False
    silent_after_events: int | None = None


@dataclass
class AnthropicUpstream:
    url: str
    script: AnthropicScript = field(default_factory=AnthropicScript)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Mapping[str, str]] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)  # the client address of each request: a reused connection repeats
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    def reset(self, script: AnthropicScript | None = None) -> None:
        self.script = script or AnthropicScript()
        self.bodies.clear()
        self.headers.clear()
        self.peers.clear()
        self.disconnected = asyncio.Event()


UPSTREAM = web.AppKey("anthropic_upstream", AnthropicUpstream)


def error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    body = {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}
    return web.json_response(body, status=status, headers=headers)


def refusal(body: Any) -> str | None:
    """What the real API would refuse in this body, or None."""
    if not isinstance(body, dict) or not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "max_tokens: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    tool_ids: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        if i == 0 and role != "user":
            return 'messages: first message must use the "user" role'
        if i > 0 and messages[i - 1]["role"] == role:
            return 'messages: roles must alternate between "user" and "assistant"'
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if block.get("type") == "tool_use":
                tool_ids.add(block["id"])
            if block.get("type") == "tool_result" and block.get("tool_use_id") not in tool_ids:
                return f"messages.{i}: tool_result block(s) provided without a matching tool_use"
            if block.get("type") not in ("text", "image", "tool_use", "tool_result"):
                return f"messages.{i}.content: unknown block type"
    return None


def answer_blocks(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    last = body["messages"][-1]["content"]
    results = [b for b in last if isinstance(b, dict) and b.get("type") == "tool_result"] if isinstance(
        last, list) else []  # fmt: skip
    if results:
        said = results[0].get("content")
        text = said if isinstance(said, str) else "".join(b.get("text", "") for b in said or [])
        return [{"type": "text", "text": f"The tool said: {text}"}], "end_turn"
    if body.get("tools"):
        tool = body["tools"][0]["name"]
        return [{"type": "tool_use", "id": "toolu_01A", "name": tool, "input": TOOL_INPUT}], "tool_use"
    return [{"type": "text", "text": "".join(PIECES)}], "end_turn"


async def messages(request: web.Request) -> web.StreamResponse:
    upstream = request.app[UPSTREAM]
    script = upstream.script
    body = await request.json()
    upstream.bodies.append(body)
    upstream.headers.append(dict(request.headers))
    upstream.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
    if request.headers.get("x-api-key") != API_KEY:
        return error(401, "invalid x-api-key")
    if not request.headers.get("anthropic-version"):
        return error(400, "anthropic-version: header is required")
    if len(upstream.bodies) <= script.fail_first:
        headers = {"retry-after": script.retry_after} if script.retry_after is not None else None
        return error(script.fail_status, f"failure {script.fail_status}", headers)
    reason = refusal(body)
    if reason is not None:
        return error(400, reason)
    if script.hang:
        try:
            await asyncio.sleep(3600)
        finally:
            upstream.disconnected.set()
    blocks, stop_reason = answer_blocks(body)
    if not body.get("stream"):
        return web.json_response({
            "id": "msg_01up", "type": "message", "role": "assistant", "model": body["model"], "content": blocks,
            "stop_reason": stop_reason, "stop_sequence": None, "usage": USAGE,
        })  # fmt: skip
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"message": {"id": "msg_01up", "type": "message", "role": "assistant",
                                       "model": body["model"], "content": [], "stop_reason": None,
                                       "stop_sequence": None, "usage": {**USAGE, "output_tokens": 1}}}),
        ("ping", {}),
    ]  # fmt: skip
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            events.append(("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}}))
            pieces = PIECES if block["text"] == "".join(PIECES) else [block["text"]]
            events += [("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": p}})
                       for p in pieces]  # fmt: skip
        else:
            start = {**block, "input": {}}
            events.append(("content_block_start", {"index": index, "content_block": start}))
            raw = orjson.dumps(block["input"]).decode()
            for part in (raw[: len(raw) // 2], raw[len(raw) // 2 :]):
                piece = {"type": "input_json_delta", "partial_json": part}
                events.append(("content_block_delta", {"index": index, "delta": piece}))
        events.append(("content_block_stop", {"index": index}))
    events.append(("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                     "usage": {"output_tokens": USAGE["output_tokens"]}}))  # fmt: skip
    events.append(("message_stop", {}))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        for index, (kind, data) in enumerate(events):
            if script.silent_after_events is not None and index == script.silent_after_events:
                await asyncio.sleep(3600)
            raw = b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"
            await response.write(raw[:9])  # split so the client must reassemble SSE lines
            await response.write(raw[9:])
    except (ConnectionResetError, asyncio.CancelledError):
        upstream.disconnected.set()
        raise
    finally:
        if script.silent_after_events is not None:
            upstream.disconnected.set()
    return response


@asynccontextmanager
async def running_anthropic_upstream() -> AsyncIterator[AnthropicUpstream]:
    state = AnthropicUpstream(url="")
    app = web.Application()
    app[UPSTREAM] = state
    app.router.add_post("/v1/messages", messages)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    state.url = f"http://{host}:{port}/v1"
    try:
        yield state
    finally:
        await runner.cleanup()
