"""The policy snapshot: an org's status, model policy, limits and budgets, and those of its agents.

Built from Postgres inside the org's tenant transaction, cached in the two-tier versioned cache under the org's
policy key, and invalidated by the reconcile code. A snapshot that cannot be verified (stores down) fails closed
with 503 upstream of here; this module only models and loads it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from decimal import Decimal
from typing import Any
from uuid import UUID

import orjson

from ibex_dataplane.proxy.cache import TieredCache
from ibex_dataplane.proxy.repository import AgentPolicy, OrgRow, ProxyRepository
from ibex_dataplane.shared.model_policy import model_allowed
from ibex_dataplane.store.keys import TenantKeys


@dataclass(frozen=True)
class PolicySnapshot(OrgRow):
    """The org's row plus its agents: everything the gates check, cached as one value."""

    agents: dict[UUID, AgentPolicy] = field(default_factory=dict)

    @property
    def org_id(self) -> UUID:
        return self.id

    @property
    def org_name(self) -> str:
        return self.name

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
        return model_allowed(model, self.allow, self.deny)

    def resolve_model(self, requested: str | None, agent: AgentPolicy) -> str | None:
        return requested or agent.default_model or self.default_model

    # -- cache codec: plain JSON (money as strings, ids as text) ----------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        def plain(row: object) -> dict[str, Any]:
            out = {}
            for f in fields(OrgRow if isinstance(row, OrgRow) else AgentPolicy):
                v = getattr(row, f.name)
                out[f.name] = str(v) if isinstance(v, UUID | Decimal) else list(v) if isinstance(v, tuple) else v
            return out

        return {**plain(self), "agents": [plain(a) for a in self.agents.values()]}

    @classmethod
    def from_json(cls, d: Any) -> PolicySnapshot:
        def money(v: str | None) -> Decimal | None:
            return None if v is None else Decimal(v)

        def agent(a: dict[str, Any]) -> AgentPolicy:
            roles = tuple(a.get("memory_capture_roles", ("user",)))
            return AgentPolicy(**{**a, "id": UUID(a["id"]), "budget_limit": money(a["budget_limit"]),
                                  "memory_capture_roles": roles})  # fmt: skip

        agents = {UUID(a["id"]): agent(a) for a in d["agents"]}
        org = {f.name: d[f.name] for f in fields(OrgRow)}
        org.update(id=UUID(d["id"]), budget_limit=money(d["budget_limit"]), allow=tuple(d["allow"]),
                   deny=tuple(d["deny"]))  # fmt: skip
        return cls(**org, agents=agents)

    @classmethod
    def from_rows(cls, org: OrgRow, agents: list[AgentPolicy]) -> PolicySnapshot:
        return cls(**{f.name: getattr(org, f.name) for f in fields(OrgRow)}, agents={a.id: a for a in agents})


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

        return await self._cache.get(_policy_key(org_id), load)


@functools.lru_cache(maxsize=16384)
def _policy_key(org_id: UUID) -> str:
    """The cache key of an org's policy snapshot, built once per org."""
    return TenantKeys(org_id).policy()
