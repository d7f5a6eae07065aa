"""Context assembly for one request, free of gRPC: retrieve, budget, pack, format (architecture section 10).

:meth:`ContextService.assemble` takes the verified principal (tenant scope comes from it alone) and an
:class:`AssemblyRequest`, and runs three branches concurrently, each under its own timeout and all under one outer
deadline (the smaller of the caller's remaining time and the server's own):

- **directive**: the agent's active directive as the proxy resolved it before calling (its gates come first, and
  it keeps the directive for the degraded path), so this branch never waits on a store;
- **hot**: the agent's hot memories, scored by the memory stage with no query (relevance 0);
- **cold**: the memory stage's ranked hybrid search for a query built from the conversation
  (:func:`cold_query`).

A branch that misses its time is cancelled (its HTTP call with it) and reported ``timeout``; completed branches are
kept. Then the token budget is computed by subtraction (:mod:`.budget`), the candidates are packed as a knapsack
(:mod:`.packer`) and the result is formatted injection-safe (:mod:`.formatter`). The ids placed into the context
are reported back to the memory stage, off the answer path, so their retrieval metadata is bumped.
Called by the gRPC servicer (:mod:`ibex_dataplane.context.servicer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ibex_dataplane.context.budget import ContextBudget, compute_budget
from ibex_dataplane.context.formatter import (
    MemoryEntry,
    assemble_messages,
    entry_tokens,
    formatter_overhead,
    new_nonce,
)
from ibex_dataplane.context.memory_client import Hit, MemoryStageClient, MemoryUnavailable
from ibex_dataplane.context.metrics import ContextMetrics
from ibex_dataplane.context.packer import PackCandidate, PackResult, pack_memories
from ibex_dataplane.providers.catalog import ModelCatalog
from ibex_dataplane.providers.tokens import estimate_chat_tokens
from ibex_dataplane.security.principal import Principal
from ibex_dataplane.shared.directives import inject_directive
from ibex_dataplane.shared.errors import NotFound

log = logging.getLogger(__name__)

T = TypeVar("T")

# The cold query: the latest user turn; a short one (a follow-up such as "and when was that?") also takes the
# user turn before it, so the search sees what the follow-up refers to.
SHORT_TURN_WORDS = 6
MAX_QUERY_CHARS = 1_500


class BranchStatus(enum.StrEnum):
    SUCCESS = "success"
    TIMEOUT = "timeout"
    ERROR = "error"
    SKIPPED = "skipped"


class Degradation(enum.StrEnum):
    NONE = "none"
    PARTIAL = "partial"  # a retrieval branch timed out or failed; what completed is used
    HISTORY_ONLY = "history_only"  # no memory branch completed


@dataclass(frozen=True, slots=True)
class Directive:
    version: int
    content: str
    injection_mode: str


@dataclass(frozen=True, slots=True)
class AssemblyRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    session_id: str = ""
    context_tokens: int = 2000  # the agent's memory.contextTokens
    max_output_tokens: int = 0  # the request's own limit; 0: the model's
    skip_memory: bool = False
    max_memories: int = 0  # 0: the server's default
    directive: Directive | None = None


@dataclass(frozen=True, slots=True)
class ContextTuning:
    deadline: float = 0.040  # the server's outer deadline, seconds
    directive_timeout: float = 0.005
    hot_timeout: float = 0.015
    cold_timeout: float = 0.045
    max_memories: int = 20
    hot_limit: int = 10


@dataclass(frozen=True, slots=True)
class BranchReport:
    name: str
    status: BranchStatus
    latency_ms: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class UsedMemory:
    id: str
    score: float
    components: Mapping[str, float]
    tokens: int
    source: str  # "hot" | "cold"


@dataclass(frozen=True, slots=True)
class SectionTokens:
    directive: int
    history: int
    memories: int
    tools: int
    formatter: int
    usable: int
    estimate_kind: str
    tokenizer_family: str

    @property
    def total(self) -> int:
        return self.directive + self.history + self.memories + self.tools + (self.formatter if self.memories else 0)


@dataclass(frozen=True, slots=True)
class Assembly:
    messages: list[dict[str, Any]]
    tokens: SectionTokens
    used: list[UsedMemory]
    branches: list[BranchReport]
    degradation: Degradation
    packing: PackResult
    constrained: bool
    nonce_sha256: str
    timings_ms: dict[str, float] = field(default_factory=dict)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def cold_query(messages: Sequence[Mapping[str, Any]]) -> str:
    """The search query for a conversation: its latest user turn, plus the one before when that turn is short."""
    turns = [t for t in (_text_of(m.get("content")).strip() for m in messages if m.get("role") == "user") if t]
    if not turns:
        return ""
    query = turns[-1]
    if len(query.split()) < SHORT_TURN_WORDS and len(turns) > 1:
        query = f"{turns[-2]}\n{query}"
    return query[-MAX_QUERY_CHARS:]


async def _run_branch(name: str, work: Awaitable[T], timeout: float) -> tuple[BranchReport, T | None]:
    started = time.perf_counter()

    def report(status: BranchStatus, detail: str = "") -> BranchReport:
        return BranchReport(name, status, (time.perf_counter() - started) * 1000, detail)

    if timeout <= 0:
        if isinstance(work, asyncio.Future | asyncio.Task):
            work.cancel()
        elif hasattr(work, "close"):
            work.close()
        return report(BranchStatus.TIMEOUT, "no time left"), None
    try:
        async with asyncio.timeout(timeout):
            result = await work
    except TimeoutError:
        return report(BranchStatus.TIMEOUT, f"over {timeout * 1000:.0f} ms"), None
    except MemoryUnavailable as e:
        return report(BranchStatus.ERROR, str(e)), None
    return report(BranchStatus.SUCCESS), result


async def _directive(request: AssemblyRequest) -> Directive | None:
    return request.directive


class ContextService:
    def __init__(
        self, catalog: ModelCatalog, memory: MemoryStageClient, tuning: ContextTuning, metrics: ContextMetrics
    ) -> None:
        self._catalog = catalog
        self._memory = memory
        self.tuning = tuning
        self._metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    async def assemble(self, principal: Principal, request: AssemblyRequest, *, timeout: float | None) -> Assembly:
        """Assemble the context; ``timeout`` is the caller's remaining time in seconds (None: no caller deadline)."""
        started = time.perf_counter()
        model = self._catalog.get(request.model)
        if model is None:
            raise NotFound(f"model '{request.model}' does not exist")
        t = self.tuning
        outer = min(t.deadline, principal.remaining(), timeout if timeout is not None else t.deadline)
        end = started + max(0.0, outer)

        def left(branch_timeout: float) -> float:
            return min(branch_timeout, end - time.perf_counter())

        wants_memory = not request.skip_memory and request.context_tokens > 0
        query = cold_query(request.messages) if wants_memory else ""
        limit = min(t.max_memories, request.max_memories or t.max_memories)
        directive_branch = _run_branch("directive", _directive(request), left(t.directive_timeout))
        if wants_memory and t.hot_limit > 0:
            hot_branch = _run_branch("hot", self._memory.hot(principal, t.hot_limit), left(t.hot_timeout))
        else:
            hot_branch = _skipped("hot", "memory skipped" if not wants_memory else "hot memories off")
        if wants_memory and query:
            cold_branch = _run_branch("cold", self._memory.search(principal, query, limit), left(t.cold_timeout))
        else:
            cold_branch = _skipped("cold", "memory skipped" if not wants_memory else "no user turn to search for")
        (d_report, _), (h_report, hot), (c_report, cold) = await asyncio.gather(
            directive_branch, hot_branch, cold_branch
        )
        retrieved = time.perf_counter()

        family = model.tokenizer_family
        directive = request.directive
        directive_tokens = estimate_chat_tokens(
            [{"role": "system", "content": directive.content}] if directive else [], family
        )
        history_tokens = estimate_chat_tokens(request.messages, family)
        tools_tokens = estimate_chat_tokens([], family, request.tools)
        overhead = formatter_overhead(family)
        if request.max_output_tokens:
            model = dataclasses.replace(
                model, max_output_tokens=min(model.max_output_tokens, request.max_output_tokens)
            )
        budget = compute_budget(
            model, directive=directive_tokens, messages=history_tokens, tools=tools_tokens,
            formatter_overhead=overhead, cap=request.context_tokens,
        )  # fmt: skip

        candidates, sources = self._candidates(cold, hot)
        entries = {c.id: MemoryEntry(c.id, c.content, c.valid_from) for c in candidates.values()}
        pack_input = [PackCandidate(c.id, c.score, entry_tokens(entries[c.id], family)) for c in candidates.values()]
        packed = pack_memories(pack_input, budget.usable, max_items=limit)
        packed_at = time.perf_counter()

        nonce = new_nonce()
        history = inject_directive(request.messages, directive)
        chosen = [entries[c.id] for c in packed.chosen]
        messages = assemble_messages(history, chosen, nonce)
        formatted = time.perf_counter()

        used = [
            UsedMemory(c.id, candidates[c.id].score, candidates[c.id].components, c.tokens, sources[c.id])
            for c in packed.chosen
        ]
        if used:
            self._report_placed(principal, [u.id for u in used])
        degradation = _degradation(h_report, c_report)
        self._observe(started, retrieved, packed_at, formatted, [d_report, h_report, c_report], used, degradation)
        return Assembly(
            messages=messages,
            tokens=self._sections(budget, packed),
            used=used,
            branches=[d_report, h_report, c_report],
            degradation=degradation,
            packing=packed,
            constrained=budget.constrained,
            nonce_sha256=hashlib.sha256(nonce.encode()).hexdigest(),
            timings_ms={
                "total": (formatted - started) * 1000,
                "retrieval": (retrieved - started) * 1000,
                "pack": (packed_at - retrieved) * 1000,
                "format": (formatted - packed_at) * 1000,
            },
        )

    def _observe(
        self, started: float, retrieved: float, packed: float, formatted: float, branches: list[BranchReport],
        used: list[UsedMemory], degradation: Degradation,
    ) -> None:  # fmt: skip
        m = self._metrics
        m.assembly_seconds.labels("retrieval").observe(retrieved - started)
        m.assembly_seconds.labels("pack").observe(packed - retrieved)
        m.assembly_seconds.labels("format").observe(formatted - packed)
        m.assembly_seconds.labels("total").observe(formatted - started)
        for b in branches:
            m.branch_outcomes.labels(b.name, str(b.status)).inc()
        for u in used:
            m.memories_placed.labels(u.source).inc()
        m.assemblies.labels(str(degradation)).inc()

    @staticmethod
    def _candidates(cold: list[Hit] | None, hot: list[Hit] | None) -> tuple[dict[str, Hit], dict[str, str]]:
        """Cold hits first (their score knows the query), then hot memories not already found."""
        candidates: dict[str, Hit] = {}
        sources: dict[str, str] = {}
        for source, hits in (("cold", cold or []), ("hot", hot or [])):
            for hit in hits:
                if hit.id not in candidates and hit.content:
                    candidates[hit.id] = hit
                    sources[hit.id] = source
        return candidates, sources

    @staticmethod
    def _sections(budget: ContextBudget, packed: PackResult) -> SectionTokens:
        return SectionTokens(
            directive=budget.directive,
            history=budget.messages,
            memories=packed.tokens,
            tools=budget.tools,
            formatter=budget.formatter_overhead,
            usable=budget.usable,
            estimate_kind=str(budget.kind),
            tokenizer_family=str(budget.family),
        )

    def _report_placed(self, principal: Principal, ids: list[str]) -> None:
        async def report() -> None:
            try:
                await self._memory.retrieved(principal, ids)
            except MemoryUnavailable as e:
                log.warning("could not report placed memories (request_id=%s): %s", principal.request_id, e)

        task = asyncio.get_running_loop().create_task(report(), name="ibex-context-placed")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout: float = 5.0) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)


async def _skipped(name: str, detail: str) -> tuple[BranchReport, None]:
    return BranchReport(name, BranchStatus.SKIPPED, 0.0, detail), None


def _degradation(hot: BranchReport, cold: BranchReport) -> Degradation:
    ran = [b for b in (hot, cold) if b.status is not BranchStatus.SKIPPED]
    failed = [b for b in ran if b.status is not BranchStatus.SUCCESS]
    if not failed:
        return Degradation.NONE
    return Degradation.HISTORY_ONLY if len(failed) == len(ran) else Degradation.PARTIAL
