"""The context stage as a raw gRPC client sees it: no valid principal, no retrieval; bad input is a clear status."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import orjson
import pytest
from aiohttp import web

from ibex_dataplane.context.app import ContextStage
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2 as pb
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2_grpc as pb_grpc
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.security.principal import Principal, PrincipalSigner, grpc_target, http_target
from ibex_dataplane.settings import Settings

ASSEMBLE = "/ibex.context.v1.ContextAssembly/Assemble"
SECRET = secrets.token_bytes(32)


def hit(i: int, words: int = 12) -> dict[str, object]:
    """A search hit as the memory stage answers it (wire shape of section 9.5)."""
    memory = {"id": str(uuid.UUID(int=i + 1)), "content": f"memory {i}: " + "tea " * words, "valid_from": None}
    components = {"relevance": 0.9, "recency": 0.5, "usefulness": 0.5, "confidence": 1.0, "frequency": 0.0}
    return {"memory": memory, "score": 0.9 - i / 100, "components": components, "matched_by": "both"}


SEARCH_HITS: list[dict[str, object]] = []


@asynccontextmanager
async def recording_memory_stage() -> AsyncIterator[tuple[str, list[str]]]:
    """Stands in for the memory stage: answers searches with SEARCH_HITS (else nothing) and records every call."""
    asked: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(f"{request.method} {request.path}")
        results = SEARCH_HITS if request.path == "/v1/memories/search" else []
        return web.json_response({"results": results})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", asked
    finally:
        await runner.cleanup()


@pytest.fixture
async def stage(settings: Settings) -> AsyncIterator[tuple[ContextStage, list[str]]]:
    async with recording_memory_stage() as (url, asked):
        running = ContextStage(
            settings.model_copy(update={"context_deadline_ms": 5000.0, "context_hot_ms": 5000.0,
                                        "context_cold_ms": 5000.0}),
            catalog=ModelCatalog.builtin(), memory_url=url, secret=SECRET, host="127.0.0.1", port=0, health_port=0,
        )  # fmt: skip
        await running.start()
        asked.clear()  # the stage's warm-up connection at start is not a retrieval
        try:
            yield running, asked
        finally:
            await running.stop()


def principal(target: str = grpc_target(ASSEMBLE), deadline_in: float = 10.0) -> Principal:
    return Principal(uuid.uuid4(), uuid.uuid4(), frozenset({"chat"}), "req-raw", time.time() + deadline_in, target)


def request() -> pb.AssembleRequest:
    user = {"role": "user", "content": "what tea do I like?"}
    return pb.AssembleRequest(
        model="echo",
        messages=[pb.Message(role="user", json=orjson.dumps(user))],
        limits=pb.Limits(context_tokens=2000),
    )


async def call(stage: ContextStage, req: pb.AssembleRequest, token: str | None) -> pb.AssembleResponse:
    async with grpc.aio.insecure_channel(stage.address) as channel:
        stub = pb_grpc.ContextAssemblyStub(channel)  # type: ignore[no-untyped-call]
        metadata = (("x-ibex-principal", token),) if token is not None else None
        response: pb.AssembleResponse = await stub.Assemble(req, timeout=10, metadata=metadata)
        return response


@pytest.mark.parametrize(
    "token",
    [
        None,
        "",
        "garbage",
        PrincipalSigner(b"not-the-stage-secret-at-all").sign(principal()),  # forged
        PrincipalSigner(SECRET).sign(principal(deadline_in=-1)),  # expired
        PrincipalSigner(SECRET).sign(principal(target=http_target("POST", "/v1/memories/search"))),  # another call
    ],
    ids=["missing", "empty", "garbage", "forged", "expired", "another-route"],
)
async def test_a_call_without_a_valid_principal_is_unauthenticated_and_retrieves_nothing(
    stage: tuple[ContextStage, list[str]], token: str | None
) -> None:
    running, asked = stage
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(running, request(), token)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert asked == []


async def test_a_valid_principal_retrieves_for_its_own_tenant_only(stage: tuple[ContextStage, list[str]]) -> None:
    running, asked = stage
    response = await call(running, request(), PrincipalSigner(SECRET).sign(principal()))
    assert sorted(asked) == ["GET /v1/memories:hot", "POST /v1/memories/search"]
    assert [orjson.loads(m.json) for m in response.messages] == [{"role": "user", "content": "what tea do I like?"}]
    assert {b.name: b.status for b in response.branches} == {"directive": pb.SUCCESS, "hot": pb.SUCCESS,
                                                              "cold": pb.SUCCESS}  # fmt: skip
    assert response.degradation == pb.NONE
    assert not response.packing.budget_reached  # no candidates is not a truncation


@pytest.mark.parametrize(
    ("mutate", "status"),
    [
        (lambda r: r.messages.append(pb.Message(role="user", json=b"{not json")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.messages.append(pb.Message(role="user", json=b"[1, 2]")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r, "tools_json", b'{"a": 1}'), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r, "model", ""), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r, "model", "no-such-model"), grpc.StatusCode.NOT_FOUND),
    ],
    ids=["message-not-json", "message-not-object", "tools-not-array", "no-model", "unknown-model"],
)
async def test_bad_requests_get_a_clear_status_never_internal(
    stage: tuple[ContextStage, list[str]], mutate: object, status: grpc.StatusCode
) -> None:
    running, _ = stage
    req = request()
    mutate(req)  # type: ignore[operator]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(running, req, PrincipalSigner(SECRET).sign(principal()))
    assert caught.value.code() == status


async def test_the_stage_serves_health_and_metrics(stage: tuple[ContextStage, list[str]]) -> None:
    from aiohttp import ClientSession

    running, _ = stage
    await call(running, request(), PrincipalSigner(SECRET).sign(principal()))
    async with ClientSession() as http:
        for path in ("/healthz", "/readyz"):
            async with http.get(running.health_url + path) as r:
                assert r.status == 200
        async with http.get(running.health_url + "/metrics") as r:
            text = await r.text()
    assert 'ibex_context_branch_outcomes_total{branch="cold",status="success"} 1.0' in text
    assert 'ibex_context_assemblies_total{degradation="none"} 1.0' in text


async def test_max_memories_and_the_agents_token_cap_bound_what_is_placed(
    stage: tuple[ContextStage, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    running, _ = stage
    monkeypatch.setattr(f"{__name__}.SEARCH_HITS", [hit(i) for i in range(8)])
    token = PrincipalSigner(SECRET).sign(principal())
    capped = request()
    capped.options.max_memories = 3
    response = await call(running, capped, PrincipalSigner(SECRET).sign(principal()))
    assert [m.id for m in response.memories] == [str(uuid.UUID(int=i + 1)) for i in range(3)]  # best first
    assert all(m.source == "cold" and m.components.relevance == 0.9 for m in response.memories)
    assert response.tokens.memories == sum(m.tokens for m in response.memories) > 0

    small = request()
    small.limits.context_tokens = 250  # room for a couple of entries only, and constrained (< 256 usable)
    response = await call(running, small, token)
    assert response.packing.constrained and response.packing.budget_reached
    assert response.tokens.usable == 250 and response.tokens.memories <= 250
    assert 0 < len(response.memories) < 8
    assert response.packing.excluded_for_budget == 8 - len(response.memories)
