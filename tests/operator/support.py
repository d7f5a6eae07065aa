"""Helpers for the operator tests: kubectl without blocking the event loop, waiting for conditions, and running
the operator either in-process (a thread with its own event loop, sharing the session's ClickHouse engine) or as
a real ``ibex operator`` subprocess that a test can kill."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.runtime.stores import Stores, StoreUrls
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_operator import app
from ibex_operator.health import OperatorState
from ibex_operator.options import OperatorOptions

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
API = "ibex.dev/v1alpha1"


# -- kubectl -------------------------------------------------------------------------------------------------------
async def kubectl(
    kube: KubeApiserver, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """kubectl as an asyncio subprocess, so an operator in this event loop keeps running meanwhile."""
    cmd = [str(kube.kubectl_path), "--kubeconfig", str(kube.kubeconfig), *args]
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=kube.env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(input.encode() if input is not None else None), timeout)
    result = subprocess.CompletedProcess(cmd, proc.returncode or 0, out.decode(), err.decode())
    if check and result.returncode != 0:
        raise AssertionError(
            f"kubectl {shlex.join(args)} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def resource(kind: str, name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API, "kind": kind, "metadata": {"name": name, "namespace": namespace}, "spec": spec}


async def apply(kube: KubeApiserver, *objs: dict[str, Any]) -> None:
    await kubectl(kube, "apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all(objs))


async def get(kube: KubeApiserver, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    out = await kubectl(kube, "-n", namespace, "get", kind, name, "-o", "json", "--ignore-not-found")
    return json.loads(out.stdout) if out.stdout.strip() else None


def condition(obj: dict[str, Any] | None, type_: str = "Ready") -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return None


async def wait_until(
    probe: Callable[[], Awaitable[T | None]], *, timeout: float = 30, interval: float = 0.2, what: str = "condition"
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


async def wait_condition(
    kube: KubeApiserver,
    kind: str,
    name: str,
    namespace: str,
    *,
    status: str = "True",
    reason: str | None = None,
    generation: int | None = None,
    timeout: float = 30,
) -> dict[str, Any]:
    """Wait until Ready has ``status`` (and ``reason``), observed at ``generation`` when given; returns the object."""
    last: dict[str, Any] = {}

    async def probe() -> dict[str, Any] | None:
        obj = await get(kube, kind, name, namespace)
        ready = condition(obj)
        last["ready"] = ready
        if obj is None or ready is None or ready["status"] != status:
            return None
        if reason is not None and ready["reason"] != reason:
            return None
        if generation is not None and (obj.get("status") or {}).get("observedGeneration") != generation:
            return None
        return obj

    try:
        return await wait_until(probe, timeout=timeout, what=f"{kind} {namespace}/{name} Ready={status} {reason or ''}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last Ready condition: {last.get('ready')}") from None


async def wait_gone(kube: KubeApiserver, kind: str, name: str, namespace: str, timeout: float = 30) -> None:
    async def probe() -> bool:
        return await get(kube, kind, name, namespace) is None

    await wait_until(probe, timeout=timeout, what=f"{kind} {namespace}/{name} to be deleted")


async def events(kube: KubeApiserver, namespace: str, name: str) -> list[dict[str, Any]]:
    out = await kubectl(
        kube, "-n", namespace, "get", "events", "-o", "json", "--field-selector", f"involvedObject.name={name}"
    )
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


# -- the operator in-process ---------------------------------------------------------------------------------------
@dataclass
class OperatorThread:
    """``ibex_operator.app.run`` in a thread with its own event loop and its own Postgres/Redis clients.

    chdb (the embedded ClickHouse engine) can be opened by one process only, so the operator shares the test
    session's :class:`ClickHouse` facade (it runs every call on its own worker thread, from any event loop).
    """

    info: RuntimeInfo
    clickhouse: ClickHouse
    pepper: bytes
    options: OperatorOptions
    state: OperatorState = field(default_factory=OperatorState)
    error: BaseException | None = None
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _started: threading.Event = field(default_factory=threading.Event)

    def start(self, timeout: float = 30) -> None:
        self._thread = threading.Thread(target=self._main, name="ibex-operator", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise AssertionError(f"operator did not start within {timeout} s (error: {self.error!r})")
        if self.error is not None:
            raise AssertionError(f"operator failed to start: {self.error!r}")

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:
            self.error = e
        finally:
            self._started.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        stores = await Stores.open(StoreUrls.from_runtime(self.info), Settings(_env_file=None), admin=True)  # type: ignore[call-arg]
        own_clickhouse, stores.clickhouse = stores.clickhouse, self.clickhouse
        try:

            async def announce() -> None:
                await ready.wait()
                self._started.set()

            announcer = asyncio.create_task(announce())
            await app.run(self.options, stores, self.pepper, stop=self._stop, state=self.state, ready=ready)
            announcer.cancel()
        finally:
            stores.clickhouse = own_clickhouse  # never close the shared engine from here
            await stores.close()

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise AssertionError("operator thread did not stop")


# -- the operator as a subprocess ----------------------------------------------------------------------------------
@dataclass
class OperatorProcess:
    """``python -m ibex_dataplane.cli operator`` with its own log file; ``kill()`` is a real SIGKILL."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    identity: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the operator and every process it started
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"operator {self.identity} ignored SIGTERM for {timeout} s") from None


def spawn_operator(
    kube: KubeApiserver,
    info: RuntimeInfo,
    workdir: Path,
    *,
    identity: str,
    namespace: str,
    pepper: str | None = None,
    data_dir: Path | None = None,
    lease_name: str = "ibex-operator",
    lease_duration: float = 3.0,
    kubeconfig: Path | None = None,
    extra: tuple[str, ...] = (),
) -> OperatorProcess:
    """Stores and pepper from IBEX_* variables, or (``data_dir``) from an embedded runtime's runtime.json."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**kube.env(), "IBEX_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
    for name in [k for k in env if k.startswith("IBEX_") and k != "IBEX_LOG_LEVEL"] + ["POD_NAME", "POD_NAMESPACE"]:
        env.pop(name, None)
    if data_dir is None:
        assert pepper is not None
        env |= {
            "IBEX_POSTGRES_DSN": info.postgres_app_dsn,
            "IBEX_POSTGRES_ADMIN_DSN": info.postgres_admin_dsn,
            "IBEX_REDIS_URL": info.redis_url,
            # chdb is single-process: each subprocess gets an engine of its own (these tests do not purge ClickHouse)
            "IBEX_CLICKHOUSE_URL": f"chdb://{workdir / f'clickhouse-{identity}'}",
            "IBEX_KEY_PEPPER": pepper,
        }
    else:
        extra = ("--data-dir", str(data_dir), *extra)
    cmd = [
        sys.executable, "-m", "ibex_dataplane.cli", "operator",
        "--kubeconfig", str(kubeconfig or kube.kubeconfig),
        "--namespace", namespace,
        "--identity", identity,
        "--lease-name", lease_name,
        "--lease-namespace", namespace,
        "--lease-duration", str(lease_duration),
        "--retry-max", "2",
        *extra,
    ]  # fmt: skip
    log_path = workdir / f"operator-{identity}-{time.monotonic_ns()}.log"
    with log_path.open("wb") as out:
        # Its own process group, so kill() takes its children (the chdb engine process, multiprocessing's
        # resource tracker) with it: a SIGKILL to the operator alone would orphan them.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    return OperatorProcess(proc, log_path, identity)


def lease_holder(kube: KubeApiserver, namespace: str, name: str) -> str | None:
    out = kube.kubectl("-n", namespace, "get", "lease", name, "-o", "json", "--ignore-not-found").stdout
    if not out.strip():
        return None
    holder: str | None = json.loads(out)["spec"].get("holderIdentity")
    return holder
