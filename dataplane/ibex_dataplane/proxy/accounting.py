"""After-response accounting of every generation route: budget settle, token-window correction, session
checkpoint and the analytics trace.

The generation pipeline (:mod:`ibex_dataplane.proxy.generation`) calls :meth:`Accounting.after` once the answer
(JSON or SSE, on any wire format) has been produced, and :meth:`Accounting.trace` for every request that got as
far as a known org and agent. The writes run as shielded background tasks (:class:`BackgroundTasks`), so a
client disconnect cannot cut them short; nothing here blocks the answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson

from ibex_dataplane.providers.base import Usage
from ibex_dataplane.providers.catalog import ModelCatalog, ModelInfo
from ibex_dataplane.providers.openai_compat import streamed_text
from ibex_dataplane.providers.tokens import estimate_chat_tokens, estimate_text_tokens
from ibex_dataplane.proxy.analytics import AnalyticsRecorder, Trace
from ibex_dataplane.proxy.capture import capture_of
from ibex_dataplane.proxy.context import ContextOutcome
from ibex_dataplane.proxy.gates import GateState
from ibex_dataplane.proxy.metrics import ProxyMetrics
from ibex_dataplane.proxy.ratelimit import DeferredCorrections, RateLimiter, RateLimits
from ibex_dataplane.proxy.repository import DirectiveRow
from ibex_dataplane.proxy.sessions import SessionService, Turn
from ibex_dataplane.proxy.settles import AnswerSettles
from ibex_dataplane.shared.budget import BudgetHold, BudgetService
from ibex_dataplane.shared.idempotency import Claim

log = logging.getLogger(__name__)


@dataclass
class GenerationPlan:
    """What the generation gates decided; the handoff and the after-response work use it.

    ``body`` is always a Chat Completions body: every wire format is translated into it at the edge.
    """

    model: ModelInfo
    limits: RateLimits
    route: str = "chat.completions"
    prompt_tokens: int = 0
    max_output: int = 0
    charged_tokens: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    hold: BudgetHold | None = None
    session_id: str = ""
    directive_version: int | None = None
    directive: DirectiveRow | None = None
    client_messages: list[dict[str, Any]] = field(default_factory=list)  # as sent, before any injection
    observed_at: datetime | None = None  # X-IBEX-Observed-At: when the turn happened (capture)
    captured: bool = False  # the turn was handed to the capture queue with its checkpoint
    context: ContextOutcome = field(default_factory=ContextOutcome)
    rate_window: int | None = None
    rate_admitted: bool = False  # the rate limiter charged charged_tokens for this request
    # What the handoff produced, for the trace:
    claim: Claim | None = None  # Idempotency-Key claim of a non-streaming request
    usage: Usage | None = None
    served_by: str = ""
    provider: str = ""
    upstream_ms: float = 0.0
    cost: Decimal = Decimal(0)

    @property
    def fallback_served(self) -> bool:
        """A model of the fallback chain answered instead of the requested one."""
        return bool(self.served_by) and self.served_by != self.model.name


def plan_of(state: GateState) -> GenerationPlan | None:
    plan = state.extra.get("generation")
    return plan if isinstance(plan, GenerationPlan) else None


class BackgroundTasks:
    """After-response work: tracked so shutdown can wait for it, shielded from request cancellation."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._metrics = metrics

    def spawn(self, name: str, coro: Coroutine[Any, Any, object]) -> None:
        async def guarded() -> None:
            try:
                await coro
            except Exception:
                self._metrics.background_failures.labels(name).inc()
                log.exception("background task %s failed", name)

        task = asyncio.get_running_loop().create_task(guarded(), name=f"ibex-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 10.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


def content_digest(value: Any) -> str:
    """SHA-256 of a JSON value; what session checkpoints keep instead of text."""
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()


def streamed_usage(plan: GenerationPlan, forwarded: list[bytes]) -> Usage | None:
    """A conservative usage for a stream that ended without the provider's figures (client gone, upstream died):
    the prompt the provider was sent plus the tokens of what was already forwarded. Nothing forwarded: nothing
    served, nothing billed."""
    if not forwarded:
        return None
    family = plan.model.tokenizer_family
    tools = plan.body.get("tools")
    prompt = estimate_chat_tokens(plan.body.get("messages", []), family, tools if isinstance(tools, list) else None)
    return Usage(prompt.tokens, estimate_text_tokens(streamed_text(forwarded), family), estimated=True)


class Accounting:
    """Settles what a generation consumed, whatever its wire format."""

    def __init__(
        self,
        *,
        catalog: ModelCatalog,
        budgets: BudgetService,
        rate_limiter: RateLimiter,
        sessions: SessionService,
        analytics: AnalyticsRecorder,
        background: BackgroundTasks,
        metrics: ProxyMetrics | None = None,
        settle_gather_s: float = 0.0,
    ) -> None:
        self._metrics = metrics
        self._catalog = catalog
        self._budgets = budgets
        self._sessions = sessions
        self._analytics = analytics
        self.background = background
        self._rate_limiter = rate_limiter
        self.corrections = DeferredCorrections(rate_limiter, on_failure=self._corrections_lost)
        self._answers = AnswerSettles(
            sessions, budgets, background.spawn, self._checkpoint_failed, gather_s=settle_gather_s
        )

    def _corrections_lost(self, requests: int) -> None:
        if self._metrics is not None:
            self._metrics.background_failures.labels("tpm").inc(requests)
        log.warning("token-window corrections of %d requests were lost (their estimates stay charged)", requests)

    async def close(self) -> None:
        """At shutdown, after the background work drained: send the pending token corrections."""
        await self.corrections.close()

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.gathered_counter(self._metrics.budget_holds, outcome).inc()

    def release(self, plan: GenerationPlan) -> None:
        """Nothing was served: let go of the budget hold."""
        if plan.hold is not None:
            self._count("released")
            self.background.spawn("release", self._budgets.release(plan.hold))

    def refund_tokens(self, state: GateState) -> None:
        """Give back the TPM charge of a request the rate limiter admitted but that never reached a provider."""
        plan = plan_of(state)
        if plan is None or not plan.rate_admitted or not plan.charged_tokens:
            return
        plan.rate_admitted = False
        caller = state.require_caller()
        _, agent = state.require_agent()
        # At once, not deferred: a client retrying a refusal must find its window free again.
        self.background.spawn(
            "tpm",
            self._rate_limiter.adjust_tokens(
                caller.org_id, agent.id, plan.limits, -plan.charged_tokens, window=plan.rate_window
            ),
        )

    def after(
        self,
        state: GateState,
        plan: GenerationPlan,
        usage: Usage | None,
        served_by: str,
        completion: str | None = None,
        answer: str | None = None,
    ) -> None:
        """Settle or release the hold, correct the TPM charge (gathered with other requests' corrections for a few
        milliseconds, :class:`DeferredCorrections`), checkpoint the session (with the settle, gathered with the
        agent's other answers, :class:`AnswerSettles`) and, for a complete answer (``answer`` is its text), queue the
        turn's capture; never blocks the answer."""
        caller = state.require_caller()
        policy, agent = state.require_agent()
        plan.usage, plan.served_by = usage, served_by
        if usage is not None:
            plan.cost = self._catalog.cost(served_by, usage.prompt_tokens, usage.completion_tokens)
        used = usage.total_tokens if usage is not None else 0
        self.corrections.add(caller.org_id, agent.id, plan.limits, used - plan.charged_tokens, window=plan.rate_window)
        settlement = None
        if plan.hold is not None and usage is None:
            self._count("released")
            self.background.spawn("release", self._budgets.release(plan.hold))
        elif plan.hold is not None and usage is not None:
            self._count("settled")
            try:
                settlement = self._budgets.settlement(
                    plan.hold, plan.cost, model=served_by, prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                )  # fmt: skip
            except ValueError:  # a cost out of any sane range: a bug of ours, never the client's answer's problem
                if self._metrics is not None:
                    self._metrics.background_failures.labels("settle").inc()
                log.exception("cannot settle request %s (the hold stays until it expires)", state.request_id)
        turn = None
        if usage is not None and plan.session_id:  # embeddings belong to no session
            capture = (
                capture_of(agent, plan.client_messages, answer, plan.observed_at, policy.default_model)
                if answer is not None
                else None
            )
            plan.captured = capture is not None
            turn = Turn(
                plan.session_id, state.request_id, [content_digest(m) for m in plan.body.get("messages", [])],
                completion, usage.prompt_tokens, usage.completion_tokens,
                (time.perf_counter() - state.started) * 1000, capture,
            )  # fmt: skip
        if settlement is not None and turn is not None:
            self._answers.add(settlement, turn)
        elif settlement is not None:
            self.background.spawn("settle", self._budgets.settle_again(settlement))
        elif turn is not None:
            self.background.spawn("checkpoint", self._sessions.record_turn(
                caller.org_id, agent.id, turn.external_id, request_id=turn.request_id,
                message_digests=turn.message_digests, completion_digest=turn.completion_digest,
                prompt_tokens=turn.prompt_tokens, completion_tokens=turn.completion_tokens,
                latency_ms=turn.latency_ms, capture=turn.capture,
            ))  # fmt: skip

    def _checkpoint_failed(self) -> None:
        if self._metrics is not None:
            self._metrics.background_failures.labels("checkpoint").inc()

    def trace(self, state: GateState, route: str, status: int, error_code: str) -> None:
        """One analytics row per request that got as far as a known org and agent (never content)."""
        if state.caller is None or state.agent is None:
            return
        plan = plan_of(state)
        usage = plan.usage if plan else None
        self._analytics.record(
            Trace(
                org_id=state.caller.org_id, agent_id=state.agent.id, request_id=state.server_request_id,
                ts=datetime.now(UTC), key_id=state.caller.key_id, session_id=plan.session_id if plan else "",
                route=route,
                model=(plan.served_by or plan.model.name) if plan else str(state.extra.get("model_name", "")),
                provider=plan.provider if plan else "", stream=bool(plan and plan.body.get("stream") is True),
                status_code=status, error_code=error_code,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                cost_usd=plan.cost if plan else Decimal(0),
                latency_ms=(time.perf_counter() - state.started) * 1000,
                upstream_ms=plan.upstream_ms if plan else 0.0, stage_ms=dict(state.timings),
                memories_injected=plan.context.memories_injected if plan else 0,
                context_tokens=plan.context.context_tokens if plan else 0,
                context_degraded=bool(plan and plan.context.degraded),
                degradations=(*plan.context.reasons, *(("fallback",) if plan.fallback_served else ())) if plan else (),
                captured=bool(plan and plan.captured), priced=usage is not None,
            )
        )  # fmt: skip
