"""The proxy's side of context assembly: one gRPC call to the context stage, bounded, and a degraded fallback.

After the gates (the directive is resolved and already injected into the request's messages, which is the
fallback), :func:`context_assembly` calls ``ContextAssembly/Assemble`` for agents whose ``memory.enabled`` is true,
with a principal signed for that method and a deadline no later than the request's. On success the assembled
messages replace the request's. On any failure (stage not configured, unreachable, slower than the deadline, an
error status) the request continues with the directive-only or history-only messages it already has, the response
says ``X-IBEX-Context-Degraded: true`` and the degradation is counted and traced. Authorization never changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson

from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2 as pb
from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2_grpc as pb_grpc
from ibex_dataplane.proxy.metrics import ProxyMetrics
from ibex_dataplane.proxy.repository import DirectiveRow
from ibex_dataplane.security.principal import (
    ASSEMBLE_METHOD,
    GRPC_METADATA,
    Principal,
    PrincipalSigner,
    grpc_target,
)

log = logging.getLogger(__name__)

SKIP_HEADER = "X-IBEX-Skip-Memory"


@dataclass
class ContextOutcome:
    """What context assembly did for one request, for the headers and the trace."""

    attempted: bool = False
    messages: list[dict[str, Any]] | None = None  # None: keep the request's messages (degraded or not attempted)
    memories_injected: int = 0
    context_tokens: int = 0
    degraded: bool = False
    reasons: list[str] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        if not self.attempted:
            return {}
        return {
            "X-IBEX-Memories-Injected": str(self.memories_injected),
            "X-IBEX-Context-Tokens": str(self.context_tokens),
            "X-IBEX-Context-Degraded": "true" if self.degraded else "false",
        }


_DEGRADED_BRANCH = {pb.TIMEOUT: "timeout", pb.ERROR: "error"}


class ContextClient:
    """A long-lived channel to the context stage; ``None`` target means the stage is not configured."""

    def __init__(self, target: str | None, signer: PrincipalSigner | None, *, timeout: float, metrics: ProxyMetrics):
        self._target = target
        self._signer = signer
        self._timeout = timeout
        self._metrics = metrics
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def start(self) -> None:
        if self._target:
            self._channel = grpc.aio.insecure_channel(self._target)
            self._stub = pb_grpc.ContextAssemblyStub(self._channel)  # type: ignore[no-untyped-call]
            # Start connecting now, without waiting (the stage may start after the proxy): the first request
            # should not pay for the connection under its tight deadline.
            self._channel.get_state(try_to_connect=True)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    def _degrade(self, outcome: ContextOutcome, reason: str) -> ContextOutcome:
        outcome.degraded = True
        outcome.reasons.append(reason)
        self._metrics.degradations.labels("context").inc()
        return outcome

    async def assemble(
        self,
        *,
        org_id: Any,
        agent_id: Any,
        request_id: str,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        session_id: str,
        context_tokens: int,
        max_output_tokens: int,
        skip_memory: bool,
        directive: DirectiveRow | None,
    ) -> ContextOutcome:
        outcome = ContextOutcome(attempted=True)
        if self._stub is None or self._signer is None:
            return self._degrade(outcome, "context:not_configured")
        principal = Principal(
            org_id=org_id, agent_id=agent_id, scopes=frozenset({"chat"}), request_id=request_id,
            deadline=time.time() + self._timeout, target=grpc_target(ASSEMBLE_METHOD),
        )  # fmt: skip
        request = pb.AssembleRequest(
            model=model,
            messages=[pb.Message(role=str(m.get("role", "")), json=orjson.dumps(m)) for m in messages],
            tools_json=orjson.dumps(tools) if tools else b"",
            session=pb.Session(id=session_id),
            limits=pb.Limits(context_tokens=context_tokens, max_output_tokens=max_output_tokens),
            options=pb.Options(skip_memory=skip_memory),
        )
        if directive is not None:
            request.directive.CopyFrom(
                pb.Directive(version=directive.version, content=directive.content,
                             injection_mode=directive.injection_mode)
            )  # fmt: skip
        metadata = ((GRPC_METADATA, self._signer.sign(principal)),)
        try:
            response = await self._stub.Assemble(request, timeout=self._timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            reason = "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name.lower()
            log.warning("context assembly degraded (request_id=%s): %s", request_id, code.name)
            return self._degrade(outcome, f"context:{reason}")
        try:
            outcome.messages = [orjson.loads(m.json) for m in response.messages]
        except orjson.JSONDecodeError:
            return self._degrade(outcome, "context:malformed")
        outcome.memories_injected = len(response.memories)
        outcome.context_tokens = response.tokens.total
        for branch in response.branches:
            if branch.status in _DEGRADED_BRANCH:
                self._degrade(outcome, f"context.{branch.name}:{_DEGRADED_BRANCH[branch.status]}")
        return outcome
