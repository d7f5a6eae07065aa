"""The causes docs/troubleshooting.md gives for an error are the causes the code has: each case below is one a
first-time user meets, with the status, code and message the guide tells them to look for."""

from __future__ import annotations

import secrets
import uuid
from datetime import UTC, datetime, timedelta

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from ibex_operator.models import ApiKeySpec
from tests.integration.test_proxy_gates import assert_error, call
from tests.support.proxy import RunningProxy, running_proxy
from tests.support.tenants import NAMESPACE, TenantFactory


async def test_an_expired_key_is_invalid_token_saying_so(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    agent_name = next(iter(t.agents))
    name = f"expired-{uuid.uuid4().hex[:8]}"
    spec = ApiKeySpec.model_validate({
        "organizationRef": {"name": t.name}, "agentRefs": [{"name": f"{agent_name}-{t.name.removeprefix('org-')}"}],
        "scopes": ["chat"], "secretName": name, "expiresAt": (datetime.now(UTC) - timedelta(hours=1)).isoformat(),
    })  # fmt: skip
    assert (await tenants.reconciler.api_key(NAMESPACE, name, spec, generation=1)).ready
    token = await tenants.sink.read(NAMESPACE, name)
    error = assert_error(await call(proxy, token=token, agent=str(t.agents[agent_name])), 401, "INVALID_TOKEN")
    assert "expired" in error["message"]


async def test_a_proxy_with_another_pepper_refuses_every_key(
    settings: Settings, stores: Stores, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    async with running_proxy(settings, stores, secrets.token_hex(32).encode()) as other:
        assert_error(await call(other, token=t.keys["alpha"], agent=str(t.agents["alpha"])), 401, "INVALID_TOKEN")


async def test_no_model_and_no_default_is_a_validation_error(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create(org_spec={"models": {}})
    body = {"messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(await call(proxy, token=t.keys["alpha"], agent=str(t.agents["alpha"]), body=body), 400,
                         "VALIDATION_ERROR")  # fmt: skip
    assert error["message"] == "no model given and no default model configured"


async def test_an_allowed_but_uncatalogued_model_is_not_found(proxy: RunningProxy, tenants: TenantFactory) -> None:
    t = await tenants.create()
    body = {"model": "llama-nowhere", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(await call(proxy, token=t.keys["alpha"], agent=str(t.agents["alpha"]), body=body), 404,
                         "NOT_FOUND")  # fmt: skip
    assert "does not exist" in error["message"]


async def test_content_that_outgrows_the_limit_once_masked_is_unprocessable(
    proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    content = "x" * 9500 + " a@b.io" * 70  # 9990 bytes; each address becomes [EMAIL_ADDRESS], 9 bytes longer
    assert len(content.encode()) < 10_000
    error = assert_error(
        await call(proxy, token=t.keys["alpha"], agent=str(t.agents["alpha"]), path="/v1/memories",
                   body={"content": content}),
        422, "UNPROCESSABLE",
    )  # fmt: skip
    assert "once personal data is masked" in error["message"]


async def test_a_proxy_run_alone_says_its_memory_stage_is_not_configured(
    second_proxy: RunningProxy, tenants: TenantFactory
) -> None:
    t = await tenants.create()
    error = assert_error(
        await call(second_proxy, token=t.keys["alpha"], agent=str(t.agents["alpha"]), path="/v1/memories",
                   method="GET"),
        503, "SERVICE_DEGRADED",
    )  # fmt: skip
    assert error["message"] == "the memory stage is not configured"
