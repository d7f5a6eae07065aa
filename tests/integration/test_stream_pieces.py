"""Stream events the upstream sent together go out together: the provider marks them (``StreamChunk.more``) and the
relay writes such a run in one write, the first event of a stream at once and alone, and never holds an event back
while the upstream is silent.

The upstream is a raw asyncio server writing an SSE answer in pieces the test chooses, each piece in one write,
and waiting for the test between pieces, so what arrives together is exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import orjson
import pytest
import pytest_asyncio
from aiohttp import ClientSession
from pydantic import SecretStr

from ibex_dataplane.providers.base import ChatRequest, StreamChunk, StreamDone
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.errors import ProviderStreamInterrupted
from ibex_dataplane.providers.openai_compat import OpenAICompatConfig, OpenAICompatProvider
from ibex_dataplane.providers.transport import UpstreamClient
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import TenantFactory

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
DONE = b"data: [DONE]\n\n"


def event(text: str, finish: str | None = None) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


@dataclass
class Pieces:
    """What the upstream writes for the next request: each piece in one write; before each piece but the first it
    waits for the matching event in ``go``."""

    pieces: list[bytes] = field(default_factory=list)
    go: list[asyncio.Event] = field(default_factory=list)
    url: str = ""

    def script(self, *pieces: bytes) -> list[asyncio.Event]:
        self.pieces = list(pieces)
        self.go = [asyncio.Event() for _ in pieces[1:]]
        return self.go


@asynccontextmanager
async def upstream() -> AsyncIterator[Pieces]:
    state = Pieces()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))  # fmt: skip
            await reader.readexactly(length)
            for i, piece in enumerate(state.pieces):
                if i:
                    await state.go[i - 1].wait()
                writer.write(piece)
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    async with server:
        yield state
        server.close()


def provider(url: str, client: UpstreamClient) -> OpenAICompatProvider:
    config = OpenAICompatConfig(base_url=url, api_key=SecretStr("sk-test"), max_attempts=1, read_timeout=10.0)
    return OpenAICompatProvider("raw", config, client, catalog=ModelCatalog.builtin())


def chat() -> ChatRequest:
    return ChatRequest(body={"messages": [{"role": "user", "content": "hi"}], "stream": True}, model="gpt-4o-mini",
                       deadline=time.monotonic() + 10, request_id="req-1")  # fmt: skip


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    upstreams = UpstreamClient()
    yield upstreams
    await upstreams.close()


async def test_chunks_the_upstream_sent_together_are_marked_and_a_chunk_before_a_wait_is_not(
    client: UpstreamClient,
) -> None:
    async with upstream() as up:
        (go,) = up.script(HEAD + event("a"), event("b") + event("c") + event("", "stop") + DONE)
        marks: list[tuple[bytes, bool]] = []
        async with provider(up.url, client).stream(chat()) as events:
            async for e in events:
                if isinstance(e, StreamChunk):
                    marks.append((orjson.loads(e.data)["choices"][0]["delta"]["content"], e.more))
                    go.set()  # the rest comes only once the first chunk is out
                else:
                    assert isinstance(e, StreamDone) and e.finish_reason == "stop"
    # "a" came alone and the upstream then waited; "b", "c" and the last came together, followed by [DONE].
    assert marks == [("a", False), ("b", True), ("c", True), ("", True)]


async def test_the_chunks_before_a_broken_event_of_the_same_piece_are_still_yielded(client: UpstreamClient) -> None:
    async with upstream() as up:
        up.script(HEAD + event("a") + event("b") + b"data: {broken\n\n")
        received: list[bytes] = []

        async def read() -> None:
            async with provider(up.url, client).stream(chat()) as events:
                async for e in events:
                    if isinstance(e, StreamChunk):
                        received.append(orjson.loads(e.data)["choices"][0]["delta"]["content"])

        with pytest.raises(ProviderStreamInterrupted, match="malformed"):
            await read()
        assert received == ["a", "b"]


@pytest_asyncio.fixture(scope="module")
async def raw_upstream() -> AsyncIterator[Pieces]:
    async with upstream() as up:
        yield up


@pytest_asyncio.fixture(scope="module")
async def gateway(
    settings: Settings, stores: Stores, pepper: bytes, raw_upstream: Pieces
) -> AsyncIterator[RunningProxy]:
    config = {
        "models": [
            {"name": "raw-model", "provider": "raw", "context_window": 8192, "max_output_tokens": 1024,
             "input_price_per_mtok": "1", "output_price_per_mtok": "2"}
        ],
        "providers": {"raw": {"type": "openai_compat", "base_url": raw_upstream.url, "api_key": "sk-test",
                              "max_attempts": 1}},
    }  # fmt: skip
    async with running_proxy(settings, stores, pepper, provider_config=config) as proxy:
        yield proxy


async def test_the_relay_holds_no_event_while_the_upstream_is_silent_and_the_stream_adds_up(
    gateway: RunningProxy, raw_upstream: Pieces, tenants: TenantFactory
) -> None:
    """The upstream sends "a" alone, then "b" and "c" together and goes silent until the client has both: a relay
    that held "c" for the next piece would never let it continue (the wait below would time out)."""
    tenant = await tenants.create()
    go_bc, go_end = raw_upstream.script(HEAD + event("a"), event("b") + event("c"), event("", "stop") + DONE)
    headers = {"Authorization": f"Bearer {tenant.keys['alpha']}", "X-IBEX-Agent-ID": str(tenant.agents["alpha"])}
    body = {"model": "raw-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    received = b""
    async with ClientSession() as http, http.post(gateway.v1 + "/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"

        async def until(text: bytes) -> None:
            nonlocal received
            while text not in received:
                received += await r.content.readany()

        await asyncio.wait_for(until(b'"content":"a"'), 10)
        go_bc.set()
        await asyncio.wait_for(until(b'"content":"c"'), 10)  # both, with the upstream silent
        assert b'"content":"b"' in received
        go_end.set()
        received += await asyncio.wait_for(r.content.read(), 10)
    events = [line[6:] for line in received.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    contents = [orjson.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert [c for c in contents if c] == ["a", "b", "c"]
