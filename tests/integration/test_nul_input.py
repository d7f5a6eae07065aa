"""NUL characters (which Postgres text cannot hold) are refused at the edge with a 400 naming the field, or are a
404 where they can only name nothing; never a 500, and nothing is written."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import ClientSession

from ibex_dataplane.runtime.stores import Stores
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("POST", "/v1/memories", {"content": "\u0000"}, 400, "content"),
    ("POST", "/v1/memories", {"content": "ok", "metadata": {"k": "a\u0000b"}}, 400, "metadata.k"),
    ("POST", "/v1/memories", {"content": "ok", "metadata": {"\u0000": 1}}, 400, "metadata.\u0000"),
    ("POST", "/v1/memories", {"content": "ok", "labels": ["x\u0000"]}, 400, "labels[0]"),
    ("POST", "/v1/memories:batch", {"items": [{"content": "fine"}, {"content": "\u0000"}]}, 400, "items[1].content"),
    ("POST", "/v1/memories/search", {"query": "tea\u0000"}, 400, "query"),
    ("POST", "/v1/sessions/%00/terminate", None, 404, None),
    ("POST", "/v1/sessions/a%00b/terminate", None, 404, None),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "field"), CASES)
async def test_nul_characters_get_a_clear_client_error_and_write_nothing(
    proxy: RunningProxy, tenants: TenantFactory, stores: Stores,
    method: str, path: str, body: Any, status: int, field: str | None,
) -> None:  # fmt: skip
    t = await tenants.create()
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    async with ClientSession() as http, http.request(method, proxy.base_url + path, json=body, headers=headers) as r:
        payload = await r.json()
    assert r.status == status, payload
    if field is not None:
        assert payload["error"]["code"] == "VALIDATION_ERROR"
        assert payload["error"]["field_errors"] == [{"field": field, "message": "contains NUL"}]
    async with stores.db.tenant(t.org_id, t.agents["alpha"]) as conn:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0
