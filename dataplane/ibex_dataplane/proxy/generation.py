"""The one generation pipeline: every text-generation route (Chat Completions, Responses, Anthropic Messages) runs
the same gates, context assembly, provider call, relay and accounting, on a Chat Completions body its edge
translated the client's body into (:mod:`ibex_dataplane.proxy.edge`).

After the shared gates (:mod:`ibex_dataplane.proxy.gates`): model policy -> rate limit -> request validation ->
idempotency -> budget hold -> directive + session -> bounded context assembly (:mod:`ibex_dataplane.proxy.context`,
degrades) -> provider handoff (JSON here, SSE in :mod:`ibex_dataplane.proxy.streaming`). After the answer the hold
is settled, the token window corrected, the session checkpoint and the trace written
(:mod:`ibex_dataplane.proxy.accounting`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import orjson
from aiohttp import web

from ibex_dataplane.providers.base import ChatRequest, EmbeddingRequest
from ibex_dataplane.providers.catalog import ModelCatalog, ModelInfo, ModelKind
from ibex_dataplane.providers.errors import ProviderError
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.providers.tokens import directive_allowance, estimate_chat_tokens
from ibex_dataplane.proxy.accounting import Accounting, GenerationPlan, content_digest, plan_of
from ibex_dataplane.proxy.capture import answer_text, observed_at_of
from ibex_dataplane.proxy.context import SKIP_HEADER, ContextClient
from ibex_dataplane.proxy.directives import DirectiveService
from ibex_dataplane.proxy.edge import CHAT_EDGE, Edge
from ibex_dataplane.proxy.embeddings import input_tokens, validate_embeddings_body
from ibex_dataplane.proxy.gates import GatePipeline, GateState, session_id_of
from ibex_dataplane.proxy.handoff import FALLBACK_HEADER, keep_answer, provider_error_response, render_context
from ibex_dataplane.proxy.metrics import ProxyMetrics
from ibex_dataplane.proxy.ratelimit import RateLimiter, RateLimits
from ibex_dataplane.proxy.repository import AgentPolicy
from ibex_dataplane.proxy.streaming import relay
from ibex_dataplane.shared.budget import BudgetExceeded, BudgetPolicy, BudgetService, Enforcement
from ibex_dataplane.shared.directives import inject_directive
from ibex_dataplane.shared.errors import ApiError, ServiceError
from ibex_dataplane.shared.http import request_id_of, server_request_id_of
from ibex_dataplane.shared.idempotency import (
    REPLAYED_HEADER,
    Claim,
    IdempotencyLedger,
    StoredResponse,
    fingerprint,
    idempotency_key_of,
)

DEFAULT_DEADLINE = 120.0

# Room for the memory block's fixed framing (preamble, wrapper, message framing) beyond memory.contextTokens; a
# unit test checks the context stage's formatter overhead stays within it for every tokenizer family.
MEMORY_FRAMING_ALLOWANCE = 512

_DIRECTED = "directed"
"""``state.extra`` key: the directive the budget gate found and the messages with it injected (None: no directive)."""


@dataclass
class GenerationServices:
    catalog: ModelCatalog
    providers: ProviderRegistry
    rate_limiter: RateLimiter
    budgets: BudgetService
    directives: DirectiveService
    metrics: ProxyMetrics
    accounting: Accounting
    idempotency: IdempotencyLedger
    context: ContextClient


def _plan(state: GateState) -> GenerationPlan:
    plan = plan_of(state)
    assert plan is not None, "model gate did not run"
    return plan


def edge_of(state: GateState) -> Edge:
    return cast(Edge, state.extra.get("edge", CHAT_EDGE))


def translated_or_none(state: GateState) -> dict[str, Any] | None:
    """The edge's Chat Completions body, or None while the body is broken (the validation gate reports it)."""
    if "translated" not in state.extra:
        body = state.json_or_none()
        try:
            state.extra["translated"] = edge_of(state).to_chat(body) if body is not None else None
        except ApiError:
            state.extra["translated"] = None
    result = state.extra["translated"]
    return result if isinstance(result, dict) else None


# -- generation gates --------------------------------------------------------------------------------------------


def model_policy(
    catalog: ModelCatalog,
    servable: Callable[[str], str | None] = lambda name: None,
    kind: ModelKind = ModelKind.CHAT,
) -> Any:
    """The model named (or the agent's / org's default, for generation) must be of ``kind``, allowed and served."""

    async def gate(state: GateState) -> None:
        policy, agent = state.require_agent()
        body = state.json_or_none()  # a broken body is reported by the validation gate, in its turn
        requested = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None
        # Defaults are chat models: an embeddings call always names its model.
        name = policy.resolve_model(requested or None, agent) if kind is ModelKind.CHAT else requested or None
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
        if info.kind is not kind:
            route = "/v1/embeddings" if info.kind is ModelKind.EMBEDDING else "a generation route"
            raise ApiError(
                400, "VALIDATION_ERROR", f"model '{name}' is a {info.kind} model: use it with {route}",
                field_errors=[{"field": "model", "message": f"must be a {kind} model"}],
            )  # fmt: skip
        missing = servable(name)
        if missing is not None:  # a configuration gap, not an outage: say which setting closes it
            raise ApiError(
                400, "VALIDATION_ERROR",
                f"model '{name}' needs provider '{missing}', which is not configured on this gateway: add it to the"
                " providers file named by IBEX_PROVIDERS_FILE (see docs/providers.md)",
                field_errors=[{"field": "model", "message": f"provider '{missing}' is not configured"}],
            )  # fmt: skip
        limits = RateLimits(agent_rpm=agent.rpm, agent_tpm=agent.tpm, org_rpm=policy.rpm, org_tpm=policy.tpm)
        route = edge_of(state).route if kind is ModelKind.CHAT else "embeddings"
        state.extra["generation"] = GenerationPlan(model=info, limits=limits, route=route)

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
        body = translated_or_none(state) if plan.model.kind is ModelKind.CHAT else None
        messages = body.get("messages") if body is not None else None
        if plan.model.kind is ModelKind.EMBEDDING:
            plan.prompt_tokens = input_tokens(state.json_or_none(), plan.model) or len(state.raw_body)
        elif body is not None and isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            tools = body.get("tools") if isinstance(body.get("tools"), list) else None
            plan.prompt_tokens = estimate_chat_tokens(messages, plan.model.tokenizer_family, tools).tokens
        else:
            plan.prompt_tokens = len(state.raw_body)  # bytes bound tokens from above
        plan.max_output = _max_output(body, plan.model) if plan.model.kind is ModelKind.CHAT else 0
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
    # The rate limit gate translated (and so validated) the body already; a broken one is translated again here
    # for its field errors.
    body = translated_or_none(state) or edge_of(state).to_chat(state.json())
    plan.body = {**body, "model": plan.model.name}


async def validate_embeddings(state: GateState) -> None:
    plan = _plan(state)
    plan.body = {**validate_embeddings_body(state.json(), plan.model), "model": plan.model.name}


class Replay(Exception):
    """Raised by the idempotency gate: answer with the stored response, run nothing else."""

    def __init__(self, stored: StoredResponse) -> None:
        super().__init__("idempotent replay")
        self.stored = stored


def idempotency(ledger: IdempotencyLedger) -> Any:
    """Idempotency-Key on non-streaming calls: same key and body replay the stored answer; another body is 409."""

    async def gate(state: GateState) -> None:
        plan = _plan(state)
        key = idempotency_key_of(state.request.headers)
        if key is None or plan.body.get("stream") is True:
            return
        caller = state.require_caller()
        _, agent = state.require_agent()
        result = await ledger.claim(
            caller.org_id, agent.id, key, plan.route, fingerprint(plan.route, state.raw_body),
            lock_seconds=DEFAULT_DEADLINE + 10,
        )  # fmt: skip
        if isinstance(result, StoredResponse):
            raise Replay(result)
        plan.claim = result

    return gate


def memory_allowance(agent: AgentPolicy) -> int:
    """Tokens context assembly may add to the prompt for this agent: what the budget hold must also cover."""
    return agent.memory_context_tokens + MEMORY_FRAMING_ALLOWANCE if agent.memory_enabled else 0


def budget_hold(
    budgets: BudgetService, catalog: ModelCatalog, directives: DirectiveService, metrics: ProxyMetrics | None = None
) -> Any:
    drawn = metrics.gathered_counter(metrics.budget_holds, "drawn") if metrics is not None else None
    placed = metrics.gathered_counter(metrics.budget_holds, "placed") if metrics is not None else None

    async def gate(state: GateState) -> None:
        plan = _plan(state)
        caller = state.require_caller()
        policy, agent = state.require_agent()
        # The provider is sent the prompt with the agent's directive in it (the next gate injects it, from the same
        # cache), so the worst case counts it too; and the memories context may add.
        directive = await directives.active(caller.org_id, agent.id) if plan.model.kind is ModelKind.CHAT else None
        prompt = plan.prompt_tokens
        if directive is not None:
            sent = inject_directive(plan.body["messages"], directive)
            state.extra[_DIRECTED] = (directive, sent)  # the next gate sends these: no second lookup
            # The rate-limit gate's estimate of the client's messages, plus what the directive can add to it (an
            # upper bound, whichever way it is injected): the chat is not estimated a second time.
            prompt += directive_allowance(directive.content, plan.model.tokenizer_family)
        elif plan.model.kind is ModelKind.CHAT:
            state.extra[_DIRECTED] = None
        if plan.model.kind is ModelKind.CHAT:
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
            if metrics is not None:
                metrics.budget_holds.labels("refused").inc()
            raise ApiError(402, "BUDGET_EXCEEDED", f"the {e.scope} budget for this month is exhausted") from e
        if drawn is not None and placed is not None:
            (drawn if plan.hold.lease else placed).inc()

    return gate


def directive_and_session(directives: DirectiveService) -> Any:
    async def gate(state: GateState) -> None:
        plan = _plan(state)
        caller = state.require_caller()
        _, agent = state.require_agent()
        plan.session_id = session_id_of(state.request)
        plan.observed_at = observed_at_of(state.request)
        state.response_headers["X-IBEX-Session-ID"] = plan.session_id
        plan.client_messages = plan.body["messages"]
        if _DIRECTED in state.extra:  # the budget gate read it, and injected it into these same messages
            directed = state.extra[_DIRECTED]
        else:
            directive = await directives.active(caller.org_id, agent.id)
            directed = None if directive is None else (directive, inject_directive(plan.body["messages"], directive))
        if directed is not None:
            plan.directive, plan.directive_version = directed[0], directed[0].version
            # Also the fallback when context assembly degrades: directive-only context.
            plan.body["messages"] = directed[1]

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


class GenerationHandler:
    """Runs one generation request of any wire format through the shared pipeline."""

    def __init__(
        self, pipeline: GatePipeline, services: GenerationServices, embedding_pipeline: GatePipeline | None = None
    ) -> None:
        self._pipeline = pipeline
        self._embedding_pipeline = embedding_pipeline or pipeline
        self._s = services

    @property
    def gate_names(self) -> list[str]:
        """The generation gates in the order they run (docs/architecture.md lists the same)."""
        return self._pipeline.names

    async def handle(self, request: web.Request, edge: Edge = CHAT_EDGE) -> web.StreamResponse:
        """A generation request in ``edge``'s wire format."""

        async def serve(state: GateState, plan: GenerationPlan) -> web.StreamResponse:
            chat = ChatRequest(
                body=plan.body, model=plan.model.name, deadline=time.monotonic() + DEFAULT_DEADLINE,
                request_id=state.request_id,
            )  # fmt: skip
            if plan.body.get("stream") is True:
                return await relay(state, plan, chat, edge, self._s.providers, self._s.metrics, self._s.accounting)
            response = await self._complete(state, plan, chat, edge)
            if plan.claim is not None:
                await self._finalize(plan.claim, response)
            return response

        state = GateState(request, request_id_of(request), "chat", server_request_id=server_request_id_of(request))
        state.extra["edge"] = edge
        return await self._run(state, self._pipeline, edge.route, serve)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/embeddings``."""
        state = GateState(request, request_id_of(request), "chat", server_request_id=server_request_id_of(request))
        return await self._run(state, self._embedding_pipeline, "embeddings", self._embed)

    async def _run(
        self,
        state: GateState,
        pipeline: GatePipeline,
        route: str,
        serve: Callable[[GateState, GenerationPlan], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """The gates, then ``serve``; refusals release what the gates reserved; every outcome is traced."""
        accounting = self._s.accounting
        status, error_code = 500, "INTERNAL_ERROR"
        try:
            try:
                await pipeline.run(state)
            except Replay as replay:
                status = replay.stored.status
                accounting.refund_tokens(state)  # the stored answer is served again: no provider tokens this time
                return web.Response(
                    status=replay.stored.status, body=replay.stored.body,
                    headers={**replay.stored.headers, **state.response_headers, REPLAYED_HEADER: "true"},
                )  # fmt: skip
            except ServiceError as e:
                e.headers = {**state.response_headers, **e.headers}
                plan = plan_of(state)
                if plan is not None:
                    accounting.release(plan)
                    if plan.claim is not None:  # nothing ran: let a retry with the same key run again
                        accounting.background.spawn("abandon", self._s.idempotency.abandon(plan.claim))
                accounting.refund_tokens(state)  # refused after admission: retries must not burn the token window
                status, error_code = e.status, e.code
                raise
            response = await serve(state, _plan(state))
            status = response.status
            error_code = state.extra.get("error_code", "") if status >= 400 else ""
            return response
        except ServiceError as e:
            status, error_code = e.status, e.code
            raise
        finally:
            accounting.trace(state, route, status, error_code)

    def _failed(self, state: GateState, plan: GenerationPlan, e: ProviderError) -> web.Response:
        """A provider call that failed: counted, nothing served is billed, the error answered in the envelope."""
        self._s.metrics.provider_calls.labels(e.provider, e.code).inc()
        state.extra["error_code"] = e.code
        self._s.accounting.after(state, plan, None, plan.model.name)
        return provider_error_response(e, state)

    def _served(self, plan: GenerationPlan, provider: str, started: float) -> None:
        """A provider call that answered: who served it, how long it took, counted."""
        plan.provider = provider
        plan.upstream_ms = (time.perf_counter() - started) * 1000
        metrics = self._s.metrics
        metrics.gathered_counter(metrics.provider_calls, provider, "ok").inc()
        metrics.gathered_histogram(metrics.provider_seconds, provider).observe(plan.upstream_ms / 1000)

    async def _embed(self, state: GateState, plan: GenerationPlan) -> web.StreamResponse:
        request = EmbeddingRequest(
            body=plan.body, model=plan.model.name, deadline=time.monotonic() + DEFAULT_DEADLINE,
            request_id=state.request_id,
        )  # fmt: skip
        started = time.perf_counter()
        accounting = self._s.accounting
        try:
            answer = await self._s.providers.embed(request)
        except ProviderError as e:
            return self._failed(state, plan, e)
        except BaseException:
            accounting.after(state, plan, None, plan.model.name)
            raise
        self._served(plan, answer.provider, started)
        accounting.after(state, plan, answer.usage, answer.model)
        if plan.fallback_served:
            state.response_headers[FALLBACK_HEADER] = answer.model
        return web.Response(body=orjson.dumps(answer.body), content_type="application/json",
                            headers=state.response_headers)  # fmt: skip

    async def _finalize(self, claim: Claim, response: web.StreamResponse) -> None:
        """Record the answer under the idempotency key before returning it; a provider failure frees the key."""
        if response.status >= 500:
            self._s.accounting.background.spawn("abandon", self._s.idempotency.abandon(claim))
            return
        keep = {str(k): v for k, v in response.headers.items() if k in ("Content-Type", "X-IBEX-Session-ID")}
        body = response.body if isinstance(response, web.Response) and isinstance(response.body, bytes) else b""
        # Raises (503) when the claim cannot be finalized: never report success over an unfinished claim.
        await self._s.idempotency.complete(claim, StoredResponse(response.status, body, keep))

    async def _complete(self, state: GateState, plan: GenerationPlan, chat: ChatRequest, edge: Edge) -> web.Response:
        started = time.perf_counter()
        accounting = self._s.accounting
        try:
            answer = await self._s.providers.complete(chat)
        except ProviderError as e:
            return self._failed(state, plan, e)
        except BaseException:
            accounting.after(state, plan, None, plan.model.name)
            raise
        self._served(plan, answer.provider, started)
        choices = answer.body.get("choices")
        accounting.after(state, plan, answer.usage, answer.model, content_digest(choices), answer_text(choices))
        if plan.fallback_served:
            state.response_headers[FALLBACK_HEADER] = answer.model
        rendered = edge.render(answer.body, answer.usage, render_context(state, plan, answer.model))
        await keep_answer(edge, state, rendered, self._s.metrics)
        return web.Response(body=orjson.dumps(rendered), content_type="application/json",
                            headers=state.response_headers)  # fmt: skip
