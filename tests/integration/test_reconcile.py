"""The reconcile functions converge Postgres and Redis to the spec, idempotently, with stable ids."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.security.apikeys import parse_token, secret_matches
from ibex_dataplane.store.keys import TenantKeys
from ibex_operator.errors import SecretConflict
from ibex_operator.manifests import apply_manifests, load_manifests
from ibex_operator.models import AgentSpec, ApiKeySpec, DirectiveSpec, OrganizationSpec
from ibex_operator.reconcile import Reconciler
from ibex_operator.repository import TenantConfigRepository
from ibex_operator.secrets import FileSecretSink
from tests.support.tenants import NAMESPACE, TenantFactory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tenants"


async def key_row(stores: Stores, key_id: str) -> dict[str, object]:
    async with stores.db.unscoped() as conn:
        row = await conn.fetchrow("SELECT * FROM ibex_lookup_api_key($1)", key_id)
    assert row is not None
    return dict(row)


async def test_examples_apply_ready_and_reapply_without_changing_ids_or_tokens(
    reconciler: Reconciler, secret_sink: FileSecretSink
) -> None:
    manifests = load_manifests(EXAMPLES)
    first = await apply_manifests(reconciler, manifests)
    assert all(o.ready for o in first), [o for o in first if not o.ready]
    tokens_before = secret_sink._load()
    second = await apply_manifests(reconciler, manifests)
    assert [o.fields for o in second] == [o.fields for o in first]
    assert secret_sink._load() == tokens_before


async def test_directive_edits_append_versions_and_keep_old_ones(
    reconciler: Reconciler, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("solo",), directive=None)
    agent_name = next(iter(await _agent_names(stores, t.org_id)))
    spec = DirectiveSpec.model_validate({"agentRef": {"name": agent_name}, "content": "Be brief."})
    one = await reconciler.directive(NAMESPACE, "d", spec, generation=1)
    same = await reconciler.directive(NAMESPACE, "d", spec, generation=2)
    edited = await reconciler.directive(
        NAMESPACE, "d", spec.model_copy(update={"content": "Be thorough."}), generation=3
    )
    assert (one.fields["version"], same.fields["version"], edited.fields["version"]) == (1, 1, 2)
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        versions = await conn.fetch(
            "SELECT v.version, v.content FROM directive_versions v JOIN directives d ON d.id = v.directive_id"
            " WHERE d.namespace = $1 AND d.name = 'd' ORDER BY 1",
            NAMESPACE,
        )
        active = await conn.fetchval(
            "SELECT active_version FROM directives WHERE namespace = $1 AND name = 'd'", NAMESPACE
        )
    assert [(r["version"], r["content"]) for r in versions] == [(1, "Be brief."), (2, "Be thorough.")]
    assert active == 2


async def _agent_names(stores: Stores, org_id: uuid.UUID) -> list[str]:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        return [r["name"] for r in await conn.fetch("SELECT name FROM agents WHERE org_id = $1", org_id)]


async def test_missing_organization_is_not_ready_and_recovers_when_it_appears(reconciler: Reconciler) -> None:
    org = f"late-{uuid.uuid4().hex[:8]}"
    spec = AgentSpec.model_validate({"organizationRef": {"name": org}})
    waiting = await reconciler.agent(NAMESPACE, f"{org}-bot", spec, generation=1)
    assert not waiting.ready and waiting.reason == "OrganizationNotFound" and waiting.retryable
    assert (await reconciler.organization(NAMESPACE, org, OrganizationSpec(), generation=1)).ready
    recovered = await reconciler.agent(NAMESPACE, f"{org}-bot", spec, generation=1)
    assert recovered.ready and recovered.fields["agentId"]


async def test_agent_ids_are_stable_and_an_agent_cannot_change_organization(
    reconciler: Reconciler, tenants: TenantFactory, stores: Stores
) -> None:
    a = await tenants.create(agents=("one",))
    b = await tenants.create(agents=("one",))
    name = (await _agent_names(stores, a.org_id))[0]
    same = await reconciler.agent(
        NAMESPACE,
        name,
        AgentSpec.model_validate({"organizationRef": {"name": a.name}, "suspended": True}),
        generation=2,
    )
    assert same.fields["agentId"] == str(a.agents["one"])
    moved = await reconciler.agent(
        NAMESPACE, name, AgentSpec.model_validate({"organizationRef": {"name": b.name}}), generation=3
    )
    assert not moved.ready and moved.reason == "OrganizationImmutable"


async def test_key_rotation_issues_a_new_secret_under_the_same_key_id(
    reconciler: Reconciler, tenants: TenantFactory, secret_sink: FileSecretSink, stores: Stores, pepper: bytes
) -> None:
    t = await tenants.create(agents=("solo",))
    old_token = t.keys["solo"]
    key_name = f"solo-key-{t.name.removeprefix('org-')}"
    agent_name = (await _agent_names(stores, t.org_id))[0]
    spec = ApiKeySpec.model_validate(
        {"organizationRef": {"name": t.name}, "agentRefs": [{"name": agent_name}], "scopes": ["chat"],
         "secretName": key_name, "rotation": 1}
    )  # fmt: skip
    out = await reconciler.api_key(NAMESPACE, key_name, spec, generation=2)
    assert out.ready and out.fields["keyId"] == t.key_ids["solo"]
    new_token = await secret_sink.read(NAMESPACE, key_name)
    assert new_token and new_token != old_token
    row = await key_row(stores, t.key_ids["solo"])
    assert secret_matches(pepper, parse_token(new_token)[1], row["secret_hash"])  # type: ignore[arg-type]
    assert not secret_matches(pepper, parse_token(old_token)[1], row["secret_hash"])  # type: ignore[arg-type]
    assert row["scopes"] == ["chat"]


async def test_a_lost_secret_is_reissued_and_revocation_is_recorded(
    reconciler: Reconciler, tenants: TenantFactory, secret_sink: FileSecretSink, stores: Stores
) -> None:
    t = await tenants.create(agents=("solo",))
    key_name = f"solo-key-{t.name.removeprefix('org-')}"
    agent_name = (await _agent_names(stores, t.org_id))[0]
    base = {"organizationRef": {"name": t.name}, "agentRefs": [{"name": agent_name}], "scopes": ["chat"]}
    # The Secret was deleted: write a different secret name so the sink has nothing for it.
    out = await reconciler.api_key(
        NAMESPACE, key_name, ApiKeySpec.model_validate({**base, "secretName": f"{key_name}-moved"}), generation=2
    )
    assert out.ready
    assert await secret_sink.read(NAMESPACE, f"{key_name}-moved") not in (None, t.keys["solo"])
    revoked = await reconciler.api_key(
        NAMESPACE, key_name, ApiKeySpec.model_validate({**base, "secretName": key_name, "revoked": True}), generation=3
    )
    assert not revoked.ready and revoked.reason == "Revoked"
    assert (await key_row(stores, t.key_ids["solo"]))["revoked_at"] is not None


async def test_org_changes_move_the_cached_policy_to_a_new_version(
    reconciler: Reconciler, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("solo",))
    version_key = TenantKeys(t.org_id).policy()
    before = int(await stores.redis.get(version_key) or 0)
    out = await reconciler.organization(NAMESPACE, t.name, OrganizationSpec(suspended=True), generation=2)
    assert out.ready and out.fields["orgId"] == str(t.org_id)
    assert int(await stores.redis.get(version_key) or 0) == before + 1


class RefusingSink:
    """A Secret store whose writes are refused (as when GitOps stripped the operator's managed-by label)."""

    def __init__(self, inner: FileSecretSink) -> None:
        self._inner = inner
        self.attempts = 0

    async def read(self, namespace: str, secret_name: str) -> str | None:
        return await self._inner.read(namespace, secret_name)

    async def write(self, namespace: str, secret_name: str, token: str, owner: dict[str, str] | None) -> None:
        self.attempts += 1
        raise SecretConflict(f"Secret {secret_name} exists and is not managed by the IBEX operator")


async def test_a_secret_that_cannot_be_written_never_rotates_the_working_key(
    tenants: TenantFactory, secret_sink: FileSecretSink, stores: Stores, pepper: bytes
) -> None:
    t = await tenants.create(agents=("solo",))
    working = t.keys["solo"]
    key_name = f"solo-key-{t.name.removeprefix('org-')}"
    agent_name = (await _agent_names(stores, t.org_id))[0]
    spec = ApiKeySpec.model_validate(
        {"organizationRef": {"name": t.name}, "agentRefs": [{"name": agent_name}], "scopes": ["chat"],
         "secretName": key_name, "rotation": 1}
    )  # fmt: skip
    assert stores.admin_pool is not None
    refusing = RefusingSink(secret_sink)
    blocked = Reconciler(TenantConfigRepository(stores.admin_pool, stores.redis), refusing, pepper)
    for generation in (2, 3, 4):  # every retry of the reconcile
        with pytest.raises(SecretConflict):
            await blocked.api_key(NAMESPACE, key_name, spec, generation=generation)
    assert refusing.attempts == 3
    row = await key_row(stores, t.key_ids["solo"])
    assert secret_matches(pepper, parse_token(working)[1], row["secret_hash"])  # type: ignore[arg-type]
    assert await secret_sink.read(NAMESPACE, key_name) == working


async def test_the_capture_policy_is_reconciled_into_the_agent_and_edits_reach_the_proxys_policy(
    reconciler: Reconciler, stores: Stores
) -> None:
    from ibex_dataplane.proxy.repository import ProxyRepository

    suffix = uuid.uuid4().hex[:8]
    org = await reconciler.organization(NAMESPACE, f"cap-{suffix}", OrganizationSpec(), generation=1)
    org_id = uuid.UUID(org.fields["orgId"])

    async def apply(memory: dict[str, object], generation: int) -> tuple[str, tuple[str, ...], str | None]:
        spec = AgentSpec.model_validate({"organizationRef": {"name": f"cap-{suffix}"}, "memory": memory})
        assert (await reconciler.agent(NAMESPACE, f"bot-{suffix}", spec, generation=generation)).ready
        _, agents = await ProxyRepository(stores.db).org_and_agents(org_id)
        [a] = agents
        return a.memory_capture, a.memory_capture_roles, a.memory_extraction_model

    assert await apply({}, 1) == ("off", ("user",), None)
    assert await apply({"capture": "turns", "captureRoles": ["user", "assistant"]}, 2) == (
        "turns", ("user", "assistant"), None
    )  # fmt: skip
    assert await apply({"capture": "facts", "extractionModel": "gpt-4o-mini"}, 3) == ("facts", ("user",), "gpt-4o-mini")


@pytest.mark.parametrize(
    "memory",
    [{"capture": "always"}, {"captureRoles": []}, {"captureRoles": ["user", "user"]}, {"captureRoles": ["system"]}],
)
def test_an_invalid_capture_policy_is_refused_by_the_model(memory: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="capture"):
        AgentSpec.model_validate({"organizationRef": {"name": "acme"}, "memory": memory})
