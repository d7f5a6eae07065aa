"""The policy snapshot: an org's status, model policy, limits and budgets, and those of its agents.

Built from Postgres inside the org's tenant transaction, cached in the two-tier versioned cache under the org's
policy key, and invalidated by the reconcile code. A snapshot that cannot be verified (stores down) fails closed
with 503 upstream of here; this module only models and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Any
from uuid import UUID

import orjson

from ibex_dataplane.proxy.cache import TieredCache
from ibex_dataplane.proxy.repository import AgentPolicy, OrgRow, ProxyRepository
from ibex_dataplane.store.keys import TenantKeys


@dataclass(frozen=True)
class PolicySnapshot:
    org_id: UUID
    org_name: str
    display_name: str
    suspended: bool
    rpm: int | None
    tpm: int | None
    budget_limit: Decimal | None
    enforcement: str
    allow: tuple[str, ...]
    deny: tuple[str, ...]
    default_model: str | None
    agents: dict[UUID, AgentPolicy] = field(default_factory=dict)

    def find_agent(self, ident: str) -> AgentPolicy | None:
        """By id, or by name within the org."""
        try:
            agent = self.agents.get(UUID(ident))
        except ValueError:
            agent = None
        if agent is not None:
            return agent
        for candidate in self.agents.values():
            if candidate.name == ident:
                return candidate
        return None

    def model_allowed(self, model: str) -> bool:
        if any(fnmatchcase(model, pattern) for pattern in self.deny):
            return False
        return not self.allow or any(fnmatchcase(model, pattern) for pattern in self.allow)

    def resolve_model(self, requested: str | None, agent: AgentPolicy) -> str | None:
        return requested or agent.default_model or self.default_model

    # -- cache codec ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        def money(v: Decimal | None) -> str | None:
            return None if v is None else str(v)

        return {
            "org_id": str(self.org_id), "org_name": self.org_name, "display_name": self.display_name,
            "suspended": self.suspended, "rpm": self.rpm, "tpm": self.tpm,
            "budget_limit": money(self.budget_limit), "enforcement": self.enforcement,
            "allow": list(self.allow), "deny": list(self.deny), "default_model": self.default_model,
            "agents": [
                {"id": str(a.id), "name": a.name, "suspended": a.suspended, "default_model": a.default_model,
                 "rpm": a.rpm, "tpm": a.tpm, "budget_limit": money(a.budget_limit),
                 "memory_enabled": a.memory_enabled, "memory_context_tokens": a.memory_context_tokens}
                for a in self.agents.values()
            ],
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: Any) -> PolicySnapshot:
        def money(v: str | None) -> Decimal | None:
            return None if v is None else Decimal(v)

        agents = {
            UUID(a["id"]): AgentPolicy(
                UUID(a["id"]),
                a["name"],
                a["suspended"],
                a["default_model"],
                a["rpm"],
                a["tpm"],
                money(a["budget_limit"]),
                a["memory_enabled"],
                a["memory_context_tokens"],
            )
            for a in d["agents"]
        }
        return cls(
            UUID(d["org_id"]), d["org_name"], d["display_name"], d["suspended"], d["rpm"], d["tpm"],
            money(d["budget_limit"]), d["enforcement"], tuple(d["allow"]), tuple(d["deny"]), d["default_model"],
            agents,
        )  # fmt: skip

    @classmethod
    def from_rows(cls, org: OrgRow, agents: list[AgentPolicy]) -> PolicySnapshot:
        return cls(
            org.id, org.name, org.display_name, org.suspended, org.rpm, org.tpm, org.budget_limit, org.enforcement,
            org.allow, org.deny, org.default_model, {a.id: a for a in agents},
        )  # fmt: skip


def encode_policy(p: PolicySnapshot | None) -> bytes:
    return orjson.dumps(p.to_json() if p else None)


def decode_policy(raw: bytes) -> PolicySnapshot | None:
    data = orjson.loads(raw)
    return PolicySnapshot.from_json(data) if data is not None else None


class PolicyService:
    def __init__(self, repo: ProxyRepository, cache: TieredCache[PolicySnapshot | None]) -> None:
        self._repo = repo
        self._cache = cache

    async def snapshot(self, org_id: UUID) -> PolicySnapshot | None:
        async def load() -> PolicySnapshot | None:
            org, agents = await self._repo.org_and_agents(org_id)
            return PolicySnapshot.from_rows(org, list(agents)) if org else None

        return await self._cache.get(TenantKeys(org_id).policy(), load)
