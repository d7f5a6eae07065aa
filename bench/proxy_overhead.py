"""Proxy overhead on the full protected path (architecture section 16), against a local instant upstream.

Starts, as separate processes: a local OpenAI-compatible upstream that answers at once, and `ibex dev` (embedded
Postgres and Valkey, migrations, one tenant with a directive, rate limits and a HardCap budget) routing a catalog
model to that upstream. Then, from this process, it sends the same chat request directly to the upstream and
through the proxy (key, agent binding, policy, rate limit, validation, budget hold, directive; memory off) and
reports the added latency (p50/p95/p99 of proxy minus direct) and requests/s through the proxy, and the CPU each
process (the proxy, its children, the upstream, this client, Postgres, Valkey) spent per request in each phase.

Run from the repository root:  .venv/bin/python -m bench.proxy_overhead [--requests N] [--concurrency C]

With ``--workers 1,2`` it also measures ``ibex proxy --workers N`` for each N, beside ``ibex dev`` on its stores
(``--data-dir``) with an embedded ClickHouse of its own (migrated first, so analytics rows are written as in
``ibex dev``); the targets are named ``workers=N``. The load generator is this one Python process, on the same
machine: at some point it, not the proxy, is the limit (compare with ``direct``).

With ``--bare`` it also measures a bare pass-through (``bench/passthrough.py``: the same HTTP server and upstream
client as ``ibex``, nothing else) as the target ``bare``, the floor one more hop through a Python process sets.

With ``--stages`` it also says where the proxy's own time went in the sequential phase, from the analytics rows
``ibex dev`` wrote for those requests (read from its ClickHouse once it has stopped): p50, p99 and the largest of
each gate, of the upstream call and of the rest (the request's time less those), server side.

With ``--stream-requests N`` (default 1000; 0 leaves it out) it also measures streamed answers of
``--stream-events`` content events each (32 by default, then the finish event and ``[DONE]``), sequentially in
the same interleaved rounds, on every target but ``bare`` (which buffers): the time to the first event and to the
end of the stream, each target's quantile minus the direct upstream's, and what each relayed event adds (the added
time to the end less the added time to the first event, over the events after the first). Every streamed answer
must be a 200 event stream whose content adds up to what the upstream sent and which ends with ``[DONE]``.
``--stream-interval-ms`` makes the upstream pause between its events (by default it sends them all at once).

With ``--litellm PATH/TO/litellm`` it also measures LiteLLM's proxy side by side (master key only, no database,
one worker, the same upstream). LiteLLM is not a dependency of this project; install it in a scratch virtualenv:
``python3 -m venv "$LITELLM_VENV" && "$LITELLM_VENV/bin/pip" install 'litellm[proxy]'`` (any scratch folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.cpu import cpu_ms_per_call, tree_ticks
from bench.durability import production_durability
from bench.figures import Figures, latency
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

STORES = ("postgres", "valkey-server")  # CPU by command name, whoever started them

BODY = {
    "model": "bench-model",
    "messages": [{"role": "user", "content": "How fast is this gateway?"}],
    "max_tokens": 16,
}


def stage_tails(engine: Path, skip: int, n: int) -> dict[str, dict[str, float]]:
    """p50, p99 and max (ms) of each gate, the upstream call and the rest, over ``n`` requests after the first
    ``skip`` (in time order) of the analytics rows in the embedded ClickHouse at ``engine``."""
    import clickhouse_connect  # the bench's own reader, after `ibex dev` released the engine

    client = clickhouse_connect.get_client(dsn=f"chdb://{engine}")
    try:
        rows = client.query(
            "SELECT latency_ms, upstream_ms, stage_ms FROM llm_traces ORDER BY ts"
            " LIMIT {n:UInt32} OFFSET {skip:UInt32}",
            parameters={"n": n, "skip": skip},
        ).result_rows
    finally:
        client.close()
    if len(rows) != n:
        raise SystemExit(f"expected {n} analytics rows of the sequential phase, found {len(rows)}")
    columns: dict[str, list[float]] = {"upstream": [r[1] for r in rows]}
    for name in sorted({k for r in rows for k in r[2]}):
        columns[name] = [r[2].get(name, 0.0) for r in rows]
    columns["rest"] = [r[0] - r[1] - sum(r[2].values()) for r in rows]
    columns["request"] = [r[0] for r in rows]
    return {name: {"p50": q(values, 50), "p99": q(values, 99), "max": max(values)} for name, values in columns.items()}


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


async def throughput(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], n: int, c: int
) -> tuple[float, int]:
    """Successful (200) answers per second at concurrency ``c``, and how many answers were not 200."""
    per_worker = n // c
    errors = 0

    async def worker() -> None:
        nonlocal errors
        for _ in range(per_worker):
            async with http.post(url, json=BODY, headers=headers) as r:
                await r.read()
                errors += r.status != 200

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    return (per_worker * c - errors) / (time.perf_counter() - t0), errors


WARM_UP = 300
"""Requests each target serves before anything is measured."""
STREAM_BODY = {**BODY, "stream": True}
STREAM_PIECE = "tok "


def streamed_content(raw: bytes) -> str | None:
    """The content an OpenAI event stream adds up to, or None when it does not end with ``data: [DONE]``."""
    parts = []
    data = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return None
    for payload in data[:-1]:
        for choice in json.loads(payload).get("choices") or []:
            parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def timed_stream(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], n: int, expected: str
) -> list[tuple[float, float]]:
    """``n`` streamed answers one after another: (ms to the first event, ms to the end of the stream) of each."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        first = 0.0
        chunks: list[bytes] = []
        async with http.post(url, json=STREAM_BODY, headers=headers) as r:
            if r.status != 200 or r.content_type != "text/event-stream":
                raise SystemExit(f"unexpected {r.status} {r.content_type} from {url}: {await r.text()}")
            async for data in r.content.iter_any():
                if not chunks:
                    first = time.perf_counter()
                chunks.append(data)
        end = time.perf_counter()
        content = streamed_content(b"".join(chunks))
        if content != expected:
            raise SystemExit(f"a stream from {url} added up to {content!r}, not the {len(expected)} characters sent")
        out.append(((first - t0) * 1000, (end - t0) * 1000))
    return out


def q(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=1000)[int(p * 10) - 1]


async def measure(
    targets: dict[str, tuple[str, dict[str, str]]], args: argparse.Namespace, pids: dict[str, int]
) -> tuple[dict[str, Any], dict[str, list[tuple[float, float]]]]:
    """Latency (interleaved rounds, sequential), streamed answers (the same, ``--stream-requests``) and throughput
    (concurrent) of each target: name -> (url, headers), and the CPU each process spent per request of the
    throughput phase. ``pids``: target name -> pid of the
    process serving it (``upstream`` too); ``--profile`` samples the ``ibex`` one during its throughput phase."""
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    # Streamed answers on every target but the bare pass-through, which buffers them.
    streamers = {name: target for name, target in targets.items() if name != "bare"} if args.stream_requests else {}
    streams: dict[str, list[tuple[float, float]]] = {name: [] for name in streamers}
    rps: dict[str, tuple[float, int]] = {}
    cpu: dict[str, dict[str, float]] = {}

    def roots_of(name: str) -> dict[str, int]:  # the processes whose CPU is read for ``name``: upstream and proxy
        return {"upstream": pids["upstream"], **({"proxy": pids[name]} if name in pids else {})}

    async with aiohttp.ClientSession(connector=connector) as http:
        for url, headers in targets.values():  # warm up every path
            await timed(http, url, headers, WARM_UP)
        sequential_ticks: dict[str, dict[str, int]] = {name: {} for name in targets}
        for _ in range(args.rounds):  # interleave rounds so drift hits every side alike
            for name, (url, headers) in targets.items():
                roots = roots_of(name)
                before = tree_ticks(roots, STORES)
                latencies[name] += await timed(http, url, headers, args.requests // args.rounds)
                for role, ticks in tree_ticks(roots, STORES).items():  # what each process spent in this round
                    spent = sequential_ticks[name]
                    spent[role] = spent.get(role, 0) + ticks - before.get(role, 0)
        expected = STREAM_PIECE * args.stream_events
        for url, headers in streamers.values():
            await timed_stream(http, url, headers, WARM_UP // 10, expected)
        for _ in range(args.rounds):
            for name, (url, headers) in streamers.items():
                streams[name] += await timed_stream(http, url, headers, args.stream_requests // args.rounds, expected)
        for name, (url, headers) in targets.items():
            profiler = profile_start(args.profile, pids.get(name)) if args.profile and name == "ibex" else None
            roots = roots_of(name)
            try:
                before = tree_ticks(roots, STORES)
                rps[name] = await throughput(http, url, headers, args.throughput_requests, args.concurrency)
                cpu[name] = {k: v * 1000 for k, v in cpu_ms_per_call(before, tree_ticks(roots, STORES),
                                                                     args.throughput_requests).items()}  # fmt: skip
            finally:
                if profiler is not None:
                    profile_stop(profiler)
    return {
        name: (
            {p: q(values, p) for p in (50, 95, 99)},
            *rps[name],
            values,
            cpu[name],
            {k: v * 1000 for k, v in cpu_ms_per_call({}, sequential_ticks[name], len(values)).items()},
        )
        for name, values in latencies.items()
    }, {name: pairs for name, pairs in streams.items() if pairs}  # none when fewer answers than rounds were asked


def profile_start(path: str, pid: int | None) -> subprocess.Popen[bytes] | None:
    """py-spy sampling ``pid`` into ``path`` (collapsed stacks) while the throughput phase runs."""
    if pid is None:
        return None
    spy = Path(sys.executable).with_name("py-spy")
    command = [str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", "250", "--nonblocking",
               "--output", path]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches before the load starts (a benchmark's setup, not a test's synchronization)
    return proc


def profile_stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    proc.wait(timeout=60)


LITELLM_CONFIG = """\
model_list:
  - model_name: bench-model
    litellm_params: {{model: openai/bench-model, api_base: "{upstream}", api_key: "{key}"}}
general_settings: {{master_key: sk-litellm-bench}}
"""


def start_litellm(binary: str, upstream: str, root: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    (root / "litellm.yaml").write_text(LITELLM_CONFIG.format(upstream=upstream, key=API_KEY))
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--config", str(root / "litellm.yaml"), "--host", "127.0.0.1", "--port", str(port),
         "--num_workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        env={**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health/liveliness", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("LiteLLM did not start")


def start_workers_proxy(workers: int, root: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """`ibex proxy --workers N` on the stores of the running `ibex dev` (data dir ``root/data``), with a migrated
    embedded ClickHouse of its own (`ibex dev` holds its engine)."""
    proxy_env = {**env, "IBEX_CLICKHOUSE_URL": f"chdb://{root / f'clickhouse-{workers}'}"}
    subprocess.run(
        [sys.executable, "-m", "ibex_dataplane.cli", "migrate"], env={**proxy_env, "IBEX_DATA_DIR": str(root / "data")},
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return start(
        [sys.executable, "-m", "ibex_dataplane.cli", "proxy", "--workers", str(workers), "--data-dir",
         str(root / "data"), "--port", "0"],
        proxy_env, r"^ibex proxy ready: (http://\S+)",
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def report_streams(streams: dict[str, list[tuple[float, float]]], args: argparse.Namespace, figures: Figures) -> None:
    """Print and keep the streamed answers' figures: each target's time to the first event and to the end, added
    over the direct upstream's at the same quantile, and the added time per event after the first."""
    after_first = args.stream_events + 1  # the content events but the first, the finish event and [DONE]
    first = {name: {p: q([f for f, _ in pairs], p) for p in (50, 99)} for name, pairs in streams.items()}
    last = {name: {p: q([e for _, e in pairs], p) for p in (50, 99)} for name, pairs in streams.items()}
    print(f"streamed answers: {args.stream_requests} per target in {args.rounds} interleaved rounds, "
          f"{args.stream_events} content events each; ms to the first event and to the end of the stream")  # fmt: skip
    print(f"{'':10}{'first p50':>10}{'first p99':>10}{'end p50':>9}{'end p99':>9}  {'added first p50/p99':>20}"
          f"  {'added end p50/p99':>18}  {'added per event':>16}")  # fmt: skip
    figures.put("stream.method", f"{args.stream_requests} streamed answers per target, sequential, in "
                f"{args.rounds} interleaved rounds, {args.stream_events} content events each; added = the "
                "target's quantile minus the direct upstream's; per event = (added end - added first) at p50 over "
                f"the {after_first} events after the first")  # fmt: skip
    figures.put("stream.events", args.stream_events)
    for name, pairs in streams.items():
        added = {f"{edge}_p{p}": quantiles[name][p] - quantiles["direct"][p]
                 for edge, quantiles in (("first", first), ("end", last)) for p in (50, 99)}  # fmt: skip
        per_event_us = (added["end_p50"] - added["first_p50"]) / after_first * 1000
        print(f"{name:10}{first[name][50]:10.3f}{first[name][99]:10.3f}{last[name][50]:9.3f}{last[name][99]:9.3f}"
              f"  {added['first_p50']:9.3f} {added['first_p99']:9.3f}  {added['end_p50']:8.3f} {added['end_p99']:8.3f}"
              f"  {per_event_us:13.1f} us")  # fmt: skip
        figures.put(f"stream.targets.{name}", {"first": latency([f for f, _ in pairs]),
                                               "end": latency([e for _, e in pairs])})  # fmt: skip
        if name != "direct":
            figures.put(f"stream.added.{name}", {**added, "per_event_us": per_event_us})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000, help="sequential requests per side (latency)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--throughput-requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--litellm", default=None, help="path of a `litellm` executable to measure side by side")
    parser.add_argument("--profile", default=None, help="py-spy the proxy during its throughput phase into this file")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON here (bench/report.py)")
    parser.add_argument("--stages", action="store_true", help="where the proxy's time went, from its analytics rows")
    parser.add_argument("--bare", action="store_true", help="also measure a bare pass-through (bench/passthrough.py)")
    parser.add_argument("--stream-requests", type=int, default=1000, help="streamed answers per target (0: none)")
    parser.add_argument("--stream-events", type=int, default=32, help="content events of each streamed answer")
    parser.add_argument("--stream-interval-ms", type=float, default=0.0,
                        help="the upstream's pause between stream events (0: all at once)")  # fmt: skip
    parser.add_argument(
        "--workers", type=lambda v: [int(n) for n in v.split(",")], default=[],
        help="also measure `ibex proxy --workers N` for each N of this comma-separated list",
    )  # fmt: skip
    args = parser.parse_args()
    figures = Figures("proxy")  # now: it records the load average before anything starts

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
        litellm_proc = bare_proc = None
        worker_procs: list[subprocess.Popen[str]] = []
        try:
            admin_dsn = json.loads((root / "data" / "runtime.json").read_text())["postgres_admin_dsn"]
            durability = asyncio.run(production_durability(admin_dsn))
            token = json.loads((root / "keys.json").read_text())["bench/bench-key"]
            targets = {
                "direct": (upstream_url + "/chat/completions", {"Authorization": f"Bearer {API_KEY}"}),
                "ibex": (proxy_url + "/v1/chat/completions",
                         {"Authorization": f"Bearer {token}", "X-IBEX-Agent-ID": "bench-agent"}),
            }  # fmt: skip
            if args.bare:
                bare_proc, bare_url = start(
                    [sys.executable, "-m", "bench.passthrough", upstream_url, API_KEY], env,
                    r"passthrough ready: (http://\S+)",
                )  # fmt: skip
                targets["bare"] = (bare_url + "/v1/chat/completions", {})
            for n in args.workers:
                proc, url = start_workers_proxy(n, root, dev_env)
                worker_procs.append(proc)
                targets[f"workers={n}"] = (url + "/v1/chat/completions", targets["ibex"][1])
            if args.litellm:
                litellm_proc, litellm_url = start_litellm(args.litellm, upstream_url, root, env)
                targets["litellm"] = (
                    litellm_url + "/v1/chat/completions",
                    {"Authorization": "Bearer sk-litellm-bench"},
                )
            pids = {
                "upstream": upstream_proc.pid,
                "ibex": dev_proc.pid,
                **{f"workers={n}": proc.pid for n, proc in zip(args.workers, worker_procs, strict=True)},
            }
            if litellm_proc is not None:
                pids["litellm"] = litellm_proc.pid
            if bare_proc is not None:
                pids["bare"] = bare_proc.pid
            if args.stream_requests:  # every streamed answer carries --stream-events content events
                script = urllib.request.Request(
                    upstream_url.removesuffix("/v1") + "/_script", method="POST",
                    data=json.dumps({"stream_pieces": [STREAM_PIECE] * args.stream_events,
                                     "chunk_interval": args.stream_interval_ms / 1000}).encode(),
                    headers={"Content-Type": "application/json"},
                )  # fmt: skip
                with urllib.request.urlopen(script, timeout=10) as answer:
                    if answer.status != 200:
                        raise SystemExit(f"the upstream refused its script: {answer.status}")
            result, streams = asyncio.run(measure(targets, args, pids))
        finally:
            if litellm_proc is not None:
                stop(litellm_proc)
            if bare_proc is not None:
                stop(bare_proc)
            for proc in worker_procs:
                stop(proc)
            stop(dev_proc)
            stop(upstream_proc)
        sequential = args.requests // args.rounds * args.rounds
        stages = stage_tails(root / "data" / "clickhouse", WARM_UP, sequential) if args.stages else None

    print(f"latency: {args.requests} sequential requests per target in {args.rounds} interleaved rounds; "
          f"throughput: {args.throughput_requests} requests at concurrency {args.concurrency}; Postgres "
          + ", ".join(f"{k} = {v}" for k, v in durability.items()))  # fmt: skip
    direct = result["direct"][0]
    print(f"{'':10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}  {'added p50':>10}{'added p95':>10}{'added p99':>10}"
          "  req/s  errors")  # fmt: skip
    for name, (lat, rps, errors, *_) in result.items():
        added = [lat[p] - direct[p] for p in (50, 95, 99)]
        print(f"{name:10}{lat[50]:9.3f}{lat[95]:9.3f}{lat[99]:9.3f}  {added[0]:10.3f}{added[1]:10.3f}{added[2]:10.3f}"
              f"  {rps:7.0f}  {errors:6d}")  # fmt: skip
    if "litellm" in result:
        ours = result["ibex"][0][50] - direct[50]
        theirs = result["litellm"][0][50] - direct[50]
        print(f"added p50, ibex / litellm: {ours / theirs:.2f}; throughput ratio ibex / litellm: "
              f"{result['ibex'][1] / result['litellm'][1]:.1f}")  # fmt: skip
    figures.put("durability", durability)
    figures.put("method", f"{args.requests} sequential requests per target in {args.rounds} interleaved rounds; "
                f"added = the target's quantile minus the direct upstream's quantile of the same run; throughput: "
                f"{args.throughput_requests} requests at concurrency {args.concurrency}")  # fmt: skip
    print(
        "CPU per request of the throughput phase, core-microseconds by process (proxy: the process serving the "
        "target; its children: the processes it started, such as workers and the ClickHouse engine):"
    )
    for name, (*_, cpu, _) in result.items():
        print(f"  {name:10}" + ", ".join(f"{role} {us:.0f}" for role, us in cpu.items()))
    print(
        "CPU per request of the sequential phase, the same way: with one request at a time, what the stores and the"
        " proxy's background work (settles, analytics) spend beside each request is not spread over a crowd:"
    )
    for name, (*_, sequential_cpu) in result.items():
        print(f"  {name:10}" + ", ".join(f"{role} {us:.0f}" for role, us in sequential_cpu.items()))
    for name, (_, rps, errors, samples, cpu, sequential_cpu) in result.items():
        figures.put(f"targets.{name}", {"latency": latency(samples, samples=True), "rps": rps, "errors": errors,
                                        "cpu_us_per_request": cpu,
                                        "sequential_cpu_us_per_request": sequential_cpu})  # fmt: skip
        if name != "direct":
            figures.put(f"added.{name}", {f"p{p}": result[name][0][p] - direct[p] for p in (50, 95, 99)})
    if "litellm" in result:
        for name, key in (("ibex", "ratio_litellm"), ("bare", "ratio_litellm_bare")):  # bare: the floor of a hop
            if name in result:
                figures.put(key, {
                    f"p{p}": (result[name][0][p] - direct[p]) / (result["litellm"][0][p] - direct[p]) for p in (50, 99)
                })  # fmt: skip
    if streams:
        report_streams(streams, args, figures)
    for n in args.workers:  # `ibex proxy --workers N` alone (the "ibex" target is `ibex dev`, every stage in one)
        _, rps, errors, *_ = result[f"workers={n}"]
        figures.put(f"workers.{n}", {"rps": rps, "errors": errors})
    if stages is not None:
        print(f"where the proxy's time went, the {sequential} sequential requests through `ibex dev`, server side "
              "(its analytics rows), ms:")  # fmt: skip
        print(f"  {'':18}{'p50':>8}{'p99':>8}{'max':>8}")
        for name, values in sorted(stages.items(), key=lambda kv: -kv[1]["p99"]):
            print(f"  {name:18}{values['p50']:8.3f}{values['p99']:8.3f}{values['max']:8.2f}")
        figures.put("stages.ibex", stages)
    figures.write(args.json)


if __name__ == "__main__":
    main()
