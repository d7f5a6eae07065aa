"""``ibex mcp``: a stdio MCP server that forwards every message to a proxy's ``/mcp`` endpoint.

For MCP clients that only launch local processes (desktop assistants, IDEs). It reads one JSON-RPC message per line
on stdin, POSTs it to ``/mcp`` with the API key (read from a file, never from the command line) and the agent
header, and writes each answer as one line on stdout: a JSON answer as it is, an SSE answer event by event. It keeps
the ``Mcp-Session-Id`` and the negotiated ``MCP-Protocol-Version`` from ``initialize`` and sends them after. An HTTP
refusal (a bad key, a rate limit, the proxy down) becomes a JSON-RPC error whose ``data`` is the proxy's error
envelope, so the client and its user see the code. When stdin closes, in-flight calls finish, the session is ended
(``DELETE /mcp``) and the process exits. Only protocol messages go to stdout; the log goes to stderr.

Called by :func:`ibex_dataplane.cli.cmd_mcp`; imports nothing of the stages (it is a client of the proxy).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO

import aiohttp
import orjson

log = logging.getLogger(__name__)

SESSION_HEADER = "Mcp-Session-Id"
VERSION_HEADER = "MCP-Protocol-Version"
INTERNAL_ERROR = -32603
REFUSED = -32003  # the proxy refused the HTTP request; data is its error envelope


def endpoint_url(url: str) -> str:
    """The ``/mcp`` endpoint for a proxy base URL (a URL that already ends with ``/mcp`` is kept)."""
    url = url.rstrip("/")
    return url if url.endswith("/mcp") else url + "/mcp"


class Bridge:
    def __init__(self, http: aiohttp.ClientSession, url: str, token: str, agent: str, write: Callable[[bytes], None]):
        self._http = http
        self._url = endpoint_url(url)
        self._token = token
        self._agent = agent
        self._write = write
        self.session_id: str | None = None
        self.protocol_version: str | None = None

    def _headers(self) -> dict[str, str]:
        headers = {
            "Authorization": f"Bearer {self._token}",
            "X-IBEX-Agent-ID": self._agent,
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }
        if self.session_id:
            headers[SESSION_HEADER] = self.session_id
        if self.protocol_version:
            headers[VERSION_HEADER] = self.protocol_version
        return headers

    def _emit(self, message: Any) -> None:
        self._write(orjson.dumps(message) + b"\n")

    def _fail(self, msg_id: Any, code: int, message: str, data: Any = None) -> None:
        error: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            error["data"] = data
        self._emit({"jsonrpc": "2.0", "id": msg_id, "error": error})

    async def forward(self, line: bytes) -> None:
        """POST one message and write what comes back (requests get exactly one answer, even on failure)."""
        try:
            message = orjson.loads(line)
        except orjson.JSONDecodeError:
            self._fail(None, -32700, "the line is not valid JSON")
            return
        is_request = isinstance(message, dict) and "method" in message and "id" in message
        msg_id = message.get("id") if isinstance(message, dict) else None
        is_initialize = is_request and message.get("method") == "initialize"
        try:
            async with self._http.post(self._url, data=line, headers=self._headers()) as response:
                if is_initialize and response.status == 200:
                    self.session_id = response.headers.get(SESSION_HEADER) or self.session_id
                ctype = response.headers.get("Content-Type", "")
                if ctype.startswith("text/event-stream"):
                    await self._relay_events(response, is_initialize)
                    return
                body = await response.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("the IBEX proxy at %s could not be reached: %s", self._url, type(e).__name__)
            if is_request:
                self._fail(msg_id, INTERNAL_ERROR, f"the IBEX proxy could not be reached ({type(e).__name__})")
            return
        if response.status == 202 or not body:
            if is_request and response.status >= 400:
                self._fail(msg_id, REFUSED, f"the IBEX proxy answered HTTP {response.status}")
            return
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            answer = None
        if isinstance(answer, dict) and answer.get("jsonrpc") == "2.0":
            if is_initialize and isinstance(answer.get("result"), dict):
                self.protocol_version = answer["result"].get("protocolVersion")
            if answer.get("id") is None and is_request:
                answer["id"] = msg_id  # an error the proxy could not attach to the request
            self._emit(answer)
            return
        if is_request:  # the error envelope of a gate (401, 403, 429, 503 ...)
            envelope = answer.get("error") if isinstance(answer, dict) else None
            if isinstance(envelope, dict):
                data = {**envelope, "status": response.status}
                self._fail(msg_id, REFUSED, f"{envelope.get('code')}: {envelope.get('message')}", data)
            else:
                self._fail(msg_id, REFUSED, f"the IBEX proxy answered HTTP {response.status}")

    async def _relay_events(self, response: aiohttp.ClientResponse, is_initialize: bool) -> None:
        data: list[bytes] = []
        async for raw in response.content:
            line = raw.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            elif not line and data:
                payload = b"\n".join(data)
                data = []
                try:
                    message = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if is_initialize and isinstance(message, dict) and isinstance(message.get("result"), dict):
                    self.protocol_version = message["result"].get("protocolVersion")
                self._emit(message)

    async def close(self) -> None:
        """End the session, if one was opened (best effort: the proxy expires it anyway)."""
        if not self.session_id:
            return
        try:
            async with self._http.delete(self._url, headers=self._headers()) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("could not end the MCP session: %s", type(e).__name__)


async def run_bridge(
    url: str, token: str, agent: str, *, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None
) -> int:
    reader = stdin or sys.stdin.buffer
    writer = stdout or sys.stdout.buffer
    loop = asyncio.get_running_loop()

    def write(data: bytes) -> None:
        writer.write(data)
        writer.flush()

    async def read_line() -> bytes:
        line: bytes = await loop.run_in_executor(None, reader.readline)
        return line

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        bridge = Bridge(http, url, token, agent, write)
        pending: set[asyncio.Task[None]] = set()

        def spawn(work: Awaitable[None]) -> None:
            task: asyncio.Task[None] = asyncio.ensure_future(work)
            pending.add(task)
            task.add_done_callback(pending.discard)

        while True:
            line = await read_line()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if b'"initialize"' in line and bridge.session_id is None:
                await bridge.forward(line)  # later messages need its session id
            else:
                spawn(bridge.forward(line))
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await bridge.close()
    return 0
