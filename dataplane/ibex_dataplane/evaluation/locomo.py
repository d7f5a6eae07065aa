"""``ibex eval locomo``: evidence recall of the public memory search on LoCoMo-format conversations.

Owns the measurement, not the stack: given the proxy's base URL and a way to provision a fresh agent with an API
key (the CLI builds both on embedded stores, exactly as ``ibex dev`` does), each conversation gets its own agent;
every turn is written through ``POST /v1/memories:batch`` and every question of the chosen categories is asked
through ``POST /v1/memories/search``, with the agent's API key, over HTTP. There is no other retrieval path: the
figures are what a client gets. A deduplicated write answers with the memory that already holds the content, so
one memory can stand for several turns; it then counts for all of them.

With ``capture``, the agent has ``memory.capture: turns`` and each conversation is replayed instead through
``POST /v1/chat/completions`` (the ``echo`` model, one chat session per LoCoMo session, ``X-IBEX-Observed-At``
from the session's date, ``X-IBEX-Skip-Memory`` since no answer is read): the memory stage's capture worker
writes the memories. Once the agent's capture queue is drained, its captured memories are listed through
``GET /v1/memories?source=extracted`` and mapped back to turns by their ``metadata.capture`` session and turn. A
turn whose capture was an exact duplicate of an earlier memory is not mapped (the route does not say which
memory absorbed it).

Evidence recall@k of a question: the share of its evidence turns among the turns of the first k results;
averaged over questions, overall and by category. Search latency is the client's round trip, p50 and p95 by
nearest rank. Called by :func:`ibex_dataplane.cli.main`; the pure pieces (:func:`recall_at`, :func:`summarize`)
are tested on their own.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp
import orjson

from ibex_dataplane.evaluation.dataset import CATEGORY_NAMES, Conversation, Question

DEFAULT_KS = (1, 5, 10, 20)
BATCH_SIZE = 100  # the route's maximum
MAX_SEARCH_LIMIT = 50
INGEST_CONCURRENCY = 2  # batches in flight: PII checks and embedding of two batches overlap
ATTEMPTS = 6  # a 503, 429 or in-progress 409 is retried after its Retry-After (at most RETRY_CAP_S), as a client would
RETRY_CAP_S = 5.0


@dataclass(frozen=True, slots=True)
class Agent:
    """What a client needs to act as one agent: its id (``X-IBEX-Agent-ID``) and an API key."""

    agent_id: str
    token: str
    # capture: True once the agent's first ``n`` chat turns are checkpointed and nothing of it is left queued
    drained: Callable[[int], Awaitable[bool]] | None = None


Provision = Callable[[str], Awaitable[Agent]]
CAPTURE_TIMEOUT_S = 1800.0


class EvaluationError(Exception):
    """The stack refused the evaluation's requests (not a quality problem: a broken run)."""


@dataclass
class IngestStats:
    turns: int = 0
    created: int = 0
    deduplicated: int = 0
    quarantined: int = 0
    redacted: int = 0  # stored with a placeholder in place of something found as personal data
    failed: int = 0
    superseded: set[str] = field(default_factory=set)  # memories a later write replaced (no longer searchable)
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Scored:
    question: Question
    recall: dict[int, float]
    latency_ms: float
    results: int


@dataclass
class Report:
    ks: tuple[int, ...]
    scored: list[Scored] = field(default_factory=list)
    ingest: IngestStats = field(default_factory=IngestStats)
    skipped: int = 0  # questions without evidence in their conversation

    def to_json(self) -> dict[str, Any]:
        return summarize(self.scored, self.ks, self.ingest)


def recall_at(evidence: Sequence[str], ranked: Sequence[Sequence[str]], k: int) -> float:
    """Share of ``evidence`` among the turns of the first ``k`` results (each result names one or more turns)."""
    if not evidence:
        raise ValueError("a question without evidence has no recall")
    found = {turn for result in ranked[:k] for turn in result}
    return sum(1 for e in evidence if e in found) / len(evidence)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(scored: Sequence[Scored], ks: Sequence[int], ingest: IngestStats) -> dict[str, Any]:
    """The ``--json`` object: question and turn counts, recall by k overall and by category, timings."""

    def mean(items: Sequence[Scored], k: int) -> float:
        return round(sum(s.recall[k] for s in items) / len(items), 4) if items else 0.0

    categories = sorted({s.question.category for s in scored})
    latencies = [s.latency_ms for s in scored]
    return {
        "questions": len(scored),
        "turns": ingest.turns,
        "recall": {str(k): mean(scored, k) for k in ks},
        "by_category": {
            str(c): {str(k): mean([s for s in scored if s.question.category == c], k) for k in ks} for c in categories
        },
        "ingest_s": round(ingest.seconds, 3),
        "search_p50_ms": round(percentile(latencies, 50), 2),
        "search_p95_ms": round(percentile(latencies, 95), 2),
    }


class Progress:
    """A one-line progress bar on a terminal; silent on anything else (pipes, files, tests)."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream if stream is not None and stream.isatty() else None

    def update(self, label: str, done: int, total: int) -> None:
        if self._stream is None:
            return
        width = 30
        filled = width * done // max(total, 1)
        self._stream.write(f"\r{label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            self._stream.write("\n")
        self._stream.flush()


class _Client:
    """The two routes, as the agent: API key in ``Authorization``, agent id in ``X-IBEX-Agent-ID``."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, agent: Agent) -> None:
        self._http = http
        self._base = base_url.rstrip("/")
        self._headers = {
            "Authorization": f"Bearer {agent.token}",
            "X-IBEX-Agent-ID": agent.agent_id,
            "Content-Type": "application/json",
        }

    async def post(
        self, path: str, body: Any, *, idempotent: bool = False, headers: dict[str, str] | None = None
    ) -> Any:
        """One call; a 503 or 429 (the stack is overloaded or a store is away), or a 409 saying the same idempotent
        write is still in progress, is retried after its Retry-After.
        Writes retry only with an ``Idempotency-Key``, so a retried batch can never be applied twice."""
        return await self._call("POST", path, orjson.dumps(body), idempotent=idempotent, extra=headers)

    async def get(self, path: str, params: dict[str, str]) -> Any:
        return await self._call("GET", path, None, params=params)

    async def _call(
        self,
        method: str,
        path: str,
        data: bytes | None,
        *,
        idempotent: bool = False,
        extra: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        headers = {**self._headers, **(extra or {})}
        if idempotent:
            headers["Idempotency-Key"] = f"eval-{uuid.uuid4().hex}"
        for attempt in range(1, ATTEMPTS + 1):
            async with self._http.request(method, self._base + path, data=data, headers=headers, params=params) as r:
                raw = await r.read()
                if r.status == 200:
                    return orjson.loads(raw)
                retry_after = r.headers.get("Retry-After", "1")
            # 409 IDEMPOTENCY_IN_PROGRESS: an earlier attempt the proxy gave up on is still being written.
            in_progress = r.status == 409 and b"IDEMPOTENCY_IN_PROGRESS" in raw
            if not (r.status in (429, 503) or in_progress) or attempt == ATTEMPTS:
                raise EvaluationError(f"{method} {path} answered {r.status}: {raw[:300]!r}")
            await asyncio.sleep(min(RETRY_CAP_S, float(retry_after) if retry_after.isdigit() else 1.0))
        raise AssertionError("unreachable")


async def _ingest(
    client: _Client, conversation: Conversation, stats: IngestStats, progress: Progress
) -> dict[str, set[str]]:
    """Write every turn; returns memory id -> the turns it holds."""
    holds: dict[str, set[str]] = {}
    turns = conversation.turns
    batches = [turns[i : i + BATCH_SIZE] for i in range(0, len(turns), BATCH_SIZE)]
    done = 0
    gate = asyncio.Semaphore(INGEST_CONCURRENCY)
    label = f"ingest {conversation.sample_id}"

    async def write(batch: Sequence[Any]) -> None:
        nonlocal done
        async with gate:
            reply = await client.post("/v1/memories:batch", {"items": [t.write_body() for t in batch]}, idempotent=True)
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or len(results) != len(batch):
            raise EvaluationError("the batch route answered without one result per item")
        for turn, result in zip(batch, results, strict=True):
            status = result.get("status")
            memory = result.get("memory") or {}
            if status == 201:
                stats.created += 1
            elif status == 200:
                stats.deduplicated += 1
            elif status == 202:
                stats.quarantined += 1
                continue  # kept for review, never retrieved
            else:
                stats.failed += 1
                continue
            if status == 201 and memory.get("content") != turn.content:
                stats.redacted += 1
            for relationship in result.get("relationships") or ():
                if relationship.get("kind") == "supersedes":
                    stats.superseded.add(str(relationship.get("target_id")))
            holds.setdefault(str(memory["id"]), set()).add(turn.dia_id)
        done += len(batch)
        progress.update(label, done, len(turns))

    started = time.perf_counter()
    await asyncio.gather(*(write(b) for b in batches))
    stats.seconds += time.perf_counter() - started
    stats.turns += len(turns)
    return holds


async def _capture(
    client: _Client, conversation: Conversation, agent: Agent, stats: IngestStats, progress: Progress
) -> dict[str, set[str]]:
    """Replay every turn as a chat of an agent that captures turns; returns memory id -> the turns it holds."""
    if agent.drained is None:
        raise EvaluationError("capture needs a way to tell when the agent's capture queue is drained")
    label = f"chat {conversation.sample_id}"
    started = time.perf_counter()
    turn_of: dict[tuple[str, int], str] = {}
    said: dict[tuple[str, str], set[str]] = {}  # (session, content) -> turns
    sessions: dict[int, list[Any]] = {}
    for t in conversation.turns:
        sessions.setdefault(t.session, []).append(t)
    done = 0
    for number, turns in sorted(sessions.items()):
        session_id = f"{conversation.sample_id}-session-{number}"
        for index, turn in enumerate(turns, 1):  # in order: the proxy numbers a session's turns as they come
            headers = {"X-IBEX-Session-ID": session_id, "X-IBEX-Skip-Memory": "1"}
            body = turn.write_body()
            if "observed_at" in body:
                headers["X-IBEX-Observed-At"] = body["observed_at"]
            chat = {"model": "echo", "messages": [{"role": "user", "content": turn.content}], "max_tokens": 1}
            await client.post("/v1/chat/completions", chat, headers=headers)
            turn_of[(session_id, index)] = turn.dia_id
            said.setdefault((session_id, turn.content), set()).add(turn.dia_id)
            done += 1
            progress.update(label, done, len(conversation.turns))
    deadline = time.monotonic() + CAPTURE_TIMEOUT_S
    while not await agent.drained(done):
        if time.monotonic() > deadline:
            raise EvaluationError(f"the capture queue of {conversation.sample_id} was not drained in time")
        await asyncio.sleep(0.2)
    stats.seconds += time.perf_counter() - started
    stats.turns += len(conversation.turns)
    holds: dict[str, set[str]] = {}
    stored = 0
    for status in ("active", "superseded", "quarantined"):
        cursor: str | None = ""
        while cursor is not None:
            params = {"source": "extracted", "status": status, "limit": "100"}
            if cursor:
                params["cursor"] = cursor
            page = await client.get("/v1/memories", params)
            for memory in page["data"]:
                stored += 1
                if status == "quarantined":
                    stats.quarantined += 1
                    continue
                stats.created += 1
                if status == "superseded":
                    stats.superseded.add(str(memory["id"]))
                where = (memory.get("metadata") or {}).get("capture") or {}
                session_id = str(where.get("session_id"))
                # By content first: the proxy numbers a session's turns as their checkpoints commit, which may
                # swap two quick turns; a masked memory no longer matches its turn's text, so then by number.
                dia_ids = said.get((session_id, str(memory.get("content"))))
                if dia_ids is None:
                    numbered = turn_of.get((session_id, int(where.get("turn", 0))))
                    dia_ids = {numbered} if numbered else set()
                if dia_ids:
                    holds.setdefault(str(memory["id"]), set()).update(dia_ids)
            cursor = page.get("next_cursor")
    stats.deduplicated += len(conversation.turns) - stored
    return holds


async def _ask(
    client: _Client,
    conversation: Conversation,
    holds: dict[str, set[str]],
    ks: Sequence[int],
    categories: Sequence[int],
    report: Report,
    progress: Progress,
) -> None:
    questions = [q for q in conversation.questions if q.category in categories]
    limit = min(MAX_SEARCH_LIMIT, max(ks))
    label = f"search {conversation.sample_id}"
    for i, question in enumerate(questions, 1):
        if not question.evidence:
            report.skipped += 1
            continue
        started = time.perf_counter()
        reply = await client.post("/v1/memories/search", {"query": question.text, "limit": limit})
        latency_ms = (time.perf_counter() - started) * 1000
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list):
            raise EvaluationError("the search route answered without results")
        ranked = [sorted(holds.get(str(r["memory"]["id"]), ())) for r in results]
        recall = {k: recall_at(question.evidence, ranked, k) for k in ks}
        report.scored.append(Scored(question, recall, latency_ms, len(results)))
        progress.update(label, i, len(questions))


async def evaluate(
    conversations: Sequence[Conversation],
    base_url: str,
    provision: Provision,
    *,
    ks: Sequence[int] = DEFAULT_KS,
    categories: Sequence[int] = (1, 2, 3, 4),
    progress: Progress | None = None,
    capture: bool = False,
) -> Report:
    """Ingest (or, with ``capture``, replay as chats) then question each conversation with its own fresh agent;
    the report holds every scored question."""
    report = Report(tuple(ks))
    progress = progress or Progress(None)
    async with aiohttp.ClientSession() as http:
        for conversation in conversations:
            agent = await provision(conversation.sample_id)
            client = _Client(http, base_url, agent)
            if capture:
                holds = await _capture(client, conversation, agent, report.ingest, progress)
            else:
                holds = await _ingest(client, conversation, report.ingest, progress)
            await _ask(client, conversation, holds, ks, categories, report, progress)
    return report


def render_table(report: Report) -> str:
    """The human output: recall@k by category and overall, then ingest and search figures."""
    summary = report.to_json()
    ks = [str(k) for k in report.ks]
    counts = {c: sum(1 for s in report.scored if s.question.category == c) for c in CATEGORY_NAMES}
    header = f"{'category':<16}{'questions':>10}" + "".join(f"{'R@' + k:>8}" for k in ks)
    lines = [header, "-" * len(header)]
    for c, row in summary["by_category"].items():
        name = f"{c} {CATEGORY_NAMES.get(int(c), '')}"
        lines.append(f"{name:<16}{counts.get(int(c), 0):>10}" + "".join(f"{row[k]:>8.3f}" for k in ks))
    lines.append("-" * len(header))
    lines.append(f"{'all':<16}{summary['questions']:>10}" + "".join(f"{summary['recall'][k]:>8.3f}" for k in ks))
    ingest = report.ingest
    rate = ingest.turns / ingest.seconds if ingest.seconds else 0.0
    empty = sum(1 for s in report.scored if s.results == 0)
    lines += [
        "",
        f"ingest: {ingest.turns} turns in {ingest.seconds:.1f}s ({rate:.0f}/s); created {ingest.created}, "
        f"deduplicated {ingest.deduplicated}, quarantined {ingest.quarantined}, redacted {ingest.redacted}, "
        f"superseded {len(ingest.superseded)}, failed {ingest.failed}",
        f"search: p50 {summary['search_p50_ms']:.1f} ms, p95 {summary['search_p95_ms']:.1f} ms; "
        f"{empty} questions without any result"
        + (f"; {report.skipped} skipped (no evidence)" if report.skipped else ""),
    ]
    return "\n".join(lines)


def default_progress() -> Progress:
    return Progress(sys.stderr)
