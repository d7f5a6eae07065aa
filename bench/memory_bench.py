"""Memory stage benchmark (architecture section 16): single write, bulk ingest and search at 10k and 100k memories.

Starts its own embedded stores, the memory stage and the proxy in-process (real Postgres + pgvector, Valkey, the
ONNX embedder and Presidio), creates one tenant through the real reconcile code, and drives everything over HTTP
through the proxy as an agent would:

1. single writes: N sequential ``POST /v1/memories`` of distinct sentences (the whole refinery);
2. bulk ingest: ``POST /v1/memories:batch`` of 100 items until the agent holds 10k memories;
3. search at 10k: sequential ``POST /v1/memories/search`` of random questions (query masking, embedding, hybrid
   SQL, scoring), with the CPU each search costs by consumer (Postgres, the event loop, each model; from /proc)
   and the query cache's hit rate; then an agent's tool loop, each question asked three times in a row, its first
   asks and its repeats (which the query cache serves) reported apart;
4. grow the agent to 100k memories. Setup shortcut (documented): the extra 90k rows are embedded with the same
   embedder ahead of time and COPY'd straight into ``memories`` as the admin role, because 90k writes through the
   refinery take most of an hour on 2 cores; a second org's agent gets 20k rows the same way, so the shared HNSW
   index really has to filter by tenant; the tables are then vacuumed and analyzed, as autovacuum would have done
   by the time an agent holds that many memories;
5. search at 100k as at 10k, plus the recall of the filtered ANN leg (HNSW iterative scan) against an exact scan.

Run: ``.venv/bin/python bench/memory_bench.py [--single 300] [--searches 300] [--big 100000] [--out FILE]``.
Prints medians and percentiles; it never gates anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import ClientSession

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cpu import cpu_ms_per_call, processes, stat_ticks  # noqa: E402
from bench.figures import Figures, latency  # noqa: E402
from bench.stack import embedded_stack, event_loop_name, freeze_heap, run_loop  # noqa: E402
from ibex_dataplane.embedding.splade import OnnxSpladeEncoder  # noqa: E402
from ibex_dataplane.memory.app import METRICS  # noqa: E402
from ibex_dataplane.memory.models import Tenant as MemoryTenant  # noqa: E402
from ibex_dataplane.memory.refinery import content_hash  # noqa: E402
from ibex_dataplane.memory.repository import MemoryRepository  # noqa: E402
from ibex_dataplane.memory.tuning import SearchTuning  # noqa: E402
from ibex_dataplane.runtime.stores import Stores  # noqa: E402
from tests.support.proxy import MemoryDeps, running_proxy  # noqa: E402
from tests.support.tenants import Tenant  # noqa: E402

SUBJECTS = ["The user", "Alice", "The support team", "Our CFO", "The on-call engineer", "The customer", "Bob",
            "The design lead", "The warehouse manager", "The new intern", "Priya", "The QA team", "Marco",
            "The sales rep", "The landlord", "The billing service", "The mobile app", "The nightly job"]  # fmt: skip
VERBS = ["prefers", "asked about", "complained about", "approved", "rejected", "scheduled", "forgot", "mentioned",
         "wants to change", "is responsible for", "reviewed", "cancelled", "renewed", "escalated", "documented",
         "migrated", "is allergic to", "recommended", "budgeted for", "blocked"]  # fmt: skip
OBJECTS = [
    "the quarterly report",
    "window seats",
    "the staging cluster",
    "oat milk",
    "the vendor contract",
    "dark mode",
    "the Kubernetes upgrade",
    "weekly standups",
    "the refund policy",
    "Postgres backups",
    "the onboarding checklist",
    "peanuts",
    "the marketing budget",
    "the API rate limits",
    "Python 3.12",
    "the holiday rota",
    "invoice reminders",
    "the data retention policy",
    "gluten-free meals",
    "the hiring plan",
    "the SLA dashboard",
    "two-factor login",
    "the office move",
    "TLS certificates",
    "the pricing page",
    "customer churn",
    "the incident review",
    "GPU quotas",
    "the loyalty program",
]
WHEN = ["on Mondays", "every morning", "last week", "before the release", "after lunch", "in Q3", "since March",
        "during the audit", "at month end", "next sprint", "on weekends", "every other Friday", "yesterday",
        "before noon", "in the spring"]  # fmt: skip
PLACES = ["in Berlin", "in the London office", "on the west coast", "in the Lisbon hub", "remotely", "in Tokyo",
          "at headquarters", "in the Austin lab", "in Singapore", "at the Paris store"]  # fmt: skip
DETAILS = [
    "because of costs",
    "for compliance",
    "to cut latency",
    "at the customer's request",
    "after feedback",
    "as a trial",
    "for the second time",
    "with a deadline",
    "despite objections",
    "without a ticket",
]


def sentence(rng: random.Random, i: int) -> str:
    """A varied synthetic memory; ``i`` makes it unique (so exact dedup never fires by accident)."""
    return (
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(WHEN)} "
        f"{rng.choice(PLACES)} {rng.choice(DETAILS)} (note {i})."
    )


def query(rng: random.Random) -> str:
    return f"what does {rng.choice(SUBJECTS).lower()} think of {rng.choice(OBJECTS)} {rng.choice(WHEN)}"


def phase_means(metrics: Any, before: dict[str, tuple[float, float]]) -> tuple[str, dict[str, tuple[float, float]]]:
    """Mean seconds per search phase (embed, query, score) since ``before``, from the stage's own histogram."""
    now: dict[str, tuple[float, float]] = {}
    for family in metrics.search_seconds.collect():
        for sample in family.samples:
            phase = sample.labels.get("phase", "")
            total, count = now.get(phase, (0.0, 0.0))
            if sample.name.endswith("_sum"):
                now[phase] = (sample.value, count)
            elif sample.name.endswith("_count"):
                now[phase] = (total, sample.value)
    parts = []
    for phase, (total, count) in sorted(now.items()):
        t0, c0 = before.get(phase, (0.0, 0.0))
        if count > c0:
            parts.append(f"{phase}={(total - t0) / (count - c0) * 1000:.2f}ms")
    return "  mean per phase in the memory stage: " + " ".join(parts), now


def phase_dict(line: str) -> dict[str, float]:
    """``phase_means``' line back as {phase: mean ms} (for the JSON figures)."""
    pairs = (part.split("=") for part in line.split(":", 1)[1].split())
    return {phase: float(value.removesuffix("ms")) for phase, value in pairs}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(label: str, seconds: list[float]) -> str:
    ms = [s * 1000 for s in seconds]
    return (
        f"{label:<34} n={len(ms):>5}  p50={statistics.median(ms):7.2f} ms  p95={pct(ms, 0.95):7.2f} ms  "
        f"p99={pct(ms, 0.99):7.2f} ms  mean={statistics.fmean(ms):7.2f} ms"
    )


async def timed(n: int, call: Callable[[int], Awaitable[None]]) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        await call(i)
        out.append(time.perf_counter() - started)
    return out


def cpu_ticks() -> dict[str, int]:
    """CPU clock ticks so far of this process's threads (by role; threads Python does not know are onnxruntime's)
    and of every Postgres process, from /proc; :func:`cpu_ms_per_call` turns two readings into a breakdown."""
    roles = {"MainThread": "event loop (client, proxy, memory stage)", "ibex-embed": "dense model",
             "ibex-splade": "sparse model", "ibex-pii": "PII"}  # fmt: skip
    names = {t.native_id: roles.get(t.name.split("_")[0], t.name) for t in threading.enumerate()}
    out: dict[str, int] = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            n = stat_ticks(task / "stat").total
            key = names.get(int(task.name), "onnxruntime pool")
            out[key] = out.get(key, 0) + n
    for pid, ticks in processes():
        if ticks.name == "postgres" and pid != os.getpid():
            out["postgres"] = out.get("postgres", 0) + ticks.total
    return out


async def copy_rows(
    stores: Stores, tenant: Tenant, agent: str, texts: list[str], vectors: np.ndarray[Any, Any]
) -> None:
    """Setup shortcut: rows with precomputed embeddings and SPLADE weights, COPY'd as the admin role (bypasses the
    refinery; the triggers still write the BM25 and SPLADE postings), then vacuumed and analyzed. Without the
    weights, the memory stage's sparse backfill would encode every row while the benchmark measures."""
    assert stores.admin_pool is not None
    org, agent_id = tenant.org_id, tenant.agents[agent]
    encoder = OnnxSpladeEncoder.from_installed_packages()
    try:
        sparse = [v for i in range(0, len(texts), 256) for v in await encoder.encode(texts[i : i + 256])]
    finally:
        encoder.close()
    records = [
        (uuid.uuid4(), org, agent_id, text, content_hash(text), "active", "imported", 1.0, "{}", vector,
         w.tokens.tolist(), w.weights.tolist())
        for text, vector, w in zip(texts, vectors, sparse, strict=True)
    ]  # fmt: skip
    async with stores.admin_pool.acquire() as conn:
        for first in range(0, len(records), 5000):
            await conn.copy_records_to_table(
                "memories",
                records=records[first : first + 5000],
                timeout=900,  # HNSW upkeep and the postings triggers: minutes per batch at 100k on 2 cores
                columns=[
                    "id",
                    "org_id",
                    "agent_id",
                    "content",
                    "content_hash",
                    "status",
                    "source",
                    "confidence",
                    "metadata",
                    "embedding",
                    "sparse_tokens",
                    "sparse_weights",
                ],
            )
        # Vacuumed as autovacuum would have by the time an agent holds this many memories: the postings' index-only
        # scans then skip the heap (right after the COPY they visit it for every posting).
        await conn.execute("VACUUM (ANALYZE) memories, memory_terms, memory_sparse_terms")
        pending = await conn.fetchval(
            "SELECT count(*) FROM memories WHERE agent_id = $1 AND status = 'active' AND sparse_tokens IS NULL",
            agent_id,
        )
    assert pending == 0, f"{pending} copied rows without SPLADE weights"


@dataclass(frozen=True)
class AnnRecall:
    strict: float  # of the exact scan's k nearest, the share the HNSW leg returned
    ties: float  # the same, counting as found a returned neighbour no farther than the exact k-th one (a tie)


async def ann_recall(
    stores: Stores, tenant: Tenant, vectors: np.ndarray[Any, Any], ef_search: int, k: int = 10
) -> AnnRecall:
    """Recall@k of the filtered HNSW leg (as the search runs it: iterative scan, ``ef_search`` from the settings)
    against an exact scan of the agent's rows. The generated sentences differ in little more than a number, so a
    query can have more than k rows at the k-th distance; ``ties`` counts a returned row at that distance as found."""
    hits = tied = total = 0
    org, agent = tenant.org_id, tenant.agents["alpha"]
    sql = (
        "SELECT id, m.embedding <=> $3 AS distance FROM memories m WHERE m.org_id = $1 AND m.agent_id = $2 "
        "AND m.status = 'active' AND m.embedding IS NOT NULL ORDER BY m.embedding <=> $3 LIMIT $4"
    )
    for vector in vectors:
        async with stores.db.tenant(org, agent, readonly=True) as conn:
            await conn.execute(
                "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true), "
                "set_config('hnsw.ef_search', $1, true)",
                str(ef_search),
            )
            approx = {r["id"]: r["distance"] for r in await conn.fetch(sql, org, agent, vector, k)}
        async with stores.db.tenant(org, agent, readonly=True) as conn:
            await conn.execute("SET LOCAL enable_indexscan = off")
            exact = {r["id"]: r["distance"] for r in await conn.fetch(sql, org, agent, vector, k)}
        farthest = max(exact.values(), default=0.0)
        hits += len(approx.keys() & exact.keys())
        tied += sum(1 for i, d in approx.items() if i in exact or d <= farthest + 1e-9)
        total += len(exact)
    return AnnRecall(hits / max(total, 1), min(tied, total) / max(total, 1))


async def direct_search(stores: Stores, tenant: Tenant, vectors: np.ndarray[Any, Any]) -> list[float]:
    """The three legs' statements alone, concurrently as search runs them (scoring, hits, hydration, each in its
    tenant transaction with its planner settings), with the production pools; no HTTP, no model, no ranking."""
    repo = MemoryRepository(stores.db)
    scope = MemoryTenant(tenant.org_id, tenant.agents["alpha"])
    t = SearchTuning()
    text = "what does the user think of dark mode in q3"
    encoder = OnnxSpladeEncoder.from_installed_packages()
    try:
        (sparse,) = await encoder.encode([text])
    finally:
        encoder.close()

    async def ready(value: Any) -> Any:
        return value

    out = []
    for i in range(200):
        started = time.perf_counter()
        await asyncio.gather(
            repo.search_vector(
                scope, vector=ready(vectors[i % len(vectors)]), at=None, candidates=t.ann_candidates,
                min_similarity=t.min_similarity, min_confidence=None, labels=[],
            ),
            repo.search_text(
                scope, text=text, at=None, candidates=t.text_candidates, min_confidence=None, labels=[],
                term_rows=t.text_term_rows, population=t.text_population,
            ),
            repo.search_sparse(
                scope, vector=ready(sparse), candidates=t.sparse_candidates, min_confidence=None, labels=[],
                term_rows=t.sparse_term_rows,
            ),
        )  # fmt: skip
        out.append(time.perf_counter() - started)
    return out


async def run(args: argparse.Namespace, figures: Figures) -> list[str]:
    lines: list[str] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    rng = random.Random(7)
    report(f"event loop: {event_loop_name(args.no_uvloop)}")
    async with embedded_stack("ibex-memory-bench-") as stack:
        settings, stores, embedder, redactor, pepper = (
            stack.settings,
            stack.stores,
            stack.embedder,
            stack.redactor,
            stack.pepper,
        )
        factory = stack.tenants
        tenant = await factory.create(agents=("alpha",))
        other = await factory.create(agents=("alpha",))
        async with (
            running_proxy(settings, stores, pepper, memory=MemoryDeps(embedder, redactor)) as proxy,
            ClientSession() as http,
        ):
            headers = {"Authorization": f"Bearer {tenant.keys['alpha']}", "X-IBEX-Agent-ID": "alpha"}
            headers["X-IBEX-Agent-ID"] = str(tenant.agents["alpha"])
            counter = iter(range(10**9))

            async def post(path: str, body: Any, expect: int = 200) -> Any:
                async with http.post(proxy.v1 + path, json=body, headers=headers) as r:
                    payload = await r.json()
                    assert r.status == expect, (r.status, payload)
                    return payload

            report(f"machine: {__import__('os').cpu_count()} cores; embedded Postgres 18 + pgvector, Valkey")
            # Warm-up (model, prepared statements, pools).
            for _ in range(20):
                await post("/memories", {"content": sentence(rng, next(counter))}, 201)
            report(f"heap frozen after the warm-up, as the serving commands do: {freeze_heap()} objects")

            single = await timed(
                args.single, lambda i: post("/memories", {"content": sentence(rng, next(counter))}, 201)
            )
            report(summary("single write (through proxy)", single))
            figures.put("single_write", latency([s * 1000 for s in single]))
            figures.put("durability", stack.durability)

            total = args.single + 20
            statuses: dict[int, int] = {}
            for streams in sorted({1, args.streams}):
                # Half of the remaining ingest sequentially, the rest with concurrent batch requests (a bulk
                # importer's natural shape: embedding one batch overlaps PII and Postgres work of another).
                goal = total + (args.small - total) // (2 if streams == 1 and args.streams > 1 else 1)
                started, cpu0 = time.perf_counter(), cpu_ticks()
                before = total

                async def stream(goal: int = goal) -> None:
                    nonlocal total
                    while total < goal:
                        n = min(100, goal - total)
                        total += n
                        body = {"items": [{"content": sentence(rng, next(counter))} for _ in range(n)]}
                        reply = await post("/memories:batch", body)
                        for r in reply["results"]:
                            statuses[r["status"]] = statuses.get(r["status"], 0) + 1

                await asyncio.gather(*(stream() for _ in range(streams)))
                elapsed = time.perf_counter() - started
                cpu = cpu_ms_per_call(cpu0, cpu_ticks(), total - before)
                report(f"bulk ingest, batches of 100, {streams} stream(s): {total - before} memories in "
                       f"{elapsed:.1f}s = {(total - before) / elapsed:.0f} memories/s")  # fmt: skip
                report(f"  CPU per memory, core-ms: {cpu}")
                figures.put(f"bulk.streams_{streams}", {"memories": total - before, "seconds": elapsed,
                                                        "per_second": (total - before) / elapsed,
                                                        "cpu_ms_per_memory": cpu})  # fmt: skip

            report(f"bulk item statuses (201 created, 202 quarantined, 200 duplicate): {sorted(statuses.items())}")

            async def search(_: int) -> None:
                await post("/memories/search", {"query": query(rng)})

            assert proxy.memory is not None
            metrics = proxy.memory.app[METRICS]
            registry = metrics.registry

            def lookups() -> tuple[float, float]:
                def count(result: str) -> float:
                    return registry.get_sample_value("ibex_memory_query_cache_lookups_total", {"result": result}) or 0.0

                return count("hit"), count("miss")

            async def distinct_and_repeated(size: int) -> tuple[list[float], str, dict[str, Any]]:
                """Distinct random queries (the headline figure, with the CPU each search costs and the query
                cache's hit rate), then an agent's tool loop: each query asked three times in a row."""
                for _ in range(20):
                    await search(0)
                _, marks = phase_means(metrics, {})
                (h0, m0), cpu0 = lookups(), cpu_ticks()
                measured = await timed(args.searches, search)
                cpu = cpu_ms_per_call(cpu0, cpu_ticks(), args.searches)
                (h1, m1) = lookups()
                report(summary(f"search at {size // 1000}k (through proxy)", measured))
                line = phase_means(metrics, marks)[0]
                report(line)
                hit_rate = (h1 - h0) / max(h1 - h0 + m1 - m0, 1)
                report(f"  CPU per search, core-ms: {cpu}; query cache hit rate {hit_rate:.3f}")
                asked = [query(rng) for _ in range(args.searches // 3)]
                loop = await timed(len(asked) * 3, lambda i: post("/memories/search", {"query": asked[i // 3]}))
                first, again = loop[0::3], [t for i, t in enumerate(loop) if i % 3]
                report(summary(f"  tool loop at {size // 1000}k, first ask", first))
                report(summary(f"  tool loop at {size // 1000}k, repeats", again))
                extra = {"cpu_ms_per_search": cpu, "query_cache_hit_rate": hit_rate,
                         "tool_loop": {"first": latency([t * 1000 for t in first]),
                                       "repeats": latency([t * 1000 for t in again])}}  # fmt: skip
                return measured, line, extra

            small, line, more = await distinct_and_repeated(total)
            qvecs = embedder.embed_sync([query(rng) for _ in range(50)])
            ef_search = settings.memory_hnsw_ef_search
            recall = await ann_recall(stores, tenant, qvecs, ef_search)
            report(f"filtered ANN recall@10 at {total // 1000}k (ef_search {ef_search}): {recall.strict:.3f}, "
                   f"{recall.ties:.3f} counting ties at the 10th distance")  # fmt: skip
            figures.put(f"search.{total}", {"latency": latency([s * 1000 for s in small], samples=True),
                                            "phases_ms": phase_dict(line), "ann_recall_at_10": recall.strict,
                                            "ann_recall_at_10_ties": recall.ties, **more})  # fmt: skip

            if args.big > total:
                extra = args.big - total
                started = time.perf_counter()
                texts = [sentence(rng, next(counter)) for _ in range(extra)]
                noise = [sentence(rng, next(counter)) for _ in range(args.noise)]
                vectors = embedder.embed_sync(texts + noise)
                embedded = time.perf_counter() - started
                await copy_rows(stores, tenant, "alpha", texts, vectors[:extra])
                await copy_rows(stores, other, "alpha", noise, vectors[extra:])
                copied = time.perf_counter() - started - embedded
                report(
                    f"setup shortcut: embedded {extra + args.noise} texts in {embedded:.0f}s "
                    f"({(extra + args.noise) / embedded:.0f}/s, embedder only), COPY + HNSW upkeep {copied:.0f}s; "
                    f"other org: {args.noise} rows"
                )
                big, line, more = await distinct_and_repeated(args.big)
                report(
                    summary(
                        f"  the three legs' statements alone at {args.big // 1000}k",
                        await direct_search(stores, tenant, qvecs),
                    )
                )
                single_big = await timed(
                    100, lambda i: post("/memories", {"content": sentence(rng, next(counter))}, 201)
                )
                report(summary(f"single write at {args.big // 1000}k", single_big))
                recall = await ann_recall(stores, tenant, qvecs, ef_search)
                report(f"filtered ANN recall@10 at {args.big // 1000}k (ef_search {ef_search}): {recall.strict:.3f}, "
                       f"{recall.ties:.3f} counting ties at the 10th distance")  # fmt: skip
                big_ms = [s * 1000 for s in big]
                found = {"latency": latency(big_ms, samples=True), "phases_ms": phase_dict(line),
                         "ann_recall_at_10": recall.strict, "ann_recall_at_10_ties": recall.ties, **more}  # fmt: skip
                figures.put(f"search.{args.big}", found)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, default=300, help="sequential single writes to time")
    parser.add_argument("--searches", type=int, default=300, help="sequential searches to time per size")
    parser.add_argument("--small", type=int, default=10_000, help="memories of the agent for the first search run")
    parser.add_argument("--big", type=int, default=100_000, help="memories of the agent for the second search run")
    parser.add_argument("--noise", type=int, default=20_000, help="rows of another org in the same index")
    parser.add_argument("--streams", type=int, default=1, help="concurrent batch requests in the second ingest half")
    parser.add_argument("--verbose", action="store_true", help="log per-stage refinery timings")
    parser.add_argument("--no-uvloop", action="store_true", help="asyncio's own event loop instead of production's")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON here (bench/report.py)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.verbose:
        logging.getLogger("ibex_dataplane.memory.refinery").setLevel(logging.INFO)
    figures = Figures("memory")
    lines = run_loop(run(args, figures), plain=args.no_uvloop)
    figures.write(args.json)
    if args.out:
        command = "python bench/memory_bench.py " + " ".join(sys.argv[1:])
        args.out.write_text("$ " + command + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
