"""What a running proxy answers is what its OpenAPI document says: every route, success and error bodies alike.

One walk drives every documented operation the way a client would (with the memory and context stages behind the
proxy), and checks each answer: its status is documented for that operation, it carries ``X-Request-ID``, and its
body validates against the documented schema (each SSE event against the documented chunk schema). At the end
every documented operation must have produced at least one documented success.
"""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from typing import Any

import orjson
from aiohttp import ClientSession

from ibex_dataplane.proxy.openapi import openapi_document
from tests.support.openapi import escape, operations, schema_validator
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

SSN = "457-55-5462"  # a bare SSN without context: plausible PII, below the redaction threshold, so quarantined


class Contract:
    def __init__(self, http: ClientSession, base_url: str) -> None:
        self.doc = openapi_document()
        self.http = http
        self.base = base_url
        self.succeeded: set[tuple[str, str]] = set()
        self.statuses: list[tuple[str, str, int]] = []
        self.last_headers: dict[str, str] = {}

    async def call(
        self,
        method: str,
        template: str,
        *,
        path: str | None = None,
        query: str = "",
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        expect: int | None = None,
    ) -> Any:
        """Call ``template`` (or the concrete ``path`` for it) and check the answer against the document."""
        op = self.doc["paths"][template][method]
        url = self.base + (path or template) + (f"?{query}" if query else "")
        h = dict(headers or {})
        data: bytes | io.BytesIO | None = io.BytesIO(raw) if raw is not None and len(raw) > 2**20 else raw
        if body is not None:
            data = orjson.dumps(body)
            h.setdefault("Content-Type", "application/json")
        async with self.http.request(method.upper(), url, data=data, headers=h) as r:
            payload = await r.read()
            status, ctype = r.status, r.content_type
            self.last_headers = dict(r.headers)
            assert r.headers.get("X-Request-ID"), (method, template)
        where = f"{method.upper()} {template} -> {status}: {payload[:300]!r}"
        if expect is not None:
            assert status == expect, where
        assert str(status) in op["responses"], f"undocumented status: {where}"
        self.statuses.append((method, template, status))
        response = op["responses"][str(status)]
        pointer = f"/paths/{escape(template)}/{method}/responses/{status}/content/{escape(ctype)}"
        if status == 204 or (status == 202 and "content" not in response):
            assert payload == b"" and "content" not in response, where
            parsed: Any = None
        else:
            assert ctype in response["content"], f"undocumented content type {ctype}: {where}"
            if ctype == "text/event-stream":
                events = schema_validator(self.doc, pointer + "/x-ibex-event-schema")
                lines = [line for line in payload.decode().split("\n") if line.startswith("data: ")]
                if template == "/v1/chat/completions":  # only chat's streams end with [DONE]
                    assert lines.pop() == "data: [DONE]", where
                parsed = [orjson.loads(line.removeprefix("data: ")) for line in lines]
                for event in parsed:
                    errors = [e.message for e in events.iter_errors(event)]
                    assert not errors, (where, event, errors)
            elif ctype == "application/json":
                parsed = orjson.loads(payload)
                errors = [e.message for e in schema_validator(self.doc, pointer + "/schema").iter_errors(parsed)]
                assert not errors, (where, errors)
            else:
                parsed = payload.decode()
        if 200 <= status < 300:
            self.succeeded.add((method, template))
        return parsed


async def test_every_route_answers_what_the_document_says(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(scopes=("chat", "memory:read", "memory:write", "memory:delete", "usage:read"))
    chat_only = await tenants.create(scopes=("chat",))
    key = {"Authorization": f"Bearer {t.keys['alpha']}"}
    agent = {**key, "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    hello = {"model": "echo", "messages": [{"role": "user", "content": "Hello"}]}

    async with ClientSession() as http:
        c = Contract(http, proxy.base_url)

        # -- operations: no key --
        await c.call("get", "/healthz", expect=200)
        await c.call("get", "/readyz", expect=200)
        assert "ibex_proxy" in await c.call("get", "/metrics", expect=200)
        served = await c.call("get", "/openapi.json", expect=200)
        assert served == orjson.loads(orjson.dumps(openapi_document()))

        # -- who am I --
        me = await c.call("get", "/v1/me", headers=key, expect=200)
        assert me["org_id"] == str(t.org_id)
        probe = "/v1/orgs/{org_id}/auth-probe"
        await c.call("get", probe, path=f"/v1/orgs/{t.org_id}/auth-probe", headers=key, expect=200)
        refused = await c.call("get", probe, path=f"/v1/orgs/{uuid.uuid4()}/auth-probe", headers=key, expect=403)
        assert refused["error"]["code"] == "PATH_ORG_MISMATCH"

        # -- models and chat --
        models = await c.call("get", "/v1/models", headers=key, expect=200)
        assert "echo" in {m["id"] for m in models["data"]}
        await c.call("get", "/v1/models", headers=agent, expect=200)
        session = {**agent, "X-IBEX-Session-ID": f"openapi-{uuid.uuid4().hex[:8]}"}
        completion = await c.call("post", "/v1/chat/completions", body=hello, headers=session, expect=200)
        assert completion["object"] == "chat.completion"
        streamed = await c.call(
            "post", "/v1/chat/completions", headers=agent, expect=200,
            body={**hello, "stream": True, "stream_options": {"include_usage": True}},
        )  # fmt: skip
        assert streamed[-1]["usage"]["total_tokens"] > 0

        # -- the other generation wire formats, and stored responses --
        ask = {"model": "echo", "instructions": "Be brief.", "input": "Hello"}
        response = await c.call("post", "/v1/responses", body=ask, headers=agent, expect=200)
        assert response["object"] == "response" and response["status"] == "completed"
        events = await c.call("post", "/v1/responses", body={**ask, "stream": True}, headers=agent, expect=200)
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
        stored = "/v1/responses/{response_id}"
        kept = await c.call("get", stored, path=f"/v1/responses/{response['id']}", headers=agent, expect=200)
        assert kept["id"] == response["id"]
        await c.call("get", stored, path="/v1/responses/resp_nope", headers=agent, expect=404)
        bad_input = await c.call("post", "/v1/responses", body={"input": []}, headers=agent, expect=400)
        assert bad_input["error"]["field_errors"][0]["field"] == "input"
        message = {"model": "echo", "max_tokens": 256, "messages": [{"role": "user", "content": "Hello"}]}
        answer = await c.call("post", "/v1/messages", body=message, headers=agent, expect=200)
        assert answer["type"] == "message" and answer["stop_reason"] == "end_turn"
        stream_events = await c.call(
            "post", "/v1/messages", body={**message, "stream": True}, headers=agent, expect=200
        )
        assert stream_events[0]["type"] == "message_start" and stream_events[-1]["type"] == "message_stop"
        no_max = await c.call("post", "/v1/messages", body={"messages": message["messages"]}, headers=agent, expect=400)
        vectors = await c.call("post", "/v1/embeddings", body={"model": "ibex-minilm", "input": "Hello"}, headers=agent,
                               expect=200)  # fmt: skip
        assert len(vectors["data"][0]["embedding"]) == 384
        await c.call("post", "/v1/embeddings", body={"model": "ibex-minilm", "input": ""}, headers=agent, expect=400)
        assert no_max["error"]["field_errors"][0]["field"] == "max_tokens"
        terminate = "/v1/sessions/{session_id}/terminate"
        closed_path = f"/v1/sessions/{session['X-IBEX-Session-ID']}/terminate"
        await c.call("post", terminate, path=closed_path, headers=agent, expect=200)
        await c.call("post", terminate, path=closed_path, headers=agent, expect=404)

        # -- chat errors --
        assert (await c.call("post", "/v1/chat/completions", body=hello, expect=401))["error"]["code"] == (
            "MISSING_TOKEN"
        )
        bad_key = {"Authorization": "Bearer ibex_sk_nope_nope", "X-IBEX-Agent-ID": "x"}
        await c.call("post", "/v1/chat/completions", body=hello, headers=bad_key, expect=401)
        missing = await c.call("post", "/v1/chat/completions", body=hello, headers=key, expect=400)
        assert missing["error"]["code"] == "MISSING_AGENT_ID"
        invalid = await c.call("post", "/v1/chat/completions", body={"messages": []}, headers=agent, expect=400)
        assert invalid["error"]["field_errors"]
        await c.call("post", "/v1/chat/completions", raw=b"{", headers={**agent, "Content-Type": "application/json"},
                     expect=400)  # fmt: skip
        await c.call("post", "/v1/chat/completions", raw=b"hi", headers={**agent, "Content-Type": "text/plain"},
                     expect=415)  # fmt: skip
        await c.call("post", "/v1/chat/completions", raw=b"x" * (2 << 20),
                     headers={**agent, "Content-Type": "application/json"}, expect=413)  # fmt: skip
        denied = await c.call("post", "/v1/chat/completions", body={**hello, "model": "gpt-4o-not-allowed"},
                              headers=agent)  # fmt: skip
        assert denied["error"]["code"] in ("MODEL_NOT_ALLOWED", "NOT_FOUND")

        # -- memory --
        note = {"content": f"The customer {uuid.uuid4().hex[:6]} prefers email over phone calls.", "labels": ["pref"]}
        created = await c.call("post", "/v1/memories", body=note, headers=agent, expect=201)
        mid = created["memory"]["id"]
        again = await c.call("post", "/v1/memories", body=note, headers=agent, expect=200)
        assert again["deduplicated"] == "exact"
        await c.call("post", "/v1/memories", body={"content": f"Reference {SSN} for the file."}, headers=agent,
                     expect=202)  # fmt: skip
        batch = await c.call(
            "post", "/v1/memories:batch", headers={**agent, "Idempotency-Key": uuid.uuid4().hex}, expect=200,
            body={"items": [{"content": "The office closes at six on Fridays."}, {"content": " "}]},
        )  # fmt: skip
        assert [r["status"] for r in batch["results"]] == [201, 400]
        first = await c.call("get", "/v1/memories", query="limit=1", headers=agent, expect=200)
        assert first["next_cursor"]
        await c.call("get", "/v1/memories", query=f"limit=1&cursor={first['next_cursor']}", headers=agent, expect=200)
        held = await c.call("get", "/v1/memories", query="status=quarantined", headers=agent, expect=200)
        assert [m["status"] for m in held["data"]] == ["quarantined"]
        await c.call("get", "/v1/memories", query="status=superseded", headers=agent, expect=200)
        await c.call("get", "/v1/memories", query="colour=blue", headers=agent, expect=400)
        one = "/v1/memories/{memory_id}"
        await c.call("get", one, path=f"/v1/memories/{mid}", headers=agent, expect=200)
        hits = await c.call("post", "/v1/memories/search", body={"query": "how to contact the customer by email"},
                            headers=agent, expect=200)  # fmt: skip
        assert mid in {h["memory"]["id"] for h in hits["results"]}
        feedback = "/v1/memories/{memory_id}/feedback"
        await c.call("post", feedback, path=f"/v1/memories/{mid}/feedback", body={"useful": True}, headers=agent,
                     expect=200)  # fmt: skip
        await c.call("post", feedback, path=f"/v1/memories/{mid}/feedback", body={"useful": "yes"}, headers=agent,
                     expect=400)  # fmt: skip
        await c.call("delete", one, path=f"/v1/memories/{mid}", headers=agent, expect=204)
        await c.call("delete", one, path=f"/v1/memories/{mid}", headers=agent, expect=404)
        await c.call("get", one, path="/v1/memories/not-a-uuid", headers=agent, expect=404)
        lacking = {
            "Authorization": f"Bearer {chat_only.keys['alpha']}",
            "X-IBEX-Agent-ID": str(chat_only.agents["alpha"]),
        }
        scope = await c.call("get", "/v1/memories", headers=lacking, expect=403)
        assert scope["error"]["code"] == "INSUFFICIENT_PERMISSIONS"

        # -- usage (rows arrive with the analytics flush) --
        deadline = time.monotonic() + 15
        while True:
            usage = await c.call("get", "/v1/usage", query="group_by=agent", headers=key, expect=200)
            if usage["data"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)  # polling for the flush; the assertion below is what counts
        assert usage["data"] and usage["data"][0]["agent_name"]
        for grouping in ("model", "day"):
            await c.call("get", "/v1/usage", query=f"group_by={grouping}&from=2020-01-01", headers=key, expect=200)
        await c.call("get", "/v1/usage", query="group_by=planet", headers=key, expect=400)
        await c.call("get", "/v1/usage", headers=lacking, expect=403)

        # -- MCP --
        for well_known in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"):
            await c.call("get", well_known, expect=200)
        mcp = {**agent, "Accept": "application/json, text/event-stream"}
        await c.call("post", "/mcp", body={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers=mcp, expect=400)
        initialize = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": "2025-11-25"}}
        await c.call("post", "/mcp", body=initialize, headers=mcp, expect=200)
        mcp["Mcp-Session-Id"] = c.last_headers["Mcp-Session-Id"]
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        await c.call("post", "/mcp", body=note, headers=mcp, expect=202)
        search = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                  "params": {"name": "search_memory", "arguments": {"query": "contact"}}}  # fmt: skip
        await c.call("post", "/mcp", body=search, headers=mcp, expect=200)
        search["params"]["_meta"] = {"progressToken": "p"}  # type: ignore[index]
        events = await c.call("post", "/mcp", body=search, headers=mcp, expect=200)
        assert [e.get("method") for e in events][-1] is None and events[-1]["result"]["isError"] is False
        await c.call("post", "/mcp", body={"jsonrpc": "2.0", "id": 3, "method": "nope"}, headers=mcp, expect=200)
        await c.call("post", "/mcp", raw=b"[", headers={**mcp, "Content-Type": "application/json"}, expect=400)
        await c.call("post", "/mcp", body=search, headers={**agent, "Mcp-Session-Id": "x" * 32}, expect=404)
        await c.call("post", "/mcp", body=search, headers={"X-IBEX-Agent-ID": "a"}, expect=401)
        await c.call("delete", "/mcp", headers=mcp, expect=204)
        await c.call("delete", "/mcp", headers=mcp, expect=404)

    documented = {(method, path) for method, path, _ in operations(c.doc)}
    assert c.succeeded == documented, sorted(documented - c.succeeded)
    assert {status for _, _, status in c.statuses} >= {400, 401, 403, 404, 413, 415}
