"""API key format, generation and hashing (architecture section 5). Shared by the operator, which issues keys, and
the proxy, which validates them.

Format: ``ibex_sk_<keyid>_<secret>``. ``keyid`` is a random public id (lowercase base32, no underscores);
``secret`` is 32 random bytes, url-safe base64. Only ``HMAC-SHA256(pepper, secret)`` is stored: the secret is
random, so a keyed fast hash is the right tool (a slow password hash would only add latency).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

TOKEN_PREFIX = "ibex_sk_"  # noqa: S105 - a format prefix, not a secret
_KEY_ID = re.compile(r"^[a-z2-7]{16}$")
_SECRET = re.compile(r"^[A-Za-z0-9_\-]{43}$")
_TOKEN = re.compile(r"^ibex_sk_([a-z2-7]{16})_([A-Za-z0-9_\-]{43})$")


class MalformedKey(ValueError):
    """The presented string is not an IBEX API key."""


@dataclass(frozen=True, repr=False)
class IssuedKey:
    """A freshly generated key. ``token`` is the only place the plaintext exists; it is never logged."""

    key_id: str
    secret: str

    @property
    def token(self) -> str:
        return f"{TOKEN_PREFIX}{self.key_id}_{self.secret}"

    def __repr__(self) -> str:
        return f"IssuedKey(key_id={self.key_id!r}, secret=<redacted>)"


def new_key_id() -> str:
    return base64.b32encode(secrets.token_bytes(10)).decode().lower()


def new_secret() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def generate_key(key_id: str | None = None) -> IssuedKey:
    """A new key; pass the existing ``key_id`` to rotate the secret of a key whose id must stay stable."""
    kid = key_id or new_key_id()
    if not _KEY_ID.fullmatch(kid):
        raise MalformedKey("invalid key id")
    return IssuedKey(key_id=kid, secret=new_secret())


def parse_token(token: str) -> tuple[str, str]:
    """Split a presented token into (key id, secret); raises MalformedKey without echoing the input."""
    m = _TOKEN.fullmatch(token)
    if not m:
        raise MalformedKey("not an IBEX API key")
    return m.group(1), m.group(2)


def hash_secret(pepper: bytes, secret: str) -> bytes:
    return hmac.new(pepper, secret.encode(), hashlib.sha256).digest()


def secret_matches(pepper: bytes, secret: str, stored_hash: bytes) -> bool:
    return hmac.compare_digest(hash_secret(pepper, secret), stored_hash)
