"""Readiness: a store the proxy fails closed without makes it not ready; a store it only degrades without is
reported and leaves it ready."""

from __future__ import annotations

import orjson
import pytest
from aiohttp.test_utils import make_mocked_request

from ibex_dataplane.proxy.health import HealthChecks


async def fine() -> None:
    return None


async def down() -> None:
    raise ConnectionRefusedError


@pytest.mark.parametrize(
    ("failing", "status", "degraded"),
    [((), 200, None), (("clickhouse",), 200, ["clickhouse"]), (("postgres",), 503, None),
     (("postgres", "clickhouse"), 503, ["clickhouse"])],
)  # fmt: skip
async def test_only_critical_stores_decide_readiness(
    failing: tuple[str, ...], status: int, degraded: list[str] | None
) -> None:
    checks = {name: (down if name in failing else fine) for name in ("postgres", "redis", "clickhouse")}
    health = HealthChecks(checks, degradable=frozenset({"clickhouse"}))
    response = await health.readyz(make_mocked_request("GET", "/readyz"))
    body = orjson.loads(response.body)  # type: ignore[arg-type]
    assert response.status == status
    assert body["status"] == ("ready" if status == 200 else "not ready")
    assert body.get("degraded") == degraded
    assert {name for name, v in body["checks"].items() if v.startswith("error")} == set(failing)
