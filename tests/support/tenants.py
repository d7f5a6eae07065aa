"""Create whole tenants for a test through the real reconcile code, with unique names."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from ibex_operator.models import AgentSpec, ApiKeySpec, DirectiveSpec, OrganizationSpec
from ibex_operator.reconcile import Reconciler
from ibex_operator.secrets import FileSecretSink

NAMESPACE = "tests"


@dataclass
class Tenant:
    name: str
    org_id: UUID
    agents: dict[str, UUID] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # ApiKey name -> token
    key_ids: dict[str, str] = field(default_factory=dict)


class TenantFactory:
    def __init__(self, reconciler: Reconciler, sink: FileSecretSink) -> None:
        self.reconciler = reconciler
        self.sink = sink

    async def create(
        self,
        *,
        agents: tuple[str, ...] = ("alpha", "beta"),
        org_spec: dict[str, Any] | None = None,
        agent_spec: dict[str, Any] | None = None,
        agent_specs: dict[str, dict[str, Any]] | None = None,
        scopes: tuple[str, ...] = ("chat", "memory:read", "memory:write", "memory:delete", "usage:read"),
        directive: str | None = "You are a test agent.",
    ) -> Tenant:
        suffix = uuid.uuid4().hex[:10]
        org_name = f"org-{suffix}"
        org = await self.reconciler.organization(
            NAMESPACE,
            org_name,
            OrganizationSpec.model_validate(org_spec or {"models": {"default": "echo"}}),
            generation=1,
        )
        assert org.ready, org
        tenant = Tenant(org_name, UUID(org.fields["orgId"]))
        for short in agents:
            name = f"{short}-{suffix}"
            own = (agent_specs or {}).get(short, agent_spec or {})  # a per-agent spec wins over the shared one
            spec = AgentSpec.model_validate({"organizationRef": {"name": org_name}, **own})
            out = await self.reconciler.agent(NAMESPACE, name, spec, generation=1)
            assert out.ready, out
            tenant.agents[short] = UUID(out.fields["agentId"])
            if directive:
                d = DirectiveSpec.model_validate({"agentRef": {"name": name}, "content": f"{directive} ({short})"})
                assert (await self.reconciler.directive(NAMESPACE, f"{name}-directive", d, generation=1)).ready
            key_name = f"{short}-key-{suffix}"
            kspec = ApiKeySpec.model_validate(
                {
                    "organizationRef": {"name": org_name},
                    "agentRefs": [{"name": name}],
                    "scopes": list(scopes),
                    "secretName": key_name,
                }
            )
            kout = await self.reconciler.api_key(NAMESPACE, key_name, kspec, generation=1)
            assert kout.ready, kout
            token = await self.sink.read(NAMESPACE, key_name)
            assert token
            tenant.keys[short] = token
            tenant.key_ids[short] = kout.fields["keyId"]
        return tenant
