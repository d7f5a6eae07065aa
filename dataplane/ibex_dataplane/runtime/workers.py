"""``ibex proxy --workers N``: one supervisor process and N proxy worker processes that share one port.

Called by the CLI (the composition root), which builds each worker's command line. The supervisor opens no store
and runs no event loop: it reserves the port (a socket bound with SO_REUSEPORT, never listening, so ``--port 0``
resolves to one real port before any worker starts), starts the workers as fresh interpreters (spawned, never
forked), each of which binds its own listening socket on that port with SO_REUSEPORT, so the kernel spreads new
connections over them. It prints the ``ibex proxy ready`` line once, after every worker reported ready.

- **Stopping**: SIGTERM or SIGINT to the supervisor is passed to every worker as SIGTERM; each stops as a single
  proxy does (closes its listener, finishes its in-flight requests, drains its after-answer work); the supervisor
  exits 0 when all exited 0.
- **A worker that dies** (killed, crashed, or failing its start) is not restarted: the supervisor stops the others
  the same graceful way and exits 1, so the pod (or whoever runs it) restarts the whole proxy with every worker.
- **Metrics**: workers run prometheus_client's multiprocess mode in a per-run folder (``PROMETHEUS_MULTIPROC_DIR``,
  set before they start); the supervisor marks each exited worker dead there (its live gauges disappear; its
  counts stay in the sums).
- **Embedded ClickHouse** (``chdb://``): a data path opens in one process only, so the supervisor opens it and
  serves it to the workers over a Unix socket in the per-run folder (mode 0700), authenticated with a random key
  (:class:`~ibex_dataplane.store.clickhouse.EngineServer`). With a ClickHouse server each worker has its own client.
- **Orphans**: each worker holds the read end of a pipe the supervisor keeps open; if the supervisor is killed,
  the pipe closes and the worker stops gracefully on its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from ibex_dataplane.store.clickhouse import EngineAddress, EngineServer

log = logging.getLogger(__name__)

_CONFIG = "worker.json"


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by this process's cgroup CPU quota (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``), if any."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on (its affinity), capped by the cgroup CPU quota rounded up; at least 1."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(1, count)


@dataclass(frozen=True)
class WorkerContext:
    """What a worker learns from its supervisor's per-run folder."""

    metrics_dir: Path
    engine: EngineAddress | None  # the supervisor's embedded ClickHouse, when the URL is chdb://

    @classmethod
    def read(cls, run_dir: Path) -> WorkerContext:
        config = json.loads((run_dir / _CONFIG).read_text())
        engine = None
        if config["engine_socket"]:
            engine = EngineAddress(config["engine_socket"], bytes.fromhex((run_dir / "engine.key").read_text()))
        return cls(Path(config["metrics_dir"]), engine)


@dataclass(frozen=True)
class WorkerLaunch:
    """How the CLI must start one worker: listen on ``port`` with SO_REUSEPORT, read ``run_dir``, write a line to
    ``ready_fd`` once listening, and stop when ``lifeline_fd`` reaches end of file."""

    port: int
    run_dir: Path
    ready_fd: int
    lifeline_fd: int


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    ready_fd: int
    lifeline_fd: int  # the supervisor's (write) end
    ready: bool = False
    returncode: int | None = None


def _reserve(host: str, port: int) -> tuple[socket.socket, int]:
    """Bind (without listening) a SO_REUSEPORT socket: it fixes the port and keeps other programs off it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock, sock.getsockname()[1]


def _describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def supervise(
    workers: int,
    host: str,
    port: int,
    command: Callable[[WorkerLaunch], Sequence[str]],
    *,
    engine_url: str | None = None,
) -> int:
    """Run ``workers`` proxy workers until SIGTERM/SIGINT (exit 0) or until one dies (exit 1). ``command`` gives a
    worker's command line; ``engine_url``: a ``chdb://`` URL this process serves to the workers."""
    run_dir = Path(tempfile.mkdtemp(prefix="ibex-proxy-"))  # mode 0700: the engine socket and its key live here
    metrics_dir = run_dir / "metrics"
    metrics_dir.mkdir()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)
    previous = {s: signal.getsignal(s) for s in handled}

    def note(signum: int, frame: FrameType | None) -> None:
        """The signal's number reaches the loop through the wake-up pipe."""

    previous_wakeup = signal.set_wakeup_fd(wake_w)
    for s in handled:
        signal.signal(s, note)
    placeholder: socket.socket | None = None
    engine: EngineServer | None = None
    running: list[_Worker] = []
    try:
        placeholder, port = _reserve(host, port)
        address: EngineAddress | None = None
        if engine_url is not None:
            address = EngineAddress(str(run_dir / "engine.sock"), secrets.token_bytes(32))
            key_fd = os.open(run_dir / "engine.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(key_fd, "w") as f:
                f.write(address.authkey.hex())
            engine = EngineServer(engine_url, address)
            engine.start()
        config = {"metrics_dir": str(metrics_dir), "engine_socket": address.path if address else None}
        (run_dir / _CONFIG).write_text(json.dumps(config))
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        for _ in range(workers):
            ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
            life_r, life_w = os.pipe2(os.O_CLOEXEC)
            try:
                argv = command(WorkerLaunch(port, run_dir, ready_w, life_r))
                proc = subprocess.Popen(list(argv), env=env, pass_fds=(ready_w, life_r))
            except BaseException:
                for fd in (ready_r, life_w):
                    os.close(fd)
                raise
            finally:
                os.close(ready_w)
                os.close(life_r)
            running.append(_Worker(proc, ready_r, life_w))
        return _run(running, host, port, placeholder, wake_r, metrics_dir)
    finally:
        for w in running:
            if w.proc.poll() is None:  # only when the supervisor itself failed: never leave a worker behind
                w.proc.kill()
                w.proc.wait()
            for fd in (w.ready_fd, w.lifeline_fd):
                with contextlib.suppress(OSError):  # already closed
                    os.close(fd)
        if placeholder is not None:
            placeholder.close()
        if engine is not None:
            engine.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_wakeup)
        os.close(wake_r)
        os.close(wake_w)
        shutil.rmtree(run_dir, ignore_errors=True)


def _run(
    workers: list[_Worker], host: str, port: int, placeholder: socket.socket, wake_r: int, metrics_dir: Path
) -> int:
    from prometheus_client.multiprocess import mark_process_dead

    selector = selectors.DefaultSelector()
    selector.register(wake_r, selectors.EVENT_READ)
    for w in workers:
        selector.register(w.ready_fd, selectors.EVENT_READ, w)
    stopping = False
    code = 0

    def stop_all() -> None:
        for w in workers:
            if w.returncode is None:
                w.proc.send_signal(signal.SIGTERM)

    while any(w.returncode is None for w in workers):
        for key, _ in selector.select():
            if key.fd == wake_r:
                try:
                    received = os.read(wake_r, 512)
                except BlockingIOError:
                    received = b""
                if not stopping and {signal.SIGTERM, signal.SIGINT} & set(received):
                    stopping = True
                    print("ibex proxy: stopping every worker", file=sys.stderr, flush=True)
                    stop_all()
                continue
            w = key.data
            selector.unregister(key.fd)
            w.ready = bool(os.read(key.fd, 64))  # empty: it exited before it was ready (seen when reaped)
            if w.ready and all(x.ready for x in workers) and not stopping:
                placeholder.close()  # every worker listens on the port now
                pids = ", ".join(str(x.proc.pid) for x in workers)
                print(f"ibex proxy ready: http://{host}:{port} ({len(workers)} workers: {pids})", flush=True)
        for w in workers:
            if w.returncode is not None or w.proc.poll() is None:
                continue
            w.returncode = w.proc.returncode
            mark_process_dead(w.proc.pid, str(metrics_dir))  # type: ignore[no-untyped-call]
            if not stopping:
                print(
                    f"ibex proxy: worker {w.proc.pid} {_describe(w.returncode)}; stopping the others and exiting 1"
                    " (workers are not restarted: let the pod restart the proxy)",
                    file=sys.stderr,
                    flush=True,
                )
                stopping, code = True, 1
                stop_all()
            elif w.returncode != 0:
                log.warning("worker %s %s while stopping", w.proc.pid, _describe(w.returncode))
                code = 1
    selector.close()
    return code
