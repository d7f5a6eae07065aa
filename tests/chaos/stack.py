"""The fault suite's stack: private embedded stores and every data-plane stage as its own real process.

Three ``ibex proxy`` replicas, one ``ibex memory`` and one ``ibex context`` stage, on fixed free ports of 127.0.0.1
so that a replacement process comes back where the old one was (what a Kubernetes Service gives its clients).
Postgres and Valkey come from a private :class:`EmbeddedRuntime`, so stopping them cannot disturb the rest of the
test session. Each replica has its own chdb analytics directory (see the suite's module docstring for why).

Every process runs in its own session and process group: ``kill -9`` of a replica is ``killpg(SIGKILL)`` of its
group, as the kernel does to a container, so the chdb engine process it started dies with it. Output goes to one
log file per process (a pipe nobody reads would fill up and stall the process under a fault's warnings).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ibex_dataplane.runtime.embedded import EmbeddedRuntime, free_port
from tests.support.processes import IBEX, REPO, child_processes
from tests.support.upstream import API_KEY


class StageFailed(AssertionError):
    """A stage process exited or never became ready."""


@dataclass
class StageProcess:
    """One ``ibex <stage>`` process: start (and wait for its ready line), SIGKILL its group, stop it."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    ready: str  # a regex matched against each line of the log
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    log_offset: int = 0  # where this start's output begins in the log
    command: tuple[str, ...] = tuple(IBEX)

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} is not running"
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        assert not self.running(), f"{self.name} is already running"
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n--- start {self.starts} of {self.name} ---\n".encode())
            log.flush()
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(
                [*self.command, *self.args], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float) -> re.Match[str]:
        """Poll the log for the ready line of this start; fail if the process exits or the deadline passes."""
        deadline = time.monotonic() + timeout
        pattern = re.compile(self.ready)
        while True:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
            for line in text.splitlines():
                if m := pattern.search(line):
                    return m
            if self.proc is None or self.proc.poll() is not None:
                raise StageFailed(f"{self.name} exited before it was ready:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise StageFailed(f"{self.name} was not ready within {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.05)  # polling a log file for a condition, under a deadline

    def start(self, timeout: float = 90) -> re.Match[str]:
        self.spawn()
        return self.wait_ready(timeout)

    def kill(self) -> None:
        """``kill -9`` of the whole process group (the stage and any engine process it started)."""
        proc = self.proc
        assert proc is not None and proc.poll() is None, f"{self.name} is not running"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL the group if it lingers; reap the stage itself."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):  # whatever is left of its group (engine, tracker)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def children(self, marker: str) -> list[int]:
        """Pids of this process's children whose command line contains ``marker``."""
        return [pid for pid, cmdline in child_processes(self.pid) if marker in cmdline]

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# Deadlines of the stack, generous for a loaded 2-core machine. The context deadlines are raised like the other
# functional tests do (the deadline behaviour has its own tests): here a degraded context must mean a fault.
STAGE_ENV = {
    "IBEX_LOG_LEVEL": "WARNING",
    "IBEX_CONTEXT_DEADLINE_MS": "3000",
    "IBEX_CONTEXT_DIRECTIVE_MS": "3000",
    "IBEX_CONTEXT_HOT_MS": "3000",
    "IBEX_CONTEXT_COLD_MS": "3000",
    "IBEX_CONTEXT_TIMEOUT_MS": "4000",
    # The principal's lifetime, and so how long a memory write's idempotency claim stays locked after the stage
    # that held it died (lifetime + 5 s): a retry of that write waits that long for 409 to turn into a takeover.
    "IBEX_MEMORY_TIMEOUT_SECONDS": "5",
    "IBEX_ANALYTICS_FLUSH_SECONDS": "0.5",
    "IBEX_POSTGRES_POOL_MAX": "20",
    "HF_HUB_OFFLINE": "1",
    "ORT_DISABLE_TELEMETRY": "1",
}

UPSTREAM_MODEL = "chaos-up"


def providers_file(path: Path, upstream_url: str, api_key: str) -> Path:
    """One OpenAI-compatible upstream (the fake one) with short timeouts and a quick breaker."""
    config = {
                "models": [
                    {"name": UPSTREAM_MODEL, "provider": "chaos-upstream", "context_window": 16384,
                     "max_output_tokens": 64, "tokenizer_family": "generic", "input_price_per_mtok": "3.00",
                     "output_price_per_mtok": "15.00"}
                ],
                "providers": {
                    "chaos-upstream": {"type": "openai_compat", "base_url": upstream_url, "api_key": api_key,
                                       "connect_timeout": 1.0, "read_timeout": 1.0, "max_attempts": 2,
                                       "backoff_base": 0.05, "backoff_max": 0.2, "breaker_failure_threshold": 5,
                                       "breaker_cooldown": 1.0}
                },
            }  # fmt: skip
    path.write_text(json.dumps(config))
    return path


@dataclass
class Stack:
    root: Path
    runtime: EmbeddedRuntime
    pepper: str
    secret: str
    proxies: list[StageProcess]
    memory: StageProcess
    context: StageProcess
    proxy_urls: list[str]
    upstream: StageProcess
    upstream_url: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def stages(self) -> list[StageProcess]:
        return [self.upstream, self.memory, self.context, *self.proxies]

    async def script(self, **fields: Any) -> None:
        """Tell the fake upstream how to answer from now on (fields of ``tests.support.upstream.Script``)."""
        async with aiohttp.ClientSession() as http, http.post(self.upstream_url + "/_script", json=fields) as r:
            assert r.status == 200, await r.text()

    def valkey_pid(self) -> int:
        proc: Any = getattr(self.runtime.valkey, "_proc", None)
        assert proc is not None and proc.poll() is None, "valkey is not running"
        return int(proc.pid)

    def engine_pids(self, replica: int) -> list[int]:
        """The chdb engine process of one proxy replica (a spawned multiprocessing worker)."""
        return self.proxies[replica].children("multiprocessing.spawn")

    def stop(self) -> None:
        for stage in reversed(self.stages):
            stage.stop()


def upstream_process(root: Path) -> StageProcess:
    """The fake OpenAI-wire upstream in its own process (scripted through its ``POST /_script``)."""
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    return StageProcess(
        "upstream", [], dict(os.environ), logs / "upstream.log", r"upstream ready: (http://\S+)",
        command=(sys.executable, "-m", "tests.support.upstream"),
    )  # fmt: skip


def build_stack(
    root: Path, runtime: EmbeddedRuntime, pepper: str, secret: str, upstream: StageProcess, upstream_url: str
) -> Stack:
    """Processes (not started) wired to the runtime's stores; ports chosen now and kept across restarts."""
    info = runtime.info
    memory_port, context_port, health_port = free_port(), free_port(), free_port()
    base = {
        **os.environ,
        **STAGE_ENV,
        "IBEX_POSTGRES_DSN": info.postgres_app_dsn,
        "IBEX_REDIS_URL": info.redis_url,
        "IBEX_KEY_PEPPER": pepper,
        "IBEX_INTERNAL_SECRET": secret,
        "IBEX_MEMORY_URL": f"http://127.0.0.1:{memory_port}",
        "IBEX_CONTEXT_URL": f"127.0.0.1:{context_port}",
        "IBEX_PROVIDERS_FILE": str(providers_file(root / "providers.json", upstream_url + "/v1", API_KEY)),
    }
    logs = root / "logs"
    logs.mkdir(exist_ok=True)

    def analytics(name: str) -> dict[str, str]:
        return {"IBEX_CLICKHOUSE_URL": f"chdb://{root / ('clickhouse-' + name)}"}

    memory = StageProcess(
        "memory", ["memory", "--port", str(memory_port)], {**base, **analytics("memory")}, logs / "memory.log",
        r"ibex memory ready: http://",
    )  # fmt: skip
    context = StageProcess(
        "context", ["context", "--port", str(context_port), "--health-port", str(health_port)],
        {**base, **analytics("context")}, logs / "context.log", r"ibex context ready: grpc://",
    )  # fmt: skip
    proxies, urls = [], []
    for i in range(3):
        port = free_port()
        # One process per replica: the faults target a replica's own processes (its chdb engine among them).
        proxy = StageProcess(
            f"proxy-{i}", ["proxy", "--workers", "1", "--port", str(port)], {**base, **analytics(f"proxy-{i}")},
            logs / f"proxy-{i}.log",
            r"ibex proxy ready: http://",
        )  # fmt: skip
        proxies.append(proxy)
        urls.append(f"http://127.0.0.1:{port}")
    return Stack(root, runtime, pepper, secret, proxies, memory, context, urls, upstream, upstream_url, base)


async def start_all(stack: Stack, timeout: float) -> None:
    """Spawn every stage at once (they load in parallel), then wait for every ready line within ``timeout``."""
    deadline = time.monotonic() + timeout
    stages = [s for s in stack.stages if not s.running()]
    for stage in stages:
        stage.spawn()
    for stage in stages:
        await asyncio.to_thread(stage.wait_ready, max(0.0, deadline - time.monotonic()))


def analytics_dirs(root: Path) -> list[str]:
    return [f"chdb://{root / ('clickhouse-proxy-' + str(i))}" for i in range(3)]
