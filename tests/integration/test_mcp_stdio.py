"""`ibex mcp`, the stdio bridge: the official `mcp` SDK client launches it as a real process and talks MCP over its
stdin and stdout; the bridge forwards every message to the proxy's /mcp with the key from the file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mcp.shared.exceptions import MCPError

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.keys import TenantKeys
from ibex_dataplane.store.redis import scan_tagged
from tests.support.mcp import blocks, stdio_client
from tests.support.processes import IBEX, REPO
from tests.support.proxy import RunningProxy
from tests.support.tenants import Tenant, TenantFactory


def key_file(tmp_path: Path, tenant: Tenant, short: str = "alpha") -> Path:
    path = tmp_path / f"{short}.key"
    path.write_text(tenant.keys[short] + "\n")
    return path


def text_of(result: object) -> str:
    return "\n".join(b.text for b in result.content if b.type == "text")  # type: ignore[attr-defined]


def mcp_error(raised: BaseException) -> MCPError:
    """The MCPError a failed connect raised (the SDK's task groups wrap it in exception groups)."""
    if isinstance(raised, MCPError):
        return raised
    if isinstance(raised, BaseExceptionGroup):
        for inner in raised.exceptions:
            try:
                return mcp_error(inner)
            except AssertionError:
                continue
    raise AssertionError(f"no MCPError in {raised!r}")


async def connect_error(proxy: RunningProxy, key: Path, agent: str) -> MCPError:
    try:
        async with stdio_client(proxy, key, agent):
            pass
    except Exception as raised:  # an exception group from the SDK's task groups, looked into below
        return mcp_error(raised)
    raise AssertionError("the client connected")


async def sessions_of(stores: Stores, tenant: Tenant) -> list[bytes]:
    return [key async for key in scan_tagged(stores.redis, TenantKeys(tenant.org_id).key("mcp") + ":*")]


async def test_the_bridge_lets_the_official_client_call_each_tool_and_read_the_resource(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores, tmp_path: Path
) -> None:
    tenant = await tenants.create()
    progress: list[float] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    async with stdio_client(proxy, key_file(tmp_path, tenant), str(tenant.agents["alpha"])) as client:
        assert client.protocol_version == "2025-11-25"
        assert client.server_info is not None and client.server_info.name == "ibex-harness"
        assert {t.name for t in (await client.list_tools()).tools} == {
            "search_memory", "write_memory", "forget_memory", "list_memories", "record_feedback"
        }  # fmt: skip
        written = await client.call_tool("write_memory", {"content": "The team meets on Tuesdays at ten."},
                                         progress_callback=on_progress)  # fmt: skip
        assert written.structured_content is not None and written.structured_content["outcome"] == "created"
        memory_id = written.structured_content["memory"]["id"]
        assert progress == [0, 1]  # the SSE answer came through the bridge event by event

        found = await client.call_tool("search_memory", {"query": "When does the team meet?"})
        assert [b["body"] for b in blocks(text_of(found))] == ["The team meets on Tuesdays at ten."]
        listed = await client.call_tool("list_memories", {})
        assert listed.structured_content is not None
        assert [m["memory"]["id"] for m in listed.structured_content["memories"]] == [memory_id]
        feedback = await client.call_tool("record_feedback", {"id": memory_id, "useful": False})
        assert feedback.structured_content is not None and feedback.structured_content["memory"]["usefulness"] < 0.5

        uris = [str(r.uri) for r in (await client.list_resources()).resources]
        assert uris == ["ibex://memories/recent", f"ibex://memories/{memory_id}"]
        recent = (await client.read_resource("ibex://memories/recent")).contents[0]
        assert [b["id"] for b in blocks(recent.text)] == [memory_id]  # type: ignore[union-attr]

        bad = await client.call_tool("write_memory", {"content": ""})
        assert bad.is_error and bad.structured_content is not None
        assert bad.structured_content["error"]["code"] == "VALIDATION_ERROR"
        forgotten = await client.call_tool("forget_memory", {"id": memory_id})
        assert forgotten.structured_content == {"id": memory_id, "forgotten": True}
        assert len(await sessions_of(stores, tenant)) == 1
    # Its input closed: the bridge ended its session before it exited.
    assert await sessions_of(stores, tenant) == []


async def test_the_bridge_turns_a_refused_key_into_an_error_carrying_the_envelope_code(
    proxy: RunningProxy, tenants: TenantFactory, tmp_path: Path
) -> None:
    tenant = await tenants.create()
    revoked = tmp_path / "wrong.key"
    revoked.write_text("ibex_sk_nosuchkey_" + "x" * 43)
    refused = await connect_error(proxy, revoked, str(tenant.agents["alpha"]))
    assert refused.error.message.startswith("INVALID_TOKEN:")
    assert refused.error.data["status"] == 401

    other = await tenants.create()  # a real key, but not for that agent
    unbound = await connect_error(proxy, key_file(tmp_path, other), str(tenant.agents["alpha"]))
    assert unbound.error.data["code"] == "AGENT_NOT_AUTHORIZED" and unbound.error.data["status"] == 403


@pytest.mark.parametrize(("content", "says"), [(None, "cannot read the key file"), ("\n", "is empty")])
def test_ibex_mcp_refuses_a_missing_or_empty_key_file(tmp_path: Path, content: str | None, says: str) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    done = subprocess.run(
        [*IBEX, "mcp", "--url", "http://127.0.0.1:9", "--key-file", str(path), "--agent", "a"],
        cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2
    assert says in done.stderr and done.stdout == ""
