"""GitOps end to end: ``kubectl apply -f examples/tenants/``, the operator fills the stores and Secrets, an agent
chats through the proxy with the token from its Secret (official openai SDK), and ``kubectl delete`` of the ApiKey
makes that token invalid within a second."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import openai
import pytest
from openai import AsyncOpenAI

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from tests.operator.support import REPO, get, kubectl, wait_condition, wait_gone
from tests.operator.test_resources import secret_token, token_valid
from tests.support.proxy import RunningProxy, running_proxy

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver

EXAMPLES = REPO / "examples" / "tenants"
NS = "tenants"
KINDS = {
    "organization": ["acme", "globex"],
    "agent": ["support-bot", "research-agent", "sales-bot", "ops-agent"],
    "directive": ["support-bot-directive", "research-agent-directive", "sales-bot-directive"],
    "apikey": ["support-bot-key", "acme-admin-key", "sales-bot-key", "globex-ops-key"],
}


def chat_client(proxy: RunningProxy, token: str, agent: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=proxy.v1, api_key=token, default_headers={"X-IBEX-Agent-ID": agent}, max_retries=0)


async def ask(proxy: RunningProxy, token: str, agent: str, text: str) -> list[dict[str, str]]:
    async with chat_client(proxy, token, agent) as ai:
        reply = await ai.chat.completions.create(model="echo", messages=[{"role": "user", "content": text}])
    seen: list[dict[str, str]] = json.loads(reply.choices[0].message.content or "")
    return seen


async def test_gitops_apply_chat_and_revoke_by_deleting_the_api_key(
    kube_apiserver: KubeApiserver,
    shared_operator: object,
    stores: Stores,
    settings: Settings,
    pepper: bytes,
) -> None:
    kube = kube_apiserver
    await kubectl(kube, "apply", "-f", str(EXAMPLES))
    try:
        for kind, names in KINDS.items():
            for name in names:
                await wait_condition(kube, kind, name, NS, timeout=30)

        tokens = {}
        for name in KINDS["apikey"]:
            token = await secret_token(kube, NS, name)
            assert token is not None, f"no token in Secret {name}"
            assert await token_valid(stores, pepper, token), f"{name}: token does not match the stored hash"
            tokens[name] = token

        async with running_proxy(settings, stores, pepper) as proxy:
            # the operator-written directive reaches the model, first, as the example asks (SystemFirst)
            seen = await ask(proxy, tokens["support-bot-key"], "support-bot", "Where is my parcel?")
            assert seen[0]["role"] == "system" and seen[0]["content"].startswith("You are the support assistant")
            assert seen[-1] == {"role": "user", "content": "Where is my parcel?"}
            # the admin key may act as both Acme agents; Globex's key may not act as Acme's agent
            seen = await ask(proxy, tokens["acme-admin-key"], "research-agent", "hi")
            assert any(m["role"] == "system" and "Cite the memories" in m["content"] for m in seen)
            with pytest.raises(openai.PermissionDeniedError):
                await ask(proxy, tokens["sales-bot-key"], "support-bot", "let me in")

            # GitOps revocation: delete the ApiKey; the token stops working everywhere within a second. `kubectl
            # delete` returns once the object is gone, after the operator's finalizer revoked the key; the second
            # counts from then (the time kubectl itself takes to start under load is not the proxy's).
            started = time.monotonic()
            deletion = asyncio.create_task(kubectl(kube, "-n", NS, "delete", "apikey", "support-bot-key"))
            deleted_at: float | None = None
            rejected_at = None
            while time.monotonic() - started < 30:
                if deleted_at is None and deletion.done():
                    deleted_at = time.monotonic()
                try:
                    await ask(proxy, tokens["support-bot-key"], "support-bot", "still there?")
                except openai.AuthenticationError:
                    rejected_at = time.monotonic()
                    break
                await asyncio.sleep(0.02)
            await deletion
            assert rejected_at is not None, "the deleted key was still accepted after 30 s"
            if deleted_at is not None:
                assert rejected_at - deleted_at < 1.0, (
                    f"still accepted {rejected_at - deleted_at:.2f} s after the delete"
                )
            assert not await token_valid(stores, pepper, tokens["support-bot-key"])
            # the other keys keep working
            assert await ask(proxy, tokens["acme-admin-key"], "support-bot", "and me?")

        # the Secret went with its ApiKey (owner reference, garbage collector)
        await wait_gone(kube, "secret", "support-bot-key", NS, timeout=30)
        assert await get(kube, "secret", "acme-admin-key", NS) is not None
    finally:
        await kubectl(kube, "delete", "-f", str(EXAMPLES), "--ignore-not-found", "--timeout=90s", timeout=120)

    # deleting the namespace ran every finalizer: the example tenants are gone from the stores
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM organizations WHERE namespace = $1", NS) == 0
        assert await conn.fetchval("SELECT count(*) FROM agents WHERE namespace = $1", NS) == 0
        revoked = await conn.fetch("SELECT revoked_at FROM api_keys WHERE namespace = $1", NS)
    assert revoked == []  # rows of the organizations went with them
