"""MCP clients for tests: the official SDK client over streamable HTTP or the stdio bridge, and a raw poster for
messages no well-behaved client sends."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import orjson
from aiohttp import ClientSession
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from tests.support.proxy import RunningProxy

REPO = Path(__file__).resolve().parents[2]
# One block of the memory format, found by its nonce-tagged opening tag; bodies hold no "<".
BLOCK = re.compile(
    r'<memory nonce="(?P<nonce>[a-p]{16})" id="(?P<id>[^"]*)"(?: valid_from="[^"]*")?>(?P<body>[^<]*)</memory>'
)
PREAMBLE_NONCE = re.compile(r'whose nonce is "(?P<nonce>[a-p]{16})"')


@asynccontextmanager
async def http_client(proxy: RunningProxy, token: str, agent: str, **options: Any) -> AsyncIterator[Client]:
    """The official client over streamable HTTP, sending the key and the agent on every request."""
    headers = {"Authorization": f"Bearer {token}", "X-IBEX-Agent-ID": agent}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=60.0)) as http,
        Client(streamable_http_client(proxy.base_url + "/mcp", http_client=http), **options) as client,
    ):
        yield client


@asynccontextmanager
async def stdio_client(proxy: RunningProxy, key_file: Path, agent: str, **options: Any) -> AsyncIterator[Client]:
    """The official client over stdio, talking to ``ibex mcp`` (a real process) in front of ``proxy``."""
    params = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "ibex_dataplane.cli",
            "mcp",
            "--url",
            proxy.base_url,
            "--key-file",
            str(key_file),
            "--agent",
            agent,
        ],
        env={
            "PYTHONPATH": os.pathsep.join([str(REPO / "dataplane"), str(REPO / "operator")]),
            "HF_HUB_OFFLINE": "1",
            "IBEX_LOG_LEVEL": "WARNING",
        },
        cwd=str(REPO),
    )
    async with Client(params, **options) as client:
        yield client


def blocks(text: str) -> list[dict[str, str]]:
    """The memory blocks of a text whose preamble names their nonce (asserting every block carries it)."""
    named = PREAMBLE_NONCE.search(text)
    if named is None:  # no memory shown: then no block either
        assert "<memory" not in text, text
        return []
    found = [m.groupdict() for m in BLOCK.finditer(text)]
    assert all(b["nonce"] == named["nonce"] for b in found)
    return found


@dataclass(frozen=True)
class RawReply:
    status: int
    headers: dict[str, str]
    body: Any
    raw: bytes


class RawMcp:
    """POSTs exactly the bytes a test chooses to ``/mcp``."""

    def __init__(self, http: ClientSession, proxy: RunningProxy, token: str | None, agent: str | None) -> None:
        self._http = http
        self._url = proxy.base_url + "/mcp"
        self.token = token
        self.agent = agent
        self.session_id: str | None = None

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.token is not None:
            h["Authorization"] = f"Bearer {self.token}"
        if self.agent is not None:
            h["X-IBEX-Agent-ID"] = self.agent
        if self.session_id is not None:
            h["Mcp-Session-Id"] = self.session_id
        return {**h, **(extra or {})}

    async def send(self, body: Any, *, raw: bytes | None = None, headers: dict[str, str] | None = None,
                   method: str = "POST") -> RawReply:  # fmt: skip
        data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
        async with self._http.request(method, self._url, data=data, headers=self.headers(headers)) as r:
            content = await r.read()
            parsed = None
            if r.content_type == "application/json" and content:
                parsed = orjson.loads(content)
            return RawReply(r.status, dict(r.headers), parsed, content)

    async def initialize(self) -> RawReply:
        params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        reply = await self.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params})
        assert reply.status == 200, reply
        self.session_id = reply.headers["Mcp-Session-Id"]
        return reply

    async def request(self, method: str, params: Any = None, *, msg_id: Any = 1, **kw: Any) -> RawReply:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": msg_id, "method": method}
        if params is not None:
            message["params"] = params
        return await self.send(message, **kw)

    async def tool(self, name: str, arguments: Any) -> RawReply:
        return await self.request("tools/call", {"name": name, "arguments": arguments})


@asynccontextmanager
async def raw_mcp(proxy: RunningProxy, token: str | None, agent: str | None) -> AsyncIterator[RawMcp]:
    async with ClientSession() as http:
        yield RawMcp(http, proxy, token, agent)
