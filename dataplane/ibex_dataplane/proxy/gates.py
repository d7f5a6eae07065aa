"""The gates of the protected path (section 6.1), as small named steps run in order by :class:`GatePipeline`.

Each gate reads and fills one :class:`GateState`, and either passes or raises :class:`ApiError`. The pipeline
times every gate, counts its outcome, and turns a store outage inside any gate into 503 ``SERVICE_DEGRADED``
(every gate here fails closed). No provider is ever called unless every gate passed.

Order: body limit -> content type -> bearer key -> agent binding -> policy snapshot -> rate limit -> request
validation -> budget hold -> directive + session. The first five are shared by every protected route; the chat
routes add the rest (see :mod:`ibex_dataplane.proxy.generation`).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from ibex_dataplane.proxy.auth import Caller, KeyValidator, require_scope
from ibex_dataplane.proxy.metrics import ProxyMetrics
from ibex_dataplane.proxy.policy import PolicyService, PolicySnapshot
from ibex_dataplane.proxy.ratelimit import RateLimiter, RateLimits
from ibex_dataplane.proxy.repository import AgentPolicy
from ibex_dataplane.shared.errors import ApiError
from ibex_dataplane.store.errors import StoreUnavailable

AGENT_HEADER = "X-IBEX-Agent-ID"
SESSION_HEADER = "X-IBEX-Session-ID"
SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass
class GateState:
    """Everything the gates learn about one request, in the order they learn it."""

    request: web.Request
    request_id: str  # the client's X-Request-ID when it sent a valid one: for correlation only
    scope: str
    started: float = field(default_factory=time.perf_counter)
    raw_body: bytes = b""
    caller: Caller | None = None
    policy: PolicySnapshot | None = None
    agent: AgentPolicy | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    server_request_id: str = ""  # unique per request: budget holds and the ledger key on it
    timings: dict[str, float] = field(default_factory=dict)  # gate name -> milliseconds
    # Filled by route-specific gates:
    extra: dict[str, Any] = field(default_factory=dict)

    _json: Any = None
    _json_parsed: bool = False
    _json_error: bool = False

    def json(self) -> Any:
        """The parsed body, or raises 400 INVALID_JSON (parsed once)."""
        if not self._json_parsed:
            self._json_parsed = True
            try:
                self._json = orjson.loads(self.raw_body) if self.raw_body else None
            except orjson.JSONDecodeError:
                self._json_error = True
        if self._json_error:
            raise ApiError(400, "INVALID_JSON", "the request body is not valid JSON")
        if self._json is None:
            raise ApiError(400, "INVALID_JSON", "a JSON request body is required")
        return self._json

    def json_or_none(self) -> Any:
        try:
            return self.json()
        except ApiError:
            return None

    def require_caller(self) -> Caller:
        assert self.caller is not None, "authenticate gate did not run"
        return self.caller

    def require_agent(self) -> tuple[PolicySnapshot, AgentPolicy]:
        assert self.policy is not None and self.agent is not None, "binding gate did not run"
        return self.policy, self.agent


Gate = Callable[[GateState], Awaitable[None]]


class GatePipeline:
    def __init__(self, gates: Sequence[tuple[str, Gate]], metrics: ProxyMetrics) -> None:
        self._metrics = metrics
        self._gates = [
            (name, gate, metrics.gathered_histogram(metrics.gate_seconds, name),
             metrics.gathered_counter(metrics.gate_outcomes, name, "pass"))
            for name, gate in gates
        ]  # fmt: skip

    @property
    def names(self) -> list[str]:
        return [name for name, *_ in self._gates]

    async def run(self, state: GateState) -> None:
        timings = state.timings
        clock = time.perf_counter
        for name, gate, timer, passed in self._gates:
            started = clock()
            try:
                await gate(state)
            except ApiError as e:
                self._metrics.gate_outcomes.labels(name, e.code).inc()
                raise
            except StoreUnavailable as e:
                self._metrics.gate_outcomes.labels(name, "SERVICE_DEGRADED").inc()
                raise ApiError(
                    503,
                    "SERVICE_DEGRADED",
                    f"a required store is unavailable ({e.store})",
                    headers={"Retry-After": "1"},
                ) from e
            finally:
                elapsed = clock() - started
                timer.observe(elapsed)
                timings[name] = elapsed * 1000
            passed.inc()


# -- shared gates ----------------------------------------------------------------------------------------------


def body_limit(max_bytes: int) -> Gate:
    async def gate(state: GateState) -> None:
        request = state.request
        declared = request.content_length
        if declared is not None and declared > max_bytes:
            raise ApiError(413, "PAYLOAD_TOO_LARGE", f"the request body exceeds {max_bytes} bytes")
        try:
            state.raw_body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, "PAYLOAD_TOO_LARGE", f"the request body exceeds {max_bytes} bytes") from None
        if len(state.raw_body) > max_bytes:
            raise ApiError(413, "PAYLOAD_TOO_LARGE", f"the request body exceeds {max_bytes} bytes")

    return gate


async def json_content_type(state: GateState) -> None:
    if not state.raw_body:  # nothing to interpret (GET, DELETE, a bodiless POST such as terminate)
        return
    ctype = state.request.content_type
    if ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
        raise ApiError(415, "UNSUPPORTED_MEDIA_TYPE", "the request body must be application/json")


def authenticate(keys: KeyValidator) -> Gate:
    async def gate(state: GateState) -> None:
        headers = state.request.headers
        authorization = headers.get("Authorization")
        if authorization is None and headers.get("X-Api-Key"):  # how the anthropic SDK sends its key
            authorization = f"Bearer {headers['X-Api-Key']}"
        caller = await keys.authenticate(authorization)
        if state.scope != "any":
            require_scope(caller, state.scope)
        state.caller = caller

    return gate


def bind_agent(policies: PolicyService) -> Gate:
    """The agent named by X-IBEX-Agent-ID (id or name) must be in the key's org and one of the key's agents."""

    async def gate(state: GateState) -> None:
        caller = state.require_caller()
        ident = state.request.headers.get(AGENT_HEADER, "").strip()
        if not ident:
            raise ApiError(400, "MISSING_AGENT_ID", f"the {AGENT_HEADER} header is required")
        snapshot = await policies.snapshot(caller.org_id)
        if snapshot is None:
            raise ApiError(401, "INVALID_TOKEN", "the API key's organization no longer exists")
        agent = snapshot.find_agent(ident)
        if agent is None or agent.id not in caller.agent_ids:
            raise ApiError(403, "AGENT_NOT_AUTHORIZED", "this API key may not act as that agent")
        state.policy, state.agent = snapshot, agent

    return gate


async def tenant_status(state: GateState) -> None:
    """Suspension of the org or the agent (the model part of the policy gate is route-specific)."""
    policy, agent = state.require_agent()
    if policy.suspended:
        raise ApiError(403, "ORG_SUSPENDED", "the organization is suspended")
    if agent.suspended:
        raise ApiError(403, "AGENT_SUSPENDED", "the agent is suspended")


def request_rate_limit(limiter: RateLimiter) -> Gate:
    """Requests-per-minute tiers (agent and org) for routes that spend no model tokens, e.g. the memory routes."""

    async def gate(state: GateState) -> None:
        policy, agent = state.require_agent()
        limits = RateLimits(agent_rpm=agent.rpm, agent_tpm=None, org_rpm=policy.rpm, org_tpm=None)
        decision = await limiter.admit(policy.org_id, agent.id, limits, 0)
        state.response_headers.update(decision.headers())
        if not decision.allowed:
            raise ApiError(429, "RATE_LIMITED", "rate limit exceeded", headers=decision.headers())

    return gate


def session_id_of(request: web.Request) -> str:
    supplied = request.headers.get(SESSION_HEADER)
    if supplied is None or supplied == "":
        return f"sess_{secrets.token_hex(16)}"  # 128 random bits, as a uuid4 has 122
    if not SESSION_ID.fullmatch(supplied):
        raise ApiError(
            400, "VALIDATION_ERROR", "invalid session id",
            field_errors=[{"field": f"header {SESSION_HEADER}", "message": "must match ^[A-Za-z0-9._:-]{1,128}$"}],
        )  # fmt: skip
    return supplied
