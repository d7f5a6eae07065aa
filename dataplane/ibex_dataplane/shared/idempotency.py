"""The idempotency ledger in Postgres, scoped by (org, agent, key) (architecture section 9.2).

Owns the ``idempotency_keys`` rows. Route-agnostic, so any stage can put it in front of a non-idempotent call: the
memory stage uses it for its writes, and the proxy can use it for chat ``Idempotency-Key`` s. The caller asks for a
claim with the request's fingerprint and gets either a :class:`Claim` (run the request, then :meth:`complete` or
:meth:`abandon` it) or the :class:`StoredResponse` to replay. The other outcomes are errors:

==========================================  ==============================================================
same key, different request                 :class:`IdempotencyConflict` (409)
first claim still running                   :class:`IdempotencyInProgress` (409, with Retry-After)
ledger unreachable                          :class:`IdempotencyUnavailable` (503), before anything ran
request done but claim cannot be finalized  :class:`IdempotencyUnavailable` (503) from :meth:`complete`
==========================================  ==============================================================

A claim whose holder died stays locked until ``locked_until`` and can then be taken over by a retry of the same
request; only the holder of the current claim token can finalize it. Records expire after ``retention`` and are
deleted by the housekeeping function.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from uuid import UUID

import orjson

from ibex_dataplane.shared.errors import (
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyUnavailable,
    ValidationFailed,
)
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.postgres import CONNECTION_ERRORS, Database

HEADERS = ("Idempotency-Key", "X-Idempotency-Key")
_LEDGER_DOWN: tuple[type[BaseException], ...] = (StoreUnavailable, *CONNECTION_ERRORS)
REPLAYED_HEADER = "X-Idempotency-Replayed"
_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")

_CLAIM = """
INSERT INTO idempotency_keys AS k (org_id, agent_id, key, route, request_hash, state, locked_until, expires_at,
                                   claim_token)
VALUES ($1, $2, $3, $4, $5, 'in_progress', now() + $6::interval, now() + $7::interval, $8)
ON CONFLICT (org_id, agent_id, key) DO UPDATE
   SET route = EXCLUDED.route, request_hash = EXCLUDED.request_hash, state = 'in_progress',
       response_status = NULL, response_headers = NULL, response_body = NULL, locked_until = EXCLUDED.locked_until,
       created_at = now(), completed_at = NULL, expires_at = EXCLUDED.expires_at, claim_token = EXCLUDED.claim_token
 WHERE k.expires_at <= now()
    OR (k.state = 'in_progress' AND k.locked_until <= now()
        AND k.request_hash = EXCLUDED.request_hash AND k.route = EXCLUDED.route)
RETURNING k.claim_token
"""
_EXISTING = """
SELECT route, request_hash, state, response_status, response_headers, response_body, locked_until, now() AS now
  FROM idempotency_keys WHERE org_id = $1 AND agent_id = $2 AND key = $3
"""
_COMPLETE = """
UPDATE idempotency_keys
   SET state = 'completed', response_status = $5, response_headers = $6::jsonb, response_body = $7,
       completed_at = now(), locked_until = now()
 WHERE org_id = $1 AND agent_id = $2 AND key = $3 AND claim_token = $4 AND state = 'in_progress'
"""
_ABANDON = """
DELETE FROM idempotency_keys
 WHERE org_id = $1 AND agent_id = $2 AND key = $3 AND claim_token = $4 AND state = 'in_progress'
"""


def idempotency_key_of(headers: dict[str, str] | object) -> str | None:
    """The client's key from ``Idempotency-Key`` or ``X-Idempotency-Key``; None when it sent neither."""
    get = getattr(headers, "get", None)
    if get is None:
        return None
    for name in HEADERS:
        value = get(name)
        if value is not None:
            if not _KEY.fullmatch(value):
                raise ValidationFailed(
                    "invalid idempotency key",
                    field_errors=[{"field": f"header {name}", "message": "must be 1..255 visible ASCII characters"}],
                )
            return str(value)
    return None


def fingerprint(route: str, body: bytes) -> bytes:
    """SHA-256 of the route and the body; a JSON body is canonicalized first, so key order does not matter."""
    try:
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS) if body else b""
    except orjson.JSONDecodeError:
        canonical = body
    return hashlib.sha256(route.encode() + b"\n" + canonical).digest()


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Claim:
    org_id: UUID
    agent_id: UUID
    key: str
    token: UUID


class IdempotencyLedger:
    def __init__(self, db: Database, *, lock_seconds: float = 30.0, retention_seconds: float = 86400.0) -> None:
        self._db = db
        self._lock = lock_seconds
        self._retention = timedelta(seconds=retention_seconds)

    async def claim(
        self,
        org_id: UUID,
        agent_id: UUID,
        key: str,
        route: str,
        request_fingerprint: bytes,
        *,
        lock_seconds: float | None = None,
    ) -> Claim | StoredResponse:
        """Claim ``key`` for this request, or return the response to replay; see the module doc for errors."""
        token = uuid.uuid4()
        lock = timedelta(seconds=max(lock_seconds or self._lock, 1.0))
        try:
            async with self._db.tenant(org_id, agent_id) as conn:
                claimed = await conn.fetchval(
                    _CLAIM, org_id, agent_id, key, route, request_fingerprint, lock, self._retention, token
                )
                existing = None if claimed == token else await conn.fetchrow(_EXISTING, org_id, agent_id, key)
        except _LEDGER_DOWN as e:
            raise IdempotencyUnavailable("the idempotency ledger is unavailable; nothing was done") from e
        if claimed == token:
            return Claim(org_id, agent_id, key, token)
        if existing is None:  # deleted between the two statements (expired and swept): a fresh claim next time
            raise IdempotencyInProgress("the idempotency key is being recycled; retry", retry_after=1)
        if existing["route"] != route or bytes(existing["request_hash"]) != request_fingerprint:
            raise IdempotencyConflict("this idempotency key was already used for a different request")
        if existing["state"] == "completed":
            headers = orjson.loads(existing["response_headers"]) if existing["response_headers"] else {}
            return StoredResponse(int(existing["response_status"]), bytes(existing["response_body"] or b""), headers)
        wait = (existing["locked_until"] - existing["now"]).total_seconds()
        raise IdempotencyInProgress(
            "a request with this idempotency key is still in progress", retry_after=max(1, math.ceil(wait))
        )

    async def complete(self, claim: Claim, response: StoredResponse) -> None:
        """Store the response under the claim; raises IdempotencyUnavailable if that cannot be recorded."""
        try:
            async with self._db.tenant(claim.org_id, claim.agent_id) as conn:
                result = await conn.execute(
                    _COMPLETE, claim.org_id, claim.agent_id, claim.key, claim.token, response.status,
                    orjson.dumps(response.headers).decode(), response.body,
                )  # fmt: skip
        except _LEDGER_DOWN as e:
            raise IdempotencyUnavailable(
                "the request was processed but its idempotency record could not be finalized; retry with the same key"
            ) from e
        if result != "UPDATE 1":
            raise IdempotencyUnavailable(
                "the idempotency claim was lost before it could be finalized; retry with the same key"
            )

    async def abandon(self, claim: Claim) -> bool:
        """Release a claim whose request failed without effect, so a retry can run at once (best effort)."""
        try:
            async with self._db.tenant(claim.org_id, claim.agent_id) as conn:
                result = await conn.execute(_ABANDON, claim.org_id, claim.agent_id, claim.key, claim.token)
        except _LEDGER_DOWN:
            return False
        return bool(result == "DELETE 1")
