"""Level-based: the periodic resync notices what changed outside a resource (its Organization went away) and the
resource recovers, with the same stable id, when the Organization is back."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from tests.operator.support import apply, kubectl, spawn_operator, wait_condition
from tests.operator.test_resources import agent, into, org

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver


async def test_a_resource_whose_organization_disappears_turns_not_ready_and_recovers_with_the_same_id(
    kube_apiserver: KubeApiserver, solo_namespace: str, embedded: EmbeddedRuntime, stores: Stores, tmp_path: Path
) -> None:
    kube, ns = kube_apiserver, solo_namespace
    op = spawn_operator(
        kube, embedded.info, tmp_path, identity="resync", namespace=ns, pepper=secrets.token_hex(16),
        extra=("--resync-interval", "1"),
    )  # fmt: skip
    try:
        await apply(kube, *into(ns, org("acme"), agent("bot", "acme")))
        before = await wait_condition(kube, "agent", "bot", ns, timeout=30)

        await kubectl(kube, "-n", ns, "delete", "organization", "acme", "--timeout=30s")
        await wait_condition(kube, "agent", "bot", ns, status="False", reason="OrganizationNotFound", timeout=15)

        await apply(kube, *into(ns, org("acme")))
        after = await wait_condition(kube, "agent", "bot", ns, timeout=15)
        assert after["status"]["agentId"] == before["status"]["agentId"]
        assert after["status"]["orgId"] != before["status"]["orgId"]  # a new organization, the same agent
        assert stores.admin_pool is not None
        async with stores.admin_pool.acquire() as conn:
            row = await conn.fetchrow("SELECT org_id::text FROM agents WHERE namespace = $1 AND name = 'bot'", ns)
        assert row is not None and row["org_id"] == after["status"]["orgId"]
    finally:
        op.kill()
