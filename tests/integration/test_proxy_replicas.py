"""Two proxy processes sharing the stores: limits hold in total, and revocation reaches both within a second."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import ClientSession

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from ibex_operator.models import ApiKeySpec
from ibex_operator.reconcile import Reconciler
from tests.support.processes import ibex_process
from tests.support.tenants import NAMESPACE, TenantFactory


@contextmanager
def proxy_process(
    embedded: EmbeddedRuntime, pepper: bytes, clickhouse: Path
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    # The suite's embedded ClickHouse opens in one process only: each replica gets an engine of its own.
    env = {
        **os.environ, "IBEX_KEY_PEPPER": pepper.decode(), "IBEX_LOG_LEVEL": "WARNING",
        "IBEX_CLICKHOUSE_URL": f"chdb://{clickhouse}",
    }  # fmt: skip
    with ibex_process(["proxy", "--data-dir", str(embedded.data_dir), "--port", "0"], env) as running:
        yield running.proc, running.url


@pytest_asyncio.fixture(scope="module")
async def replicas(
    embedded: EmbeddedRuntime, stores: Stores, pepper: bytes, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[str]]:
    scratch = tmp_path_factory.mktemp("replicas")
    with (
        proxy_process(embedded, pepper, scratch / "clickhouse-a") as (a, url_a),
        proxy_process(embedded, pepper, scratch / "clickhouse-b") as (b, url_b),
    ):
        yield [url_a, url_b]
        assert a.poll() is None and b.poll() is None, "a replica died during the test"


async def post_chat(http: ClientSession, url: str, token: str, agent: str) -> int:
    body = {"model": "echo", "messages": [{"role": "user", "content": "count me"}]}
    headers = {"Authorization": f"Bearer {token}", "X-IBEX-Agent-ID": agent}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def start_of_a_fresh_window(stores: Stores, margin: float = 20.0) -> None:
    """Limits count per minute of the Redis clock: start where the burst cannot straddle a window boundary."""
    while True:
        seconds, micros = await stores.redis.time()
        if (seconds % 60) + micros / 1e6 < 60 - margin:
            return
        await asyncio.sleep(0.25)  # waiting for a clock reading, not for another task


async def test_two_processes_never_admit_more_than_the_rpm_limit_in_total(
    replicas: list[str], tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("busy",), agent_spec={"limits": {"requestsPerMinute": 25}})
    token, agent = t.keys["busy"], str(t.agents["busy"])
    await start_of_a_fresh_window(stores)
    async with ClientSession() as http:
        statuses = await asyncio.gather(
            *(post_chat(http, replicas[i % 2], token, agent) for i in range(80))
        )  # fmt: skip
    assert Counter(statuses) == {200: 25, 429: 55}


async def test_revocation_reaches_another_process_within_a_second(
    replicas: list[str], tenants: TenantFactory, reconciler: Reconciler
) -> None:
    t = await tenants.create(agents=("solo",))
    token, agent = t.keys["solo"], str(t.agents["solo"])
    suffix = t.name.removeprefix("org-")
    async with ClientSession() as http:
        assert [await post_chat(http, url, token, agent) for url in replicas] == [200, 200]
        spec = ApiKeySpec.model_validate(
            {"organizationRef": {"name": t.name}, "agentRefs": [{"name": f"solo-{suffix}"}], "scopes": ["chat"],
             "secretName": f"solo-key-{suffix}", "revoked": True}
        )  # fmt: skip
        await reconciler.api_key(NAMESPACE, f"solo-key-{suffix}", spec, generation=2)
        revoked = time.monotonic()
        pending = set(replicas)
        while pending:
            for url in list(pending):
                if await post_chat(http, url, token, agent) == 401:
                    pending.discard(url)
            assert time.monotonic() - revoked < 1.0, f"still accepted by {pending} after 1 s"
            await asyncio.sleep(0.02)
