"""Resident memory of each stage process (architecture section 16; issue: memory per process), idle, after a
warm-up and under load, and what a fresh interpreter pays for each heavy import.

Method: the stages run as separate processes as in a pod (`ibex proxy`, `ibex memory`, `ibex context`, plus the
local OpenAI-wire upstream), on embedded stores in this process's runtime, wired exactly like the fault suite's
stack (tests/chaos/stack.py: three proxy replicas, one memory and one context stage, one chdb engine per stage).
RSS and peak RSS (VmRSS, VmHWM of /proc/PID/status) are read for each stage and, separately, for its chdb engine
process (a spawned child). The three moments:

1. idle: every stage printed its ready line;
2. warm: after a mixed load (chat with memory, echo, streams, upstream calls, memory writes and searches) at
   ``--rate`` requests/s for ``--warm`` seconds;
3. load: the highest RSS seen while the same mix runs for ``--seconds`` more (sampled every 0.5 s).

Then, in fresh interpreters, the RSS added by importing (and, for models, loading) each heavy component, to say
what dominates. Every load request's status is checked and non-success answers are counted.

Run from the repository root:  .venv/bin/python -m bench.rss [--rate R] [--warm S] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.figures import Figures
from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import migrations_dir
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.migrations import migrate_clickhouse, migrate_postgres
from ibex_dataplane.store.postgres import create_pool
from ibex_dataplane.store.redis import create_redis
from ibex_operator.reconcile import Reconciler
from ibex_operator.repository import TenantConfigRepository
from ibex_operator.secrets import FileSecretSink
from tests.chaos.load import SUCCESS, Load, Org, token
from tests.chaos.stack import Stack, analytics_dirs, build_stack, start_all, upstream_process
from tests.support.tenants import TenantFactory

LIMITS = {"requestsPerMinute": 1_000_000, "tokensPerMinute": 1_000_000_000}

# (label, code run in a fresh interpreter after `import sys`): what each heavy piece adds to a process.
IMPORTS = [
    ("python + aiohttp + asyncpg + redis (every stage)", "import aiohttp, asyncpg, redis, orjson"),
    ("+ the proxy application", "import ibex_dataplane.proxy.app"),
    ("+ the context stage (grpc)", "import ibex_dataplane.context.app"),
    ("+ the memory stage application", "import ibex_dataplane.memory.app"),
    ("+ MiniLM embedder loaded (onnxruntime)",
     "from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder as E; e = E.from_installed_packages();"
     " e.embed_sync(['warm up'])"),
    ("+ SPLADE encoder loaded (onnxruntime)",
     "from ibex_dataplane.embedding.splade import shared_encoder as s; s().encode_sync(['warm up'])"),
    ("+ Presidio redactor (pattern recognizers)",
     "from ibex_dataplane.pii.redactor import PiiRedactor as P; p = P(); p.redact('call 212 555 0187')"),
    ("+ chdb imported (its engine runs in a child process)", "import chdb"),
]  # fmt: skip


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def status(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) // 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def processes(stack: Stack) -> dict[str, int]:
    """Label -> pid of every stage process, of each stage's chdb engine and of each proxy worker (a proxy with
    several workers is a supervisor, its workers and the engine it serves them)."""
    out = {}
    for stage in stack.stages:
        workers = stage.children("--workers 1")
        out[f"{stage.name} supervisor" if workers else stage.name] = stage.pid
        for i, pid in enumerate(workers):
            out[f"{stage.name} worker {i + 1}"] = pid
        for i, pid in enumerate(stage.children("multiprocessing.spawn")):
            out[f"{stage.name} chdb engine{'' if i == 0 else f' {i + 1}'}"] = pid
    return out


async def orgs(tenants: TenantFactory, n: int = 2) -> list[Org]:
    out = []
    for _ in range(n):
        t = await tenants.create(
            agents=("mem", "cap", "fast"),
            agent_specs={"mem": {"limits": LIMITS}, "cap": {"limits": LIMITS, "memory": {"enabled": False}},
                         "fast": {"limits": LIMITS, "memory": {"enabled": False}}},
            org_spec={"models": {"default": "echo"}, "limits": LIMITS},
        )  # fmt: skip
        out.append(Org(t.name, t.org_id, "mk" + token(10), dict(t.agents), dict(t.keys)))
    return out


async def run_load(stack: Stack, tenants: list[Org], rate: float, seconds: float, pids: dict[str, int]) -> tuple[
    dict[str, int], Counter[str]
]:  # fmt: skip
    """The mix for ``seconds``; the highest RSS of each process meanwhile, and the outcomes that were not success."""
    peak = {name: status(pid)[0] for name, pid in pids.items()}
    end = time.monotonic() + seconds
    async with Load(stack.proxy_urls, tenants, [], rate=rate, max_seconds=seconds) as load:
        while time.monotonic() < end:
            for name, pid in pids.items():
                peak[name] = max(peak[name], status(pid)[0])
            await asyncio.sleep(0.5)  # sampling RSS while the load runs
    failures: Counter[str] = Counter()
    for r in load.results:
        if r.status not in SUCCESS[r.kind]:
            failures[f"{r.kind} {r.status or r.outcome}"] += 1
    failures["total requests"] = len(load.results)
    return peak, failures


def import_costs() -> list[tuple[str, int]]:
    """Cumulative RSS (MiB) of a fresh interpreter after each step of IMPORTS."""
    script = "import sys, os\n"
    script += "def rss():\n"
    script += "    return int([x for x in open('/proc/self/status') if x.startswith('VmRSS')][0].split()[1]) // 1024\n"
    script += "print('start', rss(), flush=True)\n"
    for label, code in IMPORTS:
        script += f"{code}\nprint({label!r}, rss(), flush=True)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)  # fmt: skip
    rows = []
    for line in done.stdout.splitlines():
        label, _, value = line.rpartition(" ")
        rows.append((label, int(value)))
    return rows


async def measure(args: argparse.Namespace, figures: Figures) -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    root = Path(tempfile.mkdtemp(prefix="ibex-rss-"))
    runtime = EmbeddedRuntime(root / "stores")
    await asyncio.to_thread(runtime.start)
    stack: Stack | None = None
    upstream = upstream_process(root)
    try:
        info = runtime.info
        folder = migrations_dir(settings)
        await migrate_postgres(info.postgres_admin_dsn, folder / "postgres")
        for url in analytics_dirs(root):
            clickhouse = ClickHouse(url)
            try:
                await migrate_clickhouse(clickhouse, folder / "clickhouse")
            finally:
                await clickhouse.close()
        upstream_url = (await asyncio.to_thread(upstream.start)).group(1).removesuffix("/v1")
        stack = build_stack(root, runtime, secrets.token_hex(32), secrets.token_hex(32), upstream, upstream_url)
        await start_all(stack, timeout=180)
        pool = await create_pool(info.postgres_admin_dsn, min_size=1, max_size=2, application_name="rss")
        redis = create_redis(info.redis_url)
        try:
            sink = FileSecretSink(root / "secrets.json")
            tenants = TenantFactory(Reconciler(TenantConfigRepository(pool, redis), sink, stack.pepper.encode()), sink)
            load_orgs = await orgs(tenants)
            pids = processes(stack)
            idle = {name: status(pid)[0] for name, pid in pids.items()}
            _, warm_failures = await run_load(stack, load_orgs, args.rate, args.warm, pids)
            pids = processes(stack)  # the engines start with the first analytics write
            warm = {name: status(pid)[0] for name, pid in pids.items()}
            peak, load_failures = await run_load(stack, load_orgs, args.rate, args.seconds, pids)
            hwm = {name: status(pid)[1] for name, pid in pids.items()}
        finally:
            await redis.aclose()
            await pool.close()
    finally:
        if stack is not None:
            await asyncio.to_thread(stack.stop)
        else:
            await asyncio.to_thread(upstream.stop)
        await asyncio.to_thread(runtime.stop)
        shutil.rmtree(root, ignore_errors=True)

    print(f"python {platform.python_version()}, {os.cpu_count()} cores, load average after the run {loadavg()}")
    print(f"mixed load at {args.rate:g} requests/s: warm-up {args.warm:g} s, then {args.seconds:g} s sampled")
    print(f"warm-up: {dict(warm_failures)}; load: {dict(load_failures)} (keys other than 'total requests' are"
          " answers that were not success)")  # fmt: skip
    print(f"{'process':28}{'idle MiB':>10}{'warm MiB':>10}{'load max':>10}{'peak (HWM)':>12}")
    for name in pids:
        print(f"{name:28}{idle.get(name, 0):10d}{warm.get(name, 0):10d}{peak.get(name, 0):10d}{hwm.get(name, 0):12d}")
    print("\nfresh interpreter, cumulative RSS after each step (MiB):")
    previous = 0
    steps = import_costs()
    for label, value in steps:
        print(f"  {label:55}{value:6d}  (+{value - previous})")
        previous = value
    figures.put("rate", args.rate)
    figures.put("processes_mib", {
        name: {"idle": idle.get(name, 0), "warm": warm.get(name, 0), "load_max": peak.get(name, 0),
               "peak_hwm": hwm.get(name, 0)}
        for name in pids
    })  # fmt: skip
    figures.put("import_steps_mib", dict(steps))
    figures.put("failures", {"warm": dict(warm_failures), "load": dict(load_failures)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second of the mixed load")
    parser.add_argument("--warm", type=float, default=20.0, help="seconds of warm-up load")
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of sampled load")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON here (bench/report.py)")
    args = parser.parse_args()
    figures = Figures("rss")
    asyncio.run(measure(args, figures))
    figures.write(args.json)


if __name__ == "__main__":
    main()
