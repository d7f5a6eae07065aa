"""API key format and hashing."""

from __future__ import annotations

import pytest

from ibex_dataplane.security.apikeys import (
    MalformedKey,
    generate_key,
    hash_secret,
    parse_token,
    secret_matches,
)


def test_generated_tokens_parse_back_to_their_parts() -> None:
    key = generate_key()
    assert key.token.startswith("ibex_sk_")
    assert parse_token(key.token) == (key.key_id, key.secret)
    assert len(key.secret) >= 43  # 32 random bytes, url-safe


def test_rotation_keeps_the_key_id_and_changes_the_secret() -> None:
    first = generate_key()
    second = generate_key(first.key_id)
    assert second.key_id == first.key_id
    assert second.secret != first.secret


@pytest.mark.parametrize(
    "token",
    [
        "",
        "Bearer x",
        "ibex_sk_",
        "ibex_sk_short_secret",
        "ibex_pk_abcdefghabcdefgh_" + "a" * 43,
        "ibex_sk_ABCDEFGHABCDEFGH_" + "a" * 43,
    ],
)
def test_malformed_tokens_are_refused(token: str) -> None:
    with pytest.raises(MalformedKey):
        parse_token(token)


def test_hash_is_keyed_by_the_pepper_and_verified_in_constant_time() -> None:
    key = generate_key()
    stored = hash_secret(b"pepper-1", key.secret)
    assert secret_matches(b"pepper-1", key.secret, stored)
    assert not secret_matches(b"pepper-2", key.secret, stored)
    assert not secret_matches(b"pepper-1", generate_key().secret, stored)


def test_repr_never_shows_the_secret() -> None:
    key = generate_key()
    assert key.secret not in repr(key)


def test_a_trailing_newline_does_not_slip_through() -> None:
    key = generate_key()
    with pytest.raises(MalformedKey):
        parse_token(key.token + "\n")
