"""``POST /v1/chat/completions``: the chat-specific gates, the provider handoff and the after-response work.

After the shared gates (:mod:`ibex_dataplane.proxy.gates`): model policy -> rate limit -> request validation ->
budget hold -> directive + session -> bounded context assembly (:mod:`ibex_dataplane.proxy.context`, degrades)
-> provider handoff. After the answer (JSON or SSE) has been produced, the
budget hold is settled to the actual usage, the TPM counters corrected, and the session checkpoint and the
analytics rows written; those run as shielded background tasks so a client disconnect cannot cut them short.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson
from aiohttp import web

from ibex_dataplane.providers.base import ChatRequest, StreamChunk, StreamDone, Usage
from ibex_dataplane.providers.catalog import ModelCatalog, ModelInfo
from ibex_dataplane.providers.errors import ProviderError, UpstreamRejected
from ibex_dataplane.providers.openai_compat import streamed_text
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.providers.tokens import estimate_chat_tokens, estimate_text_tokens
from ibex_dataplane.proxy.analytics import AnalyticsRecorder, Trace
from ibex_dataplane.proxy.budget import BudgetExceeded, BudgetHold, BudgetPolicy, BudgetService, Enforcement
from ibex_dataplane.proxy.capture import answer_text, capture_of, observed_at_of, streamed_answer_text
from ibex_dataplane.proxy.context import SKIP_HEADER, ContextClient, ContextOutcome
from ibex_dataplane.proxy.directives import DirectiveService
from ibex_dataplane.proxy.gates import GatePipeline, GateState, session_id_of
from ibex_dataplane.proxy.metrics import ProxyMetrics
from ibex_dataplane.proxy.ratelimit import RateLimiter, RateLimits
from ibex_dataplane.proxy.repository import AgentPolicy, DirectiveRow
from ibex_dataplane.proxy.sessions import SessionService
from ibex_dataplane.proxy.validation import validate_chat_body
from ibex_dataplane.shared.directives import inject_directive
from ibex_dataplane.shared.errors import ApiError, ServiceError, error_response
from ibex_dataplane.shared.http import request_id_of, server_request_id_of
from ibex_dataplane.shared.idempotency import (
    REPLAYED_HEADER,
    Claim,
    IdempotencyLedger,
    StoredResponse,
    fingerprint,
    idempotency_key_of,
)

log = logging.getLogger(__name__)

DEFAULT_DEADLINE = 120.0


@dataclass
class ChatPlan:
    """What the chat gates decided; the handoff and the after-response work use it."""

    model: ModelInfo
    limits: RateLimits
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


@dataclass
class ChatServices:
    catalog: ModelCatalog
    providers: ProviderRegistry
    rate_limiter: RateLimiter
    budgets: BudgetService
    directives: DirectiveService
    sessions: SessionService
    metrics: ProxyMetrics
    background: BackgroundTasks
    analytics: AnalyticsRecorder
    idempotency: IdempotencyLedger
    context: ContextClient


def _plan(state: GateState) -> ChatPlan:
    plan = state.extra.get("chat")
    assert isinstance(plan, ChatPlan), "model gate did not run"
    return plan


# -- chat gates --------------------------------------------------------------------------------------------------


def model_policy(catalog: ModelCatalog, servable: Callable[[str], str | None] = lambda name: None) -> Any:
    async def gate(state: GateState) -> None:
        policy, agent = state.require_agent()
        body = state.json_or_none()  # a broken body is reported by the validation gate, in its turn
        requested = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None
        name = policy.resolve_model(requested or None, agent)
        state.extra["model_name"] = name or ""
        if name is None:
            raise ApiError(
                400, "VALIDATION_ERROR", "no model given and no default model configured",
                field_errors=[{"field": "model", "message": "is required"}],
            )  # fmt: skip
        if not policy.model_allowed(name):
            raise ApiError(403, "MODEL_NOT_ALLOWED", f"model '{name}' is not allowed for this organization")
        info = catalog.get(name)
        if info is None:
            raise ApiError(404, "NOT_FOUND", f"model '{name}' does not exist")
        missing = servable(name)
        if missing is not None:  # a configuration gap, not an outage: say which setting closes it
            raise ApiError(
                400, "VALIDATION_ERROR",
                f"model '{name}' needs provider '{missing}', which is not configured on this gateway: add it to the"
                " providers file named by IBEX_PROVIDERS_FILE (see docs/providers.md)",
                field_errors=[{"field": "model", "message": f"provider '{missing}' is not configured"}],
            )  # fmt: skip
        limits = RateLimits(agent_rpm=agent.rpm, agent_tpm=agent.tpm, org_rpm=policy.rpm, org_tpm=policy.tpm)
        state.extra["chat"] = ChatPlan(model=info, limits=limits)

    return gate


def _max_output(body: Any, model: ModelInfo) -> int:
    limits = [
        v
        for v in ((body.get("max_tokens"), body.get("max_completion_tokens")) if isinstance(body, dict) else ())
        if isinstance(v, int) and not isinstance(v, bool) and v > 0
    ]
    return min([model.max_output_tokens, *limits])


def rate_limit(limiter: RateLimiter) -> Any:
    async def gate(state: GateState) -> None:
        plan = _plan(state)
        caller = state.require_caller()
        _, agent = state.require_agent()
        body = state.json_or_none()
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            tools = body.get("tools") if isinstance(body.get("tools"), list) else None
            plan.prompt_tokens = estimate_chat_tokens(messages, plan.model.tokenizer_family, tools).tokens
        else:
            plan.prompt_tokens = len(state.raw_body)  # bytes bound tokens from above
        plan.max_output = _max_output(body, plan.model)
        plan.charged_tokens = plan.prompt_tokens + plan.max_output
        decision = await limiter.admit(caller.org_id, agent.id, plan.limits, plan.charged_tokens)
        plan.rate_window = decision.window
        plan.rate_admitted = decision.allowed and not decision.oversized
        state.response_headers.update(decision.headers())
        if decision.oversized:
            raise ApiError(
                422, "UNPROCESSABLE", "the request alone needs more tokens than the per-minute token limit allows"
            )
        if not decision.allowed:
            raise ApiError(429, "RATE_LIMITED", "rate limit exceeded", headers=decision.headers())

    return gate


async def validate_request(state: GateState) -> None:
    plan = _plan(state)
    body = validate_chat_body(state.json())
    plan.body = {**body, "model": plan.model.name}


class Replay(Exception):
    """Raised by the idempotency gate: answer with the stored response, run nothing else."""

    def __init__(self, stored: StoredResponse) -> None:
        super().__init__("idempotent replay")
        self.stored = stored


def idempotency(ledger: IdempotencyLedger) -> Any:
    """Idempotency-Key on non-streaming chat: same key and body replay the stored answer; another body is 409."""

    async def gate(state: GateState) -> None:
        plan = _plan(state)
        key = idempotency_key_of(state.request.headers)
        if key is None or plan.body.get("stream") is True:
            return
        caller = state.require_caller()
        _, agent = state.require_agent()
        result = await ledger.claim(
            caller.org_id, agent.id, key, "chat.completions", fingerprint("chat.completions", state.raw_body),
            lock_seconds=DEFAULT_DEADLINE + 10,
        )  # fmt: skip
        if isinstance(result, StoredResponse):
            raise Replay(result)
        plan.claim = result

    return gate


# Room for the memory block's fixed framing (preamble, wrapper, message framing) beyond memory.contextTokens; a
# unit test checks the context stage's formatter overhead stays within it for every tokenizer family.
MEMORY_FRAMING_ALLOWANCE = 512


def memory_allowance(agent: AgentPolicy) -> int:
    """Tokens context assembly may add to the prompt for this agent: what the budget hold must also cover."""
    return agent.memory_context_tokens + MEMORY_FRAMING_ALLOWANCE if agent.memory_enabled else 0


def budget_hold(budgets: BudgetService, catalog: ModelCatalog, directives: DirectiveService) -> Any:
    async def gate(state: GateState) -> None:
        plan = _plan(state)
        caller = state.require_caller()
        policy, agent = state.require_agent()
        # The provider is sent the prompt with the agent's directive in it (the next gate injects it, from the same
        # cache), so the worst case counts it too; and the memories context may add.
        directive = await directives.active(caller.org_id, agent.id)
        prompt = plan.prompt_tokens
        if directive is not None:
            tools = plan.body.get("tools")
            sent = inject_directive(plan.body["messages"], directive)
            prompt = max(prompt, estimate_chat_tokens(sent, plan.model.tokenizer_family,
                                                      tools if isinstance(tools, list) else None).tokens)  # fmt: skip
        prompt += memory_allowance(agent)
        amount = catalog.worst_case_cost(plan.model, prompt, plan.max_output)
        budget = BudgetPolicy(
            org_limit_usd=policy.budget_limit,
            agent_limit_usd=agent.budget_limit,
            enforcement=Enforcement(policy.enforcement),
        )
        try:
            plan.hold = await budgets.hold(caller.org_id, agent.id, state.server_request_id, amount, budget)
        except BudgetExceeded as e:
            raise ApiError(402, "BUDGET_EXCEEDED", f"the {e.scope} budget for this month is exhausted") from e

    return gate


def directive_and_session(directives: DirectiveService) -> Any:
    async def gate(state: GateState) -> None:
        plan = _plan(state)
        caller = state.require_caller()
        _, agent = state.require_agent()
        plan.session_id = session_id_of(state.request)
        plan.observed_at = observed_at_of(state.request)
        state.response_headers["X-IBEX-Session-ID"] = plan.session_id
        directive = await directives.active(caller.org_id, agent.id)
        plan.client_messages = plan.body["messages"]
        if directive is not None:
            plan.directive, plan.directive_version = directive, directive.version
            # Also the fallback when context assembly degrades: directive-only context.
            plan.body["messages"] = inject_directive(plan.body["messages"], directive)

    return gate


def context_assembly(client: ContextClient) -> Any:
    """Memory context for agents with ``memory.enabled``; never fails the request (section 6.1: it degrades)."""

    async def gate(state: GateState) -> None:
        plan = _plan(state)
        caller = state.require_caller()
        _, agent = state.require_agent()
        if not agent.memory_enabled:
            return
        tools = plan.body.get("tools")
        outcome = await client.assemble(
            org_id=caller.org_id, agent_id=agent.id, request_id=state.request_id, model=plan.model.name,
            messages=plan.client_messages, tools=tools if isinstance(tools, list) else None,
            session_id=plan.session_id, context_tokens=agent.memory_context_tokens, max_output_tokens=plan.max_output,
            skip_memory=state.request.headers.get(SKIP_HEADER, "").strip().lower() in ("1", "true", "yes"),
            directive=plan.directive,
        )  # fmt: skip
        plan.context = outcome
        if outcome.messages is not None:
            plan.body["messages"] = outcome.messages
        state.response_headers.update(outcome.headers())

    return gate


# -- handoff -----------------------------------------------------------------------------------------------------


def _provider_error_response(e: ProviderError, state: GateState) -> web.Response:
    headers = dict(state.response_headers)
    if e.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(e.retry_after)))
    elif e.status == 503:  # the upstream named no time (or none was asked): every 503 says when to come back
        headers["Retry-After"] = "1"
    if isinstance(e, UpstreamRejected):
        err = e.body.get("error") if isinstance(e.body, dict) else None
        message = err.get("message") if isinstance(err, dict) and isinstance(err.get("message"), str) else e.message
        code = "UNPROCESSABLE" if e.status == 422 else "VALIDATION_ERROR" if e.status == 400 else "PROVIDER_ERROR"
        status = e.status if 400 <= e.status < 500 else 502
        return error_response(status, code, f"upstream rejected the request: {message}", state.request_id,
                              headers=headers)  # fmt: skip
    return error_response(e.status, e.code, e.message, state.request_id, headers=headers)


class ChatHandler:
    def __init__(self, pipeline: GatePipeline, services: ChatServices) -> None:
        self._pipeline = pipeline
        self._s = services

    @property
    def gate_names(self) -> list[str]:
        """The chat gates in the order they run (docs/architecture.md lists the same)."""
        return self._pipeline.names

    async def handle(self, request: web.Request) -> web.StreamResponse:
        state = GateState(request, request_id_of(request), "chat", server_request_id=server_request_id_of(request))
        status, error_code = 500, "INTERNAL_ERROR"
        try:
            try:
                await self._pipeline.run(state)
            except Replay as replay:
                status = replay.stored.status
                self._refund_tokens(state)  # the stored answer is served again: no provider tokens this time
                return web.Response(
                    status=replay.stored.status, body=replay.stored.body,
                    headers={**replay.stored.headers, **state.response_headers, REPLAYED_HEADER: "true"},
                )  # fmt: skip
            except ServiceError as e:
                e.headers = {**state.response_headers, **e.headers}
                plan = state.extra.get("chat")
                if isinstance(plan, ChatPlan):
                    if plan.hold is not None:
                        self._s.background.spawn("release", self._s.budgets.release(plan.hold))
                    if plan.claim is not None:  # nothing ran: let a retry with the same key run again
                        self._s.background.spawn("abandon", self._s.idempotency.abandon(plan.claim))
                self._refund_tokens(state)  # refused after admission: retries must not burn the token window
                status, error_code = e.status, e.code
                raise
            plan = _plan(state)
            chat = ChatRequest(
                body=plan.body, model=plan.model.name, deadline=time.monotonic() + DEFAULT_DEADLINE,
                request_id=state.request_id,
            )  # fmt: skip
            if plan.body.get("stream") is True:
                response = await self._stream(state, plan, chat)
            else:
                response = await self._complete(state, plan, chat)
                if plan.claim is not None:
                    await self._finalize(plan.claim, response)
            status = response.status
            error_code = state.extra.get("error_code", "") if status >= 400 else ""
            return response
        except ServiceError as e:
            status, error_code = e.status, e.code
            raise
        finally:
            self._trace(state, status, error_code)

    def _refund_tokens(self, state: GateState) -> None:
        """Give back the TPM charge of a request the rate limiter admitted but that never reached a provider."""
        plan = state.extra.get("chat")
        if not isinstance(plan, ChatPlan) or not plan.rate_admitted or not plan.charged_tokens:
            return
        plan.rate_admitted = False
        caller = state.require_caller()
        _, agent = state.require_agent()
        self._s.background.spawn(
            "tpm",
            self._s.rate_limiter.adjust_tokens(
                caller.org_id, agent.id, plan.limits, -plan.charged_tokens, window=plan.rate_window
            ),
        )

    async def _finalize(self, claim: Claim, response: web.StreamResponse) -> None:
        """Record the answer under the idempotency key before returning it; a provider failure frees the key."""
        if response.status >= 500:
            self._s.background.spawn("abandon", self._s.idempotency.abandon(claim))
            return
        keep = {str(k): v for k, v in response.headers.items() if k in ("Content-Type", "X-IBEX-Session-ID")}
        body = response.body if isinstance(response, web.Response) and isinstance(response.body, bytes) else b""
        # Raises (503) when the claim cannot be finalized: never report success over an unfinished claim.
        await self._s.idempotency.complete(claim, StoredResponse(response.status, body, keep))

    def _trace(self, state: GateState, status: int, error_code: str) -> None:
        """One analytics row per request that got as far as a known org and agent (never content)."""
        if state.caller is None or state.agent is None:
            return
        plan = state.extra.get("chat")
        plan = plan if isinstance(plan, ChatPlan) else None
        usage = plan.usage if plan else None
        self._s.analytics.record(
            Trace(
                org_id=state.caller.org_id, agent_id=state.agent.id, request_id=state.server_request_id,
                ts=datetime.now(UTC), key_id=state.caller.key_id, session_id=plan.session_id if plan else "",
                route="chat.completions",
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
                degradations=tuple(plan.context.reasons) if plan else (),
                captured=bool(plan and plan.captured), priced=usage is not None,
            )
        )  # fmt: skip

    async def _complete(self, state: GateState, plan: ChatPlan, chat: ChatRequest) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            answer = await self._s.providers.complete(chat)
        except ProviderError as e:
            self._s.metrics.provider_calls.labels(plan.model.provider, e.code).inc()
            state.extra["error_code"] = e.code
            self._after(state, plan, None, plan.model.name)
            return _provider_error_response(e, state)
        except BaseException:
            self._after(state, plan, None, plan.model.name)
            raise
        plan.provider = answer.provider
        plan.upstream_ms = (time.perf_counter() - started) * 1000
        self._s.metrics.provider_calls.labels(answer.provider, "ok").inc()
        self._s.metrics.provider_seconds.labels(answer.provider).observe(plan.upstream_ms / 1000)
        choices = answer.body.get("choices")
        self._after(state, plan, answer.usage, answer.model, content_digest(choices), answer_text(choices))
        return web.Response(body=orjson.dumps(answer.body), content_type="application/json",
                            headers=state.response_headers)  # fmt: skip

    async def _stream(self, state: GateState, plan: ChatPlan, chat: ChatRequest) -> web.StreamResponse:
        usage: Usage | None = None
        served_by = plan.model.name
        response: web.StreamResponse | None = None
        digest = hashlib.sha256()
        forwarded: list[bytes] = []  # chunks already sent: what a stream cut short is billed from
        upstream_failed = False  # the provider failed after the stream began: the answer is not whole
        started = time.perf_counter()

        def served() -> Usage | None:
            return usage if usage is not None else self._streamed_usage(plan, forwarded)

        try:
            async with self._s.providers.stream(chat) as events:
                response = web.StreamResponse(
                    status=200,
                    headers={**state.response_headers, "Content-Type": "text/event-stream",
                             "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                             "X-Request-ID": state.request_id},  # sent before the middleware could add it
                )  # fmt: skip
                await response.prepare(state.request)
                try:
                    async for event in events:
                        if isinstance(event, StreamChunk):
                            digest.update(event.data)
                            forwarded.append(event.data)
                            await response.write(b"data: " + event.data + b"\n\n")
                        elif isinstance(event, StreamDone):
                            usage, served_by, plan.provider = event.usage, event.model, event.provider
                except ProviderError as e:
                    upstream_failed = True
                    self._s.metrics.provider_calls.labels(plan.model.provider, e.code).inc()
                    error = {"error": {"code": e.code, "message": e.message, "request_id": state.request_id}}
                    await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
        except ProviderError as e:
            self._s.metrics.provider_calls.labels(plan.model.provider, e.code).inc()
            state.extra["error_code"] = e.code
            self._after(state, plan, served(), served_by)
            if response is None:
                return _provider_error_response(e, state)
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            self._after(state, plan, served(), served_by)
            raise
        except BaseException:
            self._after(state, plan, served(), served_by)
            raise
        plan.upstream_ms = (time.perf_counter() - started) * 1000
        self._s.metrics.provider_calls.labels(plan.model.provider, "ok").inc()
        answer = None if upstream_failed else streamed_answer_text(forwarded)
        self._after(state, plan, served(), served_by, digest.hexdigest(), answer)
        assert response is not None
        return response

    @staticmethod
    def _streamed_usage(plan: ChatPlan, forwarded: list[bytes]) -> Usage | None:
        """A conservative usage for a stream that ended without the provider's figures (client gone, upstream
        died): the prompt the provider was sent plus the tokens of what was already forwarded. Nothing forwarded:
        nothing served, nothing billed."""
        if not forwarded:
            return None
        family = plan.model.tokenizer_family
        tools = plan.body.get("tools")
        prompt = estimate_chat_tokens(plan.body.get("messages", []), family, tools if isinstance(tools, list) else None)
        return Usage(prompt.tokens, estimate_text_tokens(streamed_text(forwarded), family), estimated=True)

    # -- after the answer ----------------------------------------------------------------------------------------
    def _after(
        self,
        state: GateState,
        plan: ChatPlan,
        usage: Usage | None,
        served_by: str,
        completion: str | None = None,
        answer: str | None = None,
    ) -> None:
        """Settle or release the hold, correct the TPM charge, checkpoint the session and, for a complete answer
        (``answer`` is its text), queue the turn's capture; never blocks the answer."""
        caller = state.require_caller()
        _, agent = state.require_agent()
        s = self._s
        plan.usage, plan.served_by = usage, served_by
        if usage is not None:
            plan.cost = s.catalog.cost(served_by, usage.prompt_tokens, usage.completion_tokens)
        if plan.hold is not None:
            if usage is None:
                s.background.spawn("release", s.budgets.release(plan.hold))
            else:
                cost = plan.cost
                s.background.spawn(
                    "settle",
                    s.budgets.settle(plan.hold, cost, model=served_by, prompt_tokens=usage.prompt_tokens,
                                     completion_tokens=usage.completion_tokens),
                )  # fmt: skip
        used = usage.total_tokens if usage is not None else 0
        delta = used - plan.charged_tokens
        if delta:
            s.background.spawn(
                "tpm",
                s.rate_limiter.adjust_tokens(caller.org_id, agent.id, plan.limits, delta, window=plan.rate_window),
            )
        if usage is not None:
            capture = capture_of(agent, plan.client_messages, answer, plan.observed_at) if answer is not None else None
            plan.captured = capture is not None
            s.background.spawn(
                "checkpoint",
                s.sessions.record_turn(
                    caller.org_id, agent.id, plan.session_id, request_id=state.request_id,
                    message_digests=[content_digest(m) for m in plan.body.get("messages", [])],
                    completion_digest=completion, prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    latency_ms=(time.perf_counter() - state.started) * 1000, capture=capture,
                ),
            )  # fmt: skip


def content_digest(value: Any) -> str:
    """SHA-256 of a JSON value; what session checkpoints keep instead of text."""
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()
