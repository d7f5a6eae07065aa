"""The internal principal: what the proxy signs is exactly what a stage verifies, and nothing else passes."""

from __future__ import annotations

import base64
import time
import uuid

import orjson
import pytest

from ibex_dataplane.security.principal import Principal, PrincipalError, PrincipalSigner, grpc_target, http_target

SECRET = b"0123456789abcdef-test-secret"
SEARCH = http_target("POST", "/v1/memories/search")


def principal(deadline_in: float = 10.0) -> Principal:
    return Principal(
        org_id=uuid.uuid4(),
        agent_id=uuid.uuid4(),
        scopes=frozenset({"memory:read", "memory:write"}),
        request_id="req-1",
        deadline=round(time.time() + deadline_in, 3),
        target=SEARCH,
    )


def test_a_signed_principal_verifies_to_the_same_claims() -> None:
    signer = PrincipalSigner(SECRET)
    p = principal()
    assert signer.verify(signer.sign(p), target=SEARCH) == p
    assert p.has("memory:read") and not p.has("memory:delete")
    assert 9 < p.remaining() <= 10.001


def test_a_principal_signed_with_another_secret_is_forged() -> None:
    token = PrincipalSigner(b"another-secret-of-16+bytes").sign(principal())
    with pytest.raises(PrincipalError, match="signature"):
        PrincipalSigner(SECRET).verify(token, target=SEARCH)


def test_changing_any_claim_breaks_the_signature() -> None:
    signer = PrincipalSigner(SECRET)
    version, payload, mac = signer.sign(principal()).split(".")
    claims = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["o"] = str(uuid.uuid4())  # act for another org
    tampered = base64.urlsafe_b64encode(orjson.dumps(claims)).decode().rstrip("=")
    with pytest.raises(PrincipalError, match="signature"):
        signer.verify(f"{version}.{tampered}.{mac}", target=SEARCH)


@pytest.mark.parametrize("token", [None, "", "v1", "v1.a.b.c", "v2.abc.def", "v1.!!!.###", "v1..", "garbage"])
def test_missing_and_malformed_tokens_are_refused(token: str | None) -> None:
    with pytest.raises(PrincipalError):
        PrincipalSigner(SECRET).verify(token, target=SEARCH)


def test_expired_and_overlong_principals_are_refused() -> None:
    signer = PrincipalSigner(SECRET, max_lifetime=60)
    with pytest.raises(PrincipalError, match="expired"):
        signer.verify(signer.sign(principal(deadline_in=-0.5)), target=SEARCH)
    with pytest.raises(PrincipalError, match="too long"):
        signer.verify(signer.sign(principal(deadline_in=3600)), target=SEARCH)
    p = principal(deadline_in=5)
    with pytest.raises(PrincipalError, match="expired"):
        signer.verify(signer.sign(p), target=SEARCH, now=p.deadline + 1)


def test_signed_but_malformed_claims_are_refused() -> None:
    signer = PrincipalSigner(SECRET)
    payload = orjson.dumps({"o": "not-a-uuid", "a": str(uuid.uuid4()), "s": [], "r": "x", "d": time.time() + 5})
    mac = signer._mac(payload)
    token = "v1.{}.{}".format(
        base64.urlsafe_b64encode(payload).decode().rstrip("="), base64.urlsafe_b64encode(mac).decode().rstrip("=")
    )
    with pytest.raises(PrincipalError, match="malformed"):
        signer.verify(token, target=SEARCH)


def test_short_secrets_are_rejected_and_errors_never_echo_the_token() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        PrincipalSigner(b"short")
    token = PrincipalSigner(b"another-secret-of-16+bytes").sign(principal())
    with pytest.raises(PrincipalError) as caught:
        PrincipalSigner(SECRET).verify(token, target=SEARCH)
    assert token not in str(caught.value)


@pytest.mark.parametrize(
    "other",
    [
        http_target("GET", "/v1/memories/search"),
        http_target("POST", "/v1/memories"),
        http_target("DELETE", "/v1/memories/0b1c"),
        grpc_target("/ibex.context.v1.ContextAssembly/Assemble"),
        "",
    ],
)
def test_a_principal_signed_for_one_call_is_refused_for_any_other(other: str) -> None:
    signer = PrincipalSigner(SECRET)
    token = signer.sign(principal())
    with pytest.raises(PrincipalError, match="another call"):
        signer.verify(token, target=other)
    assert signer.verify(token, target=SEARCH).target == SEARCH
