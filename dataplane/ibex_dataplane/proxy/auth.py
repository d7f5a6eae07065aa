"""Bearer key validation and agent binding: the first gates, which establish who the tenant is.

``KeyValidator.authenticate`` turns an ``Authorization`` header into a :class:`Caller` (org, key, scopes, the
agents the key may act as) or raises 401. Records come from the two-tier cache over the ``SECURITY DEFINER``
lookup; revocation reaches every replica through the invalidation channel within milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from uuid import UUID

import orjson

from ibex_dataplane.proxy.cache import TieredCache
from ibex_dataplane.proxy.repository import KeyRecord, ProxyRepository
from ibex_dataplane.security.apikeys import MalformedKey, parse_token, secret_matches
from ibex_dataplane.shared.errors import ApiError
from ibex_dataplane.store.keys import GlobalKeys


@dataclass(frozen=True)
class Caller:
    key_id: str
    org_id: UUID
    scopes: frozenset[str]
    agent_ids: frozenset[UUID]


def invalid_token(message: str = "the API key is invalid") -> ApiError:
    return ApiError(401, "INVALID_TOKEN", message, headers={"WWW-Authenticate": "Bearer"})


class KeyValidator:
    def __init__(self, repo: ProxyRepository, cache: TieredCache[KeyRecord | None], pepper: bytes) -> None:
        self._repo = repo
        self._cache = cache
        self._pepper = pepper

    async def authenticate(self, authorization: str | None) -> Caller:
        if not authorization:
            raise ApiError(401, "MISSING_TOKEN", "an Authorization: Bearer API key is required",
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "MISSING_TOKEN", "an Authorization: Bearer API key is required",
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        try:
            key_id, secret = parse_token(token.strip())
        except MalformedKey:
            raise invalid_token("the API key is malformed") from None
        record = await self._cache.get(GlobalKeys.api_key(key_id), lambda: self._repo.key(key_id))
        if record is None or not secret_matches(self._pepper, secret, record.secret_hash):
            raise invalid_token()
        if record.revoked:
            raise invalid_token("the API key has been revoked")
        if record.expires_at is not None and record.expires_at <= datetime.now(UTC):
            raise invalid_token("the API key has expired")
        return Caller(record.key_id, record.org_id, record.scopes, record.agent_ids)


def encode_key(record: KeyRecord | None) -> bytes:
    """Unknown key ids are cached too (as null), so guessing ids does not reach Postgres every time."""
    return orjson.dumps(record.to_json() if record else None)


def decode_key(raw: bytes) -> KeyRecord | None:
    data = orjson.loads(raw)
    return KeyRecord.from_json(data) if data is not None else None


def require_scope(caller: Caller, scope: str) -> None:
    if scope not in caller.scopes:
        raise ApiError(403, "INSUFFICIENT_PERMISSIONS", f"this API key lacks the '{scope}' scope")
