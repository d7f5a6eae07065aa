"""A local upstream speaking the OpenAI Chat Completions wire format (JSON and SSE), for tests and benchmarks.

An aiohttp server on 127.0.0.1 (free port) that answers like OpenAI does, and can be scripted to fail with a
status N times, hang, answer slowly (a delay before the first byte, a pause between stream chunks), go silent
mid-stream, drop the connection mid-stream, or omit usage. With tools and no tool result yet it calls the first
tool (as a model would); after a tool result it answers with what the tool said. It records what it received and
whether the client went away.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

API_KEY = "sk-upstream-test-key"
PIECES = ["Hel", "lo", ", wor", "ld!"]
UPSTREAM_USAGE = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
TOOL_ARGUMENTS = '{"city": "Paris"}'
TOOL_CALL_ID = "call_up1"


def tool_turn(body: Mapping[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(text answering a tool result, or a tool call to make) for a body with tools; (None, None) without."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    if last.get("role") == "tool":
        return f"The tool said: {last.get('content')}", None
    if body.get("tools"):
        name = body["tools"][0]["function"]["name"]
        return None, {"id": TOOL_CALL_ID, "type": "function", "function": {"name": name, "arguments": TOOL_ARGUMENTS}}
    return None, None


@dataclass
class Script:
    """What the fake upstream does with the next requests."""

    fail_first: int = 0
    fail_status: int = 500
    fail_body: dict[str, Any] | None = None
    retry_after: str | None = None
    hang: bool = False
    silent_after_chunks: int | None = None
    drop_after_chunks: int | None = None
    endless: bool = False
    omit_usage: bool = False
    delay: float = 0.0  # seconds before the first byte of every answer
    chunk_interval: float = 0.0  # seconds between stream events
    answers: list[str] = field(default_factory=list)  # contents of the next JSON answers, in order (then the default)
    set_cookie: str | None = None  # a Set-Cookie header on every JSON answer (a provider behind a sticky balancer)
    stream_pieces: list[str] | None = None  # the content events of a streamed answer (default: PIECES)


@dataclass
class Upstream:
    url: str
    script: Script = field(default_factory=Script)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Mapping[str, str]] = field(default_factory=list)
    peers: list[Any] = field(default_factory=list)  # the client address of each request: a reused connection repeats
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    def reset(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.bodies.clear()
        self.headers.clear()
        self.peers.clear()
        self.disconnected = asyncio.Event()


UPSTREAM = web.AppKey("upstream", Upstream)


def chunk(body: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-up",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": body["model"],
        "system_fingerprint": "fp_test",
        **fields,
    }


def choice(delta: dict[str, Any], finish_reason: str | None = None) -> list[dict[str, Any]]:
    return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    upstream = request.app[UPSTREAM]
    script = upstream.script
    body = await request.json()
    upstream.bodies.append(body)
    upstream.headers.append(dict(request.headers))
    upstream.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
    if request.headers.get("Authorization") != f"Bearer {API_KEY}":
        return web.json_response({"error": {"message": "bad key", "type": "auth"}}, status=401)
    if len(upstream.bodies) <= script.fail_first:
        headers = {"Retry-After": script.retry_after} if script.retry_after is not None else None
        error = script.fail_body or {"error": {"message": f"failure {script.fail_status}", "type": "server_error"}}
        return web.json_response(error, status=script.fail_status, headers=headers)
    if script.hang:
        try:
            await asyncio.sleep(3600)
        finally:
            upstream.disconnected.set()
    if script.delay:
        await asyncio.sleep(script.delay)
    said, call = tool_turn(body)
    if not body.get("stream") and (said is not None or call is not None):
        message = {"role": "assistant", "content": said, **({"tool_calls": [call]} if call else {})}
        finish = "tool_calls" if call else "stop"
        return web.json_response({
            "id": "chatcmpl-up", "object": "chat.completion", "created": 1700000000, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": UPSTREAM_USAGE,
        })  # fmt: skip
    if not body.get("stream"):
        answer: dict[str, Any] = {
            "id": "chatcmpl-up",
            "object": "chat.completion",
            "created": 1700000000,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": script.answers.pop(0) if script.answers else "".join(PIECES),
                    },
                    "finish_reason": "stop",
                }
            ],
            "upstream_extra": {"kept": True},
        }
        if not script.omit_usage:
            answer["usage"] = UPSTREAM_USAGE
        cookie = {"Set-Cookie": script.set_cookie} if script.set_cookie else None
        return web.json_response(answer, headers=cookie)

    include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and not script.omit_usage
    extra = {"usage": None} if include_usage else {}
    events = [chunk(body, choices=choice({"role": "assistant", "content": ""}), **extra)]
    if call is not None:
        opening = {**call, "index": 0, "function": {"name": call["function"]["name"], "arguments": ""}}
        events.append(chunk(body, choices=choice({"tool_calls": [opening]}), **extra))
        for part in (TOOL_ARGUMENTS[:7], TOOL_ARGUMENTS[7:]):
            events.append(chunk(body, choices=choice({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}),
                                **extra))  # fmt: skip
        events.append(chunk(body, choices=choice({}, "tool_calls"), **extra))
    else:
        pieces = [said] if said is not None else script.stream_pieces or PIECES
        events += [chunk(body, choices=choice({"content": piece}), **extra) for piece in pieces]
        events.append(chunk(body, choices=choice({}, "stop"), **extra))
    if include_usage:
        events.append(chunk(body, choices=[], usage=UPSTREAM_USAGE))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        for index, event in enumerate(events):
            if script.drop_after_chunks is not None and index == script.drop_after_chunks:
                assert request.transport is not None
                request.transport.close()
                return response
            if script.silent_after_chunks is not None and index == script.silent_after_chunks:
                await asyncio.sleep(3600)
            # split each event in two writes so the client must reassemble SSE lines
            raw = b"data: " + orjson.dumps(event) + b"\n\n"
            await response.write(raw[:7])
            await response.write(raw[7:])
            if script.chunk_interval:
                await asyncio.sleep(script.chunk_interval)
        while script.endless:
            await response.write(b"data: " + orjson.dumps(chunk(body, choices=choice({"content": "."}))) + b"\n\n")
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        upstream.disconnected.set()
        raise
    finally:
        if script.silent_after_chunks is not None or script.endless:
            upstream.disconnected.set()
    return response


EMBEDDING = [0.6, 0.8, 0.0]
EMBEDDING_TOKENS_PER_INPUT = 3


async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's ``/v1/embeddings``: one fixed unit vector per input (base64 when asked), 3 tokens per input."""
    upstream = request.app[UPSTREAM]
    script = upstream.script
    body = await request.json()
    upstream.bodies.append(body)
    upstream.headers.append(dict(request.headers))
    if request.headers.get("Authorization") != f"Bearer {API_KEY}":
        return web.json_response({"error": {"message": "bad key", "type": "auth"}}, status=401)
    if len(upstream.bodies) <= script.fail_first:
        headers = {"Retry-After": script.retry_after} if script.retry_after is not None else None
        error = script.fail_body or {"error": {"message": f"failure {script.fail_status}", "type": "server_error"}}
        return web.json_response(error, status=script.fail_status, headers=headers)
    if script.hang:
        try:
            await asyncio.sleep(3600)
        finally:
            upstream.disconnected.set()
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    if inputs and isinstance(inputs[0], int):
        inputs = [inputs]
    vector: Any = EMBEDDING
    if body.get("encoding_format") == "base64":
        vector = base64.b64encode(struct.pack("<3f", *EMBEDDING)).decode()
    tokens = EMBEDDING_TOKENS_PER_INPUT * len(inputs)
    return web.json_response({
        "object": "list", "model": body["model"],
        "data": [{"object": "embedding", "index": i, "embedding": vector} for i in range(len(inputs))],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })  # fmt: skip


async def set_script(request: web.Request) -> web.Response:
    """``POST /_script`` with Script fields as JSON: how a test drives the upstream when it runs as a process."""
    upstream = request.app[UPSTREAM]
    upstream.script = Script(**await request.json())
    upstream.bodies.clear()
    upstream.headers.clear()
    return web.json_response({"ok": True})


@asynccontextmanager
async def running_upstream() -> AsyncIterator[Upstream]:
    state = Upstream(url="")
    app = web.Application()
    app[UPSTREAM] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/_script", set_script)
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


async def _serve_forever() -> None:
    async with running_upstream() as state:
        print(f"upstream ready: {state.url}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":  # `python -m tests.support.upstream`: a standalone upstream (benchmarks, fault suite)
    import uvloop

    uvloop.run(_serve_forever())
