"""Every Redis key IBEX uses, built in one place.

Tenant keys always embed the org id as the Redis Cluster hash tag (``ibex:{<org>}:...``): a tenant's keys share a
slot, so multi-key Lua scripts stay single-slot, and no code path can produce a tenant key without an org. Parts
may not contain braces, so the org is always the first and only hash tag. The few keys read before a tenant is
known (the API key cache, the invalidation channel) are global and named as such; an API key's cache keys use the
key id as their hash tag, for the same reason.
"""

from __future__ import annotations

import re
from uuid import UUID

from ibex_dataplane.store.errors import TenantKeyError

PREFIX = "ibex"
_PART = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


def _check_part(part: str) -> str:
    if not isinstance(part, str) or not _PART.fullmatch(part):
        raise TenantKeyError(f"invalid Redis key part {part!r}")
    return part


def _org(org_id: UUID | str) -> str:
    try:
        return str(org_id if isinstance(org_id, UUID) else UUID(str(org_id)))
    except (ValueError, AttributeError, TypeError) as e:
        raise TenantKeyError(f"tenant keys need a valid org id, got {org_id!r}") from e


class TenantKeys:
    """Key builder for one organization."""

    __slots__ = ("org_id", "prefix")

    def __init__(self, org_id: UUID | str) -> None:
        self.org_id = _org(org_id)
        self.prefix = f"{PREFIX}:{{{self.org_id}}}"

    def key(self, *parts: str) -> str:
        if not parts:
            raise TenantKeyError("a tenant key needs at least one part after the org")
        return ":".join((self.prefix, *(_check_part(p) for p in parts)))

    # Named keys, so callers never assemble strings themselves.
    def policy(self) -> str:
        return self.key("policy")

    def rate_limit(self, scope: str, scope_id: UUID | str, metric: str) -> str:
        return self.key("rl", scope, str(scope_id), metric)

    def agent_rate_window(self, agent_id: UUID | str) -> str:
        """Hash of one agent's current rate-limit window (fields ``w`` window id, ``r`` requests, ``t`` tokens)."""
        return self.key("rl", "agent", str(agent_id), "win")

    def org_rate_window(self) -> str:
        """Hash of the whole org's current rate-limit window (same fields as :meth:`agent_rate_window`)."""
        return self.key("rl", "org", "win")

    def directive(self, agent_id: UUID | str) -> str:
        return self.key("directive", str(agent_id))

    def hot_memories(self, agent_id: UUID | str) -> str:
        return self.key("hot", str(agent_id))

    def mcp_session(self, session_id: str) -> str:
        """An MCP session of the proxy's ``/mcp`` endpoint (who opened it, the negotiated protocol revision)."""
        return self.key("mcp", session_id)

    def stored_response(self, agent_id: UUID | str, response_id: str) -> str:
        """A Responses API answer kept for ``GET /v1/responses/{id}`` (scoped to the agent that created it)."""
        return self.key("resp", str(agent_id), response_id)

    def pattern(self) -> str:
        """A SCAN pattern matching every key of this org (used by org deletion)."""
        return f"{PREFIX}:{{{self.org_id}}}:*"


class GlobalKeys:
    """Keys that exist before a tenant is established; they carry no tenant data beyond a key's own record."""

    @staticmethod
    def api_key(key_id: str) -> str:
        """The key id is the hash tag: the versioned cache keeps ``<this>`` and ``<this>:v<n>`` in one slot."""
        return f"{PREFIX}:apikey:{{{_check_part(key_id)}}}"

    INVALIDATION_CHANNEL = f"{PREFIX}:invalidate"
