"""``POST /v1/embeddings`` through the official openai SDK: the built-in embedder and an upstream, behind the gates."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal

import numpy as np
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.integration.test_proxy_upstream import settled
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import Tenant, TenantFactory
from tests.support.upstream import API_KEY, EMBEDDING, EMBEDDING_TOKENS_PER_INPUT, Script, Upstream, running_upstream


def ai(proxy: RunningProxy, tenant: Tenant, agent: str = "alpha") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=proxy.v1, api_key=tenant.keys[agent], max_retries=0,
                       default_headers={"X-IBEX-Agent-ID": str(tenant.agents[agent])})  # fmt: skip


async def test_the_built_in_embedder_answers_unit_vectors_and_is_billed(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None, agent_spec={"budget": {"monthlyLimitUSD": "5.00"}})
    texts = ["A kitten sleeps on the sofa.", "A small cat naps on the couch.", "Bond yields rose after the report."]
    async with ai(proxy, t) as client:
        answer = await client.embeddings.create(model="ibex-minilm", input=texts)  # the SDK asks for base64
    async with ai(proxy, await tenants.create(directive=None)) as client:
        floats = await client.embeddings.create(model="ibex-minilm", input=texts[0], encoding_format="float")
    assert answer.model == "ibex-minilm" and [d.index for d in answer.data] == [0, 1, 2]
    vectors = np.array([d.embedding for d in answer.data])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # the paraphrase is nearer than the unrelated text
    assert np.allclose(floats.data[0].embedding, vectors[0], atol=1e-6)  # float and base64 carry the same vector
    assert answer.usage.prompt_tokens > 0 and answer.usage.total_tokens == answer.usage.prompt_tokens
    rows, total, held = await settled(stores, t.org_id)
    assert rows == 1 and held == 0  # settled, nothing left held
    assert total == answer.usage.prompt_tokens * Decimal("0.02") / 1_000_000  # every served token, at its price


async def test_embeddings_go_through_the_same_gates_as_chat(proxy: RunningProxy, tenants: TenantFactory) -> None:
    limited = await tenants.create(
        directive=None, org_spec={"models": {"allow": ["echo*"], "default": "echo"}},
        agent_spec={"limits": {"requestsPerMinute": 1}},
    )  # fmt: skip
    async with ai(proxy, limited) as client:
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await client.embeddings.create(model="ibex-minilm", input="hi")
        assert denied.value.body["code"] == "MODEL_NOT_ALLOWED"  # type: ignore[index]
    t, other = await tenants.create(directive=None), await tenants.create(directive=None)
    async with ai(proxy, t) as client:
        with pytest.raises(openai.BadRequestError) as chat_model:
            await client.embeddings.create(model="echo", input="hi")
        assert chat_model.value.body["field_errors"][0]["field"] == "model"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as embedding_model:
            await client.chat.completions.create(model="ibex-minilm", messages=[{"role": "user", "content": "hi"}])
        assert embedding_model.value.body["field_errors"][0]["field"] == "model"  # type: ignore[index]
        for bad in ([], [""], [[1, 2, 3]], 42):
            with pytest.raises(openai.BadRequestError) as invalid:
                await client.embeddings.create(model="ibex-minilm", input=bad)  # type: ignore[arg-type]
            assert invalid.value.body["field_errors"][0]["field"] == "input", bad  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            await client.embeddings.create(model="ibex-minilm", input="hi", dimensions=12)
    async with AsyncOpenAI(base_url=proxy.v1, api_key=other.keys["alpha"], max_retries=0,
                           default_headers={"X-IBEX-Agent-ID": str(t.agents["alpha"])}) as client:  # fmt: skip
        with pytest.raises(openai.PermissionDeniedError) as foreign:
            await client.embeddings.create(model="ibex-minilm", input="hi")
        assert foreign.value.body["code"] == "AGENT_NOT_AUTHORIZED"  # type: ignore[index]
    one_per_minute = await tenants.create(directive=None, agent_spec={"limits": {"requestsPerMinute": 1}})
    async with ai(proxy, one_per_minute) as client:
        await client.embeddings.create(model="ibex-minilm", input="hi")
        with pytest.raises(openai.RateLimitError) as limited_error:
            await client.embeddings.create(model="ibex-minilm", input="hi")
        assert limited_error.value.response.headers["Retry-After"]
    broke = await tenants.create(directive=None, agent_spec={"budget": {"monthlyLimitUSD": "0.00"}})
    async with ai(proxy, broke) as client:
        with pytest.raises(openai.APIStatusError) as budget:
            await client.embeddings.create(model="ibex-minilm", input="hi")
        assert budget.value.status_code == 402 and budget.value.body["code"] == "BUDGET_EXCEEDED"  # type: ignore[index]


@pytest_asyncio.fixture(scope="module")
async def upstream() -> AsyncIterator[Upstream]:
    async with running_upstream() as state:
        yield state


@pytest_asyncio.fixture(scope="module")
async def gateway(settings: Settings, stores: Stores, pepper: bytes, upstream: Upstream) -> AsyncIterator[RunningProxy]:
    config = {
        "models": [
            {"name": "up-embed", "provider": "local", "kind": "embedding", "context_window": 8191,
             "max_output_tokens": 1, "input_price_per_mtok": "0.02", "output_price_per_mtok": "0"}
        ],
        "providers": {"local": {"type": "openai_compat", "base_url": upstream.url, "api_key": API_KEY,
                                "max_attempts": 1}},
    }  # fmt: skip
    async with running_proxy(settings, stores, pepper, provider_config=config) as running:
        yield running


async def test_embeddings_reach_an_upstream_and_its_errors_map_to_the_envelope(
    gateway: RunningProxy, upstream: Upstream, tenants: TenantFactory
) -> None:
    t = await tenants.create(directive=None)
    upstream.reset()
    async with ai(gateway, t) as client:
        answer = await client.embeddings.create(model="up-embed", input=["one", "two"], user="u-1")
        assert np.allclose([d.embedding for d in answer.data], [EMBEDDING, EMBEDDING])
        assert answer.usage.prompt_tokens == 2 * EMBEDDING_TOKENS_PER_INPUT  # the upstream's count is what is billed
        sent = upstream.bodies[-1]
        assert sent["model"] == "up-embed" and sent["input"] == ["one", "two"] and sent["user"] == "u-1"
        tokens = await client.embeddings.create(model="up-embed", input=[[1, 2, 3]])  # token arrays: upstream only
        assert len(tokens.data) == 1
        upstream.reset(Script(fail_first=10, fail_status=400, fail_body={"error": {"message": "too long"}}))
        with pytest.raises(openai.BadRequestError) as rejected:
            await client.embeddings.create(model="up-embed", input="x")
        assert "too long" in rejected.value.body["message"]  # type: ignore[index]
        upstream.reset(Script(fail_first=10, fail_status=503))
        with pytest.raises(openai.APIStatusError) as down:
            await client.embeddings.create(model="up-embed", input="x")
        assert down.value.status_code == 503 and down.value.response.headers["Retry-After"]


async def test_the_model_list_says_which_models_embed(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(directive=None)
    async with ai(proxy, t) as client:
        models = {m.id: getattr(m, "kind", None) async for m in client.models.list()}
    assert models["ibex-minilm"] == "embedding" and models["echo"] == "chat"
    assert "text-embedding-3-small" not in models  # catalogued, but no openai provider is configured here
