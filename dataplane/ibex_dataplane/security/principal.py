"""The internal principal: how the proxy tells the memory and context stages who a call is for (section 6.6).

A short-lived token signed with HMAC-SHA256 over a compact JSON claim set: org, agent, scopes, request id, an
absolute deadline (wall-clock epoch seconds, so it survives process boundaries) and the one call it was made for
(its *target*: an HTTP method and path of the memory stage, or a gRPC method of the context stage). Stages accept
a call only with a valid principal signed for that very call, and derive tenant scope from it alone: a principal
captured from one call cannot be replayed against another route. Format: ``v1.<base64url(claims)>.<base64url(mac)>``.
"""

from __future__ import annotations

import base64
import hmac
import time
from dataclasses import dataclass
from hashlib import sha256
from uuid import UUID

import orjson

HEADER = "X-IBEX-Principal"  # where HTTP stages read it
GRPC_METADATA = "x-ibex-principal"  # where gRPC stages read it
ASSEMBLE_METHOD = "/ibex.context.v1.ContextAssembly/Assemble"  # the context stage's one method
_VERSION = "v1"


class PrincipalError(ValueError):
    """Missing, malformed, forged or expired principal. The message never echoes the token."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Principal:
    org_id: UUID
    agent_id: UUID
    scopes: frozenset[str]
    request_id: str
    deadline: float  # epoch seconds after which the call must not run
    target: str  # the call this principal is for: see http_target() and grpc_target()

    def remaining(self, now: float | None = None) -> float:
        return self.deadline - (time.time() if now is None else now)

    def has(self, scope: str) -> bool:
        return scope in self.scopes


def http_target(method: str, path: str) -> str:
    """The target of a call to an HTTP stage: method and path (no query string)."""
    return f"http {method.upper()} {path}"


def grpc_target(full_method: str) -> str:
    """The target of a gRPC call, e.g. ``/ibex.context.v1.ContextAssembly/Assemble``."""
    return f"grpc {full_method}"


class PrincipalSigner:
    """Signs and verifies principals with one shared secret (a Kubernetes Secret, or random per local run)."""

    def __init__(self, secret: bytes, *, max_lifetime: float = 60.0) -> None:
        if len(secret) < 16:
            raise ValueError("the internal principal secret must be at least 16 bytes")
        self._secret = secret
        self._max_lifetime = max_lifetime

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, _VERSION.encode() + b"." + payload, sha256).digest()

    def sign(self, principal: Principal) -> str:
        claims = {
            "o": str(principal.org_id),
            "a": str(principal.agent_id),
            "s": sorted(principal.scopes),
            "r": principal.request_id,
            "d": round(principal.deadline, 3),
            "t": principal.target,
        }
        payload = orjson.dumps(claims)
        return f"{_VERSION}.{_b64(payload)}.{_b64(self._mac(payload))}"

    def verify(self, token: str | None, *, target: str, now: float | None = None) -> Principal:
        """The principal in ``token`` if it is well formed, authentic, unexpired and signed for ``target``."""
        if not token:
            raise PrincipalError("missing internal principal")
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _VERSION:
            raise PrincipalError("malformed internal principal")
        try:
            payload, mac = _unb64(parts[1]), _unb64(parts[2])
        except ValueError as e:
            raise PrincipalError("malformed internal principal") from e
        if not hmac.compare_digest(mac, self._mac(payload)):
            raise PrincipalError("internal principal signature is invalid")
        try:
            claims = orjson.loads(payload)
            principal = Principal(
                org_id=UUID(claims["o"]),
                agent_id=UUID(claims["a"]),
                scopes=frozenset(str(s) for s in claims["s"]),
                request_id=str(claims["r"]),
                deadline=float(claims["d"]),
                target=str(claims["t"]),
            )
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as e:
            raise PrincipalError("malformed internal principal") from e
        current = time.time() if now is None else now
        if principal.deadline <= current:
            raise PrincipalError("internal principal expired")
        if principal.deadline - current > self._max_lifetime:
            raise PrincipalError("internal principal lives too long")
        if not hmac.compare_digest(principal.target.encode(), target.encode()):
            raise PrincipalError("internal principal was signed for another call")
        return principal
