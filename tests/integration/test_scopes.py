"""The README's scope table is what the proxy enforces: without a route's scope the key gets 403, with it not."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from aiohttp import ClientSession

from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory

README = Path(__file__).resolve().parents[2] / "README.md"
ALL = ("chat", "memory:read", "memory:write", "memory:delete", "usage:read")


def scope_table() -> dict[str, list[tuple[str, str]]]:
    text = README.read_text()
    table = text[text.index("| scope | grants |") :].split("\n\n", 1)[0]
    rows: dict[str, list[tuple[str, str]]] = {}
    for m in re.finditer(r"^\| `([a-z:]+)` \| (.+) \|$", table, re.MULTILINE):
        rows[m.group(1)] = re.findall(r"`(GET|POST|DELETE) (/v1/[^`]+)`", m.group(2))
    return rows


def test_the_table_covers_every_scope() -> None:
    rows = scope_table()
    assert set(rows) == set(ALL) and all(rows.values())


@pytest.mark.parametrize("scope", ALL)
async def test_a_key_without_the_scope_is_refused_every_route_the_table_lists(
    proxy: RunningProxy, tenants: TenantFactory, scope: str
) -> None:
    lacking = await tenants.create(scopes=tuple(s for s in ALL if s != scope))
    having = await tenants.create(scopes=(scope,))
    async with ClientSession() as http:
        for method, path in scope_table()[scope]:
            url = proxy.base_url + re.sub(r"\{[a-z_]+\}", str(uuid.uuid4()), path)
            for t, refused in ((lacking, True), (having, False)):
                headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
                body = {} if method == "POST" else None
                async with http.request(method, url, json=body, headers=headers) as r:
                    payload = await r.json(content_type=None)
                code = payload.get("error", {}).get("code") if isinstance(payload, dict) else None
                if refused:
                    assert (r.status, code) == (403, "INSUFFICIENT_PERMISSIONS"), (method, path)
                else:
                    assert code != "INSUFFICIENT_PERMISSIONS", (method, path, payload)
