"""The capture worker: memories from conversations (``spec.memory.capture``), drained from the durable queue.

The proxy queues a chat turn's captured messages in ``capture_jobs`` in the same statement as the turn's session
checkpoint. This worker leases due jobs (``FOR UPDATE SKIP LOCKED`` across tenants, ids only), reads each inside
its own tenant's scope and runs it through the whole refinery like a client write (validation, PII redaction or
quarantine, exact and near dedup, embedding, supersession), with provenance: ``source: extracted``, the session
id, ``observed_at`` from when the turn happened, and ``metadata.capture`` naming the session, turn and role. A
captured turn is a record of what was said and when (searches that name a period match ``observed_at``), not a
claim about how long something holds: it carries no ``valid_from``, so the interval rule never makes one remark
supersede an earlier, similar one. A ``facts`` job first goes to the extraction model
(:mod:`ibex_dataplane.memory.facts`), and each fact it returns is a candidate, valid from the date the
conversation gives it or from when it was said. A processed job is deleted with its text.

Delivery is at least once (a worker killed mid-job leaves the job leased; the lease runs out and another worker
takes it), and harmless when repeated: each job claims the deterministic idempotency key
``capture:<session>:<turn>`` in the same ledger client writes use, so a job that already stored its memories
replays instead of writing twice. Store or model outages retry with backoff; after ``max_attempts`` a job fails
for good, visibly (metadata and error kept, text deleted). Nothing here can fail or slow a chat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson

from ibex_dataplane.memory.extraction import Fact
from ibex_dataplane.memory.facts import ExtractionRefused, ExtractionUnavailable, FactExtractor
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.refinery import WriteOutcome, WriteResult
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.shared.errors import IdempotencyConflict, ServiceError
from ibex_dataplane.shared.idempotency import IdempotencyLedger, StoredResponse, fingerprint
from ibex_dataplane.shared.memory_limits import MAX_CONTENT_BYTES
from ibex_dataplane.store.errors import StoreError

log = logging.getLogger(__name__)

ROUTE = "capture"
Write = Callable[..., Awaitable[tuple[list[WriteResult], list[Any]]]]


class Retry(Exception):
    """The job could not be processed now (a store or model is down): try again later."""


def chunks(text: str, limit: int = MAX_CONTENT_BYTES) -> list[str]:
    """``text`` in pieces of at most ``limit`` UTF-8 bytes, cut at whitespace where there is some."""
    out: list[str] = []
    rest = text.strip()
    while len(rest.encode()) > limit:
        head = rest.encode()[:limit].decode(errors="ignore")
        cut = max(head.rfind(" "), head.rfind("\n"))
        piece = head[:cut] if cut > 0 else head
        out.append(piece.strip())
        rest = rest[len(piece) :].strip()
    if rest:
        out.append(rest)
    return out


def messages_of(job: dict[str, Any]) -> list[dict[str, Any]]:
    messages = job["messages"]
    return list(orjson.loads(messages) if isinstance(messages, str | bytes) else messages)


def candidates(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The candidate memories of a ``turns`` job: one per captured message (long ones in pieces)."""
    messages = messages_of(job)
    observed: datetime = job["observed_at"]
    items: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        for part, text in enumerate(chunks(str(message.get("content", "")))):
            items.append({
                "content": text,
                "source": "extracted",
                "session_id": job["session_id"],
                "observed_at": observed.isoformat(),
                "metadata": {"capture": {"session_id": job["session_id"], "turn": job["turn"],
                                         "role": message.get("role"), "message": index, "part": part}},
            })  # fmt: skip
    return items


def fact_candidates(job: dict[str, Any], facts: list[Fact], model: str) -> list[dict[str, Any]]:
    """The candidate memories of a ``facts`` job: one per extracted fact, valid from the date the conversation
    gives it or else from when it was said, so the conflict stage lets a newer fact supersede an older one."""
    observed: datetime = job["observed_at"]
    items: list[dict[str, Any]] = []
    for index, fact in enumerate(facts):
        capture = {"session_id": job["session_id"], "turn": job["turn"], "mode": "facts", "model": model,
                   "fact": index}  # fmt: skip
        items.append({
            "content": fact.content, "source": "extracted", "session_id": job["session_id"],
            "observed_at": observed.isoformat(), "valid_from": (fact.valid_from or observed).isoformat(),
            "metadata": {"capture": capture},
        })  # fmt: skip
    return items


class CaptureWorker:
    def __init__(
        self,
        repo: MemoryRepository,
        write: Write,
        ledger: IdempotencyLedger,
        metrics: MemoryMetrics,
        *,
        extractor: FactExtractor | None = None,
        poll_seconds: float = 1.0,
        lease_seconds: float = 60.0,
        batch: int = 20,
        max_attempts: int = 8,
        max_backoff: float = 300.0,
        job_seconds: float = 30.0,
        housekeeping_every: float = 600.0,
        failed_retention: float = 7 * 86400.0,
    ) -> None:
        self._repo = repo
        self._write = write
        self._ledger = ledger
        self._metrics = metrics
        self._poll = poll_seconds
        self._lease = lease_seconds
        self._batch = batch
        self._max_attempts = max_attempts
        self._max_backoff = max_backoff
        self._job_seconds = job_seconds
        self._housekeeping_every = housekeeping_every
        self._failed_retention = failed_retention
        self._extractor = extractor
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> int:
        """Lease due jobs and process each; returns how many were leased."""
        jobs = await self._repo.lease_capture(self._batch, self._lease)
        for job in jobs:
            tenant = Tenant(job["org_id"], job["agent_id"])
            try:
                outcome = await self._process(tenant, job)
            except (Retry, ExtractionUnavailable) as e:
                await self._retry_or_fail(tenant, job, str(e))
                continue
            except ExtractionRefused as e:
                await self._fail(tenant, job, str(e))
                continue
            except (StoreError, OSError) as e:
                await self._retry_or_fail(tenant, job, type(e).__name__)
                continue
            except IdempotencyConflict:
                await self._fail(tenant, job, "the capture key was already used for different messages")
                continue
            except ServiceError as e:  # ledger down or busy, a stage degraded: later; anything else: never
                if e.status >= 500 or e.status == 409:
                    await self._retry_or_fail(tenant, job, f"{e.code}: {e.message}")
                else:
                    await self._fail(tenant, job, f"{e.code}: {e.message}")
                continue
            with contextlib.suppress(StoreError, OSError):  # not deleted: the replay path finishes it next time
                await self._repo.capture_done(tenant, job["id"])
            self._metrics.capture_jobs.labels(outcome).inc()
            self._metrics.capture_lag.observe(max(0.0, (datetime.now(UTC) - job["created_at"]).total_seconds()))
        return len(jobs)

    async def _process(self, tenant: Tenant, job: dict[str, Any]) -> str:
        if job["mode"] == "turns":
            items: list[dict[str, Any]] | None = candidates(job)
            body = orjson.dumps(items, option=orjson.OPT_SORT_KEYS)
        elif job["mode"] == "facts" and self._extractor is not None:
            items = None  # known after the extraction, which runs only if the key was not already used
            body = orjson.dumps(messages_of(job), option=orjson.OPT_SORT_KEYS)
        else:
            raise Retry(f"capture mode {job['mode']!r} is not served by this worker")
        key = f"{ROUTE}:{job['session_id']}:{job['turn']}"
        claim = await self._ledger.claim(
            tenant.org_id, tenant.agent_id, key, ROUTE, fingerprint(ROUTE, body), lock_seconds=self._lease
        )
        if isinstance(claim, StoredResponse):
            return "replayed"
        try:
            if items is None:
                items = await self._extract(tenant, job)
            results, _ = await self._write(
                tenant, items, request_id=job["request_id"], deadline=time.time() + self._job_seconds
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await self._ledger.abandon(claim)
            raise
        unavailable = [r.error for r in results if r.error is not None and r.error.status >= 500]
        if unavailable:
            with contextlib.suppress(Exception):
                await self._ledger.abandon(claim)
            raise Retry(f"{unavailable[0].code}: {unavailable[0].message}")
        for r in results:
            self._metrics.capture_messages.labels(
                WriteOutcome.REJECTED.value if r.error is not None else r.outcome.value
            ).inc()
        summary = {"memories": [str(r.memory.id) if r.memory else None for r in results],
                   "outcomes": [r.outcome.value for r in results]}  # fmt: skip
        await self._ledger.complete(claim, StoredResponse(200, orjson.dumps(summary)))
        return "captured"

    async def _extract(self, tenant: Tenant, job: dict[str, Any]) -> list[dict[str, Any]]:
        assert self._extractor is not None
        messages = messages_of(job)
        if not job["model"]:
            raise ExtractionRefused("no extraction model: set spec.memory.extractionModel or a default model")
        facts, model = await self._extractor.facts(
            tenant, model=job["model"], request_id=job["request_id"], observed_at=job["observed_at"],
            earlier=[m for m in messages if m.get("context")], latest=[m for m in messages if not m.get("context")],
        )  # fmt: skip
        return fact_candidates(job, facts, model)

    async def _retry_or_fail(self, tenant: Tenant, job: dict[str, Any], error: str) -> None:
        if int(job["attempts"]) >= self._max_attempts:
            await self._fail(tenant, job, error)
            return
        delay = min(self._max_backoff, 2.0 ** min(int(job["attempts"]), 10))
        self._metrics.capture_jobs.labels("retry").inc()
        log.warning("capture job %d deferred (attempt %d): %s", job["id"], job["attempts"], error)
        with contextlib.suppress(StoreError, OSError):
            await self._repo.capture_retry(tenant, job["id"], error=error[:500], delay=delay)

    async def _fail(self, tenant: Tenant, job: dict[str, Any], error: str) -> None:
        self._metrics.capture_jobs.labels("failed").inc()
        log.error("capture job %d failed for good after %d attempts: %s", job["id"], job["attempts"], error)
        with contextlib.suppress(StoreError, OSError):
            await self._repo.capture_failed(tenant, job["id"], error=error[:500])

    async def observe_backlog(self) -> None:
        waiting, failed, oldest = await self._repo.capture_backlog()
        self._metrics.capture_queue.labels("waiting").set(waiting)
        self._metrics.capture_queue.labels("failed").set(failed)
        self._metrics.capture_oldest.set(oldest)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_housekeeping = loop.time()
        while True:
            handled = 0
            try:
                handled = await self.run_once()
                await self.observe_backlog()
                if loop.time() >= next_housekeeping:
                    next_housekeeping = loop.time() + self._housekeeping_every
                    await self._repo.capture_housekeeping(failed_age=self._failed_retention)
            except (StoreError, OSError) as e:
                log.warning("capture worker pass failed: %s", type(e).__name__)
            except Exception:
                log.exception("capture worker pass failed unexpectedly")
            if handled < self._batch:
                await asyncio.sleep(self._poll)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="ibex-memory-capture")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
