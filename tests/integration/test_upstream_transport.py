"""The providers' HTTP/1.1 client against raw upstreams on 127.0.0.1 that write their answers byte by byte.

Each upstream here is an ``asyncio`` server whose answers the test writes itself, so every framing the client must
read (``Content-Length``, ``chunked`` with extensions and trailers, the end of the connection, gzip), every way an
upstream can misbehave (silence, closing early, a malformed answer) and keep-alive reuse are exercised exactly.
"""

from __future__ import annotations

import asyncio
import gzip
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvloop

from ibex_dataplane.providers.errors import TransportError
from ibex_dataplane.providers.transport import UpstreamClient
from tests.support.tls import self_signed_certificate

JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Upstream"], Awaitable[None]]


@dataclass
class Upstream:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)  # head and body of each request, as received
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)
    received: asyncio.Event = field(default_factory=asyncio.Event)  # a request came in


async def read_request(reader: asyncio.StreamReader, upstream: Upstream) -> bool:
    """Read one request (head and Content-Length body); False when the client closed the connection instead."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    upstream.requests.append(head + await reader.readexactly(length))
    upstream.received.set()
    return True


@asynccontextmanager
async def serving(answer: Answer, *, tls: ssl.SSLContext | None = None) -> AsyncIterator[Upstream]:
    """An upstream answering every request of a connection with ``answer`` until the client closes it."""
    upstream = Upstream(url="")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream.connections += 1
        try:
            while await read_request(reader, upstream):
                await answer(reader, writer, upstream)
                if writer.is_closing():
                    return
            upstream.closed_by_client.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            upstream.closed_by_client.set()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    upstream.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1/chat/completions"
    async with server:
        yield upstream
        server.close()


def fixed(raw: bytes) -> Answer:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.write(raw)
        await writer.drain()

    return answer


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    upstreams = UpstreamClient()
    yield upstreams
    await upstreams.close()


async def post(client: UpstreamClient, url: str, **timeouts: float) -> tuple[int, dict[str, str], bytes]:
    response = await client.post(url, b'{"model": "m"}', JSON_HEADERS, **timeouts)
    try:
        return response.status, response.headers, await response.read()
    finally:
        response.release()


async def test_a_request_goes_out_as_http_1_1_with_host_length_and_the_callers_headers(client: UpstreamClient) -> None:
    async with serving(fixed(OK)) as upstream:
        status, headers, body = await post(client, upstream.url)
    assert (status, headers["content-type"], body) == (200, "application/json", b'{"ok": true}')
    head, _, sent = upstream.requests[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    port = upstream.url.split(":")[2].split("/")[0]
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    assert f"Host: 127.0.0.1:{port}" in lines
    assert "Content-Length: 14" in lines and "Accept: application/json" in lines
    assert sent == b'{"model": "m"}'


async def test_consecutive_calls_reuse_one_keep_alive_connection(client: UpstreamClient) -> None:
    async with serving(fixed(OK)) as upstream:
        for _ in range(5):
            assert (await post(client, upstream.url))[2] == b'{"ok": true}'
    assert (upstream.connections, len(upstream.requests)) == (1, 5)


async def test_connection_close_from_the_upstream_opens_a_new_connection_next_time(client: UpstreamClient) -> None:
    raw = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi"
    async with serving(fixed(raw)) as upstream:
        for _ in range(3):
            assert (await post(client, upstream.url))[2] == b"hi"
    assert upstream.connections == 3


async def test_a_chunked_body_is_decoded_with_extensions_and_trailers(client: UpstreamClient) -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )
    async with serving(fixed(raw)) as upstream:
        for _ in range(2):  # the connection is reusable after the trailers
            assert (await post(client, upstream.url))[2] == b"hello world!"
    assert upstream.connections == 1


async def test_a_stream_is_read_piece_by_piece_as_the_upstream_sends_it(client: UpstreamClient) -> None:
    go_on = asyncio.Event()

    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"d\r\ndata: first\n\n\r\n")
        await writer.drain()
        await go_on.wait()  # the second event only once the client has read the first
        writer.write(b"e\r\ndata: second\n\n\r\n0\r\n\r\n")
        await writer.drain()

    async with serving(answer) as upstream:
        response = await client.post(upstream.url, b"{}", JSON_HEADERS)
        first = await response.read_some()
        go_on.set()
        rest = await response.read()
        response.release()
    assert (first, rest) == (b"data: first\n\n", b"data: second\n\n")


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
LAST_EVENT = b"e\r\ndata: [DONE]\n\n\r\n"


async def read_last_event_then_finish(client: UpstreamClient, url: str, **bounds: float) -> None:
    """What a provider does with a stream: read up to its last event, then finish the response."""
    response = await client.post(url, b"{}", JSON_HEADERS)
    assert await response.read_some() == b"data: [DONE]\n\n"
    await response.finish(**bounds)  # type: ignore[arg-type]


async def test_finishing_a_stream_after_its_last_event_keeps_the_connection(client: UpstreamClient) -> None:
    event_read = asyncio.Event()

    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.write(STREAM_HEAD + LAST_EVENT)
        await writer.drain()
        await event_read.wait()  # the body's end comes in a packet of its own, once the client has read the event
        event_read.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with serving(answer) as upstream:
        for _ in range(3):
            response = await client.post(upstream.url, b"{}", JSON_HEADERS)
            assert await response.read_some() == b"data: [DONE]\n\n"
            event_read.set()
            await response.finish(timeout=10)
    assert (upstream.connections, len(upstream.requests)) == (1, 3)


@pytest.mark.parametrize(
    ("after_last_event", "bounds"),
    [
        (b"", {"timeout": 0.2}),  # the body never ends: closed once the wait is over
        (b"4000\r\n" + b"x" * 0x4000 + b"\r\n0\r\n\r\n", {"limit": 1024}),  # more than the limit follows
        (b"zz\r\n", {}),  # a malformed chunk
    ],
    ids=["silent", "over-the-limit", "malformed"],
)
async def test_a_stream_whose_body_does_not_end_well_after_its_last_event_is_closed(
    client: UpstreamClient, after_last_event: bytes, bounds: dict[str, float]
) -> None:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.write(STREAM_HEAD + LAST_EVENT + after_last_event)
        await writer.drain()

    async with serving(answer) as upstream:
        await read_last_event_then_finish(client, upstream.url, **bounds)
        await asyncio.wait_for(upstream.closed_by_client.wait(), 10)
        await read_last_event_then_finish(client, upstream.url, timeout=0.2)
    assert upstream.connections == 2


async def test_finishing_a_body_framed_by_the_end_of_the_connection_does_not_wait_for_it(
    client: UpstreamClient,
) -> None:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: [DONE]\n\n")
        await writer.drain()
        await asyncio.sleep(3600)  # never closes on its own

    async with serving(answer) as upstream:
        for _ in range(2):
            response = await client.post(upstream.url, b"{}", JSON_HEADERS)
            assert await response.read_some() == b"data: [DONE]\n\n"
            await asyncio.wait_for(response.finish(timeout=30), 5)  # closed at once, not after 30 s
    assert upstream.connections == 2


async def test_cancelling_a_finish_closes_the_connection(client: UpstreamClient) -> None:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.write(STREAM_HEAD + LAST_EVENT)
        await writer.drain()

    async with serving(answer) as upstream:
        response = await client.post(upstream.url, b"{}", JSON_HEADERS)
        assert await response.read_some() == b"data: [DONE]\n\n"
        finishing = asyncio.create_task(response.finish(timeout=30))
        await asyncio.sleep(0)  # it starts waiting for the body's end
        finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing
        await asyncio.wait_for(upstream.closed_by_client.wait(), 10)


async def test_a_gzip_body_is_decompressed(client: UpstreamClient) -> None:
    packed = gzip.compress(b'{"data": [' + b"0.125, " * 500 + b"1]}")
    raw = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed) + packed
    async with serving(fixed(raw)) as upstream:
        body = (await post(client, upstream.url))[2]
    assert body == b'{"data": [' + b"0.125, " * 500 + b"1]}"
    assert b"Accept-Encoding: gzip, deflate" in upstream.requests[0]


async def test_a_body_without_length_ends_with_the_connection(client: UpstreamClient) -> None:
    raw = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + b"x" * 100_000

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: Upstream) -> None:
        await fixed(raw)(reader, writer, upstream)
        writer.close()

    async with serving(answer) as upstream:
        assert (await post(client, upstream.url))[2] == b"x" * 100_000
        assert (await post(client, upstream.url))[2] == b"x" * 100_000
    assert upstream.connections == 2


async def test_interim_100_continue_is_skipped(client: UpstreamClient) -> None:
    async with serving(fixed(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)) as upstream:
        status, _, body = await post(client, upstream.url)
    assert (status, body) == (200, b'{"ok": true}')


async def test_error_statuses_and_repeated_headers_reach_the_caller(client: UpstreamClient) -> None:
    raw = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nX-Seen: a\r\nx-seen: b\r\nContent-Length: 4\r\n\r\nslow"
    async with serving(fixed(raw)) as upstream:
        status, headers, body = await post(client, upstream.url)
    assert (status, headers["retry-after"], headers["x-seen"], body) == (429, "2", "a, b", b"slow")


async def test_a_response_closed_before_its_end_closes_the_connection(client: UpstreamClient) -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234"  # the rest never comes

    async with serving(fixed(raw)) as upstream:
        response = await client.post(upstream.url, b"{}", JSON_HEADERS)
        assert await response.read_some() == b"01234"
        response.close()
        await asyncio.wait_for(upstream.closed_by_client.wait(), 10)
        response = await client.post(upstream.url, b"{}", JSON_HEADERS)  # a fresh connection
        response.close()
    assert upstream.connections == 2


async def test_a_released_response_that_was_not_read_to_its_end_is_not_reused(client: UpstreamClient) -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"y" * 100_000
    async with serving(fixed(raw)) as upstream:
        response = await client.post(upstream.url, b"{}", JSON_HEADERS)
        response.release()  # unread: the leftover bytes must not be taken for the next answer
        assert len((await post(client, upstream.url))[2]) == 100_000
    assert upstream.connections == 2


async def test_an_upstream_that_closes_without_answering_is_a_transport_error(client: UpstreamClient) -> None:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.close()

    async with serving(answer) as upstream:
        with pytest.raises(TransportError, match="closed the connection"):
            await post(client, upstream.url)


async def test_a_body_cut_short_is_a_transport_error(client: UpstreamClient) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: Upstream) -> None:
        await fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{partial")(reader, writer, upstream)
        writer.close()

    async with serving(answer) as upstream:
        with pytest.raises(TransportError):
            await post(client, upstream.url)


@pytest.mark.parametrize(
    "raw",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: zstd\r\nContent-Length: 1\r\n\r\nx",
    ],
)
async def test_a_malformed_answer_is_a_transport_error(client: UpstreamClient, raw: bytes) -> None:
    async with serving(fixed(raw)) as upstream:
        with pytest.raises(TransportError):
            await post(client, upstream.url)


async def test_refused_connections_are_transport_errors(client: UpstreamClient) -> None:
    async with serving(fixed(OK)) as upstream:
        url = upstream.url
    with pytest.raises(TransportError, match="cannot reach"):
        await post(client, url)


async def test_a_silent_upstream_times_out_after_the_read_timeout(client: UpstreamClient) -> None:
    async def answer(reader: asyncio.StreamReader, _: asyncio.StreamWriter, __: Upstream) -> None:
        await reader.read()  # never answers

    async with serving(answer) as upstream:
        with pytest.raises(TimeoutError):
            await post(client, upstream.url, read_timeout=0.2)
        await asyncio.wait_for(upstream.closed_by_client.wait(), 10)  # the client hung up


async def test_a_deadline_nearer_than_the_read_timeout_ends_the_wait_for_the_answer(client: UpstreamClient) -> None:
    async def answer(reader: asyncio.StreamReader, _: asyncio.StreamWriter, __: Upstream) -> None:
        await reader.read()  # never answers

    async with serving(answer) as upstream:
        call = post(client, upstream.url, read_timeout=600, deadline=time.monotonic() + 0.2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call, 30)  # the read timeout alone would wait ten minutes
        await asyncio.wait_for(upstream.closed_by_client.wait(), 10)


async def test_a_deadline_ends_the_wait_for_the_rest_of_a_body(client: UpstreamClient) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, __: Upstream) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial"')
        await writer.drain()
        await reader.read()  # the other 90 bytes never come

    async with serving(answer) as upstream:
        response = await client.post(upstream.url, b"{}", JSON_HEADERS, read_timeout=600,
                                     deadline=time.monotonic() + 0.2)  # fmt: skip
        assert response.status == 200
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(response.read(), 30)
        response.close()
        await asyncio.wait_for(upstream.closed_by_client.wait(), 10)


async def test_a_deadline_ends_the_wait_for_a_pooled_connection_and_frees_nothing_it_did_not_take() -> None:
    client = UpstreamClient(limit=1)
    async with serving(fixed(OK)) as upstream:
        first = await client.post(upstream.url, b"{}", JSON_HEADERS)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(post(client, upstream.url, deadline=time.monotonic() + 0.2), 30)
        assert await first.read() == b'{"ok": true}'
        first.release()
        # The call that gave up held no slot: the one connection serves the next call, and no second one opened.
        assert (await asyncio.wait_for(post(client, upstream.url), 10))[0] == 200
    await client.close()
    assert (upstream.connections, len(upstream.requests)) == (1, 2)


async def test_a_deadline_already_past_sends_nothing(client: UpstreamClient) -> None:
    async with serving(fixed(OK)) as upstream:
        assert (await post(client, upstream.url))[0] == 200  # leaves a pooled connection a call could reuse
        with pytest.raises(TimeoutError):
            await post(client, upstream.url, deadline=time.monotonic() - 1)
        assert (await post(client, upstream.url))[0] == 200  # the slot it did not keep serves the next call
    assert (upstream.connections, len(upstream.requests)) == (1, 2)


async def test_a_redirect_reaches_the_caller_unfollowed(client: UpstreamClient) -> None:
    moved = b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/elsewhere\r\nContent-Length: 0\r\n\r\n"
    async with serving(fixed(moved)) as upstream:
        status, headers, body = await post(client, upstream.url)
    assert (status, headers["location"], body) == (302, "http://127.0.0.1:9/elsewhere", b"")
    assert len(upstream.requests) == 1


async def test_proxy_variables_of_the_environment_are_ignored(
    client: UpstreamClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy named in the environment (here one that refuses every connection) is not used: calls go straight
    to the upstream."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    async with serving(fixed(OK)) as upstream:
        assert await post(client, upstream.url) == (
            200,
            {"content-type": "application/json", "content-length": "12"},
            b'{"ok": true}',
        )
    assert len(upstream.requests) == 1


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent(client: UpstreamClient) -> None:
    async with serving(fixed(OK)) as upstream:
        with pytest.raises(ValueError, match="line break"):
            await client.post(upstream.url, b"{}", {"X-Request-ID": "abc\r\nX-Injected: 1"})
        assert (await post(client, upstream.url))[0] == 200
    assert len(upstream.requests) == 1 and b"X-Injected" not in upstream.requests[0]


async def test_the_pool_limit_makes_a_call_wait_for_a_connection() -> None:
    client = UpstreamClient(limit=1)
    async with serving(fixed(OK)) as upstream:
        first = await client.post(upstream.url, b"{}", JSON_HEADERS)
        second = asyncio.ensure_future(post(client, upstream.url))
        assert await first.read() == b'{"ok": true}'
        first.release()
        assert (await asyncio.wait_for(second, 10))[0] == 200
    await client.close()
    # Without the cap the second call would have opened a connection of its own while the first was in use.
    assert (upstream.connections, len(upstream.requests)) == (1, 2)


async def test_cancelling_a_call_waiting_for_its_answer_closes_the_connection(client: UpstreamClient) -> None:
    async def answer(reader: asyncio.StreamReader, _: asyncio.StreamWriter, __: Upstream) -> None:
        await reader.read()

    async with serving(answer) as upstream:
        call = asyncio.ensure_future(post(client, upstream.url))
        await asyncio.wait_for(upstream.received.wait(), 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(upstream.closed_by_client.wait(), 10)


async def test_https_upstreams_are_reached_over_verified_tls(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    async with serving(fixed(OK), tls=server_tls) as upstream:
        trusting = UpstreamClient(ssl_context=ssl.create_default_context(cafile=str(cert)))
        for _ in range(2):
            assert (await post(trusting, upstream.url))[2] == b'{"ok": true}'
        await trusting.close()
        assert upstream.connections == 1
        strict = UpstreamClient()  # the system's CAs do not know this certificate
        with pytest.raises(TransportError, match="TLS"):
            await post(strict, upstream.url)
        await strict.close()


def test_the_client_runs_on_uvloop_as_in_the_serving_processes() -> None:
    async def scenario() -> tuple[int, bytes, int]:
        client = UpstreamClient()
        async with serving(fixed(OK)) as upstream:
            first = await post(client, upstream.url)
            second = await post(client, upstream.url)
        await client.close()
        assert first == second
        return first[0], first[2], upstream.connections

    assert uvloop.run(scenario()) == (200, b'{"ok": true}', 1)
