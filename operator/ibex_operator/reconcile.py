"""Level-based reconcile for Organization, Agent, Directive and ApiKey: spec in, store changes and status out.

One idempotent function per kind converges Postgres and Redis to the spec. The kopf handlers (create, update,
resume, timer) and the local manifest loader call exactly these. Nothing here talks to the Kubernetes API: secrets
go through a :class:`~ibex_operator.secrets.SecretSink`. Missing references and store outages come back as
``Ready=False`` outcomes marked retryable; they never raise to the caller.
"""

from __future__ import annotations

import hashlib
import logging
from functools import partial
from uuid import UUID

from ibex_dataplane.security.apikeys import (
    MalformedKey,
    generate_key,
    hash_secret,
    parse_token,
    secret_matches,
)
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_operator.models import AgentSpec, ApiKeySpec, DirectiveSpec, OrganizationSpec
from ibex_operator.repository import TenantConfigRepository
from ibex_operator.secrets import SecretSink
from ibex_operator.status import Condition, ReconcileOutcome

log = logging.getLogger(__name__)


def _uuid(value: object) -> UUID | None:
    try:
        return UUID(str(value)) if value else None
    except ValueError:
        return None


class Reconciler:
    """Holds the stores a reconcile needs; one method per kind."""

    def __init__(self, repo: TenantConfigRepository, secrets: SecretSink, pepper: bytes) -> None:
        self._repo = repo
        self._secrets = secrets
        self._pepper = pepper

    # -- Organization ------------------------------------------------------------------------------------------
    async def organization(
        self,
        namespace: str,
        name: str,
        spec: OrganizationSpec,
        *,
        generation: int,
        known_id: str | None = None,
    ) -> ReconcileOutcome:
        outcome = partial(ReconcileOutcome, "Organization", namespace, name)
        fail = partial(ReconcileOutcome.failed, "Organization", namespace, name)

        try:
            org_id = await self._repo.upsert_org(
                known_id=_uuid(known_id),
                namespace=namespace,
                name=name,
                display_name=spec.display_name,
                suspended=spec.suspended,
                rpm=spec.limits.requests_per_minute,
                tpm=spec.limits.tokens_per_minute,
                budget_limit=spec.budget.limit if spec.budget else None,
                enforcement=(spec.budget.enforcement if spec.budget else "HardCap"),
                allow=list(spec.models.allow),
                deny=list(spec.models.deny),
                default_model=spec.models.default,
                generation=generation,
            )
        except StoreUnavailable as e:
            return fail("StoreSynced", "StoreUnavailable", str(e), retryable=True)
        return outcome(
            ready=True,
            reason="Reconciled",
            message="organization is in the stores",
            conditions=(Condition("StoreSynced", "True", "Synced"),),
            fields={"orgId": str(org_id)},
        )

    # -- Agent -------------------------------------------------------------------------------------------------
    async def agent(
        self, namespace: str, name: str, spec: AgentSpec, *, generation: int, known_id: str | None = None
    ) -> ReconcileOutcome:
        outcome = partial(ReconcileOutcome, "Agent", namespace, name)
        fail = partial(ReconcileOutcome.failed, "Agent", namespace, name)

        try:
            org = await self._repo.find_org(namespace, spec.organization_ref.name)
            if org is None:
                msg = f"Organization {namespace}/{spec.organization_ref.name} not found"
                return fail("OrganizationBound", "OrganizationNotFound", msg, retryable=True)
            existing = await self._repo.find_agent(namespace, name)
            if existing is not None and existing.org_id != org.id:
                msg = "an agent cannot move to another organization; delete and recreate it"
                return fail("OrganizationBound", "OrganizationImmutable", msg)
            agent_id = await self._repo.upsert_agent(
                known_id=_uuid(known_id),
                org_id=org.id,
                namespace=namespace,
                name=name,
                display_name=spec.display_name,
                suspended=spec.suspended,
                default_model=spec.default_model,
                rpm=spec.limits.requests_per_minute,
                tpm=spec.limits.tokens_per_minute,
                budget_limit=spec.budget.limit if spec.budget else None,
                memory_enabled=spec.memory.enabled,
                memory_context_tokens=spec.memory.context_tokens,
                memory_capture=spec.memory.capture.value,
                memory_capture_roles=[r.value for r in spec.memory.capture_roles],
                memory_extraction_model=spec.memory.extraction_model,
                generation=generation,
            )
        except StoreUnavailable as e:
            return fail("StoreSynced", "StoreUnavailable", str(e), retryable=True)
        return outcome(
            ready=True,
            reason="Reconciled",
            message="agent is in the stores",
            conditions=(
                Condition("OrganizationBound", "True", "Bound"),
                Condition("StoreSynced", "True", "Synced"),
            ),
            fields={"agentId": str(agent_id), "orgId": str(org.id)},
        )

    # -- Directive ---------------------------------------------------------------------------------------------
    async def directive(
        self, namespace: str, name: str, spec: DirectiveSpec, *, generation: int, known_id: str | None = None
    ) -> ReconcileOutcome:
        outcome = partial(ReconcileOutcome, "Directive", namespace, name)
        fail = partial(ReconcileOutcome.failed, "Directive", namespace, name)

        sha = hashlib.sha256(spec.content.encode()).hexdigest()
        try:
            agent = await self._repo.find_agent(namespace, spec.agent_ref.name)
            if agent is None:
                msg = f"Agent {namespace}/{spec.agent_ref.name} not found"
                return fail("AgentBound", "AgentNotFound", msg, retryable=True)
            state = await self._repo.directive_state(namespace, name)
            try:
                version = await self._repo.put_directive_version(
                    known_id=state.id if state else _uuid(known_id),
                    org_id=agent.org_id,
                    agent_id=agent.id,
                    namespace=namespace,
                    name=name,
                    content=spec.content,
                    content_sha256=sha,
                    injection_mode=spec.injection_mode.value,
                )
            except ValueError as e:
                return fail("AgentBound", "AgentConflict", str(e))
        except StoreUnavailable as e:
            return fail("StoreSynced", "StoreUnavailable", str(e), retryable=True)
        except Exception as e:
            if "directives_agent_id_key" in str(e):
                msg = f"Agent {spec.agent_ref.name} already has another Directive"
                return fail("AgentBound", "AgentConflict", msg)
            raise
        return outcome(
            ready=True,
            reason="Reconciled",
            message=f"version {version} is active",
            conditions=(Condition("AgentBound", "True", "Bound"), Condition("StoreSynced", "True", "Synced")),
            fields={"version": version, "contentSHA256": sha, "agentId": str(agent.id)},
        )

    # -- ApiKey ------------------------------------------------------------------------------------------------
    async def api_key(
        self,
        namespace: str,
        name: str,
        spec: ApiKeySpec,
        *,
        generation: int,
        owner: dict[str, str] | None = None,
    ) -> ReconcileOutcome:
        outcome = partial(ReconcileOutcome, "ApiKey", namespace, name)
        fail = partial(ReconcileOutcome.failed, "ApiKey", namespace, name)

        try:
            org = await self._repo.find_org(namespace, spec.organization_ref.name)
            if org is None:
                msg = f"Organization {namespace}/{spec.organization_ref.name} not found"
                return fail("OrganizationBound", "OrganizationNotFound", msg, retryable=True)
            agent_ids: list[UUID] = []
            for ref in spec.agent_refs:
                agent = await self._repo.find_agent(namespace, ref.name)
                if agent is None:
                    msg = f"Agent {namespace}/{ref.name} not found"
                    return fail("AgentsBound", "AgentNotFound", msg, retryable=True)
                if agent.org_id != org.id:
                    msg = f"Agent {ref.name} belongs to another organization"
                    return fail("AgentsBound", "AgentOrganizationMismatch", msg)
                agent_ids.append(agent.id)

            existing = await self._repo.find_key(namespace, name)
            if existing is not None and existing.org_id != org.id:
                msg = "an API key cannot move to another organization; delete and recreate it"
                return fail("OrganizationBound", "OrganizationImmutable", msg)
            token = await self._secrets.read(namespace, spec.secret_name)
            current_valid = existing is not None and _token_matches(
                self._pepper, token, existing.id, existing.secret_hash
            )
            rotate = existing is None or spec.rotation > existing.rotation or not current_valid
            if existing is not None and spec.revoked:
                rotate = False  # a revoked key keeps its dead secret; nothing new is issued for it
            if rotate:
                issued = generate_key(existing.id if existing else None)
                key_id, secret_hash, token = (
                    issued.key_id,
                    hash_secret(self._pepper, issued.secret),
                    issued.token,
                )
            else:
                assert existing is not None
                key_id, secret_hash = existing.id, existing.secret_hash
            # Write the Secret before the hash: a key's hash changes only once a Secret holds its token. If the
            # Secret cannot be written (a conflict, an outage) the working key is left as it was; a crash in
            # between leaves a Secret that does not match yet, which the next reconcile repairs by issuing again.
            if rotate and token is not None:
                await self._secrets.write(namespace, spec.secret_name, token, owner)
            await self._repo.put_key(
                key_id=key_id,
                org_id=org.id,
                namespace=namespace,
                name=name,
                secret_hash=secret_hash,
                scopes=[s.value for s in spec.scopes],
                expires_at=spec.expires_at,
                revoked=spec.revoked,
                rotation=max(spec.rotation, existing.rotation if existing else 0),
                agent_ids=agent_ids,
                rotated=rotate and existing is not None,
            )
        except StoreUnavailable as e:
            return fail("StoreSynced", "StoreUnavailable", str(e), retryable=True)
        state = "revoked" if spec.revoked else "active"
        return outcome(
            ready=not spec.revoked,
            reason="Revoked" if spec.revoked else "Reconciled",
            message=f"key {key_id} is {state}",
            conditions=(
                Condition("OrganizationBound", "True", "Bound"),
                Condition("AgentsBound", "True", "Bound"),
                Condition("StoreSynced", "True", "Synced"),
                Condition("SecretWritten", "True", "Written", f"Secret {spec.secret_name}, key token"),
            ),
            fields={
                "keyId": key_id,
                "orgId": str(org.id),
                "secretRef": {"name": spec.secret_name, "key": "token"},
                "rotation": spec.rotation,
            },
        )

    async def revoke_api_key(self, key_id: str) -> None:
        """Finalizer path: the key stops working everywhere (caches included) before the resource goes."""
        await self._repo.revoke_key(key_id)


def _token_matches(pepper: bytes, token: str | None, key_id: str, stored_hash: bytes) -> bool:
    if not token:
        return False
    try:
        kid, secret = parse_token(token)
    except MalformedKey:
        return False
    return kid == key_id and secret_matches(pepper, secret, stored_hash)
