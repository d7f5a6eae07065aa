"""The HTTP/1.1 client the network providers reach their upstreams with: keep-alive connections on asyncio protocols.

One :class:`UpstreamClient` is shared by every provider of a process (the proxy's and the memory stage's registries
each own one). It does only what a model API call needs, and does it with little work per request, because the
proxy's throughput is bound by its one event-loop thread: a ``POST`` with a body built by the caller, keep-alive
connections pooled per origin (at most ``limit`` open to each, idle ones dropped after ``keepalive`` seconds), TLS
for ``https`` origins, and response bodies framed by ``Content-Length``, ``chunked`` or the end of the connection,
decoded from ``gzip``/``deflate`` when the upstream compressed them. No redirects, cookies or proxies (model APIs
use none; the aiohttp session this replaces had them off too).

Timeouts: ``connect_timeout`` bounds opening a connection and ``read_timeout`` any silence while an answer is
awaited or read; a ``deadline`` (a ``time.monotonic()`` instant) given to :meth:`UpstreamClient.post` bounds the
whole call as well: waiting for a pooled connection, connecting, and each wait for bytes of the answer (its head and
its body) end at it at the latest. Each raises ``TimeoutError``. The deadline costs no timer of its own: it shortens
the one each wait for bytes already sets, so a caller needs no ``asyncio.timeout`` around every call or read.
Everything else that goes wrong on the wire (refused, reset, closed before the answer ended, a malformed answer)
raises :class:`~ibex_dataplane.providers.errors.TransportError`.
A request is never sent twice here: a reused connection that the upstream closed before answering is an error like
any other, and the caller's retry policy decides (a ``POST`` is not idempotent).

A response must be ended with :meth:`UpstreamResponse.release` (its connection goes back to the pool if the body
was read to the end and the upstream keeps connections alive), :meth:`UpstreamResponse.finish` (the rest of the
body read first, within bounds: for a stream whose last event has come but not yet the body's end) or
:meth:`UpstreamResponse.close` (the connection is closed: the upstream sees the client go away). Cancelling a call
closes its connection.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import urlsplit

from ibex_dataplane.providers.errors import TransportError

__all__ = ["UpstreamClient", "UpstreamResponse"]

_MAX_HEAD: Final = 64 * 1024  # status line and headers of one answer
_HIGH_WATER: Final = 256 * 1024  # buffered, unread answer bytes before the socket stops being read
_OURS: Final = frozenset({"host", "content-length", "accept-encoding", "transfer-encoding", "connection"})
_HEX: Final = re.compile(rb"[0-9A-Fa-f]{1,16}")
_NO_BODY_STATUSES: Final = frozenset({204, 304})


@dataclass(frozen=True, slots=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class _Target:
    origin: _Origin
    path: str  # path and query, as sent on the request line


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(_Origin(parts.scheme, parts.hostname, port), path)


_FINISH_LIMIT = 64 * 1024  # bytes UpstreamResponse.finish reads past a stream's last event at most
_FINISH_TIMEOUT = 0.1  # seconds it waits for the body's end at most (the client's own stream has ended by then)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: bytes received wait in a buffer until the response that owns them reads them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False  # the upstream closed its side (or the connection was lost)
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not derive from asyncio's classes

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()

    # -- reading ------------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def more(self, timeout: float) -> None:
        """Wait until bytes beyond the buffered ones arrive or the upstream closes; ``TimeoutError`` after
        ``timeout`` seconds of silence."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        if self.eof:
            raise TransportError("the upstream closed the connection before the answer ended") from self.error
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = self._loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def take(self, n: int) -> bytes:
        piece = bytes(self.buffer[:n])
        del self.buffer[:n]
        if self._paused and len(self.buffer) <= _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return piece

    def reusable(self, now: float, keepalive: float) -> bool:
        transport = self.transport
        return (
            transport is not None
            and not transport.is_closing()
            and not self.eof
            and not self.buffer  # nothing may arrive between answers
            and now - self.idle_since < keepalive
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.eof = True


def _left(deadline: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic()``); ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError()
    return left


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Pool:
    """Connections of one origin: idle ones (most recently used first) and a cap on how many are open."""

    def __init__(self, limit: int) -> None:
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(limit)


class UpstreamClient:
    """Keep-alive HTTP/1.1 connections to model upstreams, shared by the providers of one process."""

    def __init__(self, *, limit: int = 100, keepalive: float = 15.0, ssl_context: ssl.SSLContext | None = None) -> None:
        self._limit = limit
        self._keepalive = keepalive
        self._ssl = ssl_context
        self._pools: dict[_Origin, _Pool] = {}
        self._targets: dict[str, _Target] = {}
        self._closed = False

    async def close(self) -> None:
        """Close every idle connection; responses still open close their own when they end."""
        self._closed = True
        for pool in self._pools.values():
            for conn in pool.idle:
                conn.close()
            pool.idle.clear()

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        deadline: float | None = None,
    ) -> UpstreamResponse:
        """Send ``POST url`` with ``body`` and ``headers`` (``Host``, ``Content-Length`` and
        ``Accept-Encoding`` are added) and return once the answer's status and headers are in; the body is read
        from the returned response, within the same ``deadline`` (``time.monotonic()``; None: none)."""
        if self._closed:
            raise TransportError("the upstream client is closed")
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _target(url)
        lines = [f"POST {target.path} HTTP/1.1\r\nHost: {target.origin.host_header}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers.items() if name.lower() not in _OURS]
        lines.append(f"Accept-Encoding: gzip, deflate\r\nContent-Length: {len(body)}\r\n\r\n")
        text = "".join(lines)
        # Each line ends in CRLF: a CR, LF or NUL inside a name or value (header injection) shows in the counts.
        breaks = len(lines) + 3  # the first line holds two, the last three
        if text.count("\n") != breaks or text.count("\r") != breaks or "\0" in text:
            raise ValueError("a request header contains a line break or NUL")
        head = text.encode("latin-1")

        pool = self._pools.get(target.origin)
        if pool is None:
            pool = self._pools[target.origin] = _Pool(self._limit)
        if deadline is not None:
            _left(deadline)  # already past: nothing is sent
        if pool.slots.locked() and deadline is not None:  # every connection busy: wait, up to the deadline
            async with asyncio.timeout(_left(deadline)):
                await pool.slots.acquire()
        else:
            await pool.slots.acquire()
        conn: _Connection | None = None
        try:
            conn = self._idle_connection(pool)
            if conn is None:
                timeout = connect_timeout if deadline is None else min(connect_timeout, _left(deadline))
                conn = await self._connect(target.origin, timeout)
            assert conn.transport is not None
            conn.transport.writelines((head, body))
            response = UpstreamResponse(self, pool, conn, read_timeout, deadline)
            await response._read_head()
            return response
        except BaseException as e:
            if conn is not None:
                conn.close()
            pool.slots.release()
            if isinstance(e, OSError) and not isinstance(e, TimeoutError):  # TimeoutError is an OSError
                raise TransportError(f"cannot reach the upstream: {e.strerror or e}") from e
            raise

    def _idle_connection(self, pool: _Pool) -> _Connection | None:
        now = time.monotonic()
        while pool.idle:
            conn = pool.idle.pop()
            if conn.reusable(now, self._keepalive):
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.scheme == "https":
            tls = self._ssl or ssl.create_default_context()
            self._ssl = tls  # one context for the client's life: building one reads the CA store
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), origin.host, origin.port, ssl=tls,
                    server_hostname=origin.host if tls is not None else None,
                )  # fmt: skip
        except ssl.SSLError as e:
            raise TransportError(f"TLS with the upstream failed: {e.reason or e}") from e
        return conn

    def _give_back(self, pool: _Pool, conn: _Connection, keep: bool) -> None:
        pool.slots.release()
        now = time.monotonic()
        conn.idle_since = now
        if keep and not self._closed and conn.reusable(now, self._keepalive):
            pool.idle.append(conn)
        else:
            conn.close()


class UpstreamResponse:
    """One answer: ``status`` and ``headers`` (names lowercased) once :meth:`UpstreamClient.post` returns, the
    body read with :meth:`read` (all of it) or :meth:`read_some` (what has arrived: the pieces of a stream)."""

    def __init__(
        self, client: UpstreamClient, pool: _Pool, conn: _Connection, read_timeout: float, deadline: float | None
    ) -> None:
        self._client = client
        self._pool = pool
        self._conn = conn
        self._timeout = read_timeout
        self._deadline = deadline
        self.status = 0
        self.headers: dict[str, str] = {}
        self._keep_alive = True
        self._length: int | None = None  # bytes of body left, when framed by Content-Length
        self._chunked = False
        self._chunk_left = 0  # bytes left in the current chunk; 0 between chunks
        self._done = False
        self._ended = False  # released or closed
        self._decoder: zlib._Decompress | None = None

    def _silence(self) -> float:
        """How long the next wait for bytes may last: the read timeout, or what is left before the deadline."""
        if self._deadline is None:
            return self._timeout
        return min(self._timeout, _left(self._deadline))

    # -- head ---------------------------------------------------------------------------------------------------

    async def _read_head(self) -> None:
        conn = self._conn
        while True:
            end = conn.buffer.find(b"\r\n\r\n")
            while end < 0:
                if len(conn.buffer) > _MAX_HEAD:
                    raise TransportError("the upstream's answer headers are too large")
                await conn.more(self._silence())
                end = conn.buffer.find(b"\r\n\r\n")
            head = conn.take(end + 4)[:end].decode("latin-1")
            lines = head.split("\r\n")
            status_line = lines[0].split(" ", 2)
            if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or not status_line[1].isdigit():
                raise TransportError("the upstream did not answer in HTTP/1.x")
            status = int(status_line[1])
            if 100 <= status < 200 and status != 101:
                continue  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            break
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise TransportError("the upstream sent a malformed header line")
            key = name.lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        self.status = status
        self.headers = headers
        connection = headers.get("connection", "").lower()
        self._keep_alive = "close" not in connection and (status_line[0] != "HTTP/1.0" or "keep-alive" in connection)
        encoding = headers.get("transfer-encoding", "").lower()
        if status in _NO_BODY_STATUSES or status == 101:
            self._length = 0
        elif encoding:
            self._chunked = encoding.rsplit(",", 1)[-1].strip() == "chunked"
            if not self._chunked:
                self._keep_alive = False  # framed by the end of the connection
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise TransportError("the upstream sent an invalid Content-Length")
            self._length = int(length)
        else:
            self._keep_alive = False  # framed by the end of the connection
        self._done = self._length == 0
        coding = headers.get("content-encoding", "").lower()
        if coding in ("gzip", "x-gzip", "deflate"):
            self._decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)  # either header, detected
        elif coding not in ("", "identity"):
            raise TransportError(f"the upstream sent an unsupported Content-Encoding {coding!r}")

    # -- body ---------------------------------------------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        pieces = []
        while piece := await self.read_some():
            pieces.append(piece)
        return b"".join(pieces)

    async def read_upto(self, limit: int) -> bytes:
        """At most ``limit`` bytes of the body (an error's explanation, say)."""
        pieces: list[bytes] = []
        size = 0
        while size < limit and (piece := await self.read_some()):
            pieces.append(piece)
            size += len(piece)
        return b"".join(pieces)[:limit]

    async def read_some(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none have), or ``b""`` once the body ended."""
        while not self._done:
            raw = await self._raw_piece()
            if self._decoder is None:
                return raw
            try:
                decoded = self._decoder.decompress(raw) if raw else self._decoder.flush()
            except zlib.error as e:
                raise TransportError("the upstream sent a corrupt compressed body") from e
            if decoded:
                return decoded
        return b""

    async def _raw_piece(self) -> bytes:
        conn = self._conn
        if self._chunked:
            return await self._chunk_piece()
        if self._length is not None:
            while not conn.buffer:
                await conn.more(self._silence())
            piece = conn.take(min(self._length, len(conn.buffer)))
            self._length -= len(piece)
            self._done = self._length == 0
            return piece
        while not conn.buffer:  # framed by the end of the connection
            if conn.eof:
                self._done = True
                return b""
            try:
                await conn.more(self._silence())
            except TransportError:
                continue  # the upstream closed: that ends this body
        return conn.take(len(conn.buffer))

    async def _chunk_piece(self) -> bytes:
        conn = self._conn
        while self._chunk_left == 0:
            line = await self._line()
            size = line.split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size):
                raise TransportError("the upstream sent a malformed chunk size")
            self._chunk_left = int(size, 16)
            if self._chunk_left == 0:
                while await self._line():  # trailers, up to the empty line
                    pass
                self._done = True
                return b""
        while not conn.buffer:
            await conn.more(self._silence())
        piece = conn.take(min(self._chunk_left, len(conn.buffer)))
        self._chunk_left -= len(piece)
        if self._chunk_left == 0:
            while len(conn.buffer) < 2:
                await conn.more(self._silence())
            if conn.take(2) != b"\r\n":
                raise TransportError("the upstream sent a malformed chunk")
        return piece

    async def _line(self) -> bytes:
        conn = self._conn
        end = conn.buffer.find(b"\r\n")
        while end < 0:
            if len(conn.buffer) > _MAX_HEAD:
                raise TransportError("the upstream sent an over-long chunk line")
            await conn.more(self._silence())
            end = conn.buffer.find(b"\r\n")
        return conn.take(end + 2)[:-2]

    # -- the end ------------------------------------------------------------------------------------------------

    async def finish(self, *, limit: int = _FINISH_LIMIT, timeout: float = _FINISH_TIMEOUT) -> None:
        """Read the rest of the body and release the response, so that its connection serves the next call.

        For a stream whose last event has been read (``[DONE]``, ``message_stop``): the body's end (the last chunk
        of a chunked body) usually follows in the same packet, but nothing has read it yet, and a connection is only
        reused once its body was read to the end. At most ``limit`` more bytes are read, for at most ``timeout``
        seconds; an upstream that sends more, takes longer or breaks the connection gets it closed instead. A body
        framed by the end of the connection is never waited for."""
        if self._ended:
            return
        if not self._keep_alive:
            self.close()
            return
        left = limit
        try:
            async with asyncio.timeout(timeout):
                while left >= 0 and (piece := await self.read_some()):
                    left -= len(piece)
        except (TimeoutError, TransportError):
            self.close()
            return
        except BaseException:  # cancelled while waiting: the connection goes, never back to the pool half read
            self.close()
            raise
        self.release()  # closes it all the same if the body did not end within the limit

    def release(self) -> None:
        """End the response; its connection is kept for the next call if the body was read to its end."""
        if not self._ended:
            self._ended = True
            self._client._give_back(self._pool, self._conn, self._done and self._keep_alive)

    def close(self) -> None:
        """End the response and close its connection (the upstream sees the client go away)."""
        if not self._ended:
            self._ended = True
            self._client._give_back(self._pool, self._conn, False)
