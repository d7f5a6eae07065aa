"""Proxy overhead on the full protected path (architecture section 16), against a local instant upstream.

Starts, as separate processes: a local OpenAI-compatible upstream that answers at once, and `ibex dev` (embedded
Postgres and Valkey, migrations, one tenant with a directive, rate limits and a HardCap budget) routing a catalog
model to that upstream. Then, from this process, it sends the same chat request directly to the upstream and
through the proxy (key, agent binding, policy, rate limit, validation, budget hold, directive; memory off) and
reports the added latency (p50/p95/p99 of proxy minus direct) and requests/s through the proxy.

Run from the repository root:  .venv/bin/python -m bench.proxy_overhead [--requests N] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.upstream import API_KEY

TENANT = """\
apiVersion: ibex.dev/v1alpha1
kind: Organization
metadata: {name: bench, namespace: bench}
spec:
  limits: {requestsPerMinute: 10000000, tokensPerMinute: 2000000000}
  budget: {monthlyLimitUSD: "1000000.00", enforcement: HardCap}
  models: {allow: ["bench-*"], default: bench-model}
---
apiVersion: ibex.dev/v1alpha1
kind: Agent
metadata: {name: bench-agent, namespace: bench}
spec:
  organizationRef: {name: bench}
  limits: {requestsPerMinute: 10000000, tokensPerMinute: 2000000000}
  budget: {monthlyLimitUSD: "1000000.00"}
  memory: {enabled: false, contextTokens: 0}
---
apiVersion: ibex.dev/v1alpha1
kind: Directive
metadata: {name: bench-directive, namespace: bench}
spec: {agentRef: {name: bench-agent}, content: "You are a benchmark agent.", injectionMode: SystemFirst}
---
apiVersion: ibex.dev/v1alpha1
kind: ApiKey
metadata: {name: bench-key, namespace: bench}
spec:
  organizationRef: {name: bench}
  agentRefs: [{name: bench-agent}]
  scopes: [chat]
  secretName: bench-key
"""

BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "How fast is this gateway?"}], "max_tokens": 16}


def start(cmd: list[str], env: dict[str, str], pattern: str, timeout: float = 120) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("failed to start: " + " ".join(cmd) + "\n" + "".join(seen[-20:]))


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def timed(http: aiohttp.ClientSession, url: str, headers: dict[str, str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with http.post(url, json=BODY, headers=headers) as r:
            await r.read()
            if r.status != 200:
                raise SystemExit(f"unexpected {r.status} from {url}: {await r.text()}")
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def throughput(http: aiohttp.ClientSession, url: str, headers: dict[str, str], n: int, c: int) -> float:
    per_worker = n // c

    async def worker() -> None:
        for _ in range(per_worker):
            async with http.post(url, json=BODY, headers=headers) as r:
                await r.read()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    return per_worker * c / (time.perf_counter() - t0)


def q(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=1000)[int(p * 10) - 1]


async def measure(proxy: str, upstream: str, token: str, args: argparse.Namespace) -> dict[str, Any]:
    direct_headers = {"Authorization": f"Bearer {API_KEY}"}
    proxy_headers = {"Authorization": f"Bearer {token}", "X-IBEX-Agent-ID": "bench-agent"}
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as http:
        direct_url, proxy_url = upstream + "/chat/completions", proxy + "/v1/chat/completions"
        await timed(http, direct_url, direct_headers, 200)  # warm up both paths
        await timed(http, proxy_url, proxy_headers, 500)
        direct, via = [], []
        for _ in range(args.rounds):  # interleave rounds so drift hits both sides alike
            direct += await timed(http, direct_url, direct_headers, args.requests // args.rounds)
            via += await timed(http, proxy_url, proxy_headers, args.requests // args.rounds)
        rps_direct = await throughput(http, direct_url, direct_headers, args.throughput_requests, args.concurrency)
        rps_proxy = await throughput(http, proxy_url, proxy_headers, args.throughput_requests, args.concurrency)
    return {
        "direct": {p: q(direct, p) for p in (50, 95, 99)},
        "proxy": {p: q(via, p) for p in (50, 95, 99)},
        "rps_direct": rps_direct,
        "rps_proxy": rps_proxy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000, help="sequential requests per side (latency)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--throughput-requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "IBEX_LOG_LEVEL": "WARNING"}
    upstream_proc, upstream_url = start(
        [sys.executable, "-m", "tests.support.upstream"], env, r"upstream ready: (http://\S+)"
    )
    with tempfile.TemporaryDirectory(prefix="ibex-bench-") as tmp:
        root = Path(tmp)
        (root / "tenants").mkdir()
        (root / "tenants" / "bench.yaml").write_text(TENANT)
        providers = {
            "models": [{"name": "bench-model", "provider": "local", "context_window": 128000,
                        "max_output_tokens": 4096, "input_price_per_mtok": "1", "output_price_per_mtok": "2"}],
            "providers": {"local": {"type": "openai_compat", "base_url": upstream_url, "api_key": API_KEY}},
        }  # fmt: skip
        (root / "providers.json").write_text(json.dumps(providers))
        os.chmod(root, 0o755)
        dev_env = {**env, "IBEX_PROVIDERS_FILE": str(root / "providers.json")}
        dev_proc, proxy_url = start(
            [sys.executable, "-m", "ibex_dataplane.cli", "dev", "--manifests", str(root / "tenants"),
             "--data-dir", str(root / "data"), "--port", "0", "--keys-out", str(root / "keys.json")],
            dev_env, r"ready.*(http://\S+) ",
        )  # fmt: skip
        try:
            token = json.loads((root / "keys.json").read_text())["bench/bench-key"]
            result = asyncio.run(measure(proxy_url, upstream_url, token, args))
        finally:
            stop(dev_proc)
            stop(upstream_proc)

    d, p = result["direct"], result["proxy"]
    print(f"requests per side (latency): {args.requests}, throughput: {args.throughput_requests} at c={args.concurrency}")
    print(f"{'':12}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}")
    print(f"{'direct':12}{d[50]:10.3f}{d[95]:10.3f}{d[99]:10.3f}")
    print(f"{'via proxy':12}{p[50]:10.3f}{p[95]:10.3f}{p[99]:10.3f}")
    print(f"{'added':12}{p[50] - d[50]:10.3f}{p[95] - d[95]:10.3f}{p[99] - d[99]:10.3f}")
    print(f"throughput: direct {result['rps_direct']:.0f} req/s, via proxy {result['rps_proxy']:.0f} req/s "
          f"(ratio {result['rps_proxy'] / result['rps_direct']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
