"""Context assembly benchmark (architecture section 16): end to end at 10k memories per agent.

Starts its own embedded stores, the memory stage, the context stage and the proxy in-process (real Postgres +
pgvector, Valkey, the ONNX embedder, Presidio), creates tenants through the real reconcile code, gives one agent
``--memories`` memories (setup shortcut, as in ``bench/memory_bench.py``: rows embedded with the same embedder,
COPY'd as the admin role, then vacuumed and analyzed; the hot cache is filled by writing ``--hot`` more through
the real refinery), then measures, side by side in one run:

1. ``Assemble`` over gRPC with a signed principal, as the proxy calls it: query masking and embedding, the hot and
   cold branches, budget, knapsack packing, formatting. The stage runs with deadlines raised to 5 s so the real
   distribution is measured (with the production 40 ms deadline a slow call would be cut off, not measured); the
   share of calls over 40 ms is reported.
2. A chat through the proxy with memory on (the full path: gates, assembly, echo) versus the same agent shape with
   ``memory.enabled: false``: the added latency of context assembly as a client sees it.

Every response's status is checked. Run: ``.venv/bin/python bench/context_bench.py [--memories 10000]
[--queries 300] [--repeats 3]``. Prints medians and percentiles per repeat; it never gates anything.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
from aiohttp import ClientSession

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.figures import Figures, latency  # noqa: E402
from bench.memory_bench import copy_rows, pct, query, sentence  # noqa: E402
from bench.stack import embedded_stack, event_loop_name, freeze_heap, run_loop  # noqa: E402
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2 as pb  # noqa: E402
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2_grpc as pb_grpc  # noqa: E402
from ibex_dataplane.security.principal import Principal, PrincipalSigner, grpc_target  # noqa: E402
from tests.support.proxy import running_proxy  # noqa: E402

ASSEMBLE = "/ibex.context.v1.ContextAssembly/Assemble"


def summary(label: str, ms: list[float]) -> str:
    return (
        f"{label:<44} n={len(ms):>4}  p50={statistics.median(ms):7.2f} ms  p95={pct(ms, 0.95):7.2f} ms  "
        f"p99={pct(ms, 0.99):7.2f} ms"
    )


def versions(durability: dict[str, str]) -> str:
    import grpc as g
    import onnxruntime

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return (
        f"commit {commit.stdout.strip()}; python {platform.python_version()}; numpy {np.__version__}; "
        f"grpcio {g.__version__}; onnxruntime {onnxruntime.__version__}; cores {os.cpu_count()}; "
        f"Postgres 18 (embedded, fsync {durability['fsync']}, synchronous_commit {durability['synchronous_commit']});"
        f" loadavg before {os.getloadavg()}"
    )


async def run(args: argparse.Namespace, figures: Figures) -> None:
    rng = random.Random(11)
    async with embedded_stack("ibex-context-bench-") as stack:
        settings, stores, embedder = stack.settings, stack.stores, stack.embedder
        tenant = await stack.tenants.create(agents=("alpha",), directive="You are the support assistant.")
        plain = await stack.tenants.create(
            agents=("alpha",), directive="You are the support assistant.", agent_spec={"memory": {"enabled": False}}
        )
        texts = [sentence(rng, i) for i in range(args.memories)]
        vectors = np.vstack([await embedder.embed(texts[i : i + 256]) for i in range(0, len(texts), 256)])
        await copy_rows(stores, tenant, "alpha", texts, vectors)
        print(versions(stack.durability) + f"; event loop {event_loop_name(args.no_uvloop)}", flush=True)
        figures.put("durability", stack.durability)
        figures.put("memories", args.memories)
        print(f"setup: {args.memories} memories COPY'd for one agent; {args.hot} written through the refinery")
        async with (
            running_proxy(settings, stores, stack.pepper, memory=stack.memory_deps) as proxy,
            ClientSession() as http,
        ):
            assert proxy.context is not None and proxy.memory is not None
            headers = {"Authorization": f"Bearer {tenant.keys['alpha']}", "X-IBEX-Agent-ID": "alpha"}
            headers["X-IBEX-Agent-ID"] = str(tenant.agents["alpha"])
            for i in range(args.hot):
                body = {"content": sentence(rng, args.memories + i)}
                async with http.post(proxy.v1 + "/memories", json=body, headers=headers) as r:
                    assert r.status == 201, await r.text()
            signer = proxy.memory.signer
            print(f"heap frozen once the stages are up, as the serving commands do: {freeze_heap()} objects")
            async with grpc.aio.insecure_channel(proxy.context.address) as channel:
                stub = pb_grpc.ContextAssemblyStub(channel)  # type: ignore[no-untyped-call]
                for repeat in range(args.repeats):
                    await one_round(args, rng, stub, signer, tenant, plain, proxy, http, repeat, figures)


async def one_round(
    args: argparse.Namespace, rng: random.Random, stub: Any, signer: PrincipalSigner, tenant: Any, plain: Any,
    proxy: Any, http: ClientSession, repeat: int, figures: Figures,
) -> None:  # fmt: skip
    assembly_ms: list[float] = []
    server_ms: list[float] = []
    phases: dict[str, list[float]] = {"retrieval": [], "pack": [], "format": [], "hot": [], "cold": []}
    placed: list[int] = []
    degraded = 0
    for i in range(args.queries + 20):
        user = {"role": "user", "content": query(rng)}
        request = pb.AssembleRequest(
            model="echo", messages=[pb.Message(role="user", json=orjson.dumps(user))],
            limits=pb.Limits(context_tokens=2000),
            directive=pb.Directive(version=1, content="You are the support assistant.", injection_mode="SystemFirst"),
        )  # fmt: skip
        principal = Principal(
            tenant.org_id, tenant.agents["alpha"], frozenset({"chat"}), f"bench-{i}", time.time() + 10,
            grpc_target(ASSEMBLE),
        )  # fmt: skip
        started = time.perf_counter()
        response = await stub.Assemble(request, timeout=10, metadata=(("x-ibex-principal", signer.sign(principal)),))
        elapsed = (time.perf_counter() - started) * 1000
        if i < 20:
            continue  # warm-up
        assembly_ms.append(elapsed)
        server_ms.append(response.timings.total_ms)
        phases["retrieval"].append(response.timings.retrieval_ms)
        phases["pack"].append(response.timings.pack_ms)
        phases["format"].append(response.timings.format_ms)
        for branch in response.branches:
            if branch.name in phases:
                phases[branch.name].append(branch.latency_ms)
        placed.append(len(response.memories))
        degraded += response.degradation != pb.NONE
    print(f"-- repeat {repeat + 1}/{args.repeats} (loadavg {os.getloadavg()[0]:.2f})")
    print(summary("Assemble over gRPC (client-side)", assembly_ms))
    print(summary("  of which inside the stage", server_ms))
    print("  median per phase: " + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in phases.items() if v))
    over = sum(ms > 40 for ms in assembly_ms)
    print(f"  memories placed per assembly: median {statistics.median(placed)}; degraded {degraded}; "
          f"over the 40 ms production deadline: {over}/{len(assembly_ms)}")  # fmt: skip

    async def chat(t: Any) -> float:
        h = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
        body = {"model": "echo", "messages": [{"role": "user", "content": query(rng)}], "max_tokens": 16}
        started = time.perf_counter()
        async with http.post(proxy.v1 + "/chat/completions", json=body, headers=h) as r:
            await r.read()
            assert r.status == 200, r.status
        return (time.perf_counter() - started) * 1000

    with_memory: list[float] = []
    without: list[float] = []
    for _ in range(args.queries):  # interleaved, so load changes hit both sides alike
        with_memory.append(await chat(tenant))
        without.append(await chat(plain))
    print(summary("chat through the proxy, memory on", with_memory))
    print(summary("chat through the proxy, memory off", without))
    added = statistics.median(with_memory) - statistics.median(without)
    print(f"  added by context assembly (p50 difference): {added:.2f} ms")
    figures.put(f"repeats.{repeat}", {
        "assembly": latency(assembly_ms, samples=True), "inside_stage": latency(server_ms),
        "phases_median_ms": {k: statistics.median(v) for k, v in phases.items() if v},
        "memories_placed_median": statistics.median(placed), "degraded": degraded,
        "over_deadline": over, "chat_memory_on": latency(with_memory), "chat_memory_off": latency(without),
        "added_p50_ms": added, "load": os.getloadavg()[0],
    })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memories", type=int, default=10_000)
    parser.add_argument("--hot", type=int, default=50)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON here (bench/report.py)")
    parser.add_argument("--no-uvloop", action="store_true", help="asyncio's own event loop instead of production's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    figures = Figures("context")
    run_loop(run(args, figures), plain=args.no_uvloop)
    figures.write(args.json)


if __name__ == "__main__":
    main()
