"""`ibex proxy --workers 2`: both workers serve, gates and accounting hold in total, metrics and analytics are
merged, SIGTERM drains and stops every worker, and a worker that dies stops the proxy with exit code 1.

The proxy runs as a real process tree on the suite's Postgres and Valkey, with an embedded ClickHouse of its own
(the suite's engine is open in this process's engine child; chdb opens a data path in one process only), which
the supervisor serves to both workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession, TCPConnector, web
from prometheus_client.parser import text_string_to_metric_families

from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.tokens import TokenizerFamily, estimate_chat_tokens
from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.store.clickhouse import ENGINE_NICE, ClickHouse
from ibex_dataplane.store.migrations import default_migrations_dir, migrate_clickhouse
from tests.integration.test_clickhouse_priority import thread_nices
from tests.integration.test_dashboard import WORKER_ONLY, queried
from tests.integration.test_proxy_replicas import post_chat, start_of_a_fresh_window
from tests.support.processes import IbexProcess, child_processes, ibex_process
from tests.support.tenants import TenantFactory
from tests.support.waiting import until

MESSAGES = [{"role": "user", "content": "what does this cost?"}]


async def migrated_chdb(folder: Path) -> str:
    url = f"chdb://{folder}"
    clickhouse = ClickHouse(url)
    try:
        await migrate_clickhouse(clickhouse, default_migrations_dir() / "clickhouse")
    finally:
        await clickhouse.close()  # releases the data path for the proxy's supervisor
    return url


@contextmanager
def workers_proxy(
    embedded: EmbeddedRuntime, pepper: bytes, clickhouse_url: str, **extra_env: str
) -> Iterator[IbexProcess]:
    env = {
        **os.environ, "IBEX_KEY_PEPPER": pepper.decode(), "IBEX_LOG_LEVEL": "WARNING",
        "IBEX_CLICKHOUSE_URL": clickhouse_url, "IBEX_ANALYTICS_FLUSH_SECONDS": "0.2", **extra_env,
    }  # fmt: skip
    args = ["proxy", "--workers", "2", "--data-dir", str(embedded.data_dir), "--port", "0"]
    with ibex_process(args, env) as running:
        yield running


def worker_pids(supervisor: int) -> set[int]:
    return {pid for pid, cmdline in child_processes(supervisor) if "--worker-run-dir" in cmdline}


def is_gone(pid: int) -> bool:
    """No process ``pid`` any more (reaping it if it was orphaned to us: the suite is the subreaper)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass  # not our child (yet): a worker of a live supervisor
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run_dir_of(supervisor: int) -> Path:
    (cmdline, *_) = [c for _, c in child_processes(supervisor) if "--worker-run-dir" in c]
    return Path(cmdline.split("--worker-run-dir ", 1)[1].split()[0])


@pytest_asyncio.fixture(scope="module")
async def proxy(
    embedded: EmbeddedRuntime, stores: Stores, pepper: bytes, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[IbexProcess]:
    url = await migrated_chdb(tmp_path_factory.mktemp("workers") / "clickhouse")
    with workers_proxy(embedded, pepper, url) as running:
        yield running
        assert running.proc.poll() is None, "the proxy died during the tests"


async def scrape(http: ClientSession, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def per_worker(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[int, float]:
    return {
        int(dict(labels)["pid"]): value
        for (name, labels), value in samples.items()
        if name == "ibex_proxy_worker_requests"
    }


def fresh_connections() -> ClientSession:
    """A client that opens a new connection for every request, so the kernel spreads them over the workers."""
    return ClientSession(connector=TCPConnector(force_close=True))


async def test_requests_spread_over_both_workers_and_every_worker_shows_the_merged_metrics(
    proxy: IbexProcess,
) -> None:
    pids = worker_pids(proxy.proc.pid)
    assert len(pids) == 2
    healthz = ("ibex_proxy_request_duration_seconds_count", (("route", "/healthz"), ("status", "200")))
    async with fresh_connections() as http:
        before = await scrape(http, proxy.url)
        for _ in range(40):
            async with http.get(proxy.url + "/healthz") as r:
                assert r.status == 200
        # A worker moves what it gathered into the shared files once a second (and before it renders): scrape
        # until the other worker's share is in, then every scrape must show all of it.
        deadline = time.monotonic() + 30
        while (await scrape(http, proxy.url)).get(healthz, 0) - before.get(healthz, 0) < 40:
            assert time.monotonic() < deadline, "the workers' request counts never reached 40"
        scrapes = [await scrape(http, proxy.url) for _ in range(20)]
    # Each worker finished some of the requests (SO_REUSEPORT spread the connections)...
    served = {pid: value - per_worker(before).get(pid, 0) for pid, value in per_worker(scrapes[0]).items()}
    assert set(served) == pids
    assert all(n > 0 for n in served.values()), served
    assert sum(served.values()) >= 40  # the scrapes since are counted too
    # ...and every scrape, whichever worker answered it, counts all 40 of them.
    # (A worker rendering only its own values would show fewer: each served fewer than 40.)
    assert {s.get(healthz, 0) - before.get(healthz, 0) for s in scrapes} == {40}


async def test_the_dashboards_per_worker_series_are_in_a_workers_scrape(proxy: IbexProcess) -> None:
    """The chart's dashboard plots series only several workers export (test_dashboard checks the rest)."""
    async with fresh_connections() as http:
        names = {name for name, _ in await scrape(http, proxy.url)}
    assert queried() >= WORKER_ONLY and names >= WORKER_ONLY


async def test_requests_without_a_valid_key_are_refused_with_the_envelope(proxy: IbexProcess) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    async with fresh_connections() as http:
        for i in range(6):
            headers = {"Authorization": "Bearer ibex_not-a-key"} if i % 2 else {}
            async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 401
                error = (await r.json())["error"]
            assert error["code"] == ("INVALID_TOKEN" if i % 2 else "MISSING_TOKEN") and error["request_id"]


async def test_a_chat_completion_answers_on_either_worker(proxy: IbexProcess, tenants: TenantFactory) -> None:
    t = await tenants.create(agents=("solo",), agent_spec={"memory": {"enabled": False}})
    headers = {"Authorization": f"Bearer {t.keys['solo']}", "X-IBEX-Agent-ID": str(t.agents["solo"])}
    async with fresh_connections() as http:
        for _ in range(6):
            body = {"model": "echo", "messages": [{"role": "user", "content": "Hello there"}]}
            async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
                reply = await r.json()
            assert "Hello there" in reply["choices"][0]["message"]["content"]


async def test_the_supervisor_serves_the_engine_at_the_lowest_priority_and_nothing_else_runs_at_it(
    proxy: IbexProcess, tenants: TenantFactory
) -> None:
    t = await tenants.create(agents=("solo",), agent_spec={"memory": {"enabled": False}})
    headers = {"Authorization": f"Bearer {t.keys['solo']}", "X-IBEX-Agent-ID": str(t.agents["solo"])}
    async with fresh_connections() as http:  # its analytics row makes a worker's flush call the engine
        body = {"model": "echo", "messages": [{"role": "user", "content": "Hello there"}]}
        async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200

    async def engine_lowered() -> bool:
        return ENGINE_NICE in thread_nices(proxy.proc.pid).values()

    await until(engine_lowered, "the supervisor's engine threads at the lowest priority")
    default = os.getpriority(os.PRIO_PROCESS, 0)  # what the proxy's processes inherit from this one
    assert default != ENGINE_NICE
    assert thread_nices(proxy.proc.pid)[proxy.proc.pid] == default  # the supervisor's own thread
    workers = worker_pids(proxy.proc.pid)
    assert len(workers) == 2
    for pid in workers:
        assert set(thread_nices(pid).values()) == {default}


async def test_two_workers_never_admit_more_than_the_rpm_limit_in_total(
    proxy: IbexProcess, tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(agents=("busy",), agent_spec={"limits": {"requestsPerMinute": 25}})
    token, agent = t.keys["busy"], str(t.agents["busy"])
    await start_of_a_fresh_window(stores)
    async with fresh_connections() as http:
        before = per_worker(await scrape(http, proxy.url))
        statuses = await asyncio.gather(*(post_chat(http, proxy.url, token, agent) for _ in range(80)))
        after = per_worker(await scrape(http, proxy.url))
    assert Counter(statuses) == {200: 25, 429: 55}
    assert all(after[pid] - before.get(pid, 0) > 0 for pid in after), "one worker served every request"


async def test_a_budget_for_ten_admits_ten_across_workers_and_usage_reports_them(
    proxy: IbexProcess, tenants: TenantFactory, stores: Stores
) -> None:
    prompt = estimate_chat_tokens(MESSAGES, TokenizerFamily.GENERIC).tokens
    limit = ModelCatalog.builtin().worst_case_cost("echo", prompt, 1) * 10
    spec = {"budget": {"monthlyLimitUSD": format(limit, "f")}, "memory": {"enabled": False}}
    t = await tenants.create(agents=("spender",), directive=None, agent_spec=spec)
    headers = {"Authorization": f"Bearer {t.keys['spender']}", "X-IBEX-Agent-ID": str(t.agents["spender"])}
    body = {"model": "echo", "messages": MESSAGES, "max_tokens": 1}

    async def one(http: ClientSession) -> int:
        async with http.post(proxy.url + "/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status

    async with fresh_connections() as http:
        assert Counter(await asyncio.gather(*(one(http) for _ in range(50)))) == {200: 10, 402: 40}

        assert stores.admin_pool is not None
        admin = stores.admin_pool

        async def settled() -> bool:
            async with admin.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT spent_usd, held_usd FROM budget_periods WHERE org_id = $1 AND scope_id = $2",
                    t.org_id, t.agents["spender"],
                )  # fmt: skip
            return row is not None and row["spent_usd"] == limit and row["held_usd"] == 0

        await until(settled, "the ten holds settled to the limit")

        # The usage facts of both workers reach the supervisor's one embedded engine, and either worker reads them.
        report: dict[str, Any] = {}

        async def reported() -> bool:
            nonlocal report
            async with http.get(proxy.url + "/v1/usage", headers=headers) as r:
                assert r.status == 200
                report = await r.json()
            return bool(report["data"]) and report["data"][0]["requests"] == 10

        await until(reported, "usage of the ten answered requests")
    [row] = report["data"]
    assert row["key"] == str(t.agents["spender"]) and Decimal(row["cost_usd"]) == limit


# -- stopping ----------------------------------------------------------------------------------------------------


@asynccontextmanager
async def gated_upstream() -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event, list[int]]]:
    """An OpenAI-format upstream whose answers wait for ``release``.

    ``arrived`` is set by the first request; ``callers`` gets the client port of each request's connection.
    """
    arrived, release, callers = asyncio.Event(), asyncio.Event(), list[int]()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        assert request.transport is not None
        callers.append(request.transport.get_extra_info("peername")[1])
        arrived.set()
        await release.wait()
        return web.json_response({
            "id": "chatcmpl-gated", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "late"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        })  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1", arrived, release, callers
    finally:
        release.set()
        await runner.cleanup()


def owner_of_port(pids: Iterable[int], port: int) -> int:
    """Which of ``pids`` holds the local TCP socket bound to ``port`` (read from ``/proc``)."""
    inodes = set[str]()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    owners = [pid for pid in pids for fd in Path(f"/proc/{pid}/fd").iterdir() if _link(fd) in inodes]
    assert len(set(owners)) == 1, f"port {port} is held by {owners}"
    return owners[0]


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except FileNotFoundError:  # closed while listed
        return ""


async def refuses_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        _, writer = await asyncio.open_connection(host, int(port))
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # queued on a listener that closed meanwhile: another may still listen, ask again
        return False
    writer.close()
    await writer.wait_closed()
    return False


async def test_sigterm_lets_an_in_flight_request_finish_then_stops_every_worker_with_exit_0(
    embedded: EmbeddedRuntime, stores: Stores, pepper: bytes, tenants: TenantFactory, tmp_path: Path
) -> None:
    url = await migrated_chdb(tmp_path / "clickhouse")
    async with gated_upstream() as (upstream, arrived, release, callers):
        providers = tmp_path / "providers.json"
        providers.write_text(json.dumps({
            "models": [{"name": "gated", "provider": "gated", "context_window": 8192, "max_output_tokens": 64,
                        "input_price_per_mtok": "1", "output_price_per_mtok": "2"}],
            "providers": {"gated": {"type": "openai_compat", "base_url": upstream,
                                    "api_key_env": "IBEX_TEST_GATED_KEY"}},
        }))  # fmt: skip
        t = await tenants.create(agents=("slow",), agent_spec={"memory": {"enabled": False}})
        headers = {"Authorization": f"Bearer {t.keys['slow']}", "X-IBEX-Agent-ID": str(t.agents["slow"])}
        extra = {"IBEX_PROVIDERS_FILE": str(providers), "IBEX_TEST_GATED_KEY": uuid.uuid4().hex}
        with workers_proxy(embedded, pepper, url, **extra) as running:
            pids = worker_pids(running.proc.pid)
            assert len(pids) == 2
            async with ClientSession() as http:
                body = {"model": "gated", "messages": [{"role": "user", "content": "take your time"}]}

                async def slow() -> tuple[int, dict[str, Any]]:
                    async with http.post(running.url + "/v1/chat/completions", json=body, headers=headers) as r:
                        return r.status, await r.json()

                in_flight = asyncio.create_task(slow())
                await until(lambda: _is_set(arrived), "the request to reach the upstream")
                busy = owner_of_port(pids, callers[0])
                running.proc.send_signal(signal.SIGTERM)
                # Both workers closed their listeners while the busy one still holds the request open (the idle one
                # may already have exited: it has nothing to wait for).
                await until(lambda: refuses_connections(running.url), "every worker to stop listening")
                assert running.proc.poll() is None and not is_gone(busy)
                release.set()
                status, reply = await in_flight
            assert status == 200 and reply["choices"][0]["message"]["content"] == "late"
            code = await asyncio.to_thread(running.proc.wait, 60)
    assert code == 0, "".join(running.output)
    assert all(is_gone(pid) for pid in pids)


async def _is_set(event: asyncio.Event) -> bool:
    return event.is_set()


async def test_a_worker_that_dies_stops_the_other_and_the_proxy_exits_1(
    embedded: EmbeddedRuntime, stores: Stores, pepper: bytes, tmp_path: Path
) -> None:
    url = await migrated_chdb(tmp_path / "clickhouse")
    with workers_proxy(embedded, pepper, url) as running:
        pids = worker_pids(running.proc.pid)
        assert len(pids) == 2
        victim, survivor = sorted(pids)
        os.kill(victim, signal.SIGKILL)
        try:
            code = await asyncio.to_thread(running.proc.wait, 60)
        except subprocess.TimeoutExpired:
            pytest.fail("the proxy kept running without one of its workers")
        assert running.proc.stdout is not None
        output = "".join(running.output) + running.proc.stdout.read()
    assert code == 1, output
    assert f"worker {victim} was killed by SIGKILL; stopping the others and exiting 1" in output
    assert is_gone(survivor) and is_gone(victim)


async def test_sigint_stops_every_worker_too_and_the_run_folder_is_removed(
    embedded: EmbeddedRuntime, stores: Stores, pepper: bytes, tmp_path: Path
) -> None:
    url = await migrated_chdb(tmp_path / "clickhouse")
    with workers_proxy(embedded, pepper, url) as running:
        pids = worker_pids(running.proc.pid)
        run_dir = run_dir_of(running.proc.pid)
        assert len(pids) == 2 and (run_dir / "metrics").is_dir() and (run_dir / "engine.sock").exists()
        running.proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(running.proc.wait, 60)
    assert code == 0, "".join(running.output)
    assert all(is_gone(pid) for pid in pids) and not run_dir.exists()


async def test_the_workers_of_a_killed_supervisor_stop_on_their_own(
    embedded: EmbeddedRuntime, stores: Stores, pepper: bytes, tmp_path: Path
) -> None:
    url = await migrated_chdb(tmp_path / "clickhouse")
    with workers_proxy(embedded, pepper, url) as running:
        pids = worker_pids(running.proc.pid)
        run_dir = run_dir_of(running.proc.pid)
        assert len(pids) == 2
        running.proc.kill()
        await asyncio.to_thread(running.proc.wait, 60)
        shutil.rmtree(run_dir)  # a killed supervisor cannot remove it

        async def orphans_gone() -> bool:
            return all(is_gone(pid) for pid in pids)

        await until(orphans_gone, "the orphaned workers to exit")
