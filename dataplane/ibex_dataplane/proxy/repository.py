"""Every SQL statement the proxy runs for tenant configuration and sessions (budgets live in budget_repository).

Reads go through :meth:`Database.tenant` (RLS-scoped), except the key lookup, which runs before the tenant is
known through the ``SECURITY DEFINER`` function that returns only the named key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from ibex_dataplane.store.postgres import Database


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    org_id: UUID
    secret_hash: bytes
    scopes: frozenset[str]
    expires_at: datetime | None
    revoked: bool
    agent_ids: frozenset[UUID]

    def to_json(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "org_id": str(self.org_id),
            "secret_hash": self.secret_hash.hex(),
            "scopes": sorted(self.scopes),
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
            "revoked": self.revoked,
            "agent_ids": sorted(str(a) for a in self.agent_ids),
        }

    @classmethod
    def from_json(cls, data: Any) -> KeyRecord:
        return cls(
            key_id=data["key_id"],
            org_id=UUID(data["org_id"]),
            secret_hash=bytes.fromhex(data["secret_hash"]),
            scopes=frozenset(data["scopes"]),
            expires_at=datetime.fromisoformat(data["expires_at"]) if data["expires_at"] else None,
            revoked=bool(data["revoked"]),
            agent_ids=frozenset(UUID(a) for a in data["agent_ids"]),
        )


@dataclass(frozen=True)
class AgentPolicy:
    """An agent as the policy snapshot carries it (the row is the policy)."""

    id: UUID
    name: str
    suspended: bool
    default_model: str | None
    rpm: int | None
    tpm: int | None
    budget_limit: Decimal | None
    memory_enabled: bool
    memory_context_tokens: int
    memory_capture: str = "off"  # off | turns | facts
    memory_capture_roles: tuple[str, ...] = ("user",)
    memory_extraction_model: str | None = None


@dataclass(frozen=True)
class OrgRow:
    id: UUID
    name: str
    display_name: str
    suspended: bool
    rpm: int | None
    tpm: int | None
    budget_limit: Decimal | None
    enforcement: str
    allow: tuple[str, ...]
    deny: tuple[str, ...]
    default_model: str | None


@dataclass(frozen=True)
class DirectiveRow:
    version: int
    content: str
    sha256: str
    injection_mode: str


class ProxyRepository:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def key(self, key_id: str) -> KeyRecord | None:
        async with self._db.unscoped() as conn:
            row = await conn.fetchrow(
                "SELECT key_id, org_id, secret_hash, scopes, expires_at, revoked_at, agent_ids"
                " FROM ibex_lookup_api_key($1)",
                key_id,
            )
        if row is None:
            return None
        return KeyRecord(
            key_id=row["key_id"],
            org_id=row["org_id"],
            secret_hash=bytes(row["secret_hash"]),
            scopes=frozenset(row["scopes"]),
            expires_at=row["expires_at"],
            revoked=row["revoked_at"] is not None,
            agent_ids=frozenset(row["agent_ids"]),
        )

    async def org_and_agents(self, org_id: UUID) -> tuple[OrgRow | None, Sequence[AgentPolicy]]:
        async with self._db.tenant(org_id, readonly=True) as conn:
            org = await conn.fetchrow(
                "SELECT id, name, display_name, suspended, rpm_limit, tpm_limit, budget_limit_usd,"
                " budget_enforcement, models_allow, models_deny, default_model FROM organizations WHERE id = $1",
                org_id,
            )
            agents = await conn.fetch(
                "SELECT id, name, suspended, default_model, rpm_limit, tpm_limit, budget_limit_usd, memory_enabled,"
                " memory_context_tokens, memory_capture, memory_capture_roles, memory_extraction_model"
                " FROM agents WHERE org_id = $1",
                org_id,
            )
        if org is None:
            return None, []
        org_row = OrgRow(
            org["id"], org["name"], org["display_name"], org["suspended"], org["rpm_limit"], org["tpm_limit"],
            org["budget_limit_usd"], org["budget_enforcement"], tuple(org["models_allow"]),
            tuple(org["models_deny"]), org["default_model"],
        )  # fmt: skip
        agent_rows = [
            AgentPolicy(
                a["id"],
                a["name"],
                a["suspended"],
                a["default_model"],
                a["rpm_limit"],
                a["tpm_limit"],
                a["budget_limit_usd"],
                a["memory_enabled"],
                a["memory_context_tokens"],
                a["memory_capture"],
                tuple(a["memory_capture_roles"]),
                a["memory_extraction_model"],
            )
            for a in agents
        ]
        return org_row, agent_rows

    async def active_directive(self, org_id: UUID, agent_id: UUID) -> DirectiveRow | None:
        async with self._db.tenant(org_id, agent_id, readonly=True) as conn:
            row = await conn.fetchrow(
                "SELECT v.version, v.content, v.content_sha256, v.injection_mode FROM directives d"
                " JOIN directive_versions v ON v.directive_id = d.id AND v.version = d.active_version"
                " WHERE d.org_id = $1 AND d.agent_id = $2",
                org_id,
                agent_id,
            )
        if row is None:
            return None
        return DirectiveRow(row["version"], row["content"], row["content_sha256"], row["injection_mode"])
