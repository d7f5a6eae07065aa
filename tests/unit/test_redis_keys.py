"""The Redis key builder cannot produce a tenant key without the org as its hash tag."""

from __future__ import annotations

import re
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_dataplane.store.clickhouse import org_query
from ibex_dataplane.store.errors import TenantKeyError
from ibex_dataplane.store.keys import GlobalKeys, TenantKeys

parts = st.lists(st.from_regex(r"[A-Za-z0-9_.:\-]{1,40}", fullmatch=True), min_size=1, max_size=6)


def cluster_hash_tag(key: str) -> str | None:
    """What Redis Cluster hashes: the text between the first '{' and the next '}', if non-empty."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


@given(org=st.uuids(), parts=parts)
def test_every_tenant_key_is_tagged_with_its_org(org: uuid.UUID, parts: list[str]) -> None:
    key = TenantKeys(org).key(*parts)
    assert key.startswith(f"ibex:{{{org}}}:")
    assert cluster_hash_tag(key) == str(org)
    assert key.count("{") == 1 and key.count("}") == 1


@given(org=st.uuids(), agent=st.uuids())
def test_named_tenant_keys_share_the_org_slot(org: uuid.UUID, agent: uuid.UUID) -> None:
    keys = TenantKeys(org)
    built = [
        keys.policy(),
        keys.rate_limit("agent", agent, "rpm"),
        keys.directive(agent),
        keys.hot_memories(agent),
    ]
    assert {cluster_hash_tag(k) for k in built} == {str(org)}


@pytest.mark.parametrize("org", ["", "acme", "{x}", None, "00000000-0000-0000-0000-00000000000g"])
def test_tenant_keys_refuse_anything_but_a_valid_org_id(org: object) -> None:
    with pytest.raises(TenantKeyError):
        TenantKeys(org)  # type: ignore[arg-type]


@given(bad=st.text(min_size=1, max_size=20).filter(lambda s: bool(re.search(r"[{}\s]", s))))
def test_parts_with_braces_or_spaces_cannot_forge_another_tag(bad: str) -> None:
    with pytest.raises(TenantKeyError):
        TenantKeys(uuid.uuid4()).key("rl", bad)


def test_a_tenant_key_needs_a_part_after_the_org() -> None:
    with pytest.raises(TenantKeyError):
        TenantKeys(uuid.uuid4()).key()


def test_api_key_cache_keys_are_tagged_by_the_key_id_not_an_org_and_validate_ids() -> None:
    key = GlobalKeys.api_key("abcdefgh23456723")
    assert cluster_hash_tag(key) == cluster_hash_tag(key + ":v4") == "abcdefgh23456723"  # version and value: one slot
    assert cluster_hash_tag(GlobalKeys.INVALIDATION_CHANNEL) is None
    with pytest.raises(TenantKeyError):
        GlobalKeys.api_key("x}{y")


def test_clickhouse_reads_must_filter_on_the_org() -> None:
    org = uuid.uuid4()
    q = org_query("SELECT count() FROM usage_facts WHERE org_id = {org_id:UUID} AND model = {m:String}", org, m="x")
    assert q.parameters == {"m": "x", "org_id": org}
    with pytest.raises(TenantKeyError):
        org_query("SELECT count() FROM usage_facts", org)
    with pytest.raises(TenantKeyError):
        org_query("SELECT count() FROM usage_facts WHERE org_id = {org_id:UUID}", str(org))  # type: ignore[arg-type]
