"""Shared fixtures: real embedded stores started once per test session, and tenants created per test.

Isolation between tests comes from tenancy itself: each test creates its own organizations with unique names, so
tests never see each other's rows (and a test that could would be an isolation bug).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from ibex_dataplane.runtime.embedded import EmbeddedRuntime, RuntimeInfo
from ibex_dataplane.runtime.stores import Stores, StoreUrls, migrate_all
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_operator.reconcile import Reconciler
from ibex_operator.repository import TenantConfigRepository
from ibex_operator.secrets import FileSecretSink
from tests.support.processes import child_processes
from tests.support.tenants import TenantFactory
from tests.support.watchdog import Watchdog, bound

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings(_env_file=None)  # type: ignore[call-arg]


@pytest.fixture(scope="session")
def embedded() -> Iterator[EmbeddedRuntime]:
    # Under /tmp itself rather than pytest's private (0700) temp root: as root, Postgres runs as an unprivileged
    # user that must be able to reach its data directory.
    root = Path(tempfile.mkdtemp(prefix="ibex-test-stores-"))
    runtime = EmbeddedRuntime(root)
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def runtime_info(embedded: EmbeddedRuntime) -> RuntimeInfo:
    return embedded.info


@pytest_asyncio.fixture(scope="session")
async def stores(embedded: EmbeddedRuntime, settings: Settings) -> AsyncIterator[Stores]:
    urls = StoreUrls.from_runtime(embedded.info)
    clickhouse = ClickHouse(urls.clickhouse_url)
    try:
        await migrate_all(urls, settings, clickhouse)
    finally:
        await clickhouse.close()
    opened = await Stores.open(urls, settings, admin=True)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture(scope="session")
def pepper() -> bytes:
    return secrets.token_hex(32).encode()  # printable, so subprocesses can take it as IBEX_KEY_PEPPER


@pytest.fixture(scope="session")
def secret_sink(tmp_path_factory: pytest.TempPathFactory) -> FileSecretSink:
    return FileSecretSink(tmp_path_factory.mktemp("secrets") / "secrets.json")


@pytest.fixture(scope="session")
def reconciler(stores: Stores, secret_sink: FileSecretSink, pepper: bytes) -> Reconciler:
    assert stores.admin_pool is not None
    return Reconciler(TenantConfigRepository(stores.admin_pool, stores.redis), secret_sink, pepper)


@pytest.fixture
def tenants(reconciler: Reconciler, secret_sink: FileSecretSink) -> TenantFactory:
    return TenantFactory(reconciler, secret_sink)


# -- no process outlives the suite --------------------------------------------------------------------------------
# The test process adopts orphans (Linux child subreaper), so a server or engine process a test forgot, even one
# whose parent died, is still our child at the end, where the check below fails the run.
_PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config: pytest.Config) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _watched(item: pytest.Item, phase: str) -> Watchdog:
    terminal = item.config.get_terminal_writer()
    capture = item.config.pluginmanager.getplugin("capturemanager")

    def write(text: str) -> None:
        with capture.global_and_fixture_disabled():
            terminal.write(text)
            terminal.flush()

    return Watchdog(f"{item.nodeid} ({phase})", bound(phase), write)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _watched(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _watched(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _watched(item, "teardown"):
        return (yield)


def _own_resource_tracker() -> int | None:
    """multiprocessing's tracker of this process (chdb's engine process uses it): it exits with us, by design."""
    from multiprocessing import resource_tracker

    pid: int | None = getattr(resource_tracker._resource_tracker, "_pid", None)
    return pid


def _live_children() -> list[str]:
    while True:  # reap the ones that already exited
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    tracker = _own_resource_tracker()
    return [f"{pid}: {cmdline[:160]}" for pid, cmdline in child_processes(os.getpid()) if pid != tracker]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import time

    deadline = time.monotonic() + 10  # processes stopped by the last teardowns may take a moment to exit
    left = _live_children()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for other processes to exit, not synchronizing tests
        left = _live_children()
    if left:
        print("\nprocesses left behind by the test suite:\n  " + "\n  ".join(left))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
