"""Every SQL statement and Redis key the reconcile code uses to write tenant configuration.

Runs with the privileged pool (the operator's role bypasses row-level security: it works across tenants by
design). After each change it moves the affected cache entries to a new version and publishes an invalidation so
every proxy replica forgets its in-process copy at once (revocation within one second).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

import asyncpg

from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.keys import GlobalKeys, TenantKeys
from ibex_dataplane.store.postgres import CONNECTION_ERRORS
from ibex_dataplane.store.redis import REDIS_DOWN, RedisClient, unavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrgRow:
    id: UUID
    namespace: str
    name: str


@dataclass(frozen=True)
class AgentRow:
    id: UUID
    org_id: UUID
    namespace: str
    name: str


@dataclass(frozen=True)
class KeyRow:
    id: str
    org_id: UUID
    secret_hash: bytes
    rotation: int
    revoked_at: datetime | None


@dataclass(frozen=True)
class DirectiveState:
    id: UUID
    agent_id: UUID
    active_version: int
    active_sha256: str | None
    active_mode: str | None


class TenantConfigRepository:
    """Writes organizations, agents, directives and API keys; invalidates what the data plane caches."""

    def __init__(self, pool: asyncpg.Pool, redis: RedisClient) -> None:
        self._pool = pool
        self._redis = redis

    async def _fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        try:
            async with self._pool.acquire() as conn:
                row: asyncpg.Record | None = await conn.fetchrow(sql, *args)
                return row
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e

    # -- organizations -----------------------------------------------------------------------------------------
    async def find_org(self, namespace: str, name: str) -> OrgRow | None:
        row = await self._fetchrow(
            "SELECT id, namespace, name FROM organizations WHERE namespace = $1 AND name = $2",
            namespace,
            name,
        )
        return OrgRow(row["id"], row["namespace"], row["name"]) if row else None

    async def upsert_org(
        self,
        *,
        known_id: UUID | None,
        namespace: str,
        name: str,
        display_name: str,
        suspended: bool,
        rpm: int | None,
        tpm: int | None,
        budget_limit: Decimal | None,
        enforcement: str,
        allow: list[str],
        deny: list[str],
        default_model: str | None,
        generation: int,
    ) -> UUID:
        row = await self._fetchrow(
            """
            INSERT INTO organizations AS o (id, namespace, name, display_name, suspended, rpm_limit, tpm_limit,
                budget_limit_usd, budget_enforcement, models_allow, models_deny, default_model, generation)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
            ON CONFLICT (namespace, name) DO UPDATE SET
                display_name = EXCLUDED.display_name, suspended = EXCLUDED.suspended,
                rpm_limit = EXCLUDED.rpm_limit, tpm_limit = EXCLUDED.tpm_limit,
                budget_limit_usd = EXCLUDED.budget_limit_usd, budget_enforcement = EXCLUDED.budget_enforcement,
                models_allow = EXCLUDED.models_allow, models_deny = EXCLUDED.models_deny,
                default_model = EXCLUDED.default_model, generation = EXCLUDED.generation, updated_at = now()
            RETURNING id
            """,
            known_id or uuid.uuid4(),
            namespace,
            name,
            display_name,
            suspended,
            rpm,
            tpm,
            budget_limit,
            enforcement,
            allow,
            deny,
            default_model,
            generation,
        )
        assert row is not None
        org_id: UUID = row["id"]
        await self.invalidate_org(org_id)
        return org_id

    # -- agents ------------------------------------------------------------------------------------------------
    async def find_agent(self, namespace: str, name: str) -> AgentRow | None:
        row = await self._fetchrow(
            "SELECT id, org_id, namespace, name FROM agents WHERE namespace = $1 AND name = $2",
            namespace,
            name,
        )
        return AgentRow(row["id"], row["org_id"], row["namespace"], row["name"]) if row else None

    async def upsert_agent(
        self,
        *,
        known_id: UUID | None,
        org_id: UUID,
        namespace: str,
        name: str,
        display_name: str,
        suspended: bool,
        default_model: str | None,
        rpm: int | None,
        tpm: int | None,
        budget_limit: Decimal | None,
        memory_enabled: bool,
        memory_context_tokens: int,
        memory_capture: str,
        memory_capture_roles: list[str],
        memory_extraction_model: str | None,
        generation: int,
    ) -> UUID:
        row = await self._fetchrow(
            """
            INSERT INTO agents AS a (id, org_id, namespace, name, display_name, suspended, default_model,
                rpm_limit, tpm_limit, budget_limit_usd, memory_enabled, memory_context_tokens, generation,
                memory_capture, memory_capture_roles, memory_extraction_model)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
            ON CONFLICT (namespace, name) DO UPDATE SET
                display_name = EXCLUDED.display_name, suspended = EXCLUDED.suspended,
                default_model = EXCLUDED.default_model, rpm_limit = EXCLUDED.rpm_limit,
                tpm_limit = EXCLUDED.tpm_limit, budget_limit_usd = EXCLUDED.budget_limit_usd,
                memory_enabled = EXCLUDED.memory_enabled, memory_context_tokens = EXCLUDED.memory_context_tokens,
                memory_capture = EXCLUDED.memory_capture, memory_capture_roles = EXCLUDED.memory_capture_roles,
                memory_extraction_model = EXCLUDED.memory_extraction_model,
                generation = EXCLUDED.generation, updated_at = now()
            WHERE a.org_id = EXCLUDED.org_id
            RETURNING id
            """,
            known_id or uuid.uuid4(),
            org_id,
            namespace,
            name,
            display_name,
            suspended,
            default_model,
            rpm,
            tpm,
            budget_limit,
            memory_enabled,
            memory_context_tokens,
            generation,
            memory_capture,
            memory_capture_roles,
            memory_extraction_model,
        )
        if row is None:
            raise ValueError("agent belongs to another organization")
        agent_id: UUID = row["id"]
        await self.invalidate_org(org_id)
        return agent_id

    # -- directives --------------------------------------------------------------------------------------------
    async def directive_state(self, namespace: str, name: str) -> DirectiveState | None:
        row = await self._fetchrow(
            """
            SELECT d.id, d.agent_id, d.active_version, v.content_sha256, v.injection_mode
              FROM directives d
              LEFT JOIN directive_versions v ON v.directive_id = d.id AND v.version = d.active_version
             WHERE d.namespace = $1 AND d.name = $2
            """,
            namespace,
            name,
        )
        if row is None:
            return None
        return DirectiveState(
            row["id"], row["agent_id"], row["active_version"], row["content_sha256"], row["injection_mode"]
        )

    async def put_directive_version(
        self,
        *,
        known_id: UUID | None,
        org_id: UUID,
        agent_id: UUID,
        namespace: str,
        name: str,
        content: str,
        content_sha256: str,
        injection_mode: str,
    ) -> int:
        """Append a version when content or mode changed and make it active; returns the active version."""
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    """
                    INSERT INTO directives (id, org_id, agent_id, namespace, name)
                    VALUES ($1, $2, $3, $4, $5)
                    ON CONFLICT (namespace, name) DO UPDATE SET updated_at = now()
                    RETURNING id, agent_id, active_version
                    """,
                    known_id or uuid.uuid4(),
                    org_id,
                    agent_id,
                    namespace,
                    name,
                )
                assert row is not None
                if row["agent_id"] != agent_id:
                    raise ValueError("directive already bound to another agent")
                directive_id = row["id"]
                # Lock the directive so concurrent reconciles append one version, not two.
                await conn.execute("SELECT 1 FROM directives WHERE id = $1 FOR UPDATE", directive_id)
                current = await conn.fetchrow(
                    """
                    SELECT v.version, v.content_sha256, v.injection_mode FROM directives d
                      JOIN directive_versions v ON v.directive_id = d.id AND v.version = d.active_version
                     WHERE d.id = $1
                    """,
                    directive_id,
                )
                if (
                    current
                    and current["content_sha256"] == content_sha256
                    and (current["injection_mode"] == injection_mode)
                ):
                    version: int = current["version"]
                    return version
                version = await conn.fetchval(
                    "SELECT coalesce(max(version), 0) + 1 FROM directive_versions WHERE directive_id = $1",
                    directive_id,
                )
                await conn.execute(
                    """
                    INSERT INTO directive_versions (directive_id, version, org_id, agent_id, content,
                        content_sha256, injection_mode)
                    VALUES ($1, $2, $3, $4, $5, $6, $7)
                    """,
                    directive_id,
                    version,
                    org_id,
                    agent_id,
                    content,
                    content_sha256,
                    injection_mode,
                )
                await conn.execute(
                    "UPDATE directives SET active_version = $2, updated_at = now() WHERE id = $1",
                    directive_id,
                    version,
                )
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e
        await self.invalidate_directive(org_id, agent_id)
        return version

    async def delete_directive(self, namespace: str, name: str) -> int:
        """The Directive resource is gone: drop it and its versions; returns how many versions were removed."""
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    "SELECT id, org_id, agent_id FROM directives WHERE namespace = $1 AND name = $2 FOR UPDATE",
                    namespace,
                    name,
                )
                if row is None:
                    return 0
                versions: int = await conn.fetchval(
                    "SELECT count(*) FROM directive_versions WHERE directive_id = $1", row["id"]
                )
                await conn.execute("DELETE FROM directives WHERE id = $1", row["id"])
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e
        await self.invalidate_directive(row["org_id"], row["agent_id"])
        return versions

    # -- API keys ----------------------------------------------------------------------------------------------
    async def find_key(self, namespace: str, name: str) -> KeyRow | None:
        row = await self._fetchrow(
            "SELECT id, org_id, secret_hash, rotation, revoked_at FROM api_keys WHERE namespace = $1 AND name = $2",
            namespace,
            name,
        )
        if row is None:
            return None
        return KeyRow(row["id"], row["org_id"], bytes(row["secret_hash"]), row["rotation"], row["revoked_at"])

    async def put_key(
        self,
        *,
        key_id: str,
        org_id: UUID,
        namespace: str,
        name: str,
        secret_hash: bytes,
        scopes: list[str],
        expires_at: datetime | None,
        revoked: bool,
        rotation: int,
        agent_ids: list[UUID],
        rotated: bool,
    ) -> None:
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    """
                    INSERT INTO api_keys (id, org_id, namespace, name, secret_hash, scopes, expires_at, revoked_at,
                        rotation, rotated_at)
                    VALUES ($1, $2, $3, $4, $5, $6, $7, CASE WHEN $8 THEN now() END, $9,
                            CASE WHEN $10 THEN now() END)
                    ON CONFLICT (id) DO UPDATE SET
                        secret_hash = EXCLUDED.secret_hash, scopes = EXCLUDED.scopes,
                        expires_at = EXCLUDED.expires_at,
                        revoked_at = CASE WHEN $8 THEN coalesce(api_keys.revoked_at, now()) END,
                        rotation = EXCLUDED.rotation,
                        rotated_at = CASE WHEN $10 THEN now() ELSE api_keys.rotated_at END,
                        updated_at = now()
                    """,
                    key_id,
                    org_id,
                    namespace,
                    name,
                    secret_hash,
                    scopes,
                    expires_at,
                    revoked,
                    rotation,
                    rotated,
                )
                await conn.execute("DELETE FROM api_key_agents WHERE key_id = $1", key_id)
                await conn.executemany(
                    "INSERT INTO api_key_agents (key_id, org_id, agent_id) VALUES ($1, $2, $3)",
                    [(key_id, org_id, a) for a in agent_ids],
                )
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e
        await self.invalidate_key(key_id)

    async def retire_key(self, namespace: str, name: str, key_id: str | None) -> str | None:
        """The ApiKey resource is gone: revoke the key and overwrite its hash so no earlier token can ever match
        again (a resource created later under the same name gets a fresh secret). The row stays for audit.
        Returns the key id, or None when the key never reached the stores."""
        try:
            async with self._pool.acquire() as conn:
                found: str | None = await conn.fetchval(
                    """
                    UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()),
                        secret_hash = sha256(gen_random_uuid()::text::bytea), updated_at = now()
                     WHERE (namespace = $1 AND name = $2) OR id = $3
                    RETURNING id
                    """,
                    namespace,
                    name,
                    key_id,
                )
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e
        if found is not None:
            await self.invalidate_key(found)
        return found

    async def revoke_key(self, key_id: str) -> None:
        try:
            async with self._pool.acquire() as conn:
                await conn.execute(
                    "UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()), updated_at = now() WHERE id = $1",
                    key_id,
                )
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable("postgres", type(e).__name__) from e
        await self.invalidate_key(key_id)

    # -- cache invalidation ------------------------------------------------------------------------------------
    async def invalidate_org(self, org_id: UUID) -> None:
        await self._invalidate(TenantKeys(org_id).policy(), {"kind": "org", "org_id": str(org_id)})

    async def invalidate_directive(self, org_id: UUID, agent_id: UUID) -> None:
        await self._invalidate(
            TenantKeys(org_id).directive(agent_id),
            {"kind": "directive", "org_id": str(org_id), "agent_id": str(agent_id)},
        )

    async def invalidate_key(self, key_id: str) -> None:
        await self._invalidate(GlobalKeys.api_key(key_id), {"kind": "apikey", "key_id": key_id})

    async def _invalidate(self, version_key: str, event: dict[str, str]) -> None:
        """After a commit: move the cached entry to a new version (readers reload) and tell every replica."""
        try:
            await self._redis.incr(version_key)
            await self._redis.publish(GlobalKeys.INVALIDATION_CHANNEL, json.dumps(event))
        except REDIS_DOWN as e:
            raise unavailable(e) from e
