"""A data dir whose embedded stores `ibex dev` runs is taken: a second `ibex dev`, `ibex migrate` and `ibex proxy`
on its single-process ClickHouse engine stop at once and say what to do instead; so do `ibex dev` and
`ibex proxy` on a port that is taken."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ibex_dataplane import cli
from ibex_dataplane.runtime.embedded import EmbeddedRuntime, RuntimeInfo, RuntimeLock, runtime_holder
from ibex_dataplane.runtime.errors import DataDirInUse
from ibex_dataplane.runtime.stores import StoreUrls
from ibex_dataplane.settings import Settings

URL = "http://127.0.0.1:18080"


@pytest.fixture
def taken(tmp_path: Path) -> Iterator[Path]:
    """A data dir as a running `ibex dev` leaves it: runtime.json and its lock, held, with the proxy's URL."""
    RuntimeInfo(
        postgres_admin_dsn="postgresql://ibex_admin:x@127.0.0.1:1/ibex",
        postgres_app_dsn="postgresql://ibex_app:x@127.0.0.1:1/ibex",
        redis_url="redis://127.0.0.1:2/0",
        clickhouse_url=f"chdb://{tmp_path / 'clickhouse'}",
    ).write(tmp_path / "runtime.json")
    lock = RuntimeLock(tmp_path)
    lock.acquire()
    lock.announce(URL)
    try:
        yield tmp_path
    finally:
        lock.release()


def test_the_lock_names_its_holder_and_is_free_once_released(tmp_path: Path) -> None:
    assert runtime_holder(tmp_path) is None
    lock = RuntimeLock(tmp_path)
    lock.acquire()
    lock.announce(URL)
    holder = runtime_holder(tmp_path)
    assert holder is not None and (holder.pid, holder.url) == (os.getpid(), URL)
    with pytest.raises(DataDirInUse) as refused:
        RuntimeLock(tmp_path).acquire()
    assert (refused.value.pid, refused.value.url) == (os.getpid(), URL)
    lock.release()
    assert runtime_holder(tmp_path) is None
    again = RuntimeLock(tmp_path)
    again.acquire()
    again.release()


def test_the_lock_goes_with_its_process_however_it_ends(tmp_path: Path) -> None:
    """No stale lock after a crash: the kernel drops it when the holder dies."""
    code = (
        "import sys; from pathlib import Path; from ibex_dataplane.runtime.embedded import RuntimeLock;"
        f"lock = RuntimeLock(Path({str(tmp_path)!r})); lock.acquire(); print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        found = runtime_holder(tmp_path)
        assert found is not None and found.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.stdout.close()
    assert runtime_holder(tmp_path) is None


def test_a_runtime_that_finds_its_folder_taken_starts_and_stops_nothing(taken: Path) -> None:
    runtime = EmbeddedRuntime(taken)
    with pytest.raises(DataDirInUse):
        runtime.start()
    runtime.stop()
    assert (taken / "runtime.json").exists(), "the other process's runtime file was removed"
    assert not (taken / "postgres").exists() and not (taken / "valkey").exists()


def test_each_configured_store_url_wins_over_the_embedded_runtime(taken: Path) -> None:
    own = f"chdb://{taken / 'mine'}"
    urls = StoreUrls.from_settings(Settings(_env_file=None, data_dir=taken, clickhouse_url=own))  # type: ignore[call-arg]
    info = RuntimeInfo.read(taken / "runtime.json")
    assert urls == StoreUrls(info.postgres_app_dsn, info.postgres_admin_dsn, info.redis_url, own)
    elsewhere = "postgresql://app@db.example/ibex"
    urls = StoreUrls.from_settings(Settings(_env_file=None, data_dir=taken, postgres_dsn=elsewhere))  # type: ignore[call-arg]
    assert (urls.postgres_app_dsn, urls.postgres_admin_dsn) == (elsewhere, None)  # not the embedded admin DSN


Run = Callable[..., tuple[int, str]]


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """``ibex <argv>`` in this process with ``env`` set: its exit code and what it printed on stderr."""
    monkeypatch.setattr(cli, "_configure_logging", lambda settings: None)  # keep the test process's logging as is

    def invoke(*argv: str, **env: str) -> tuple[int, str]:
        for name in ("IBEX_POSTGRES_DSN", "IBEX_REDIS_URL", "IBEX_CLICKHOUSE_URL", "IBEX_PROVIDERS_FILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code = cli.main(list(argv))
        return code, capsys.readouterr().err

    return invoke


def test_migrate_beside_ibex_dev_says_it_already_migrated(taken: Path, run: Run) -> None:
    code, err = run("migrate", IBEX_DATA_DIR=str(taken))
    assert code == 2
    assert f"`ibex dev` (pid {os.getpid()}, serving {URL}) runs the embedded stores of {taken}" in err
    assert "applied every pending migration when it started" in err
    assert "stop `ibex dev` and start it again" in err


def test_a_proxy_beside_ibex_dev_on_its_clickhouse_says_how_to_run_one(taken: Path, run: Run) -> None:
    code, err = run("proxy", "--data-dir", str(taken))
    assert code == 2
    assert "holds the embedded ClickHouse engine" in err and "could never become ready" in err
    assert "IBEX_CLICKHOUSE_URL=http://" in err and "chdb:///another/folder" in err
    own = Settings(_env_file=None, data_dir=taken, clickhouse_url=f"chdb://{taken / 'mine'}")  # type: ignore[call-arg]
    assert cli._engine_holder(own, StoreUrls.from_settings(own)) is None  # its own engine: allowed


def test_a_second_ibex_dev_on_the_same_data_dir_stops_before_starting_anything(taken: Path, run: Run) -> None:
    before = json.loads((taken / "runtime.json").read_text())
    code, err = run("dev", "--data-dir", str(taken), "--port", "0")
    assert code == 2
    assert f"`ibex dev` (pid {os.getpid()}, serving {URL}) is already running on {taken}" in err
    assert "another --data-dir" in err
    assert json.loads((taken / "runtime.json").read_text()) == before


@pytest.mark.parametrize("command", ["dev", "proxy"])
def test_a_busy_port_stops_dev_and_proxy_before_anything_starts(tmp_path: Path, run: Run, command: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = run(command, "--data-dir", str(tmp_path / "data"), "--host", "127.0.0.1", "--port", str(port))
    assert code == 2
    assert f"ibex {command}: cannot listen on 127.0.0.1:{port}" in err and "--port 0 picks a free one" in err
    assert not (tmp_path / "data").exists()


def test_a_proxy_worker_starts_on_the_port_its_siblings_already_listen_on(taken: Path, run: Run) -> None:
    """`ibex proxy --workers N`: the supervisor reserves the port and each worker binds it with SO_REUSEPORT; a
    worker that starts after a sibling listens is not refused the port (it goes on to its next check, here the
    ClickHouse engine `ibex dev` holds)."""
    with socket.socket() as placeholder, socket.socket() as sibling:
        for sock in (placeholder, sibling):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
        sibling.bind(("127.0.0.1", port))
        sibling.listen()
        worker = ["--worker-run-dir", str(taken / "run"), "--worker-fds", "98,99"]
        code, err = run("proxy", "--data-dir", str(taken), "--host", "127.0.0.1", "--port", str(port), *worker)
        assert "cannot listen on" not in err
        assert code == 2 and "holds the embedded ClickHouse engine" in err
        code, err = run("proxy", "--data-dir", str(taken), "--host", "127.0.0.1", "--port", str(port))
    assert code == 2 and f"ibex proxy: cannot listen on 127.0.0.1:{port}" in err  # not a worker: refused
